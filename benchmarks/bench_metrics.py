"""What Prometheus metrics cost the embedded engine: tokens/s with metrics on vs off, one run.

The agent-like workload of ``bench_engine.py`` (four pipeline stages, three
inputs each, ``--rounds`` times) runs on SmolLM2-135M through `Engine.generate`
in this process (no HTTP: its noise would hide a 1% difference), once per mode
per repeat on fresh engines (fresh learned shards, fresh metrics), the modes
alternating (on, off, off, on, ...) so that drift hits both alike.  Each "on"
pass also renders the registry once (what a scrape costs), inside the timed
region.  Printed: per repeat tokens/s of each mode, the medians and the on/off
ratio of the medians; greedy outputs are checked to be identical.  Since a
shared machine's noise can exceed 1%, the metrics work of the request loop is
also timed alone (per verification step) and set against the measured step time.

    python benchmarks/bench_metrics.py [--threads 1] [--repeats 5] [--rounds 2] [--max-tokens 48]

Needs the ``local`` extra (torch, transformers).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_engine import STAGES  # this folder is on sys.path when run as a script

from agentspec.engine import Completion, Engine, EngineOptions, GenerationRequest
from agentspec.engine._chat import render_chat
from agentspec.models import load_model
from agentspec.protocol import DEFAULT_TENANT


def prompts(tok):
    """Per stage and input: the chat prompt's token ids."""
    out = []
    for stage, (system, inputs) in STAGES.items():
        for text in inputs:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": text}]
            out.append((stage, render_chat(tok, messages)))
    return out


def run_pass(model, tok, work, args, metrics):
    """One pass of the workload on a fresh engine: (tokens, seconds, outputs, steps)."""
    engine = Engine(model, tok, EngineOptions(default_max_tokens=args.max_tokens, metrics=metrics))
    tokens, steps, outputs = 0, 0, []
    try:
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            for stage, ids in work:
                request = GenerationRequest(
                    ids, max_tokens=args.max_tokens, key=(DEFAULT_TENANT, "bench", stage)
                )
                done = next(x for x in engine.generate(request) if isinstance(x, Completion))
                tokens += len(done.token_ids)
                steps += done.stats.steps
                outputs.append(done.token_ids)
        if engine.metrics is not None:
            engine.metrics.render()  # one scrape per pass
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    return tokens, seconds, outputs, steps


def micro(steps_per_request=16, requests=20_000):
    """Seconds the request loop's metrics work takes per verification step, alone: the two
    histogram observations and the accepted-run count of each step, plus each request's
    `EngineMetrics.record_request` spread over its steps."""
    from agentspec.engine._metrics import EngineMetrics

    metrics = EngineMetrics()
    key = (DEFAULT_TENANT, "bench", "sql")
    t0 = time.perf_counter()
    for _ in range(requests):
        runs: dict[int, int] = {}
        for step in range(steps_per_request):
            metrics.step_seconds.observe((), 0.02)
            metrics.tokens_per_step.observe(("sql",), 3)
            accepted = step % 4
            if accepted:
                runs[accepted] = runs.get(accepted, 0) + 1
        metrics.record_request(key, steps_per_request, 64, 24, runs, {"stage": 12, "none": 4})
    per_step = (time.perf_counter() - t0) / (requests * steps_per_request)
    t0 = time.perf_counter()
    for _ in range(200):
        metrics.render()
    return per_step, (time.perf_counter() - t0) / 200


def draft_cost(calls=20_000):
    """Seconds per `Speculator.draft` call and per `draft_source` call (what the engine
    drafts through with metrics on: it names the tree the draft came from)."""
    from agentspec import DraftParams, Speculator

    params = DraftParams.confident()
    with Speculator(64) as spec:
        for i in range(50):
            spec.start_request(i, [1, 2, 3], stage="sql", pipeline="bench")
            spec.extend(i, [(i * 7 + j) % 97 for j in range(40)])
            spec.finish(i)
        spec.start_request("q", [1, 2, 3, 7, 14, 21], stage="sql", pipeline="bench")
        times = {}
        for name in ("draft", "draft_source", "draft", "draft_source"):
            fn = spec.draft if name == "draft" else spec.draft_source
            t0 = time.perf_counter()
            for _ in range(calls):
                fn("q", params)
            times[name] = (time.perf_counter() - t0) / calls
        spec.finish("q", learn=False)
    return times["draft"], times["draft_source"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--micro-only", action="store_true", help="only the metrics work timed alone (no model)"
    )
    args = ap.parse_args()
    per_step, scrape = micro()
    plain, named = draft_cost()
    print(
        f"metrics work alone: {per_step * 1e6:.2f} us per verification step; one scrape "
        f"(render) {scrape * 1e3:.2f} ms; a draft {plain * 1e6:.2f} us, with its source "
        f"named {named * 1e6:.2f} us"
    )
    if args.micro_only:
        return
    import torch

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    work = prompts(tok)
    print(
        f"model {args.model}, torch threads {args.threads}, {len(work) * args.rounds} requests "
        f"per pass, max_tokens {args.max_tokens}, {args.repeats} repeats per mode"
    )
    run_pass(model, tok, work, args, metrics=False)  # warm-up (not counted)
    tps = {True: [], False: []}
    step_seconds = []
    reference = None
    same = True
    for r in range(args.repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        row = {}
        for metrics in order:
            tokens, seconds, outputs, steps = run_pass(model, tok, work, args, metrics)
            step_seconds.append(seconds / steps)
            reference = outputs if reference is None else reference
            same = same and outputs == reference
            tps[metrics].append(tokens / seconds)
            row[metrics] = tokens / seconds
        print(
            f"repeat {r + 1}: metrics on {row[True]:8.1f} tok/s, off {row[False]:8.1f} tok/s, "
            f"on/off {row[True] / row[False]:.4f}"
        )
    on, off = statistics.median(tps[True]), statistics.median(tps[False])
    print(f"median: metrics on {on:.1f} tok/s, off {off:.1f} tok/s")
    print(f"ratio on/off (median tokens/s): {on / off:.4f}")
    step = statistics.median(step_seconds)
    extra = per_step + max(0.0, named - plain)
    print(
        f"the median engine step here {step * 1e3:.2f} ms: the metrics work per step "
        f"(with the draft's source) is {extra / step:.4%} of it"
    )
    print(f"greedy outputs identical with metrics on and off: {same}")
    if not same:
        raise SystemExit("outputs differ with metrics on")


if __name__ == "__main__":
    main()
