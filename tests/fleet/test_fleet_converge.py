"""Fleet convergence on a real redis-server: every subscriber holds the same shards.

Checked: three subscribers agree with each other and with a FIFO model of
the stream (token budget evictions included); a late subscriber and a
restarted one agree too; a response published by two sides under one
identity is learned once, even after it was evicted; `publish_shard` takes
a store's delta; drafting threads may read the trees while they change.
Every wait is on an event with a timeout, never a fixed sleep.
"""

from __future__ import annotations

import array
import threading
from collections import deque

import pytest
from redis_server import RedisServer, requires_redis_server

from agentspec import SuffixTree
from agentspec._fleet.config import FleetConfig
from agentspec._fleet.ids import fleet_seq_id, parse_id
from agentspec._fleet.pub import FleetPublisher, PublishStatus
from agentspec._fleet.sub import FleetSubscriber

pytestmark = requires_redis_server

TENANT = "acme"
CFG = FleetConfig(max_depth=16, max_shard_tokens=60)
WAIT = 30.0


@pytest.fixture
def server():
    with RedisServer() as s:
        yield s


def key_of(i):
    return (TENANT, "sql", f"stage{i % 3}")


def tokens_of(i):
    return [(i * 7 + j) % 50 for j in range(4 + i % 5)]


def contents(sub):
    """{key: [(id, tokens), ...] oldest first} of a subscriber."""
    return {k: [(i, t.sequence(i)) for i in t.sequence_ids()] for k, t in sub.trees().items()}


def fifo_model(items, budget):
    """What every shard must hold: (key, identity, tokens) in stream order, FIFO budget."""
    shards: dict = {}
    for key, ident, toks in items:
        sid = fleet_seq_id(key, ident, memoryview(array.array("i", toks)))
        q = shards.setdefault(key, deque())
        if any(s == sid for s, _ in q):
            continue
        q.append((sid, toks))
        while sum(len(t) for _, t in q) > budget and len(q) > 1:
            q.popleft()
    return {k: list(q) for k, q in shards.items()}


def publish_range(pub, start, stop):
    items = [(key_of(i), f"req-{i}", tokens_of(i)) for i in range(start, stop)]
    for key, ident, toks in items:
        assert pub.publish(key, toks, ident) is PublishStatus.QUEUED
    assert pub.flush(WAIT)
    return items


def subscriber(server, **kw):
    kw.setdefault("config", CFG)
    kw.setdefault("block_ms", 100)
    kw.setdefault("compact_every", 0)
    return FleetSubscriber(server.url, TENANT, **kw)


def caught_up(subs, pub):
    return all(s.wait_for(pub.last_id, WAIT) for s in subs)


def test_three_subscribers_converge_to_the_fifo_model(server):
    with FleetPublisher(server.url, config=CFG) as pub:
        subs = [subscriber(server) for _ in range(3)]
        try:
            items = publish_range(pub, 0, 200)
            assert caught_up(subs, pub)
            expected = fifo_model(items, CFG.max_shard_tokens)
            for s in subs:
                assert contents(s) == expected
                st = s.stats()
                assert st.applied == 200
                assert st.malformed == 0
                assert st.lag_ms == 0
                assert all(sh.tokens <= CFG.max_shard_tokens for sh in st.shards.values())
                assert sum(sh.evicted for sh in st.shards.values()) > 0
        finally:
            for s in subs:
                s.close()


def test_late_and_restarted_subscribers_converge(server):
    with FleetPublisher(server.url, config=CFG) as pub:
        first = subscriber(server)
        items = publish_range(pub, 0, 80)
        assert caught_up([first], pub)
        assert first.compact() is not None  # snapshots now cover the first 80
        items += publish_range(pub, 80, 120)
        late = subscriber(server)
        assert caught_up([first, late], pub)
        assert contents(late) == contents(first) == fifo_model(items, CFG.max_shard_tokens)
        assert all(sh.through != "0-0" for sh in late.stats().shards.values())  # from snapshots
        first.close()
        items += publish_range(pub, 120, 170)
        restarted = subscriber(server)
        assert caught_up([late, restarted], pub)
        assert contents(restarted) == contents(late) == fifo_model(items, CFG.max_shard_tokens)
        late.close()
        restarted.close()


def test_a_response_published_by_both_sides_is_learned_once(server):
    cfg = FleetConfig(max_depth=16, max_shard_tokens=40)
    client_side = FleetPublisher(server.url, config=cfg)
    worker_side = FleetPublisher(server.url, config=cfg)
    subs = [subscriber(server, config=cfg) for _ in range(2)]
    try:
        key = (TENANT, "p", "s")
        for i in range(5):
            for pub in (client_side, worker_side):
                assert pub.publish(key, [i, i, 1, 2], f"call-{i}") is PublishStatus.QUEUED
        # Same tokens, another request: a second, distinct sequence.
        client_side.publish(key, [0, 0, 1, 2], "call-other")
        assert client_side.flush(WAIT)
        assert worker_side.flush(WAIT)
        last = max(client_side.last_id, worker_side.last_id, key=parse_id)
        assert all(s.wait_for(last, WAIT) for s in subs)
        for s in subs:
            assert len(s.tree(key).sequence_ids()) == 6
            assert s.stats().duplicates == 5
        # Evict call-0 (40 tokens of newer sequences), then publish it again: still skipped.
        for i in range(10, 21):
            client_side.publish(key, [i, i, i, i], f"call-{i}")
        client_side.publish(key, [0, 0, 1, 2], "call-0")
        assert client_side.flush(WAIT)
        assert all(s.wait_for(client_side.last_id, WAIT) for s in subs)
        gone = fleet_seq_id(key, "call-0", memoryview(array.array("i", [0, 0, 1, 2])))
        for s in subs:
            assert gone not in s.tree(key)
            assert s.stats().duplicates == 6
        assert contents(subs[0]) == contents(subs[1])
    finally:
        client_side.close()
        worker_side.close()
        for s in subs:
            s.close()


def test_publish_shard_rekeys_a_store_delta(server):
    key = (TENANT, "p", "s")
    local = SuffixTree(16)
    local.add(7, [3, 4, 5, 6])
    delta = local.delta_bytes([7])
    with FleetPublisher(server.url, config=CFG) as pub, subscriber(server) as sub:
        assert pub.publish_shard(key, delta, "req-9") is PublishStatus.QUEUED
        assert pub.publish(key, [3, 4, 5, 6], "req-9") is PublishStatus.QUEUED  # same response
        assert pub.flush(WAIT)
        assert sub.wait_for(pub.last_id, WAIT)
        sid = fleet_seq_id(key, "req-9", memoryview(array.array("i", [3, 4, 5, 6])))
        assert sub.tree(key).sequence_ids() == [sid]
        assert sub.stats().duplicates == 1


def test_drafting_threads_read_while_the_subscriber_writes(server):
    key = (TENANT, "sql", "stage0")
    stop = threading.Event()
    errors: list[BaseException] = []
    drafts = [0]

    def draft_forever(sub):
        while not stop.is_set():
            tree = sub.tree(key)
            if tree is None:
                continue
            try:
                tree.draft([1, 2, 3])
                drafts[0] += 1
            except RuntimeError as e:  # a change in progress: drafting never waits
                if "concurrent modification" not in str(e):
                    errors.append(e)
            except BaseException as e:
                errors.append(e)

    with FleetPublisher(server.url, config=CFG) as pub, subscriber(server) as sub:
        readers = [threading.Thread(target=draft_forever, args=(sub,)) for _ in range(3)]
        for t in readers:
            t.start()
        try:
            items = publish_range(pub, 0, 300)
            assert sub.wait_for(pub.last_id, WAIT)
        finally:
            stop.set()
            for t in readers:
                t.join()
        assert not errors
        assert contents(sub) == fifo_model(items, CFG.max_shard_tokens)
