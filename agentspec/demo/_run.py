"""Running the demo: the text-to-SQL pipeline twice (speculation off and on) on one server.

For each question the pipeline (``examples/text_to_sql``) runs with
``vllm_xargs.agentspec_speculate = false`` (plain decoding: the baseline)
and with speculation on, the baseline first on even questions and second on
odd ones; both runs see the same questions in the same order.  Interleaving
the runs per question, rather than doing all "off" questions first, exposes
both to the same machine load, which matters on a shared CPU, and
alternating the order spreads whatever the first of a pair pays over both.
Each run uses its own tenant (``demo-<id>-off`` / ``-on``): the
"on" run's stage shards start empty and learn only from its own earlier
answers, never from the baseline's identical outputs.

Every call is recorded on the wire (`CallRecord`, through an httpx event
hook on the openai client): request messages, output text, token ids
(``return_token_ids``), ``usage``, the server's ``agentspec`` step counts and
the call's start and end.  `agentspec.demo._report` then checks the outputs
are identical and sums per stage.

The pipeline (``examples/text_to_sql``, imported by `agentspec.demo._pipeline`)
runs with the demo's prompts and stop strings (`agentspec.demo._prompts`),
fitted to the small default model, and the demo's ``max_tokens``
(`DEMO_MAX_TOKENS`).  After each question the runner checks every output of
both runs (`CallRecord.valid`): Extract's JSON, the SQL queries against
SQLite ``EXPLAIN`` on a database built from the question's schema.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TextIO

from agentspec.demo._pipeline import (
    PIPELINE_MODULE,
    QUESTION_TYPES,
    DemoError,
    PipelineConfig,
    QuestionResult,
    SchemaDatabase,
    SpiderQuestion,
    Text2SQLPipeline,
    ensure_pipeline_importable,
    extract_sql,
    load_questions,
    parse_combine,
    parse_schema_selection,
)
from agentspec.demo._prompts import DEMO_PROMPTS, DEMO_STOP, is_feature_json
from agentspec.demo._questions import builtin_questions
from agentspec.demo._report import (
    OFF,
    ON,
    CallRecord,
    DemoReport,
    QuestionTiming,
    build_report,
)
from agentspec.protocol import (
    HEADER_SESSION,
    HEADER_STAGE,
    XARG_SESSION,
    XARG_SPECULATE,
    XARG_STAGE,
    XARG_TENANT,
    XARGS_FIELD,
)

__all__ = [
    "DEMO_MAX_TOKENS",
    "PIPELINE_MODULE",
    "DemoConfig",
    "DemoError",
    "DemoResult",
    "default_spider_paths",
    "ensure_pipeline_importable",
    "run_demo",
]

_REPO_ROOT = Path(__file__).resolve().parents[2]

#: ``max_tokens`` per stage for the demo (the pipeline's own defaults are for
#: larger models): a little above the longest well-formed answer of each stage
#: with the demo's prompts, so a call that reaches it is a loop, cut short.
DEMO_MAX_TOKENS: Mapping[str, int] = MappingProxyType(
    {"Classify": 4, "Extract": 96, "Enrich": 40, "SQL": 64, "SQL-fix": 64, "Combine": 128}
)
_SPIDER_NAME = "spider-sql.dev.jsonl.gz"


def default_spider_paths() -> list[Path]:
    """Where the Spider trace is looked for: ``../shared/data/traces`` beside the checkout."""
    return [
        _REPO_ROOT.parent / "shared" / "data" / "traces" / _SPIDER_NAME,
        Path.cwd().parent / "shared" / "data" / "traces" / _SPIDER_NAME,
    ]


@dataclass(frozen=True)
class DemoConfig:
    """What `run_demo` does.

    Attributes:
        base_url: an OpenAI-compatible server (``.../v1``); None starts the
            embedded engine in this process on a free port.
        model: for the embedded engine, a model name or HF folder
            (`agentspec.models.resolve_model`); for a server, the model name
            to request (None: the first of ``/v1/models``).
        questions: how many questions (N).
        n_sql: parallel SQL stages of the pipeline.
        max_tokens: ``max_tokens`` per stage (merged over `DEMO_MAX_TOKENS`).
        data: the Spider trace (None: `default_spider_paths`, then the
            built-in questions); ``builtin``: use the built-in questions.
        threads: torch threads of the embedded engine (None: its default).
        api_key: sent to the server.
        timeout: seconds per request.
    """

    base_url: str | None = None
    model: str | None = None
    questions: int = 6
    n_sql: int = 1
    max_tokens: Mapping[str, int] = field(default_factory=dict)
    data: str | None = None
    builtin: bool = False
    threads: int | None = None
    api_key: str = "EMPTY"
    timeout: float = 600.0

    def __post_init__(self) -> None:
        """Check the numbers; merge ``max_tokens`` over `DEMO_MAX_TOKENS`."""
        if self.questions < 1:
            raise ValueError(f"the number of questions must be >= 1, got {self.questions}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        merged = {**DEMO_MAX_TOKENS, **self.max_tokens}
        PipelineConfig(model="check", n_sql=self.n_sql, max_tokens=merged)  # ValueError if bad
        object.__setattr__(self, "max_tokens", MappingProxyType(merged))


@dataclass
class DemoResult:
    """The report and every recorded call of both runs."""

    report: DemoReport
    records: list[CallRecord]


# --- questions -------------------------------------------------------------------------------


def _load_questions(config: DemoConfig) -> tuple[list[SpiderQuestion], str, list[str]]:
    """The questions, a description of where they came from, and warnings."""
    warnings: list[str] = []
    path: Path | None = None
    if not config.builtin:
        if config.data is not None:
            path = Path(config.data).expanduser()
            if not path.is_file():
                raise DemoError("no such Spider trace file", str(path))
        else:
            path = next((p for p in default_spider_paths() if p.is_file()), None)
    if path is not None:
        try:
            questions = load_questions(path, limit=config.questions)
        except (OSError, ValueError) as exc:
            raise DemoError(f"cannot read the Spider trace: {exc}", str(path)) from exc
        if not questions:
            raise DemoError("the Spider trace holds no questions", str(path))
        return questions, f"Spider dev ({path})", warnings
    if not config.builtin:
        warnings.append("Spider trace not found; using the built-in questions")
    built = builtin_questions()
    if config.questions > len(built):
        warnings.append(f"only {len(built)} built-in questions; running all of them")
    picked = built[: config.questions]
    questions = [SpiderQuestion(q.session, q.db_id, q.question, q.schema) for q in picked]
    return questions, "built-in questions", warnings


# --- recording calls on the wire -------------------------------------------------------------


def _messages_key(body: Mapping[str, Any]) -> str:
    blob = json.dumps(body.get("messages"), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class _WireRecorder:
    """httpx event hooks recording every chat completion of one run as a `CallRecord`."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.question = -1
        self.records: list[CallRecord] = []
        self._started: dict[int, float] = {}
        self._lock = threading.Lock()

    def hooks(self) -> dict[str, list[Callable[[Any], None]]]:
        """The ``event_hooks`` argument of an httpx client."""
        return {"request": [self.on_request], "response": [self.on_response]}

    def on_request(self, request: Any) -> None:
        """Note when the request left."""
        with self._lock:
            self._started[id(request)] = time.perf_counter()

    def on_response(self, response: Any) -> None:
        """Read the whole answer and record the call (chat completions only)."""
        response.read()
        ended = time.perf_counter()
        request = response.request
        with self._lock:
            started = self._started.pop(id(request), ended)
            question = self.question
        if not str(request.url.path).endswith("/chat/completions"):
            return
        try:
            body = json.loads(request.content or b"{}")
        except ValueError:
            body = {}
        xargs = body.get(XARGS_FIELD) or {}
        headers = request.headers
        rec = CallRecord(
            run=self.run,
            question=question,
            session=str(xargs.get(XARG_SESSION) or headers.get(HEADER_SESSION)),
            stage=str(xargs.get(XARG_STAGE) or headers.get(HEADER_STAGE)),
            request_key=_messages_key(body),
            started=started,
            ended=ended,
        )
        _fill(rec, response)
        with self._lock:
            self.records.append(rec)


def _fill(rec: CallRecord, response: Any) -> None:
    """Copy what the answer says into ``rec`` (an error when it is not a usable answer)."""
    try:
        data = json.loads(response.content)
    except ValueError:
        data = None
    if response.status_code != 200 or not isinstance(data, dict):
        rec.error = f"HTTP {response.status_code}: {response.text[:300]}"
        return
    choices = data.get("choices") or []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    rec.text = (choice.get("message") or {}).get("content")
    ids = choice.get("token_ids")
    rec.token_ids = [int(t) for t in ids] if isinstance(ids, list) else None
    rec.finish_reason = choice.get("finish_reason")
    usage = data.get("usage") or {}
    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    ext = data.get("agentspec")
    if isinstance(ext, dict):
        for name in ("steps", "drafted", "accepted"):
            value = ext.get(name)
            setattr(rec, name, int(value) if isinstance(value, int) else None)
        spec = ext.get("speculate")
        rec.speculate = spec if isinstance(spec, bool) else None
        cached = ext.get("cached_tokens")
        rec.cached_tokens = cached if isinstance(cached, int) and cached >= 0 else None
        seconds = ext.get("seconds")
        if isinstance(seconds, dict):
            for name in ("prefill", "draft", "verify", "engine"):
                value = seconds.get(name)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    value = None
                setattr(rec, f"{name}_s", None if value is None else float(value))


# --- checking the outputs -------------------------------------------------------------------


def output_valid(
    stage: str, text: str | None, db: SchemaDatabase, result: QuestionResult | None = None
) -> bool | None:
    """Whether ``text`` is a well-formed answer of ``stage`` (None: a failed call).

    Classify: exactly one question type; Extract: one JSON object with exactly
    the feature keys; Enrich: names a table of the schema; SQL stages and
    SQL-fix: a query that passes SQLite ``EXPLAIN`` on ``db``; Combine: its
    query (or the candidate of ``result`` it names) passes ``EXPLAIN``.
    """
    if text is None:
        return None
    if stage == "Classify":
        return text.strip().lower() in QUESTION_TYPES
    if stage == "Extract":
        return is_feature_json(text)
    if stage == "Enrich":
        columns = {t.name: [c.name for c in t.columns] for t in db.tables}
        return parse_schema_selection(text, columns).failure is None
    if stage == "Combine":
        candidates = result.candidates if result is not None else []
        answer = parse_combine(text, len(candidates)).value
        sql = candidates[answer.choice - 1].sql if answer.choice is not None else answer.sql
        return sql is not None and db.explain(sql).ok
    if stage.startswith("SQL"):
        sql = extract_sql(text)
        return sql is not None and db.explain(sql).ok
    return None


def _check_question(
    records: Sequence[CallRecord], question: int, db: SchemaDatabase, result: QuestionResult
) -> None:
    """Set `CallRecord.valid` on the records of ``question`` (in place)."""
    for rec in records:
        if rec.question == question and rec.error is None:
            rec.valid = output_valid(rec.stage, rec.text, db, result)


# --- progress ---------------------------------------------------------------------------------


class _Progress:
    """One status line on ``stream`` (rewritten in place on a terminal)."""

    def __init__(self, stream: TextIO | None, total: int) -> None:
        self.stream = stream
        self.total = total
        self.t0 = time.perf_counter()
        self.tty = bool(stream is not None and stream.isatty())

    def show(self, text: str, *, final: bool = False) -> None:
        if self.stream is None:
            return
        elapsed = time.perf_counter() - self.t0
        line = f"[demo {elapsed:6.1f}s] {text}"
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def question(self, i: int, run: str, done: Sequence[QuestionTiming]) -> None:
        width = 20
        filled = width * (2 * i + (run == ON)) // (2 * self.total)
        bar = "#" * filled + "." * (width - filled)
        last = (
            f"; last {done[-1].seconds_off:.1f}s off / {done[-1].seconds_on:.1f}s on"
            if done
            else ""
        )
        self.show(f"[{bar}] question {i + 1}/{self.total}, speculation {run}{last}")


# --- the server ---------------------------------------------------------------------------------


def _start_engine(model: str, threads: int | None, progress: _Progress) -> tuple[Any, str, int]:
    """Start the embedded engine for ``model`` on a free port: ``(server, name, threads)``."""
    try:
        import torch

        from agentspec.engine import EngineOptions, EngineServer, default_threads
        from agentspec.models import ModelError, load_model
    except ImportError as exc:
        raise DemoError(
            "the embedded engine needs torch and transformers",
            f'pip install "agentspec[local]", or pass --base-url of a running server: {exc}',
        ) from exc
    torch.set_num_threads(threads or default_threads())
    progress.show(f"loading {model} (threads: {torch.get_num_threads()})")
    try:
        loaded, tokenizer = load_model(model)
    except ModelError as exc:
        raise DemoError(f"cannot load the model: {exc}") from exc
    name = Path(model).name if Path(model).is_dir() else str(model)
    server = EngineServer.create(loaded, tokenizer, EngineOptions(), served_model_name=name)
    return server.start(), name, int(torch.get_num_threads())


def _openai_client(config: DemoConfig, base_url: str, hooks: Any = None) -> Any:
    import openai

    http = openai.DefaultHttpxClient(event_hooks=hooks) if hooks else None
    return openai.OpenAI(
        base_url=base_url,
        api_key=config.api_key,
        timeout=config.timeout,
        max_retries=0,
        http_client=http,
    )


def _served_model(config: DemoConfig, base_url: str) -> str:
    import openai

    with _openai_client(config, base_url) as client:
        try:
            models = client.models.list().data
        except openai.OpenAIError as exc:
            raise DemoError(f"cannot list the server's models: {exc}", base_url) from exc
    if not models:
        raise DemoError("the server lists no models; pass --model", base_url)
    return str(models[0].id)


#: The warm-up asks for text from its own prompt, so that with speculation on the
#: engine drafts from the prompt and runs its multi-token verification once.
WARM_UP_PROMPT = "Repeat exactly: SELECT name, country, age FROM singer ORDER BY age DESC"


def _warm_up(config: DemoConfig, base_url: str, model: str) -> None:
    """Two short unrecorded requests, speculation off and on, on a tenant of their
    own: the first-call costs of both paths stay out of the measurements."""
    import openai

    with _openai_client(config, base_url) as client:
        for speculate in (False, True):
            try:
                client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": WARM_UP_PROMPT}],
                    max_tokens=16,
                    temperature=0,
                    extra_body={
                        XARGS_FIELD: {
                            XARG_TENANT: "demo-warmup",
                            XARG_SPECULATE: speculate,
                        }
                    },
                )
            except openai.OpenAIError as exc:
                raise DemoError(f"the server does not answer: {exc}", base_url) from exc


# --- the runs -----------------------------------------------------------------------------------


def _timed(pipeline: Text2SQLPipeline, question: SpiderQuestion) -> tuple[QuestionResult, float]:
    t0 = time.perf_counter()
    result = pipeline.run(question)
    return result, time.perf_counter() - t0


def _request_errors(result: QuestionResult, run: str) -> list[tuple[str, str, str, str]]:
    """``(run, session, stage, error)`` of the pipeline's failed calls."""
    return [
        (run, result.session, rec.stage, rec.error)
        for rec in result.stages
        if rec.error is not None
    ]


def run_demo(config: DemoConfig, *, progress: TextIO | None = None) -> DemoResult:
    """Run the demo; progress lines go to ``progress`` (e.g. ``sys.stderr``).

    Raises:
        DemoError: no model / torch, no questions, a server that does not answer.
    """
    from agentspec import AgentSpecClient

    questions, source, warnings = _load_questions(config)
    bar = _Progress(progress, len(questions))
    run_id = uuid.uuid4().hex[:8]
    tenants = {run: f"demo-{run_id}-{run}" for run in (OFF, ON)}
    recorders = {run: _WireRecorder(run) for run in (OFF, ON)}
    timings: list[QuestionTiming] = []
    request_errors: list[tuple[str, str, str, str]] = []
    threads: int | None = None
    with contextlib.ExitStack() as stack:
        if config.base_url is None:
            server, model, threads = _start_engine(
                config.model or "smollm2-135m", config.threads, bar
            )
            stack.callback(server.engine.close)
            stack.callback(server.stop)
            base_url = str(server.base_url)
            where = f"embedded engine ({base_url})"
        else:
            base_url = config.base_url.rstrip("/")
            model = config.model or _served_model(config, base_url)
            where = base_url
        bar.show(f"warming up {where}")
        _warm_up(config, base_url, model)
        pipelines: dict[str, Text2SQLPipeline] = {}
        for run in (OFF, ON):
            client = stack.enter_context(
                AgentSpecClient(
                    client=_openai_client(config, base_url, recorders[run].hooks()),
                    tenant=tenants[run],
                    return_token_ids=True,
                )
            )
            pipeline_config = PipelineConfig(
                model=model,
                n_sql=config.n_sql,
                max_tokens=config.max_tokens,
                extra_body={XARGS_FIELD: {XARG_SPECULATE: run == ON}},
                prompts=DEMO_PROMPTS,
                stop=DEMO_STOP,
            )
            pipelines[run] = stack.enter_context(Text2SQLPipeline(client, pipeline_config))
        for i, question in enumerate(questions):
            results: dict[str, tuple[QuestionResult, float]] = {}
            # Alternate which run goes first: whatever the first of a pair pays (a
            # verifier switching tenants, caches, a load spike) falls on both runs.
            for run in (OFF, ON) if i % 2 == 0 else (ON, OFF):
                bar.question(i, run, timings)
                recorders[run].question = i
                results[run] = _timed(pipelines[run], question)
                request_errors += _request_errors(results[run][0], run)
            (off_res, off_s), (on_res, on_s) = results[OFF], results[ON]
            db = pipelines[ON].database(question.schema)
            for run in (OFF, ON):
                _check_question(recorders[run].records, i, db, results[run][0])
            final_ok = on_res.final_sql is not None and db.explain(on_res.final_sql).ok
            timings.append(
                QuestionTiming(
                    question.session,
                    question.db_id,
                    off_s,
                    on_s,
                    off_res.final_sql,
                    on_res.final_sql,
                    final_ok,
                )
            )
    bar.show(
        f"done: {sum(t.seconds_off for t in timings):.1f}s off, "
        f"{sum(t.seconds_on for t in timings):.1f}s on",
        final=True,
    )
    settings = {
        "questions": len(questions),
        "n_sql": config.n_sql,
        "max_tokens": dict(config.max_tokens),
        "stop": {stage: list(strings) for stage, strings in DEMO_STOP.items()},
        "engine_threads": threads,
        "tenants": tenants,
    }
    report = build_report(
        recorders[OFF].records,
        recorders[ON].records,
        timings,
        model=model,
        server=where,
        source=source,
        settled_from=min(2, len(questions) - 1),
        settings=settings,
    )
    report.warnings[:0] = warnings
    # Requests that got no answer at all (connection errors, timeouts) are only in the
    # pipeline's records; answers with an error status are already in the wire records.
    answered = {
        (r.run, r.session, r.stage)
        for rec_list in (recorders[OFF].records, recorders[ON].records)
        for r in rec_list
        if r.error is not None
    }
    report.errors += [
        f"{run} run, {session} {stage}: {error}"
        for run, session, stage, error in request_errors
        if (run, session, stage) not in answered
    ]
    return DemoResult(report, [*recorders[OFF].records, *recorders[ON].records])
