"""The multi-stage text-to-SQL agent: stages, orchestration and per-question results.

One question is one session (``client.session(<question id>,
pipeline="text2sql")``); every model call is tagged with its stage through
`agentspec.stage`::

    Classify -> Extract -> Enrich -> SQL1 | SQL2 | SQL3 (parallel) -> Combine
                                       \\-> SQL-fix (once, when EXPLAIN fails)

- **Classify**: one word of `QUESTION_TYPES`.
- **Extract**: a JSON object with the fixed `FEATURE_KEYS`.
- **Enrich**: the tables / columns needed, which become a compact schema subset.
- **SQL1..SQLn**: one query each, with different prompting strategies
  (`SQL_STRATEGIES`: zero-shot, clause by clause, few-shot from questions this
  run already answered, decomposition), run on a thread pool.  Each query is
  compiled with SQLite ``EXPLAIN`` against a database built from the
  schema; a failing (or missing) query is sent back once, as a follow-up turn
  of that stage's conversation, under the stage **SQL-fix**.
- **Combine**: picks or merges the candidates, answering ``SQL:`` /
  ``ANSWER:``; its query is checked too, and a failing one is replaced by
  the most common candidate that passed.

Calls use greedy decoding (``temperature=0``) and a per-stage ``max_tokens``.
Model output is parsed leniently; what cannot be read is recorded
(`StageRecord.parse_failure`) and a fallback used, and a failed request
(`openai.APIError`) is recorded (`StageRecord.error`) without stopping the
question.  Only `AgentSpecClient` is used, so the pipeline runs on any
OpenAI-compatible server.
"""

from __future__ import annotations

import contextvars
import re
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from time import monotonic
from types import MappingProxyType, TracebackType
from typing import Any

import openai

import agentspec
from agentspec import AgentSpecClient

from .prompts import (
    DEFAULT_PROMPTS,
    FEATURE_KEYS,
    QUESTION_TYPES,
    SQL_STRATEGIES,
    Message,
    PromptSet,
    extract_sql,
    parse_combine,
    parse_features,
    parse_question_type,
    parse_schema_selection,
)
from .spider import ExplainResult, SchemaDatabase, SpiderQuestion

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "FEATURE_KEYS",
    "PIPELINE",
    "QUESTION_TYPES",
    "STAGE_CLASSIFY",
    "STAGE_COMBINE",
    "STAGE_ENRICH",
    "STAGE_EXTRACT",
    "STAGE_FIX",
    "Candidate",
    "PipelineConfig",
    "QuestionResult",
    "StageRecord",
    "Text2SQLPipeline",
    "sql_stage",
]

#: The pipeline tag of every call.
PIPELINE = "text2sql"
#: Stage names (the SQL stages are ``sql_stage(1)`` = ``"SQL1"``, ...).
STAGE_CLASSIFY = "Classify"
STAGE_EXTRACT = "Extract"
STAGE_ENRICH = "Enrich"
STAGE_FIX = "SQL-fix"
STAGE_COMBINE = "Combine"
_SQL = "SQL"  # the max_tokens key shared by the SQL stages

#: ``max_tokens`` per stage; ``"SQL"`` covers SQL1..SQLn.
DEFAULT_MAX_TOKENS: Mapping[str, int] = MappingProxyType(
    {
        STAGE_CLASSIFY: 8,
        STAGE_EXTRACT: 256,
        STAGE_ENRICH: 192,
        _SQL: 384,
        STAGE_FIX: 384,
        STAGE_COMBINE: 256,
    }
)

_SPACES = re.compile(r"\s+")
# Reasoning blocks some models emit before the answer (a cut-off one runs to the end).
_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)


def sql_stage(index: int) -> str:
    """The stage name of the ``index``-th (1-based) parallel SQL stage."""
    return f"{_SQL}{index}"


@dataclass(frozen=True)
class PipelineConfig:
    """How the pipeline calls the model.

    ``n_sql`` parallel SQL stages (1..len(SQL_STRATEGIES)), ``max_tokens`` per
    stage (missing stages take `DEFAULT_MAX_TOKENS`), ``few_shot`` examples
    at most for the few-shot strategy, ``fix``: send failing queries back
    once (SQL-fix), ``extra_body``: extra request fields for every call (for
    example ``{"chat_template_kwargs": {"enable_thinking": False}}`` on vLLM),
    ``prompts``: the prompt builders (`PromptSet`), ``stop``: stop strings
    per stage (keys as ``max_tokens``; none by default).
    """

    model: str
    n_sql: int = 3
    max_tokens: Mapping[str, int] = field(default_factory=dict)
    few_shot: int = 3
    fix: bool = True
    pipeline: str = PIPELINE
    extra_body: Mapping[str, Any] | None = None
    prompts: PromptSet = DEFAULT_PROMPTS
    stop: Mapping[str, Sequence[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Check the values; merge ``max_tokens`` over the defaults."""
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty str")
        if not 1 <= self.n_sql <= len(SQL_STRATEGIES):
            raise ValueError(f"n_sql must be in 1..{len(SQL_STRATEGIES)}, got {self.n_sql}")
        if self.few_shot < 0:
            raise ValueError(f"few_shot must be >= 0, got {self.few_shot}")
        unknown = set(self.max_tokens) - set(DEFAULT_MAX_TOKENS)
        if unknown:
            raise ValueError(
                f"max_tokens has unknown stages {sorted(unknown)}; "
                f"known: {sorted(DEFAULT_MAX_TOKENS)}"
            )
        merged = {**DEFAULT_MAX_TOKENS, **self.max_tokens}
        bad = {k: v for k, v in merged.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"max_tokens must be positive ints, got {bad}")
        object.__setattr__(self, "max_tokens", MappingProxyType(merged))
        unknown = set(self.stop) - set(DEFAULT_MAX_TOKENS)
        if unknown:
            raise ValueError(
                f"stop has unknown stages {sorted(unknown)}; known: {sorted(DEFAULT_MAX_TOKENS)}"
            )
        stops: dict[str, tuple[str, ...]] = {}
        for stage, strings in self.stop.items():
            if isinstance(strings, str) or not all(isinstance(x, str) and x for x in strings):
                raise ValueError(f"stop[{stage!r}] must be a list of non-empty str")
            stops[stage] = tuple(strings)
        object.__setattr__(self, "stop", MappingProxyType(stops))


@dataclass
class StageRecord:
    """One model call of a question.

    ``output`` is the answer text, ``<think>`` blocks removed (None when the
    request failed, with ``error`` saying why); ``parsed`` what was read from it and
    ``parse_failure`` what could not be.  ``started`` is seconds after the
    question began, ``seconds`` the call's duration; token counts come from
    the response's ``usage`` (None when the server sent none).  ``fix_of``
    names the SQL stage a SQL-fix call corrects.
    """

    stage: str
    output: str | None = None
    parsed: Any = None
    parse_failure: str | None = None
    error: str | None = None
    started: float = 0.0
    seconds: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    fix_of: str | None = None


@dataclass
class Candidate:
    """The query of one SQL stage after its EXPLAIN check (and SQL-fix, when run).

    ``first_sql`` / ``first_error`` are the stage's own query and EXPLAIN
    error when SQL-fix replaced it (``fixed``).
    """

    stage: str
    strategy: str
    sql: str | None
    explain_ok: bool
    explain_error: str | None
    fixed: bool = False
    first_sql: str | None = None
    first_error: str | None = None


@dataclass
class QuestionResult:
    """Everything one question produced.

    ``final_source`` says where ``final_sql`` came from: ``"combine"`` (its
    query), ``"combine-choice"`` (a candidate it named by number), ``"vote"``
    (Combine's query was missing or failed EXPLAIN: the most common passing
    candidate), ``"candidate"`` (Combine gave no query and none passes: the
    first candidate query) or ``"none"``.
    """

    session: str
    db_id: str
    question: str
    question_type: str = "other"
    features: dict[str, Any] = field(default_factory=dict)
    schema_subset: str = ""
    stages: list[StageRecord] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)
    final_sql: str | None = None
    answer: str | None = None
    final_source: str = "none"
    explain_ok: bool = False
    explain_error: str | None = None
    seconds: float = 0.0

    def usage(self) -> dict[str, dict[str, int]]:
        """Token usage summed per stage: ``{stage: {"prompt_tokens", "completion_tokens"}}``."""
        out: dict[str, dict[str, int]] = {}
        for rec in self.stages:
            entry = out.setdefault(rec.stage, {"prompt_tokens": 0, "completion_tokens": 0})
            entry["prompt_tokens"] += rec.prompt_tokens or 0
            entry["completion_tokens"] += rec.completion_tokens or 0
        return out

    def parse_failures(self) -> dict[str, str]:
        """The stages whose output could not be (fully) parsed, with the reason."""
        return {
            rec.stage if rec.fix_of is None else f"{rec.stage}({rec.fix_of})": rec.parse_failure
            for rec in self.stages
            if rec.parse_failure is not None
        }

    def to_json(self) -> dict[str, Any]:
        """The result as plain JSON data (with ``usage`` added)."""
        data = asdict(self)
        data["usage"] = self.usage()
        return data


def _normalise(sql: str) -> str:
    return _SPACES.sub(" ", sql.strip().rstrip(";")).lower()


def _usage(response: Any) -> tuple[int | None, int | None]:
    usage = getattr(response, "usage", None)
    if usage is None:
        return None, None
    return getattr(usage, "prompt_tokens", None), getattr(usage, "completion_tokens", None)


class Text2SQLPipeline:
    """Runs questions through the stages with one `AgentSpecClient`.

    Questions of `run_all` run one after another (the few-shot strategy
    learns from earlier answers, so order matters); within a question the
    SQL stages run in parallel.  Databases built from schemas are cached per
    schema text and closed by `close`.
    """

    def __init__(self, client: AgentSpecClient, config: PipelineConfig) -> None:
        """Use ``client`` for every call, as ``config`` says."""
        self._client = client
        self.config = config
        self._lock = threading.Lock()
        self._databases: dict[str, SchemaDatabase] = {}
        self._answered: list[tuple[str, str, str]] = []  # (db_id, question, sql)

    # -- resources

    def database(self, schema: str) -> SchemaDatabase:
        """The (cached) `SchemaDatabase` of ``schema``; `SchemaError` if unusable."""
        with self._lock:
            db = self._databases.get(schema)
            if db is None:
                db = self._databases[schema] = SchemaDatabase(schema)
            return db

    def close(self) -> None:
        """Close the cached databases (the client stays the caller's)."""
        with self._lock:
            dbs, self._databases = list(self._databases.values()), {}
        for db in dbs:
            db.close()

    def __enter__(self) -> Text2SQLPipeline:
        """Return the pipeline."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """`close` the pipeline."""
        self.close()

    # -- one model call

    def _call(
        self, stage: str, messages: list[Message], t0: float, *, budget: str | None = None
    ) -> StageRecord:
        """Call the model under ``stage``; the record holds the text (or the error)."""
        rec = StageRecord(stage, started=monotonic() - t0)
        start = monotonic()
        try:
            extra: dict[str, Any] = {}
            if self.config.extra_body is not None:
                extra["extra_body"] = self.config.extra_body
            stop = self.config.stop.get(budget or stage)
            if stop:
                extra["stop"] = list(stop)
            with agentspec.stage(stage):
                response = self._client.chat.completions.create(
                    model=self.config.model,
                    messages=messages,
                    temperature=0,
                    max_tokens=self.config.max_tokens[budget or stage],
                    **extra,
                )
        except openai.APIError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        else:
            choices = getattr(response, "choices", None) or []
            if choices:
                rec.output = _THINK.sub("", choices[0].message.content or "").strip()
                rec.finish_reason = choices[0].finish_reason
            else:
                rec.output = ""
            rec.prompt_tokens, rec.completion_tokens = _usage(response)
        rec.seconds = monotonic() - start
        return rec

    # -- the stages

    def _examples(self, db_id: str, question: str) -> list[tuple[str, str]]:
        """Few-shot examples: this run's answered questions, same database first."""
        with self._lock:
            answered = list(self._answered)
        same = [(q, s) for d, q, s in reversed(answered) if d == db_id and q != question]
        other = [(q, s) for d, q, s in reversed(answered) if d != db_id]
        return (same + other)[: self.config.few_shot][::-1]

    def _sql_candidate(
        self,
        index: int,
        messages: list[Message],
        db: SchemaDatabase,
        full_schema: str,
        t0: float,
    ) -> tuple[Candidate, list[StageRecord]]:
        """One SQL stage: generate, EXPLAIN, and on failure SQL-fix once."""
        stage = sql_stage(index)
        strategy = SQL_STRATEGIES[index - 1]
        rec = self._call(stage, messages, t0, budget=_SQL)
        records = [rec]
        if rec.output is None:
            return Candidate(stage, strategy, None, False, rec.error), records
        sql = extract_sql(rec.output)
        rec.parsed = sql
        if sql is None:
            rec.parse_failure = f"no SQL query in {rec.output[:80]!r}"
            check = ExplainResult(False, "no SQL query found")
        else:
            check = db.explain(sql)
        cand = Candidate(stage, strategy, sql, check.ok, check.error)
        if check.ok or not self.config.fix:
            return cand, records
        feedback = self.config.prompts.fix_feedback(
            sql, check.error or "EXPLAIN failed", full_schema
        )
        fix_messages = [
            *messages,
            {"role": "assistant", "content": rec.output},
            {"role": "user", "content": feedback},
        ]
        fix = self._call(STAGE_FIX, fix_messages, t0)
        fix.fix_of = stage
        records.append(fix)
        if fix.output is None:
            return cand, records
        fixed_sql = extract_sql(fix.output)
        fix.parsed = fixed_sql
        if fixed_sql is None:
            fix.parse_failure = f"no SQL query in {fix.output[:80]!r}"
            return cand, records
        fixed_check = db.explain(fixed_sql)
        return (
            Candidate(
                stage,
                strategy,
                fixed_sql,
                fixed_check.ok,
                fixed_check.error,
                fixed=True,
                first_sql=sql,
                first_error=check.error,
            ),
            records,
        )

    def _vote(self, candidates: list[Candidate]) -> Candidate | None:
        """The most common passing candidate query (first one on ties), or None."""
        passing = [c for c in candidates if c.explain_ok and c.sql]
        if not passing:
            return None
        counts = Counter(_normalise(c.sql or "") for c in passing)
        best = max(counts.values())
        return next(c for c in passing if counts[_normalise(c.sql or "")] == best)

    def run(self, question: SpiderQuestion) -> QuestionResult:
        """Run every stage for ``question``; never raises for model output or API errors.

        A schema from which no database can be built raises `SchemaError`.
        """
        t0 = monotonic()
        db = self.database(question.schema)
        full_schema = db.compact_schema()
        columns = {t.name: [c.name for c in t.columns] for t in db.tables}
        result = QuestionResult(question.session, question.db_id, question.question)
        q = question.question
        with self._client.session(question.session, pipeline=self.config.pipeline):
            # Classify
            prompts = self.config.prompts
            rec = self._call(STAGE_CLASSIFY, prompts.classify(q), t0)
            result.stages.append(rec)
            if rec.output is not None:
                kind = parse_question_type(rec.output)
                rec.parsed, rec.parse_failure = kind.value, kind.failure
                result.question_type = kind.value
            # Extract
            rec = self._call(STAGE_EXTRACT, prompts.extract(q, full_schema), t0)
            result.stages.append(rec)
            feats = parse_features(rec.output or "")
            result.features = feats.value
            if rec.output is not None:
                rec.parsed, rec.parse_failure = feats.value, feats.failure
            # Enrich
            rec = self._call(STAGE_ENRICH, prompts.enrich(q, full_schema, result.features), t0)
            result.stages.append(rec)
            selection = parse_schema_selection(rec.output or "", columns)
            if rec.output is not None:
                rec.parsed, rec.parse_failure = selection.value, selection.failure
            picked = selection.value
            if not picked:  # fall back on Extract's tables, then on the whole schema
                fallback = "\n".join(result.features.get("tables", []))
                picked = parse_schema_selection(fallback, columns).value
            result.schema_subset = db.compact_schema(picked) if picked else full_schema
            # SQL1..SQLn in parallel, each with its EXPLAIN check and SQL-fix
            examples = self._examples(question.db_id, q)
            sql_prompts = [
                prompts.sql(
                    SQL_STRATEGIES[i - 1],
                    q,
                    result.schema_subset,
                    question_type=result.question_type,
                    features=result.features,
                    examples=examples,
                )
                for i in range(1, self.config.n_sql + 1)
            ]
            with ThreadPoolExecutor(self.config.n_sql, thread_name_prefix="text2sql") as pool:
                futures = [
                    pool.submit(
                        contextvars.copy_context().run,
                        self._sql_candidate,
                        i,
                        sql_prompts[i - 1],
                        db,
                        full_schema,
                        t0,
                    )
                    for i in range(1, self.config.n_sql + 1)
                ]
                outcomes = [f.result() for f in futures]
            fixes: list[StageRecord] = []
            for cand, records in outcomes:
                result.candidates.append(cand)
                result.stages.append(records[0])
                fixes.extend(records[1:])
            result.stages.extend(sorted(fixes, key=lambda r: r.started))
            # Combine
            self._combine(result, db, t0)
        result.seconds = monotonic() - t0
        if result.explain_ok and result.final_sql:
            with self._lock:
                self._answered.append((question.db_id, q, result.final_sql))
        return result

    def _combine(self, result: QuestionResult, db: SchemaDatabase, t0: float) -> None:
        listed = [
            (c.sql, "passes EXPLAIN" if c.explain_ok else f"fails: {c.explain_error}")
            for c in result.candidates
        ]
        messages = self.config.prompts.combine(result.question, result.schema_subset, listed)
        rec = self._call(STAGE_COMBINE, messages, t0)
        result.stages.append(rec)
        final: str | None = None
        source = "none"
        if rec.output is not None:
            parsed = parse_combine(rec.output, len(result.candidates))
            rec.parsed, rec.parse_failure = asdict(parsed.value), parsed.failure
            result.answer = parsed.value.answer
            if parsed.value.choice is not None:
                final, source = result.candidates[parsed.value.choice - 1].sql, "combine-choice"
            elif parsed.value.sql is not None:
                final, source = parsed.value.sql, "combine"
        check = db.explain(final) if final else ExplainResult(False, "no final query")
        if not check.ok:
            voted = self._vote(result.candidates)
            if voted is not None:
                final, source, check = voted.sql, "vote", ExplainResult(True)
            elif final is None:  # nothing passes: keep the first candidate query there is
                first = next((c for c in result.candidates if c.sql), None)
                if first is not None and first.sql is not None:
                    final, source = first.sql, "candidate"
                    check = ExplainResult(False, first.explain_error)
        result.final_sql, result.final_source = final, source if final else "none"
        result.explain_ok, result.explain_error = check.ok, check.error

    def run_all(self, questions: Iterable[SpiderQuestion]) -> Iterator[QuestionResult]:
        """`run` each question in turn, yielding its result."""
        for question in questions:
            yield self.run(question)
