"""The fleet over TLS (``rediss://``) against a real redis-server with a TLS port.

A publisher, a subscriber and ``agentspec fleet status`` work over
``rediss://`` with the CA named in the URL (``?ssl_ca_certs=``); a client
that does not trust the server's certificate fails to connect, keeps
retrying, and reports the certificate error with no password in it.
"""

from __future__ import annotations

import json
import logging

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
PASSWORD = "tls-S3cret-pw"
WAIT = 30.0


@pytest.fixture(scope="module")
def server():
    with RedisServer(tls=True) as s:
        admin = s.client()
        load_library(admin)  # what `agentspec fleet setup` does
        admin.execute_command(
            "ACL", "SETUSER", "alice", "on", f">{PASSWORD}", *tenant_acl_rules("alice")
        )
        admin.close()
        yield s


def test_publish_subscribe_and_status_over_rediss(server, capsys):
    url = server.url_for("alice", PASSWORD)
    assert url.startswith("rediss://")
    key = ("alice", "sql", "gen")
    with (
        FleetPublisher(url, config=CFG) as pub,
        FleetSubscriber(url, "alice", config=CFG, block_ms=100, name="tls-replica") as sub,
    ):
        for i in range(5):
            assert pub.publish(key, [i, 3, 4, 5], f"r{i}") is PublishStatus.QUEUED
        assert pub.flush(WAIT)
        assert sub.wait_for(pub.last_id, WAIT)
        assert len(sub.tree(key)) == 5
        n = sub.stats().heartbeats
        assert sub.wait_until(lambda: sub.stats().heartbeats > n, WAIT)
        assert main(["fleet", "status", "--redis", url, "--tenant", "alice", "--json"]) == 0
        out = capsys.readouterr().out
    alice = json.loads(out)["tenants"]["alice"]
    assert alice["stream"]["last_id"] == pub.last_id
    assert [s["sequences"] for s in alice["shards"]] == [5]
    assert [s["name"] for s in alice["subscribers"]] == ["tls-replica"]
    assert PASSWORD not in out


def test_an_untrusted_certificate_is_retried_and_reported_without_the_password(server, caplog):
    caplog.set_level(logging.DEBUG, logger="agentspec")
    url = server.url_for("alice", PASSWORD).split("?", 1)[0]  # no CA: the system's, which fail
    with FleetSubscriber(url, "alice", config=CFG, max_backoff=0.1) as sub:
        assert sub.wait_until(lambda: (sub.stats().last_error or "").count("CERTIFICATE") > 0, WAIT)
        assert not sub.stats().connected
        text = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
        text += repr(sub) + str(sub.stats())
    assert PASSWORD not in text
    assert "alice:***@" in repr(sub)
    # A plain redis:// client to the TLS port fails too, never hangs.
    plain = "redis://" + url.removeprefix("rediss://")
    with FleetSubscriber(plain, "alice", config=CFG, max_backoff=0.1) as sub:
        assert sub.wait_until(lambda: sub.stats().last_error is not None, WAIT)
        assert not sub.stats().connected
