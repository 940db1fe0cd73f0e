"""A real Prometheus scrapes two embedded engines on a real fleet while a tagged pipeline runs.

Engine A (bearer key, as its other routes) answers the pipeline of
tests/ops_pipeline.py and publishes its responses to the fleet (a real
redis-server); engine B follows the fleet and applies them, then skips one
malformed entry written straight into the stream.  Prometheus (Debian's
binary, 1 s scrapes, the shipped alerting rules loaded) scrapes both; after
two scrapes that follow the run:

- per (tenant, pipeline, stage), Prometheus's requests, verification steps,
  drafted and accepted tokens, and the acceptance rate, equal what the
  responses' own ``agentspec`` fields counted;
- the fleet's counters: published by A, applied and malformed on B; the
  pushes A answered (one shard pushed, one malformed snapshot refused);
- every PromQL expression of docs/grafana/agentspec.json parses and returns
  series (but those of ``ops_pipeline.VLLM_SERIES``: vLLM's own ``vllm:*``;
  integrations/vllm/tests/test_prometheus_vllm.py checks them), the fleet lag
  and, after B's compaction, the snapshot age included; and the
  template variables list the pipeline's tenants and stages;
- docs/prometheus/agentspec-alerts.yml loads and every rule evaluates
  without error.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ops_pipeline
import pytest
from prometheus_server import PrometheusServer, Target, eventually, requires_prometheus
from redis_server import RedisServer, requires_redis_server

pytest.importorskip("torch")
pytest.importorskip("transformers")

from agentspec import ShardPusher, ShardStore
from agentspec._fleet.config import FleetConfig
from agentspec._fleet.functions import load_library
from agentspec._fleet.names import FleetKeys
from agentspec._push.wire import SHARD_CONTENT_TYPE, SNAPSHOT_PATH
from agentspec.engine import EngineOptions, EngineServer
from agentspec.engine._fleet import EngineFleet

pytestmark = [requires_prometheus, requires_redis_server]

KEY = "sk-ops-test"
WAIT = 60.0
CFG = FleetConfig(max_depth=64, max_shard_tokens=100_000)
KEY_LABELS = ("tenant", "pipeline", "stage")
ALERT_NAMES = {
    "AgentSpecAcceptanceCollapsed",
    "AgentSpecFleetLag",
    "AgentSpecShardMemoryNearBudget",
}


@dataclass
class Stack:
    prom: PrometheusServer
    expected: dict[tuple[str, str, str], ops_pipeline.Counts]
    applied_on_b: int


@pytest.fixture(scope="module")
def stack(model_tok: tuple[Any, Any], start_prometheus: Any) -> Iterator[Stack]:
    opts = EngineOptions(default_max_tokens=16)
    with RedisServer(tcp=True) as redis:
        admin = redis.client()
        load_library(admin)  # what `agentspec fleet setup` does
        fleet_a = EngineFleet(redis.tcp_url, config=CFG, block_ms=200)
        fleet_b = EngineFleet(redis.tcp_url, config=CFG, block_ms=200)
        a = EngineServer.create(*model_tok, opts, api_key=KEY, fleet=fleet_a).start()
        b = EngineServer.create(*model_tok, opts, fleet=fleet_b).start()
        try:
            prom = start_prometheus(
                {
                    "engine-a": [Target(f"127.0.0.1:{a.port}", bearer=KEY)],
                    "engine-b": [Target(f"127.0.0.1:{b.port}")],
                },
                rule_files=[ops_pipeline.ALERTS],
            )
            prom.wait_scraped()  # both targets up before the run
            expected = ops_pipeline.run(a.port, api_key=KEY)
            _push(a, good=True)
            _push(a, good=False)
            # B applies what A published (the default tenant's stream), then skips
            # one malformed entry.
            assert fleet_a.publisher.flush(WAIT)
            log = FleetKeys.of("default").log
            ((last, _),) = admin.xrevrange(log, count=1)
            sub = fleet_b.subscribers["default"]
            assert sub.wait_for(last, WAIT)
            bad = admin.xadd(log, {b"x": b"not an entry"})
            assert sub.wait_for(bad, WAIT)
            assert sub.compact(WAIT) is not None  # a snapshot round: B's snapshot age
            applied = sum(c.requests for k, c in expected.items() if k[0] == "default")
            # two scrapes after the run: every series has two samples (rate() needs them)
            prom.wait_scraped(time.time())
            prom.wait_scraped(time.time())
            yield Stack(prom, expected, applied)
        finally:
            for srv in (a, b):
                srv.stop()
                srv.engine.close()
            fleet_a.close(0)
            fleet_b.close(0)
            admin.close()


def _push(srv: EngineServer, *, good: bool) -> None:
    """One shard pushed to ``srv`` with `ShardPusher` (good), or a malformed snapshot (400)."""
    if good:
        store = ShardStore()
        pusher = ShardPusher(store, [srv.url], api_key=KEY)
        try:
            store.learn(("default", ops_pipeline.PIPELINE, "pushed"), [5, 6, 7, 8, 9])
            assert pusher.flush(WAIT)
        finally:
            pusher.close()
            store.close()
        return
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": SHARD_CONTENT_TYPE}
        conn.request("PUT", SNAPSHOT_PATH + "?stage=bad", b"not a shard", headers)
        resp = conn.getresponse()
        assert resp.status == 400, resp.read()
        resp.read()
    finally:
        conn.close()


def _by_key(prom: PrometheusServer, expr: str) -> dict[tuple[str, str, str], float]:
    out = {}
    for r in prom.query(expr):
        key = tuple(r["metric"].get(label, "") for label in KEY_LABELS)
        out[key] = float(r["value"][1])
    return out  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("metric", "field"),
    [
        ("agentspec_requests_total", "requests"),
        ("agentspec_verify_steps_total", "steps"),
        ("agentspec_draft_tokens_total", "drafted"),
        ("agentspec_accepted_tokens_total", "accepted"),
    ],
)
def test_per_stage_counters_equal_the_responses(stack: Stack, metric: str, field: str) -> None:
    got = _by_key(stack.prom, f'sum by (tenant, pipeline, stage) ({metric}{{job="engine-a"}})')
    want = {k: float(getattr(c, field)) for k, c in stack.expected.items()}
    assert got == want


def test_per_stage_acceptance_rate_equals_the_responses(stack: Stack) -> None:
    sel = '{job="engine-a"}'
    got = _by_key(
        stack.prom,
        f"sum by (tenant, pipeline, stage) (agentspec_accepted_tokens_total{sel})"
        f" / sum by (tenant, pipeline, stage) (agentspec_draft_tokens_total{sel})",
    )
    want = {k: c.rate for k, c in stack.expected.items()}
    assert got.keys() == want.keys()
    for k, rate in want.items():
        assert got[k] == pytest.approx(rate, rel=1e-12), k
    # the learned shards drafted and were accepted: the rates are not all 0
    assert max(want.values()) > 0.5, want
    # accepted per draft position sums to the accepted tokens, stage by stage
    per_pos = _by_key(
        stack.prom,
        f"sum by (tenant, pipeline, stage) (agentspec_accepted_tokens_per_position_total{sel})",
    )
    assert per_pos == {k: float(c.accepted) for k, c in stack.expected.items()}


def test_fleet_counters(stack: Stack) -> None:
    prom = stack.prom
    published = sum(c.requests for c in stack.expected.values())
    assert prom.values('sum(agentspec_fleet_published_total{job="engine-a"})', "") == {
        "": float(published)
    }
    assert prom.values('sum(agentspec_fleet_applied_total{job="engine-b"})', "") == {
        "": float(stack.applied_on_b)
    }
    assert prom.values('sum(agentspec_fleet_malformed_total{job="engine-b"})', "") == {"": 1.0}
    # one lag observation per applied entry; B's snapshot age after its compaction
    assert prom.values('sum(agentspec_fleet_lag_seconds_count{job="engine-b"})', "") == {
        "": float(stack.applied_on_b)
    }
    ages = prom.values('max(agentspec_fleet_snapshot_age_seconds{job="engine-b"})', "")
    assert 0 <= ages[""] < WAIT


def test_push_counters(stack: Stack) -> None:
    got = {
        (r["metric"]["result"], r["metric"]["code"]): float(r["value"][1])
        for r in stack.prom.query('sum by (result, code) (agentspec_pushes_total{job="engine-a"})')
    }
    assert got.pop(("refused", "400")) == 1.0
    assert set(got) == {("accepted", "200")}
    assert got["accepted", "200"] >= 1


def test_every_dashboard_expression_returns_series(stack: Stack) -> None:
    exprs = [(w, e) for w, e in ops_pipeline.dashboard_exprs() if not ops_pipeline.is_vllm(e)]
    assert len(exprs) >= 20
    empty = []
    for where, expr in exprs:
        if not stack.prom.query(ops_pipeline.concrete(expr)):  # raises on a parse error
            empty.append(f"{where}: {expr}")
    assert not empty, "no series:\n" + "\n".join(empty)


def test_dashboard_variables_list_the_pipeline(stack: Stack) -> None:
    exprs = dict(ops_pipeline.dashboard_exprs())
    values = {
        name: set(stack.prom.values(ops_pipeline.concrete(exprs[f"variable {name}"]), name))
        for name in KEY_LABELS
    }
    assert values["tenant"] >= {"default", "acme"}
    assert values["pipeline"] >= {ops_pipeline.PIPELINE}
    assert values["stage"] >= {"plan", "code", "review"}


def test_alerting_rules_load_and_evaluate(stack: Stack) -> None:
    prom = stack.prom

    def evaluated() -> bool:
        rules = prom.rules()
        return {r["name"] for r in rules} == ALERT_NAMES and all(
            r["health"] != "unknown" for r in rules
        )

    assert eventually(evaluated, WAIT), prom.rules()
    for rule in prom.rules():
        assert rule["type"] == "alerting"
        assert rule["health"] == "ok", rule
        assert not rule.get("lastError"), rule
        # a short run with healthy fleets and small shards fires none of them
        assert rule["state"] == "inactive", rule
