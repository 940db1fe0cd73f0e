"""``agentspec bench budget``: MAT against draft budget, compared at equal budget.

MAT alone rewards drafting more: a drafter that proposes twice the tokens per
step accepts more, whatever its quality.  This benchmark replays each trace
file (as ``agentspec bench replay`` does) once per point of a grid of draft
budget rules (``--alphas`` x ``--min-probs``: the budget per matched token and
the minimum path probability of a drafted token) for each method, and reports
every point's drafted tokens per step, MAT and acceptance rate.  The
``confidence`` method has no budget per matched token: its points sweep its
cut (``--conf-min-probs``).  The copy oracle's MAT is measured once per file,
and every point reports its fraction of it.

Methods are then compared at *equal drafted tokens per step*: for each point
of the baseline method (default ``arctic``), each other method's MAT at the
same drafted tokens per step is read off its upper envelope (the best MAT
measured at that budget or below, interpolated linearly between measured
points; "-" outside the measured range), with the ratio to the baseline's MAT,
and the drafted tokens per step the method needs to reach ``--target`` times
the baseline's MAT (">" the largest measured budget when it never does).
"""

from __future__ import annotations

import argparse
import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from agentspec._core.draft import CONFIDENT_ALPHA
from agentspec.bench._common import (
    Progress,
    add_common_arguments,
    add_trace_arguments,
    check_inputs,
    cli_start,
    table,
    write_outputs,
)
from agentspec.bench._methods import (
    METHODS,
    ORACLE,
    ReplayConfig,
    make_method,
    method_status,
)
from agentspec.bench._trace import (
    load_trace,
)
from agentspec.bench.replay import (
    parse_methods,
    replay,
    summarize_run,
)

__all__ = [
    "Point",
    "add_arguments",
    "budget_for",
    "compare",
    "envelope",
    "mat_at",
    "render_tables",
    "run",
    "run_cli",
]

DEFAULT_METHODS = ("confidence", "stage-shards", "arctic")
DEFAULT_ALPHAS = (0.5, 0.75, 1.0, 1.5, 2.0, 4.0)
DEFAULT_MIN_PROBS = (0.1,)
#: The confidence method has no alpha budget: its curve sweeps its cut instead.
DEFAULT_CONF_MIN_PROBS = (0.02, 0.04, 0.08, 0.12, 0.17, 0.25, 0.35, 0.5, 0.65)
CONF_METHOD = "confidence"


@dataclass(frozen=True)
class Point:
    """One method replayed with one budget rule."""

    method: str
    alpha: float
    min_prob: float
    steps: int
    mat: float
    drafted_per_step: float
    acceptance_rate: float | None


def envelope(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The upper envelope of ``(drafted_per_step, mat)`` points.

    Sorted by budget; each point's MAT is the best measured at that budget or
    below (a drafter can always draft less), and points that do not raise the
    best MAT are dropped.
    """
    out: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if not (math.isfinite(x) and math.isfinite(y)):
            raise ValueError(f"points must be finite, got ({x}, {y})")
        if out and y <= out[-1][1]:
            continue
        if out and x == out[-1][0]:
            out[-1] = (x, y)
        else:
            out.append((x, y))
    return out


def mat_at(env: Sequence[tuple[float, float]], x: float) -> float | None:
    """MAT on ``env`` at budget ``x``: linear between points; None outside
    the measured range (nothing is known there)."""
    if not env or x < env[0][0] or x > env[-1][0]:
        return None
    xs = [p[0] for p in env]
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return env[i][1]
    (x0, y0), (x1, y1) = env[i - 1], env[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def budget_for(env: Sequence[tuple[float, float]], y: float) -> float | None:
    """The smallest budget at which ``env`` reaches MAT ``y`` (None: it never
    does); when the first point already reaches it, that point's budget (an
    upper bound: nothing below it was measured)."""
    for i, (x1, y1) in enumerate(env):
        if y1 >= y:
            if i == 0:
                return x1
            x0, y0 = env[i - 1]
            return x0 + (x1 - x0) * (y - y0) / (y1 - y0)
    return None


def compare(points: Sequence[Point], baseline: str, target: float) -> list[dict[str, Any]]:
    """For each baseline point and each other method: the equal-budget comparison.

    Rows (baseline points by budget, then methods in order of first
    appearance): ``method``, ``alpha``, ``min_prob`` (of the baseline point),
    ``drafted_per_step`` and ``baseline_mat``, the method's ``mat`` at that
    budget and ``ratio`` (None outside its measured range), and
    ``budget_for_target``: the drafted tokens per step the method needs to
    reach ``target`` times the baseline's MAT (None: not within its points).
    """
    base = sorted(
        (p for p in points if p.method == baseline), key=lambda p: (p.drafted_per_step, p.mat)
    )
    others: dict[str, list[tuple[float, float]]] = {}
    for p in points:
        if p.method != baseline:
            others.setdefault(p.method, []).append((p.drafted_per_step, p.mat))
    envs = {m: envelope(pts) for m, pts in others.items()}
    rows = []
    for b in base:
        for m, env in envs.items():
            y = mat_at(env, b.drafted_per_step)
            rows.append(
                {
                    "method": m,
                    "alpha": b.alpha,
                    "min_prob": b.min_prob,
                    "drafted_per_step": b.drafted_per_step,
                    "baseline_mat": b.mat,
                    "mat": y,
                    "ratio": None if y is None else y / b.mat,
                    "budget_for_target": budget_for(env, target * b.mat),
                }
            )
    return rows


def _grid(alphas: Sequence[float], min_probs: Sequence[float]) -> list[tuple[float, float]]:
    grid = [(a, mp) for a in alphas for mp in min_probs]
    if not grid:
        raise ValueError("the budget grid is empty")
    if len(set(grid)) != len(grid):
        raise ValueError("the budget grid repeats a point")
    for a, mp in grid:
        ReplayConfig(alpha=a, min_prob=mp)  # range checks
    return grid


def run(
    paths: Sequence[Path],
    *,
    methods: Sequence[str],
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    min_probs: Sequence[float] = DEFAULT_MIN_PROBS,
    conf_min_probs: Sequence[float] = DEFAULT_CONF_MIN_PROBS,
    oracle: bool = True,
    baseline: str = "arctic",
    target: float = 1.10,
    base_cfg: ReplayConfig | None = None,
    tokenizer: Any,
    max_sessions: int | None = None,
    log: Callable[[str], None] = lambda s: None,
    progress_stream: TextIO | None = None,
) -> dict[str, Any]:
    """Replay every file with every method at every budget rule; JSON-ready results.

    Methods that cannot run here are listed under ``skipped``; so is the
    comparison when the baseline cannot run.
    """
    for m in [*methods, baseline]:
        if m not in METHODS or m == ORACLE:
            raise ValueError(f"unknown or unsupported method {m!r} for a budget sweep")
    if not (math.isfinite(target) and target > 0):
        raise ValueError(f"target must be a positive number, got {target}")
    grid = _grid(alphas, min_probs)
    conf_grid = _grid([CONFIDENT_ALPHA], conf_min_probs)
    cfg0 = base_cfg or ReplayConfig()
    status = method_status()
    wanted = list(dict.fromkeys([*methods, baseline]))
    skipped = {m: status[m] for m in wanted if status[m] is not None}
    runnable = [m for m in wanted if status[m] is None]
    for m, why in skipped.items():
        log(f"skipping {m}: {why}")
    files = []
    for path in paths:
        trace = load_trace(path, tokenizer, max_sessions)
        counts = trace.counts()
        log(f"[{trace.name}] {counts['requests']} requests, {counts['response_tokens']} tokens")
        points: list[Point] = []
        oracle_mat = None
        if oracle:
            method = make_method(ORACLE, cfg0)
            prog = Progress(progress_stream, f"[{trace.name}] oracle", len(trace.requests))
            try:
                oracle_mat = summarize_run(replay(method, trace, (), prog))["mat"]
            finally:
                method.close()
            prog.close(f"MAT {oracle_mat:.3f}")
        for m in runnable:
            for a, mp in conf_grid if m == CONF_METHOD else grid:
                cfg = (
                    replace(cfg0, conf_min_prob=mp)
                    if m == CONF_METHOD
                    else replace(cfg0, alpha=a, min_prob=mp)
                )
                method = make_method(m, cfg)
                label = f"[{trace.name}] {m} alpha={a:g} min_prob={mp:g}"
                prog = Progress(progress_stream, label, len(trace.requests))
                try:
                    res = summarize_run(replay(method, trace, (), prog))
                finally:
                    method.close()
                points.append(
                    Point(
                        m,
                        a,
                        mp,
                        res["steps"],
                        res["mat"],
                        res["drafted_per_step"],
                        res["acceptance_rate"],
                    )
                )
                prog.close(f"MAT {res['mat']:.3f} at {res['drafted_per_step']:.2f} drafted/step")
        rows = compare(points, baseline, target) if baseline in runnable else []
        files.append(
            {
                "path": str(path),
                "name": trace.name,
                "counts": counts,
                "points": [asdict(p) for p in points],
                "oracle_mat": oracle_mat,
                "comparison": rows,
            }
        )
    return {
        "config": asdict(cfg0),
        "alphas": list(alphas),
        "min_probs": list(min_probs),
        "conf_min_probs": list(conf_min_probs),
        "baseline": baseline,
        "target": target,
        "max_sessions": max_sessions,
        "methods": runnable,
        "skipped": skipped,
        "files": files,
    }


def _f(v: float | None, nd: int) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def render_tables(results: dict[str, Any]) -> str:
    """Per file: every point, then the equal-budget comparison against the baseline."""
    out: list[str] = []
    base, target = results["baseline"], results["target"]
    for f in results["files"]:
        c = f["counts"]
        out.append(
            f"== {f['name']}: {c['sessions']:,} sessions, {c['requests']:,} requests, "
            f"{c['response_tokens']:,} response tokens"
        )
        pts = sorted(f["points"], key=lambda p: (p["method"], p["drafted_per_step"]))
        omat = f.get("oracle_mat")
        if omat:
            out.append(f"copy oracle MAT {omat:.3f} (/oracle: a point's MAT as a fraction of it)")
        if pts:
            out.append(
                table(
                    [
                        "method",
                        "alpha",
                        "min prob",
                        "drafted/step",
                        "MAT",
                        "/oracle",
                        "accept",
                        "steps",
                    ],
                    [
                        [
                            p["method"],
                            f"{p['alpha']:g}",
                            f"{p['min_prob']:g}",
                            _f(p["drafted_per_step"], 2),
                            _f(p["mat"], 3),
                            _f(p["mat"] / omat if omat and p["mat"] else None, 3),
                            _f(p["acceptance_rate"], 3),
                            f"{p['steps']:,}",
                        ]
                        for p in pts
                    ],
                )
            )
        rows = f["comparison"]
        if rows:
            out.append("")
            out.append(
                f"at {base}'s drafted tokens per step (envelope, linear between points): "
                f"MAT, ratio to {base}, and the budget needed for {target:g}x {base}'s MAT"
            )
            out.append(
                table(
                    [
                        "method",
                        f"{base} alpha",
                        "min prob",
                        "drafted/step",
                        f"{base} MAT",
                        "MAT",
                        "ratio",
                        f"drafted/step for {target:g}x",
                    ],
                    [
                        [
                            r["method"],
                            f"{r['alpha']:g}",
                            f"{r['min_prob']:g}",
                            _f(r["drafted_per_step"], 2),
                            _f(r["baseline_mat"], 3),
                            _f(r["mat"], 3),
                            _f(r["ratio"], 3),
                            _budget_cell(r, f["points"]),
                        ]
                        for r in rows
                    ],
                )
            )
        out.append("")
    for m, why in results.get("skipped", {}).items():
        out.append(f"skipped {m}: {why}")
    if results.get("skipped", {}).get(base):
        out.append(f"no comparison: the baseline {base} did not run")
    return "\n".join(out).rstrip() + "\n"


def _budget_cell(row: dict[str, Any], points: Sequence[dict[str, Any]]) -> str:
    need = row["budget_for_target"]
    if need is not None:
        return f"{need:.2f} ({need / row['drafted_per_step']:.2f}x)"
    top = max(p["drafted_per_step"] for p in points if p["method"] == row["method"])
    return f"> {top:.2f}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``bench budget`` options to ``p``."""
    add_trace_arguments(p)
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma-separated methods (default: {','.join(DEFAULT_METHODS)}); any replay "
        "method but the oracle",
    )
    p.add_argument(
        "--baseline", default="arctic", help="the method compared against (default arctic)"
    )
    p.add_argument(
        "--alphas",
        default=",".join(f"{a:g}" for a in DEFAULT_ALPHAS),
        help="draft budgets per matched token to sweep (default 0.5,0.75,1,1.5,2,4)",
    )
    p.add_argument(
        "--min-probs",
        default=",".join(f"{m:g}" for m in DEFAULT_MIN_PROBS),
        help="min path probabilities to sweep (default 0.1)",
    )
    p.add_argument(
        "--conf-min-probs",
        default=",".join(f"{m:g}" for m in DEFAULT_CONF_MIN_PROBS),
        help="the confidence method's cuts to sweep (default "
        + ",".join(f"{m:g}" for m in DEFAULT_CONF_MIN_PROBS)
        + ")",
    )
    p.add_argument(
        "--no-oracle", action="store_true", help="skip the copy oracle's replay (no /oracle)"
    )
    p.add_argument(
        "--target", type=float, default=1.10, help="MAT ratio to find budgets for (default 1.10)"
    )
    add_common_arguments(p, budget_rule=False)


def _floats(name: str, spec: str) -> list[float]:
    try:
        vals = [float(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated numbers, got {spec!r}") from None
    if not vals:
        raise ValueError(f"{name} is empty")
    return vals


def run_cli(args: argparse.Namespace) -> int:
    """Run ``agentspec bench budget`` from parsed arguments; return the exit status."""
    check_inputs(args.traces, args.max_sessions)
    methods = parse_methods(args.methods)
    baseline = args.baseline.strip()
    alphas = _floats("--alphas", args.alphas)
    min_probs = _floats("--min-probs", args.min_probs)
    conf_min_probs = _floats("--conf-min-probs", args.conf_min_probs)
    start = cli_start(args, budget_rule=False, inputs=False)
    cfg, tok, err, log = start.cfg, start.tokenizer, start.err, start.log
    results = run(
        args.traces,
        methods=methods,
        alphas=alphas,
        min_probs=min_probs,
        conf_min_probs=conf_min_probs,
        oracle=not args.no_oracle,
        baseline=baseline,
        target=args.target,
        base_cfg=cfg,
        tokenizer=tok,
        max_sessions=args.max_sessions,
        log=log,
        progress_stream=err,
    )
    from agentspec.bench.plots import plot_budget

    write_outputs(results, render_tables(results), args.json, args.plots, plot_budget, log)
    return 0
