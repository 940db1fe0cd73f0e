"""Compaction and trimming on a real redis-server: Redis stays bounded, laggards reload.

Checked: after each round the stream holds only the entries since the
previous round and the snapshots stay within the token budget, however
much was published; a subscriber paused behind the trim reloads the
snapshots and converges; snapshot writes are compare-and-set on the
covered id (never a regression), and the trim mark never moves back.
"""

from __future__ import annotations

import pytest
from redis_server import RedisServer, requires_redis_server

from agentspec import SuffixTree
from agentspec._fleet.config import FleetConfig
from agentspec._fleet.functions import fcall
from agentspec._fleet.ids import parse_id
from agentspec._fleet.names import FleetKeys
from agentspec._fleet.pub import FleetPublisher
from agentspec._fleet.sub import FleetSubscriber

pytestmark = requires_redis_server

TENANT = "acme"
CFG = FleetConfig(max_depth=16, max_shard_tokens=80)
KEYS = FleetKeys.of(TENANT)
WAIT = 30.0
ROUND = 100  # entries published between two compactions


@pytest.fixture
def server():
    with RedisServer() as s:
        yield s


def contents(sub):
    return {k: [(i, t.sequence(i)) for i in t.sequence_ids()] for k, t in sub.trees().items()}


def publish(pub, start, n):
    for i in range(start, start + n):
        pub.publish((TENANT, "p", f"s{i % 4}"), [(i * 3 + j) % 40 for j in range(6)], f"r{i}")
    assert pub.flush(WAIT)


def snapshot_tokens(client):
    """Tokens of every stored snapshot, by shard name."""
    out = {}
    for name in client.hkeys(KEYS.index):
        data = client.hget(KEYS.snap(name.decode()), "data")
        with SuffixTree.from_bytes(data) as t:
            out[name] = t.stats().tokens
    return out


def test_redis_stays_bounded_by_budgets_not_by_time(server):
    admin = server.client()
    with (
        FleetPublisher(server.url, config=CFG) as pub,
        FleetSubscriber(server.url, TENANT, config=CFG, block_ms=100, compact_every=0) as sub,
    ):
        sizes = []
        for r in range(8):
            publish(pub, r * ROUND, ROUND)
            assert sub.wait_for(pub.last_id, WAIT)
            result = sub.compact()
            assert result is not None
            # No trim after the first round; then the stream keeps one round of slack.
            expected = ROUND if r == 0 else ROUND + 1
            assert admin.xlen(KEYS.log) == expected
            assert result.removed == (0 if r == 0 else ROUND if r > 1 else ROUND - 1)
            tokens = snapshot_tokens(admin)
            assert len(tokens) == 4
            assert all(t <= CFG.max_shard_tokens for t in tokens.values())
            sizes.append(admin.memory_usage(KEYS.log))
        assert max(sizes[2:]) <= 1.5 * min(sizes[2:])  # flat, not growing with time
        fresh = FleetSubscriber(server.url, TENANT, block_ms=100, compact_every=0)
        assert fresh.wait_for(pub.last_id, WAIT)
        assert contents(fresh) == contents(sub)
        fresh.close()
    admin.close()


def test_automatic_compaction_keeps_the_stream_short(server):
    admin = server.client()
    with (
        FleetPublisher(server.url, config=CFG) as pub,
        FleetSubscriber(server.url, TENANT, config=CFG, block_ms=100, compact_every=50) as sub,
    ):
        for r in range(10):
            publish(pub, r * ROUND, ROUND)
            assert sub.wait_for(pub.last_id, WAIT)
        assert sub.stats().compactions >= 5
        assert admin.xlen(KEYS.log) < 3 * ROUND  # 1000 published
    admin.close()


def test_a_subscriber_behind_the_trim_reloads_and_converges(server):
    with (
        FleetPublisher(server.url, config=CFG) as pub,
        FleetSubscriber(server.url, TENANT, config=CFG, block_ms=100, compact_every=0) as lead,
        FleetSubscriber(server.url, TENANT, config=CFG, block_ms=100, compact_every=0) as lag,
    ):
        publish(pub, 0, 50)
        assert lead.wait_for(pub.last_id, WAIT)
        assert lag.wait_for(pub.last_id, WAIT)
        assert lag.pause()
        behind = lag.stats().position
        for r in range(1, 4):
            publish(pub, r * ROUND, ROUND)
            assert lead.wait_for(pub.last_id, WAIT)
            assert lead.compact() is not None
        admin = server.client()
        first = admin.xrange(KEYS.log, count=1)[0][0].decode()
        admin.close()
        assert parse_id(first) > parse_id(behind)  # entries after `behind` are gone
        lag.resume()
        assert lag.wait_for(pub.last_id, WAIT)
        assert lag.stats().loads == 2
        assert contents(lag) == contents(lead)
        assert lag.stats().malformed == 0


def test_snapshots_never_regress_and_trim_never_moves_back(server):
    admin = server.client()
    snap = KEYS.snap("a1")

    def put_at(covered, data, mode="put", seen="0-0"):
        keys = [snap, KEYS.index]
        return fcall(admin, "put_snapshot", keys, ["a1", covered, mode, seen, data, "k", b""])

    def finish(keys, args):
        return fcall(admin, "finish_round", keys, args)

    assert put_at("5-0", b"new") == 1
    assert put_at("3-0", b"old") == 1  # already covered: nothing written
    assert admin.hmget(snap, ["data", "covered"]) == [b"new", b"5-0"]
    assert put_at("9-0", b"", mode="bump", seen="6-0") == 0  # stored misses entry 6-0
    assert admin.hget(snap, "covered") == b"5-0"
    assert put_at("9-0", b"", mode="bump", seen="5-0") == 1
    assert admin.hmget(snap, ["data", "covered"]) == [b"new", b"9-0"]
    assert admin.hget(KEYS.index, "a1") == b"9-0"
    for i in range(1, 12):
        admin.xadd(KEYS.log, {"x": "y"}, id=f"{i}-0")
    args = {"keys": [KEYS.meta, KEYS.index, KEYS.log]}
    assert finish(**args, args=["4-0"]) == [b"0-0", 0]  # first round: nothing trimmed
    assert finish(**args, args=["7-0"]) == [b"4-0", 3]  # behind the previous round
    assert finish(**args, args=["6-0"]) == [b"4-0", 0]  # an older round changes nothing
    assert finish(**args, args=["10-0"]) == [b"7-0", 3]
    # A snapshot covering less than the previous round (a1 at 9-0) does not hold the
    # trim back: a shard with an entry after its snapshot is rewritten by every round.
    assert finish(**args, args=["11-0"]) == [b"10-0", 3]
    assert admin.xrange(KEYS.log, count=1)[0][0] == b"10-0"
    admin.close()
