"""`agentspec bench evidence`: acceptance by matched length and count, and the fitted table.

Each trace is replayed with the count-only drafter at a large budget (an
`agentspec.Speculator` with stage shards, the pipeline tree and the
per-request tree, online learning, ``DraftParams(alpha=32,
min_token_prob=0)``, no goodput control) under the simulated greedy
verifier.  Every *verified* draft token (its whole prefix accepted: tokens
``0..a`` of a draft whose first ``a`` tokens were accepted) is recorded with:

- ``L``: the tokens matched before it, the draft's ``match_len`` plus its
  index in the draft;
- ``T``: the number of continuations of the string it continues (those ``L``
  tokens) in the tree it was drafted from (``local``: the request's prompt and
  output, mirrored in a `SuffixTree`; ``stage`` / ``pipeline``: the shard
  `Speculator.draft_source` names), recovered exactly as
  ``SuffixTree.count(string + token) / conditional probability`` (an
  occurrence at the very end of a sequence has no continuation, so this is
  the engine's total, not ``count(string)``);
- its conditional probability (``probs[i] / probs[i - 1]``, the share of
  those continuations that go on with it) and whether it was accepted.

Bins are the engine's (`DraftParams.conf`): the bit length of ``min(x, 127)``,
so bin 1 is 1, bin 2 is 2-3, ..., bin 7 is 64 and up.  Reported per trace and
pooled over the traces:

- the acceptance rate of the tokens with conditional probability 1 per
  (bin(L), bin(T)), with token counts;
- the acceptance per conditional-probability bucket, beside what the model
  below predicts (``cond * f(L, T)``) with the default and the fitted
  parameters;
- the model of `agentspec.confidence_table`, ``f = 1 - 1 / (1 + scale *
  L**length_exp * T**count_exp)`` at the bin middles, fitted to the
  conditional-probability-1 cells by maximum likelihood (`fit_confidence`),
  with the default parameters' and the fit's log loss per token, and the
  per-cell rates' (the best any table can do).

``--plots DIR`` writes ``<trace>-evidence.png`` (and ``pooled-evidence.png``
with several traces): the acceptance table as a heat map.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agentspec.bench._common import (
    LOCAL_SEQ,
    add_common_arguments,
    add_trace_arguments,
    cli_start,
    mirror_prompt,
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

__all__ = [
    "COND_BUCKETS",
    "EVIDENCE_ALPHA",
    "ModelFit",
    "add_arguments",
    "conf_bin",
    "evidence_trace",
    "fit_confidence",
    "log_loss",
    "plot_evidence",
    "render_table",
    "run",
    "run_cli",
    "summarize",
]

#: The drafter's budget per matched token: large, so drafts stop at the tree, not the budget.
EVIDENCE_ALPHA = 32.0
#: Conditional-probability buckets ``(label, low)``: a token falls in the first with cond >= low.
COND_BUCKETS: tuple[tuple[str, float], ...] = (
    ("1", 1.0),
    ("[0.75,1)", 0.75),
    ("[0.5,0.75)", 0.5),
    ("[0.25,0.5)", 0.25),
    ("[0,0.25)", 0.0),
)
#: The default table's parameters (`agentspec.confidence_table`'s defaults).
DEFAULT_MODEL = (0.5, 1.0, 0.5)

_BIN_LABELS = ("0", "1", "2-3", "4-7", "8-15", "16-31", "32-63", "64+")
_P_EPS = 1e-12


def conf_bin(x: int) -> int:
    """The confidence table's bin of a length or count: the bit length of ``min(x, 127)``."""
    return min(int(x), 127).bit_length()


def _bins() -> int:
    from agentspec._core import lowlevel

    return int(lowlevel.CONF_BINS)


def _cond_bucket(cond: float) -> int:
    for i, (_, low) in enumerate(COND_BUCKETS):
        if cond >= low:
            return i
    return len(COND_BUCKETS) - 1


# --------------------------------------------------------------------------
# the model and its fit


def _log_mid(b: int) -> float:
    """log of the middle of bin ``b``, as `agentspec.confidence_table` evaluates it."""
    from agentspec._core.draft import _bin_middle

    return math.log(_bin_middle(b))


def _model_p(scale: float, length_exp: float, count_exp: float, lb: int, tb: int) -> float:
    """``1 - 1 / (1 + scale * mid(lb)**length_exp * mid(tb)**count_exp)``."""
    if scale <= 0:
        return 0.0
    z = math.log(scale) + length_exp * _log_mid(lb) + count_exp * _log_mid(tb)
    return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0


@dataclass(frozen=True)
class ModelFit:
    """Parameters of the confidence model and their log loss on the cells they were fitted to."""

    scale: float
    length_exp: float
    count_exp: float
    log_loss: float | None  # mean nats per token; None without tokens
    tokens: float


def log_loss(
    cells: Iterable[tuple[int, int, float, float]],
    scale: float,
    length_exp: float,
    count_exp: float,
) -> float | None:
    """Mean log loss per token of the model on ``(l_bin, t_bin, tokens, accepted)`` cells."""
    total = 0.0
    loss = 0.0
    for lb, tb, n, k in cells:
        if n <= 0:
            continue
        p = min(1.0 - _P_EPS, max(_P_EPS, _model_p(scale, length_exp, count_exp, lb, tb)))
        loss -= k * math.log(p) + (n - k) * math.log(1.0 - p)
        total += n
    return loss / total if total else None


def _check_cells(
    cells: Iterable[tuple[int, int, float, float]],
) -> list[tuple[int, int, float, float]]:
    out = []
    nb = _bins()
    for cell in cells:
        lb, tb, n, k = cell
        if not (0 <= lb < nb and 0 <= tb < nb):
            raise ValueError(f"cell bins must be in [0, {nb}), got {cell}")
        if not (math.isfinite(n) and math.isfinite(k) and 0 <= k <= n):
            raise ValueError(f"a cell needs 0 <= accepted <= tokens, got {cell}")
        if n > 0:
            out.append((int(lb), int(tb), float(n), float(k)))
    return out


def fit_confidence(
    cells: Iterable[tuple[int, int, float, float]],
    *,
    start: tuple[float, float, float] = DEFAULT_MODEL,
    ridge: float = 1e-6,
) -> ModelFit:
    """Fit ``(scale, length_exp, count_exp)`` of `agentspec.confidence_table` to cells.

    ``cells`` are ``(l_bin, t_bin, tokens, accepted)``; ``accepted`` may be
    fractional (expected counts).  The model's log-odds are ``log scale +
    length_exp * log mid(l_bin) + count_exp * log mid(t_bin)``, so the
    binomial maximum likelihood is a logistic regression on those two
    features, solved by Newton's method; the exponents are kept >= 0 (as
    `confidence_table` requires) by solving on each face of that constraint
    and keeping the best feasible solution.  A tiny ridge towards ``start``
    (``ridge`` nats per token) keeps a parameter the cells cannot tell (all in
    one bin, or every token accepted) at its start value instead of diverging.

    Raises:
        ValueError: a cell out of range, or no tokens.
    """
    data = _check_cells(cells)
    if not data:
        raise ValueError("no tokens to fit")
    x = np.array([[1.0, _log_mid(lb), _log_mid(tb)] for lb, tb, _, _ in data])
    n = np.array([c[2] for c in data])
    k = np.array([c[3] for c in data])
    w0 = np.array([math.log(start[0]), start[1], start[2]])
    lam = ridge * float(n.sum())
    best: tuple[float, np.ndarray[Any, Any]] | None = None
    for fixed in ((), (1,), (2,), (1, 2)):
        free = [i for i in range(3) if i not in fixed]
        w = w0.copy()
        for i in fixed:
            w[i] = 0.0
        w = _newton(x, n, k, w, w0, free, lam)
        if any(w[i] < 0 for i in (1, 2)):
            continue
        obj = _objective(x, n, k, w, w0, lam)
        if best is None or obj < best[0]:
            best = (obj, w)
    assert best is not None  # the face with both exponents fixed at 0 is always feasible
    w = best[1]
    scale, le, ce = math.exp(float(w[0])), float(w[1]), float(w[2])
    return ModelFit(scale, le, ce, log_loss(data, scale, le, ce), float(n.sum()))


def _objective(
    x: np.ndarray[Any, Any],
    n: np.ndarray[Any, Any],
    k: np.ndarray[Any, Any],
    w: np.ndarray[Any, Any],
    w0: np.ndarray[Any, Any],
    lam: float,
) -> float:
    """Negative log likelihood plus the ridge (nats)."""
    z = x @ w
    # -[k log p + (n - k) log(1 - p)] with p = sigmoid(z), stably
    nll = float(np.sum(n * np.logaddexp(0.0, z) - k * z))
    return nll + lam * float(np.sum((w - w0) ** 2))


def _newton(
    x: np.ndarray[Any, Any],
    n: np.ndarray[Any, Any],
    k: np.ndarray[Any, Any],
    w: np.ndarray[Any, Any],
    w0: np.ndarray[Any, Any],
    free: Sequence[int],
    lam: float,
) -> np.ndarray[Any, Any]:
    """Minimise `_objective` over the ``free`` coordinates of ``w`` (Newton, step halving)."""
    xf = x[:, free]
    obj = _objective(x, n, k, w, w0, lam)
    for _ in range(100):
        z = x @ w
        p = 1.0 / (1.0 + np.exp(-np.clip(z, -700, 700)))
        grad = xf.T @ (n * p - k) + 2 * lam * (w - w0)[free]
        hess = (xf * (n * p * (1 - p))[:, None]).T @ xf + 2 * lam * np.eye(len(free))
        try:
            step = np.linalg.solve(hess, grad)
        except np.linalg.LinAlgError:
            step = np.linalg.lstsq(hess, grad, rcond=None)[0]
        t = 1.0
        while True:
            cand = w.copy()
            cand[free] = w[free] - t * step
            c_obj = _objective(x, n, k, cand, w0, lam)
            if c_obj <= obj or t < 1e-10:
                break
            t /= 2
        done = obj - c_obj < 1e-12 * max(1.0, abs(obj)) and float(np.max(np.abs(t * step))) < 1e-9
        w, obj = cand, min(obj, c_obj)
        if done:
            break
    return w


# --------------------------------------------------------------------------
# the replay


class _Cells:
    """Verified draft tokens per (source, bin(L), bin(T), conditional-probability bucket)."""

    def __init__(self) -> None:
        # key -> [tokens, accepted, sum of conditional probabilities]
        self.data: dict[tuple[str, int, int, int], list[float]] = {}

    def add(self, source: str, lb: int, tb: int, cond: float, ok: bool) -> None:
        cell = self.data.setdefault((source, lb, tb, _cond_bucket(cond)), [0, 0, 0.0])
        cell[0] += 1
        cell[1] += ok
        cell[2] += cond

    def rows(self) -> list[dict[str, Any]]:
        return [
            {
                "source": s,
                "l_bin": lb,
                "t_bin": tb,
                "cond_bucket": COND_BUCKETS[cb][0],
                "tokens": int(v[0]),
                "accepted": int(v[1]),
                "cond_sum": v[2],
            }
            for (s, lb, tb, cb), v in sorted(self.data.items())
        ]


class _Collector:
    """Replays one trace and records every verified draft token (see the module docstring)."""

    def __init__(self, cfg: ReplayConfig) -> None:
        from agentspec import DraftParams, Speculator

        self.depth = cfg.depth
        params = DraftParams(
            max_spec_tokens=cfg.max_spec_tokens, alpha=EVIDENCE_ALPHA, min_token_prob=0.0
        )
        self.spec = Speculator(cfg.depth, params=params, goodput=False)
        self.local: Any = None  # the request's prompt and output so far (its cursor's tree)
        self._ctx: np.ndarray[Any, Any] = np.zeros(0, dtype=np.int32)
        self.cells = _Cells()
        self.steps = 0
        self.drafts = 0
        self.tokens = 0
        self.verified = 0
        self.accepted = 0

    def _start_local(self, prompt: np.ndarray[Any, Any]) -> None:
        """Index the prompt; only its new tokens when it extends the previous context."""
        self.local = mirror_prompt(self.local, self._ctx, prompt, self.depth)
        self._ctx = prompt

    def run(self, trace: TraceData) -> None:
        spec = self.spec
        for i, req in enumerate(trace.requests):
            prompt = req.prompt()
            resp: list[int] = req.response.tolist()
            n = len(resp)
            spec.start_request(i, prompt, stage=req.stage, pipeline=req.workload)
            self._start_local(prompt)
            tail: list[int] = prompt[-self.depth :].tolist()  # the last `depth` context tokens
            pos = 0
            while pos < n:
                d, source = spec.draft_source(i)
                toks = d.token_ids
                a = accept_linear(toks, resp, pos)
                if toks:
                    self.drafts += 1
                    tree = self._tree(source, req.stage, req.workload)
                    self._record(tree, source, tail, toks, d.probs, d.match_len, a)
                step = advance(a, n - pos)
                chunk = resp[pos : pos + step]
                spec.extend(i, chunk)
                self.local.append(LOCAL_SEQ, chunk)
                tail = (tail + chunk)[-self.depth :]
                pos += step
                self.steps += 1
            spec.finish(i, learn=True)
            self._ctx = np.concatenate((prompt, req.response)).astype(np.int32, copy=False)
            self.tokens += n

    def _tree(self, source: str, stage: str, pipeline: str) -> Any:
        if source == "local":
            return self.local
        if source == "stage":
            return self.spec.shard(stage=stage, pipeline=pipeline)
        if source == "pipeline":
            return self.spec.pipeline_tree(pipeline)
        raise RuntimeError(f"unexpected draft source {source!r}")

    def _record(
        self,
        tree: Any,
        source: str,
        tail: list[int],
        toks: Sequence[int],
        probs: Sequence[float],
        m: int,
        a: int,
    ) -> None:
        full = tail + list(toks)
        base = len(tail)
        prev = 1.0
        for j in range(min(a + 1, len(toks))):
            cond = probs[j] / prev if prev > 0 else 0.0
            prev = probs[j]
            length = m + j
            # the string the token continues and the token itself
            c = tree.count(full[base + j - length : base + j + 1])
            if c < 1 or not cond > 0:
                raise RuntimeError(
                    f"draft token {j} (match {m}) not found in its {source} tree: "
                    "the mirror of the drafter's trees is out of step"
                )
            total = max(c, round(c / cond))
            self.cells.add(source, conf_bin(length), conf_bin(total), c / total, j < a)
            self.verified += 1
            self.accepted += j < a

    def close(self) -> None:
        self.spec.close()
        if self.local is not None:
            self.local.close()
            self.local = None


def evidence_trace(trace: TraceData, cfg: ReplayConfig) -> dict[str, Any]:
    """Replay ``trace`` and report its acceptance evidence (see the module docstring)."""
    col = _Collector(cfg)
    t0 = time.perf_counter()
    try:
        col.run(trace)
    finally:
        col.close()
    cells = col.cells.rows()
    return {
        "name": trace.name,
        "workload": trace.workload,
        "sessions": trace.sessions,
        "requests": len(trace.requests),
        "response_tokens": col.tokens,
        "steps": col.steps,
        "drafts": col.drafts,
        "verified_tokens": col.verified,
        "accepted_tokens": col.accepted,
        "cells": cells,
        **summarize(cells),
        "wall_s": time.perf_counter() - t0,
    }


# --------------------------------------------------------------------------
# summaries


def _certain(rows: Iterable[Mapping[str, Any]]) -> list[tuple[int, int, float, float]]:
    """``(l_bin, t_bin, tokens, accepted)`` of the conditional-probability-1 tokens."""
    acc: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        if r["cond_bucket"] != COND_BUCKETS[0][0]:
            continue
        cell = acc.setdefault((r["l_bin"], r["t_bin"]), [0.0, 0.0])
        cell[0] += r["tokens"]
        cell[1] += r["accepted"]
    return [(lb, tb, n, k) for (lb, tb), (n, k) in sorted(acc.items())]


def _saturated_loss(cells: Sequence[tuple[int, int, float, float]]) -> float | None:
    """Log loss per token of each cell's own rate (no model can do better on these cells)."""
    total = sum(n for _, _, n, _ in cells)
    loss = 0.0
    for _, _, n, k in cells:
        for part in (k, n - k):
            if part > 0:
                loss -= part * math.log(part / n)
    return loss / total if total else None


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The tables and fits of a list of cell rows (as `evidence_trace` returns them)."""
    certain = _certain(rows)
    fits: dict[str, Any] = {}
    default = ModelFit(
        *DEFAULT_MODEL, log_loss(certain, *DEFAULT_MODEL), float(sum(c[2] for c in certain))
    )
    fitted = fit_confidence(certain) if certain else None
    fits["default"] = vars(default)
    fits["fitted"] = None if fitted is None else vars(fitted)
    fits["per_cell_log_loss"] = _saturated_loss(certain)
    models = {"default": default} | ({} if fitted is None else {"fitted": fitted})
    buckets = []
    for label, _ in COND_BUCKETS:
        sel = [r for r in rows if r["cond_bucket"] == label]
        n = sum(r["tokens"] for r in sel)
        k = sum(r["accepted"] for r in sel)
        row: dict[str, Any] = {
            "bucket": label,
            "tokens": n,
            "mean_cond": sum(r["cond_sum"] for r in sel) / n if n else None,
            "observed": k / n if n else None,
        }
        for name, mf in models.items():
            pred = sum(
                r["cond_sum"]
                * _model_p(mf.scale, mf.length_exp, mf.count_exp, r["l_bin"], r["t_bin"])
                for r in sel
            )
            row[f"predicted_{name}"] = pred / n if n else None
        buckets.append(row)
    sources: dict[str, list[int]] = {}
    for r in rows:
        s = sources.setdefault(r["source"], [0, 0])
        s[0] += r["tokens"]
        s[1] += r["accepted"]
    return {
        "table": [
            {"l_bin": lb, "t_bin": tb, "tokens": int(n), "accepted": int(k), "rate": k / n}
            for lb, tb, n, k in certain
        ],
        "cond_buckets": buckets,
        "sources": {
            s: {"tokens": n, "accepted": k, "rate": k / n} for s, (n, k) in sorted(sources.items())
        },
        "fits": fits,
    }


def _pooled(traces: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every trace's cells added up, with their summary."""
    acc: dict[tuple[str, int, int, str], list[float]] = {}
    for t in traces:
        for r in t["cells"]:
            cell = acc.setdefault(
                (r["source"], r["l_bin"], r["t_bin"], r["cond_bucket"]), [0, 0, 0.0]
            )
            cell[0] += r["tokens"]
            cell[1] += r["accepted"]
            cell[2] += r["cond_sum"]
    cells = [
        {
            "source": s,
            "l_bin": lb,
            "t_bin": tb,
            "cond_bucket": cb,
            "tokens": int(v[0]),
            "accepted": int(v[1]),
            "cond_sum": v[2],
        }
        for (s, lb, tb, cb), v in sorted(acc.items())
    ]
    return {
        "name": "pooled",
        "traces": [t["name"] for t in traces],
        "verified_tokens": sum(t["verified_tokens"] for t in traces),
        "accepted_tokens": sum(t["accepted_tokens"] for t in traces),
        "cells": cells,
        **summarize(cells),
    }


# --------------------------------------------------------------------------
# report


def _f(v: float | None, nd: int = 3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _n(v: float) -> str:
    """A token count in at most 5 characters."""
    v = int(v)
    if v < 10_000:
        return str(v)
    if v < 1_000_000:
        return f"{v / 1000:.0f}k"
    return f"{v / 1e6:.1f}M"


def _section(t: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    table = {(c["l_bin"], c["t_bin"]): c for c in t["table"]}
    lbs = sorted({lb for lb, _ in table})
    tbs = sorted({tb for _, tb in table})
    out.append(
        "  acceptance of tokens with conditional probability 1 (tokens), "
        "by matched length L (rows) and continuations T (columns):"
    )
    corner = "L \\ T"
    out.append("  " + f"{corner:>6}" + "".join(f"{_BIN_LABELS[tb]:>13}" for tb in tbs))
    for lb in lbs:
        cells = []
        for tb in tbs:
            c = table.get((lb, tb))
            cells.append(
                f"{'-':>13}" if c is None else f"{c['rate']:.2f} ({_n(c['tokens']):>5})".rjust(13)
            )
        out.append("  " + f"{_BIN_LABELS[lb]:>6}" + "".join(cells))
    out.append("  by conditional probability:")
    has_fit = t["fits"]["fitted"] is not None
    out.append(
        f"  {'cond':<11} {'tokens':>9} {'mean cond':>9} {'observed':>8} {'default':>8}"
        + (f" {'fitted':>8}" if has_fit else "")
    )
    for b in t["cond_buckets"]:
        if not b["tokens"]:
            continue
        out.append(
            f"  {b['bucket']:<11} {b['tokens']:>9,} {_f(b['mean_cond']):>9} {_f(b['observed']):>8} "
            f"{_f(b['predicted_default']):>8}"
            + (f" {_f(b['predicted_fitted']):>8}" if has_fit else "")
        )
    out.append(
        "  by source: "
        + ", ".join(
            f"{s} {v['tokens']:,} tokens, {100 * v['rate']:.1f}% accepted"
            for s, v in t["sources"].items()
        )
    )
    head = ("model (cond = 1 tokens)", "scale", "length_exp", "count_exp", "log loss")
    out.append(f"  {head[0]:<26} {head[1]:>8} {head[2]:>10} {head[3]:>9} {head[4]:>9}")
    for name in ("default", "fitted"):
        mf = t["fits"][name]
        if mf is None:
            continue
        out.append(
            f"  {name:<26} {mf['scale']:>8.3f} {mf['length_exp']:>10.3f} {mf['count_exp']:>9.3f} "
            f"{_f(mf['log_loss'], 4):>9}"
        )
    best = _f(t["fits"]["per_cell_log_loss"], 4)
    out.append(f"  {'per-cell rates (no model)':<26} {'':>29} {best:>9}")
    return out


def render_table(results: Mapping[str, Any]) -> str:
    """Per trace, then pooled: the acceptance table, the buckets, the sources and the fits."""
    out: list[str] = []
    for t in results["traces"]:
        rate = t["accepted_tokens"] / t["verified_tokens"] if t["verified_tokens"] else None
        out.append(
            f"== {t['name']}: {t['sessions']:,} sessions, {t['requests']:,} requests, "
            f"{t['steps']:,} steps, {t['verified_tokens']:,} verified draft tokens "
            f"({_f(rate)} accepted) ({t['wall_s']:.1f} s)"
        )
        out += _section(t)
        out.append("")
    pooled = results.get("pooled")
    if pooled is not None:
        out.append(
            f"== pooled over {len(pooled['traces'])} traces: "
            f"{pooled['verified_tokens']:,} verified draft tokens"
        )
        out += _section(pooled)
        out.append("")
    return "\n".join(out) + "\n"


def plot_evidence(results: Mapping[str, Any], out_dir: Path | str) -> tuple[list[Path], str | None]:
    """``<trace>-evidence.png`` per trace (and ``pooled-evidence.png``): the acceptance heat map."""
    from agentspec.bench.plots import _NO_MATPLOTLIB, _prepare, _save

    plt, out = _prepare(out_dir)
    if plt is None:
        return [], _NO_MATPLOTLIB
    written: list[Path] = []
    parts = list(results["traces"])
    if results.get("pooled") is not None:
        parts.append(results["pooled"])
    nb = _bins()
    for t in parts:
        rate = np.full((nb - 1, nb - 1), np.nan)
        count = np.zeros((nb - 1, nb - 1), dtype=np.int64)
        for c in t["table"]:
            if c["l_bin"] >= 1 and c["t_bin"] >= 1:
                rate[c["l_bin"] - 1, c["t_bin"] - 1] = c["rate"]
                count[c["l_bin"] - 1, c["t_bin"] - 1] = c["tokens"]
        fig, ax = plt.subplots(figsize=(7.0, 5.8))
        im = ax.imshow(rate, vmin=0.0, vmax=1.0, cmap="viridis", origin="lower")
        for (i, j), v in np.ndenumerate(rate):
            if not np.isnan(v):
                ax.text(
                    j,
                    i,
                    f"{v:.2f}\n{_n(count[i, j])}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if v < 0.6 else "black",
                )
        labels = list(_BIN_LABELS[1:])
        ax.set_xticks(range(nb - 1), labels)
        ax.set_yticks(range(nb - 1), labels)
        ax.set_xlabel("continuations T of the matched string")
        ax.set_ylabel("matched length L")
        fit = t["fits"]["fitted"]
        sub = (
            ""
            if fit is None
            else (
                f"\nfit: scale {fit['scale']:.2f}, L^{fit['length_exp']:.2f}, "
                f"T^{fit['count_exp']:.2f}"
            )
        )
        ax.set_title(f"{t['name']}: acceptance at conditional probability 1{sub}", fontsize=10)
        fig.colorbar(im, ax=ax, label="acceptance rate")
        written.append(_save(plt, fig, out / f"{t['name']}-evidence.png"))
    return written, None


def run(
    paths: Sequence[Path],
    *,
    cfg: ReplayConfig,
    tokenizer: Any,
    max_sessions: int | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """The evidence of each trace file, and pooled over them (see the module docstring)."""
    traces = []
    for p in paths:
        trace = load_trace(p, tokenizer, max_sessions)
        log(f"{trace.name}: {len(trace.requests)} requests")
        traces.append(evidence_trace(trace, cfg))
        log(f"{trace.name}: done in {traces[-1]['wall_s']:.1f} s")
    return {
        "config": {
            "depth": cfg.depth,
            "max_spec_tokens": cfg.max_spec_tokens,
            "alpha": EVIDENCE_ALPHA,
            "min_prob": 0.0,
        },
        "max_sessions": max_sessions,
        "cond_buckets": [label for label, _ in COND_BUCKETS],
        "traces": traces,
        "pooled": _pooled(traces) if len(traces) > 1 else None,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``bench evidence`` options to ``p``."""
    add_trace_arguments(p)
    add_common_arguments(p, budget_rule=False)


def run_cli(args: argparse.Namespace) -> int:
    """Run ``agentspec bench evidence`` from parsed arguments; return the exit status."""
    start = cli_start(args, budget_rule=False)
    cfg, tok, log = start.cfg, start.tokenizer, start.log
    results = run(args.traces, cfg=cfg, tokenizer=tok, max_sessions=args.max_sessions, log=log)
    results["command"] = getattr(args, "argv", None)
    write_outputs(results, render_table(results), args.json, args.plots, plot_evidence, log)
    return 0
