#!/usr/bin/env python
"""Decode-step drafting cost: one native call per step against one call per request.

A serving engine drafts for its whole batch at every decode step.  This
benchmark replays recorded requests (prompt and true response, Qwen3 tokens)
``--batch`` at a time through a `Speculator` with stage shards, as the vLLM
proposer drives it: per step, each request is fed the tokens the simulated
greedy verifier accepted (its draft's matching prefix plus one bonus token),
then the step's drafts are made either

* ``per-request``: one `Speculator.draft_source` call per request, or
* ``batched``: one `Speculator.draft_batch_source` call for the whole batch.

Both modes replay the same requests and reach the same drafts (checked), so
the steps are identical; only the drafting calls are timed.  ``--policy``
picks the drafting parameters: ``confidence`` (`DraftParams.confident`, the
proposer's default) and/or ``counts`` (`DraftParams()`, arctic's rule).  Finished requests
are learned into their stage shards and replaced by the next ones.  Printed:
median µs per step and per request-step over ``--repeats`` runs, the
batched/per-request ratio, and tokens per request-step (accepted + 1: what
concurrent requests of one stage gain from drafting from each other's partial
outputs with live learning).

Run ``python benchmarks/bench_decode_step.py --help``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentspec import DraftParams, Speculator
from agentspec.bench.replay import Request, load_tokenizer, load_trace
from agentspec.bench.verifier import accept_linear, advance

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "data" / "traces" / "spider-sql.dev.jsonl.gz"


POLICIES = ("confidence", "counts")


def policy_params(policy: str, k: int) -> DraftParams:
    """The proposer's drafting parameters for ``policy`` with at most ``k`` tokens."""
    if policy == "confidence":
        return DraftParams.confident(max_spec_tokens=k)
    if policy == "counts":
        return DraftParams(max_spec_tokens=k)
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")


def run(
    requests: list[Request],
    batch: int,
    k: int,
    batched: bool,
    live: bool = True,
    policy: str = "confidence",
) -> tuple[int, int, float, list[list[int]]]:
    """Replay ``requests`` ``batch`` at a time.

    Returns (decode steps, request-steps, seconds spent drafting, every draft).
    """
    params = policy_params(policy, k)
    spec = Speculator(64, params=params, live=live)
    queue = list(reversed(requests))
    active: dict[int, tuple[Request, list[int], int]] = {}  # rid -> (request, response, pos)
    steps = row_steps = 0
    spent = 0.0
    drafts: list[list[int]] = []
    clock = time.perf_counter
    while queue or active:
        while queue and len(active) < batch:
            req = queue.pop()
            spec.start_request(req.index, req.prompt(), stage=req.stage, pipeline=req.workload)
            active[req.index] = (req, req.response.tolist(), 0)
        ids = list(active)
        t0 = clock()
        got = spec.draft_batch_source(ids) if batched else [spec.draft_source(r) for r in ids]
        spent += clock() - t0
        steps += 1
        row_steps += len(ids)
        for rid, (draft, _) in zip(ids, got, strict=True):
            req, resp, pos = active[rid]
            toks = list(draft.token_ids)
            drafts.append(toks)
            step = advance(accept_linear(toks, resp, pos), len(resp) - pos)
            spec.extend(rid, resp[pos : pos + step])
            pos += step
            if pos >= len(resp):
                spec.finish(rid)
                del active[rid]
            else:
                active[rid] = (req, resp, pos)
    spec.close()
    return steps, row_steps, spent, drafts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--requests", type=int, default=600, help="requests replayed per run")
    p.add_argument("--batch", type=str, default="1,8,32", help="batch sizes")
    p.add_argument("--k", type=int, default=8, help="max draft tokens (num_speculative_tokens)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--live",
        default="on,off",
        help="live learning (the vLLM proposer's default: on), e.g. on or on,off",
    )
    p.add_argument(
        "--policy",
        default="confidence,counts",
        help="drafting policies, e.g. confidence,counts (default both; confidence is the "
        "proposer's default)",
    )
    args = p.parse_args(argv)
    policies = [x.strip() for x in args.policy.split(",") if x.strip()]
    for pol in policies:
        if pol not in POLICIES:
            p.error(f"unknown policy {pol!r}; choose from {', '.join(POLICIES)}")
    trace = load_trace(args.trace, load_tokenizer())
    requests = list(trace.requests[: args.requests])
    print(
        f"{trace.name}: {len(requests)} requests, k={args.k}, {args.repeats} repeats "
        "(median); µs of drafting per decode step"
    )
    print(
        f"{'policy':>10}  {'live':>4}  {'batch':>5}  {'per-request':>12}  {'batched':>9}  "
        f"{'ratio':>6}  {'batched/row':>11}  {'tok/step':>8}"
    )
    tokens = sum(len(r.response) for r in requests)
    for policy, live, batch in (
        (pol, mode == "on", int(b))
        for pol in policies
        for mode in args.live.split(",")
        for b in args.batch.split(",")
    ):
        per: dict[bool, list[float]] = {False: [], True: []}
        rows = 0
        for _ in range(args.repeats):
            results = {}
            for batched in (False, True):
                gc.collect()
                gc.disable()
                try:
                    steps, rows, spent, drafts = run(requests, batch, args.k, batched, live, policy)
                finally:
                    gc.enable()
                per[batched].append(spent / steps * 1e6)
                results[batched] = (steps, drafts)
            if results[False] != results[True]:
                print("error: batched drafts differ from per-request drafts", file=sys.stderr)
                return 1
        a, b = statistics.median(per[False]), statistics.median(per[True])
        row = b / (rows / steps) if steps else 0.0
        on = "on" if live else "off"
        mat = tokens / rows if rows else 0.0
        print(
            f"{policy:>10}  {on:>4}  {batch:>5}  {a:>12.1f}  {b:>9.1f}  {b / a:>6.2f}  "
            f"{row:>11.2f}  {mat:>8.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
