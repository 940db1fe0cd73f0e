"""Threads: parallel drafting from one shared tree, and concurrent misuse.

Drafting only reads a tree, so many threads may draft from one shard at once
(each with its own Cursor) while other trees are being modified; the results
must be exactly the single-threaded ones.  Modifying a tree while another
thread uses it must raise RuntimeError (the binding's non-blocking guard)
instead of corrupting the tree.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from agentspec import BatchDrafter, Cursor, Draft, DraftParams, SuffixTree

DEPTH = 16
N_READERS = 4
DEADLINE_S = 120.0  # contention tests give up (and fail) after this, never hang
PARAMS = [
    DraftParams(max_spec_tokens=8),
    DraftParams(max_spec_tokens=16, tree=True, min_token_prob=0.05),
    DraftParams(max_spec_tokens=6, alpha=2.0, offset=1.0, merge=True),
    DraftParams(max_spec_tokens=4, use_local=False, min_token_prob=0.0),
]


def corpus(seed: int, n: int) -> list[list[int]]:
    """Sequences built from a few recurring phrases, so drafts are non-trivial."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(40) for _ in range(rng.randrange(3, 12))] for _ in range(25)]
    seqs = []
    for _ in range(n):
        seq: list[int] = []
        while len(seq) < rng.randrange(40, 160):
            seq += rng.choice(phrases) if rng.random() < 0.8 else [rng.randrange(40)]
        seqs.append(seq)
    return seqs


def shared_shard() -> bytes:
    """A snapshot of a tree over the corpus."""
    with SuffixTree(DEPTH) as tree:
        for i, seq in enumerate(corpus(7, 60)):
            tree.add(i, seq)
        return tree.to_bytes()


def request_steps(seed: int) -> list[list[int]]:
    """One request's chunks: a prompt, then accepted tokens 1-4 at a time."""
    rng = random.Random(seed)
    stream = [t for s in corpus(seed, 3) for t in s]
    chunks = [stream[:20]]
    i = 20
    while i < len(stream):
        k = rng.randrange(1, 5)
        chunks.append(stream[i : i + k])
        i += k
    return chunks


def run_request(tree: SuffixTree, seed: int) -> list[Draft]:
    """Feed one request into a fresh cursor, drafting after every chunk."""
    out = []
    with Cursor(DEPTH) as cur:
        for step, chunk in enumerate(request_steps(seed)):
            cur.extend(chunk)
            out.append(cur.draft(tree, PARAMS[step % len(PARAMS)]))
    return out


def run_batched(tree: SuffixTree, seeds: list[int], threads: int) -> list[list[Draft]]:
    """Feed several requests through one BatchDrafter, one decode step per call."""
    steps = [request_steps(s) for s in seeds]
    cursors = [Cursor(DEPTH) for _ in seeds]
    drafter = BatchDrafter(PARAMS[1], threads=threads)
    out: list[list[Draft]] = [[] for _ in seeds]
    try:
        for step in range(max(map(len, steps))):
            live = [i for i, s in enumerate(steps) if step < len(s)]
            drafts = drafter.draft([(cursors[i], tree, steps[i][step]) for i in live])
            for i, d in zip(live, drafts, strict=True):
                out[i].append(d)
    finally:
        for c in cursors:
            c.close()
    return out


def run_threads(targets: list[Callable[[], Any]]) -> list[Any]:
    """Run callables on threads started together; return results, re-raise errors."""
    barrier = threading.Barrier(len(targets))
    results: list[Any] = [None] * len(targets)
    errors: list[BaseException] = []

    def wrap(i: int) -> None:
        try:
            barrier.wait()
            results[i] = targets[i]()
        except BaseException as exc:  # collected and re-raised in the caller
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def churn(stop: threading.Event) -> int:
    """Keep appending to and removing sequences of a private tree until stopped."""
    rng = random.Random(99)
    seqs = corpus(99, 20)
    rounds = 0
    with SuffixTree(DEPTH) as other:
        while not stop.is_set() or rounds < 20:
            sid = rounds % 8
            if sid in other:
                other.remove(sid)
            seq = rng.choice(seqs)
            for i in range(0, len(seq), 7):
                other.append(sid, seq[i : i + 7])
            if rounds % 3 == 0:
                other.close_sequence(sid)
            rounds += 1
        other.check()
    return rounds


def test_parallel_drafts_equal_single_threaded() -> None:
    """Threads drafting from one shared shard, beside a writer of another tree, match serial."""
    seeds = [101 + i for i in range(N_READERS)]
    with SuffixTree.from_bytes(shared_shard()) as tree:
        expected = [run_request(tree, s) for s in seeds]
        expected_batch = run_batched(tree, [201, 202, 203], threads=1)
        assert any(len(d) for per in expected for d in per)  # the drafts are not all empty
        stop = threading.Event()

        def readers_then_stop(seed: int) -> Callable[[], list[Draft]]:
            return lambda: run_request(tree, seed)

        targets: list[Callable[[], Any]] = [readers_then_stop(s) for s in seeds]
        targets.append(lambda: run_batched(tree, [201, 202, 203], threads=2))
        writer_result: list[int] = []
        writer = threading.Thread(target=lambda: writer_result.append(churn(stop)))
        writer.start()
        try:
            for _round in range(3):
                results = run_threads(targets)
                assert results[:N_READERS] == expected
                assert results[N_READERS] == expected_batch
        finally:
            stop.set()
            writer.join()
        assert writer_result
        assert writer_result[0] >= 20
        tree.check()


def backoff() -> None:
    """Let the other thread take the GIL and the tree between two attempts.

    Without a pause, a thread retrying in a tight loop can keep missing the
    short windows in which the other thread is outside a call (it only ever
    gets the GIL while the other thread is inside C holding the guard): a
    livelock on some schedulers.
    """
    time.sleep(0.0005)


def test_concurrent_modification_raises_runtime_error() -> None:
    """Modifying or reading a tree while another thread modifies it raises RuntimeError."""
    rng = random.Random(5)
    big = [rng.randrange(50) for _ in range(300_000)]
    tree = SuffixTree(64)
    started = threading.Event()
    outcome: dict[str, int] = {"write_ok": 0, "write_busy": 0, "read_busy": 0, "add_retries": 0}
    deadline = time.monotonic() + DEADLINE_S

    def long_add() -> None:
        started.set()
        while time.monotonic() < deadline:
            try:
                tree.add(1, big)  # holds the tree for a few hundred milliseconds
                return
            except RuntimeError:
                outcome["add_retries"] += 1
                backoff()

    adder = threading.Thread(target=long_add)
    adder.start()
    started.wait()
    while adder.is_alive() and time.monotonic() < deadline:
        try:
            tree.append(2, [7])
            outcome["write_ok"] += 1
        except RuntimeError:
            outcome["write_busy"] += 1
        try:
            tree.count([7])
        except RuntimeError:
            outcome["read_busy"] += 1
        backoff()
    adder.join()
    with tree:
        assert 1 in tree, f"the long add never got the tree: {outcome}"
        assert outcome["write_busy"] > 0
        assert outcome["read_busy"] > 0
        tree.check()
        assert tree.sequence(1) == big
        appended = tree.sequence(2) if 2 in tree else []
        assert appended == [7] * outcome["write_ok"]
        assert len(tree) == (2 if outcome["write_ok"] else 1)


def test_modification_during_read_raises_runtime_error() -> None:
    """A modification while another thread reads (check) the tree raises RuntimeError."""
    rng = random.Random(6)
    tree = SuffixTree(64)
    tree.add(1, [rng.randrange(50) for _ in range(300_000)])
    count_before = tree.count([1, 2])
    started = threading.Event()
    done = threading.Event()
    deadline = time.monotonic() + DEADLINE_S
    checks = 0

    def long_reads() -> None:
        nonlocal checks
        started.set()
        try:
            while checks < 5 and time.monotonic() < deadline:
                try:
                    tree.check()  # a read of the whole tree, tens of milliseconds each
                    checks += 1
                except RuntimeError:
                    backoff()  # refused: the main thread was inside a (short) write
        finally:
            done.set()

    reader = threading.Thread(target=long_reads)
    reader.start()
    started.wait()
    busy = 0
    present = False  # sequence 2 goes in and out, so memory stays bounded
    while not done.is_set():
        try:
            if present:
                tree.remove(2)
            else:
                tree.add(2, [1, 2, 3])
            present = not present
        except RuntimeError:
            busy += 1
        backoff()
    reader.join()
    with tree:
        assert checks == 5, "the reader never got the tree often enough"
        assert busy > 0
        assert tree.sequence_ids() == ([1, 2] if present else [1])
        assert tree.count([1, 2]) == count_before + present
        if present:
            tree.remove(2)
        tree.check()
        assert tree.count([1, 2]) == count_before


def test_cursor_used_from_two_threads_raises() -> None:
    """Using a Cursor from a second thread while the first is inside a call raises RuntimeError."""
    rng = random.Random(8)
    long_prompt = [rng.randrange(50) for _ in range(300_000)]
    cur = Cursor(64)
    started = threading.Event()
    deadline = time.monotonic() + DEADLINE_S

    def long_extend() -> None:
        started.set()
        while time.monotonic() < deadline:
            try:
                cur.extend(long_prompt)  # a few hundred milliseconds inside the cursor
                return
            except RuntimeError:
                backoff()  # the main thread was inside draft(); nothing was appended

    worker = threading.Thread(target=long_extend)
    worker.start()
    started.wait()
    busy = 0
    while worker.is_alive() and time.monotonic() < deadline:
        try:
            cur.draft(None)
        except RuntimeError:
            busy += 1
        backoff()
    worker.join()
    with cur:
        assert len(cur) == len(long_prompt), "the long extend never got the cursor"
        assert busy > 0
