"""What `agentspec demo` measured: call records, the identity check, per-stage numbers, outputs.

The runner (`agentspec.demo._run`) records every model call of both runs as a
`CallRecord`.  This module

- checks that the two runs produced the same outputs (`compare_runs`: every
  call's text and token ids, keyed by question, stage and request messages);
- attributes wall time to calls (`attribute_exclusive_time`): each moment of
  a question's run is charged to the call that finishes next, so stages whose
  calls overlap (the parallel SQL stages) are not counted twice; for a server
  that runs one request at a time, like the embedded engine, this is each
  call's own service time;
- sums per stage and overall (`build_report`) and renders the results as a
  text table with a legend of its columns (`format_table`), JSON
  (`DemoReport.to_json`) and a PNG chart (`write_chart`, when matplotlib is
  installed).

Speedups are ratios of measured wall times, never derived from step counts.
Each is also given over the *uncapped* calls only (those that ended on their
own rather than at ``max_tokens``): a call cut off at ``max_tokens`` is
usually a model stuck in a loop, which speculation predicts very well, so a
speedup carried by such calls says little about real answers.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentspec.bench.plots import pyplot

__all__ = [
    "ACCEPTANCE",
    "COLUMNS",
    "MAX_CAPPED_FRACTION",
    "TIME_COLUMNS",
    "CallRecord",
    "Check",
    "DemoReport",
    "Mismatch",
    "QuestionTiming",
    "StageSummary",
    "TimeSplit",
    "attribute_exclusive_time",
    "build_report",
    "compare_runs",
    "format_table",
    "time_split",
    "write_chart",
    "write_outputs",
]

OFF, ON = "off", "on"
#: Acceptance thresholds: (check name, stage or "overall", minimum).
ACCEPTANCE: tuple[tuple[str, str, float], ...] = (
    ("tokens per step, Extract (settled)", "Extract", 3.0),
    ("tokens per step, overall (settled)", "overall", 2.0),
    ("wall-clock speedup, overall", "wall", 1.0),
)
#: At most this fraction of the calls may stop at ``max_tokens`` (a check of the report).
MAX_CAPPED_FRACTION = 1 / 6
#: What each column of `format_table` means: (column, explanation).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("calls", "model calls of the stage in each run (both runs make the same calls)"),
    (
        "capped",
        "calls that stopped at max_tokens (finish_reason 'length') instead of ending "
        "their answer; their text is cut off, often a loop",
    ),
    (
        "valid",
        "well-formed outputs: Classify one question type; Extract one JSON object with "
        "exactly the 6 feature keys; Enrich a table of the schema; SQL / SQL-fix a query "
        "that passes SQLite EXPLAIN; Combine a final query that passes EXPLAIN",
    ),
    ("tokens", "completion tokens of the stage's calls (the same in each run)"),
    (
        "tok/step",
        "completion tokens per verification step (one forward pass of the model): 1.00 "
        "with speculation off by construction; 'on' is speculation on",
    ),
    (
        "q>=N",
        "tokens per step with speculation on from question N on, once the stage shards "
        "have learned from the questions before it",
    ),
    (
        "time",
        "wall time charged to the stage's calls, speculation off / on (overlapping calls "
        "counted once)",
    ),
    ("speedup", "time off / time on, measured"),
    (
        "uncapped",
        "the same speedup over the calls that ended on their own (not capped); n/a when "
        "every call was capped",
    ),
)
#: What each column of the time table of `format_table` means: (column, explanation).
TIME_COLUMNS: tuple[tuple[str, str], ...] = (
    ("steps", "verification steps (forward passes after the prefill), off / on"),
    ("prefill", "seconds in the prompts' forward passes, off / on"),
    (
        "cached",
        "share of the prompt tokens the server took from its prefix cache instead of "
        "computing them (its cache is per tenant: each run reuses only its own prompts)",
    ),
    ("verify", "seconds in the verification steps (forward pass, acceptance, KV cache)"),
    ("ms/step", "verify seconds per step in milliseconds: what a step costs, off / on"),
    ("draft", "seconds drafting with speculation on (suffix trees, goodput control)"),
    (
        "python",
        "the server's other seconds of the calls: per-step Python work (detokenizing, "
        "stop strings, learning), off / on",
    ),
    (
        "outside",
        "seconds of the calls outside the engine: HTTP, chat template, tokenizing, off / on",
    ),
)
_STAGE_ORDER = ("Classify", "Extract", "Enrich")
_LATE_STAGES = ("SQL-fix", "Combine")


@dataclass
class CallRecord:
    """One model call as seen on the wire.

    ``run`` is ``"off"`` (speculation off) or ``"on"``; ``question`` the
    question's index; ``request_key`` a digest of the request's messages
    (equal requests in both runs have equal keys).  ``steps`` / ``drafted`` /
    ``accepted`` / ``speculate`` come from the response's ``agentspec`` field
    (None when the server sent none).  ``started`` / ``ended`` are
    ``time.perf_counter()`` values; ``exclusive_s`` is set by
    `attribute_exclusive_time`.  ``prefill_s`` / ``draft_s`` / ``verify_s`` /
    ``engine_s`` are the server's own account of its time (the ``seconds`` of
    the ``agentspec`` field; None when it sent none): see `TIME_COLUMNS`;
    ``cached_tokens`` the prompt tokens it took from its prefix cache.
    ``error`` says why a call failed.  ``valid`` says whether the output is
    well formed for its stage (None: not checked; see `COLUMNS`).
    """

    run: str
    question: int
    session: str
    stage: str
    request_key: str
    text: str | None = None
    token_ids: list[int] | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    steps: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    speculate: bool | None = None
    finish_reason: str | None = None
    started: float = 0.0
    ended: float = 0.0
    error: str | None = None
    exclusive_s: float = 0.0
    valid: bool | None = None
    cached_tokens: int | None = None
    prefill_s: float | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    engine_s: float | None = None

    @property
    def capped(self) -> bool:
        """Whether the call stopped at ``max_tokens``."""
        return self.finish_reason == "length"

    @property
    def key(self) -> tuple[int, str, str]:
        """``(question, stage, request_key)``: what identifies the call across runs."""
        return (self.question, self.stage, self.request_key)


@dataclass(frozen=True)
class Mismatch:
    """A difference between the runs: ``what`` differs for ``stage`` of ``session``."""

    session: str
    stage: str
    what: str
    detail: str

    def __str__(self) -> str:
        """``session stage: what (detail)``."""
        return f"{self.session} {self.stage}: {self.what} ({self.detail})"


@dataclass(frozen=True)
class QuestionTiming:
    """One question's measured wall time in each run, and its final query per run.

    ``final_ok`` says whether the final query (of the "on" run) passes SQLite
    ``EXPLAIN`` (None: not known).
    """

    session: str
    db_id: str
    seconds_off: float
    seconds_on: float
    final_sql_off: str | None = None
    final_sql_on: str | None = None
    final_ok: bool | None = None


@dataclass(frozen=True)
class TimeSplit:
    """Where one run's wall time of some calls went, by the server's own account.

    ``prefill``, ``draft`` and ``verify`` are the server's seconds in those
    phases; ``python`` the rest of its time on the calls (per-step Python
    work); ``outside`` the calls' wall time outside the server's engine
    (HTTP, chat template, tokenizing).  ``steps`` are verification steps;
    ``prompt_tokens`` / ``cached_tokens`` the prompts' tokens and those of
    them taken from the server's prefix cache.
    """

    steps: int
    prefill: float
    draft: float
    verify: float
    python: float
    outside: float
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def ms_per_step(self) -> float | None:
        """Verification milliseconds per step."""
        return 1000.0 * self.verify / self.steps if self.steps else None


def time_split(records: Sequence[CallRecord]) -> TimeSplit | None:
    """The `TimeSplit` of ``records`` (None when a record lacks the server's seconds)."""
    recs = list(records)
    if any(r.engine_s is None or r.steps is None for r in recs):
        return None

    def total(name: str) -> float:
        return sum(getattr(r, name) or 0.0 for r in recs)

    prefill, draft, verify, engine = (
        total(f"{n}_s") for n in ("prefill", "draft", "verify", "engine")
    )
    return TimeSplit(
        steps=sum(r.steps or 0 for r in recs),
        prefill=prefill,
        draft=draft,
        verify=verify,
        python=max(0.0, engine - prefill - draft - verify),
        outside=max(0.0, total("exclusive_s") - engine),
        prompt_tokens=sum(r.prompt_tokens for r in recs),
        cached_tokens=sum(r.cached_tokens or 0 for r in recs),
    )


@dataclass(frozen=True)
class StageSummary:
    """Per-stage (or overall) sums over both runs.

    ``tokens`` are completion tokens (of the "on" run; equal to the "off"
    run's when the outputs match).  ``tokens_per_step`` is tokens over
    verification steps in the "on" run (``tokens_per_step_off``: in the "off"
    run, 1.0 for plain decoding); ``settled`` the same over the questions from
    `DemoReport.settled_from` on.  ``seconds_off`` / ``seconds_on`` are
    attributed wall times; ``speedup`` their ratio.  ``capped`` counts calls
    that stopped at ``max_tokens`` (in the "on" run); the ``*_uncapped``
    fields are the same numbers over the calls that stopped in neither run.
    ``valid`` counts well-formed outputs of the "on" run (None: not checked).
    ``time_off`` / ``time_on`` say where each run's time went (None: the
    server did not say).
    """

    stage: str
    calls: int
    tokens: int
    steps_off: int | None
    steps_on: int | None
    drafted_on: int | None
    accepted_on: int | None
    tokens_per_step: float | None
    settled_tokens_per_step: float | None
    seconds_off: float
    seconds_on: float
    speedup: float | None
    capped: int
    tokens_per_step_off: float | None = None
    valid: int | None = None
    calls_uncapped: int = 0
    tokens_per_step_uncapped: float | None = None
    seconds_off_uncapped: float = 0.0
    seconds_on_uncapped: float = 0.0
    speedup_uncapped: float | None = None
    time_off: TimeSplit | None = None
    time_on: TimeSplit | None = None


@dataclass(frozen=True)
class Check:
    """One acceptance check: ``value`` against ``minimum`` (value None: not measurable).

    With ``maximum`` set, the value must also be at most that.
    """

    name: str
    value: float | None
    minimum: float
    maximum: float | None = None

    @property
    def ok(self) -> bool:
        """Whether the value is known and above the minimum (``>=``; speedup: ``>``)."""
        if self.value is None:
            return False
        if self.maximum is not None and self.value > self.maximum:
            return False
        return self.value > self.minimum if "speedup" in self.name else self.value >= self.minimum

    def wanted(self) -> str:
        """The condition, as text (``>= 3``, ``<= 0.167``)."""
        if self.maximum is not None:
            return f"<= {self.maximum:.3g}"
        return f"{'>' if 'speedup' in self.name else '>='} {self.minimum:g}"


@dataclass
class DemoReport:
    """Everything `agentspec demo` reports; `to_json` is what ``report.json`` holds."""

    model: str
    server: str
    source: str
    questions: list[QuestionTiming]
    stages: list[StageSummary]
    overall: StageSummary
    wall_off: float
    wall_on: float
    settled_from: int
    per_question_tokens_per_step: list[float | None]
    per_question_extract_tokens_per_step: list[float | None]
    mismatches: list[Mismatch] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        """Measured wall time off over on, for the whole run."""
        return self.wall_off / self.wall_on if self.wall_on > 0 else None

    @property
    def median_question_speedup(self) -> float | None:
        """The median over questions of their measured off / on wall times.

        Less sensitive than `speedup` to a burst of load from other processes
        during one question of one run.
        """
        ratios = sorted(q.seconds_off / q.seconds_on for q in self.questions if q.seconds_on > 0)
        if not ratios:
            return None
        mid = len(ratios) // 2
        return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2

    @property
    def identical(self) -> bool:
        """Whether both runs produced the same outputs (and nothing failed)."""
        return not self.mismatches and not self.errors

    def stage(self, name: str) -> StageSummary | None:
        """The summary of stage ``name``, or None when it made no calls."""
        return next((s for s in self.stages if s.stage == name), None)

    @property
    def sql_explain(self) -> tuple[int, int]:
        """``(passed, checked)``: SQL stage and SQL-fix queries that pass ``EXPLAIN``."""
        rows = [s for s in self.stages if s.stage.startswith("SQL") and s.valid is not None]
        return sum(s.valid or 0 for s in rows), sum(s.calls for s in rows)

    @property
    def final_explain(self) -> tuple[int, int]:
        """``(passed, checked)``: final queries that pass ``EXPLAIN``."""
        known = [q.final_ok for q in self.questions if q.final_ok is not None]
        return sum(known), len(known)

    def checks(self) -> list[Check]:
        """The acceptance checks of `ACCEPTANCE` on these numbers, and the output checks.

        The output checks: at most `MAX_CAPPED_FRACTION` of the calls stop at
        ``max_tokens``, and every Extract output is JSON with the feature keys
        (when the outputs were checked).
        """
        out: list[Check] = []
        for name, where, minimum in ACCEPTANCE:
            if where == "wall":
                value = self.speedup
            elif where == "overall":
                value = self.overall.settled_tokens_per_step
            else:
                row = self.stage(where)
                value = row.settled_tokens_per_step if row is not None else None
            out.append(Check(name, value, minimum))
        out.append(
            Check(
                "calls stopped at max_tokens, fraction",
                _ratio(self.overall.capped, self.overall.calls),
                0.0,
                MAX_CAPPED_FRACTION,
            )
        )
        extract = self.stage("Extract")
        if extract is not None and extract.valid is not None:
            out.append(
                Check(
                    "Extract outputs that are JSON with the feature keys, fraction",
                    _ratio(extract.valid, extract.calls),
                    1.0,
                )
            )
        return out

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON data."""
        return {
            "model": self.model,
            "server": self.server,
            "source": self.source,
            "settings": self.settings,
            "identical": self.identical,
            "mismatches": [asdict(m) for m in self.mismatches],
            "errors": list(self.errors),
            "warnings": list(self.warnings),
            "wall_seconds": {OFF: self.wall_off, ON: self.wall_on},
            "speedup": self.speedup,
            "speedup_uncapped": self.overall.speedup_uncapped,
            "median_question_speedup": self.median_question_speedup,
            "columns": dict(COLUMNS),
            "sql_explain": dict(zip(("passed", "checked"), self.sql_explain, strict=True)),
            "final_explain": dict(zip(("passed", "checked"), self.final_explain, strict=True)),
            "settled_from_question": self.settled_from,
            "stages": [asdict(s) for s in self.stages],
            "overall": asdict(self.overall),
            "per_question": [
                {
                    **asdict(q),
                    "tokens_per_step": tps,
                    "extract_tokens_per_step": ext,
                }
                for q, tps, ext in zip(
                    self.questions,
                    self.per_question_tokens_per_step,
                    self.per_question_extract_tokens_per_step,
                    strict=True,
                )
            ],
            "checks": [{**asdict(c), "ok": c.ok} for c in self.checks()],
        }


# --- comparing and timing ------------------------------------------------------------------


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _snippet(text: str | None, at: int) -> str:
    if text is None:
        return "None"
    return repr(text[max(0, at - 20) : at + 30])


def compare_runs(
    off: Iterable[CallRecord],
    on: Iterable[CallRecord],
    timings: Sequence[QuestionTiming] = (),
) -> list[Mismatch]:
    """Every difference between the runs' calls (and final queries), in question order.

    Calls are matched by `CallRecord.key`; a call made in one run only is a
    mismatch (an earlier output differed, so a later request did too), as is
    a different text or different token ids.  Token ids are compared when
    both calls have them.
    """
    off_by = {r.key: r for r in off}
    on_by = {r.key: r for r in on}
    out: list[Mismatch] = []
    for key in sorted(off_by.keys() | on_by.keys()):
        a, b = off_by.get(key), on_by.get(key)
        if a is None or b is None:
            rec = a or b
            assert rec is not None
            run = OFF if a is not None else ON
            out.append(
                Mismatch(rec.session, rec.stage, f"request made only in the '{run}' run", key[2])
            )
            continue
        if a.text != b.text:
            at = _first_difference(a.text or "", b.text or "")
            out.append(
                Mismatch(
                    a.session,
                    a.stage,
                    "output text differs",
                    f"at char {at}: off {_snippet(a.text, at)} vs on {_snippet(b.text, at)}",
                )
            )
        elif a.token_ids is not None and b.token_ids is not None and a.token_ids != b.token_ids:
            at = _first_difference(a.token_ids, b.token_ids)
            out.append(
                Mismatch(
                    a.session,
                    a.stage,
                    "token ids differ",
                    f"at token {at}: off {a.token_ids[at : at + 5]} "
                    f"vs on {b.token_ids[at : at + 5]}",
                )
            )
    for q in timings:
        if q.final_sql_off != q.final_sql_on:
            out.append(
                Mismatch(
                    q.session,
                    "final",
                    "final query differs",
                    f"{q.final_sql_off!r} vs {q.final_sql_on!r}",
                )
            )
    return out


def attribute_exclusive_time(records: Iterable[CallRecord]) -> None:
    """Set each record's ``exclusive_s``: the wall time charged to it (in place).

    Within one run and question, calls are taken in the order they ended;
    a call gets the time from the later of its start and the previous end
    to its own end.  Overlapping calls are so never counted twice, and for
    a server that serves one request at a time the result is each call's
    service time (plus its HTTP round trip).
    """
    groups: dict[tuple[str, int], list[CallRecord]] = {}
    for rec in records:
        groups.setdefault((rec.run, rec.question), []).append(rec)
    for group in groups.values():
        group.sort(key=lambda r: r.ended)
        last = float("-inf")
        for rec in group:
            rec.exclusive_s = max(0.0, rec.ended - max(rec.started, last))
            last = max(last, rec.ended)


# --- summing -------------------------------------------------------------------------------


def _stage_order(stages: Iterable[str]) -> list[str]:
    def rank(stage: str) -> tuple[int, int, str]:
        if stage in _STAGE_ORDER:
            return (_STAGE_ORDER.index(stage), 0, stage)
        if stage in _LATE_STAGES:
            return (len(_STAGE_ORDER) + 1 + _LATE_STAGES.index(stage), 0, stage)
        digits = stage[3:] if stage.startswith("SQL") else ""
        if digits.isdigit():
            return (len(_STAGE_ORDER), int(digits), stage)
        return (len(_STAGE_ORDER) + 1 + len(_LATE_STAGES), 0, stage)

    return sorted(set(stages), key=rank)


def _sum_known(values: Iterable[int | None]) -> int | None:
    vals = list(values)
    if not vals or any(v is None for v in vals):
        return None
    return sum(v for v in vals if v is not None)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _summary(
    name: str, off: Sequence[CallRecord], on: Sequence[CallRecord], settled_from: int
) -> StageSummary:
    tokens = sum(r.completion_tokens for r in on)
    steps_on = _sum_known(r.steps for r in on)
    steps_off = _sum_known(r.steps for r in off)
    settled = [r for r in on if r.question >= settled_from]
    settled_steps = _sum_known(r.steps for r in settled)
    seconds_off = sum(r.exclusive_s for r in off)
    seconds_on = sum(r.exclusive_s for r in on)
    off_by = {r.key: r for r in off}
    pairs = [
        (a, b) for b in on if not b.capped and (a := off_by.get(b.key)) is not None and not a.capped
    ]
    free_off = sum(a.exclusive_s for a, _ in pairs)
    free_on = sum(b.exclusive_s for _, b in pairs)
    checked = [r.valid for r in on if r.valid is not None]
    return StageSummary(
        stage=name,
        calls=len(on),
        tokens=tokens,
        steps_off=steps_off,
        steps_on=steps_on,
        drafted_on=_sum_known(r.drafted for r in on),
        accepted_on=_sum_known(r.accepted for r in on),
        tokens_per_step=_ratio(tokens, steps_on),
        settled_tokens_per_step=_ratio(sum(r.completion_tokens for r in settled), settled_steps),
        seconds_off=seconds_off,
        seconds_on=seconds_on,
        speedup=_ratio(seconds_off, seconds_on),
        capped=sum(r.capped for r in on),
        tokens_per_step_off=_ratio(sum(r.completion_tokens for r in off), steps_off),
        valid=sum(checked) if checked else None,
        calls_uncapped=len(pairs),
        tokens_per_step_uncapped=_ratio(
            sum(b.completion_tokens for _, b in pairs), _sum_known(b.steps for _, b in pairs)
        ),
        seconds_off_uncapped=free_off,
        seconds_on_uncapped=free_on,
        speedup_uncapped=_ratio(free_off, free_on),
        time_off=time_split(off),
        time_on=time_split(on),
    )


def _per_question(on: Sequence[CallRecord], n: int, stage: str | None) -> list[float | None]:
    out: list[float | None] = []
    for i in range(n):
        recs = [r for r in on if r.question == i and (stage is None or r.stage == stage)]
        out.append(
            _ratio(sum(r.completion_tokens for r in recs), _sum_known(r.steps for r in recs))
        )
    return out


def build_report(
    off: Sequence[CallRecord],
    on: Sequence[CallRecord],
    timings: Sequence[QuestionTiming],
    *,
    model: str,
    server: str,
    source: str,
    settled_from: int = 2,
    settings: Mapping[str, Any] | None = None,
) -> DemoReport:
    """Compare the runs, attribute wall time and sum per stage and overall.

    ``timings`` are the questions' measured wall times (their sums are the
    overall wall times); ``settled_from`` is the first question counted in
    the "settled" tokens per step (the shards learn during the first ones).
    """
    attribute_exclusive_time([*off, *on])
    mismatches = compare_runs(off, on, timings)
    errors = [f"{r.run} run, {r.session} {r.stage}: {r.error}" for r in (*off, *on) if r.error]
    warnings: list[str] = []
    if any(r.steps is None for r in on):
        warnings.append(
            "the server sent no 'agentspec' step counts for some calls: tokens per step unknown"
        )
    wrong_off = [r for r in off if r.speculate is True]
    wrong_on = [r for r in on if r.speculate is False]
    if wrong_off:
        errors.append(
            f"the server drafted in {len(wrong_off)} call(s) of the 'off' run: it ignores "
            "vllm_xargs.agentspec_speculate=false, so the baseline is not plain decoding"
        )
    if wrong_on:
        warnings.append(
            f"the server did not draft in {len(wrong_on)} call(s) of the 'on' run "
            "(speculation disabled on the server?)"
        )
    stages = [
        _summary(
            stage,
            [r for r in off if r.stage == stage],
            [r for r in on if r.stage == stage],
            settled_from,
        )
        for stage in _stage_order(r.stage for r in (*off, *on))
    ]
    n = len(timings)
    return DemoReport(
        model=model,
        server=server,
        source=source,
        questions=list(timings),
        stages=stages,
        overall=_summary("overall", off, on, settled_from),
        wall_off=sum(q.seconds_off for q in timings),
        wall_on=sum(q.seconds_on for q in timings),
        settled_from=settled_from,
        per_question_tokens_per_step=_per_question(on, n, None),
        per_question_extract_tokens_per_step=_per_question(on, n, "Extract"),
        mismatches=mismatches,
        errors=errors,
        warnings=warnings,
        settings=dict(settings or {}),
    )


# --- rendering -----------------------------------------------------------------------------


def _f(value: float | None, fmt: str = ".2f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _i(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _valid(s: StageSummary) -> str:
    return "-" if s.valid is None else f"{s.valid}/{s.calls}"


def _legend(settled_from: int) -> list[str]:
    width = max(len(name) for name, _ in COLUMNS)
    lines = ["columns:"]
    for name, text in COLUMNS:
        shown = name
        if name == "q>=N":
            shown = f"q>={settled_from + 1}"
            text = text.replace("question N", f"question {settled_from + 1}")
        lines.extend(
            textwrap.wrap(
                text,
                width=96,
                initial_indent=f"  {shown:<{width}}  ",
                subsequent_indent=" " * (width + 4),
            )
        )
    return lines


def format_table(report: DemoReport) -> str:
    """The per-stage table, the overall lines, the output counts, the checks and a legend."""
    settled = f"q>={report.settled_from + 1}"
    head = (
        f"{'stage':<10} {'calls':>5} {'capped':>6} {'valid':>6} {'tokens':>6} "
        f"{'tok/step':>8} {'tok/step':>8} {settled:>6} {'time':>7} {'time':>7} "
        f"{'speedup':>7} {'uncapped':>8}"
    )
    head2 = (
        f"{'':<10} {'':>5} {'':>6} {'':>6} {'':>6} {'off':>8} {'on':>8} {'on':>6} "
        f"{'off':>7} {'on':>7} {'':>7} {'speedup':>8}"
    )
    lines = [head, head2, "-" * len(head)]

    def row(s: StageSummary) -> str:
        return (
            f"{s.stage:<10} {s.calls:>5} {s.capped:>6} {_valid(s):>6} {s.tokens:>6} "
            f"{_f(s.tokens_per_step_off):>8} {_f(s.tokens_per_step):>8} "
            f"{_f(s.settled_tokens_per_step):>6} {s.seconds_off:>6.1f}s {s.seconds_on:>6.1f}s "
            f"{_x(s.speedup):>7} {_x(s.speedup_uncapped):>8}"
        )

    lines.extend(row(s) for s in report.stages)
    lines.append("-" * len(head))
    lines.append(row(report.overall))
    o = report.overall
    lines.append(
        f"wall clock: {report.wall_off:.1f}s off, {report.wall_on:.1f}s on "
        f"-> {_f(report.speedup)}x measured speedup over {len(report.questions)} questions "
        f"(median per question {_f(report.median_question_speedup)}x); "
        f"model calls only: {_f(o.speedup)}x, on the {o.calls_uncapped} uncapped calls "
        f"{_f(o.speedup_uncapped)}x"
    )
    lines.append(
        "  stage times: the wall time charged to each stage's calls (overlapping calls "
        "counted once); the rest of the wall clock is client-side work"
    )
    extract = report.stage("Extract")
    parts = [f"calls stopped at max_tokens: {o.capped} of {o.calls}"]
    if extract is not None and extract.valid is not None:
        parts.append(f"Extract outputs that are JSON with the feature keys: {_valid(extract)}")
    passed, checked = report.sql_explain
    if checked:
        parts.append(f"SQL / SQL-fix queries passing EXPLAIN: {passed}/{checked}")
    passed, checked = report.final_explain
    if checked:
        parts.append(f"final queries passing EXPLAIN: {passed}/{checked}")
    lines.append("outputs: " + "; ".join(parts))
    for check in report.checks():
        state = "ok" if check.ok else "MISSED"
        lines.append(f"  [{state}] {check.name}: {_f(check.value)} (wanted {check.wanted()})")
    lines.extend(_time_table(report))
    lines.extend(_legend(report.settled_from))
    return "\n".join(lines)


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "n/a"


def _time_table(report: DemoReport) -> list[str]:
    """Where the time went per stage, off / on (nothing when the server did not say)."""
    rows = [*report.stages, report.overall]
    if any(s.time_off is None or s.time_on is None for s in rows):
        return []
    names = ("steps", "prefill", "cached", "verify", "ms/step")
    head = f"{'stage':<10} " + " ".join(f"{n:>15}" for n in names)
    head += f" {'draft':>6} {'python':>11} {'outside':>11}"
    head2 = f"{'':<10} " + " ".join(f"{'off':>7} {'on':>7}" for _ in names)
    head2 += f" {'on':>6} {'off':>5} {'on':>5} {'off':>5} {'on':>5}"
    lines = ["", "where the time went (seconds, as the server measured them):", head, head2]
    lines.append("-" * len(head))

    def row(s: StageSummary) -> str:
        a, b = s.time_off, s.time_on
        assert a is not None
        assert b is not None
        cached_off, cached_on = (_pct(t.cached_tokens, t.prompt_tokens) for t in (a, b))
        return (
            f"{s.stage:<10} {a.steps:>7} {b.steps:>7} {a.prefill:>6.1f}s {b.prefill:>6.1f}s "
            f"{cached_off:>7} {cached_on:>7} "
            f"{a.verify:>6.1f}s {b.verify:>6.1f}s {_f(a.ms_per_step, '.1f'):>7} "
            f"{_f(b.ms_per_step, '.1f'):>7} {b.draft:>5.2f}s {a.python:>4.1f}s {b.python:>4.1f}s "
            f"{a.outside:>4.1f}s {b.outside:>4.1f}s"
        )

    lines.extend(row(s) for s in report.stages)
    lines.append("-" * len(head))
    lines.append(row(report.overall))
    gap = _gap_text(report.overall)
    if gap:
        lines.extend(textwrap.wrap(gap, width=100, initial_indent="", subsequent_indent="  "))
    width = max(len(name) for name, _ in TIME_COLUMNS)
    for name, text in TIME_COLUMNS:
        lines.extend(
            textwrap.wrap(
                text,
                width=96,
                initial_indent=f"  {name:<{width}}  ",
                subsequent_indent=" " * (width + 4),
            )
        )
    return lines


def _gap_text(s: StageSummary) -> str:
    """From tokens per step to the wall-clock speedup, in one sentence: what a step
    cost with speculation on against off, what the verification steps saved, and
    the share of the engine's time that speculation cannot shorten (prefill)."""
    a, b = s.time_off, s.time_on
    if a is None or b is None or s.tokens_per_step is None:
        return ""
    ms_off, ms_on = a.ms_per_step, b.ms_per_step
    if ms_off is None or ms_on is None or not b.verify or not a.verify:
        return ""
    engine_on = b.prefill + b.draft + b.verify + b.python
    engine_off = a.prefill + a.draft + a.verify + a.python
    if engine_on <= 0 or engine_off <= 0:
        return ""
    return (
        f"from tokens per step to wall clock: {s.tokens_per_step:.2f} tokens per step; a step "
        f"cost {ms_on / ms_off:.2f}x a plain one ({ms_on:.1f} against {ms_off:.1f} ms), so "
        f"the verification steps took {a.verify / b.verify:.2f}x less time "
        f"({a.verify:.1f} s -> {b.verify:.1f} s); drafting took {b.draft:.2f} s; prefill "
        f"({a.prefill:.1f} s off, {b.prefill:.1f} s on) is "
        f"{100.0 * b.prefill / engine_on:.0f}% of the engine's time with speculation on, "
        f"which leaves {engine_off / engine_on:.2f}x for the engine as a whole"
    )


def _label_bars(
    ax: Any, bars: Any, values: Sequence[float | None], fmt: str, rotation: float = 0.0
) -> None:
    labels = ["n/a" if v is None else format(v, fmt) for v in values]
    ax.bar_label(bars, labels=labels, fontsize=7, rotation=rotation, padding=2)


def _server_kind(server: str) -> str:
    return "the embedded CPU engine" if server.startswith("embedded engine") else "a server"


def write_chart(report: DemoReport, path: str | Path) -> Path | None:
    """Write the PNG chart (tokens per step, speedup per stage, learning curve).

    Every bar carries its value; the title names the model and the questions,
    not the server's (throwaway) address.  Returns the path, or None when
    matplotlib is not installed.
    """
    plt = pyplot()
    if plt is None:
        return None
    rows = [*report.stages, report.overall]
    names = [s.stage for s in rows]
    xs = list(range(len(rows)))
    fig, axes = plt.subplots(1, 3, figsize=(16.0, 4.8))
    try:
        ax = axes[0]
        tps = [s.tokens_per_step for s in rows]
        bars = ax.bar(
            xs, [v or 0.0 for v in tps], color=["tab:blue"] * (len(rows) - 1) + ["tab:gray"]
        )
        _label_bars(ax, bars, tps, ".2f")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="speculation off")
        ax.set_xticks(xs, names, rotation=45, ha="right")
        ax.set_xlabel("stage")
        ax.set_ylabel("tokens per verification step")
        ax.set_title("tokens per step, speculation on")
        ax.legend(loc="upper right", fontsize=8)
        ax.margins(y=0.3)

        ax = axes[1]
        width = 0.4
        all_calls = [s.speedup for s in rows]
        uncapped = [s.speedup_uncapped for s in rows]
        bars = ax.bar(
            [x - width / 2 for x in xs],
            [v or 0.0 for v in all_calls],
            width,
            color="tab:green",
            label="all calls",
        )
        _label_bars(ax, bars, all_calls, ".2f", rotation=90)
        bars = ax.bar(
            [x + width / 2 for x in xs],
            [v or 0.0 for v in uncapped],
            width,
            color="tab:olive",
            label="uncapped calls",
        )
        _label_bars(ax, bars, uncapped, ".2f", rotation=90)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(xs, names, rotation=45, ha="right")
        ax.set_xlabel("stage")
        ax.set_ylabel("time off / time on")
        ax.set_title("measured speedup of the model calls")
        ax.legend(loc="upper right", fontsize=8)
        ax.margins(y=0.3)

        ax = axes[2]
        qs = list(range(1, len(report.questions) + 1))
        for label, values in (
            ("all stages", report.per_question_tokens_per_step),
            ("Extract", report.per_question_extract_tokens_per_step),
        ):
            ax.plot(qs, [v if v is not None else float("nan") for v in values], "o-", label=label)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(qs)
        ax.set_xlabel("question (in run order)")
        ax.set_ylabel("tokens per verification step")
        ax.set_title("speculation on: as the stage shards learn")
        ax.legend(fontsize=8)

        o = report.overall
        fig.suptitle(
            f"agentspec demo: {report.model} on {_server_kind(report.server)}, "
            f"{len(report.questions)} questions, outputs "
            f"{'identical' if report.identical else 'NOT identical'} with speculation on/off; "
            f"{o.capped} of {o.calls} calls capped at max_tokens"
        )
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def write_outputs(
    report: DemoReport,
    out_dir: str | Path,
    records: Sequence[CallRecord] = (),
    *,
    chart: bool = True,
) -> dict[str, Path]:
    """Write ``report.json``, ``calls.jsonl`` (the ``records``) and ``chart.png`` to ``out_dir``.

    The chart is skipped when ``chart`` is False or matplotlib is missing.
    Returns what was written by kind (``json``, ``calls``, ``chart``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    path = out / "report.json"
    path.write_text(json.dumps(report.to_json(), indent=1) + "\n", encoding="utf-8")
    written["json"] = path
    if records:
        calls = out / "calls.jsonl"
        with calls.open("w", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(asdict(rec)) + "\n")
        written["calls"] = calls
    png = write_chart(report, out / "chart.png") if chart else None
    if png is not None:
        written["chart"] = png
    return written
