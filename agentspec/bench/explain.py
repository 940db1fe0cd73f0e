"""`agentspec bench explain`: why the copy oracle accepts more than our drafter.

Each trace is replayed as in ``agentspec bench replay`` with a drafter
(``--method``: ``confidence``, the default policy, or ``stage-shards``, the
count-only one: an `agentspec.Speculator` with stage shards, the pipeline tree
and the per-request tree, online learning) under the simulated greedy
verifier.  At every one of its verification steps the copy oracle
(`agentspec.bench.oracle`) is asked, at the same position, how many tokens it
would accept (``L``: the longest prefix of the truth seen before, at most
``max_spec_tokens``).  A step where ``L`` exceeds the tokens our draft got
accepted (``a``) is an *oracle win*; it loses ``L - a`` tokens.

Every win is put in exactly one class, checked in this order with exact
`SuffixTree.count` / `SuffixTree.draft` lookups against the trees the drafter
used (``local``: the request's own prompt and output, ``stage``: its stage
shard, ``pipeline``: the pipeline tree; the replay has no pushed or fleet
trees).  ``m`` is the length of the context suffix our draft matched, and the
*truth* is ``T``, the oracle's ``L`` tokens (capped at the tree depth: a match
of ``m`` tokens can draft at most ``depth - m``):

1. ``other-branch``: our draft went wrong at some token, but ``T`` continues
   the matched ``m``-token suffix in one of our trees; the drafter drafted a
   more frequent branch (or another tree's).  Detail: ``drafted source ->
   source holding the truth`` (the drafting tree first when it holds it).
2. ``match-too-short``: as 1, and drafting with a longer suffix (one that ``T``
   also follows) from a tree holding the truth, alone under the same params,
   would have got more accepted: a shorter, better-scoring but ambiguous
   match won.  Detail: source pair; what that draft adds is recoverable.
3. ``match-too-long``: our draft went wrong, and ``T`` follows only suffixes
   of the context shorter than ``m`` in every tree.  Detail: source pair.
4. ``stopped-early``: our draft was a prefix of the truth (possibly empty)
   but stopped before ``L``.  Detail, the limit that stopped it: ``budget``
   (``alpha * m``; "more was right" when the same tree and match, drafting
   up to ``max_spec_tokens``, would have got more accepted: the tokens it
   adds are reported as recoverable), ``depth``
   (``m`` + draft reached the tree depth),
   ``min-prob`` (the path probability fell below the minimum), or
   ``branch-end`` (the drafting tree has nothing after the draft).
5. ``prompt-only``: no suffix of the context is followed by ``T`` in any tree,
   and ``T`` occurs only in the request's own prompt and output.
6. ``unanchored``: as 5, but ``T`` occurs in a shard: the copy exists but
   after text that does not end like the context.
7. ``nowhere``: ``T`` occurs in none of our trees (evicted, or deeper than
   the trees keep).

Classes 1-3 need a wrong draft token, class 4 a draft that is all accepted,
and 5-7 no suffix match of ``T`` at all (a draft that is all accepted and
empty with a match is class 4), so each win falls in exactly one.  Reported
per trace: steps, MAT, wins and their share of our steps, and per class (and
detail) the steps, their share of the wins, and the tokens lost.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
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
    Request,
    TraceData,
    load_trace,
)
from agentspec.bench.oracle import Oracle
from agentspec.bench.verifier import accept_linear, advance

__all__ = [
    "CLASSES",
    "StepRecord",
    "add_arguments",
    "explain_trace",
    "render_table",
    "run",
    "run_cli",
]

#: Every class, in priority order, with a one-line description.
#: The drafters ``bench explain`` can explain (replay method names).
EXPLAIN_METHODS = ("confidence", "stage-shards")

CLASSES: dict[str, str] = {
    "other-branch": "the truth continues the matched suffix in a tree; another branch was drafted",
    "match-too-short": "a longer suffix the truth follows would have drafted more of it",
    "match-too-long": "the truth follows only suffixes shorter than the matched one",
    "stopped-early": "the draft was a prefix of the truth but stopped (budget/depth/min-prob/end)",
    "prompt-only": "the truth is only in the request's prompt/output, after no context suffix",
    "unanchored": "the truth is in a shard, but after no suffix of the context",
    "nowhere": "the truth is in none of our trees",
}

_LOCAL = "local"


@dataclass(frozen=True)
class StepRecord:
    """One oracle win: where it was, what each side accepted, and why."""

    request: int
    pos: int
    accepted: int
    oracle: int
    cls: str
    detail: str


@dataclass
class _ClassAcc:
    steps: int = 0
    lost: int = 0
    details: Counter[str] = field(default_factory=Counter)
    detail_lost: Counter[str] = field(default_factory=Counter)
    detail_gain: Counter[str] = field(default_factory=Counter)


@dataclass
class _StageAcc:
    steps: int = 0
    wins: Counter[str] = field(default_factory=Counter)
    lost: Counter[str] = field(default_factory=Counter)


def _longest_suffix(count: Callable[[list[int]], int], tail: list[int], cont: list[int]) -> int:
    """Largest ``p`` in ``[1, len(tail)]`` with ``count(tail[-p:] + cont) > 0`` (0: none).

    Substring counts only shrink as the string grows, so this gallops then bisects.
    """
    n = len(tail)
    if n < 1 or count(tail[-1:] + cont) == 0:
        return 0
    good, step, bad = 1, 1, n + 1
    while good < n:
        probe = min(good + step, n)
        if count(tail[-probe:] + cont) > 0:
            good = probe
            step *= 2
        else:
            bad = probe
            break
    while bad - good > 1:
        mid = (good + bad) // 2
        if count(tail[-mid:] + cont) > 0:
            good = mid
        else:
            bad = mid
    return good


class _Explainer:
    """Classifies the oracle wins of one trace replay (see the module docstring)."""

    def __init__(self, cfg: ReplayConfig, *, keep_steps: bool, method: str = "confidence") -> None:
        from agentspec import DraftParams, Speculator
        from agentspec._core.draft import CONFIDENT_ALPHA

        if method not in EXPLAIN_METHODS:
            raise ValueError(f"method must be one of {', '.join(EXPLAIN_METHODS)}, not {method!r}")
        self.cfg = cfg
        self.depth = cfg.depth
        self.k = cfg.max_spec_tokens
        if method == "confidence":
            self.alpha, self.min_prob = CONFIDENT_ALPHA, cfg.conf_min_prob
            self.params = DraftParams.confident(
                max_spec_tokens=cfg.max_spec_tokens, min_token_prob=self.min_prob
            )
        else:
            self.alpha, self.min_prob = cfg.alpha, cfg.min_prob
            self.params = DraftParams(
                max_spec_tokens=cfg.max_spec_tokens, alpha=cfg.alpha, min_token_prob=cfg.min_prob
            )
        self.spec = Speculator(cfg.depth, params=self.params)
        self.oracle = Oracle(cfg.max_spec_tokens)
        self.local: Any = None  # a SuffixTree over the request's context (= its cursor's tree)
        self._ctx: np.ndarray[Any, Any] = np.zeros(0, dtype=np.int32)
        self._pattern_params: dict[tuple[int, float, float], Any] = {}
        self.classes: dict[str, _ClassAcc] = {c: _ClassAcc() for c in CLASSES}
        self.steps_out: list[StepRecord] | None = [] if keep_steps else None
        self.steps = 0
        self.accepted = 0
        self.tokens = 0
        self.wins = 0
        self.oracle_accepted = 0
        self.stages: dict[str, _StageAcc] = {}
        self._gain = 0  # tokens the alternative draft of the last win would have added

    # --- the mirror of the per-request tree ---------------------------------

    def _start_local(self, prompt: np.ndarray[Any, Any]) -> None:
        """Index the prompt; only its new tokens when it extends the previous context."""
        self.local = mirror_prompt(self.local, self._ctx, prompt, self.depth)
        self._ctx = prompt

    def _pattern(self, p: int, *, min_prob: float | None = None, alpha: float | None = None) -> Any:
        """The draft params restricted to pattern length ``p`` (other fields overridden)."""
        key = (
            p,
            self.min_prob if min_prob is None else min_prob,
            self.alpha if alpha is None else alpha,
        )
        params = self._pattern_params.get(key)
        if params is None:
            params = self._pattern_params[key] = replace(
                self.params, min_pattern=p, max_pattern=p, min_token_prob=key[1], alpha=key[2]
            )
        return params

    def _budget(self, m: int) -> int:
        return min(self.k, math.floor(self.alpha * m + 1e-6))

    # --- replay ---------------------------------------------------------------

    def warmup(self, responses: Sequence[Request]) -> None:
        """Learn finished responses before the replay (as ``bench replay --warmup-from``)."""
        for r in responses:
            self.spec.add_response(
                r.response, stage=r.stage, pipeline=r.workload, prompt=r.prompt()
            )
            self.oracle.add_response(r.response)

    def run(self, trace: TraceData) -> None:
        spec, oracle = self.spec, self.oracle
        for i, req in enumerate(trace.requests):
            prompt = req.prompt()
            resp: list[int] = req.response.tolist()
            n = len(resp)
            spec.start_request(i, prompt, stage=req.stage, pipeline=req.workload)
            oracle.start(prompt, resp)
            self._start_local(prompt)
            ptail: list[int] = prompt[-self.depth :].tolist()
            trees = self._trees(i, req.stage, req.workload)
            st = self.stages.setdefault(req.stage, _StageAcc())
            pos = 0
            while pos < n:
                d, source = spec.draft_source(i)
                toks = d.token_ids
                a = accept_linear(toks, resp, pos)
                truth = oracle.draft(pos)
                ora = len(truth)
                self.oracle_accepted += ora
                if a < ora:
                    if pos >= self.depth:
                        tail = resp[pos - self.depth : pos]
                    else:
                        tail = ptail[max(0, len(ptail) - (self.depth - pos)) :] + resp[:pos]
                    self._gain = 0
                    cls, detail = self._classify(trees, tail, truth, toks, d.match_len, source, a)
                    self._record(i, pos, a, ora, cls, detail)
                    st.lost[cls] += ora - a
                    st.wins[cls] += 1
                step = advance(a, n - pos)
                chunk = resp[pos : pos + step]
                spec.extend(i, chunk)
                oracle.extend(chunk)
                self.local.append(LOCAL_SEQ, chunk)
                pos += step
                self.steps += 1
                st.steps += 1
                self.accepted += a
            spec.finish(i, learn=True)
            oracle.finish()
            self._ctx = np.concatenate((prompt, req.response)).astype(np.int32, copy=False)
            self.tokens += n

    def _trees(self, rid: int, stage: str, pipeline: str) -> list[tuple[str, Any]]:
        """The trees request ``rid`` drafts from, named as `Speculator.draft_source` names them."""
        req = self.spec._requests[rid]
        own = self.spec._request_trees(req)
        shard = self.spec.shard(stage=stage, pipeline=pipeline)
        named: list[tuple[str, Any]] = [(_LOCAL, self.local)]
        named += [("stage" if t is shard else "pipeline", t) for t in own]
        return named

    def _record(self, rid: int, pos: int, a: int, ora: int, cls: str, detail: str) -> None:
        acc = self.classes[cls]
        acc.steps += 1
        acc.lost += ora - a
        acc.details[detail] += 1
        acc.detail_lost[detail] += ora - a
        acc.detail_gain[detail] += self._gain
        self.wins += 1
        if self.steps_out is not None:
            self.steps_out.append(StepRecord(rid, pos, a, ora, cls, detail))

    # --- the classifier -------------------------------------------------------

    def _classify(
        self,
        trees: list[tuple[str, Any]],
        tail: list[int],
        truth: list[int],
        draft: Sequence[int],
        m: int,
        source: str,
        a: int,
    ) -> tuple[str, str]:
        """The class and detail of one oracle win (see the module docstring)."""
        depth = self.depth
        ora = len(truth)
        # R: per tree, the longest context suffix the whole truth follows.
        cap = max(0, min(len(tail), depth - ora))
        reach = [
            (name, _longest_suffix(t.count, tail[len(tail) - cap :], truth) if cap else 0)
            for name, t in trees
        ]
        best_reach = max((r for _, r in reach), default=0)
        if a < len(draft):  # our draft went wrong at token a (so m >= 1)
            need = truth[: min(ora, depth - m)]
            key = tail[len(tail) - m :] + need
            holders = [name for name, t in trees if t.count(key) > 0]
            if holders:
                holder = source if source in holders else holders[0]
                for name, r in reach:
                    if r > m and name in holders:
                        tree = dict(trees)[name]
                        for p in range(r, m, -1):
                            got = tree.draft(tail, self._pattern(p)).token_ids
                            better = accept_linear(got, truth, 0)
                            if better > a:
                                self._gain = better - a
                                return "match-too-short", f"{source} -> {name}"
                return "other-branch", f"{source} -> {holder}"
            if best_reach >= 1:
                holder = next(name for name, r in reach if r == best_reach)
                return "match-too-long", f"{source} -> {holder}"
        elif draft:  # all accepted, but shorter than the oracle's
            return "stopped-early", self._stop_reason(trees, tail, truth, draft, m, source)
        elif best_reach >= 1:  # empty, though the truth continues a suffix
            if all(self._budget(r) < 1 for _, r in reach if r >= 1):
                return "stopped-early", "budget"
            return "stopped-early", "min-prob"
        in_local = trees[0][1].count(truth) > 0
        in_shard = any(t.count(truth) > 0 for _, t in trees[1:])
        if in_shard:
            return "unanchored", "in " + ",".join(n for n, t in trees if t.count(truth) > 0)
        if in_local:
            return "prompt-only", _LOCAL
        return "nowhere", "-"

    def _stop_reason(
        self,
        trees: list[tuple[str, Any]],
        tail: list[int],
        truth: list[int],
        draft: Sequence[int],
        m: int,
        source: str,
    ) -> str:
        """Why a draft that was all accepted stopped where it did."""
        n = len(draft)
        tree = dict(trees).get(source)
        if n >= self._budget(m):
            if tree is not None:
                longer = tree.draft(tail, self._pattern(m, alpha=float(self.k))).token_ids
                more = accept_linear(longer, truth, 0)
                if more > n:
                    self._gain = more - n
                    return "budget, more was right"
            return "budget, more was wrong"
        if m + n >= self.depth:
            return "depth"
        if tree is not None:
            longer = tree.draft(tail, self._pattern(m, min_prob=0.0)).token_ids
            if len(longer) > n:
                return "min-prob"
        return "branch-end"

    def close(self) -> None:
        self.spec.close()
        self.oracle.close()
        if self.local is not None:
            self.local.close()
            self.local = None

    def summary(self) -> dict[str, Any]:
        wins, steps = self.wins, self.steps
        lost = sum(c.lost for c in self.classes.values())
        out_classes = []
        for name, c in self.classes.items():
            out_classes.append(
                {
                    "class": name,
                    "steps": c.steps,
                    "share_of_wins": c.steps / wins if wins else None,
                    "lost_tokens": c.lost,
                    "share_of_lost": c.lost / lost if lost else None,
                    "details": [
                        {
                            "detail": d,
                            "steps": s,
                            "lost_tokens": c.detail_lost[d],
                            "recoverable_tokens": c.detail_gain[d],
                        }
                        for d, s in sorted(c.details.items(), key=lambda kv: (-kv[1], kv[0]))
                    ],
                }
            )
        return {
            "steps": steps,
            "response_tokens": self.tokens,
            "accepted": self.accepted,
            "mat": self.tokens / steps if steps else None,
            "oracle_accepted_at_our_steps": self.oracle_accepted,
            "wins": wins,
            "win_share": wins / steps if steps else None,
            "lost_tokens": lost,
            "classes": out_classes,
            "per_stage": {
                stage: {
                    "steps": a.steps,
                    "wins": sum(a.wins.values()),
                    "lost_tokens": sum(a.lost.values()),
                    "classes": {c: {"steps": a.wins[c], "lost_tokens": a.lost[c]} for c in CLASSES},
                }
                for stage, a in self.stages.items()
            },
        }


def explain_trace(
    trace: TraceData,
    cfg: ReplayConfig,
    *,
    warmup: Sequence[Request] = (),
    keep_steps: bool = False,
    method: str = "confidence",
) -> dict[str, Any]:
    """Replay ``trace`` with ``method``'s drafter and classify every oracle win.

    ``warmup`` responses are learned first, by both sides, and not replayed.
    With ``keep_steps`` the result also lists every win (``"wins_list"``:
    request index, position, our accepted tokens, the oracle's, class, detail).
    """
    ex = _Explainer(cfg, keep_steps=keep_steps, method=method)
    t0 = time.perf_counter()
    try:
        ex.warmup(warmup)
        ex.run(trace)
    finally:
        ex.close()
    out: dict[str, Any] = {
        "name": trace.name,
        "workload": trace.workload,
        "sessions": trace.sessions,
        "requests": len(trace.requests),
        **ex.summary(),
        "wall_s": time.perf_counter() - t0,
    }
    if ex.steps_out is not None:
        out["wins_list"] = [vars(s) for s in ex.steps_out]
    return out


# --------------------------------------------------------------------------
# report


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def render_table(results: dict[str, Any]) -> str:
    """Per trace: the totals, then one row per class and one per detail."""
    out: list[str] = []
    method = results.get("method", "confidence")
    for t in results["traces"]:
        out.append(
            f"== {t['name']} ({method}): {t['sessions']:,} sessions, {t['requests']:,} requests, "
            f"{t['steps']:,} steps, MAT {t['mat']:.3f}; oracle wins {t['wins']:,} steps "
            f"({_pct(t['win_share'])} of steps), {t['lost_tokens']:,} tokens lost "
            f"({t['wall_s']:.1f} s)"
        )
        out.append(
            f"   accepted draft tokens: ours {t['accepted']:,}, the oracle's at the same "
            f"positions {t['oracle_accepted_at_our_steps']:,}"
        )
        head = (
            f"{'class / detail':<34} {'steps':>9} {'% wins':>7} {'lost tok':>10} {'% lost':>7}"
            f" {'recoverable':>11}"
        )
        out.append(head)
        out.append("-" * len(head))
        for c in t["classes"]:
            out.append(
                f"{c['class']:<34} {c['steps']:>9,} {_pct(c['share_of_wins']):>7} "
                f"{c['lost_tokens']:>10,} {_pct(c['share_of_lost']):>7}"
            )
            if c["class"] == "nowhere":
                continue
            for d in c["details"]:
                sw = d["steps"] / t["wins"] if t["wins"] else None
                sl = d["lost_tokens"] / t["lost_tokens"] if t["lost_tokens"] else None
                out.append(
                    f"  {d['detail']:<32} {d['steps']:>9,} {_pct(sw):>7} "
                    f"{d['lost_tokens']:>10,} {_pct(sl):>7}"
                    + (f" {d['recoverable_tokens']:>11,}" if d["recoverable_tokens"] else "")
                )
        out.append(
            "(recoverable: tokens the alternative draft, a longer budget or a longer match "
            "from the same tree, would have added at those steps)"
        )
        if len(t["per_stage"]) > 1:
            out.append("")
            out.append(_stage_table(t["per_stage"]))
        out.append("")
    return "\n".join(out)


def _stage_table(per_stage: dict[str, Any]) -> str:
    """Per stage: steps, wins, tokens lost, and each class's share of the tokens lost."""
    short = ["branch", "short", "long", "stopped", "prompt", "unanch.", "nowhere"]
    head = f"{'stage':<16} {'steps':>8} {'wins':>8} {'lost tok':>9}  " + " ".join(
        f"{h:>7}" for h in short
    )
    lines = [head, "-" * len(head)]
    for stage, a in per_stage.items():
        lost = a["lost_tokens"]
        cells = " ".join(
            f"{_pct(a['classes'][c]['lost_tokens'] / lost if lost else None):>7}" for c in CLASSES
        )
        lines.append(f"{stage:<16} {a['steps']:>8,} {a['wins']:>8,} {lost:>9,}  {cells}")
    lines.append(
        "(after 'lost tok': each class's share of the stage's tokens lost: other-branch, "
        "match-too-short, match-too-long, stopped-early, prompt-only, unanchored, nowhere)"
    )
    return "\n".join(lines)


def _no_plots(results: dict[str, Any], out_dir: Path) -> tuple[list[Path], str | None]:
    return [], "bench explain makes no plots"


def run(
    paths: Sequence[Path],
    *,
    cfg: ReplayConfig,
    tokenizer: Any,
    max_sessions: int | None = None,
    warmup_from: Path | None = None,
    method: str = "confidence",
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Explain the oracle wins of each trace file (see the module docstring)."""
    warm: tuple[Request, ...] = ()
    if warmup_from is not None:
        warm = load_trace(warmup_from, tokenizer).requests
        log(f"warm-up: {len(warm)} responses")
    traces = []
    for p in paths:
        trace = load_trace(p, tokenizer, max_sessions)
        log(f"{trace.name}: {len(trace.requests)} requests")
        traces.append(explain_trace(trace, cfg, warmup=warm, method=method))
        log(f"{trace.name}: done in {traces[-1]['wall_s']:.1f} s")
    return {
        "config": {
            "depth": cfg.depth,
            "max_spec_tokens": cfg.max_spec_tokens,
            "alpha": cfg.alpha,
            "min_prob": cfg.min_prob,
            "conf_min_prob": cfg.conf_min_prob,
        },
        "method": method,
        "max_sessions": max_sessions,
        "warmup_from": None if warmup_from is None else str(warmup_from),
        "classes": CLASSES,
        "traces": traces,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``bench explain`` options to ``p``."""
    add_trace_arguments(p, warmup=True)
    p.add_argument(
        "--method",
        choices=EXPLAIN_METHODS,
        default="confidence",
        help="the drafter explained: confidence (the default policy, cut --conf-min-prob) or "
        "stage-shards (the count-only policy, --alpha/--min-prob); default confidence",
    )
    add_common_arguments(p)


def run_cli(args: argparse.Namespace) -> int:
    """Run ``agentspec bench explain`` from parsed arguments; return the exit status."""
    start = cli_start(args, warmup=True)
    cfg, tok, log = start.cfg, start.tokenizer, start.log
    results = run(
        args.traces,
        cfg=cfg,
        tokenizer=tok,
        max_sessions=args.max_sessions,
        warmup_from=args.warmup_from,
        method=args.method,
        log=log,
    )
    results["command"] = getattr(args, "argv", None)
    write_outputs(results, render_table(results), args.json, args.plots, _no_plots, log)
    return 0
