"""The plan of `scripts/bench-vllm-cuda`: which traces, which model, and what it will cost.

    python benchmarks/_cuda_plan.py plan [--gpu-mib N] [--model SPEC] [--trace FILES]
                                        [--traces DIR] [--builtin PATH] -- [BENCH_VLLM_ARGS...]
    python benchmarks/_cuda_plan.py builtin-trace PATH

``plan`` prints the plan and a rough time and memory estimate on stderr, and
one line per run on stdout (``TRACE<TAB>EXTRA ARGS``) for the script to read.
Traces, first match wins:

1. ``--trace``: trace files given by the user (comma-separated), e.g. traces
   recorded from their own agents (``AgentSpecClient(trace_path=...)``), each at
   concurrency 1, 8 and 32 and bench_vllm.py's other defaults;
2. ``--traces DIR`` holding ``spider-sql.dev.jsonl.gz`` and
   ``swe-gemini3pro.dev.jsonl.gz`` (the development traces), at concurrency 1, 8
   and 32, the second with long-prompt settings;
3. otherwise the built-in prompts: the Classify and Extract prompts of the
   demo's twelve built-in questions (`agentspec.demo.DEMO_PROMPTS`), 24
   prompt-only records and no model outputs, written by ``builtin-trace``. That
   is a smoke run that shows the setup works, too small for numbers that matter.

``plan`` needs only the standard library; ``builtin-trace`` imports agentspec.
The estimate assumes, and does not measure, that a decode step is bound by
reading the weights once (``weights / bandwidth``, at least 5 ms) and that a
server starts in a minute plus the time to load its weights; no run of
bench_vllm.py on a GPU has checked it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: The model a GPU run uses unless told otherwise: a 7B instruct model, the size agents
#: commonly run on one GPU (bf16 weights about 15 GB; fits a 24 GB card).
DEFAULT_MODEL = "Qwen/Qwen2.5-7B-Instruct"
#: The name that selects the small CPU demo model (SmolLM2-135M-Instruct).
SMALL_MODEL = "smollm2-135m"
#: Parameter counts of the models the docs suggest, for the memory estimate.
KNOWN_PARAMS = {
    "Qwen/Qwen2.5-7B-Instruct": 7.62e9,
    "Qwen/Qwen2.5-3B-Instruct": 3.09e9,
    "Qwen/Qwen2.5-1.5B-Instruct": 1.54e9,
    "Qwen/Qwen2.5-Coder-7B-Instruct": 7.62e9,
    SMALL_MODEL: 0.135e9,
}
#: bench_vllm.py's methods (``ALL_METHODS``) and defaults that the estimate depends on.
ALL_METHODS = (
    "none",
    "ngram55",
    "ngram35",
    "suffix",
    "agentspec",
    "agentspec-counts",
    "agentspec-fixed",
    "agentspec-nodraft",
    "agentspec-pushed",
)
DEVELOPMENT_TRACES = ("spider-sql.dev.jsonl.gz", "swe-gemini3pro.dev.jsonl.gz")
#: The levels of a run on real traces (the user's arguments come after and win).
LEVELS_ARGS = ("--concurrency", "1,8,32")
#: What the long agent prompts of swe-gemini3pro need.
LONG_PROMPT_ARGS = (*LEVELS_ARGS, "--max-prompt-chars", "12000", "--max-model-len", "4096")
#: The built-in trace's 24 prompts: 8 for warm-up, 8 at c=1, 8 at c=8.
BUILTIN_ARGS = (
    "--warmup-sessions",
    "8",
    "--requests",
    "8",
    "--concurrency",
    "1,8",
    "--max-prompt-chars",
    "12000",
    "--max-model-len",
    "4096",
)
BUILTIN_RECORDS = 24
GPU_BYTES_PER_SECOND = 1.0e12  # assumed memory bandwidth of a current data-centre GPU
SERVER_START_SECONDS = 60.0  # assumed, plus the weights read at 1 GB/s
MIN_STEP_SECONDS = 0.005


@dataclass(frozen=True)
class Run:
    """One bench_vllm.py run: a trace and the arguments it needs before the user's."""

    trace: str
    args: tuple[str, ...]
    prompts: int | None  # records in the trace when known (the built-in one)


def find_runs(trace: str | None, traces_dir: str | None, builtin: str) -> list[Run]:
    """The runs, in the order of the module docstring.

    Raises:
        FileNotFoundError: a file named by ``trace`` does not exist.
    """
    if trace:
        files = [t.strip() for t in trace.split(",") if t.strip()]
        missing = [f for f in files if not Path(f).is_file()]
        if missing:
            raise FileNotFoundError(f"trace not found: {', '.join(missing)}")
        return [Run(f, LEVELS_ARGS, None) for f in files]
    if traces_dir:
        d = Path(traces_dir)
        if all((d / name).is_file() for name in DEVELOPMENT_TRACES):
            return [
                Run(str(d / DEVELOPMENT_TRACES[0]), LEVELS_ARGS, None),
                Run(str(d / DEVELOPMENT_TRACES[1]), LONG_PROMPT_ARGS, None),
            ]
    return [Run(builtin, BUILTIN_ARGS, BUILTIN_RECORDS)]


def _bench_options(args: Sequence[str]) -> argparse.Namespace:
    """The bench_vllm.py options the estimate needs (the last occurrence wins, as there)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--methods", default=",".join(ALL_METHODS))
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", default="32")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--warmup-sessions", type=int, default=40)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--quick", action="store_true")
    ns, _ = p.parse_known_args(list(args))
    if ns.quick:
        ns.warmup_sessions, ns.requests, ns.max_tokens = 10, "12", 48
    return ns


def model_bytes(model: str) -> float | None:
    """bf16 weight bytes of ``model``: a folder's weight files, or a known model's size."""
    path = Path(model)
    if path.is_dir():
        files = [*path.glob("*.safetensors"), *path.glob("*.bin")]
        return float(sum(f.stat().st_size for f in files)) if files else None
    params = KNOWN_PARAMS.get(model)
    return None if params is None else 2.0 * params


@dataclass(frozen=True)
class Estimate:
    """Seconds and bytes a plan is expected to take (assumptions in the module docstring)."""

    seconds: float
    servers: int
    weight_bytes: float | None
    gpu_bytes_for_vllm: float | None
    fits: bool | None


def estimate(runs: Sequence[Run], model: str, gpu_mib: int | None, args: Sequence[str]) -> Estimate:
    """The rough cost of ``runs`` with bench_vllm.py arguments ``args`` (module docstring)."""
    ns = _bench_options(args)
    methods = [m for m in ns.methods.split(",") if m.strip()]
    weights = model_bytes(model)
    step = max(MIN_STEP_SECONDS, (weights or 16e9) / GPU_BYTES_PER_SECOND)
    start = SERVER_START_SECONDS + (weights or 16e9) / 1e9
    servers = 0
    seconds = 0.0
    for run in runs:
        run_ns = _bench_options([*run.args, *args])
        warm_requests = run_ns.warmup_sessions * 2  # sessions hold a few requests each
        steps = warm_requests * run_ns.max_tokens / 8
        run_levels = sorted({int(c) for c in run_ns.concurrency.split(",") if c.strip()})
        run_counts = [int(x) for x in run_ns.requests.split(",")]
        if len(run_counts) == 1:
            run_counts = run_counts * len(run_levels)
        steps += sum(
            n * run_ns.max_tokens / c for c, n in zip(run_levels, run_counts, strict=False)
        )
        per_method = start + steps * step
        servers += len(methods) * ns.rounds
        seconds += len(methods) * ns.rounds * per_method
    gpu_bytes = None if gpu_mib is None else gpu_mib * 2**20 * ns.gpu_memory_utilization
    fits = None
    if gpu_bytes is not None and weights is not None:
        fits = weights * 1.2 < gpu_bytes  # weights plus room for the KV cache and activations
    return Estimate(seconds, servers, weights, gpu_bytes, fits)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def describe(runs: Sequence[Run], model: str, gpu_mib: int | None, args: Sequence[str]) -> str:
    """The plan and its estimate, as lines for a person."""
    est = estimate(runs, model, gpu_mib, args)
    lines = [f"model: {model}"]
    for run in runs:
        extra = " ".join(run.args)
        what = " (built-in demo prompts: a smoke run, too small for numbers)" if run.prompts else ""
        lines.append(f"trace: {run.trace}{what}{' ' + extra if extra else ''}")
    weights = "unknown" if est.weight_bytes is None else _gib(est.weight_bytes)
    gpu = "unknown" if est.gpu_bytes_for_vllm is None else _gib(est.gpu_bytes_for_vllm)
    lines.append(
        f"estimate (assumed, not measured on a GPU): {est.servers} server starts, "
        f"about {est.seconds / 60:.0f} min after installation"
    )
    lines.append(
        f"memory: weights {weights} (bf16); vLLM takes {gpu} of GPU memory per server "
        "(--gpu-memory-utilization of the card); host: up to 2 GiB of agentspec shards "
        "per server (the default budgets), plus the model on disk and the venv (about 10 GB)"
    )
    if est.fits is False:
        lines.append(
            f"the model does not fit: weights {weights} against {gpu}; choose a smaller one, "
            "e.g. AGENTSPEC_BENCH_MODEL=Qwen/Qwen2.5-1.5B-Instruct"
        )
    return "\n".join(lines)


def write_builtin_trace(path: Path) -> int:
    """Write the built-in prompt-only trace to ``path``; returns the number of records.

    Each record is one prompt of the demo pipeline that needs no earlier model output
    (Classify and Extract of each built-in question), marked ``meta.prompt_only``:
    bench_vllm.py sends the whole message list as one request. No response is stored.
    """
    from agentspec.demo import DEMO_PROMPTS, builtin_questions

    records = []
    for q in builtin_questions():
        for stage, messages in (
            ("Classify", DEMO_PROMPTS.classify(q.question)),
            ("Extract", DEMO_PROMPTS.extract(q.question, q.schema)),
        ):
            records.append(
                {
                    "workload": "agentspec-demo-builtin",
                    "session": f"{q.session}-{stage}",
                    "stage": stage,
                    "messages": [dict(m) for m in messages],
                    "meta": {"source": "agentspec.demo built-in questions", "prompt_only": True},
                }
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return len(records)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="_cuda_plan.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    plan = sub.add_parser("plan")
    plan.add_argument("--gpu-mib", type=int, default=None)
    plan.add_argument("--model", default=DEFAULT_MODEL)
    plan.add_argument("--trace", default=None)
    plan.add_argument("--traces", default=None)
    plan.add_argument("--builtin", default="benchmarks/results/builtin-demo-prompts.jsonl.gz")
    bt = sub.add_parser("builtin-trace")
    bt.add_argument("path", type=Path)
    ns = p.parse_args(argv)
    if ns.cmd == "builtin-trace":
        n = write_builtin_trace(ns.path)
        print(f"{n} prompt-only records in {ns.path}", file=sys.stderr)
        return 0
    try:
        runs = find_runs(ns.trace, ns.traces, ns.builtin)
    except FileNotFoundError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(describe(runs, ns.model, ns.gpu_mib, bench_args), file=sys.stderr)
    if estimate(runs, ns.model, ns.gpu_mib, bench_args).fits is False:
        return 3
    for run in runs:
        print("\t".join([run.trace, *run.args]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
