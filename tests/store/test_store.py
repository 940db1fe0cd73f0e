"""ShardStore: learning, recovery, budget, deltas, imports, listeners, threads, the lock."""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest

from agentspec import SuffixTree
from agentspec._store.store import (
    ShardNotFoundError,
    ShardStats,
    ShardStore,
    StoreLockedError,
    check_key,
)
from agentspec.exceptions import (
    DepthMismatchError,
    InvalidArgumentError,
    InvalidTokenError,
    ShardFormatError,
    TreeClosedError,
)

A = ("acme", "sql", "plan")
B = ("acme", "sql", None)
C = ("other", None, None)


def keys_of(store: ShardStore) -> list:
    """All keys of a store (ShardStore is not iterable itself)."""
    return store.keys()


def content(tree: SuffixTree | None) -> dict[int, list[int]]:
    """seq id -> tokens of a tree."""
    assert tree is not None
    return {sid: tree.sequence(sid) for sid in tree.sequence_ids()}


def rand_tokens(rng: random.Random, n: int = 12) -> list[int]:
    return [rng.randrange(40) for _ in range(n)]


def live_bytes(store: ShardStore) -> int:
    total = 0
    for k in keys_of(store):
        s = store.tree(k).stats()
        total += s.bytes - s.free_bytes
    return total


# --- memory-only --------------------------------------------------------------


def test_memory_round_trip():
    with ShardStore() as st:
        assert st.path is None
        assert st.learn(A, [1, 2, 3]) == 1
        assert st.learn(A, np.array([4, 5], dtype=np.int32)) == 2
        assert st.learn(C, (7, 8)) == 1
        assert st.keys() == [A, C]
        assert st.keys(tenant="acme") == [A]
        assert st.keys(tenant="nobody") == []
        assert content(st.tree(A)) == {1: [1, 2, 3], 2: [4, 5]}
        assert st.tree(B) is None
        s = st.stats(A)
        assert isinstance(s, ShardStats)
        assert (s.key, s.sequences, s.tokens, s.first_seq, s.last_seq, s.evicted) == (
            A,
            2,
            5,
            1,
            2,
            0,
        )
        assert s.bytes > 0
        assert s.version == st.version(A)
        data, v = st.snapshot(A)
        assert v == st.version(A)
        assert content(SuffixTree.from_bytes(data)) == content(st.tree(A))
        st.compact()  # nothing to do in memory
        assert st.quarantined == []
    assert st.closed
    with pytest.raises(TreeClosedError):
        st.learn(A, [1])
    st.close()


def test_versions_grow_with_every_change():
    st = ShardStore(max_bytes=None)
    seen = []
    for i in range(5):
        st.learn(A, [i, i + 1])
        seen.append(st.version(A))
        st.learn(C, [i])
    assert seen == sorted(set(seen))


@pytest.mark.parametrize(
    "key",
    [
        ("", None, None),
        ("t" * 129, None, None),
        ("t", "a\x00b", None),
        ("t", None, "x\ny"),
        (None, None, None),
        ("t", 3, None),
        ("t", None),
        "tenant",
    ],
)
def test_bad_keys_are_refused(key):
    st = ShardStore()
    with pytest.raises(InvalidArgumentError):
        st.learn(key, [1])
    with pytest.raises(InvalidArgumentError):
        check_key(key)
    assert st.keys() == []


def test_bad_tokens_change_nothing(tmp_path):
    with ShardStore(tmp_path / "s", fsync=False) as st:
        with pytest.raises(InvalidArgumentError, match="empty"):
            st.learn(A, [])
        with pytest.raises(InvalidTokenError):
            st.learn(A, [1, -5])
        with pytest.raises(TypeError):
            st.learn(A, "abc")
        with pytest.raises(TypeError):
            st.learn(A, [1.5])
        assert st.keys() == []
        assert st.learn(A, [3]) == 1
        with pytest.raises(InvalidTokenError):
            st.learn(A, [2**31])
        assert content(st.tree(A)) == {1: [3]}
    with ShardStore(tmp_path / "s") as st:
        assert content(st.tree(A)) == {1: [3]}


def test_unknown_shard_and_bad_parameters():
    st = ShardStore()
    for call in (st.stats, st.version, st.snapshot, st.drop):
        with pytest.raises(ShardNotFoundError):
            call(A)
    with pytest.raises(ShardNotFoundError):
        st.delta_since(A, 0)
    st.learn(A, [1])
    with pytest.raises(TypeError):
        st.delta_since(A, 1.0)
    with pytest.raises(InvalidArgumentError):
        ShardStore(max_bytes=-1)
    with pytest.raises(InvalidArgumentError):
        ShardStore(snapshot_every=0)
    with pytest.raises(InvalidArgumentError):
        ShardStore(max_depth=1)
    with pytest.raises(InvalidArgumentError):
        ShardStore(lock_timeout=-1.0)
    with pytest.raises(TypeError):
        ShardStore(max_bytes=True)
    with pytest.raises(TypeError):
        st.add_listener(42)


# --- persistence --------------------------------------------------------------


@pytest.mark.parametrize("snapshot_every", [1, 3, 1000])
def test_recovery_after_close(tmp_path, snapshot_every):
    rng = random.Random(snapshot_every)
    expect: dict = {A: {}, B: {}, C: {}}
    path = tmp_path / "store"
    for _round in range(3):
        with ShardStore(path, fsync=False, snapshot_every=snapshot_every) as st:
            for k in expect:
                assert content(st.tree(k) or SuffixTree()) == expect[k]
            for _ in range(10):
                k = rng.choice([A, B, C])
                toks = rand_tokens(rng)
                expect[k][st.learn(k, toks)] = toks
    with ShardStore(path) as st:
        assert set(st.keys()) == set(expect)
        for k, seqs in expect.items():
            assert content(st.tree(k)) == seqs
            assert st.stats(k).last_seq == max(seqs)
        assert st.quarantined == []


def test_ids_continue_after_reopen_even_when_the_newest_was_evicted(tmp_path):
    path = tmp_path / "s"
    with ShardStore(path, fsync=False) as st:
        for i in range(5):
            st.learn(A, [i, 1, 2])
    with ShardStore(path, fsync=False, max_bytes=0) as st:
        assert st.keys() == [A]
        assert st.stats(A).sequences == 0
        assert st.stats(A).evicted == 5
    with ShardStore(path, fsync=False) as st:
        assert st.learn(A, [9]) == 6
        assert st.stats(A).evicted == 5


def test_permissions(tmp_path):
    old = os.umask(0)
    try:
        path = tmp_path / "s"
        with ShardStore(path, fsync=False, snapshot_every=2) as st:
            st.learn(A, [1, 2])
            st.learn(A, [1, 2])
            st.learn(C, [3])
    finally:
        os.umask(old)
    for root, dirs, files in os.walk(path):
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700, root
        for f in files:
            assert stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) == 0o600, f
        assert dirs or files
    names = {p.name for p in path.iterdir()}
    assert names == {"LOCK", "shards"}
    shard_dirs = list((path / "shards").iterdir())
    assert len(shard_dirs) == 2
    for d in shard_dirs:
        assert {p.name for p in d.iterdir()} == {"snapshot.ashd", "snapshot.json", "journal.log"}


def test_long_keys_get_hashed_names(tmp_path):
    key = ("é" * 128, "p" * 128, "\u2603" * 128)
    with ShardStore(tmp_path / "s", fsync=False) as st:
        st.learn(key, [1, 2])
    (d,) = (tmp_path / "s" / "shards").iterdir()
    assert d.name.startswith("h")
    assert len(d.name) == 65
    with ShardStore(tmp_path / "s") as st:
        assert st.keys() == [key]
        assert content(st.tree(key)) == {1: [1, 2]}


def test_drop(tmp_path):
    path = tmp_path / "s"
    with ShardStore(path, fsync=False) as st:
        st.learn(A, [1])
        st.learn(C, [2])
        st.drop(A)
        assert st.keys() == [C]
        with pytest.raises(ShardNotFoundError):
            st.stats(A)
        assert len(list((path / "shards").iterdir())) == 1
    with ShardStore(path) as st:
        assert st.keys() == [C]
        assert st.learn(A, [5]) == 1


# --- budget -------------------------------------------------------------------


def test_budget_evicts_oldest_first_store_wide(tmp_path):
    rng = random.Random(7)
    path = tmp_path / "s"
    budget = 40_000
    learned: list = []  # (key, sid) in learn order
    tokens: dict = {}
    with ShardStore(path, fsync=False, max_bytes=budget, snapshot_every=25) as st:
        for _ in range(150):
            k = rng.choice([A, B, C])
            toks = rand_tokens(rng, 20)
            sid = st.learn(k, toks)
            learned.append((k, sid))
            tokens[k, sid] = toks
            assert live_bytes(st) <= budget
        survivors = [(k, sid) for k in keys_of(st) for sid in st.tree(k).sequence_ids()]
        evicted = sum(st.stats(k).evicted for k in keys_of(st))
        assert 0 < len(survivors) < len(learned)
        assert set(survivors) == set(learned[-len(survivors) :])
        assert evicted == len(learned) - len(survivors)
        for k in keys_of(st):
            s = st.stats(k)
            ids = st.tree(k).sequence_ids()
            assert s.sequences == len(ids)
            assert (s.first_seq, s.last_seq) == ((ids[0], ids[-1]) if ids else (None, None))
        st.compact()
    with ShardStore(path, fsync=False, max_bytes=budget) as st:
        after = [(k, sid) for k in keys_of(st) for sid in st.tree(k).sequence_ids()]
        assert set(after) == set(survivors)
        assert sum(st.stats(k).evicted for k in keys_of(st)) == evicted
        for k, sid in after:
            assert st.tree(k).sequence(sid) == tokens[k, sid]
        # learning goes on evicting the oldest of the survivors
        for _ in range(30):
            k = rng.choice([A, C])
            learned.append((k, st.learn(k, rand_tokens(rng, 20))))
        now = [(k, sid) for k in keys_of(st) for sid in st.tree(k).sequence_ids()]
        assert set(now) == set(learned[-len(now) :])
        assert sum(st.stats(k).evicted for k in keys_of(st)) == len(learned) - len(now)


def test_budget_evictions_in_the_journal_survive_reopen(tmp_path):
    path = tmp_path / "s"
    with ShardStore(path, fsync=False, max_bytes=20_000, snapshot_every=10_000) as st:
        for i in range(60):
            st.learn(A, [i % 7, i % 11, i % 13, i, 1, 2, 3])
        ids = st.tree(A).sequence_ids()
        ev = st.stats(A).evicted
    assert ev > 0
    assert ev + len(ids) == 60
    assert ids == list(range(ev + 1, 61))
    with ShardStore(path, fsync=False) as st:  # no budget now: nothing more goes
        assert st.tree(A).sequence_ids() == ids
        assert st.stats(A).evicted == ev


def test_sequence_over_the_whole_budget_is_evicted():
    st = ShardStore(max_bytes=100)
    assert st.learn(A, list(range(50))) == 1
    assert st.stats(A).sequences == 0
    assert st.stats(A).evicted == 1


# --- deltas -------------------------------------------------------------------


def test_delta_since_rebuilds_the_shard():
    rng = random.Random(3)
    st = ShardStore(max_bytes=30_000)
    for _ in range(20):
        st.learn(A, rand_tokens(rng))
    data, v = st.snapshot(A)
    copy = SuffixTree.from_bytes(data)
    for step in range(8):
        for _ in range(rng.randrange(0, 15)):
            st.learn(rng.choice([A, C]), rand_tokens(rng, 25))
        got = st.delta_since(A, v)
        assert got is not None
        delta, v2 = got
        assert v2 == st.version(A)
        copy.load(delta)
        assert content(copy) == content(st.tree(A)), step
        copy.load(delta)  # idempotent
        assert content(copy) == content(st.tree(A))
        v = v2
    assert st.stats(A).evicted > 0
    # an up-to-date version gets an empty delta
    first = SuffixTree.from_bytes(st.snapshot(A)[0])
    empty, same = st.delta_since(A, v)
    first.load(empty)
    assert same == v
    assert content(first) == content(st.tree(A))


def test_delta_since_is_none_when_history_is_gone():
    class Small(ShardStore):
        change_log_limit = 5

    st = Small()
    st.learn(A, [1])
    _, v = st.snapshot(A)
    for i in range(4):
        st.learn(A, [i])
    assert st.delta_since(A, v) is not None
    st.learn(A, [9])
    st.learn(A, [9])
    assert st.delta_since(A, v) is None
    assert st.delta_since(A, st.version(A) + 1) is None
    assert st.delta_since(A, st.version(A) - 2) is not None


def test_delta_since_refuses_versions_of_a_dropped_shard():
    st = ShardStore()
    st.learn(A, [1, 2])
    _, old = st.snapshot(A)
    st.drop(A)
    st.learn(A, [3, 4])
    st.learn(A, [5])
    assert st.delta_since(A, old) is None
    assert st.delta_since(A, old - 1) is None
    fresh = SuffixTree()
    (delta, _) = st.delta_since(A, st.version(A) - 2)
    fresh.load(delta)
    assert content(fresh) == {1: [3, 4], 2: [5]}


def test_delta_history_restarts_after_reopen(tmp_path):
    with ShardStore(tmp_path / "s", fsync=False) as st:
        st.learn(A, [1])
        _, v = st.snapshot(A)
        st.learn(A, [2])
    with ShardStore(tmp_path / "s", fsync=False) as st:
        assert st.delta_since(A, v) is None
        _, v = st.snapshot(A)
        st.learn(A, [3])
        copy = SuffixTree.from_bytes(st.snapshot(A)[0])
        delta, _ = st.delta_since(A, v)
        copy.load(delta)
        assert content(copy) == {1: [1], 2: [2], 3: [3]}


# --- import / export ----------------------------------------------------------


def test_import_replace_merge_and_persist(tmp_path):
    src = SuffixTree()
    src.add(10, [1, 2, 3])
    src.add(11, [4, 5])
    path = tmp_path / "s"
    with ShardStore(path, fsync=False) as st:
        versions = []
        st.add_listener(lambda k, v: versions.append((k, v)))
        st.learn(A, [7, 7])
        v = st.import_shard(A, src.to_bytes())
        assert v == st.version(A)
        assert content(st.tree(A)) == {1: [7, 7], 10: [1, 2, 3], 11: [4, 5]}
        assert st.learn(A, [8]) == 12
        delta_src = SuffixTree()
        delta_src.add(20, [6])
        st.import_shard(A, delta_src.delta_bytes([20], [10, 999]))
        assert content(st.tree(A)) == {1: [7, 7], 11: [4, 5], 12: [8], 20: [6]}
        st.import_shard(C, src.to_bytes())
        assert content(st.tree(C)) == {10: [1, 2, 3], 11: [4, 5]}
        st.import_shard(A, src.to_bytes(), replace=True)
        assert content(st.tree(A)) == content(src)
        assert st.learn(A, [1]) == 21
        assert [k for k, _ in versions] == [A, A, A, A, C, A, A]
        assert [v for _, v in versions] == sorted(v for _, v in versions)
    with ShardStore(path) as st:
        assert content(st.tree(A)) == {**content(src), 21: [1]}
        assert content(st.tree(C)) == content(src)


def test_delta_since_spans_imports():
    st = ShardStore()
    for i in range(4):
        st.learn(A, [i, 1])
    data, v = st.snapshot(A)
    copy = SuffixTree.from_bytes(data)
    src = SuffixTree()
    src.add(3, [9, 9, 9])  # re-adds id 3 with other tokens
    src.add(50, [5])
    st.import_shard(A, src.delta_bytes([3, 50], [1, 3]))
    st.learn(A, [7])
    assert content(st.tree(A)) == {2: [1, 1], 3: [9, 9, 9], 4: [3, 1], 50: [5], 51: [7]}
    delta, _ = st.delta_since(A, v)
    copy.load(delta)
    assert content(copy) == content(st.tree(A))
    _, v = st.snapshot(A)
    st.import_shard(A, src.to_bytes(), replace=True)
    assert st.delta_since(A, v) is None  # a replaced shard is sent whole


def test_import_bad_bytes_changes_nothing(tmp_path):
    with ShardStore(tmp_path / "s", fsync=False) as st:
        st.learn(A, [1, 2])
        good = st.snapshot(A)[0]
        v = st.version(A)
        flipped = bytearray(good)
        flipped[-3] ^= 0x10
        for bad in (b"", b"junk" * 20, good[:-1], bytes(flipped)):
            with pytest.raises(ShardFormatError):
                st.import_shard(A, bad)
            with pytest.raises(ShardFormatError):
                st.import_shard(B, bad, replace=True)
        other = SuffixTree(8)
        other.add(5, [1])
        with pytest.raises(DepthMismatchError):
            st.import_shard(A, other.to_bytes())
        with pytest.raises(DepthMismatchError):
            st.import_shard(A, other.delta_bytes([5]))
        assert st.version(A) == v
        assert st.keys() == [A]
        assert content(st.tree(A)) == {1: [1, 2]}
        st.import_shard(B, other.to_bytes())  # a new shard takes the bytes' depth
        assert st.tree(B).max_depth == 8
    with ShardStore(tmp_path / "s") as st:
        assert st.tree(B).max_depth == 8
        assert content(st.tree(A)) == {1: [1, 2]}


# --- listeners ----------------------------------------------------------------


def test_listeners_are_called_and_may_fail():
    st = ShardStore(max_bytes=3000)
    calls = []

    def bad(key, version):
        raise RuntimeError("listener bug")

    st.add_listener(bad)
    st.add_listener(lambda k, v: calls.append((k, v)))
    st.learn(A, [1, 2, 3])
    assert calls == [(A, st.version(A))]
    for i in range(20):
        st.learn(C, list(range(i, i + 30)))
    assert calls[-1] == (C, st.version(C))
    assert (A, st.version(A)) in calls  # A's eviction was announced
    st.drop(C)
    assert calls[-1][0] == C


# --- threads ------------------------------------------------------------------


def test_threads_learn_concurrently(tmp_path):
    path = tmp_path / "s"
    results: dict = {}
    errors: list = []
    st = ShardStore(path, fsync=False, snapshot_every=37)

    def work(t: int) -> None:
        try:
            rng = random.Random(t)
            for _ in range(150):
                k = A if rng.random() < 0.5 else C
                toks = rand_tokens(rng)
                results[k, st.learn(k, toks)] = toks
                st.stats(k)
                st.delta_since(k, max(0, st.version(k) - 3))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    try:
        for th in threads:
            th.start()
    finally:
        for th in threads:
            th.join(timeout=60)
        st.close()
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    assert len(results) == 600
    with ShardStore(path) as st:
        for (k, sid), toks in results.items():
            assert st.tree(k).sequence(sid) == toks
        assert st.stats(A).sequences + st.stats(C).sequences == 600
        assert st.stats(A).last_seq == st.stats(A).sequences


# --- the directory lock -------------------------------------------------------


def test_second_opener_in_the_same_process_is_refused(tmp_path):
    with (
        ShardStore(tmp_path / "s", fsync=False),
        pytest.raises(StoreLockedError, match=rf"in use .*pid {os.getpid()}"),
    ):
        ShardStore(tmp_path / "s")
    ShardStore(tmp_path / "s").close()


def test_second_process_is_refused(tmp_path):
    path = tmp_path / "s"
    script = (
        "import sys\n"
        "from agentspec._store.store import ShardStore, StoreLockedError\n"
        "try:\n"
        "    ShardStore(sys.argv[1])\n"
        "except StoreLockedError as e:\n"
        "    print('LOCKED', e)\n"
        "    sys.exit(3)\n"
    )
    with ShardStore(path, fsync=False) as st:
        st.learn(A, [1])
        proc = subprocess.run(
            [sys.executable, "-c", script, str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert proc.returncode == 3, proc.stderr
    assert "LOCKED" in proc.stdout
    assert "in use by another ShardStore" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_lock_timeout_waits_for_the_holder(tmp_path):
    path = tmp_path / "s"
    first = ShardStore(path, fsync=False)
    first.learn(A, [4])
    timer = threading.Timer(0.2, first.close)
    timer.start()
    try:
        with ShardStore(path, lock_timeout=30) as second:
            assert content(second.tree(A)) == {1: [4]}
    finally:
        timer.cancel()
        timer.join(timeout=10)
        first.close()


def test_remove_listener_stops_notifications():
    with ShardStore() as st:
        seen = []

        def listener(key, version):
            seen.append(version)

        st.add_listener(listener)
        st.learn(A, [1, 2])
        st.remove_listener(listener)
        st.remove_listener(listener)  # a second removal is ignored
        st.learn(A, [3])
        assert len(seen) == 1


# --- integral argument types -------------------------------------------------------

INTEGRAL = (np.int32, np.int64, np.uint16, np.uint32, np.int16)


@pytest.mark.parametrize("kind", INTEGRAL, ids=lambda k: k.__name__)
def test_integer_arguments_accept_numpy_integers(tmp_path, kind):
    """max_bytes, max_depth, snapshot_every and delta_since's version accept numpy integers."""
    with ShardStore(
        tmp_path / "s", max_bytes=kind(30000), max_depth=kind(16), snapshot_every=kind(2)
    ) as st:
        assert (st._max_bytes, st._max_depth, st._snapshot_every) == (30000, 16, 2)
        assert all(type(v) is int for v in (st._max_bytes, st._max_depth, st._snapshot_every))
        first = st.learn(A, [kind(1), kind(2)])
        version = st.version(A)
        st.learn(A, np.array([3, 4], dtype=np.int32))
        assert st.tree(A).max_depth == 16
        delta = st.delta_since(A, kind(version))
        assert delta is not None
        tree = SuffixTree(16)
        tree.add(first, [1, 2])
        tree.load(delta[0])
        assert content(tree) == content(st.tree(A))


@pytest.mark.parametrize("value", [True, np.True_, 2.0, "2"], ids=repr)
def test_integer_arguments_refuse_bool_and_non_integers(value):
    """bool and non-integers raise TypeError naming the argument."""
    name = "bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__
    with pytest.raises(TypeError, match=f"^max_bytes must be an int or None, not {name}$"):
        ShardStore(max_bytes=value)
    for kw in ("max_depth", "snapshot_every"):
        with pytest.raises(TypeError, match=f"^{kw} must be an int, not {name}$"):
            ShardStore(**{kw: value})
    st = ShardStore()
    st.learn(A, [1])
    with pytest.raises(TypeError, match=f"^version must be an int, not {name}$"):
        st.delta_since(A, value)
