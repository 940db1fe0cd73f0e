"""`agentspec bench calibration`: are draft-token probabilities what a verifier accepts?

Each trace is replayed as in ``agentspec bench replay`` (stage shards,
online learning, a simulated greedy verifier).  For every verified draft
token (a token whose whole prefix was accepted) it records the token's
estimated conditional probability (from the tree's counts: its path
probability over its parent's) and whether it was accepted.

It reports, per trace:

- predicted vs observed acceptance per probability bucket, the expected
  calibration error (ECE: the token-weighted mean of ``|observed -
  predicted|`` over buckets) and the Brier score;
- the same after the online correction of `AcceptanceCalibrator`, learned
  per (stage, source tree) and depth in the draft, shrunk towards every
  group's rate at that depth, while replaying: each draft is scored with the
  correction learned from the drafts before it (prequential), so the gain
  is what a live controller would get;
- per (stage, source): tokens, mean bias (observed minus predicted) and
  ECE, raw and corrected.

``--plots DIR`` writes ``<trace>-calibration.png`` (reliability diagram:
observed rate against predicted probability per bucket, raw and corrected,
with the diagonal).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentspec._core.calibration import AcceptanceCalibrator, conditional_probs
from agentspec.bench._common import (
    add_common_arguments,
    add_trace_arguments,
    check_inputs,
    cli_start,
    write_outputs,
)
from agentspec.bench._methods import (
    ReplayConfig,
)
from agentspec.bench._trace import (
    TraceData,
    load_trace,
)
from agentspec.bench.verifier import accept_linear, advance

__all__ = ["add_arguments", "calibrate_trace", "plot_calibration", "render_table", "run_cli"]


class _Reliability:
    """Per-bucket sums of predictions and outcomes."""

    def __init__(self, buckets: int) -> None:
        self.buckets = buckets
        self.n = [0] * buckets
        self.pred = [0.0] * buckets
        self.obs = [0] * buckets
        self.sq = 0.0

    def add(self, p: float, ok: bool) -> None:
        b = min(self.buckets - 1, int(p * self.buckets))
        self.n[b] += 1
        self.pred[b] += p
        self.obs[b] += ok
        self.sq += (p - ok) ** 2

    @property
    def total(self) -> int:
        return sum(self.n)

    def summary(self) -> dict[str, Any]:
        total = self.total
        rows = []
        ece = 0.0
        for b in range(self.buckets):
            n = self.n[b]
            if not n:
                continue
            pred, obs = self.pred[b] / n, self.obs[b] / n
            ece += n * abs(obs - pred)
            rows.append(
                {
                    "low": b / self.buckets,
                    "high": (b + 1) / self.buckets,
                    "tokens": n,
                    "predicted": pred,
                    "observed": obs,
                }
            )
        pred_all = sum(self.pred) / total if total else None
        obs_all = sum(self.obs) / total if total else None
        return {
            "tokens": total,
            "ece": ece / total if total else None,
            "brier": self.sq / total if total else None,
            "predicted": pred_all,
            "observed": obs_all,
            "bias": None if obs_all is None or pred_all is None else obs_all - pred_all,
            "buckets": rows,
        }


def calibrate_trace(
    trace: TraceData,
    cfg: ReplayConfig,
    *,
    buckets: int = 10,
    prior: float = 8.0,
) -> dict[str, Any]:
    """Replay ``trace`` and measure the calibration of its draft-token probabilities."""
    from agentspec import DraftParams, Speculator

    params = DraftParams(
        max_spec_tokens=cfg.max_spec_tokens, alpha=cfg.alpha, min_token_prob=cfg.min_prob
    )
    spec = Speculator(cfg.depth, params=params)
    cal = AcceptanceCalibrator(buckets=buckets, prior=prior)
    raw, fixed = _Reliability(buckets), _Reliability(buckets)
    groups: dict[tuple[str, str], tuple[_Reliability, _Reliability]] = {}
    drafts = 0
    try:
        for i, req in enumerate(trace.requests):
            spec.start_request(i, req.prompt(), stage=req.stage, pipeline=req.workload)
            resp = req.response.tolist()
            n = len(resp)
            pos = 0
            while pos < n:
                d, source = spec.draft_source(i)
                if d.token_ids:
                    drafts += 1
                    a = accept_linear(d.token_ids, resp, pos)
                    cond = conditional_probs(d.probs, d.parents)
                    key = (req.stage, source)
                    corrected = cal.correct_all(key, cond[: a + 1])
                    g = groups.get(key)
                    if g is None:
                        g = groups[key] = (_Reliability(buckets), _Reliability(buckets))
                    for j, (p, q) in enumerate(zip(cond[: a + 1], corrected, strict=True)):
                        ok = j < a
                        raw.add(p, ok)
                        fixed.add(q, ok)
                        g[0].add(p, ok)
                        g[1].add(q, ok)
                    cal.observe(key, cond, a)
                else:
                    a = 0
                step = advance(a, n - pos)
                spec.extend(i, resp[pos : pos + step])
                pos += step
            spec.finish(i, learn=True)
    finally:
        spec.close()
    return {
        "name": trace.name,
        "requests": len(trace.requests),
        "drafts": drafts,
        "raw": raw.summary(),
        "corrected": fixed.summary(),
        "groups": [
            {
                "stage": stage,
                "source": source,
                "raw": {k: v for k, v in r.summary().items() if k != "buckets"},
                "corrected": {k: v for k, v in c.summary().items() if k != "buckets"},
            }
            for (stage, source), (r, c) in sorted(groups.items())
        ],
    }


def _f(v: float | None, nd: int = 3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def render_table(results: dict[str, Any]) -> str:
    """The report as text: per trace, the buckets, then the per-group summary."""
    out: list[str] = []
    for t in results["traces"]:
        r, c = t["raw"], t["corrected"]
        out.append(
            f"{t['name']}: {t['requests']} requests, {t['drafts']} drafts, "
            f"{r['tokens']} verified draft tokens"
        )
        out.append(
            f"  ECE raw {_f(r['ece'])} -> corrected {_f(c['ece'])}; "
            f"Brier {_f(r['brier'])} -> {_f(c['brier'])}; "
            f"mean predicted {_f(r['predicted'])}, observed {_f(r['observed'])}"
        )
        out.append(
            "  bucket       tokens  predicted  observed  | corrected: tokens  predicted  observed"
        )
        cb = {b["low"]: b for b in c["buckets"]}
        lows = sorted({b["low"] for b in r["buckets"]} | set(cb))
        rb = {b["low"]: b for b in r["buckets"]}
        for low in lows:
            x, y = rb.get(low), cb.get(low)
            left = (
                f"{x['tokens']:>7}  {x['predicted']:9.3f}  {x['observed']:8.3f}"
                if x
                else f"{'-':>7}  {'-':>9}  {'-':>8}"
            )
            right = (
                f"{y['tokens']:>7}  {y['predicted']:9.3f}  {y['observed']:8.3f}"
                if y
                else f"{'-':>7}  {'-':>9}  {'-':>8}"
            )
            high = low + 1 / results["buckets"]
            out.append(f"  [{low:.1f},{high:.1f})  {left}  |            {right}")
        out.append("  stage / source             tokens   bias raw  bias corr   ECE raw  ECE corr")
        for g in t["groups"]:
            label = f"{g['stage']} / {g['source']}"[:26]
            out.append(
                f"  {label:<26} {g['raw']['tokens']:>7}  {_f(g['raw']['bias']):>8}  "
                f"{_f(g['corrected']['bias']):>9}  {_f(g['raw']['ece']):>8}  "
                f"{_f(g['corrected']['ece']):>8}"
            )
        out.append("")
    return "\n".join(out) + "\n"


def plot_calibration(results: dict[str, Any], out_dir: Path | str) -> tuple[list[Path], str | None]:
    """``<trace>-calibration.png`` per trace: the reliability diagram, raw and corrected."""
    from agentspec.bench.plots import _NO_MATPLOTLIB, _prepare, _save

    plt, out = _prepare(out_dir)
    if plt is None:
        return [], _NO_MATPLOTLIB
    written: list[Path] = []
    for t in results["traces"]:
        fig, ax = plt.subplots(figsize=(5.5, 5.0))
        ax.plot([0, 1], [0, 1], color="grey", linewidth=1, label="perfect calibration")
        for label, part, style in (
            ("raw (tree counts)", "raw", "o-"),
            ("corrected online", "corrected", "s--"),
        ):
            rows = t[part]["buckets"]
            ax.plot(
                [b["predicted"] for b in rows],
                [b["observed"] for b in rows],
                style,
                markersize=4,
                label=f"{label}, ECE {_f(t[part]['ece'])}",
            )
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("predicted acceptance probability (bucket mean)")
        ax.set_ylabel("observed acceptance rate")
        ax.set_title(f"{t['name']}: draft-token calibration")
        ax.legend(loc="upper left", fontsize=8)
        written.append(_save(plt, fig, out / f"{t['name']}-calibration.png"))
    return written, None


def run(
    paths: Sequence[Path],
    *,
    cfg: ReplayConfig,
    tokenizer: Any,
    max_sessions: int | None = None,
    buckets: int = 10,
    prior: float = 8.0,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Calibration of each trace file (see the module docstring)."""
    traces = []
    for p in paths:
        trace = load_trace(p, tokenizer, max_sessions)
        log(f"{trace.name}: {len(trace.requests)} requests")
        traces.append(calibrate_trace(trace, cfg, buckets=buckets, prior=prior))
    return {
        "config": {
            "depth": cfg.depth,
            "max_spec_tokens": cfg.max_spec_tokens,
            "alpha": cfg.alpha,
            "min_prob": cfg.min_prob,
            "prior": prior,
        },
        "buckets": buckets,
        "traces": traces,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``bench calibration`` options to ``p``."""
    add_trace_arguments(p)
    p.add_argument("--buckets", type=int, default=10, help="probability buckets (default 10)")
    p.add_argument(
        "--prior",
        type=float,
        default=8.0,
        help="pseudo-observations at the estimate in the online correction (default 8)",
    )
    add_common_arguments(p)


def run_cli(args: argparse.Namespace) -> int:
    """Run ``agentspec bench calibration`` from parsed arguments; return the exit status."""
    check_inputs(args.traces, args.max_sessions)
    if not 1 <= args.buckets <= 100:
        raise ValueError(f"--buckets must be in 1..100, got {args.buckets}")
    if not args.prior > 0:
        raise ValueError(f"--prior must be > 0, got {args.prior}")
    start = cli_start(args, inputs=False)
    cfg, tok, log = start.cfg, start.tokenizer, start.log
    results = run(
        args.traces,
        cfg=cfg,
        tokenizer=tok,
        max_sessions=args.max_sessions,
        buckets=args.buckets,
        prior=args.prior,
        log=log,
    )
    write_outputs(results, render_table(results), args.json, args.plots, plot_calibration, log)
    return 0
