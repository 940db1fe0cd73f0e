"""Byte budgets of learned shards: `Speculator` (per tenant) and `LearnedBudget` (in total).

The review: "serve never sets max_shard_tokens, so learned shards are
unbounded too".  Learned shards now evict their oldest sequences, first in
first out, at a byte budget per tenant and a total shared by every tenant;
the counters move and the accounting equals the trees' live bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from prereq import require_module

from agentspec import Speculator, SuffixTree
from agentspec._core.budget import LearnedBudget, live_bytes
from agentspec.exceptions import InvalidArgumentError


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 32000, n)]


def trees_of(spec: Speculator) -> list[SuffixTree]:
    return [s.tree for s in (*spec._stages.values(), *spec._pipelines.values())]


def assert_exact(spec: Speculator) -> None:
    """The speculator's accounting equals its trees' live bytes."""
    assert spec.memory()["bytes"] == sum(live_bytes(t.stats()) for t in trees_of(spec))


def test_tenant_budget_evicts_the_oldest_first_and_counts() -> None:
    spec = Speculator(16, max_bytes=60_000)
    added = []
    for i in range(40):
        seq = tokens(200, i)
        spec.add_response(seq, stage="S", pipeline="p")
        added.append(seq)
        assert spec.memory()["bytes"] <= 60_000
        assert_exact(spec)
    mem = spec.memory()
    assert mem["evicted_sequences"] > 0
    assert mem["evicted_bytes"] > 0
    shard = spec.shard(stage="S", pipeline="p")
    assert shard is not None
    kept = [shard.sequence(i) for i in shard.sequence_ids()]
    assert kept == added[len(added) - len(kept) :]  # the newest ones, in order
    assert 0 < len(kept) < 40


def test_pipeline_tree_and_stage_shards_share_the_budget_by_arrival() -> None:
    spec = Speculator(16, max_bytes=80_000)
    for i in range(30):
        spec.add_response(tokens(150, i), stage=f"S{i % 3}", pipeline="p")
        assert spec.memory()["bytes"] <= 80_000
        assert_exact(spec)
    pipe = spec.pipeline_tree("p")
    assert pipe is not None
    ids = pipe.sequence_ids()
    assert ids == sorted(ids)  # oldest first: the pipeline tree evicts by arrival too
    # every stage still holds its newest response
    for s in range(3):
        tree = spec.shard(stage=f"S{s}", pipeline="p")
        assert tree is not None
        assert max(tree.sequence_ids(), default=-1) >= 27


def test_a_response_larger_than_the_budget_does_not_stay() -> None:
    spec = Speculator(16, max_bytes=5_000)
    spec.add_response(tokens(2_000, 1), stage="S")
    assert spec.memory()["bytes"] <= 5_000
    assert spec.memory()["evicted_sequences"] >= 1
    assert_exact(spec)


def test_open_sequences_are_never_evicted_and_go_once_closed() -> None:
    spec = Speculator(16, live=True, max_bytes=30_000, pipeline_tree=False)
    spec.start_request("r", [1, 2, 3], stage="S")
    spec.extend("r", tokens(3_000, 2))  # far over the budget, but open
    tree = spec.shard(stage="S")
    assert tree is not None
    assert len(tree.sequence_ids()) == 1
    assert spec.memory()["evicted_sequences"] == 0
    spec.finish("r")
    assert spec.memory()["bytes"] <= 30_000
    assert spec.memory()["evicted_sequences"] == 1
    assert_exact(spec)


def test_token_budget_evictions_are_counted_too() -> None:
    spec = Speculator(16, max_shard_tokens=500, max_bytes=10**9)
    for i in range(10):
        spec.add_response(tokens(200, i), stage="S")
    assert spec.memory()["evicted_sequences"] > 0
    assert spec.memory()["tokens"] <= 500
    assert_exact(spec)


def test_total_budget_is_shared_first_in_first_out_across_tenants() -> None:
    budget = LearnedBudget(100_000)
    a = Speculator(16, budget=budget)
    b = Speculator(16, budget=budget)
    for i in range(12):
        a.add_response(tokens(150, i), stage="S")
    a_before = a.memory()["bytes"]
    assert budget.bytes == a_before
    for i in range(40):
        b.add_response(tokens(150, 100 + i), stage="S")
        assert budget.bytes <= 100_000
        assert budget.bytes == a.memory()["bytes"] + b.memory()["bytes"]
    # b's arrivals pushed a's older responses out first
    assert a.memory()["evicted_sequences"] > 0
    assert a.memory()["bytes"] < a_before
    assert_exact(a)
    assert_exact(b)
    a.close()
    assert budget.bytes == b.memory()["bytes"]
    assert list(budget.members()) == [b]


def test_memory_without_a_budget_reads_the_trees() -> None:
    spec = Speculator(16)
    spec.add_response(tokens(100, 1), stage="S")
    mem = spec.memory()
    assert mem["max_bytes"] is None
    assert mem["bytes"] == sum(live_bytes(t.stats()) for t in trees_of(spec)) > 0
    assert mem["evicted_sequences"] == 0


def test_bad_budget_arguments() -> None:
    with pytest.raises(InvalidArgumentError):
        Speculator(16, max_bytes=-1)
    with pytest.raises(TypeError, match="LearnedBudget"):
        Speculator(16, budget=object())  # type: ignore[arg-type]
    assert Speculator(16, max_bytes="1MiB").memory()["max_bytes"] == 1 << 20


# --- the embedded engine ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    """A one-layer random Llama (vocabulary 512) and SmolLM2's tokenizer: fast requests."""
    torch = require_module("torch")
    transformers = require_module("transformers")
    from agentspec.models import ensure_default_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(cfg)
    tok = transformers.AutoTokenizer.from_pretrained(ensure_default_model())
    return model, tok


def _run(engine: Any, tenant: str, i: int) -> None:
    from agentspec.engine import GenerationRequest

    req = GenerationRequest(
        prompt_ids=[10 + i % 200, 20, 30, 40 + i % 100],
        max_tokens=24,
        key=(tenant, "p", f"s{i % 3}"),
    )
    for _ in engine.generate(req):
        pass


def test_engine_learned_shards_evict_at_their_budgets(tiny: tuple[Any, Any]) -> None:
    from agentspec.engine import Engine, EngineOptions

    opts = EngineOptions(max_tenant_learned_bytes=20_000, max_learned_bytes=30_000)
    engine = Engine(*tiny, opts)
    try:
        for i in range(12):
            _run(engine, "a", i)
            stats = engine.learned_stats()
            assert stats["tenants"]["a"]["bytes"] <= 20_000
        moved = stats["tenants"]["a"]["evicted_sequences"]
        assert moved > 0
        assert stats["tenants"]["a"]["evicted_bytes"] > 0
        for i in range(12):
            _run(engine, "b", 50 + i)
            stats = engine.learned_stats()
            assert stats["bytes"] <= 30_000
            assert stats["bytes"] == sum(t["bytes"] for t in stats["tenants"].values())
        # the total is shared: b's responses evicted more of a's
        assert stats["tenants"]["a"]["evicted_sequences"] > moved
        assert stats["max_bytes"] == 30_000
        assert stats["max_tenant_bytes"] == 20_000
    finally:
        engine.close()
    assert engine.learned_budget.bytes == 0


def test_engine_drafts_and_intake_know_the_vocabulary(tiny: tuple[Any, Any]) -> None:
    import json

    from agentspec._push.wire import (
        SHARD_CONTENT_TYPE,
        SHARDS_PATH,
        SNAPSHOT_PATH,
        encode_key_query,
    )
    from agentspec.engine import EngineOptions, EngineServer

    opts = EngineOptions(
        max_shard_bytes="2MiB", max_tenant_shard_bytes=100_000, max_body_bytes=4096
    )
    server = EngineServer.create(*tiny, opts)
    try:
        assert server.engine.draft_params.vocab_size == 512
        intake = server.intake
        assert intake.vocab_size == 512
        assert (intake.max_bytes, intake.max_tenant_bytes) == (2 << 20, 100_000)
        assert intake.max_body_bytes == 4096
        with SuffixTree(64) as t:
            t.add(1, [1, 2, 600])
            oov = t.to_bytes()
        query = encode_key_query(("default", None, "S"))
        r = intake.handle("PUT", SNAPSHOT_PATH, query, {"Content-Type": SHARD_CONTENT_TYPE}, oov)
        assert r.status == 422
        _run(server.engine, "default", 1)
        listing = json.loads(intake.handle("GET", SHARDS_PATH, "", {}, b"").body)
        assert listing["budget"]["max_tenant_bytes"] == 100_000
        assert listing["learned"]["tenants"]["default"]["bytes"] > 0
        assert listing["learned"]["max_bytes"] == 1 << 30
    finally:
        server.stop()
        server.engine.close()
