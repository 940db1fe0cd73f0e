"""AgentSpecClient's Prometheus metrics in the default registry (agentspec_client_*, shards).

Real calls over HTTP to tests/openai_server.py, real shard intakes for the
pushes, a real redis-server for the publish rows; the default registry is
scraped with ``prometheus_client.generate_latest`` and parsed back.  Each test
uses its own tenant, so what other tests' clients report does not interfere.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from openai_server import OpenAIServer
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis_server import RedisServer, requires_redis_server

import agentspec.metrics
from agentspec._client.client import AgentSpecClient, AsyncAgentSpecClient
from agentspec._fleet.config import FleetConfig
from agentspec._push.intake import ShardIntake, serve_intake
from agentspec._store.fleet_outbox import FleetOptions
from agentspec._store.store import ShardStore

ROOT = Path(__file__).resolve().parents[2]
WAIT = 60.0


@pytest.fixture(scope="module")
def server():
    with OpenAIServer() as srv:
        yield srv


@pytest.fixture
def tenant():
    return f"t-{uuid.uuid4().hex[:12]}"


def scrape(text: str | None = None) -> dict[tuple[str, frozenset], float]:
    """Every sample of the default registry: ``{(name, labels): value}``."""
    if text is None:
        text = generate_latest(REGISTRY).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def key(tenant, pipeline="", stage="", **more):
    return frozenset({"tenant": tenant, "pipeline": pipeline, "stage": stage, **more}.items())


def total(samples, name):
    """The sum of every series of ``name`` (label sets of other tests included)."""
    return sum(v for (n, _), v in samples.items() if n == name)


def wait_for(predicate, timeout=WAIT):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def client_for(server, tenant, **kw):
    kw.setdefault("lead_tokens", 0)
    return AgentSpecClient(
        base_url=server.base_url,
        api_key="test",
        max_retries=0,
        timeout=10,
        tenant=tenant,
        return_token_ids=True,
        **kw,
    )


def chat(client, prompt, **kw):
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], **kw
    )


def test_two_clients_add_up_and_closed_clients_stay_counted(server, tenant):
    store = ShardStore()
    a = client_for(server, tenant, store=store)
    try:
        with a.session("s", pipeline="P"):
            chat(a, "one", stage="Plan")
            chat(a, "two", stage="Plan")
            chat(a, "three", stage="Act")

        async def run_b():
            async with AsyncAgentSpecClient(
                base_url=server.base_url,
                api_key="test",
                max_retries=0,
                timeout=10,
                tenant=tenant,
                return_token_ids=True,
                store=store,
            ) as b:
                await b.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "four"}],
                    stage="Plan",
                    pipeline="P",
                )
                stream = await b.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "five"}],
                    stage="Plan",
                    pipeline="P",
                    stream=True,
                )
                async for _ in stream:
                    pass
                assert await b.flush(WAIT)
                return b.stats()

        b_stats = asyncio.run(run_b())  # b is closed here: its counts must stay
        assert a.flush(WAIT)
        got = scrape()
        plan, act = key(tenant, "P", "Plan"), key(tenant, "P", "Act")
        assert got[("agentspec_client_calls_total", plan)] == 4
        assert got[("agentspec_client_calls_total", act)] == 1
        a_stats = a.stats()
        assert a_stats.learned + b_stats.learned == 5
        assert got[("agentspec_client_learned_sequences_total", plan)] == 4
        assert got[("agentspec_client_learned_sequences_total", act)] == 1
        for stage in ("Plan", "Act"):
            st = store.stats((tenant, "P", stage))
            labels = key(tenant, "P", stage, kind="learned")
            assert got[("agentspec_shard_tokens", labels)] == st.tokens
            assert 0 < got[("agentspec_shard_bytes", labels)] <= st.bytes  # live bytes
        assert got[("agentspec_client_learn_queue_depth", frozenset())] >= 0
        # the counter families are typed counters, the depth a gauge
        families = {
            f.name: f.type for f in text_string_to_metric_families(generate_latest().decode())
        }
        assert families["agentspec_client_calls"] == "counter"
        assert families["agentspec_client_learn_queue_depth"] == "gauge"
        assert families["agentspec_shards"] == "gauge"
    finally:
        a.close()
        store.close()
    after = scrape()
    assert after[("agentspec_client_calls_total", key(tenant, "P", "Plan"))] == 4
    # gauges of closed objects are gone
    assert ("agentspec_shard_tokens", key(tenant, "P", "Plan", kind="learned")) not in after


def test_untagged_calls_and_the_default_tenant_labels(server):
    before = scrape()
    untagged = key("default")
    with client_for(server, "default") as client:
        chat(client, "x")
        assert client.flush(WAIT)
        got = scrape()
    assert got[("agentspec_client_calls_total", untagged)] == (
        before.get(("agentspec_client_calls_total", untagged), 0) + 1
    )


def test_push_backlog_and_failures(server, tenant):
    good = ShardIntake()
    refusing = ShardIntake(api_key="right-key")
    worker, thread = serve_intake(good)
    bad, bad_thread = serve_intake(refusing)
    before = scrape()
    try:
        with client_for(server, tenant, push_to=worker.url) as client:
            chat(client, "push", stage="P")
            assert client.flush(WAIT)
            got = scrape()
        assert total(got, "agentspec_client_push_failures_total") == total(
            before, "agentspec_client_push_failures_total"
        )
        store = ShardStore()
        client = client_for(server, tenant, store=store, push_to=bad.url, push_api_key="wrong-key")
        try:
            chat(client, "refused", stage="P")
            assert client._core.recorder.flush(WAIT)  # learned; the push is refused
            assert wait_for(lambda: client._core.pusher.status()[bad.url].errors > 0), (
                client._core.pusher.status()
            )
            got = scrape()
            assert (
                total(got, "agentspec_client_push_failures_total")
                >= total(before, "agentspec_client_push_failures_total") + 1
            )
            assert total(got, "agentspec_client_push_backlog") >= 1  # never acknowledged
        finally:
            client.close(timeout=0.5)
            store.close()
    finally:
        worker.stop(thread)
        bad.stop(bad_thread)


@requires_redis_server
def test_publish_rows_and_the_subscriber(server, tenant):
    cfg = FleetConfig(max_depth=16, max_shard_tokens=None)
    with RedisServer() as redis:
        store = ShardStore(
            redis=FleetOptions(redis.url, config=cfg, durable_after=0, close_timeout=5)
        )
        from agentspec._fleet.sub import FleetSubscriber

        sub = FleetSubscriber(redis.url, tenant, config=cfg, block_ms=100, heartbeat_s=0)
        try:
            before = scrape()
            with client_for(server, tenant, store=store) as client:
                for i in range(3):
                    chat(client, f"fleet {i}", stage="F")
                assert client.flush(WAIT)
                assert store.fleet is not None
                assert store.fleet.flush(WAIT)
                got = scrape()
                assert got[("agentspec_client_publish_backlog", frozenset())] == total(
                    before, "agentspec_client_publish_backlog"
                )
                assert (
                    total(got, "agentspec_fleet_published_total")
                    >= total(before, "agentspec_fleet_published_total") + 3
                )
            assert wait_for(lambda: sub.stats().applied >= 3)
            got = scrape()
            assert total(got, "agentspec_fleet_applied_total") >= 3
            fleet_key = key(tenant, "", "F", kind="fleet")
            assert got[("agentspec_shard_tokens", fleet_key)] == (
                sub.stats().shards[(tenant, None, "F")].tokens
            )
        finally:
            sub.close()
            store.close()


def test_serve_one_liner_serves_the_client_rows(server, tenant):
    httpd, thread = agentspec.metrics.serve(0)
    try:
        with client_for(server, tenant) as client:
            chat(client, "served", stage="Srv")
            url = f"http://127.0.0.1:{httpd.server_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as resp:
                text = resp.read().decode()
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)
    assert scrape(text)[("agentspec_client_calls_total", key(tenant, "", "Srv"))] == 1


_CHILD = """
import json, sys
from prometheus_client import generate_latest
from agentspec._client.client import AgentSpecClient

with AgentSpecClient(base_url=sys.argv[1], api_key="t", max_retries=0, timeout=10,
                     return_token_ids=True, lead_tokens=0) as client:
    for i in range(5):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "q"}], stage=f"stage-{i}")
    assert client.flush(30)
    text = generate_latest().decode()
print(json.dumps(text))
"""


@pytest.mark.parametrize(
    "env", [{"AGENTSPEC_METRICS_MAX_LABEL_VALUES": "3"}, {"AGENTSPEC_METRICS": "0"}]
)
def test_label_cap_and_off_switch(server, env):
    child_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHILD), server.base_url],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    got = scrape(json.loads(proc.stdout.strip().splitlines()[-1]))
    calls = {
        dict(labels)["stage"]: v
        for (n, labels), v in got.items()
        if n == "agentspec_client_calls_total"
    }
    if env.get("AGENTSPEC_METRICS") == "0":
        assert calls == {}
        assert not [n for n, _ in got if n.startswith("agentspec_")]
        return
    assert calls == {"stage-0": 1, "stage-1": 1, "stage-2": 1, "other": 2}
    overflow = {
        tuple(sorted(dict(labels).items())): v
        for (n, labels), v in got.items()
        if n == "agentspec_metrics_label_overflow_total"
    }
    assert overflow[(("label", "stage"), ("metric", "agentspec_client_calls_total"))] == 2
