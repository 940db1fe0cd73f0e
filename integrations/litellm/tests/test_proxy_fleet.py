"""A real LiteLLM proxy in the fleet, in front of a real engine that publishes too.

The proxy's hook has ``redis`` in its config; the embedded engine runs with
``--redis`` on the same redis-server, so both sides publish every answer
they see, the engine under the request's ``vllm_xargs.agentspec_request_id``
(as a vLLM worker does).  The fleet must hold each answer once: one sequence
whose fleet id is the one of the request id the upstream received, and the
other copy counted as a duplicate.  A `FleetSubscriber` reads the fleet; the
recording `Forwarder` shows what reached the engine.
"""

from __future__ import annotations

import array
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import CUSTOM_AUTH, proxy_config
from harness import ENGINE_PYTHON_ENV, Forwarder, Process, start_engine, start_proxy
from prereq import missing
from redis_server import RedisServer, requires_redis_server

from agentspec._fleet.ids import fleet_seq_id
from agentspec._fleet.sub import FleetSubscriber

pytestmark = requires_redis_server

WAIT = 120.0
PASSWORD = "pw-Fl33t-proxy"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        with srv.client() as admin:  # the proxy connects as its own ACL user
            admin.execute_command(
                "ACL", "SETUSER", "proxy", "on", f">{PASSWORD}", "~agentspec:*", "+@all"
            )
        yield srv


@pytest.fixture(scope="module")
def fleet_engine(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[Process]:
    """An embedded engine publishing what it serves to the fleet."""
    if not os.environ.get(ENGINE_PYTHON_ENV):
        missing(f"${ENGINE_PYTHON_ENV} is not set (scripts/test-litellm sets it)")
    with start_engine(tmp_path_factory.mktemp("fleet-engine"), "--redis", redis_server.url) as e:
        yield e


@pytest.fixture(scope="module")
def fleet_forwarder(fleet_engine: Process) -> Iterator[Forwarder]:
    fwd = Forwarder(fleet_engine.url)
    try:
        yield fwd
    finally:
        fwd.close()


@pytest.fixture(scope="module")
def fleet_proxy(
    tmp_path_factory: pytest.TempPathFactory,
    fleet_forwarder: Forwarder,
    fleet_engine: Process,
    redis_server: RedisServer,
) -> Iterator[tuple[Process, Path]]:
    import urllib.request

    with urllib.request.urlopen(f"{fleet_engine.url}/v1/models", timeout=10) as resp:
        model = str(json.load(resp)["data"][0]["id"])
    workdir = tmp_path_factory.mktemp("fleet-proxy")
    hook = {
        "store": str(workdir / "store"),
        "stats_file": str(workdir / "stats.json"),
        "tenant_from": "team",
        "default_stage": {"smol": "main"},
        "push": [],
        "redis": f"unix://proxy:{PASSWORD}@{redis_server.socket}",
    }
    config = proxy_config(fleet_forwarder.url, model)
    with start_proxy(workdir, config, hook, **{"custom_auth.py": CUSTOM_AUTH}) as proxy:
        yield proxy, workdir


def test_an_answer_served_through_the_proxy_is_in_the_fleet_once(
    fleet_proxy: tuple[Process, Path], fleet_forwarder: Forwarder, redis_server: RedisServer
) -> None:
    proxy, workdir = fleet_proxy
    key = ("team-a", None, "Fleet")
    with (
        FleetSubscriber(redis_server.url, "team-a", block_ms=100, compact_every=0) as sub,
        openai.OpenAI(
            base_url=f"{proxy.url}/v1", api_key="sk-team-a", max_retries=0, timeout=180
        ) as client,
    ):
        before = len(fleet_forwarder.completions())
        resp = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Name three rivers."}],
            max_tokens=12,
            temperature=0,
            extra_headers={"X-AgentSpec-Stage": "Fleet"},
        )
        assert resp.choices[0].message.content
        bodies = fleet_forwarder.completions()
        assert len(bodies) == before + 1
        rid = bodies[-1]["vllm_xargs"]["agentspec_request_id"]
        assert isinstance(rid, str)
        assert len(rid) == 32

        def both_copies() -> bool:
            shard = sub.stats().shards.get(key)
            return shard is not None and shard.sequences + shard.duplicates >= 2

        assert sub.wait_until(both_copies, WAIT), sub.stats()
        tree = sub.tree(key)
        assert tree is not None
        ids = tree.sequence_ids()
        assert len(ids) == 1, "the proxy's and the engine's copies were both learned"
        tokens = array.array("i", tree.sequence(ids[0]))
        assert ids[0] == fleet_seq_id(key, rid, memoryview(tokens))
        assert sub.stats().shards[key].duplicates == 1
    with redis_server.client() as admin:
        entries = admin.xrange("agentspec:{team-a}:log")
    assert [e[b"i"].decode() for _, e in entries].count(rid) == 2

    def fleet_stats() -> dict[str, Any] | None:
        try:
            data = json.loads((workdir / "stats.json").read_text())
        except (OSError, ValueError):
            return None
        return data.get("fleet") if isinstance(data, dict) else None

    stats = fleet_stats()
    assert stats is not None
    assert stats["redis"] == f"unix://proxy:***@{redis_server.socket}"
    for log in (workdir / "proxy.log", workdir / "stats.json"):
        assert PASSWORD not in log.read_text(errors="replace")
