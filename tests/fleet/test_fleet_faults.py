"""Faults on a real redis-server: bad entries, bad snapshots, crashes and lost data.

Checked: malformed or oversized entries are counted and skipped, never
applied, and the entries after them still are; a damaged snapshot is
counted, its shard restarts empty and the next compaction rewrites it;
after a SIGKILL and a restart the subscriber reconnects (with backoff) and
continues while the publisher, which never blocked, delivers what it
queued; when a restart loses data the subscriber reloads and matches a
fresh one.  Waits are events with timeouts.
"""

from __future__ import annotations

import array
import logging

import pytest
from redis_server import RedisServer, requires_redis_server

from agentspec import SuffixTree
from agentspec._fleet.config import FleetConfig
from agentspec._fleet.entry import FleetEntry, decode_entry
from agentspec._fleet.names import FleetKeys, shard_name
from agentspec._fleet.pub import FleetPublisher, PublishStatus
from agentspec._fleet.sub import FleetSubscriber

pytestmark = requires_redis_server

TENANT = "acme"
CFG = FleetConfig(max_depth=16, max_shard_tokens=1000)
KEYS = FleetKeys.of(TENANT)
KEY = (TENANT, "p", "s")
WAIT = 30.0


@pytest.fixture
def server():
    with RedisServer() as s:
        yield s


def contents(sub):
    return {k: [(i, t.sequence(i)) for i in t.sequence_ids()] for k, t in sub.trees().items()}


def subscriber(url, **kw):
    kw.setdefault("config", CFG)
    return FleetSubscriber(url, TENANT, block_ms=100, compact_every=0, max_backoff=0.2, **kw)


def malformed_entries():
    good = FleetEntry.make(KEY, "r1", array.array("i", [1, 2, 3])).fields(16)
    corrupt = bytearray(good[b"d"])
    corrupt[len(corrupt) // 2] ^= 0x55
    with SuffixTree(16) as t:
        t.add(424242, [1, 2, 3])
        wrong_id = t.delta_bytes([424242])
    return [
        {b"junk": b"1"},
        {**good, b"v": b"9"},
        {**good, b"k": b"\xff\xfe"},
        {**good, b"k": b'["bob","p","s"]'},
        {**good, b"d": bytes(corrupt)},
        {**good, b"d": FleetEntry.make(KEY, "r1", array.array("i", [1, 2, 3])).fields(8)[b"d"]},
        {**good, b"d": wrong_id},
        {**good, b"d": b"\x00" * 5000},  # oversized for max_entry_bytes=4096
    ]


def test_malformed_entries_are_counted_and_skipped(server, caplog):
    caplog.set_level(logging.WARNING, logger="agentspec")
    admin = server.client()
    with subscriber(server.url, max_entry_bytes=4096) as sub, FleetPublisher(server.url) as pub:
        pub.publish(KEY, [9, 9, 9], "before")
        assert pub.flush(WAIT)
        bad = malformed_entries()
        for fields in bad:
            admin.xadd(KEYS.log, fields)
        pub.publish(KEY, [7, 7, 7], "after")
        assert pub.flush(WAIT)
        assert sub.wait_for(pub.last_id, WAIT)
        st = sub.stats()
        assert st.malformed == len(bad)
        assert st.applied == 2
        assert st.connected
        assert [len(s) for _, s in contents(sub)[KEY]] == [3, 3]
        skipped = [r for r in caplog.records if "malformed entry" in r.getMessage()]
        assert len(skipped) == len(bad)
        assert all(getattr(r, "reason", None) for r in skipped)
    admin.close()


def test_a_damaged_snapshot_is_counted_and_rewritten(server):
    admin = server.client()
    with subscriber(server.url) as first, FleetPublisher(server.url, config=CFG) as pub:
        pub.publish(KEY, [1, 2, 3, 4], "r1")
        assert pub.flush(WAIT)
        assert first.wait_for(pub.last_id, WAIT)
        assert first.compact() is not None
        snap = KEYS.snap(shard_name(KEY))
        data = bytearray(admin.hget(snap, "data"))
        data[-3] ^= 0xFF
        admin.hset(snap, "data", bytes(data))
        with subscriber(server.url) as second:
            pub.publish(KEY, [5, 6, 7], "r2")
            assert pub.flush(WAIT)
            assert second.wait_for(pub.last_id, WAIT)
            assert second.stats().bad_snapshots == 1
            assert [len(s) for _, s in contents(second)[KEY]] == [3]  # restarted empty
            # Another compaction (new position) replaces the damaged snapshot.
            assert first.wait_for(pub.last_id, WAIT)
            assert first.compact() is not None
        with SuffixTree.from_bytes(admin.hget(snap, "data")) as t:
            assert len(t) == 2
    admin.close()


def test_sigkill_and_restart_the_subscriber_reconnects_and_continues(server):
    with subscriber(server.url) as sub, FleetPublisher(server.url, max_backoff=0.2) as pub:
        for i in range(20):
            pub.publish(KEY, [i, 1, 2], f"a{i}")
        assert pub.flush(WAIT)
        assert sub.wait_for(pub.last_id, WAIT)
        server.kill()
        assert sub.wait_until(lambda: not sub.stats().connected, WAIT)
        # Redis is down: publishing still returns at once, and the entries wait.
        for i in range(20):
            assert pub.publish(KEY, [i, 3, 4], f"b{i}") is PublishStatus.QUEUED
        assert not pub.flush(0.5)
        assert pub.stats().pending == 20
        assert len(sub.tree(KEY)) == 20  # the trees stay
        server.start()
        assert pub.flush(WAIT)
        assert sub.wait_for(pub.last_id, WAIT)
        st = sub.stats()
        assert st.last_error is None  # cleared once it reconnected
        assert st.loads == 1  # nothing was lost (appendfsync always): no reload
        assert len(sub.tree(KEY)) == 40
        with subscriber(server.url) as fresh:
            assert fresh.wait_for(pub.last_id, WAIT)
            assert contents(fresh) == contents(sub)


def test_a_restart_that_lost_data_makes_the_subscriber_reload():
    with (
        RedisServer(persist=False) as server,
        subscriber(server.url) as sub,
        FleetPublisher(server.url, max_backoff=0.2) as pub,
    ):
        for i in range(10):
            pub.publish(KEY, [i, 1], f"a{i}")
        assert pub.flush(WAIT)
        assert sub.wait_for(pub.last_id, WAIT)
        server.kill()
        assert sub.wait_until(lambda: not sub.stats().connected, WAIT)
        server.start()  # empty: nothing persisted
        for i in range(5):
            pub.publish(KEY, [i, 2], f"b{i}")
        assert pub.flush(WAIT)
        assert sub.wait_for(pub.last_id, WAIT)
        assert sub.stats().loads == 2
        assert sub.stats().seeded == 1  # it gave Redis back what Redis lost
        with subscriber(server.url) as fresh:
            assert fresh.wait_for(pub.last_id, WAIT)
            assert contents(fresh) == contents(sub)
        assert len(sub.tree(KEY)) == 15  # the 10 Redis lost, then the 5 sent after


def test_publisher_queue_bound_and_unsent_entries_on_close(server):
    server.kill()
    pub = FleetPublisher(server.url, max_pending=5, max_backoff=0.2)
    statuses = [pub.publish(KEY, [i, 1], f"r{i}") for i in range(6)]
    assert statuses == [PublishStatus.QUEUED] * 5 + [PublishStatus.FULL]
    left = pub.close(timeout=0.2)
    assert [e.identity for e in left] == [f"r{i}" for i in range(5)]
    assert pub.publish(KEY, [1], "late") is PublishStatus.CLOSED
    assert pub.stats().refused_full == 1
    server.start()


def test_on_published_reports_each_acknowledged_entry_once(server):
    seen = []
    with FleetPublisher(server.url, config=CFG, on_published=seen.append) as pub:
        for i in range(30):
            pub.publish(KEY, [i, 5], f"r{i}")
        assert pub.flush(WAIT)
        assert pub.stats().published == 30
    assert [p.entry.identity for p in seen] == [f"r{i}" for i in range(30)]
    assert len({p.stream_id for p in seen}) == 30
    assert seen[-1].stream_id == pub.last_id


def test_publisher_reencodes_when_redis_remade_the_tenant_config(server):
    admin = server.client()
    with FleetPublisher(server.url, config=CFG) as pub:
        pub.publish(KEY, [1, 2], "r1")
        assert pub.flush(WAIT)
        admin.delete(KEYS.meta)  # as after a restart that lost data...
        admin.hset(KEYS.meta, mapping={"depth": "32", "budget": "none"})  # ...re-made by another
        pub.publish(KEY, [3, 4], "r2")
        assert pub.flush(WAIT)
        assert pub.stats().rejected == 0
    entries = admin.xrange(KEYS.log)
    assert len(entries) == 2
    with pytest.raises(ValueError, match="shard bytes refused"):
        decode_entry(entries[1][1], TENANT, 16)
    assert decode_entry(entries[1][1], TENANT, 32).identity == "r2"
    admin.close()


def test_a_silent_reconnect_cannot_hide_lost_data():
    # Paused, the subscriber has no read in flight when Redis dies, so its client
    # reconnects without an error; the position check still sees the loss.
    with (
        RedisServer(persist=False) as server,
        subscriber(server.url) as sub,
        FleetPublisher(server.url, config=CFG, max_backoff=0.2) as pub,
    ):
        for i in range(10):
            pub.publish(KEY, [i, 1], f"a{i}")
        assert pub.flush(WAIT)
        assert sub.wait_for(pub.last_id, WAIT)
        assert sub.pause()
        server.kill()
        server.start()
        for i in range(3):
            pub.publish(KEY, [i, 2], f"b{i}")
        assert pub.flush(WAIT)
        sub.resume()
        assert sub.wait_for(pub.last_id, WAIT)
        assert sub.stats().loads == 2
        assert sub.stats().seeded == 1
        assert len(sub.tree(KEY)) == 13  # re-seeded with the 10 Redis lost
