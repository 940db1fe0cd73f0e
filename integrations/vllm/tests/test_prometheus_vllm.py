"""A real Prometheus scrapes a real vLLM server with the agentspec plugin while a pipeline runs.

One vLLM server (SmolLM2-135M on CPU, agentspec's flags as ``agentspec
serve`` builds them, on a fleet in a real redis-server) answers the tagged
pipeline of tests/ops_pipeline.py; Prometheus (Debian's binary, 1 s scrapes)
scrapes vLLM's own ``/metrics``.  Then:

- per (tenant, pipeline, stage), Prometheus's drafted and accepted tokens,
  requests and acceptance rate equal the proposer's own counters
  (``GET /v1/agentspec/stats``, summed over the workers);
- every PromQL expression of docs/grafana/agentspec.json that reads vLLM's
  own ``vllm:spec_decode_*`` series (``ops_pipeline.VLLM_SERIES``), parses and returns
  series (the others are checked against the embedded engine in tests/ops).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

import ops_pipeline
from prometheus_server import Target, eventually, requires_prometheus
from redis_server import RedisServer, requires_redis_server
from test_endpoint import API_KEY, VllmServer, need_vllm

pytestmark = [pytest.mark.vllm, requires_prometheus, requires_redis_server]

WAIT = 60.0
KEY_LABELS = ("tenant", "pipeline", "stage")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from prometheus_server import PrometheusServer

    need_vllm()
    with RedisServer() as redis:
        env = {"AGENTSPEC_VLLM_REDIS_URL": redis.url}
        srv = VllmServer(tmp_path_factory.mktemp("vllm-prom"), env=env)
        prom = None
        try:
            srv.start()
            target = Target(f"127.0.0.1:{srv.port}", bearer=API_KEY)
            prom = PrometheusServer({"vllm": [target]}).start()
            prom.wait_scraped()
            sent = ops_pipeline.run(srv.port, api_key=API_KEY)
            yield srv, prom, sent
        finally:
            if prom is not None:
                prom.close()
            srv.close()


def _stats(srv):
    """Proposer counters per (tenant, pipeline, stage), summed over the workers."""
    status, _, body = srv.request("GET", "/v1/agentspec/stats")
    assert status == 200, body
    out = {}
    for worker in json.loads(body)["workers"]:
        for k in worker["proposer"]["keys"]:
            key = (k["tenant"], k["pipeline"] or "", k["stage"] or "")
            acc = out.setdefault(key, {"requests": 0, "drafted": 0, "accepted": 0})
            acc["requests"] += k["requests"]
            acc["drafted"] += k["drafted_tokens"]
            acc["accepted"] += k["accepted_tokens"]
    return out


def _by_key(prom, expr):
    return {
        tuple(r["metric"].get(label, "") for label in KEY_LABELS): float(r["value"][1])
        for r in prom.query(expr)
    }


def test_vllm_per_stage_acceptance_matches_the_proposer(stack):
    srv, prom, sent = stack
    stats = _stats(srv)
    assert {k: v["requests"] for k, v in stats.items() if k in sent} == {
        k: c.requests for k, c in sent.items()
    }
    assert sum(v["accepted"] for v in stats.values()) > 0, stats
    want = {
        "requests": {k: float(v["requests"]) for k, v in stats.items()},
        "drafted": {k: float(v["drafted"]) for k, v in stats.items()},
        "accepted": {k: float(v["accepted"]) for k, v in stats.items()},
    }
    queries = {
        "requests": "agentspec_requests_total",
        "drafted": "agentspec_draft_tokens_total",
        "accepted": "agentspec_accepted_tokens_total",
    }
    got: dict = {}

    def same() -> bool:  # the plugin's snapshot and the scrapes trail the stats by a moment
        prom.wait_scraped(time.time())
        for name, metric in queries.items():
            got[name] = _by_key(prom, f"sum by (tenant, pipeline, stage) ({metric})")
        return got == want

    assert eventually(same, WAIT, interval=0.2), (got, want)
    rates = _by_key(
        prom,
        "sum by (tenant, pipeline, stage) (agentspec_accepted_tokens_total)"
        " / sum by (tenant, pipeline, stage) (agentspec_draft_tokens_total)",
    )
    for key, v in stats.items():
        if v["drafted"]:
            assert rates[key] == pytest.approx(v["accepted"] / v["drafted"], rel=1e-12), key


def test_vllm_dashboard_expressions_return_series(stack):
    _, prom, _ = stack
    prom.wait_scraped(time.time())
    prom.wait_scraped(time.time())  # two samples of every series: rate() has its two points
    exprs = [(w, e) for w, e in ops_pipeline.dashboard_exprs() if ops_pipeline.is_vllm(e)]
    assert len(exprs) >= 3
    empty = [f"{w}: {e}" for w, e in exprs if not prom.query(ops_pipeline.concrete(e))]
    assert not empty, "no series:\n" + "\n".join(empty)
