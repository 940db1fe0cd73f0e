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

``--proposer-metrics`` times the vLLM proposer itself instead
(`agentspec_vllm.proposer.AgentSpecProposer`, driven through a stand-in of
vLLM's model runner): CPU µs per ``propose`` call (the calling thread's CPU
time, so that other processes on a busy machine do not count) with the plugin's metrics on
and off (``metrics`` setting), the runs of both modes interleaved (in alternating
order), and the
on/off ratio of their medians.  With ``--goodput off`` both modes must make
the same drafts (checked); the goodput controller's cuts depend on measured
step times, so with it on they may differ slightly.

Run ``python benchmarks/bench_decode_step.py --help``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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


class _Runner:
    """The parts of vLLM's model runner the proposer reads, with greedy verification."""

    def __init__(self, proposer: Any, batch: int, max_len: int) -> None:
        import numpy as np

        self.drafter = proposer
        self.requests: dict[str, Any] = {}
        self.rows: list[str] = []
        self.token_ids_cpu = np.zeros((batch, max_len), dtype=np.int32)
        self.num_tokens = np.zeros(batch, dtype=np.int32)
        self.num_prompt = np.zeros(batch, dtype=np.int32)
        self.state: dict[str, tuple[list[int], int, list[int]]] = {}  # response, pos, draft
        proposer.bind_runner(self)

    @property
    def input_batch(self) -> Any:
        return SimpleNamespace(req_ids=list(self.rows), num_prompt_tokens=self.num_prompt)

    def add(self, req: Request) -> None:
        rid = str(req.index)
        extra = {"agentspec_stage": req.stage, "agentspec_pipeline": req.workload}
        params = SimpleNamespace(extra_args=extra, max_tokens=len(req.response))
        self.requests[rid] = SimpleNamespace(sampling_params=params)
        prompt = req.prompt()
        row = len(self.rows)
        self.rows.append(rid)
        self.token_ids_cpu[row, : len(prompt)] = prompt
        self.num_tokens[row] = self.num_prompt[row] = len(prompt)
        self.state[rid] = (req.response.tolist(), 0, [])

    def step(self) -> tuple[float, list[list[int]], bool]:
        """One decode step for every row: (seconds in propose, drafts, whether any finished)."""
        sampled: list[list[int]] = []
        finished = []
        for row, rid in enumerate(self.rows):
            resp, pos, draft = self.state[rid]
            new = resp[pos : pos + advance(accept_linear(draft, resp, pos), len(resp) - pos)]
            n = int(self.num_tokens[row])
            self.token_ids_cpu[row, n : n + len(new)] = new
            self.num_tokens[row] = n + len(new)
            self.state[rid] = (resp, pos + len(new), draft)
            sampled.append(new)
            if pos + len(new) >= len(resp):
                finished.append(rid)
        t0 = time.thread_time()  # CPU time: other processes on the machine do not count
        drafts = self.drafter.propose(sampled, self.num_tokens, self.token_ids_cpu)
        spent = time.thread_time() - t0
        for rid, d in zip(self.rows, drafts, strict=True):
            resp, pos, _ = self.state[rid]
            self.state[rid] = (resp, pos, d)
        for rid in finished:  # they leave the request table and the batch
            del self.requests[rid]
            row, last = self.rows.index(rid), len(self.rows) - 1
            for arr in (self.token_ids_cpu, self.num_tokens, self.num_prompt):
                arr[row] = arr[last]
            self.rows[row] = self.rows[last]
            self.rows.pop()
        return spent, drafts, bool(finished)


def run_proposer(
    requests: list[Request], batch: int, k: int, metrics: bool, goodput: bool, policy: str
) -> tuple[int, float, list[list[int]]]:
    """Replay ``requests`` through the vLLM proposer; (steps, seconds in propose, drafts)."""
    from agentspec_vllm.proposer import AgentSpecProposer
    from agentspec_vllm.shards import reset_worker_intake

    reset_worker_intake()
    max_len = max(r.prompt_tokens + len(r.response) for r in requests) + k + 2
    config = {"metrics": metrics, "goodput": goodput, "policy": policy, "max_depth": 64}
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_len, get_vocab_size=lambda: 1 << 20),
        additional_config={"agentspec": config},
    )
    proposer = AgentSpecProposer(vllm_config)
    runner = _Runner(proposer, batch, max_len)
    queue = list(reversed(requests))
    steps, spent = 0, 0.0
    drafts: list[list[int]] = []
    while queue or runner.rows:
        while queue and len(runner.rows) < batch:
            runner.add(queue.pop())
        seconds, got, _ = runner.step()
        spent += seconds
        steps += 1
        drafts.extend(got)
    proposer.close()
    return steps, spent, drafts


def proposer_metrics_main(args: argparse.Namespace, requests: list[Request]) -> int:
    """``--proposer-metrics``: µs per propose call, metrics on against off."""
    sys.path.insert(0, str(REPO_ROOT / "integrations" / "vllm"))
    print(f"vLLM proposer, {len(requests)} requests, k={args.k}, {args.repeats} repeats (median)")
    print(f"{'goodput':>7}  {'batch':>5}  {'off µs/step':>11}  {'on µs/step':>10}  {'on/off':>6}")
    for goodput in (g.strip() == "on" for g in args.goodput.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            per: dict[bool, list[float]] = {False: [], True: []}
            results: dict[bool, list[list[int]]] = {}
            for rep in range(args.repeats):
                for metrics in (False, True) if rep % 2 == 0 else (True, False):
                    gc.collect()
                    gc.disable()
                    try:
                        steps, spent, drafts = run_proposer(
                            requests, batch, args.k, metrics, goodput, args.policy.split(",")[0]
                        )
                    finally:
                        gc.enable()
                    per[metrics].append(spent / steps * 1e6)
                    results[metrics] = drafts
            if not goodput and results[False] != results[True]:
                print("error: the drafts differ with metrics on", file=sys.stderr)
                return 1
            off, on = statistics.median(per[False]), statistics.median(per[True])
            mode = "on" if goodput else "off"
            print(f"{mode:>7}  {batch:>5}  {off:>11.1f}  {on:>10.1f}  {on / off:>6.3f}")
    return 0


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
    p.add_argument(
        "--proposer-metrics",
        action="store_true",
        help="time the vLLM proposer's propose() with its metrics on and off (e.g. --batch 64)",
    )
    p.add_argument(
        "--goodput", default="on,off", help="with --proposer-metrics: goodput control, on,off"
    )
    args = p.parse_args(argv)
    policies = [x.strip() for x in args.policy.split(",") if x.strip()]
    for pol in policies:
        if pol not in POLICIES:
            p.error(f"unknown policy {pol!r}; choose from {', '.join(POLICIES)}")
    trace = load_trace(args.trace, load_tokenizer())
    requests = list(trace.requests[: args.requests])
    if args.proposer_metrics:
        return proposer_metrics_main(args, requests)
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
