"""The embedded engine on the fleet (a real redis-server): what one engine learns, another drafts.

Engine A answers a prompt (speculation off: the greedy baseline) and
publishes the response under the client's request id; engine B, sharing
A's loaded model, waits until its subscriber applied that entry (an event,
never a sleep) and answers the same prompt with accepted drafts and the
same tokens; a fresh engine with no fleet accepts fewer.  B's own response
goes out under B's response id.  Then Redis is killed: B still answers
(200), drafts, and the publisher queues; the password never shows.
"""

from __future__ import annotations

import http.client
import json
import logging
from collections import defaultdict
from typing import Any

from prereq import require_module
from prometheus_client.parser import text_string_to_metric_families
from redis_server import RedisServer, requires_redis_server

torch = require_module("torch")
require_module("transformers")

from agentspec import metrics as m  # noqa: E402
from agentspec._fleet.config import FleetConfig  # noqa: E402
from agentspec._fleet.functions import load_library  # noqa: E402
from agentspec._fleet.names import FleetKeys, tenant_acl_rules  # noqa: E402
from agentspec.engine import EngineOptions, EngineServer  # noqa: E402
from agentspec.engine._fleet import EngineFleet, fleet_tenants_for  # noqa: E402

pytestmark = requires_redis_server

MAX_NEW = 16
WAIT = 60.0
PASSWORD = "engine-S3cret-pw"
PROMPT = "Write a SQL query that selects all rows from a table named users."
CFG = FleetConfig(max_depth=64, max_shard_tokens=100_000)


def _chat(srv: EngineServer, *, speculate: bool = True, request_id: str | None = None) -> Any:
    xargs: dict[str, Any] = {"agentspec_stage": "sql", "agentspec_speculate": speculate}
    if request_id is not None:
        xargs["agentspec_request_id"] = request_id
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "return_token_ids": True,
        "vllm_xargs": xargs,
    }
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(), {})
        resp = conn.getresponse()
        obj = json.loads(resp.read())
        assert resp.status == 200, obj
        return obj
    finally:
        conn.close()


def _metrics(srv: EngineServer) -> dict[tuple[str, str, str], float]:
    """The server's metrics by (sample name, stage, source or kind), summed over the rest."""
    out: dict[tuple[str, str, str], float] = defaultdict(float)
    assert srv.engine.metrics is not None
    for family in text_string_to_metric_families(srv.engine.metrics.render().decode()):
        for sample in family.samples:
            labels = sample.labels
            key = (labels.get("stage", ""), labels.get("source", labels.get("kind", "")))
            out[(sample.name, *key)] += sample.value
    return out


def _tokens(obj: Any) -> list[int]:
    return list(obj["choices"][0]["token_ids"])


def _last_identity(server: RedisServer) -> str:
    with server.client() as c:
        ((_, fields),) = c.xrevrange(FleetKeys.of("default").log, count=1)
    return bytes(fields[b"i"]).decode()


def test_fleet_tenants_default_to_the_tenant_map() -> None:
    assert fleet_tenants_for(None, None) == ["default"]
    assert fleet_tenants_for(None, {"k1": "b", "k2": "a"}) == ["a", "b"]
    assert fleet_tenants_for(None, {"k1": "a"}, "shared") == ["a", "default"]
    assert fleet_tenants_for(["x", "x", "y"], {"k1": "a"}) == ["x", "y"]


def test_a_response_learned_by_one_engine_drafts_on_another(model_tok, caplog) -> None:
    caplog.set_level(logging.INFO, logger="agentspec")
    opts = EngineOptions(default_max_tokens=MAX_NEW)
    with RedisServer(tcp=True) as server:
        admin = server.client()
        load_library(admin)  # what `agentspec fleet setup` does
        admin.execute_command(
            "ACL", "SETUSER", "eng", "on", f">{PASSWORD}", *tenant_acl_rules("default")
        )
        admin.close()
        url = server.url_for("eng", PASSWORD, tcp=True)
        fleet_a = EngineFleet(url, config=CFG, block_ms=200)
        fleet_b = EngineFleet(url, config=CFG, block_ms=200)
        a = EngineServer.create(*model_tok, opts, fleet=fleet_a).start()
        b = EngineServer.create(*model_tok, opts, fleet=fleet_b).start()
        fresh = EngineServer.create(*model_tok, opts).start()
        try:
            # A: the greedy baseline, published under the client's request id.
            base = _chat(a, speculate=False, request_id="client-req-1")
            assert fleet_a.publisher.flush(WAIT)
            last = fleet_a.publisher.last_id
            assert last is not None
            assert _last_identity(server) == "client-req-1"
            assert fleet_b.subscribers["default"].wait_for(last, WAIT)

            # B drafts from the fleet's shard: accepted drafts, the same tokens.
            on_b = _chat(b)
            assert _tokens(on_b) == _tokens(base)
            assert on_b["agentspec"]["accepted"] > 0
            # ... which B's metrics show: drafts from the fleet, its shard, A's publish
            got = _metrics(b)
            assert got[m.DRAFTS_TOTAL, "sql", "fleet"] >= 1
            assert got[m.FLEET_APPLIED_TOTAL, "", ""] >= 1
            assert got[m.SHARDS, "", "fleet"] == 1
            assert got[m.SHARD_TOKENS, "sql", "fleet"] > 0
            assert _metrics(a)[m.FLEET_PUBLISHED_TOTAL, "", ""] >= 1
            # ... one lag observation per applied entry; the snapshot age once compacted
            lag = f"{m.FLEET_LAG_SECONDS}_count", "", ""
            assert got[lag] == got[m.FLEET_APPLIED_TOTAL, "", ""]
            assert got[f"{m.FLEET_LAG_SECONDS}_bucket", "", ""] > 0
            assert (m.FLEET_SNAPSHOT_AGE_SECONDS, "", "") not in got
            assert fleet_b.subscribers["default"].compact(WAIT) is not None
            assert 0 <= _metrics(b)[m.FLEET_SNAPSHOT_AGE_SECONDS, "", ""] < WAIT
            # A fresh engine without the fleet accepts fewer on the same prompt.
            on_fresh = _chat(fresh)
            assert _tokens(on_fresh) == _tokens(base)
            assert on_fresh["agentspec"]["accepted"] < on_b["agentspec"]["accepted"]
            # A request id the fleet cannot take is refused before anything runs.
            bad = {"messages": [{"role": "user", "content": "hi"}]}
            bad["vllm_xargs"] = {"agentspec_request_id": ""}  # type: ignore[dict-item]
            conn = http.client.HTTPConnection("127.0.0.1", fresh.port, timeout=60)
            conn.request("POST", "/v1/chat/completions", json.dumps(bad).encode(), {})
            resp = conn.getresponse()
            assert resp.status == 400
            assert b"agentspec_request_id" in resp.read()
            conn.close()
            # B's response went out under its own response id (none was sent).
            assert fleet_b.publisher.flush(WAIT)
            assert _last_identity(server) == on_b["id"]

            # Redis dies: B still serves, drafts from what it holds, queues its output.
            server.kill()
            again = _chat(b)
            assert _tokens(again) == _tokens(base)
            assert again["agentspec"]["drafted"] > 0
            assert again["agentspec"]["accepted"] > 0
            stats = fleet_b.stats()
            assert stats["publisher"]["queued"] == 2
            assert stats["subscribers"]["default"]["sequences"] >= 1
            assert "***" in stats["redis"]
            assert PASSWORD not in json.dumps(stats)
        finally:
            for srv in (a, b, fresh):
                srv.stop()
                srv.engine.close()
            fleet_a.close(0)
            fleet_b.close(0)
    text = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert PASSWORD not in text + repr(fleet_a) + repr(fleet_b)
