"""ShardStore(readonly=True) and the read-only ``agentspec shards`` commands next to a live writer.

The writer is a real second process holding the store's lock and learning
(with compactions) while the tests read; every step waits on the child's
acknowledgement line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentspec import SuffixTree
from agentspec.__main__ import main
from agentspec._store.store import ShardStore, StoreReadOnlyError
from agentspec.exceptions import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]
KEYS = (("acme", "sql", "plan"), ("acme", "sql", "write"))
LENGTH = 6

# Sequence n (1, 2, ...) is [n, n+1, n+2, n+3, n+4, 7], learned into KEYS[n % 2].
WRITER = """
import sys, threading
from agentspec._store.store import ShardStore

KEYS = (("acme", "sql", "plan"), ("acme", "sql", "write"))
store = ShardStore(sys.argv[1], fsync=False, snapshot_every=7, redis=False)
n = 0
stop = threading.Event()

def learn_one():
    global n
    n += 1
    store.learn(KEYS[n % 2], [n, n + 1, n + 2, n + 3, n + 4, 7])

def spin():
    while not stop.is_set():
        learn_one()

spinner = threading.Thread(target=spin)
print("ready", flush=True)
for line in sys.stdin:
    cmd, *arg = line.split()
    if cmd == "learn":
        for _ in range(int(arg[0])):
            learn_one()
        print("learned", n, flush=True)
    elif cmd == "spin":
        spinner.start()
        print("spinning", flush=True)
    elif cmd == "stop":
        stop.set()
        spinner.join()
        print("stopped", n, flush=True)
store.close()
print("closed", flush=True)
"""


class Writer:
    """The child process holding the store; `ask` sends a command and returns its answer."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.read() == ["ready"]

    def read(self) -> list[str]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the writer exited (rc {self.proc.wait(timeout=30)})"
        return line.split()

    def ask(self, command: str) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=30)
            if self.proc.stdout is not None:
                self.proc.stdout.close()


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[Writer]:
    w = Writer(tmp_path / "store")
    try:
        yield w
    finally:
        w.close()


def shards(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["shards", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def stats(capsys: pytest.CaptureFixture[str], path: Path) -> dict[tuple[str, str, str], dict]:
    rc, out, err = shards(capsys, "stats", "--store", str(path), "--json")
    assert rc == 0, err
    return {(d["tenant"], d["pipeline"], d["stage"]): d for d in json.loads(out)}


def well_formed(tree: SuffixTree) -> int:
    """Every sequence is one the writer learned; returns how many there are."""
    ids = tree.sequence_ids()
    for sid in ids:
        seq = tree.sequence(sid)
        n = seq[0]
        assert seq == [n, n + 1, n + 2, n + 3, n + 4, 7], (sid, seq)
    return len(ids)


def test_read_only_commands_run_while_another_process_writes(
    tmp_path: Path, writer: Writer, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "store"
    assert writer.ask("learn 20") == ["learned", "20"]

    # The child holds the writer's lock: a writing command is still refused.
    rc, _, err = shards(capsys, "compact", "--store", str(path))
    assert rc == 1
    assert "in use by another ShardStore" in err

    docs = stats(capsys, path)
    assert sorted(docs) == sorted(KEYS)
    assert [docs[k]["sequences"] for k in KEYS] == [10, 10]
    assert [docs[k]["tokens"] for k in KEYS] == [10 * LENGTH, 10 * LENGTH]
    rc, out, _ = shards(capsys, "list", "--store", str(path), "--json", "--lock-timeout", "0")
    assert rc == 0
    assert len(json.loads(out)) == 2

    with ShardStore(path, readonly=True) as ro:
        assert ro.readonly
        assert "read-only" in repr(ro)
        assert well_formed(ro.tree(KEYS[0])) == 10
        for write in (
            lambda: ro.learn(KEYS[0], [1]),
            lambda: ro.import_shard(KEYS[0], ro.snapshot(KEYS[0])[0]),
            lambda: ro.drop(KEYS[0]),
            ro.compact,
        ):
            with pytest.raises(StoreReadOnlyError, match="read-only"):
                write()
        assert ro.stats(KEYS[0]).sequences == 10

    # Reads while the child learns (and compacts every 7 records) all the time.
    assert writer.ask("spin") == ["spinning"]
    seen = []
    for _ in range(6):
        docs = stats(capsys, path)
        total = sum(d["sequences"] for d in docs.values())
        assert total >= 20
        assert sum(d["tokens"] for d in docs.values()) == total * LENGTH
        assert all(d["last_seq"] == d["sequences"] for d in docs.values())  # nothing lost
        seen.append(total)
        out_file = tmp_path / "plan.ashd"
        argv = ["export", "--store", str(path), "--stage", "plan", "--tenant", "acme"]
        rc, _, err = shards(capsys, *argv, "--pipeline", "sql", str(out_file))
        assert rc == 0, err
        assert well_formed(SuffixTree.from_bytes(out_file.read_bytes())) >= 10
    assert seen == sorted(seen)
    word, final = writer.ask("stop")
    assert word == "stopped"
    assert int(final) > 20  # the child did write while the reads ran

    docs = stats(capsys, path)
    assert sum(d["sequences"] for d in docs.values()) == int(final)
    assert sum(d["tokens"] for d in docs.values()) == int(final) * LENGTH

    # push and status read the store too, and see the same numbers the worker gets.
    from agentspec._push.intake import ShardIntake, serve_intake

    worker, thread = serve_intake(ShardIntake())
    try:
        argv = ["--store", str(path), "--endpoint", worker.url]
        rc, out, err = shards(capsys, "status", *argv)
        assert rc == 1, err
        assert out.count(": missing (local") == 2
        rc, out, err = shards(capsys, "push", *argv)
        assert rc == 0, err + out
        rc, out, err = shards(capsys, "status", *argv)
        assert rc == 0, err + out
        assert out.count(": in-sync (local") == 2
    finally:
        worker.stop(thread)
    writer.close()
    assert writer.proc.returncode == 0


def test_read_only_open_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ShardStore(path, fsync=False) as st:
        st.learn(KEYS[0], [1, 2, 3])
        st.learn(KEYS[0], [4, 5])
    (journal,) = path.glob("shards/*/journal.log")
    torn = journal.read_bytes() + b"ASJL\x01\x00"  # an unacknowledged, torn tail
    journal.write_bytes(torn)
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with ShardStore(path, readonly=True) as ro:
        assert {s: ro.tree(KEYS[0]).sequence(s) for s in (1, 2)} == {1: [1, 2, 3], 2: [4, 5]}
        with ShardStore(path, fsync=False) as rw:  # no lock is held by the reader
            assert rw.stats(KEYS[0]).sequences == 2
    after = {p: p.read_bytes() for p in before}
    assert after[journal] != torn  # the writer cut the torn tail ...
    with ShardStore(path, readonly=True):
        pass
    assert {p: p.read_bytes() for p in before} == after  # ... the reader touched nothing


def test_read_only_refusals(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no shard store"):
        ShardStore(tmp_path / "missing", readonly=True)
    assert not (tmp_path / "missing").exists()
    with pytest.raises(InvalidArgumentError, match="needs a path"):
        ShardStore(readonly=True)
    ShardStore(tmp_path / "s").close()
    with pytest.raises(InvalidArgumentError, match="publishes nothing"):
        ShardStore(tmp_path / "s", readonly=True, redis="redis://127.0.0.1:1")
