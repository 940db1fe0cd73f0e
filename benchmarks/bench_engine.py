"""The embedded engine's server end to end: speculation off vs on over agent-like traffic.

An in-process `EngineServer` on SmolLM2-135M serves repeated requests of four
agent-pipeline stages (extract JSON, text-to-SQL, classify, tool call), each
stage a fixed system prompt with a few user inputs, sent ``--rounds`` times
(a pipeline run again and again).  The same workload runs three times on
fresh servers (fresh learned shards): with ``agentspec_speculate: false``,
with speculation on and the goodput controller off (``fixed``: every draft
as the draft rule gives it), with speculation on and the controller on
(``goodput``, the default: the confidence drafting policy, chain drafts, or
trees with ``--tree``), and as ``goodput`` with the previous count-only
drafting policy (``counts``: `DraftParams()`, arctic's rule).  Greedy outputs are checked to be
identical; printed per mode and per round: completion tokens, wall time,
tokens/s, verification steps and tokens per step, and the ratios to off.

Before those, ``off`` and ``goodput`` run once more with the model's stock
PyTorch kernels (``EngineOptions(cpu_kernels=False)``; the runs after them
pack the model in place, `agentspec.engine.optimize_for_cpu`), so the last
lines compare the engine's default with what it was before its CPU kernels:
each against stock ``off``.  ``--no-stock`` skips them.

    python benchmarks/bench_engine.py [--threads 1] [--rounds 3] [--max-tokens 64] [--tree]
        [--no-stock]

Needs the ``local`` extra (torch, transformers) and the openai package.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import openai
import torch

from agentspec import DraftParams
from agentspec.engine import EngineOptions, EngineServer, default_threads
from agentspec.models import load_model

STAGES: dict[str, tuple[str, list[str]]] = {
    "extract": (
        "Extract the person's name, age and city from the text. Reply with only a JSON "
        'object with keys "name", "age" and "city".',
        [
            "Ann is 30 years old and lives in Paris.",
            "My neighbour Bob, 45, moved to Berlin last year.",
            "Carla (27) works in Madrid.",
        ],
    ),
    "sql": (
        "You translate questions into SQL for the table users(id, name, age, city). "
        "Reply with only the SQL query.",
        [
            "How many users live in Paris?",
            "List the names of users older than 40.",
            "What is the average age of users in Berlin?",
        ],
    ),
    "classify": (
        "Classify the sentiment of the review as positive, negative or neutral, then give a "
        "one-sentence reason.",
        [
            "The food was cold and the waiter was rude.",
            "Great value, I would come back any time.",
            "It was fine, nothing special.",
        ],
    ),
    "tool": (
        'You can call the tool get_weather(city, unit). Reply with only a JSON tool call like {"tool": ..., "arguments": {...}}.',  # noqa: E501
        [
            "What's the weather in Berlin?",
            "Is it cold in Oslo right now, in celsius?",
            "Tell me the temperature in New York in fahrenheit.",
        ],
    ),
}


def run_workload(model, tok, args, speculate, goodput=True, draft_params=None, cpu_kernels=True):
    """Serve the workload on a fresh server; returns per-round totals and the outputs."""
    opts = EngineOptions(
        tree_drafts=args.tree,
        default_max_tokens=args.max_tokens,
        goodput=goodput,
        draft_params=draft_params,
        cpu_kernels=cpu_kernels,
    )
    rounds = defaultdict(lambda: {"tokens": 0, "seconds": 0.0, "steps": 0, "accepted": 0})
    outputs = {}
    with (
        EngineServer.create(model, tok, opts) as srv,
        openai.OpenAI(base_url=srv.base_url, api_key="unused", timeout=600) as client,
    ):
        for r in range(args.rounds):
            for stage, (system, inputs) in STAGES.items():
                for i, text in enumerate(inputs):
                    t0 = time.perf_counter()
                    resp = client.chat.completions.create(
                        model="smollm2-135m",
                        messages=[
                            {"role": "system", "content": system},
                            {"role": "user", "content": text},
                        ],
                        max_tokens=args.max_tokens,
                        temperature=0,
                        extra_body={
                            "vllm_xargs": {
                                "agentspec_pipeline": "bench",
                                "agentspec_stage": stage,
                                "agentspec_speculate": speculate,
                            },
                            "return_token_ids": True,
                        },
                    ).model_dump()
                    dt = time.perf_counter() - t0
                    ids = resp["choices"][0]["token_ids"]
                    outputs[(r, stage, i)] = ids
                    tot = rounds[r]
                    tot["tokens"] += len(ids)
                    tot["seconds"] += dt
                    tot["steps"] += resp["agentspec"]["steps"]
                    tot["accepted"] += resp["agentspec"]["accepted"]
        srv.engine.close()
    return dict(rounds), outputs


def summary(rounds):
    """Totals over every round."""
    out = {"tokens": 0, "seconds": 0.0, "steps": 0, "accepted": 0}
    for tot in rounds.values():
        for k in out:
            out[k] += tot[k]
    return out


def line(name, tot):
    tps = tot["tokens"] / tot["seconds"]
    per_step = tot["tokens"] / max(tot["steps"], 1)
    return (
        (
            f"{name:<16} {tot['tokens']:>7} {tot['seconds']:>9.2f} {tps:>9.1f} "
            f"{tot['steps']:>7} {per_step:>10.2f}"
        ),
        tps,
        per_step,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tree", action="store_true", help="tree drafts instead of chains")
    ap.add_argument(
        "--no-stock",
        dest="stock",
        action="store_false",
        help="skip the runs on the model's stock PyTorch kernels",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    n_req = args.rounds * sum(len(v[1]) for v in STAGES.values())
    print(
        f"model {args.model}, torch threads {args.threads}, {n_req} requests "
        f"({len(STAGES)} stages x 3 inputs x {args.rounds} rounds), max_tokens {args.max_tokens}, "
        f"{'tree' if args.tree else 'chain'} drafts"
    )
    stock = {}
    if args.stock:  # before anything packs the model
        stock["stock off"] = run_workload(model, tok, args, speculate=False, cpu_kernels=False)
        stock["stock goodput"] = run_workload(model, tok, args, speculate=True, cpu_kernels=False)
    off_rounds, off_out = run_workload(model, tok, args, speculate=False)
    fixed_rounds, fixed_out = run_workload(model, tok, args, speculate=True, goodput=False)
    on_rounds, on_out = run_workload(model, tok, args, speculate=True)
    counts_rounds, counts_out = run_workload(
        model, tok, args, speculate=True, draft_params=DraftParams()
    )
    same = off_out == on_out == fixed_out == counts_out
    print(f"greedy outputs identical with speculation off, fixed, controlled, counts: {same}")
    print(f"{'':<16} {'tokens':>7} {'seconds':>9} {'tok/s':>9} {'steps':>7} {'tok/step':>10}")
    off_line, off_tps, off_ps = line("spec off", summary(off_rounds))
    print(off_line)
    for name, rounds in (
        ("fixed", fixed_rounds),
        ("goodput", on_rounds),
        ("counts", counts_rounds),
    ):
        text, tps, ps = line(name, summary(rounds))
        print(text)
        for r in sorted(rounds):
            text, r_tps, _ = line(f"  {name}, round {r + 1}", rounds[r])
            ref = off_rounds[r]["tokens"] / off_rounds[r]["seconds"]
            print(f"{text}   speedup x{r_tps / ref:.2f}")
        print(f"ratio {name}/off: tokens/s x{tps / off_tps:.2f}, tokens/step x{ps / off_ps:.2f}")
    if stock:
        stock_same = stock["stock off"][1] == stock["stock goodput"][1]
        print(f"stock kernels: outputs identical with speculation off and on: {stock_same}")
        same = same and stock_same
        _, base_tps, _ = line("stock off", summary(stock["stock off"][0]))
        rows = [(name, rounds) for name, (rounds, _) in stock.items()]
        for name, rounds in [*rows, ("off", off_rounds), ("goodput", on_rounds)]:
            text, tps, _ = line(name, summary(rounds))
            print(f"{text}   tokens/s x{tps / base_tps:.2f} of stock off")
    if not same:
        raise SystemExit("outputs differ: speculation was not lossless")


if __name__ == "__main__":
    main()
