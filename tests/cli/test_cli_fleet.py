"""``agentspec fleet status`` on a populated fleet log (a real redis-server), password redacted."""

from __future__ import annotations

import json
import time

import pytest
from redis_server import RedisServer, requires_redis_server

from agentspec.__main__ import main
from agentspec._fleet.config import FleetConfig
from agentspec._fleet.functions import load_library
from agentspec._fleet.names import tenant_acl_rules
from agentspec._fleet.pub import FleetPublisher, PublishStatus
from agentspec._fleet.sub import FleetSubscriber

pytestmark = requires_redis_server

CFG = FleetConfig(max_depth=16, max_shard_tokens=1000)
PASSWORD = "fleet-S3cret-pw"
WAIT = 30.0


@pytest.fixture(scope="module")
def populated():
    """Tenant ``alice``: two shards, one compacted into a snapshot, one more entry after it."""
    with RedisServer(tcp=True) as server:
        admin = server.client()
        load_library(admin)  # what `agentspec fleet setup` does
        admin.execute_command(
            "ACL", "SETUSER", "alice", "on", f">{PASSWORD}", *tenant_acl_rules("alice")
        )
        admin.close()
        url = server.url_for("alice", PASSWORD, tcp=True)
        with (
            FleetPublisher(url, config=CFG) as pub,
            FleetSubscriber(url, "alice", config=CFG) as sub,
        ):
            for i in range(3):
                assert (
                    pub.publish(("alice", "p", "plan"), [1, 2, 3, i], f"r{i}")
                    is PublishStatus.QUEUED
                )
            assert pub.flush(WAIT)
            assert pub.last_id is not None
            assert sub.wait_for(pub.last_id, WAIT)
            assert sub.compact(WAIT) is not None
            assert pub.publish(("alice", "p", "act"), [7, 8, 9], "r9") is PublishStatus.QUEUED
            assert pub.flush(WAIT)
            last = pub.last_id
        yield server, url, last


def test_status_json(populated, capsys):
    _, url, last = populated
    assert main(["fleet", "status", "--redis", url, "--tenant", "alice", "--json"]) == 0
    out = capsys.readouterr().out
    assert PASSWORD not in out
    status = json.loads(out)
    assert "***" in status["redis"]
    alice = status["tenants"]["alice"]
    assert alice["exists"]
    assert alice["stream"]["last_id"] == last
    shards = {tuple(s["key"]): s for s in alice["shards"]}
    plan, act = shards[("alice", "p", "plan")], shards[("alice", "p", "act")]
    assert (plan["sequences"], plan["tokens"]) == (3, 12)
    assert (act["sequences"], act["tokens"]) == (1, 3)
    assert act["last_id"] == last
    assert plan["covered"] is not None
    assert plan["snapshot_age_s"] >= 0
    assert plan["snapshot_lag_ms"] >= 0
    assert act["covered"] is None
    assert act["snapshot_lag_ms"] is None


def test_status_table_and_missing_tenant(populated, capsys, monkeypatch):
    _, url, last = populated
    monkeypatch.setenv("AGENTSPEC_REDIS_URL", url)
    assert main(["fleet", "status", "--tenant", "alice"]) == 0
    out = capsys.readouterr().out
    assert PASSWORD not in out
    assert "alice:***@" in out
    assert f"last id {last}" in out
    lines = [ln.split() for ln in out.splitlines()]
    assert next(ln[:4] for ln in lines if ln[:2] == ["p", "plan"]) == ["p", "plan", "3", "12"]
    assert ["p", "act", "1", "3", last, "-"] == next(
        ln[:6] for ln in lines if ln[:2] == ["p", "act"]
    )
    # A tenant alice may not read: the error is reported, the password is not.
    assert main(["fleet", "status", "--tenant", "bob"]) == 1
    captured = capsys.readouterr()
    assert PASSWORD not in captured.out + captured.err
    assert "***" in captured.err


def test_status_redis_down_is_redacted(capsys):
    url = f"redis://alice:{PASSWORD}@127.0.0.1:1/0"
    assert main(["fleet", "status", "--redis", url]) == 1
    err = capsys.readouterr().err
    assert PASSWORD not in err
    assert "alice:***@" in err


def test_serve_ready_line_redacts_the_redis_password(capsys, monkeypatch):
    monkeypatch.delenv("AGENTSPEC_REDIS_URL", raising=False)
    url = f"redis://eng:{PASSWORD}@127.0.0.1:1/0"
    argv = ["serve", "smollm2-135m", "--engine", "embedded", "--dry-run"]
    assert main([*argv, "--redis", url, "--fleet-tenants", "a,b"]) == 0
    out = capsys.readouterr().out
    assert "fleet: redis://eng:***@127.0.0.1:1/0, tenants a,b" in out
    assert PASSWORD not in out
    monkeypatch.setenv("AGENTSPEC_REDIS_URL", url)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tenants default" in out
    assert PASSWORD not in out
    monkeypatch.delenv("AGENTSPEC_REDIS_URL")
    assert main([*argv, "--fleet-tenants", "a"]) == 1  # needs --redis
    assert main(["serve", "m", "--engine", "vllm", "--redis", url, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "AGENTSPEC_VLLM_REDIS_URL='redis://eng:***@127.0.0.1:1/0'" in out
    assert PASSWORD not in out


def test_status_lists_live_subscribers_with_their_lag(populated, capsys):
    _, url, _ = populated
    with (
        FleetPublisher(url, config=CFG) as pub,
        FleetSubscriber(url, "alice", name="replica-a", block_ms=100) as a,
        FleetSubscriber(url, "alice", name="replica-b", block_ms=100) as b,
    ):
        assert pub.publish(("alice", "p", "act"), [4, 5, 6], "r10") is PublishStatus.QUEUED
        assert pub.flush(WAIT)
        assert a.wait_for(pub.last_id, WAIT)
        assert b.wait_for(pub.last_id, WAIT)
        beats = b.stats().heartbeats
        assert b.wait_until(lambda: b.stats().heartbeats > beats, WAIT)  # one at this position
        assert b.pause(WAIT)  # b stops reading (and beating) here
        held = b.stats().position
        while int(time.time() * 1000) <= int(held.split("-")[0]):
            pass  # the next entry gets a later millisecond
        assert pub.publish(("alice", "p", "act"), [4, 5, 7], "r11") is PublishStatus.QUEUED
        assert pub.flush(WAIT)
        assert a.wait_for(pub.last_id, WAIT)
        n = a.stats().heartbeats
        assert a.wait_until(lambda: a.stats().heartbeats > n, WAIT)
        assert main(["fleet", "status", "--redis", url, "--tenant", "alice", "--json"]) == 0
        subs = {
            s["name"]: s
            for s in json.loads(capsys.readouterr().out)["tenants"]["alice"]["subscribers"]
        }
        assert set(subs) == {"replica-a", "replica-b"}  # status's own reader never beats
        assert subs["replica-a"]["position"] == pub.last_id
        assert subs["replica-a"]["behind_ms"] == 0
        assert subs["replica-a"]["lag_ms"] == 0
        assert subs["replica-b"]["position"] == held
        assert subs["replica-b"]["behind_ms"] >= 1
        assert subs["replica-a"]["compacts"]
        assert subs["replica-a"]["seen_s_ago"] >= 0
        assert main(["fleet", "status", "--redis", url, "--tenant", "alice"]) == 0
        out = capsys.readouterr().out
        assert "subscribers: 2" in out
        assert "replica-b" in out
        assert PASSWORD not in out
        b.resume()
        b.close()
        assert main(["fleet", "status", "--redis", url, "--tenant", "alice", "--json"]) == 0
        subs = json.loads(capsys.readouterr().out)["tenants"]["alice"]["subscribers"]
        assert [s["name"] for s in subs] == ["replica-a"]  # a closed one leaves at once
