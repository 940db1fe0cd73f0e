"""The store's journal as the fleet outbox, with no Redis reachable (nothing is published).

Checked: the ADD_ID / PUBLISHED journal records (round trip, damage); the
bookkeeping's ``published`` / ``outbox`` fields (and files without them);
the watermark arithmetic; learning with the fleet's Redis down keeps going
and every sequence stays pending across reopen, compaction, a reopen
without a fleet, eviction and imports; identities are validated; the
``redis=`` argument, ``AGENTSPEC_REDIS_URL`` and ``redis=False``.
"""

from __future__ import annotations

import array
import json

import pytest
from prereq import require_module

require_module("redis", reason="the redis client is not installed")

from agentspec._core.shardkey import key_dir_name  # noqa: E402
from agentspec._core.tokens import int32_le  # noqa: E402
from agentspec._store.files import SnapshotMeta  # noqa: E402
from agentspec._store.fleet_outbox import FleetOptions  # noqa: E402
from agentspec._store.journal import (  # noqa: E402
    ADD,
    ADD_ID,
    PUBLISHED,
    encode_add_id,
    encode_published,
    parse_journal,
    read_journal,
)
from agentspec._store.outbox import ShardOutbox  # noqa: E402
from agentspec._store.store import REDIS_URL_ENV, ShardStore  # noqa: E402
from agentspec.exceptions import InvalidArgumentError  # noqa: E402

KEY = ("acme", "sql", "plan")


def toks(*values: int) -> bytes:
    return int32_le(array.array("i", values).tobytes())


@pytest.fixture
def down(tmp_path):
    """Fleet options for a Redis that is not there."""
    return FleetOptions(
        f"unix://{tmp_path}/no-redis.sock", durable_after=0, max_backoff=0.05, close_timeout=0
    )


def pending(store: ShardStore) -> list[tuple[int, str]]:
    with store._lock:
        return store._shards[KEY].outbox.items()


def test_add_id_and_published_records_round_trip():
    data = encode_add_id(7, "req-1:0", toks(1, 2, 3)) + encode_published(6)
    data += encode_add_id(8, "é" * 200, toks(5))
    recs = parse_journal(data).records
    assert [(r.kind, r.seq_id, r.identity) for r in recs] == [
        (ADD_ID, 7, "req-1:0"),
        (PUBLISHED, 6, None),
        (ADD_ID, 8, "é" * 200),
    ]
    assert recs[0].token_list() == [1, 2, 3]
    assert recs[2].token_list() == [5]
    with pytest.raises(ValueError, match="identity"):
        encode_add_id(1, "", toks(1))
    with pytest.raises(ValueError, match="tokens"):
        encode_add_id(1, "x", b"")
    torn = data[:-3]
    assert len(parse_journal(torn).records) == 2


def test_snapshot_meta_outbox_fields_round_trip_and_may_be_absent():
    meta = SnapshotMeta(KEY, 16, 5, 9, 0, [(1, 1)], published=3, outbox=[(4, "a:0")])
    back = SnapshotMeta.from_json(meta.to_json(), "x")
    assert (back.published, back.outbox) == (3, [(4, "a:0")])
    plain = json.loads(SnapshotMeta(KEY, 16, 5, 9, 0, []).to_json())
    assert "published" not in plain
    assert "outbox" not in plain
    back = SnapshotMeta.from_json(json.dumps(plain).encode(), "x")
    assert (back.published, back.outbox) == (0, [])


def test_watermark_is_the_lowest_pending_id_less_one():
    box = ShardOutbox(2, [(1, "old"), (3, "c"), (4, "d"), (6, "f")])
    assert box.items() == [(3, "c"), (4, "d"), (6, "f")]  # 1 is below the watermark
    box.sent[3] = box.unsent.pop(3)
    assert not box.settle([4], next_seq=7)  # 3 still pending
    assert box.settle([3], next_seq=7)
    assert box.published == 5
    assert box.settle([6], next_seq=9)
    assert box.published == 8
    assert not box.settle([], next_seq=9)


def test_learning_with_redis_down_keeps_everything_pending(tmp_path, down):
    path = tmp_path / "s"
    with ShardStore(path, redis=down, fsync=False) as st:
        assert st.fleet is not None
        for i in range(5):
            st.learn(KEY, [i, i + 1], identity=f"r{i}:0")
        st.learn(KEY, [9, 9])  # a random identity
        assert st.fleet.stats().pending == 6
        got = pending(st)
    assert [p[1] for p in got[:5]] == [f"r{i}:0" for i in range(5)]
    journal = path / "shards" / key_dir_name(KEY) / "journal.log"
    kinds = [r.kind for r in read_journal(journal).records]
    assert kinds == [ADD_ID] * 5  # the first one went into the new shard's snapshot
    with ShardStore(path, redis=down, fsync=False) as st:
        assert pending(st) == got
        st.compact()  # the outbox moves into snapshot.json
    with ShardStore(path, redis=False, fsync=False) as st:  # no fleet: kept, not published
        assert st.fleet is None
        st.learn(KEY, [7, 7], identity="ignored:0")
        assert pending(st) == got
    kinds = [r.kind for r in read_journal(journal).records]
    assert kinds == [ADD]
    with ShardStore(path, redis=down, fsync=False) as st:
        assert pending(st) == got  # what was learned without a fleet is never published


def test_eviction_and_imports_settle_what_is_gone(tmp_path, down):
    with ShardStore(tmp_path / "s", redis=down, fsync=False, max_bytes=1 << 30) as st:
        for i in range(4):
            st.learn(KEY, [i, 100 + i], identity=f"r{i}:0")
        shard = st._shards[KEY]
        with st._lock:
            st._max_bytes = st._live_total - 1  # just over budget: the oldest goes
            st._evict([])
        assert 1 not in shard.tree
        assert 2 in shard.tree
        assert [p[0] for p in pending(st)] == [2, 3, 4]
        data, _ = st.snapshot(KEY)
        st.import_shard(KEY, data)  # merge: the pending ones stay
        assert [p[0] for p in pending(st)] == [2, 3, 4]
        st.import_shard(KEY, data, replace=True)  # replaced: gone, and settled
        assert pending(st) == []
        assert st._shards[KEY].outbox.published == st._shards[KEY].next_seq - 1


def test_identities_are_checked(tmp_path, down):
    with ShardStore(redis=down) as st:
        for bad in ("", "x" * 257, 5):
            with pytest.raises((InvalidArgumentError, TypeError)):
                st.learn(KEY, [1], identity=bad)
        assert st.keys() == []


def test_redis_argument_and_environment(tmp_path, monkeypatch, down):
    monkeypatch.setenv(REDIS_URL_ENV, down.url)
    with ShardStore() as st:
        assert st.fleet is not None
        assert st.fleet.options.url == down.url
    with ShardStore(redis=False) as st:
        assert st.fleet is None
    monkeypatch.setenv(REDIS_URL_ENV, "")
    with ShardStore() as st:
        assert st.fleet is None
    with ShardStore(redis=down.url) as st:
        assert st.fleet is not None
        assert st.fleet.options.durable_after == 3.0
    with pytest.raises(InvalidArgumentError):
        ShardStore(redis=42)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        FleetOptions(down.url, durable_after=-1)
    assert down.url not in repr(down)


def test_the_redis_url_from_a_file_named_by_the_environment(tmp_path, monkeypatch, down):
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    url_file = tmp_path / "redis-url"
    url_file.write_text(down.url + "\n")
    url_file.chmod(0o600)
    monkeypatch.setenv("AGENTSPEC_REDIS_URL_FILE", str(url_file))
    with ShardStore() as st:
        assert st.fleet is not None
        assert st.fleet.options.url == down.url
    url_file.chmod(0o644)  # other users could read the password: refused
    with pytest.raises(InvalidArgumentError, match="mode 0644"):
        ShardStore()
    monkeypatch.setenv("AGENTSPEC_REDIS_URL_FILE", str(tmp_path / "missing"))
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        ShardStore()
