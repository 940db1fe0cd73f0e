#!/usr/bin/env python
"""Push benchmark: `ShardPusher` against a local `ShardIntake` HTTP server.

Measures, with medians over ``--reps`` repetitions:

* **snapshot push**: a shard of ``--snapshot-tokens`` tokens sent to a fresh
  worker (first contact), as tokens/s and MB/s, through an upload and,
  with ``--shm-dir``, through a snapshot file;
* **delta latency**: one response of ``--delta-tokens`` tokens learned
  into a shard the worker already has (``--base-tokens``), then the time
  until `ShardPusher.flush` reports the worker acknowledged it (the learn
  itself is timed apart): one delta request of that many tokens;
* **sustained**: responses learned one by one while the pusher runs, as
  tokens/s from the first learn until the worker acknowledged the last.

The server runs in this process (a thread of the stdlib HTTP server), so
client and worker share one interpreter: a lower bound of what two
processes achieve.  Responses are windows of a small synthetic corpus with
random edits, so shards are as repetitive as agent outputs tend to be.
Nothing is asserted; the numbers are printed (``--json`` for one JSON line).

Run ``python benchmarks/bench_push.py --help``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentspec._push.intake import ShardIntake, serve_intake
from agentspec._push.pusher import ShardPusher
from agentspec._store.store import ShardStore

KEY = ("bench", "pipeline", "stage")


class Responses:
    """Synthetic responses: windows of a corpus with a few random edits."""

    def __init__(self, seed: int, length: int, corpus_tokens: int = 20_000) -> None:
        self.rng = np.random.default_rng(seed)
        self.corpus = self.rng.integers(0, 32_000, corpus_tokens, dtype=np.int32)
        self.length = length

    def next(self) -> np.ndarray:
        start = int(self.rng.integers(0, len(self.corpus) - self.length))
        out = self.corpus[start : start + self.length].copy()
        edits = self.rng.integers(0, self.length, max(1, self.length // 50))
        out[edits] = self.rng.integers(0, 32_000, len(edits), dtype=np.int32)
        return out

    def fill(self, store: ShardStore, key: tuple[str, str, str], tokens: int) -> int:
        """Learn responses until ``tokens`` tokens; return how many were learned."""
        n = 0
        while n < tokens:
            r = self.next()
            store.learn(key, r)
            n += len(r)
        return n


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench_snapshot(args: argparse.Namespace, shm_dir: str | None) -> dict[str, float]:
    """First-contact snapshot pushes to a fresh worker each repetition."""
    store = ShardStore(max_depth=args.depth)
    tokens = Responses(1, args.response_len).fill(store, KEY, args.snapshot_tokens)
    nbytes = len(store.snapshot(KEY)[0])
    times = []
    for _ in range(args.reps):
        intake = ShardIntake(
            max_depth=args.depth,
            shm_dir=shm_dir,
            max_body_bytes=1 << 31,
            max_bytes=None,  # measures transfer and load, not the budget
            max_tenant_bytes=None,
        )
        server, thread = serve_intake(intake)
        try:
            t0 = time.perf_counter()
            pusher = ShardPusher(store, [server.url], shm_dir=shm_dir, shm_threshold=0)
            try:
                if not pusher.flush(args.timeout):
                    raise RuntimeError(f"push did not finish: {pusher.status()}")
                times.append(time.perf_counter() - t0)
            finally:
                pusher.close()
        finally:
            server.stop(thread)
    store.close()
    t = _median(times)
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "seconds": t,
        "tokens_per_s": tokens / t,
        "mb_per_s": nbytes / t / 1e6,
    }


def bench_delta(args: argparse.Namespace) -> dict[str, float]:
    """Latency of one ``--delta-tokens`` delta to a worker that has the shard."""
    store = ShardStore(max_depth=args.depth)
    Responses(2, args.response_len).fill(store, KEY, args.base_tokens)
    big = Responses(4, args.delta_tokens, corpus_tokens=max(20_000, 2 * args.delta_tokens))
    intake = ShardIntake(
        max_depth=args.depth, max_body_bytes=1 << 31, max_bytes=None, max_tenant_bytes=None
    )
    server, thread = serve_intake(intake)
    pusher = ShardPusher(store, [server.url])
    learn_s, push_s, sizes = [], [], []
    try:
        if not pusher.flush(args.timeout):
            raise RuntimeError("initial snapshot did not finish")
        for _ in range(args.reps):
            before = pusher.status()[server.url].bytes_sent
            t0 = time.perf_counter()
            store.learn(KEY, big.next())
            t1 = time.perf_counter()
            if not pusher.flush(args.timeout):
                raise RuntimeError("delta push did not finish")
            t2 = time.perf_counter()
            learn_s.append(t1 - t0)
            push_s.append(t2 - t1)
            sizes.append(pusher.status()[server.url].bytes_sent - before)
        st = pusher.status()[server.url]
    finally:
        pusher.close()
        server.stop(thread)
        store.close()
    return {
        "delta_tokens": args.delta_tokens,
        "learn_ms": _median(learn_s) * 1e3,
        "push_ms": _median(push_s) * 1e3,
        "push_max_ms": max(push_s) * 1e3,
        "push_tokens_per_s": args.delta_tokens / _median(push_s),
        "delta_bytes_sent": _median(sizes),
        "deltas": st.deltas,
        "snapshots": st.snapshots,
    }


def bench_sustained(args: argparse.Namespace) -> dict[str, float]:
    """Learn ``--sustained-tokens`` response by response while pushing."""
    rates = []
    for rep in range(args.reps):
        store = ShardStore(max_depth=args.depth)
        intake = ShardIntake(
            max_depth=args.depth, max_body_bytes=1 << 31, max_bytes=None, max_tenant_bytes=None
        )
        server, thread = serve_intake(intake)
        pusher = ShardPusher(store, [server.url])
        try:
            gen = Responses(3 + rep, args.response_len)
            t0 = time.perf_counter()
            tokens = gen.fill(store, KEY, args.sustained_tokens)
            if not pusher.flush(args.timeout):
                raise RuntimeError("sustained push did not finish")
            rates.append(tokens / (time.perf_counter() - t0))
            st = pusher.status()[server.url]
        finally:
            pusher.close()
            server.stop(thread)
            store.close()
    return {
        "tokens": args.sustained_tokens,
        "tokens_per_s": _median(rates),
        "requests": st.deltas + st.snapshots,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=5, help="repetitions (medians are reported)")
    p.add_argument("--depth", type=int, default=64, help="tree max_depth")
    p.add_argument("--response-len", type=int, default=500, help="tokens per response")
    p.add_argument("--snapshot-tokens", type=int, default=200_000)
    p.add_argument("--base-tokens", type=int, default=100_000, help="shard size before deltas")
    p.add_argument("--delta-tokens", type=int, default=10_000)
    p.add_argument("--sustained-tokens", type=int, default=200_000)
    p.add_argument("--shm-dir", default=None, help="also time snapshot files (e.g. /dev/shm)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)

    results: dict[str, dict[str, float]] = {"snapshot_upload": bench_snapshot(args, None)}
    if args.shm_dir:
        results["snapshot_shm_file"] = bench_snapshot(args, args.shm_dir)
    results["delta"] = bench_delta(args)
    results["sustained"] = bench_sustained(args)
    if args.json:
        print(json.dumps(results))
        return 0
    for name, r in results.items():
        print(name)
        for k, v in r.items():
            print(f"  {k:24s} {v:,.2f}" if isinstance(v, float) else f"  {k:24s} {v:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
