"""Tenant isolation with least-privilege Redis ACL users, and secrets kept out of text.

Each tenant gets a Redis user limited to its own key prefix and to the
commands the fleet sends (``ACL SETUSER <t> on >pw`` + `tenant_acl_rules`,
after the admin loaded the function library): the fleet works for it, and
it can neither read another tenant's keys nor list, watch or block others.
A read-only replica user (``%R~`` on the prefix, ``%RW~`` on its two
heartbeat keys) follows the fleet, converges, and never writes shards,
config or the stream.
Passwords never appear in logs, errors (``last_error``) or reprs, over a
unix socket or TCP.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
from redis_server import RedisServer, redis, requires_redis_server

from agentspec.__main__ import main
from agentspec._fleet.config import FleetConfig
from agentspec._fleet.functions import LibraryMissingError, fcall, load_library
from agentspec._fleet.heartbeat import read_heartbeats
from agentspec._fleet.names import FleetKeys, tenant_acl_rules
from agentspec._fleet.pub import FleetPublisher, PublishStatus
from agentspec._fleet.scripts import MAX_BEATS
from agentspec._fleet.status import fleet_status
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
        load_library(admin)  # what `agentspec fleet setup` does
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
    rules = tenant_acl_rules("alice")
    assert rules[:4] == ["resetkeys", "~agentspec:{alice}:*", "resetchannels", "-@all"]
    assert "+fcall|agentspec_v1_xadd" in rules
    assert "+fcall_ro|agentspec_v1_read" in rules
    for bad in ("+@all", "+eval", "+evalsha", "+scan", "+keys", "+set", "+function", "+client"):
        assert bad not in rules
    ro = tenant_acl_rules("team a/b", read_only=True)
    assert ro[1:4] == [
        "%R~agentspec:{%7465616d20612f62}:*",
        "%RW~agentspec:{%7465616d20612f62}:sub:records",
        "%RW~agentspec:{%7465616d20612f62}:sub:expiry",
    ]
    assert [r for r in ro if r.startswith("+fcall|")] == ["+fcall|agentspec_v1_beat"]
    assert "+client|setname" not in ro


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
            lambda: plain.set(keys.prefix + "sub:x", b"x" * 100),
            lambda: plain.hset(keys.snap("ab"), "data", b"x"),
            lambda: fcall(plain, "init_config", [keys.meta], ["3", "none"]),
            lambda: fcall(plain, "xadd", [keys.meta, keys.log], ["16", "1000", "v", "1"]),
            lambda: fcall(plain, "lock", [keys.lock], ["t", 1000]),
            lambda: plain.eval("return 1", 0),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                write()
        plain.close()
    # Closing removes its heartbeat at once.
    assert admin.hexists(keys.beats, ro.id) == 0
    admin.close()
    assert READER_PW not in text


def _refused(call):
    with pytest.raises(redis.exceptions.NoPermissionError):
        call()


def test_a_hostile_tenant_can_neither_list_watch_nor_block_others(server):
    a_url = user_url(server, "alice")
    with FleetPublisher(a_url, config=CFG) as pub:
        pub.publish(("alice", "p", "s"), [1, 2, 3], "r1")
        assert pub.flush(WAIT)
    a, b = FleetKeys.of("alice"), FleetKeys.of("bob")
    bob = redis.Redis.from_url(user_url(server, "bob"))
    busy = "local i = 0 while true do i = i + 1 end"
    for cmd in (
        lambda: bob.scan(0),
        lambda: bob.randomkey(),
        lambda: bob.dbsize(),
        lambda: bob.keys("*"),
        lambda: bob.execute_command("CLIENT", "TRACKING", "on", "BCAST", "PREFIX", a.prefix),
        lambda: bob.execute_command("CLIENT", "LIST"),
        lambda: bob.execute_command("CLIENT", "KILL", "TYPE", "normal"),
        lambda: bob.execute_command("SCRIPT", "FLUSH"),
        lambda: bob.execute_command("FUNCTION", "FLUSH"),
        lambda: bob.execute_command("FUNCTION", "LOAD", "#!lua name=x\nreturn 1"),
        lambda: bob.execute_command("FUNCTION", "LIST"),
        lambda: bob.eval(busy, 0),
        lambda: bob.evalsha("0" * 40, 0),
        lambda: bob.set(b.prefix + "x", b"x"),
        lambda: bob.set(b.meta, b"x"),
        lambda: bob.config_get("*"),
        lambda: bob.info(),
        lambda: bob.flushall(),
        lambda: bob.publish("agentspec", "x"),
        lambda: fcall(bob, "read", [a.meta, a.log, a.index], ["0-0", 1, 1000, 1000, 0]),
        lambda: fcall(bob, "xadd", [a.meta, a.log], ["16", "1000", "v", "1"]),
        lambda: fcall(bob, "beat", [a.beats, a.beat_expiry], ["x", b"{}", 1000]),
    ):
        _refused(cmd)
    # Its own functions bound what it writes: the four entry fields only, at a bounded size.
    for args in (
        ["16", "1000", "v", "1", "k", "x", "i", "y", "d", "z", "e", "1"],
        ["16", "1000", "v", "1", "k", "x", "i", "y", "v", "z"],
        ["16", "1000", "v", "1", "k", "x", "i", "y", "d", b"z" * (5 << 20)],
    ):
        with pytest.raises(redis.ResponseError, match="AGENTSPEC_ENTRY"):
            fcall(bob, "xadd", [b.meta, b.log], args)
    with pytest.raises(redis.ResponseError, match="AGENTSPEC_KEYS"):
        fcall(bob, "xadd", [b.meta, b.prefix + "other"], ["16", "1000"])
    with pytest.raises(redis.ResponseError, match="AGENTSPEC_ARGS"):
        fcall(bob, "beat", [b.beats, b.beat_expiry], ["x", b"y" * 5000, 1000])
    assert bob.ping()
    bob.close()
    admin = server.client()
    assert admin.xlen(b.log) == 0
    assert admin.xlen(a.log) == 1
    admin.close()


def test_every_part_of_the_fleet_runs_under_the_least_privilege_rules(server):
    url = user_url(server, "bob")
    key = ("bob", "p", "s")
    with (
        FleetPublisher(url, config=CFG, durable_after=0.2) as pub,
        FleetSubscriber(url, "bob", config=CFG, block_ms=100, compact_every=4) as sub,
    ):
        for i in range(12):
            assert pub.publish(key, [i, 5, 6], f"r{i}") is PublishStatus.QUEUED
        assert pub.flush(WAIT, durable=True)  # VERIFY and CLIENT GETNAME / SETNAME
        assert pub.stats().durable == 12
        assert sub.wait_for(pub.last_id, WAIT)
        assert sub.compact() is not None
        for i in range(12, 16):
            assert pub.publish(key, [i, 5, 6], f"r{i}") is PublishStatus.QUEUED
        assert pub.flush(WAIT, durable=True)
        assert sub.wait_for(pub.last_id, WAIT)
        assert sub.compact() is not None  # the second round trims behind the first
        assert sub.wait_until(lambda: sub.stats().heartbeats >= 1, WAIT)
        status = fleet_status(url, ["bob"], WAIT)["tenants"]["bob"]
        assert status["shards"][0]["sequences"] == 16
        assert status["stream"]["trimmed"] != "0-0"
        assert [s["id"] for s in status["subscribers"]] == [sub.id]
        assert status["subscribers"][0]["config_mismatch"] is False
        assert status["malformed_heartbeats"] == 0
        assert sub.stats().last_error is None
        assert pub.stats().rejected == 0


def test_malformed_and_oversize_heartbeats_are_shown_as_such_and_never_fetched(server):
    keys = FleetKeys.of("alice")
    url = user_url(server, "alice")
    admin = server.client()
    with FleetPublisher(url, config=CFG) as pub:
        pub.publish(("alice", "p", "s"), [1, 2, 3], "r1")
        assert pub.flush(WAIT)
    good = dict(  # noqa: C408
        id="ok", name="n", host="h", pid=1, position="1-0", head="1-0", lag_ms=0, applied=1,
        malformed=0, loads=1, reconnects=0, compacts=True, depth=7, budget=None, at_ms=1,
    )  # fmt: skip
    records = {
        "ok": json.dumps(good),
        "garbage": json.dumps({**good, "id": "garbage", "position": "garbage"}),
        "notjson": "{",
        "deep": "[" * 3000,
        "big": "x" * (8 << 20),
    }
    for rid, rec in records.items():
        admin.hset(keys.beats, rid, rec)
        admin.zadd(keys.beat_expiry, {rid: int(time.time() * 1000) + 600_000})
    sent = admin.info("stats")["total_net_output_bytes"]
    status = fleet_status(url, ["alice"], WAIT)["tenants"]["alice"]
    assert admin.info("stats")["total_net_output_bytes"] - sent < 1 << 20  # "big" never read
    assert [s["id"] for s in status["subscribers"]] == ["ok"]
    assert status["subscribers"][0]["config_mismatch"] is True  # depth 7, the tenant's is 16
    bad = {r["id"]: r for r in status["malformed_heartbeat_records"]}
    assert set(bad) == {"garbage", "notjson", "deep", "big"}
    assert bad["big"]["bytes"] == 8 << 20
    assert "stream id" in bad["garbage"]["reason"]
    assert status["malformed_heartbeats"] == 4
    assert main(["fleet", "status", "--redis", url, "--tenant", "alice"]) == 0
    # A subscriber's next beats prune the oversize record (bounded work per beat).
    with FleetSubscriber(url, "alice", config=CFG, block_ms=100, heartbeat_s=0.05) as sub:
        assert sub.wait_until(lambda: admin.hexists(keys.beats, "big") == 0, WAIT)
    # Heartbeat keys of the wrong type: reported, status still answers.
    admin.delete(keys.beats)
    admin.set(keys.beats, b"x")
    status = fleet_status(url, ["alice"], WAIT)["tenants"]["alice"]
    assert status["subscribers"] == []
    assert status["malformed_heartbeats"] == 1
    admin.close()


def test_heartbeats_expire_and_are_capped_per_tenant(server):
    keys = FleetKeys.of("bob")
    admin = server.client()
    args = [keys.beats, keys.beat_expiry]
    fcall(admin, "beat", args, ["short", b"{}", 1])
    assert admin.hexists(keys.beats, "short")
    n = 0
    while admin.hexists(keys.beats, "short"):  # pruned by the next beat once expired
        fcall(admin, "beat", args, [f"f{n}", b"{}", 60_000])
        n += 1
        assert n < 10_000
    for i in range(MAX_BEATS - admin.hlen(keys.beats)):
        fcall(admin, "beat", args, [f"x{i}", b"{}", 60_000])
    with pytest.raises(redis.ResponseError, match="AGENTSPEC_FULL"):
        fcall(admin, "beat", args, ["one-more", b"{}", 60_000])
    fcall(admin, "beat", args, ["x0", b"{}", 60_000])  # renewing an existing one is fine
    assert admin.hlen(keys.beats) == MAX_BEATS
    admin.close()


def test_the_library_is_loaded_by_admins_and_named_to_tenants(server):
    admin = server.client()
    admin.function_flush()
    url = user_url(server, "alice")
    with FleetSubscriber(url, "alice", config=CFG, block_ms=100, max_backoff=0.1) as sub:
        assert sub.wait_until(
            lambda: "agentspec fleet setup" in (sub.stats().last_error or ""), WAIT
        )
        plain = redis.Redis.from_url(url)
        k = FleetKeys.of("alice")
        with pytest.raises(LibraryMissingError, match="agentspec fleet setup"):
            fcall(plain, "read", [k.meta, k.log, k.index], ["0-0", 1, 1000, 1000, 0])
        plain.close()
        # The default user (an admin) loads it on demand; the tenant then connects.
        keys = FleetKeys.of("alice")
        assert fcall(admin, "read", [keys.meta, keys.log, keys.index], ["0-0", 1, 9, 9, 0])[0] == 1
        assert sub.wait_until(lambda: sub.stats().connected, WAIT)
    admin.close()


def test_fleet_setup_loads_the_library_and_creates_the_users(server, tmp_path, capsys):
    admin = server.client()
    admin.function_flush()
    admin_url = f"unix://{server.socket}"
    assert main(["fleet", "setup", "--redis", admin_url, "--tenant", "carol"]) == 0
    out = capsys.readouterr().out
    assert "loaded function library agentspec_v1" in out
    assert "ACL SETUSER agentspec.carol reset on >PASSWORD resetkeys ~agentspec:{carol}:*" in out
    assert "ACL SETUSER agentspec-ro.carol " in out
    pw = tmp_path / "pw"
    pw.write_text("agentspec.carol carol-S3cret\n# reader\nagentspec-ro.carol carol-ro-S3cret\n")
    assert main(["fleet", "setup", "--redis", admin_url, "--tenant", "dave", "--apply",
                 "--password-file", str(pw)]) != 0  # fmt: skip
    assert "no password for agentspec.dave" in capsys.readouterr().err
    assert main(["fleet", "setup", "--redis", admin_url, "--tenant", "carol", "--apply",
                 "--password-file", str(pw)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "carol-S3cret" not in out
    assert "created 2 users" in out
    url = server.url_for("agentspec.carol", "carol-S3cret")
    ro_url = server.url_for("agentspec-ro.carol", "carol-ro-S3cret")
    key = ("carol", "p", "s")
    with (
        FleetPublisher(url, config=CFG) as pub,
        FleetSubscriber(ro_url, "carol", config=CFG, block_ms=100) as ro,
    ):
        pub.publish(key, [1, 2, 3], "r1")
        assert pub.flush(WAIT)
        assert ro.wait_for(pub.last_id, WAIT)
        assert ro.wait_until(lambda: ro.stats().heartbeats >= 1, WAIT)
        assert len(ro.tree(key)) == 1
    admin.close()
