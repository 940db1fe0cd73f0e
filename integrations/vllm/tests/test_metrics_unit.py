"""The plugin's Prometheus metrics without vLLM: worker snapshots, merging, rendering.

The proposer runs on the real agentspec engine behind the runner stand-in of
`test_proposer_unit`; the snapshot it answers through the worker extension is
merged and rendered, and the exposition text parsed back with
``prometheus_client``'s parser is compared with the proposer's own JSON stats.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from agentspec_vllm.config import load_config
from agentspec_vllm.endpoint import ShardForwarder
from agentspec_vllm.metrics import (
    METRICS_PATH,
    RPC_METRICS,
    MetricsRefresher,
    WorkerMetrics,
    merge_snapshots,
)
from agentspec_vllm.proposer import AgentSpecProposer
from prometheus_client.parser import text_string_to_metric_families
from test_proposer_unit import (  # fresh_intake: each test gets its own worker intake
    ANSWER,
    PROMPT,
    K,
    Loop,
    Worker,
    _push,
    _snapshot,
    fresh_intake,  # noqa: F401
    vllm_config,
)

from agentspec.integration import SHARD_CONTENT_TYPE, SNAPSHOT_PATH
from agentspec.metrics import FLEET_LAG_SECONDS_BUCKETS

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: bytes) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def series(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        v
        for (n, lab), v in samples.items()
        if n == name and all(dict(lab).get(k) == w for k, w in labels.items())
    )


def collector() -> WorkerMetrics:
    m = WorkerMetrics()
    m.register(m.registry)
    return m


def run_stage(loop: Loop, n: int, stage: str, tenant: str = "acme") -> None:
    for i in range(n):
        loop.run(f"{stage}-{i}", PROMPT, ANSWER, stage=stage, pipeline="t2s", tenant=tenant)
        loop.step()  # sweeps the finished request: it is learned


def test_metrics_match_the_proposers_stats() -> None:
    config = vllm_config()
    proposer = AgentSpecProposer(config)
    loop = Loop(proposer)
    worker = Worker(loop, config)
    run_stage(loop, 3, "SQL")
    run_stage(loop, 2, "Plan")
    m = collector()
    m.update([worker.agentspec_metrics()])
    samples = parse(m.render_text())
    keys = {(e["tenant"], e["pipeline"], e["stage"]): e for e in proposer.stats()["keys"]}
    assert set(keys) == {("acme", "t2s", "SQL"), ("acme", "t2s", "Plan")}
    for (tenant, pipeline, stage), e in keys.items():
        t = {"tenant": tenant, "pipeline": pipeline, "stage": stage}
        assert series(samples, "agentspec_requests_total", **t) == e["requests"]
        assert series(samples, "agentspec_verify_steps_total", **t) == e["steps"]
        assert series(samples, "agentspec_draft_tokens_total", **t) == e["drafted_tokens"]
        assert series(samples, "agentspec_accepted_tokens_total", **t) == e["accepted_tokens"]
        assert e["accepted_tokens"] > 0
        # every accepted token sits at one position; position 0 counts the drafts
        # that accepted anything, and positions never grow along the draft
        per_pos = [
            series(samples, "agentspec_accepted_tokens_per_position_total", position=str(j), **t)
            for j in range(K)
        ]
        assert sum(per_pos) == e["accepted_tokens"]
        assert per_pos == sorted(per_pos, reverse=True)
        assert series(samples, "agentspec_drafts_total", **t) == e["steps"]
        sources = dict(e["sources"])
        sources["request"] = sources.pop("local", 0)
        for source, n in sources.items():
            assert series(samples, "agentspec_drafts_total", source=source, **t) == n
        tokens = series(samples, "agentspec_shard_tokens", kind="learned", **t)
        assert tokens == e["learned_tokens"] > 0
        assert series(samples, "agentspec_shard_bytes", kind="learned", **t) > 0
    # one observation per step in which a request decoded on
    assert series(samples, "agentspec_step_seconds_count") > 0
    assert samples[("agentspec_vllm_workers", ())] == 1
    goodput = proposer.goodput.stats()
    assert series(samples, "agentspec_goodput_offered_tokens_total") == goodput["offered"]
    assert series(samples, "agentspec_shard_budget_bytes", kind="learned") == (
        config_learned_budget(proposer)
    )


def config_learned_budget(proposer: AgentSpecProposer) -> int:
    budget = proposer.learned_budget.max_bytes
    assert budget is not None
    return budget


def test_pushed_and_source_kinds() -> None:
    config = vllm_config()
    proposer = AgentSpecProposer(config)
    loop = Loop(proposer)
    worker = Worker(loop, config)
    assert _push(worker, ("acme", "t2s", "SQL"), _snapshot(PROMPT[-8:] + ANSWER)) == 200
    loop.run("a", PROMPT, ANSWER, stage="SQL", pipeline="t2s", tenant="acme")
    m = collector()
    m.update([worker.agentspec_metrics()])
    samples = parse(m.render_text())
    t = {"tenant": "acme", "pipeline": "t2s", "stage": "SQL"}
    (entry,) = proposer.stats()["keys"]
    assert entry["sources"]["extra"] > 0
    # "extra" is reported by the kind of extra tree the request had: a pushed shard
    assert (
        series(samples, "agentspec_drafts_total", source="pushed", **t) == entry["sources"]["extra"]
    )
    assert series(samples, "agentspec_drafts_total", source="extra", **t) == 0
    assert series(samples, "agentspec_shards", kind="pushed") == 1
    (shard,) = worker.agentspec_stats()["pushed"]
    assert series(samples, "agentspec_shard_tokens", kind="pushed", **t) == shard["tokens"]
    assert series(samples, "agentspec_shard_bytes", kind="pushed", **t) == shard["bytes"]
    assert series(samples, "agentspec_pushes_total", result="accepted", code="200") == 1


def test_pushes_refused_before_forwarding_are_counted() -> None:
    """A push the API server refuses itself (bad key query, bad bytes) never reaches a
    worker; it is counted beside the workers' own answers."""
    config = vllm_config()
    worker = Worker(Loop(AgentSpecProposer(config)), config)
    assert _push(worker, ("acme", "t2s", "SQL"), _snapshot(PROMPT[-8:] + ANSWER)) == 200
    assert _push(worker, ("acme", "t2s", "SQL"), b"not a shard") == 400

    async def rpc(method: str, args: tuple[Any, ...]) -> list[Any]:
        assert method == RPC_METRICS
        return [worker.agentspec_metrics()]

    m = collector()
    fwd = ShardForwarder(rpc, load_config({"agentspec": {}}, {}), metrics=m)
    headers = {"content-type": SHARD_CONTENT_TYPE}
    bad = asyncio.run(fwd.handle("PUT", SNAPSHOT_PATH, "tenant=%00", headers, b"x"))
    assert bad.status == 400
    ok = asyncio.run(fwd.handle("GET", METRICS_PATH, "", {}, b""))
    samples = parse(ok.body)
    assert series(samples, "agentspec_pushes_total", result="accepted", code="200") == 1
    # one refused by the worker's intake, one by the API server before forwarding
    assert series(samples, "agentspec_pushes_total", result="refused", code="400") == 2


def _snap(rank: int, dp: int, requests: int, shard_bytes: int) -> dict[str, Any]:
    """A worker's snapshot with one key (only the fields the merge reads)."""
    sources = {"stage": 7, "none": 3}
    row = ["t", "p", "s", requests, 10, 5, 20, 8, 1, 0, sources, [2, 1, 2], 50, shard_bytes]
    return {
        "pid": 100 + rank,
        "rank": rank,
        "dp_rank": dp,
        "proposer": {
            "keys": [row],
            "step_seconds": {"bounds": [0.01, 0.1], "counts": [3, 1, 0], "sum": 0.07},
            "goodput": {"offered": 9, "kept": 6, "active": dp == 1, "step_cost": None},
            "learned": {"bytes": shard_bytes, "max_bytes": 1000, "shards": 1, "evictions": 2},
            "bad_tags": 1,
        },
        "pushed": {"shards": [], "bytes": 0, "max_bytes": 5000, "refused": 1, "too_large": 0},
        "fleet": None,
    }


def test_merge_counts_an_engine_once_and_sums_engines() -> None:
    # Two tensor-parallel ranks of one engine see the same batches: counted once.
    tp = merge_snapshots([_snap(0, 0, 4, 300), _snap(1, 0, 4, 300)])
    assert tp.workers == 2
    assert tp.keys[("t", "p", "s")][0] == 4
    assert tp.step_counts == [3, 1, 0]
    # Two data-parallel engines serve different requests: summed; memory is the largest.
    dp = merge_snapshots([_snap(0, 0, 4, 300), _snap(0, 1, 6, 700), None, "garbage"])
    assert dp.workers == 2
    assert dp.keys[("t", "p", "s")][:5] == [10, 20, 10, 40, 16]
    assert dp.accepted_len[("t", "p", "s")] == [4, 2, 4]
    assert dp.sources[("t", "p", "s", "stage")] == 14
    assert dp.step_counts == [6, 2, 0]
    assert dp.step_sum == pytest.approx(0.14)
    assert dp.shard_bytes[("learned", "t", "p", "s")] == 700
    assert dp.goodput_offered == 18
    assert dp.goodput_active is True
    assert dp.pushes_refused == {"507": 2, "413": 0}
    m = collector()
    m.update([_snap(0, 0, 4, 300), _snap(0, 1, 6, 700)])
    samples = parse(m.render_text())
    t = {"tenant": "t", "pipeline": "p", "stage": "s"}
    # accepted lengths [4, 2, 4]: position 0 accepted by 2 + 4 drafts, position 1 by 4
    assert series(samples, "agentspec_accepted_tokens_per_position_total", position="0", **t) == 6
    assert series(samples, "agentspec_accepted_tokens_per_position_total", position="1", **t) == 4
    assert samples[("agentspec_step_seconds_bucket", (("le", "0.01"),))] == 6
    assert samples[("agentspec_step_seconds_bucket", (("le", "+Inf"),))] == 8
    assert samples[("agentspec_pushes_total", (("code", "507"), ("result", "refused")))] == 2


def test_stage_labels_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTSPEC_METRICS_MAX_LABEL_VALUES", "2")
    config = vllm_config()
    proposer = AgentSpecProposer(config)
    loop = Loop(proposer)
    worker = Worker(loop, config)
    for stage in ("s1", "s2", "s3", "s4"):
        run_stage(loop, 1, stage)
    m = collector()
    m.update([worker.agentspec_metrics()])
    samples = parse(m.render_text())
    stages = {
        dict(lab)["stage"]
        for (n, lab) in samples
        if n == "agentspec_requests_total" and dict(lab).get("tenant") == "acme"
    }
    assert len(stages) == 3
    assert "other" in stages
    assert series(samples, "agentspec_requests_total", tenant="acme") == 4
    assert series(samples, "agentspec_metrics_label_overflow_total", label="stage") > 0


def test_metrics_off_counts_no_positions_or_step_times() -> None:
    config = vllm_config(metrics=False)
    assert load_config(config.additional_config).metrics is False
    assert load_config({}, {"AGENTSPEC_METRICS": "0"}).metrics is False
    proposer = AgentSpecProposer(config)
    loop = Loop(proposer)
    run_stage(loop, 2, "SQL")
    snap = proposer.metrics_snapshot()
    (row,) = snap["keys"]
    assert row[7] > 0  # accepted tokens are counted either way (the JSON stats have them)
    assert sum(row[11]) == 0
    assert sum(snap["step_seconds"]["counts"]) == 0


def test_metrics_route_and_refresher() -> None:
    config = vllm_config()
    proposer = AgentSpecProposer(config)
    loop = Loop(proposer)
    worker = Worker(loop, config)
    run_stage(loop, 1, "SQL")
    calls: list[str] = []
    fail: list[Exception] = []

    async def rpc(method: str, args: tuple[Any, ...]) -> list[Any]:
        calls.append(method)
        if fail:
            raise fail[0]
        assert method == RPC_METRICS
        return [worker.agentspec_metrics()]

    m = collector()
    cfg = load_config({"agentspec": {"api_key": "k"}}, {})
    fwd = ShardForwarder(rpc, cfg, metrics=m)
    auth = {"authorization": "Bearer k"}
    answer = asyncio.run(fwd.handle("GET", METRICS_PATH, "", auth, b""))
    assert answer.status == 200
    assert answer.headers["Content-Type"].startswith("text/plain")
    samples = parse(answer.body)
    assert series(samples, "agentspec_requests_total", stage="SQL") == 1
    assert asyncio.run(fwd.handle("GET", METRICS_PATH, "", {}, b"")).status == 401
    assert asyncio.run(fwd.handle("POST", METRICS_PATH, "", auth, b"")).status == 405
    off = ShardForwarder(rpc, cfg)
    assert asyncio.run(off.handle("GET", METRICS_PATH, "", auth, b"")).status == 404
    # A failed collection keeps the last snapshot and is counted.
    fail.append(RuntimeError("engine dead"))
    refresher = MetricsRefresher(rpc, m, 0.01)

    async def two_rounds() -> None:
        task = asyncio.get_running_loop().create_task(refresher.run())
        while m.failures < 2:
            await asyncio.sleep(0.005)
        task.cancel()

    asyncio.run(two_rounds())
    samples = parse(m.render_text())
    assert series(samples, "agentspec_vllm_collect_failures_total") >= 2
    assert series(samples, "agentspec_requests_total", stage="SQL") == 1
    assert (
        json.loads(asyncio.run(fwd.handle("GET", METRICS_PATH, "", auth, b"")).body)["error"][
            "type"
        ]
        == "engine_error"
    )


def test_worker_without_proposer_answers_pushed_metrics() -> None:
    config = vllm_config(max_depth=32)
    worker = Worker(SimpleNamespace(drafter=None), config)
    snap = worker.agentspec_metrics()
    assert snap["proposer"] is None
    assert snap["pushed"]["shards"] == []
    merged = merge_snapshots([snap])
    assert merged.workers == 1
    assert not merged.keys


def test_fleet_lag_sums_and_snapshot_age_is_the_least_over_engines() -> None:
    def fleet(dp: int, counts: list[int], total: float, ages: dict[str, float]) -> dict:
        snap = _snap(0, dp, 1, 100)
        snap["fleet"] = {"applied": sum(counts), "lag": {"counts": counts, "sum": total}}
        snap["fleet"]["snapshot_age"] = ages
        return snap

    n = len(FLEET_LAG_SECONDS_BUCKETS) + 1
    a = fleet(0, [2] + [0] * (n - 1), 0.002, {"t1": 9.0, "t2": 4.0})
    b = fleet(1, [0] * (n - 1) + [1], 120.0, {"t1": 3.0})
    merged = merge_snapshots([a, b])
    assert merged.snapshot_age == {"t1": 3.0, "t2": 4.0}
    m = collector()
    m.update([a, b])
    samples = parse(m.render_text())
    assert samples[("agentspec_fleet_snapshot_age_seconds", (("tenant", "t1"),))] == 3.0
    assert samples[("agentspec_fleet_snapshot_age_seconds", (("tenant", "t2"),))] == 4.0
    assert samples[("agentspec_fleet_lag_seconds_bucket", (("le", "0.001"),))] == 2
    assert samples[("agentspec_fleet_lag_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("agentspec_fleet_lag_seconds_sum", ())] == pytest.approx(120.002)
