"""Tenant isolation with Redis ACL users, and secrets kept out of text.

Each tenant gets a Redis user limited to its own key prefix
(``ACL SETUSER <t> on >pw`` + `tenant_acl_rules`): the fleet works for it,
and it cannot read another tenant's keys.  A read-only replica user
(``%R~`` on the prefix, ``%RW~`` on its heartbeat keys only) follows the
fleet, converges, and never writes shards, config or the stream.
Passwords never appear in logs, errors (``last_error``) or reprs, over a
unix socket or TCP.
"""

from __future__ import annotations

import logging

import pytest
from redis_server import RedisServer, redis, requires_redis_server

from agentspec._fleet.config import FleetConfig
from agentspec._fleet.heartbeat import read_heartbeats
from agentspec._fleet.names import FleetKeys, tenant_acl_rules
from agentspec._fleet.pub import FleetPublisher, PublishStatus
from agentspec._fleet.sub import FleetSubscriber

pytestmark = requires_redis_server

CFG = FleetConfig(max_depth=16, max_shard_tokens=1000)
WAIT = 30.0
PASSWORDS = {"alice": "alice-S3cret-pw", "bob": "bob-S3cret-pw", "team a/b": "ab-S3cret-pw"}
READER_PW = "reader-S3cret-pw"


@pytest.fixture
def server():
    with RedisServer(tcp=True) as s:
        admin = s.client()
        for tenant, pw in PASSWORDS.items():
            user = tenant.replace(" ", "_").replace("/", "_")
            admin.execute_command("ACL", "SETUSER", user, "on", f">{pw}", *tenant_acl_rules(tenant))
        rules = tenant_acl_rules("alice", read_only=True)
        admin.execute_command("ACL", "SETUSER", "alice_reader", "on", f">{READER_PW}", *rules)
        admin.close()
        yield s


def user_url(server, tenant, *, tcp=False, password=None):
    user = tenant.replace(" ", "_").replace("/", "_")
    return server.url_for(user, password or PASSWORDS[tenant], tcp=tcp)


def all_text(caplog, *objs):
    records = [f"{r.getMessage()} {r.__dict__}" for r in caplog.records]
    return "\n".join(records + [repr(o) for o in objs] + [str(o) for o in objs])


@pytest.mark.parametrize("tenant", ["alice", "team a/b"])
@pytest.mark.parametrize("tcp", [False, True])
def test_a_tenant_user_runs_its_own_fleet(server, tenant, tcp, caplog):
    caplog.set_level(logging.DEBUG, logger="agentspec")
    url = user_url(server, tenant, tcp=tcp)
    key = (tenant, "p", "s")
    with (
        FleetPublisher(url, config=CFG) as pub,
        FleetSubscriber(url, tenant, config=CFG, block_ms=100, compact_every=0) as sub,
    ):
        for i in range(10):
            assert pub.publish(key, [i, 1, 2], f"r{i}") is PublishStatus.QUEUED
        assert pub.flush(WAIT)
        assert sub.wait_for(pub.last_id, WAIT)
        assert len(sub.tree(key)) == 10
        assert sub.compact() is not None  # the Lua scripts run under the user too
        text = all_text(caplog, pub, sub, pub.stats(), sub.stats())
    assert PASSWORDS[tenant] not in text
    assert "***" in repr(sub)


def test_tenants_cannot_read_each_others_keys(server):
    url = user_url(server, "bob")
    with FleetPublisher(url, config=CFG) as pub:
        pub.publish(("bob", "p", "s"), [1, 2, 3], "r1")
        assert pub.flush(WAIT)
    alice = redis.Redis.from_url(user_url(server, "alice"))
    bob_keys = FleetKeys.of("bob")
    for read in (
        lambda: alice.xrange(bob_keys.log),
        lambda: alice.hgetall(bob_keys.meta),
        lambda: alice.xread({bob_keys.log: "0-0"}),
        lambda: alice.xadd(bob_keys.log, {"v": "1"}),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            read()
    alice.close()


def test_a_publisher_refused_for_a_tenant_drops_those_entries_only(server, caplog):
    caplog.set_level(logging.DEBUG, logger="agentspec")
    url = user_url(server, "alice")
    with (
        FleetPublisher(url, config=CFG) as pub,
        FleetSubscriber(url, "alice", config=CFG, block_ms=100, compact_every=0) as sub,
    ):
        assert pub.publish(("bob", "p", "s"), [1, 2], "r1") is PublishStatus.QUEUED
        assert pub.publish(("alice", "p", "s"), [1, 2], "r2") is PublishStatus.QUEUED
        assert pub.flush(WAIT)
        assert pub.stats().rejected == 1
        assert pub.stats().published == 1
        assert sub.wait_for(pub.last_id, WAIT)
        text = all_text(caplog, pub, sub)
    assert PASSWORDS["alice"] not in text


def test_wrong_or_foreign_credentials_are_retried_and_never_shown(server, caplog):
    caplog.set_level(logging.DEBUG, logger="agentspec")
    wrong = "wr0ng-S3cret-pw"
    subs = [
        FleetSubscriber(user_url(server, "alice", password=wrong), "alice", max_backoff=0.1),
        FleetSubscriber(user_url(server, "alice", tcp=True), "bob", max_backoff=0.1),
    ]
    try:
        for sub in subs:
            assert sub.wait_until(lambda s=sub: s.stats().last_error is not None, WAIT)
        assert "AuthenticationError" in subs[0].stats().last_error
        assert "NoPermissionError" in subs[1].stats().last_error
        assert all(not s.stats().connected for s in subs)
        text = all_text(caplog, *subs, *(s.stats() for s in subs))
    finally:
        for sub in subs:
            sub.close()
    for secret in (wrong, PASSWORDS["alice"]):
        assert secret not in text
    assert "agentspec fleet: subscriber error" in text


def test_acl_rules_name_only_the_tenants_prefix():
    assert tenant_acl_rules("alice") == [
        "resetkeys", "~agentspec:{alice}:*", "resetchannels", "+@all", "-@dangerous",
    ]  # fmt: skip
    ro = tenant_acl_rules("team a/b", read_only=True)
    assert ro[1:3] == [
        "%R~agentspec:{%7465616d20612f62}:*",
        "%RW~agentspec:{%7465616d20612f62}:sub:*",
    ]


def test_a_read_only_replica_follows_the_fleet_and_writes_nothing_else(server, caplog):
    caplog.set_level(logging.DEBUG, logger="agentspec")
    writer = user_url(server, "alice")
    reader = server.url_for("alice_reader", READER_PW)
    keys = FleetKeys.of("alice")
    key = ("alice", "p", "s")
    admin = server.client()
    with FleetSubscriber(reader, "alice", config=CFG, block_ms=100, compact_every=4) as ro:
        # Before any writer: the config is not written; the replica waits connected.
        assert ro.wait_until(lambda: ro.stats().connected and ro.stats().denied >= 1, WAIT)
        assert admin.exists(keys.meta) == 0
        with (
            FleetPublisher(writer, config=CFG) as pub,
            FleetSubscriber(writer, "alice", config=CFG, block_ms=100, compact_every=0) as rw,
        ):
            for i in range(12):
                pub.publish(key, [i, 7, 8, 9], f"r{i}")
            assert pub.flush(WAIT)
            assert ro.wait_for(pub.last_id, WAIT)
            assert rw.wait_for(pub.last_id, WAIT)
            # Its own compaction is refused (counted, turned off, never an error) ...
            assert ro.compact(timeout=WAIT) is None
            st = ro.stats()
            assert st.compacts is False
            assert st.last_error is None
            assert st.connected
            assert admin.hlen(keys.index) == 0
            beats_then = st.heartbeats
            # ... a writer compacts and trims; the reader follows through a reload.
            assert rw.compact() is not None
            for i in range(12, 20):
                pub.publish(key, [i, 7, 8, 9], f"r{i}")
            assert pub.flush(WAIT)
            assert rw.compact() is not None
            assert ro.wait_for(pub.last_id, WAIT)
            assert rw.wait_for(pub.last_id, WAIT)
            assert ro.tree(key).sequence_ids() == rw.tree(key).sequence_ids()
            assert len(ro.tree(key)) == 20
            # Its heartbeat is listed with the writer's.
            assert ro.wait_until(lambda: ro.stats().heartbeats > beats_then, WAIT)
            beats, bad = read_heartbeats(admin, keys)
            assert bad == 0
            assert {b.id for b in beats} >= {ro.id, rw.id}
            assert next(b for b in beats if b.id == ro.id).compacts is False
            text = all_text(caplog, ro, ro.stats())
        plain = redis.Redis.from_url(reader)
        for write in (
            lambda: plain.xadd(keys.log, {"v": "1"}),
            lambda: plain.hset(keys.meta, "depth", "3"),
            lambda: plain.delete(keys.snap("x")),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                write()
        plain.close()
    # Closing removes its heartbeat at once.
    assert admin.exists(keys.heartbeat(ro.id)) == 0
    admin.close()
    assert READER_PW not in text
