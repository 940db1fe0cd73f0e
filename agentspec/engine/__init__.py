"""Embedded engine pieces: verifying drafts with a real causal LM on CPU.

- `Verifier`: one forward pass per step over the pending token and a draft
  (chain or tree, custom 4D mask), greedy or lossless sampling acceptance,
  KV cache kept in step with the committed tokens.
- `generate_greedy`: the decode loop with a drafter callback (see
  `speculator_drafter` for drafts from an `agentspec.Speculator`).
- `accept_sampling`, `branch_probabilities`, `target_probs`: the speculative
  sampling rule for point-mass drafts, as pure numpy functions.

Needs the ``local`` extra (torch, transformers); see `agentspec.models` for
the default model.
"""

from agentspec.engine._draft_tree import DraftLike, DraftTree, as_draft_tree
from agentspec.engine._generate import (
    Drafter,
    GenerateResult,
    SpeculatorDrafter,
    StepStats,
    generate_greedy,
    speculator_drafter,
)
from agentspec.engine._sampling import (
    SamplingParams,
    accept_sampling,
    branch_probabilities,
    target_probs,
)
from agentspec.engine._verify import DraftInput, Verifier

__all__ = [
    "DraftInput",
    "DraftLike",
    "DraftTree",
    "Drafter",
    "GenerateResult",
    "SamplingParams",
    "SpeculatorDrafter",
    "StepStats",
    "Verifier",
    "accept_sampling",
    "as_draft_tree",
    "branch_probabilities",
    "generate_greedy",
    "speculator_drafter",
    "target_probs",
]
