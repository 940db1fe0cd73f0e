"""A hostile tenant, damaged metadata and a Redis that lost everything, on a real redis-server.

Each test is one attack or failure an outside review made, turned into a
regression test:

- an entry whose key is ``'[' * 100000`` (it used to raise RecursionError
  and wedge every replica at that position): counted as malformed and
  skipped, on a running subscriber and on a fresh one, and compaction goes on;
- arbitrary bytes in every field (hypothesis): the subscriber always advances
  past the entry and applies the good entry after it;
- damaged metadata (a non-UTF-8 shard name in the index, nested JSON in a
  snapshot's key, a garbage ``round``, a garbage ``depth``/``budget``,
  metadata keys of the wrong type): counted, and everything else proceeds;
- entries far over the size limit are never fetched, and one read holds at
  most its byte budget (measured with tracemalloc);
- lag is wall time since the oldest unapplied entry;
- a read-only replica that started with its own depth or budget before any
  writer rebuilds to the tenant's config once a writer sets it;
- Redis restarted with an empty dataset: a replica re-seeds it, every
  replica converges on the old data plus the new, and a replica started
  after that drafts from it.

Waits are events with timeouts (`FleetSubscriber.wait_until`).
"""

from __future__ import annotations

import array
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_server import RedisServer, requires_redis_server

from agentspec._fleet.config import FleetConfig
from agentspec._fleet.entry import BadEntryError, FleetEntry, decode_entry
from agentspec._fleet.names import FleetKeys, shard_name, tenant_acl_rules
from agentspec._fleet.pub import FleetPublisher
from agentspec._fleet.sub import FleetSubscriber
from agentspec.exceptions import InvalidArgumentError

pytestmark = requires_redis_server

TENANT = "acme"
CFG = FleetConfig(max_depth=16, max_shard_tokens=1000)
KEYS = FleetKeys.of(TENANT)
KEY = (TENANT, "p", "s")
WAIT = 30.0


@pytest.fixture(scope="module")
def server():
    with RedisServer(tcp=True) as s:
        yield s


@pytest.fixture
def admin(server):
    c = server.client()
    c.flushall()
    yield c
    c.close()


def subscriber(url, **kw):
    kw.setdefault("config", CFG)
    kw.setdefault("compact_every", 0)
    return FleetSubscriber(url, TENANT, block_ms=100, max_backoff=0.2, **kw)


def good(identity, tokens=(1, 2, 3), key=KEY, depth=16):
    return FleetEntry.make(key, identity, array.array("i", tokens)).fields(depth)


def contents(sub):
    return {k: sorted(t.sequence(i) for i in t.sequence_ids()) for k, t in sub.trees().items()}


def wait_applied(sub, admin, timeout=WAIT):
    last = admin.xrevrange(KEYS.log, count=1)[0][0]
    assert sub.wait_for(last, timeout), sub.stats()


# --- row 1: a poison key, and arbitrary bytes in every field ------------------


def test_a_deeply_nested_key_is_skipped_by_every_replica_and_compaction_goes_on(server, admin):
    with subscriber(server.url) as running:
        admin.xadd(KEYS.log, good("before"))
        wait_applied(running, admin)
        admin.xadd(KEYS.log, {**good("poison"), b"k": b"[" * 100_000})
        admin.xadd(KEYS.log, good("after", (4, 5, 6)))
        wait_applied(running, admin)
        with subscriber(server.url) as fresh:
            wait_applied(fresh, admin)
            for sub in (running, fresh):
                st = sub.stats()
                assert (st.malformed, st.applied, st.reconnects, st.lag_ms) == (1, 2, 0, 0)
                assert st.last_error is None
            assert contents(fresh) == contents(running)
        result = running.compact()
        assert result is not None
        assert result.written == 1


def test_decode_entry_raises_only_bad_entry_errors_for_huge_or_nested_fields():
    for raw in (b"[" * 100_000, b"[" * 500 + b"]" * 500, b'["acme",{"a":[1]},null]', b"[" * 900):
        with pytest.raises(BadEntryError):
            decode_entry({**good("x"), b"k": raw}, TENANT, 16)
    with pytest.raises(BadEntryError, match="identity too long"):
        decode_entry({**good("x"), b"i": b"x" * 5000}, TENANT, 16)


_FIELD = st.sampled_from([b"v", b"k", b"i", b"d", b"x"])
_VALUE = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda n, c: c * n, st.integers(0, 3000), st.sampled_from([b"[", b"{", b'"', b"\\"])),
    st.sampled_from([b"1", b'["acme","p","s"]', b'["acme",null,null]', b"[]", b"null"]),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_FIELD, _VALUE, min_size=1, max_size=5))
def test_decode_entry_property_only_bad_entry_errors(fields):
    base = good("prop")
    try:
        entry = decode_entry({**base, **fields}, TENANT, 16)
    except BadEntryError:
        return
    assert entry.key[0] == TENANT


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(fields=st.dictionaries(_FIELD, _VALUE, min_size=1, max_size=5), n=st.integers(0, 10**9))
def test_the_subscriber_always_advances_past_arbitrary_fields(server, fields, n):
    client = server.client()
    try:
        with subscriber(server.url) as sub:
            client.xadd(KEYS.log, {**good(f"base{n}"), **fields})
            client.xadd(KEYS.log, good(f"after{n}", (n % 1000, 7, 7)))
            last = client.xrevrange(KEYS.log, count=1)[0][0]
            assert sub.wait_for(last, WAIT), sub.stats()
            st_ = sub.stats()
            assert st_.reconnects == 0
            assert st_.last_error is None
            tree = sub.tree(KEY)
            assert tree is not None
            assert [n % 1000, 7, 7] in [tree.sequence(i) for i in tree.sequence_ids()]
    finally:
        client.delete(KEYS.log, KEYS.meta, KEYS.index)
        client.close()


# --- row 2: damaged metadata -------------------------------------------------


def test_damaged_metadata_is_counted_and_everything_else_proceeds(server, admin):
    with FleetPublisher(server.url, config=CFG) as pub, subscriber(server.url) as first:
        for i in range(5):
            pub.publish(KEY, [i, 1, 1], f"a{i}")
            pub.publish((TENANT, "p", "other"), [i, 2, 2], f"b{i}")
        assert pub.flush(WAIT)
        assert first.wait_for(pub.last_id, WAIT)
        assert first.compact() is not None
        other = shard_name((TENANT, "p", "other"))
        admin.hset(KEYS.index, b"\xff\xfe-not-utf8", b"1-0")  # a non-UTF-8 shard name
        admin.hset(KEYS.snap(other), "key", b"[" * 50_000)  # nested JSON as the key
        admin.hset(KEYS.meta, "round", "garbage")
        admin.hset(KEYS.index, "f" * 32, "1-0")  # indexed, but the snapshot hash is missing
        admin.set(KEYS.snap("e" * 32), "a string")  # the wrong type
        admin.hset(KEYS.index, "e" * 32, "1-0")
        with subscriber(server.url, compact_every=4) as second:
            pub.publish(KEY, [9, 9, 9], "c")
            assert pub.flush(WAIT)
            assert second.wait_for(pub.last_id, WAIT)
            st = second.stats()
            assert st.bad_snapshots >= 4
            assert st.reconnects == 0
            assert st.last_error is None
            assert [9, 9, 9] in [
                second.tree(KEY).sequence(i) for i in second.tree(KEY).sequence_ids()
            ]
            assert second.compact() is not None  # damaged marks do not stop compaction


def test_a_garbage_tenant_config_is_reported_and_the_subscriber_keeps_its_own(server, admin):
    admin.hset(KEYS.meta, mapping={"depth": "deep", "budget": "\xff"})
    with subscriber(server.url) as sub:
        admin.xadd(KEYS.log, good("r1"))
        wait_applied(sub, admin)
        st = sub.stats()
        assert st.applied == 1
        assert st.bad_config >= 1
        assert st.reconnects == 0
        assert "config" in (st.last_error or "")
        admin.hset(KEYS.meta, mapping={"depth": "16", "budget": "1000"})  # repaired
        admin.xadd(KEYS.log, good("r2", (5, 5)))
        wait_applied(sub, admin)
        assert sub.stats().applied >= 1
        assert len(sub.tree(KEY)) == 2


def test_metadata_keys_of_the_wrong_type_do_not_stop_the_subscriber(server, admin):
    admin.set(KEYS.index, "not a hash")
    with subscriber(server.url) as sub:
        admin.xadd(KEYS.log, good("r1"))
        wait_applied(sub, admin)
        assert sub.stats().bad_snapshots >= 1
        assert len(sub.tree(KEY)) == 1


# --- row 4: bounded reads ----------------------------------------------------


def test_oversized_entries_are_never_fetched_and_reads_are_bounded_by_bytes(server, admin):
    big = 2 << 20
    with subscriber(server.url, max_entry_bytes=1 << 20, max_batch_bytes=256 << 10) as sub:
        admin.xadd(KEYS.log, good("first"))
        wait_applied(sub, admin)
        assert sub.pause()
        for i in range(12):  # 24 MB of oversized entries ...
            admin.xadd(KEYS.log, {**good(f"big{i}"), b"d": b"\x00" * big})
        for i in range(40):  # ... and 40 entries of 100 kB (4 MB)
            admin.xadd(KEYS.log, {**good(f"mid{i}"), b"pad": b"\x01" * (100 << 10)})
        tracemalloc.start()
        try:
            sub.resume()
            wait_applied(sub, admin)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        st = sub.stats()
        assert st.malformed == 12
        assert st.applied == 41
        # Fetching the big entries in one batch would hold 24 MB (twice that with the
        # reply buffer); a read holds one batch budget (256 kB), plus at most one entry
        # of the wake-up read that follows an idle wait (2 MB, and its buffer).
        assert peak < 8 << 20, peak


# --- row 11: lag in wall time --------------------------------------------------


def test_lag_is_wall_time_since_the_oldest_unapplied_entry(server, admin):
    old_ms = int(time.time() * 1000) - 100_000
    for i in range(1500):
        admin.xadd(KEYS.log, good(f"old{i}", (i % 50, i // 50 + 1)), id=f"{old_ms}-{i + 1}")
    seen: list[int] = []
    with subscriber(server.url, start=False, batch=1) as sub:

        def record() -> bool:
            seen.append(sub.stats().lag_ms)
            return sub.stats().applied == 1500

        sub.start()
        assert sub.wait_until(record, WAIT)
        assert max(seen) >= 99_000  # while behind: about 100 s (the ids' age)
        assert sub.stats().lag_ms == 0  # caught up


# --- row 6: one authority for the tenant's config --------------------------------


@pytest.mark.parametrize("mine", [FleetConfig(8, 1000), FleetConfig(16, 5)])
def test_a_read_only_replica_rebuilds_to_the_config_a_writer_sets(server, admin, mine):
    admin.execute_command(
        "ACL", "SETUSER", "ro", "on", ">ro-pw", *tenant_acl_rules(TENANT, read_only=True)
    )
    ro_url = server.url_for("ro", "ro-pw")
    with FleetSubscriber(ro_url, TENANT, config=mine, block_ms=100, compact_every=0) as ro:
        assert ro.wait_until(lambda: ro.stats().connected, WAIT)
        assert ro.config == mine  # no writer yet: its own
        with FleetPublisher(server.url, config=CFG) as pub, subscriber(server.url) as rw:
            for i in range(20):
                pub.publish(KEY, [i, 1, 2, 3], f"r{i}")
            assert pub.flush(WAIT)
            assert rw.wait_for(pub.last_id, WAIT)
            assert ro.wait_for(pub.last_id, WAIT)
            assert ro.config == CFG
            assert ro.stats().malformed == 0
            assert contents(ro) == contents(rw)


# --- row 12: Redis restarted empty --------------------------------------------------


def test_the_fleet_survives_a_redis_that_lost_everything_while_one_replica_lives():
    with (
        RedisServer(persist=False) as server,
        FleetPublisher(server.url, config=CFG, max_backoff=0.2) as pub,
        subscriber(server.url) as a,
        subscriber(server.url) as b,
    ):
        if True:
            for i in range(40):
                pub.publish(KEY, [i, 1, 2], f"a{i}")
            assert pub.flush(WAIT)
            assert a.wait_for(pub.last_id, WAIT)
            assert b.wait_for(pub.last_id, WAIT)
            assert a.compact() is not None
            before = contents(a)
            server.kill()
            server.start()  # empty
            pub.publish(KEY, [7, 7, 7], "after")
            assert pub.flush(WAIT)
            for sub in (a, b):
                assert sub.wait_until(
                    lambda s=sub: s.stats().connected and s.stats().loads >= 2, WAIT
                )
                assert sub.wait_for(pub.last_id, WAIT)
            assert a.stats().seeded + b.stats().seeded >= 1
            expected = {KEY: sorted([*before[KEY], [7, 7, 7]])}
            assert a.wait_until(lambda: contents(a) == expected, WAIT), contents(a)
            assert b.wait_until(lambda: contents(b) == expected, WAIT), contents(b)
            with subscriber(server.url) as late:
                assert late.wait_for(pub.last_id, WAIT)
                assert contents(late) == expected


# --- row 3: many shards of one tenant -----------------------------------------------


def test_the_shard_cap_evicts_the_oldest_shards_alike_on_every_replica(server, admin):
    cfg = FleetConfig(max_depth=16, max_shard_tokens=1000, max_shards=5)
    with (
        FleetPublisher(server.url, config=cfg) as pub,
        subscriber(server.url, config=cfg, compact_every=10) as a,
        subscriber(server.url, config=cfg) as b,
    ):
        for i in range(40):  # 40 stages, a free-form tag a hostile tenant controls
            pub.publish((TENANT, "p", f"stage{i}"), [i, 1, 2], f"r{i}")
        assert pub.flush(WAIT)
        for sub in (a, b):
            assert sub.wait_until(lambda s=sub: len(s.trees()) <= 5, WAIT)
        pub.publish(KEY, [1, 1, 1], "last")
        assert pub.flush(WAIT)
        assert a.wait_for(pub.last_id, WAIT)
        # a compacts between its reads once the stream holds 10 entries, so its round
        # (the evictions) may come after it applied the last entry: wait for it
        assert a.wait_until(lambda: a.stats().evicted_shards >= 35, WAIT), a.stats()
        wait_applied(a, admin)
        wait_applied(b, admin)
        assert contents(a) == contents(b)
        assert KEY in contents(a)  # the newest shard stays
        assert a.compact() is not None
        assert admin.hlen(KEYS.index) <= 5  # the evicted shards' snapshots are gone
        with subscriber(server.url, config=cfg) as late:
            assert late.wait_for(pub.last_id, WAIT)
            assert contents(late) == contents(a)


def test_a_compaction_round_writes_only_the_shards_that_changed(server, admin):
    with (
        FleetPublisher(server.url, config=CFG) as pub,
        subscriber(server.url) as sub,
    ):
        for i in range(300):
            pub.publish((TENANT, "p", f"s{i}"), [i % 7, 1, 2], f"r{i}")
        assert pub.flush(WAIT)
        assert sub.wait_for(pub.last_id, WAIT)
        first = sub.compact()
        assert first is not None
        assert first.written == 300
        for i in range(3):
            pub.publish((TENANT, "p", f"s{i}"), [9, 9, i], f"again{i}")
        assert pub.flush(WAIT)
        assert sub.wait_for(pub.last_id, WAIT)
        second = sub.compact()
        assert second is not None
        assert (second.written, second.bumped) == (3, 0)
        third = sub.compact()
        assert third is not None
        assert third.written == 0
        with subscriber(server.url) as late:
            assert late.wait_for(pub.last_id, WAIT)
            assert contents(late) == contents(sub)


def test_a_replica_keeps_its_fleet_trees_within_its_memory_budget(server, admin):
    with (
        FleetPublisher(server.url, config=CFG) as pub,
        subscriber(server.url) as full,
        subscriber(server.url, max_bytes=400_000) as small,
    ):
        for i in range(200):
            pub.publish((TENANT, "p", f"s{i}"), list(range(i % 50, i % 50 + 30)), f"r{i}")
        assert pub.flush(WAIT)
        assert full.wait_for(pub.last_id, WAIT)
        assert small.wait_for(pub.last_id, WAIT)
        big, little = full.stats(), small.stats()
        assert big.bytes > 400_000
        assert little.bytes <= 400_000
        assert little.dropped_local > 0
        assert len(small.trees()) < len(full.trees())
        assert (TENANT, "p", "s199") in small.trees()  # the newest stay


def test_stage_names_are_bounded_in_length_and_characters_at_intake(server):
    with FleetPublisher(server.url, config=CFG) as pub:
        for bad in ("x" * 129, "a\u200bb", "a\u202eb", "a\u2028b", "\ue000", "a\x00b", ""):
            with pytest.raises(InvalidArgumentError, match="stage"):
                pub.publish((TENANT, "p", bad), [1, 2], "r")
        with pytest.raises(InvalidArgumentError, match="NFC"):
            pub.publish(("e\u0301", "p", "s"), [1, 2], "r")  # a decomposed tenant name
