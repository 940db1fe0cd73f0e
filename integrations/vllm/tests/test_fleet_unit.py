"""The proposer in a fleet: drafts from the shards other workers published to Redis.

Driven without vLLM (the `Loop` runner stand-in of test_proposer_unit) against a
real ``redis-server`` (tests/redis_server.py).  Waits are on the subscriber's
applied stream id or its change notifications, never fixed sleeps.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# tests/redis_server.py skips without the redis client or server, except under CI
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from agentspec_vllm.config import load_config
from agentspec_vllm.fleet import WorkerFleet
from agentspec_vllm.proposer import AgentSpecProposer
from agentspec_vllm.shards import reset_worker_intake
from redis_server import RedisServer, requires_redis_server
from test_proposer_unit import ANSWER, BEST, PROMPT, Loop, vllm_config

from agentspec._fleet.names import FleetKeys
from agentspec.exceptions import InvalidArgumentError
from agentspec.fleet import FleetConfig, FleetPublisher, tenant_acl_rules

pytestmark = requires_redis_server

KEY = ("default", "t2s", "SQL")
WAIT = 30.0


@pytest.fixture(autouse=True)
def fresh_intake() -> Iterator[None]:
    reset_worker_intake()
    yield
    reset_worker_intake()


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def _proposer(url: str, **agentspec: Any) -> AgentSpecProposer:
    return AgentSpecProposer(vllm_config(redis_url=url, **agentspec))


def _serve(proposer: AgentSpecProposer, req_id: str, **tags: Any) -> tuple[Loop, int]:
    """Run one request to its end and sweep it out (learned and published)."""
    loop = Loop(proposer)
    steps = loop.run(req_id, PROMPT, ANSWER, pipeline="t2s", stage="SQL", **tags)
    loop.step()
    return loop, steps


def _published_id(proposer: AgentSpecProposer) -> str:
    fleet = proposer.fleet
    assert fleet is not None
    assert fleet.publisher.flush(WAIT), fleet.stats()
    last = fleet.publisher.last_id
    assert last is not None
    return last


def _subscribed(proposer: AgentSpecProposer, tenant: str = "default") -> Any:
    fleet = proposer.fleet
    assert fleet is not None
    sub = fleet.subscribe(tenant)
    assert sub is not None
    return sub


def test_a_response_finished_on_one_worker_is_drafted_by_another(server: RedisServer) -> None:
    a = _proposer(server.url)
    b = _proposer(server.url)
    try:
        _, first = _serve(a, "req-a")
        assert first == len(ANSWER)  # nothing to draft from yet
        assert a.stats()["keys"][0]["published"] == 1
        stream_id = _published_id(a)
        assert _subscribed(b).wait_for(stream_id, WAIT)
        loop, second = _serve(b, "req-b")
        # b learned nothing itself: every right draft came from the fleet tree.
        assert second == BEST
        entry = b.stats()["keys"][0]
        assert entry["sources"].get("extra", 0) >= 1
        assert entry["accepted_tokens"] == loop.accepted["req-b"] == len(ANSWER) - BEST
    finally:
        a.close()
        b.close()


def test_a_read_only_replica_drafts_from_the_fleet_and_publishes_nothing(
    server: RedisServer,
) -> None:
    admin = server.client()
    rules = tenant_acl_rules("default", read_only=True)
    admin.execute_command("ACL", "SETUSER", "replica", "on", ">ro-S3cret", *rules)
    a = _proposer(server.url)
    b = _proposer(server.url_for("replica", "ro-S3cret"), fleet_publish=False)
    try:
        assert b.fleet is not None
        assert b.fleet.publisher is None
        _serve(a, "req-a")
        stream_id = _published_id(a)
        assert _subscribed(b).wait_for(stream_id, WAIT)
        _, second = _serve(b, "req-b")
        assert second == BEST  # drafted from the fleet tree
        assert b.stats()["keys"][0]["published"] == 0
        stats = b.fleet.stats()
        assert stats["publisher"] is None
        assert stats["tenants"]["default"]["last_error"] is None
        assert admin.xlen(FleetKeys.of("default").log) == 1  # a's response only
        assert "ro-S3cret" not in json.dumps(stats)
    finally:
        a.close()
        b.close()
        admin.close()


def test_the_first_request_of_a_tenant_starts_its_subscriber(server: RedisServer) -> None:
    a = _proposer(server.url, fleet_max_tenants=1)
    try:
        fleet = a.fleet
        assert fleet is not None
        assert fleet.subscriber("acme") is None
        _serve(a, "r1", tenant="acme")
        assert fleet.subscriber("acme") is not None
        _serve(a, "r2", tenant="other")  # over fleet_max_tenants: served, not subscribed
        assert fleet.subscriber("other") is None
        assert fleet.stats()["refused_tenants"] == 1
    finally:
        a.close()


def test_a_response_published_by_worker_and_client_is_learned_once(server: RedisServer) -> None:
    a = _proposer(server.url)
    b = _proposer(server.url)
    client = FleetPublisher(server.url)
    try:
        _serve(a, "vllm-internal-id", request_id="call-42")
        worker_id = _published_id(a)
        # The client side publishes what it learns: the prompt's last lead_tokens
        # (8 by default on both sides) followed by the output, under the same identity.
        lead = PROMPT[-a.config.lead_tokens :]
        client.publish(KEY, lead + ANSWER, "call-42")
        assert client.flush(WAIT)
        client_id = client.last_id
        assert client_id is not None
        assert client_id != worker_id
        sub = _subscribed(b)
        assert sub.wait_for(client_id, WAIT)
        stats = sub.stats()
        shard = stats.shards[KEY]
        assert (shard.sequences, shard.applied, shard.duplicates) == (1, 1, 1)
        # Another identity is another request: its tokens count again.
        client.publish(KEY, lead + ANSWER, "call-43")
        assert client.flush(WAIT)
        assert client.last_id is not None
        assert sub.wait_for(client.last_id, WAIT)
        assert sub.stats().shards[KEY].sequences == 2
    finally:
        client.close()
        a.close()
        b.close()


def test_without_a_client_request_id_the_vllm_id_is_the_identity(server: RedisServer) -> None:
    a = _proposer(server.url)
    client = FleetPublisher(server.url)
    try:
        _serve(a, "cmpl-7")
        _published_id(a)
        lead = PROMPT[-a.config.lead_tokens :]
        client.publish(KEY, lead + ANSWER, "cmpl-7")
        assert client.flush(WAIT)
        assert client.last_id is not None
        sub = _subscribed(a)
        assert sub.wait_for(client.last_id, WAIT)
        assert sub.stats().shards[KEY].duplicates == 1
    finally:
        client.close()
        a.close()


def test_redis_killed_mid_run_drafting_and_serving_continue(server: RedisServer) -> None:
    a = _proposer(server.url)
    b = _proposer(server.url)
    try:
        _serve(a, "req-a")
        stream_id = _published_id(a)
        sub = _subscribed(b)
        assert sub.wait_for(stream_id, WAIT)
        server.kill()
        assert sub.wait_until(lambda: not sub.stats().connected, WAIT)
        # The fleet tree b already holds keeps drafting; finishing publishes into
        # the queue (never waiting on Redis).
        _, steps = _serve(b, "req-b")
        assert steps == BEST
        _, again = _serve(b, "req-c")
        assert again == BEST
        fleet = b.fleet
        assert fleet is not None
        assert fleet.published == 2
        assert fleet.publisher.stats().pending >= 1
        # Redis back: the queued responses go out.
        server.start()
        assert fleet.publisher.flush(WAIT), fleet.stats()
    finally:
        a.close()
        b.close()


def test_the_password_never_shows(server: RedisServer) -> None:
    with server.client() as admin:
        admin.execute_command("ACL", "SETUSER", "w", "on", ">s3cr3t-pw", "resetkeys", "~*", "+@all")
    url = server.url_for("w", "s3cr3t-pw")
    a = _proposer(url)
    try:
        _serve(a, "req-a")
        stream_id = _published_id(a)  # the credentials work
        sub = _subscribed(a)
        assert sub.wait_for(stream_id, WAIT)
        server.kill()
        assert sub.wait_until(lambda: sub.stats().last_error is not None, WAIT)
        text = json.dumps(a.stats()) + repr(a.config) + repr(sub) + repr(a.fleet.publisher)  # type: ignore[union-attr]
        assert "s3cr3t-pw" not in text
        assert "***" in json.dumps(a.stats()["config"])
    finally:
        a.close()


def test_fleet_settings() -> None:
    env = {
        "AGENTSPEC_VLLM_REDIS_URL": "redis://u:pw@h:6379/0",
        "AGENTSPEC_VLLM_FLEET_MAX_TENANTS": "3",
    }
    config = load_config({}, env)
    assert config.redis_url == "redis://u:pw@h:6379/0"
    assert config.fleet_max_tenants == 3
    assert config.public()["redis_url"] == "redis://u:***@h:6379/0"
    assert "pw" not in repr(config)
    assert load_config({}, {}).redis_url is None
    with pytest.raises(InvalidArgumentError, match="redis_url"):
        load_config({"agentspec": {"redis_url": "http://h"}}, {})
    with pytest.raises(InvalidArgumentError, match="fleet_max_tenants"):
        load_config({"agentspec": {"fleet_max_tenants": 0}}, {})
    config = load_config({"agentspec": {"fleet_max_shard_tokens": "none"}}, {})
    assert config.fleet_max_shard_tokens is None


def test_vllm_args_emits_the_redis_url_in_the_environment() -> None:
    from agentspec._cli.vllm import REDIS_URL_ENV, vllm_launch

    launch = vllm_launch(redis_url="unix:///tmp/r.sock", environ={})
    assert launch.env[REDIS_URL_ENV] == "unix:///tmp/r.sock"
    assert not any("unix:///tmp/r.sock" in a for a in launch.args)
    assert load_config({}, launch.env).redis_url == "unix:///tmp/r.sock"
    with pytest.raises(InvalidArgumentError, match="--redis"):
        vllm_launch(redis_url="http://h", environ={})


def test_the_redis_url_from_a_file(tmp_path: Path) -> None:
    from agentspec._cli.vllm import REDIS_URL_FILE_ENV, vllm_launch

    url = "redis://u:pw-S3cret@h:6379/0"
    secret = tmp_path / "url"
    secret.write_text(f"\n {url} \n")
    secret.chmod(0o600)
    launch = vllm_launch(redis_url_file=str(secret), environ={})
    assert launch.env[REDIS_URL_FILE_ENV] == str(secret)
    assert "pw-S3cret" not in json.dumps([launch.env, launch.args])
    config = load_config({}, launch.env)
    assert config.redis_url == url
    assert "pw-S3cret" not in repr(config) + json.dumps(config.public())
    # the additional config's key wins over the file; both variables: refused
    assert load_config({"agentspec": {"redis_url": "unix:///r"}}, launch.env).redis_url == (
        "unix:///r"
    )
    both = {**launch.env, "AGENTSPEC_VLLM_REDIS_URL": url}
    with pytest.raises(InvalidArgumentError, match="not both"):
        load_config({}, both)
    secret.chmod(0o644)  # every local user could read the password: refused
    with pytest.raises(InvalidArgumentError, match="mode 0644") as info:
        load_config({}, launch.env)
    assert "pw-S3cret" not in str(info.value)
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        load_config({}, {REDIS_URL_FILE_ENV: str(tmp_path / "missing")})


def test_a_worker_joins_the_fleet_named_by_a_url_file(
    server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with server.client() as admin:
        admin.execute_command("ACL", "SETUSER", "w", "on", ">f1le-pw", "resetkeys", "~*", "+@all")
    secret = tmp_path / "url"
    secret.write_text(server.url_for("w", "f1le-pw") + "\n")
    secret.chmod(0o600)
    monkeypatch.delenv("AGENTSPEC_VLLM_REDIS_URL", raising=False)
    monkeypatch.setenv("AGENTSPEC_VLLM_REDIS_URL_FILE", str(secret))
    a = AgentSpecProposer(vllm_config())
    try:
        _serve(a, "req-a")
        assert _published_id(a)
        assert "f1le-pw" not in json.dumps(a.stats()) + repr(a.config)
    finally:
        a.close()


def test_no_redis_url_no_fleet() -> None:
    proposer = AgentSpecProposer(vllm_config())
    assert proposer.fleet is None
    assert proposer.stats()["fleet"] is None


def test_publish_never_raises() -> None:
    fleet = WorkerFleet("unix:///nonexistent/r.sock", FleetConfig(), max_tenants=1)
    try:
        assert not fleet.publish(KEY, [], "id")  # empty: refused, counted
        assert not fleet.publish(KEY, [1, 2], "")  # bad identity
        assert fleet.publish(KEY, [1, 2], "id")  # queued though Redis is unreachable
        assert fleet.dropped == 2
    finally:
        fleet.close(timeout=0.5)


def test_fleet_metrics_lag_per_applied_entry_and_snapshot_age(server: RedisServer) -> None:
    from agentspec.metrics import FLEET_LAG_SECONDS_BUCKETS

    cfg = FleetConfig(max_depth=16, max_shard_tokens=1000)
    wf = WorkerFleet(server.url, cfg, block_ms=100, compact_every=0)
    try:
        sub = wf.subscribe("default")
        assert sub is not None
        assert wf.metrics(FLEET_LAG_SECONDS_BUCKETS)["snapshot_age"] == {}  # none yet
        with FleetPublisher(server.url, config=cfg) as pub:
            for i in range(3):
                pub.publish(KEY, [i, 1, 2, 3], f"r{i}")
            assert pub.flush(WAIT)
            assert sub.wait_for(pub.last_id, WAIT)
        first = wf.metrics(FLEET_LAG_SECONDS_BUCKETS)
        # one observation per applied entry, not per collection: a second call adds none
        assert sum(first["lag"]["counts"]) == first["applied"] == 3
        second = wf.metrics(FLEET_LAG_SECONDS_BUCKETS)
        assert second["lag"] == first["lag"]
        assert len(first["lag"]["counts"]) == len(FLEET_LAG_SECONDS_BUCKETS) + 1
        assert sub.compact() is not None
        ages = wf.metrics(FLEET_LAG_SECONDS_BUCKETS)["snapshot_age"]
        assert list(ages) == ["default"]
        assert 0 <= ages["default"] < 30
        with pytest.raises(InvalidArgumentError):
            wf.metrics((1.0, 2.0))
    finally:
        wf.close()
