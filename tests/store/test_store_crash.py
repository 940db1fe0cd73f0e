"""ShardStore recovery: corruption quarantine, torn tails, crash windows, SIGKILL."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentspec import SuffixTree
from agentspec._core.shardkey import is_shard_dir_name, key_dir_name
from agentspec._store.store import ShardStore

A = ("acme", "sql", "plan")
C = ("other", None, None)


def keys_of(store: ShardStore) -> list:
    """All keys of a store (ShardStore is not iterable itself)."""
    return store.keys()


def content(tree: SuffixTree | None) -> dict[int, list[int]]:
    assert tree is not None
    return {sid: tree.sequence(sid) for sid in tree.sequence_ids()}


def shard_dir(path: Path, key) -> Path:
    return path / "shards" / key_dir_name(key)


def two_shards(path: Path, n: int = 3, **kw) -> dict:
    """A store with shards A and C, n sequences each, journals not compacted."""
    expect: dict = {A: {}, C: {}}
    with ShardStore(path, fsync=False, snapshot_every=1000, **kw) as st:
        for i in range(n):
            for k in (A, C):
                toks = [i, i + 1, i + 2, len(k[0])]
                expect[k][st.learn(k, toks)] = toks
    return expect


# --- quarantine ---------------------------------------------------------------


def damage(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x21
    path.write_bytes(bytes(data))


def journal_records(path: Path) -> list[int]:
    """End offsets of the records of a journal file."""
    from agentspec._store.journal import read_journal

    return [r.end for r in read_journal(path).records]


@pytest.mark.parametrize(
    "how",
    ["snapshot-bytes", "snapshot-missing", "json-garbage", "json-key", "journal-middle"],
)
def test_corrupt_shard_is_quarantined_and_the_rest_loads(tmp_path, how):
    path = tmp_path / "s"
    expect = two_shards(path)
    with ShardStore(path, fsync=False) as st:
        st.compact()  # A's snapshot now holds its sequences
        st.learn(A, [50, 51])
        st.learn(A, [52])
        st.learn(A, [53])
    d = shard_dir(path, A)
    if how == "snapshot-bytes":
        damage(d / "snapshot.ashd", 60)
    elif how == "snapshot-missing":
        (d / "snapshot.ashd").unlink()
    elif how == "json-garbage":
        (d / "snapshot.json").write_bytes(b"{not json")
    elif how == "json-key":
        text = (d / "snapshot.json").read_text(encoding="utf-8")
        (d / "snapshot.json").write_text(text.replace('"acme"', '"acmf"'), encoding="utf-8")
    else:
        ends = journal_records(d / "journal.log")
        assert len(ends) == 3
        damage(d / "journal.log", ends[0] + 15)
    with ShardStore(path, fsync=False) as st:
        assert st.keys() == [C]
        assert content(st.tree(C)) == expect[C]
        (q,) = st.quarantined
        assert q.parent == path / "corrupt"
        assert q.name.startswith(d.name + ".")
        assert q.is_dir()
        assert not d.exists()
        st.learn(A, [1])  # the key starts afresh
    with ShardStore(path) as st:
        assert st.quarantined == []
        assert content(st.tree(A)) == {1: [1]}


def test_torn_tail_is_truncated(tmp_path):
    path = tmp_path / "s"
    expect = two_shards(path)
    j = shard_dir(path, A) / "journal.log"
    size = j.stat().st_size
    with j.open("r+b") as f:
        f.truncate(size - 5)  # the last record lost its end: never acknowledged
    j2 = shard_dir(path, C) / "journal.log"
    with j2.open("ab") as f:
        f.write(b"\x00" * 37)  # zeros past the end (a torn block)
    with ShardStore(path, fsync=False, snapshot_every=1000) as st:
        assert st.quarantined == []
        del expect[A][3]
        assert content(st.tree(A)) == expect[A]
        assert content(st.tree(C)) == expect[C]
        assert st.learn(A, [9, 9]) == 3
        expect[A][3] = [9, 9]
    with ShardStore(path) as st:
        assert content(st.tree(A)) == expect[A]
        assert content(st.tree(C)) == expect[C]


# --- crash windows of a compaction, reproduced file by file ------------------


@pytest.mark.parametrize("restore", ["json", "journal", "json+journal"])
def test_interrupted_compaction_recovers_exactly(tmp_path, restore):
    """A crash between the renames of a compaction, or before the journal reset."""
    path = tmp_path / "s"
    with ShardStore(path, fsync=False, snapshot_every=1000, max_bytes=12_000) as st:
        for i in range(40):
            st.learn(A, [i % 5, i % 7, i, 3, 3])
        want = content(st.tree(A))
        evicted = st.stats(A).evicted
        assert evicted > 0
        d = shard_dir(path, A)
        old = {n: (d / n).read_bytes() for n in ("snapshot.json", "journal.log")}
        st.compact()
    for name in ("snapshot.json", "journal.log"):
        if name.split(".")[0] in restore:
            (d / name).write_bytes(old[name])
    for nxt in (41, 42):  # the first open repairs, the second sees the repair
        with ShardStore(path, fsync=False) as st:
            assert st.quarantined == []
            assert content(st.tree(A)) == want
            assert st.stats(A).evicted == evicted
            assert st.learn(A, [7]) == nxt
            want[nxt] = [7]


def test_interrupted_directory_operations_are_finished_or_undone(tmp_path):
    path = tmp_path / "s"
    expect = two_shards(path)
    shards = path / "shards"
    a = shard_dir(path, A)
    # a replace that moved the old directory away but never brought the new one
    a.rename(shards / f"{a.name}.replaced-0123abcd")
    # a new shard that was still being built, a drop that was not cleaned up
    (shards / f"{a.name}.tmp-89abcdef").mkdir()
    c = shard_dir(path, C)
    shutil.copytree(c, shards / f"{c.name}.dropped-00000000")
    # stray temp files of an unfinished snapshot
    (c / "snapshot.json.tmp").write_bytes(b"partial")
    (shards / "README").write_text("not ours", encoding="utf-8")
    with ShardStore(path, fsync=False) as st:
        assert content(st.tree(A)) == expect[A]
        assert content(st.tree(C)) == expect[C]
    names = sorted(p.name for p in shards.iterdir())
    assert names == sorted([a.name, c.name, "README"])
    assert not (c / "snapshot.json.tmp").exists()


# --- SIGKILL at random moments ------------------------------------------------

CHILD = r"""
import random, sys
from agentspec import SuffixTree
from agentspec._store.store import ShardStore

path, rnd = sys.argv[1], int(sys.argv[2])
rng = random.Random(rnd)
keys = [("t1", "p", "s"), ("t2", None, None), ("t1", None, "x")]
imp = ("imp", None, None)
st = ShardStore(path, snapshot_every=5, fsync=True)
out = sys.stdout
out.write("READY\n"); out.flush()
i = 0
while True:
    ki = rng.randrange(len(keys))
    toks = [rng.randrange(1000) for _ in range(rng.randrange(1, 80))]
    sid = st.learn(keys[ki], toks)
    out.write("A %d %d %s\n" % (ki, sid, " ".join(map(str, toks)))); out.flush()
    i += 1
    if i % 7 == 0:
        out.write("C\n"); out.flush()
        st.compact()
    if i % 11 == 0:
        gen = rnd * 1000 + i
        t = SuffixTree()
        for j in range(3):
            t.add(gen * 10 + j, [gen % 997, j])
        st.import_shard(imp, t.to_bytes(), replace=True)
        out.write("I %d\n" % gen); out.flush()
"""

KEYS = [("t1", "p", "s"), ("t2", None, None), ("t1", None, "x")]
IMP = ("imp", None, None)


# Where a round kills the writer. Every trigger is an acknowledgement the child
# printed, so a slow disk only makes a round slower, never a different round:
#   "append"  after the k-th ``A`` (k random): inside one of the next appends
#   "compact" after the n-th ``C``: inside that compaction (``C`` comes first)
#   "import"  after the 11th ``A``: inside the import that follows it
#   "after"   after the first ``I``: that import is acknowledged, so round 0
#             (and every fourth) pins a generation: ``max_gen >= 0`` is certain
TRIGGERS = ("after", "append", "compact", "import")
WAIT_S = 60.0  # only a stuck child runs into it


class ChildLines:
    """What the child acknowledged so far, counted by a reader thread."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.count = {"READY": 0, "A": 0, "C": 0, "I": 0}
        self.eof = False
        self.cond = threading.Condition()

    def add(self, line: str) -> None:
        with self.cond:
            self.lines.append(line)
            tag = line.split(maxsplit=1)[0]
            if tag in self.count:
                self.count[tag] += 1
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    def wait(self, tag: str, n: int) -> bool:
        """Until the n-th ``tag`` line arrived; False if the child ended first."""
        with self.cond:
            self.cond.wait_for(lambda: self.count[tag] >= n or self.eof, WAIT_S)
            return self.count[tag] >= n


def run_child(path: Path, rnd: int, rng: random.Random, err: Path) -> list[str]:
    """Start the child, SIGKILL it at a chosen acknowledgement; return its complete lines."""
    trigger = TRIGGERS[rnd % len(TRIGGERS)]
    tag, n = {
        "append": ("A", rng.randint(1, 24)),
        "compact": ("C", rng.randint(1, 2)),
        "import": ("A", 11),
        "after": ("I", 1),
    }[trigger]
    jitter = rng.uniform(0, 0.003)  # where inside the next operation it lands
    seen = ChildLines()
    with err.open("ab") as errf:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), str(rnd)],
            stdout=subprocess.PIPE,
            stderr=errf,
            text=True,
        )

    def read() -> None:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                if line.endswith("\n"):
                    seen.add(line)
        finally:
            seen.close()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert seen.wait("READY", 1), err.read_text()
        assert seen.wait(tag, n), (rnd, trigger, n, err.read_text())
        time.sleep(jitter)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=WAIT_S)
        reader.join(timeout=WAIT_S)
        assert proc.stdout is not None
        proc.stdout.close()
    assert not reader.is_alive()
    assert proc.returncode == -signal.SIGKILL, err.read_text()
    return seen.lines


def test_sigkill_loses_no_acknowledged_sequence(tmp_path):
    path = tmp_path / "store"
    err = tmp_path / "child-stderr.txt"
    rng = random.Random(12345)
    acked: dict = {}
    max_gen = -1
    rounds = 25
    for rnd in range(rounds):
        for line in run_child(path, rnd, rng, err):
            parts = line.split()
            if parts[0] == "A":
                ki, sid = int(parts[1]), int(parts[2])
                acked[KEYS[ki], sid] = [int(t) for t in parts[3:]]
            elif parts[0] == "I":
                max_gen = max(max_gen, int(parts[1]))
        with ShardStore(path, fsync=False) as st:
            assert st.quarantined == []
            for (key, sid), toks in acked.items():
                tree = st.tree(key)
                assert tree is not None
                assert sid in tree, (rnd, key, sid)
                assert tree.sequence(sid) == toks, (rnd, key, sid)
            for key in keys_of(st):
                st.tree(key).check()
            imp = st.tree(IMP)
            if max_gen >= 0:
                ids = sorted(imp.sequence_ids())
                gen = ids[0] // 10
                assert gen >= max_gen
                assert ids == [gen * 10 + j for j in range(3)]
                assert content(imp) == {gen * 10 + j: [gen % 997, j] for j in range(3)}
        leftovers = [p.name for p in (path / "shards").iterdir() if not is_shard_dir_name(p.name)]
        assert leftovers == []
    assert len(acked) > rounds
    assert max_gen >= 0
