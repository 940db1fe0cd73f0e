"""`agentspec bench replay`: replay traces through a simulated greedy verifier.

Every request of a trace file is replayed in file order, for each drafting
method in turn (each method starts empty, or from ``--warmup-from`` data):

1. ``start``: the method ingests the request's prompt (Qwen3 ChatML:
   ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per earlier message, then
   ``<|im_start|>assistant\\n``);
2. per step: ``draft``; the verifier accepts the longest draft prefix (tree
   drafts: the longest root-to-node path) equal to the true continuation and
   adds one bonus token; ``extend`` by those tokens; until the response (its
   content tokens, no special tokens) is complete;
3. ``finish``: the method learns the response (online learning).

Reported per file, per stage and per "responses already in the request's stage
shard" bucket: requests, tokens, steps, MAT (accepted + bonus per step),
acceptance rate (accepted / drafted), drafted tokens per step, drafting µs per
call (p50/p99), update µs per token, memory, and each method's MAT as a
fraction of the oracle's (the ceiling for copy-based drafting, see
`agentspec.bench.oracle`).
"""

# This module holds the replay loop, its summaries, tables and command line;
# trace loading lives in `agentspec.bench._trace`, the drafting methods in
# `agentspec.bench._methods`, what every bench command shares (options, the
# ``run_cli`` opening `cli_start`, outputs, table formatting, progress) in
# `agentspec.bench._common`.

from __future__ import annotations

import argparse
import gc
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

# The names below were defined here before the module was split by job; they
# stay importable from here (``as`` marks the re-exports).
from agentspec.bench._common import Progress as Progress
from agentspec.bench._common import add_common_arguments as add_common_arguments
from agentspec.bench._common import add_trace_arguments as add_trace_arguments
from agentspec.bench._common import check_inputs as check_inputs
from agentspec.bench._common import cli_log as cli_log
from agentspec.bench._common import cli_start as cli_start
from agentspec.bench._common import environment as _environment
from agentspec.bench._common import fmt as _fmt
from agentspec.bench._common import mb as _mb
from agentspec.bench._common import release_free_memory as release_free_memory
from agentspec.bench._common import rss_bytes as rss_bytes
from agentspec.bench._common import table as _table
from agentspec.bench._common import write_outputs as write_outputs
from agentspec.bench._methods import _ARCTIC_METHODS as _ARCTIC_METHODS
from agentspec.bench._methods import _SPECULATOR_METHODS as _SPECULATOR_METHODS
from agentspec.bench._methods import METHODS as METHODS
from agentspec.bench._methods import ORACLE as ORACLE
from agentspec.bench._methods import ArcticMethod as ArcticMethod
from agentspec.bench._methods import Method as Method
from agentspec.bench._methods import NgramMethod as NgramMethod
from agentspec.bench._methods import OracleMethod as OracleMethod
from agentspec.bench._methods import ReplayConfig as ReplayConfig
from agentspec.bench._methods import SpeculatorMethod as SpeculatorMethod
from agentspec.bench._methods import make_method as make_method
from agentspec.bench._methods import method_status as method_status
from agentspec.bench._trace import DEFAULT_TOKENIZER as DEFAULT_TOKENIZER
from agentspec.bench._trace import IM_END as IM_END
from agentspec.bench._trace import IM_START as IM_START
from agentspec.bench._trace import REPO_ROOT as REPO_ROOT
from agentspec.bench._trace import Request as Request
from agentspec.bench._trace import Tokens as Tokens
from agentspec.bench._trace import TraceData as TraceData
from agentspec.bench._trace import load_tokenizer as load_tokenizer
from agentspec.bench._trace import load_trace as load_trace
from agentspec.bench.verifier import accept_linear, accept_tree, advance

__all__ = [
    "METHODS",
    "ReplayConfig",
    "Request",
    "TraceData",
    "add_arguments",
    "load_tokenizer",
    "load_trace",
    "render_tables",
    "run",
    "run_cli",
]

# --------------------------------------------------------------------------
# replay


@dataclass
class _Acc:
    """Counters of one method over a set of requests."""

    requests: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0
    steps: int = 0
    accepted: int = 0
    drafted: int = 0
    nonempty: int = 0
    start_ns: int = 0
    update_ns: int = 0
    finish_ns: int = 0
    draft_ns: list[int] = field(default_factory=list)


def shard_bin(n: int) -> tuple[int, int]:
    """The bucket ``[lo, hi]`` of a shard size: 0, 1, 2-3, 4-7, 8-15, ..."""
    if n < 0:
        raise ValueError(f"shard size must be >= 0, got {n}")
    if n == 0:
        return 0, 0
    lo = 1 << (n.bit_length() - 1)
    return lo, 2 * lo - 1


@dataclass
class _Run:
    """Raw results of one method over one file."""

    stages: dict[str, _Acc]
    bins: dict[tuple[int, int], list[int]]  # (lo, hi) -> [requests, tokens, steps, acc, drafted]
    wall_s: float
    warmup_s: float
    peak_tree_bytes: int | None
    rss_start: int | None
    rss_peak: int | None
    stage_bytes: dict[str, int]


def replay(
    method: Method,
    trace: TraceData,
    warmup: Sequence[Request] = (),
    progress: Progress | None = None,
) -> _Run:
    """Replay every request of ``trace`` through ``method`` (garbage collector paused)."""
    release_free_memory()
    gc.disable()
    try:
        return _replay(method, trace, warmup, progress)
    finally:
        gc.enable()


def _replay(
    method: Method,
    trace: TraceData,
    warmup: Sequence[Request],
    progress: Progress | None,
) -> _Run:
    t_warm = time.perf_counter()
    if warmup:
        method.warmup(warmup)
    warmup_s = time.perf_counter() - t_warm
    shard_n: Counter[tuple[str, str]] = Counter((r.workload, r.stage) for r in warmup)
    stages: dict[str, _Acc] = {}
    bins: dict[tuple[int, int], list[int]] = {}
    rss0 = rss_peak = rss_bytes()
    peak_bytes = method.tree_bytes()
    draft, extend = method.draft, method.extend
    # tree sizes are sampled about 100 times (arctic's estimate walks its whole tree)
    total = len(trace.requests)
    sample_every = max(total // 100, 1)
    t_wall = time.perf_counter()
    for i, req in enumerate(trace.requests):
        acc = stages.get(req.stage)
        if acc is None:
            acc = stages[req.stage] = _Acc()
        prompt = req.prompt()
        resp = req.response.tolist()
        n = len(resp)
        acc.start_ns += method.start(i, req, prompt)
        if rss0 is not None:
            r = rss_bytes()
            if r is not None and rss_peak is not None and r > rss_peak:
                rss_peak = r
        dl = acc.draft_ns
        pos = steps = accepted = drafted = nonempty = upd = 0
        while pos < n:
            toks, parents, ns = draft(pos)
            dl.append(ns)
            if parents is None:
                a = accept_linear(toks, resp, pos)
            else:
                a = accept_tree(toks, parents, resp, pos)
            nd = len(toks)
            drafted += nd
            if nd:
                nonempty += 1
            step = advance(a, n - pos)
            upd += extend(resp[pos : pos + step])
            pos += step
            steps += 1
            accepted += a
        acc.finish_ns += method.finish()
        acc.update_ns += upd
        acc.requests += 1
        acc.prompt_tokens += len(prompt)
        acc.response_tokens += n
        acc.steps += steps
        acc.accepted += accepted
        acc.drafted += drafted
        acc.nonempty += nonempty
        key = (req.workload, req.stage)
        b = bins.setdefault(shard_bin(shard_n[key]), [0, 0, 0, 0, 0])
        b[0] += 1
        b[1] += n
        b[2] += steps
        b[3] += accepted
        b[4] += drafted
        shard_n[key] += 1
        if (i + 1) % sample_every == 0 or i + 1 == total:
            tb = method.tree_bytes()
            if tb is not None and (peak_bytes is None or tb > peak_bytes):
                peak_bytes = tb
        if rss0 is not None:
            r = rss_bytes()
            if r is not None and rss_peak is not None and r > rss_peak:
                rss_peak = r
        if progress is not None:
            progress.update(i + 1)
    wall = time.perf_counter() - t_wall
    return _Run(stages, bins, wall, warmup_s, peak_bytes, rss0, rss_peak, method.stage_bytes())


# --------------------------------------------------------------------------
# summaries


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _summary(acc: _Acc) -> dict[str, Any]:
    """Reported metrics of a set of counters."""
    d = np.asarray(acc.draft_ns, dtype=np.float64) / 1e3
    return {
        "requests": acc.requests,
        "prompt_tokens": acc.prompt_tokens,
        "response_tokens": acc.response_tokens,
        "steps": acc.steps,
        "mat": _ratio(acc.response_tokens, acc.steps),
        "accepted_per_step": _ratio(acc.accepted, acc.steps),
        "drafted_per_step": _ratio(acc.drafted, acc.steps),
        "acceptance_rate": _ratio(acc.accepted, acc.drafted),
        "nonempty_draft_fraction": _ratio(acc.nonempty, acc.steps),
        "draft_p50_us": float(np.percentile(d, 50)) if d.size else None,
        "draft_p99_us": float(np.percentile(d, 99)) if d.size else None,
        "draft_mean_us": float(d.mean()) if d.size else None,
        "update_us_per_token": _ratio(acc.update_ns / 1e3, acc.response_tokens),
        "ingest_us_per_prompt_token": _ratio(acc.start_ns / 1e3, acc.prompt_tokens),
        "finish_us_per_response_token": _ratio(acc.finish_ns / 1e3, acc.response_tokens),
    }


def _merge(accs: Sequence[_Acc]) -> _Acc:
    out = _Acc()
    for a in accs:
        for f in (
            "requests",
            "prompt_tokens",
            "response_tokens",
            "steps",
            "accepted",
            "drafted",
            "nonempty",
            "start_ns",
            "update_ns",
            "finish_ns",
        ):
            setattr(out, f, getattr(out, f) + getattr(a, f))
        out.draft_ns.extend(a.draft_ns)
    return out


def summarize_run(run: _Run) -> dict[str, Any]:
    """The JSON summary of one method over one file."""
    out = _summary(_merge(list(run.stages.values())))
    out["wall_s"] = run.wall_s
    out["warmup_s"] = run.warmup_s
    out["peak_tree_bytes"] = run.peak_tree_bytes
    out["tree_bytes_per_response_token"] = (
        _ratio(run.peak_tree_bytes, out["response_tokens"])
        if run.peak_tree_bytes is not None
        else None
    )
    out["rss_growth_bytes"] = (
        run.rss_peak - run.rss_start
        if run.rss_peak is not None and run.rss_start is not None
        else None
    )
    per_stage = {}
    for stage, acc in run.stages.items():
        s = _summary(acc)
        s["tree_bytes"] = run.stage_bytes.get(stage)
        per_stage[stage] = s
    out["per_stage"] = per_stage
    out["by_shard_size"] = [
        {
            "shard_responses_lo": lo,
            "shard_responses_hi": hi,
            "requests": v[0],
            "response_tokens": v[1],
            "steps": v[2],
            "mat": _ratio(v[1], v[2]),
            "acceptance_rate": _ratio(v[3], v[4]),
        }
        for (lo, hi), v in sorted(run.bins.items())
    ]
    return out


def add_oracle_fractions(methods: dict[str, dict[str, Any]]) -> None:
    """Set ``mat_vs_oracle`` (overall, per stage, per shard bucket) on every method."""
    oracle = methods.get(ORACLE)
    for res in methods.values():
        res["mat_vs_oracle"] = _frac(res.get("mat"), oracle.get("mat") if oracle else None)
        for stage, s in res["per_stage"].items():
            o = oracle["per_stage"].get(stage) if oracle else None
            s["mat_vs_oracle"] = _frac(s.get("mat"), o.get("mat") if o else None)
        obins = {(b["shard_responses_lo"]): b for b in oracle["by_shard_size"]} if oracle else {}
        for b in res["by_shard_size"]:
            ob = obins.get(b["shard_responses_lo"])
            b["mat_vs_oracle"] = _frac(b.get("mat"), ob.get("mat") if ob else None)


def _frac(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


# --------------------------------------------------------------------------
# driver


def run(
    paths: Sequence[Path],
    *,
    cfg: ReplayConfig,
    methods: Sequence[str],
    tokenizer: Any,
    max_sessions: int | None = None,
    warmup_from: Path | None = None,
    log: Callable[[str], None] = lambda s: None,
    progress_stream: TextIO | None = None,
) -> dict[str, Any]:
    """Replay every file with every runnable method; return the JSON-ready results.

    The oracle always runs (its MAT is the denominator of the fractions).
    Methods that cannot run here are listed under ``skipped`` with the reason.
    """
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    status = method_status()
    wanted = [m for m in METHODS if m in methods or m == ORACLE]
    skipped = {m: status[m] for m in wanted if status[m] is not None}
    runnable = [m for m in wanted if status[m] is None]
    for m, why in skipped.items():
        log(f"skipping {m}: {why}")
    warm: tuple[Request, ...] = ()
    warm_info: dict[str, Any] | None = None
    if warmup_from is not None:
        wt = load_trace(warmup_from, tokenizer)
        warm = wt.requests
        warm_info = {"path": str(warmup_from), **wt.counts(), "tokenize_s": wt.tokenize_s}
        log(f"warm-up: {wt.name}: {len(warm)} responses")
    files = []
    for path in paths:
        t_file = time.perf_counter()
        trace = load_trace(path, tokenizer, max_sessions)
        counts = trace.counts()
        log(
            f"[{trace.name}] {counts['sessions']} sessions, {counts['requests']} requests, "
            f"{counts['response_tokens']} response tokens (tokenized in {trace.tokenize_s:.1f} s)"
        )
        results: dict[str, dict[str, Any]] = {}
        for m in runnable:
            method = make_method(m, cfg)
            prog = Progress(progress_stream, f"[{trace.name}] {m}", len(trace.requests))
            try:
                r = replay(method, trace, warm, prog)
            finally:
                method.close()
            res = summarize_run(r)
            results[m] = res
            prog.close(
                f"MAT {_fmt(res['mat'], 3)}, {r.wall_s:.1f} s"
                + (f" (+{r.warmup_s:.1f} s warm-up)" if warm else "")
            )
        add_oracle_fractions(results)
        files.append(
            {
                "path": str(path),
                "name": trace.name,
                "workload": trace.workload,
                "counts": counts,
                "stages": trace.stages(),
                "tokenize_s": trace.tokenize_s,
                "methods": results,
                "wall_s": time.perf_counter() - t_file,
            }
        )
    return {
        "config": asdict(cfg),
        "max_sessions": max_sessions,
        "warmup": warm_info,
        "methods": runnable,
        "skipped": skipped,
        "environment": _environment(),
        "files": files,
    }


# --------------------------------------------------------------------------
# tables


_COMMON_HEAD = ["steps", "MAT", "/oracle", "accept", "drafted/step", "draft p50 µs", "p99 µs"]


def _common_cells(m: dict[str, Any]) -> list[str]:
    return [
        _fmt(m["steps"]),
        _fmt(m["mat"], 3),
        _fmt(m["mat_vs_oracle"], 3),
        _fmt(m["acceptance_rate"], 3),
        _fmt(m["drafted_per_step"], 2),
        _fmt(m["draft_p50_us"], 2),
        _fmt(m["draft_p99_us"], 2),
        _fmt(m["update_us_per_token"], 3),
    ]


def render_tables(results: dict[str, Any]) -> str:
    """Terminal tables per file: every method overall, then per stage (several stages)."""
    out: list[str] = []
    for f in results["files"]:
        c = f["counts"]
        out.append(
            f"== {f['name']} ({f['workload']}): {c['sessions']:,} sessions, "
            f"{c['requests']:,} requests, {c['prompt_tokens']:,} prompt tokens, "
            f"{c['response_tokens']:,} response tokens"
        )
        head = ["method", *_COMMON_HEAD, "update µs/tok", "trees MB", "RSS +MB", "wall s"]
        rows = [
            [
                name,
                *_common_cells(m),
                _mb(m["peak_tree_bytes"]),
                _mb(m["rss_growth_bytes"]),
                _fmt(m["wall_s"], 1),
            ]
            for name, m in f["methods"].items()
        ]
        out.append(_table(head, rows))
        if len(f["stages"]) > 1:
            out.append("")
            shead = ["stage / method", "requests", "tokens", *_COMMON_HEAD, "update µs/tok"]
            shead.append("shard MB")
            srows: list[list[str]] = []
            for stage in f["stages"]:
                for name, m in f["methods"].items():
                    st = m["per_stage"].get(stage)
                    if st is None:
                        continue
                    srows.append(
                        [
                            f"{stage} / {name}",
                            _fmt(st["requests"]),
                            _fmt(st["response_tokens"]),
                            *_common_cells(st),
                            _mb(st.get("tree_bytes")),
                        ]
                    )
            out.append(_table(shead, srows))
        out.append("")
    if results.get("skipped"):
        for m, why in results["skipped"].items():
            out.append(f"skipped {m}: {why}")
    return "\n".join(out).rstrip() + "\n"


# --------------------------------------------------------------------------
# command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``bench replay`` options to ``p``."""
    add_trace_arguments(p, warmup=True)
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated methods (default: all): {', '.join(METHODS)}; "
        "the oracle always runs",
    )
    add_common_arguments(p)


def parse_methods(spec: str) -> list[str]:
    """Split and check a ``--methods`` value."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError("--methods is empty")
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise ValueError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}")
    return names


def run_cli(args: argparse.Namespace) -> int:
    """Run ``agentspec bench replay`` from parsed arguments; return the exit status."""
    warm = [args.warmup_from] if args.warmup_from else []
    check_inputs([*args.traces, *warm], args.max_sessions)
    methods = parse_methods(args.methods)
    start = cli_start(args, inputs=False)
    cfg, tok, err, log = start.cfg, start.tokenizer, start.err, start.log
    results = run(
        args.traces,
        cfg=cfg,
        methods=methods,
        tokenizer=tok,
        max_sessions=args.max_sessions,
        warmup_from=args.warmup_from,
        log=log,
        progress_stream=err,
    )
    results["command"] = getattr(args, "argv", None)
    from agentspec.bench.plots import plot_replay

    write_outputs(results, render_tables(results), args.json, args.plots, plot_replay, log)
    return 0
