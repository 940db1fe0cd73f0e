"""vLLM's own suffix proposer running on `agentspec.compat.SuffixDecodingCache`.

vLLM's ``SuffixDecodingProposer`` (``vllm/v1/spec_decode/suffix_decoding.py``)
imports ``arctic_inference.suffix_decoding.SuffixDecodingCache``.  Here a
test-only shim module of that name, whose ``SuffixDecodingCache`` is ours, is
put into ``sys.modules`` (with monkeypatch, only for these tests), and the
unmodified proposer is driven the way vLLM's V1 model runner drives it:

- a real ``VllmConfig`` (``method="suffix"``, a ``ModelConfig`` read from a
  config-only model folder with ``max_model_len=600``);
- a real ``InputBatch`` (numpy int32 ``token_ids_cpu`` / ``num_tokens_no_spec``
  / ``num_prompt_tokens``), filled with ``add_request`` /
  ``remove_request`` / ``condense`` / ``update_req_spec_token_ids`` and the
  runner's bookkeeping of sampled tokens;
- greedy verification: a step accepts the longest prefix of the previous
  draft that matches the request's predetermined output, plus one token.

Requests are Spider text-to-SQL prompts tokenized with Qwen3 (synthetic
repetitive sequences when the shared data is absent), with outputs that run
into ``max_model_len``.  The proposer computes ``max_spec_tokens`` as
``min(num_speculative_tokens, max_model_len - num_tokens - 1)`` with
``num_tokens`` a numpy int32 read from the input batch; before the compat
class accepted numpy integers this raised ``TypeError: max_spec_tokens must
be an int or None, not int32`` as soon as a request came within
``num_speculative_tokens`` tokens of the limit.

The bound checked is the scheduler's: a step schedules at most
``max_model_len - num_computed_tokens - 1`` tokens (the sampled one and the
drafts), so ``num_tokens + len(draft) <= max_model_len - 1``; the runner
asserts ``end_idx <= max_model_len`` when it writes accepted tokens.
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prereq import require_module
from vllm_engines import requires_vllm

from agentspec.compat import SuffixDecodingCache

pytestmark = [pytest.mark.vllm, requires_vllm]

MAX_MODEL_LEN = 600
MAX_NUM_REQS = 4
QWEN3_VOCAB = 151936
SHARED = Path(__file__).resolve().parents[4] / "shared" / "data"
SPIDER = SHARED / "traces" / "spider-sql.dev.jsonl.gz"
QWEN3 = SHARED / "tokenizers" / "qwen3" / "tokenizer.json"


# --- vLLM objects ---------------------------------------------------------------------


def _clear_arctic_probe() -> None:
    """Forget vLLM's cached "is arctic_inference importable" answer."""
    from vllm.utils import import_utils

    import_utils._has_module.cache_clear()


@pytest.fixture
def arctic_shim(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``arctic_inference.suffix_decoding.SuffixDecodingCache`` is ours, for this test only."""
    package = types.ModuleType("arctic_inference")
    package.__spec__ = importlib.machinery.ModuleSpec("arctic_inference", None, is_package=True)
    package.__path__ = []
    module = types.ModuleType("arctic_inference.suffix_decoding")
    module.__spec__ = importlib.machinery.ModuleSpec("arctic_inference.suffix_decoding", None)
    module.SuffixDecodingCache = SuffixDecodingCache  # type: ignore[attr-defined]
    package.suffix_decoding = module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "arctic_inference", package)
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", module)
    _clear_arctic_probe()
    yield
    _clear_arctic_probe()


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real ``ModelConfig`` with ``max_model_len=600``, from a config-only folder."""
    from vllm.config import ModelConfig

    folder = tmp_path_factory.mktemp("model")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": QWEN3_VOCAB,
        "max_position_embeddings": 2048,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return ModelConfig(
        model=str(folder), max_model_len=MAX_MODEL_LEN, dtype="float32", skip_tokenizer_init=True
    )


def _proposer(model_config: Any, **spec: Any) -> Any:
    """vLLM's ``SuffixDecodingProposer`` for a ``VllmConfig`` with ``method="suffix"``."""
    from vllm.config import SpeculativeConfig, VllmConfig
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    vllm_config = VllmConfig(
        model_config=model_config,
        speculative_config=SpeculativeConfig(method="suffix", **spec),
    )
    proposer = SuffixDecodingProposer(vllm_config)
    assert isinstance(proposer.suffix_cache, SuffixDecodingCache)
    assert proposer.max_model_len == MAX_MODEL_LEN
    return proposer


# --- workload -------------------------------------------------------------------------


def _workload() -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, output) token arrays; most outputs run into ``max_model_len``.

    Spider requests (Qwen3 tokens): a third end after their true response;
    the others continue with the text of the following requests (same
    schemas, so long suffix matches) up to ``max_model_len``.
    """
    if SPIDER.is_file() and QWEN3.is_file():
        require_module("tokenizers")
        from agentspec.bench.replay import load_tokenizer, load_trace

        requests = load_trace(SPIDER, load_tokenizer(QWEN3), max_sessions=8).requests
        pairs = []
        for j, req in enumerate(requests):
            prompt = req.prompt()
            room = MAX_MODEL_LEN - len(prompt)
            assert room > 1
            if j % 3 == 2:
                output = req.response
            else:
                parts = [req.response]
                for later in requests[j + 1 :] + requests[:j]:
                    parts += [later.prompt(), later.response]
                output = np.concatenate(parts)[:room]
            pairs.append((prompt, output.astype(np.int32)))
        return pairs
    # Deterministic synthetic text: a few repeated "sentences" with small variations.
    rng = np.random.default_rng(0)
    sentences = [rng.integers(10, 5000, size=int(n), dtype=np.int32) for n in (7, 11, 13, 17)]
    pairs = []
    for j in range(16):
        prompt = np.concatenate([sentences[(j + k) % 4] for k in range(6 + j % 5)])
        body = [sentences[int(i)] for i in rng.integers(0, 4, size=80)]
        output = np.concatenate(body)[: MAX_MODEL_LEN - len(prompt)]
        if j % 3 == 2:
            output = output[:40]
        pairs.append((prompt, output))
    return pairs


# --- the runner -----------------------------------------------------------------------


class Runner:
    """The parts of vLLM's V1 model runner and scheduler around the proposer."""

    def __init__(self, proposer: Any, num_spec: int) -> None:
        import torch
        from vllm.v1.worker.gpu_input_batch import InputBatch

        self.proposer = proposer
        self.num_spec = num_spec
        self.batch = InputBatch(
            max_num_reqs=MAX_NUM_REQS,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=2048,
            device=torch.device("cpu"),
            vocab_size=QWEN3_VOCAB,
            block_sizes=[16],
            max_num_blocks_per_req=[-(-MAX_MODEL_LEN // 16)],
            num_spec_tokens=num_spec,
        )
        self.states: dict[str, Any] = {}
        self.outputs: dict[str, np.ndarray] = {}
        self.drafts: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.stats = dict.fromkeys(
            ("steps", "drafted", "accepted", "at_limit", "near_limit", "capped"), 0
        )

    def add(self, req_id: str, prompt: np.ndarray, output: np.ndarray) -> None:
        from vllm import SamplingParams
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        state = CachedRequestState(
            req_id=req_id,
            prompt_token_ids=prompt.tolist(),
            mm_features=[],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN),
            generator=None,
            block_ids=([],),
            num_computed_tokens=0,
            output_token_ids=[],
        )
        self.states[req_id] = state
        self.outputs[req_id] = output
        self.batch.add_request(state)

    def step(self) -> None:
        """Verify the last drafts, book the sampled tokens, propose, check the drafts."""
        batch = self.batch
        sampled: list[list[int]] = []
        for i, req_id in enumerate(batch.req_ids):
            state = self.states[req_id]
            output = self.outputs[req_id]
            done = len(state.output_token_ids)
            draft = self.drafts.pop(req_id, [])
            accepted = 0
            while (
                accepted < len(draft)
                and done + accepted < len(output)
                and draft[accepted] == output[done + accepted]
            ):
                accepted += 1
            new = output[done : done + accepted + 1].tolist()  # accepted + bonus/correction
            self.stats["accepted"] += accepted
            # The runner's bookkeeping (_bookkeeping_sync).
            start = int(batch.num_tokens_no_spec[i])
            end = start + len(new)
            assert end <= MAX_MODEL_LEN, f"{req_id}: {end} tokens > max_model_len"
            batch.token_ids_cpu[i, start:end] = new
            batch.is_token_ids[i, start:end] = True
            batch.num_tokens_no_spec[i] = end
            state.output_token_ids.extend(new)
            state.num_computed_tokens = end - 1
            sampled.append(new)
            # The scheduler's check_stop: the output's end (EOS) or the length cap.
            if len(state.output_token_ids) >= len(output) or end >= MAX_MODEL_LEN:
                self.finished.add(req_id)
        drafts = self.proposer.propose(self.num_spec, batch, sampled)
        assert len(drafts) == len(batch.req_ids)
        scheduled: dict[str, list[int]] = {}
        for i, (req_id, draft) in enumerate(zip(batch.req_ids, drafts, strict=True)):
            num_tokens = int(batch.num_tokens_no_spec[i])
            assert all(type(t) is int for t in draft)
            assert len(draft) <= self.num_spec
            if num_tokens >= MAX_MODEL_LEN:  # finished at the cap this step
                assert draft == []
                self.stats["at_limit"] += 1
                continue
            # The scheduler's cap: 1 sampled + drafts <= max_model_len - num_computed_tokens - 1.
            assert num_tokens + len(draft) <= MAX_MODEL_LEN - 1, (req_id, num_tokens, len(draft))
            if MAX_MODEL_LEN - num_tokens - 1 < self.num_spec:
                self.stats["near_limit"] += 1
                if draft and len(draft) == MAX_MODEL_LEN - num_tokens - 1:
                    self.stats["capped"] += 1  # the draft ends right at the bound
            self.stats["drafted"] += len(draft)
            if req_id not in self.finished and draft:
                scheduled[req_id] = draft
                self.drafts[req_id] = draft
        for req_id, state in self.states.items():
            if req_id not in self.finished and req_id in batch.req_id_to_index:
                batch.update_req_spec_token_ids(state, scheduled)
        self.stats["steps"] += 1

    def run(self, workload: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Serve every request, at most MAX_NUM_REQS at a time, then a last empty step."""
        waiting = [(f"req-{j}", p, o) for j, (p, o) in enumerate(workload)]
        while waiting or self.batch.req_ids:
            # _update_states: drop finished requests, add new ones, condense, refresh.
            for req_id in sorted(self.finished & set(self.batch.req_id_to_index)):
                self.batch.remove_request(req_id)
            while waiting and len(self.batch.req_id_to_index) < MAX_NUM_REQS:
                self.add(*waiting.pop(0))
            self.batch.condense()
            self.batch.refresh_metadata()
            if self.batch.req_ids:
                self.step()
        # The step after the last request finished: the proposer stops it.
        assert self.proposer.propose(self.num_spec, self.batch, []) == []


# --- tests ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        {"num_speculative_tokens": 24},  # vLLM's defaults: depth 24, 10000 requests, 1.0, 0.1
        {
            "num_speculative_tokens": 32,
            "suffix_decoding_max_tree_depth": 64,
            "suffix_decoding_max_cached_requests": 3,
            "suffix_decoding_max_spec_factor": 4.0,
            "suffix_decoding_min_token_prob": 0.0,
        },
    ],
    ids=["defaults", "deep-eager"],
)
def test_builtin_proposer_respects_max_model_len(
    arctic_shim: None, model_config: Any, spec: dict[str, Any]
) -> None:
    """vLLM's SuffixDecodingProposer on our cache: no exception, drafts within max_model_len."""
    proposer = _proposer(model_config, **spec)
    runner = Runner(proposer, spec["num_speculative_tokens"])
    workload = _workload()
    runner.run(workload)
    stats = runner.stats
    cache = proposer.suffix_cache
    assert runner.finished == set(runner.states)
    assert len(runner.states) == len(workload)
    for req_id, state in runner.states.items():  # greedy decoding: the outputs are exact
        assert state.output_token_ids == runner.outputs[req_id].tolist()
    assert stats["at_limit"] > 0  # requests ran into max_model_len,
    assert stats["near_limit"] > 0  # were drafted for within num_speculative_tokens of it,
    assert stats["capped"] > 0  # with drafts ending right at the bound,
    assert stats["accepted"] > stats["steps"]  # and drafting was useful on the way
    assert list(cache.active_requests) == []
    limit = spec.get("suffix_decoding_max_cached_requests", 10000)
    assert 0 < len(cache.cached_requests) <= limit
