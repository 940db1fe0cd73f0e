"""Speculative verification on CPU with SmolLM2-135M: throughput and forward-pass cost.

Part 1 (throughput): plain greedy decoding (one token per forward pass) against
speculative greedy decoding whose drafts come from a `Speculator` that has
already learned each prompt's output once (an oracle-ish drafter, the best
case for repeated agent stages), with chain and tree drafts.  The outputs
are checked to be identical.

Part 2 (cost): the time of one verification forward pass over the pending
token plus n draft nodes (n = 0, 1, 4, 8, 16, 32), for chains and trees,
relative to n = 0 (a plain decode step).

Both parts run first with the model's stock PyTorch kernels, then with the
embedded engine's CPU kernels (`agentspec.engine.optimize_for_cpu`: oneDNN-packed
linear layers, grouped attention heads kept grouped), in the same process;
a last table prints the optimized cost over the stock one per draft size
(``--kernels stock`` or ``--kernels cpu`` runs only one).

    python benchmarks/bench_verify.py [--model smollm2-135m] [--threads 1]
        [--max-new 64] [--repeats 3] [--context 256] [--kernels stock,cpu]

Medians over ``--repeats`` runs are printed.  Needs the ``local`` extra.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from agentspec import Speculator
from agentspec.engine import (
    DraftTree,
    Verifier,
    generate_greedy,
    optimize_for_cpu,
    speculator_drafter,
)
from agentspec.models import load_model

PROMPTS = [
    "List three colors of the rainbow.",
    "Write a Python function that returns the square of a number.",
    "Give me a JSON object with keys name and age for a person called Ann who is 30.",
    "Count from 1 to 20, separated by commas.",
    "Explain in two sentences what a suffix tree is.",
    "Write a SQL query that selects all rows from a table named users where age > 30.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Write a haiku about the sea.",
]


def chat_ids(tok, text):
    enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(enc["input_ids"])


def run_all(verifier, prompts, max_new, eos, make_drafter=None):
    """Decode every prompt; returns (seconds, outputs, forward passes, accepted)."""
    outs, passes, accepted = [], 0, 0
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        drafter = make_drafter(i, ids) if make_drafter else None
        res = generate_greedy(verifier, ids, max_new, eos, drafter=drafter)
        if make_drafter:
            make_drafter.done(i)
        outs.append(res.tokens)
        passes += res.forward_passes
        accepted += res.accepted
    return time.perf_counter() - t0, outs, passes, accepted


class LearnedDrafters:
    """Drafters from a Speculator that already learned each prompt's reference output."""

    def __init__(self, prompts, outputs, tree, max_spec):
        self.spec = Speculator(max_depth=64)
        for ids, out in zip(prompts, outputs, strict=True):
            self.spec.add_response(out, stage="bench", prompt=ids)
        self.tree, self.max_spec, self.n = tree, max_spec, 0

    def __call__(self, i, ids):
        self.n += 1
        self.req = ("r", self.n)
        self.spec.start_request(self.req, ids, stage="bench")
        return speculator_drafter(
            self.spec, self.req, tree=self.tree, max_spec_tokens=self.max_spec
        )

    def done(self, i):
        self.spec.finish(self.req, learn=False)


def bench_throughput(verifier, prompts, max_new, eos, repeats):
    print(f"== throughput: {len(prompts)} prompts, max_new_tokens={max_new}, median of {repeats}")
    _, ref, _, _ = run_all(verifier, prompts, max_new, eos)  # warm-up and reference outputs
    n_tokens = sum(len(o) for o in ref)
    rows = {}
    for name, drafters in (
        ("plain greedy", None),
        ("spec chain (learned)", LearnedDrafters(prompts, ref, False, 32)),
        ("spec tree (learned)", LearnedDrafters(prompts, ref, True, 32)),
    ):
        times = []
        for _ in range(repeats):
            secs, outs, passes, accepted = run_all(verifier, prompts, max_new, eos, drafters)
            assert outs == ref, f"{name}: output differs from plain greedy"
            times.append(secs)
        med = statistics.median(times)
        rows[name] = med
        print(
            f"{name:22s} {n_tokens / med:8.1f} tok/s  {med:6.2f} s  "
            f"{passes:4d} passes  {n_tokens / passes:5.2f} tok/pass  accepted={accepted}"
        )
    base = rows["plain greedy"]
    for name, med in rows.items():
        if name != "plain greedy":
            print(f"speedup {name}: {base / med:.2f}x")


def tree_shape(n):
    """A tree of n nodes: two-way branching at the root, then chains (like suffix-tree drafts)."""
    parents = []
    for i in range(n):
        parents.append(-1 if i < 2 else i - 2)
    return parents


def bench_forward_cost(verifier, tok, context, sizes, repeats):
    print(f"== forward-pass cost vs draft nodes: context {context} tokens, median of {repeats}")
    text = " ".join(PROMPTS * 20)
    ids = tok(text)["input_ids"][:context]
    verifier.prefill(ids)
    base = None
    medians = {}
    for n in [0, *sizes]:
        line = f"n={n:3d}"
        for kind in ("chain", "tree"):
            if n == 0 and kind == "tree":
                continue
            parents = list(range(-1, n - 1)) if kind == "chain" else tree_shape(n)
            tree = DraftTree(tuple((1000 + i) for i in range(n)), tuple(parents))
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                verifier.forward_tree(tree)
                times.append(time.perf_counter() - t0)
                verifier.discard(tree)
            med = statistics.median(times[1:]) * 1000
            medians[(n, kind)] = med
            base = base if base is not None else med
            line += f"  {kind}: {med:7.1f} ms ({med / base:4.2f}x)"
        print(line)
    return medians


def print_kernel_ratios(costs):
    """The optimized kernels' forward-pass time over the stock ones', per draft size."""
    stock, cpu = costs["stock"], costs["cpu"]
    print("== cpu kernels / stock kernels, forward-pass time (same run; < 1: faster)")
    for (n, kind), med in stock.items():
        print(
            f"n={n:3d} {kind:5s}  stock {med:7.1f} ms  cpu {cpu[(n, kind)]:7.1f} ms  "
            f"ratio {cpu[(n, kind)] / med:4.2f}"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", default="1,4,8,16,32")
    ap.add_argument("--parts", default="throughput,cost", help="which parts to run")
    ap.add_argument(
        "--kernels",
        default="stock,cpu",
        help="stock (PyTorch's), cpu (optimize_for_cpu), or both in that order",
    )
    args = ap.parse_args()
    kernels = [k for k in args.kernels.split(",") if k]
    if not kernels or any(k not in ("stock", "cpu") for k in kernels):
        ap.error("--kernels takes stock, cpu or stock,cpu")
    if kernels == ["cpu", "stock"]:
        ap.error("--kernels: stock must come first (the cpu kernels change the model in place)")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, dtype {model.dtype}")
    parts = args.parts.split(",")
    costs = {}
    for kind in kernels:
        if kind == "cpu":
            print(f"-- cpu kernels: {optimize_for_cpu(model)}")
        else:
            print("-- stock kernels")
        verifier = Verifier(model)
        if "throughput" in parts:
            bench_throughput(verifier, prompts, args.max_new, [tok.eos_token_id], args.repeats)
        if "cost" in parts:
            sizes = [int(s) for s in args.sizes.split(",")]
            costs[kind] = bench_forward_cost(
                verifier, tok, args.context, sizes, max(args.repeats, 5)
            )
    if len(costs) == 2:
        print_kernel_ratios(costs)


if __name__ == "__main__":
    main()
