"""Embedded engine pieces: verifying drafts with a real causal LM on CPU.

- `Verifier`: one forward pass per step over the pending token and a draft
  (chain or tree, custom 4D mask), greedy or lossless sampling acceptance,
  KV cache kept in step with the committed tokens.
- `generate_greedy`: the decode loop with a drafter callback (see
  `speculator_drafter` for drafts from an `agentspec.Speculator`).
- `accept_sampling`, `branch_probabilities`, `target_probs`: the speculative
  sampling rule for point-mass drafts, as pure numpy functions
  (`effective_temperature`: tiny temperatures are greedy or clamped, as in vLLM).
- `as_draft_tree` / `prune_draft_tree`: validate a draft (the latter drops
  tokens outside the vocabulary and what follows them).
- `optimize_for_cpu`: packs a CPU model's linear layers for oneDNN and keeps
  grouped attention heads grouped, so verifying a few draft tokens costs about
  a plain decode step (the `Engine` does it unless ``cpu_kernels=False``).
- `Engine`: runs requests one at a time with drafts from learned stage shards
  (and shards pushed to it); `EngineServer` / `run_engine_server`: its
  OpenAI-compatible HTTP server (``agentspec serve`` without vLLM).

Needs the ``local`` extra (torch, transformers); see `agentspec.models` for
the default model.
"""

from agentspec.engine._chat import TextDecoder, render_chat
from agentspec.engine._cpu_kernels import CpuKernels, optimize_for_cpu
from agentspec.engine._draft_tree import DraftLike, DraftTree, as_draft_tree, prune_draft_tree
from agentspec.engine._engine import (
    Completion,
    Engine,
    EngineOptions,
    GenerationCancelledError,
    GenerationRequest,
    SpecStats,
    TextDelta,
)
from agentspec.engine._generate import (
    Drafter,
    GenerateResult,
    SpeculatorDrafter,
    StepStats,
    generate_greedy,
    speculator_drafter,
)
from agentspec.engine._sampling import (
    MIN_TEMPERATURE,
    SAMPLING_EPS,
    SamplingParams,
    accept_sampling,
    branch_probabilities,
    effective_temperature,
    target_probs,
)
from agentspec.engine._server import EngineServer, default_threads, run_engine_server
from agentspec.engine._verify import DraftInput, Verifier

__all__ = [
    "MIN_TEMPERATURE",
    "SAMPLING_EPS",
    "Completion",
    "CpuKernels",
    "DraftInput",
    "DraftLike",
    "DraftTree",
    "Drafter",
    "Engine",
    "EngineOptions",
    "EngineServer",
    "GenerateResult",
    "GenerationCancelledError",
    "GenerationRequest",
    "SamplingParams",
    "SpecStats",
    "SpeculatorDrafter",
    "StepStats",
    "TextDecoder",
    "TextDelta",
    "Verifier",
    "accept_sampling",
    "as_draft_tree",
    "branch_probabilities",
    "default_threads",
    "effective_temperature",
    "generate_greedy",
    "optimize_for_cpu",
    "prune_draft_tree",
    "render_chat",
    "run_engine_server",
    "speculator_drafter",
    "target_probs",
]
