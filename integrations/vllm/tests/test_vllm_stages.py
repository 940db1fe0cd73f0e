"""Stage and tenant isolation, and pushed shards, on real vLLM.

Acceptance is read from vLLM's own spec-decode counters
(``vllm:spec_decode_num_draft_tokens`` / ``..._num_accepted_tokens``): each
batch runs alone, so the counters' change over a batch is that batch's.
After stage A learned its outputs, the same prompts in stage A accept far
more tokens; in another pipeline/stage, or another tenant, they accept no
more than before (they cannot see A's shard); a shard pushed through the
worker extension helps exactly the stage it was pushed for.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_engines import QUESTIONS, chat_ids, extract_prompt, requires_vllm, spec_counters

from agentspec import SuffixTree
from agentspec._push.wire import SHARD_CONTENT_TYPE, SNAPSHOT_PATH, encode_key_query

pytestmark = [pytest.mark.vllm, requires_vllm]

PROMPTS = [extract_prompt(*q) for q in QUESTIONS[:6]]


def _tags(tenant: str, pipeline: str, stage: str) -> dict[str, str]:
    return {
        "agentspec_tenant": tenant,
        "agentspec_pipeline": pipeline,
        "agentspec_stage": stage,
        "agentspec_session": "s1",
    }


def _run(llm: Any, tags: dict[str, str]) -> tuple[int, list[list[int]]]:
    """Accepted draft tokens over one batch of PROMPTS, and its outputs."""
    before = spec_counters(llm)
    outputs = chat_ids(llm, PROMPTS, tags=tags)
    after = spec_counters(llm)
    return after[1] - before[1], outputs


def _stats(llm: Any) -> dict[tuple[str, str | None, str | None], dict[str, Any]]:
    (worker,) = llm.collective_rpc("agentspec_stats")
    return {(e["tenant"], e["pipeline"], e["stage"]): e for e in worker["proposer"]["keys"]}


def test_learning_helps_its_stage_only(spec_llm: Any) -> None:
    a_first, outputs = _run(spec_llm, _tags("t1", "iso", "A"))
    b, b_outputs = _run(spec_llm, _tags("t1", "iso-other", "B"))
    tenant, t_outputs = _run(spec_llm, _tags("t2", "iso", "A"))
    a_again, a_outputs = _run(spec_llm, _tags("t1", "iso", "A"))
    assert outputs == b_outputs == t_outputs == a_outputs  # greedy: the tags change nothing
    total = sum(len(o) for o in outputs)
    print(
        f"\naccepted tokens of {total} generated: stage A first {a_first}, "
        f"stage B after A learned {b}, tenant t2 stage A {tenant}, stage A again {a_again}"
    )
    assert a_again >= a_first + total // 3
    assert a_again >= total // 2
    # Without A's shard, B and the other tenant draft like A's first round.
    assert b <= a_first + total // 20
    assert tenant <= a_first + total // 20
    stats = _stats(spec_llm)
    # The worker hears of a finished request at the next engine step, so the
    # requests that finished last may not be learned yet; the first round's are.
    assert len(PROMPTS) <= stats[("t1", "iso", "A")]["learned"] <= 2 * len(PROMPTS)
    assert stats[("t1", "iso", "A")]["requests"] == 2 * len(PROMPTS)
    assert stats[("t2", "iso", "A")]["requests"] == len(PROMPTS)


def test_pushed_shard_helps_its_stage(spec_llm: Any) -> None:
    cold, outputs = _run(spec_llm, _tags("t3", "push", "P"))
    # Push those outputs (behind the generation prompt's tokens) as the shard of stage Q
    # of another pipeline (P's pipeline tree would otherwise serve Q too).
    tokenizer = spec_llm.get_tokenizer()
    lead = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    tree = SuffixTree(64)
    for i, out in enumerate(outputs, start=1):
        tree.add(i, lead + out)
    snapshot = bytes(tree.to_bytes())
    tree.close()
    query = encode_key_query(("t3", "push-q", "Q"))
    headers = {"Content-Type": SHARD_CONTENT_TYPE}
    ((status, _, body),) = spec_llm.collective_rpc(
        "agentspec_handle", args=("PUT", SNAPSHOT_PATH, query, headers, snapshot)
    )
    assert status == 200, body
    pushed, q_outputs = _run(spec_llm, _tags("t3", "push-q", "Q"))
    elsewhere, _ = _run(spec_llm, _tags("t4", "push-q", "Q"))
    total = sum(len(o) for o in outputs)
    print(
        f"\naccepted tokens of {total}: stage P cold {cold}, stage Q with pushed shard "
        f"{pushed}, tenant t4 stage Q {elsewhere}"
    )
    assert q_outputs == outputs
    assert pushed >= cold + total // 3
    assert elsewhere <= cold + total // 20
    stats = _stats(spec_llm)
    assert stats[("t3", "push-q", "Q")]["sources"].get("extra", 0) > 0
