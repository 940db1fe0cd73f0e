"""The CodeAct loop: model reply -> tool call -> observation -> next reply, for a few steps.

Design: this is the drop-in path of agentspec for code that builds its own
openai client inside an agent loop.  `build_client` makes a plain
``openai.OpenAI`` and wraps it with ``AgentSpecClient(client=...)``; the loop
itself only calls ``client.chat.completions.create`` like any openai code.

- **Tags.**  One run (one task) is one session (``client.session(<id>,
  pipeline="codeact")``); agent steps run under ``agentspec.stage("CodeAct")``
  and the optional closing summary under ``"Summarize"``, so each stage gets
  its own shard ``(tenant, "codeact", stage)``.
- **Learning and pushing.**  The client asks for token ids
  (``return_token_ids``), learns each reply into its `ShardStore` and, with
  ``push_to=``, pushes the shards to the engine.  The loop flushes after each
  step, so the next step already drafts from the earlier ones.
- **Robustness.**  Every reply goes through `complete_stop` and
  `parse_tool_call`; a reply that is not a usable call becomes an ``ERROR``
  observation sent back to the model, as do tool failures.  An API error
  ends the run (recorded in the result), never raised.  Observations are
  truncated to a bound so the context stays small.
- **Determinism.**  Greedy decoding (``temperature=0``) and observations
  free of absolute paths or timings make the transcript a function of the
  task and the model: two runs in the same workdir path give the same one.

The system prompt carries a compact few-shot conversation in the tool
format, so even SmolLM2-135M replies with ``<function=...>`` blocks.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import openai

import agentspec
from agentspec import AgentSpecClient, ShardStore

from .tasks import Task, diff, snapshot
from .tools import (
    DEFAULT_BASH_TIMEOUT,
    STOP,
    Observation,
    Toolbox,
    ToolCall,
    ToolCallError,
    complete_stop,
    format_tool_call,
    parse_tool_call,
    truncate_text,
)

__all__ = [
    "FEW_SHOT",
    "PIPELINE",
    "STAGE_ACT",
    "STAGE_SUMMARIZE",
    "SYSTEM_PROMPT",
    "AgentConfig",
    "CodeActAgent",
    "RunResult",
    "Step",
    "build_client",
]

#: The pipeline tag of every call.
PIPELINE = "codeact"
#: The stage of agent steps.
STAGE_ACT = "CodeAct"
#: The stage of the closing summary call.
STAGE_SUMMARIZE = "Summarize"

Message = dict[str, str]

#: The system prompt: the three tools in the text format.
SYSTEM_PROMPT = (
    "You are a coding agent working in a small repository. "
    "Reply with exactly one tool call and nothing else.\nTools:\n"
    + format_tool_call(ToolCall("bash", {"command": "shell command"}))
    + "\n"
    + format_tool_call(
        ToolCall(
            "str_replace",
            {"path": "file", "old_str": "exact text to replace", "new_str": "new text"},
        )
    )
    + "\n"
    + format_tool_call(ToolCall("finish"))
)

_SUMMARY_SYSTEM = "You summarize what a coding agent changed, in one sentence."


def _observation_message(text: str) -> Message:
    return {"role": "user", "content": f"OBSERVATION:\n{text}"}


#: One solved example task (look, edit, test, finish), shown before the real task.
FEW_SHOT: tuple[Message, ...] = (
    {
        "role": "user",
        "content": "Task: app/config.py sets DEBUG = True; it must be False. Fix it so that "
        "`python check.py` prints OK.\nFiles: app/__init__.py app/config.py check.py",
    },
    {
        "role": "assistant",
        "content": format_tool_call(ToolCall("bash", {"command": "cat app/config.py"})),
    },
    _observation_message("DEBUG = True\nPORT = 8080\n[exit code 0]"),
    {
        "role": "assistant",
        "content": format_tool_call(
            ToolCall(
                "str_replace",
                {"path": "app/config.py", "old_str": "DEBUG = True", "new_str": "DEBUG = False"},
            )
        ),
    },
    _observation_message(
        "Replaced 1 occurrence in app/config.py:\n   1  DEBUG = False\n   2  PORT = 8080"
    ),
    {
        "role": "assistant",
        "content": format_tool_call(ToolCall("bash", {"command": "python check.py"})),
    },
    _observation_message("OK\n[exit code 0]"),
    {"role": "assistant", "content": format_tool_call(ToolCall("finish"))},
)


def build_client(
    base_url: str,
    *,
    api_key: str = "EMPTY",
    store: ShardStore | None = None,
    push_to: str | Sequence[str] | None = None,
    tenant: str = "default",
    timeout: float = 120.0,
    http_client: Any = None,
) -> AgentSpecClient:
    """An ``openai.OpenAI`` for ``base_url``, wrapped by `AgentSpecClient`.

    The wrapper learns replies with the server's token ids into ``store``
    (default: a new in-memory store) and pushes them to ``push_to`` (the
    engines' root URLs).  ``http_client`` (an ``httpx.Client``, e.g. with
    event hooks) is handed to openai.  Closing the returned client closes both.
    """
    oai = openai.OpenAI(
        base_url=base_url,
        api_key=api_key,
        timeout=timeout,
        max_retries=0,
        http_client=http_client,
    )
    try:
        return AgentSpecClient(
            client=oai, store=store, return_token_ids=True, push_to=push_to, tenant=tenant
        )
    except BaseException:
        oai.close()
        raise


@dataclass(frozen=True)
class AgentConfig:
    """How the loop calls the model and runs tools.

    Attributes:
        model: the model name to request.
        max_steps: agent steps at most (a ``finish`` call ends the run sooner).
        max_tokens: ``max_tokens`` of each step.
        temperature: 0 is greedy (deterministic); ``seed`` seeds sampling.
        summarize: add one ``Summarize`` call after the steps.
        summary_max_tokens: its ``max_tokens``.
        max_observation_chars: observations are cut to this (head and tail).
        bash_timeout: seconds per ``bash`` call (and for the task's check).
        flush_timeout: seconds to wait, after each step, for the reply to be
            learned and pushed.
        pipeline: the pipeline tag.
        extra_body: extra request fields for every call.
    """

    model: str
    max_steps: int = 6
    max_tokens: int = 96
    temperature: float = 0.0
    seed: int | None = None
    summarize: bool = True
    summary_max_tokens: int = 40
    max_observation_chars: int = 1200
    bash_timeout: float = DEFAULT_BASH_TIMEOUT
    flush_timeout: float = 10.0
    pipeline: str = PIPELINE
    extra_body: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        """Check the values."""
        if not self.model:
            raise ValueError("model must be a non-empty str")
        for name in ("max_steps", "max_tokens", "summary_max_tokens", "max_observation_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.bash_timeout <= 0 or self.flush_timeout < 0:
            raise ValueError("bash_timeout must be > 0 and flush_timeout >= 0")


@dataclass
class Step:
    """One agent step.

    ``raw`` is the model's text as returned; ``reply`` the same with `STOP`
    appended when the reply ended on it (what goes into the history).
    ``call`` is the parsed call, or None with ``parse_error`` saying why;
    ``observation`` is what was sent back (truncated), ``tool_error`` whether
    the parse or the tool failed.  Token counts come from ``usage``;
    ``spec_steps`` / ``drafted`` / ``accepted`` from the engine's
    ``agentspec`` response field (None when the server sends none).
    ``api_error`` is set when the request failed (the run then stops).
    """

    index: int
    raw: str = ""
    reply: str = ""
    finish_reason: str | None = None
    call: ToolCall | None = None
    parse_error: str | None = None
    observation: str = ""
    tool_error: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    spec_steps: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    seconds: float = 0.0
    api_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The step as plain JSON data."""
        data = asdict(self)
        data["call"] = None if self.call is None else self.call.to_json()
        return data


@dataclass
class RunResult:
    """What one run produced.

    ``stop_reason``: ``"finish"`` (the model called finish), ``"max_steps"``
    or ``"api_error"``.  ``diff`` is the unified diff of the repository,
    ``check_passed`` / ``check_output`` the task's check after the run.
    ``summary`` is the Summarize call's text (None when off or failed, with
    ``summary_error``).  ``flush_timeouts`` counts steps whose reply was not
    learned and pushed within ``flush_timeout``.
    """

    task: str
    session: str
    workdir: str
    steps: list[Step] = field(default_factory=list)
    stop_reason: str = "max_steps"
    check_passed: bool = False
    check_output: str = ""
    diff: str = ""
    summary: str | None = None
    summary_error: str | None = None
    summary_stats: dict[str, int | None] = field(default_factory=dict)
    flush_timeouts: int = 0
    seconds: float = 0.0

    @property
    def parsed(self) -> int:
        """Steps whose reply parsed into a tool call."""
        return sum(s.call is not None for s in self.steps)

    @property
    def answered(self) -> int:
        """Steps that got a reply (no API error)."""
        return sum(s.api_error is None for s in self.steps)

    def totals(self) -> dict[str, int]:
        """Completion tokens, verification steps, drafted and accepted tokens of the steps.

        Only steps whose response carried the engine's counts are summed.
        """
        out = {"completion_tokens": 0, "spec_steps": 0, "drafted": 0, "accepted": 0}
        for s in self.steps:
            if s.spec_steps is None:
                continue
            out["completion_tokens"] += s.completion_tokens or 0
            out["spec_steps"] += s.spec_steps
            out["drafted"] += s.drafted or 0
            out["accepted"] += s.accepted or 0
        return out

    def tokens_per_step(self) -> float | None:
        """Output tokens per verification step over the agent steps (None without counts)."""
        t = self.totals()
        return t["completion_tokens"] / t["spec_steps"] if t["spec_steps"] else None

    def transcript(self) -> list[dict[str, Any]]:
        """The conversation's content without timings or counts (for comparing runs)."""
        return [
            {
                "raw": s.raw,
                "call": None if s.call is None else s.call.to_json(),
                "parse_error": s.parse_error,
                "observation": s.observation,
            }
            for s in self.steps
        ]

    def to_json(self) -> dict[str, Any]:
        """The result as plain JSON data."""
        data = asdict(self)
        data["steps"] = [s.to_json() for s in self.steps]
        data["tokens_per_step"] = self.tokens_per_step()
        return data


def _spec_counts(response: Any) -> dict[str, int | None]:
    """The engine's ``agentspec`` field of a response: steps, drafted, accepted."""
    extra = getattr(response, "model_extra", None) or {}
    field_ = extra.get("agentspec")
    if not isinstance(field_, dict):
        return {"steps": None, "drafted": None, "accepted": None}
    return {
        k: (v if isinstance(v := field_.get(k), int) else None)
        for k in ("steps", "drafted", "accepted")
    }


def _parse_error_observation(error: str) -> str:
    example = format_tool_call(ToolCall("bash", {"command": "ls"}))
    return f"ERROR: {error}. Reply with exactly one tool call, for example:\n{example}"


class CodeActAgent:
    """Runs tasks with one `AgentSpecClient` (the caller's; `close` it yourself)."""

    def __init__(self, client: AgentSpecClient, config: AgentConfig) -> None:
        """Use ``client`` for every call, as ``config`` says."""
        self._client = client
        self.config = config

    def _create(self, messages: list[Message], max_tokens: int, stop: list[str] | None) -> Any:
        cfg = self.config
        kwargs: dict[str, Any] = {
            "model": cfg.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": cfg.temperature,
        }
        if stop:
            kwargs["stop"] = stop
        if cfg.seed is not None:
            kwargs["seed"] = cfg.seed
        if cfg.extra_body is not None:
            kwargs["extra_body"] = dict(cfg.extra_body)
        return self._client.chat.completions.create(**kwargs)

    def _step(self, index: int, messages: list[Message], tools: Toolbox) -> Step:
        """One model call and, when it holds a call, one tool run."""
        step = Step(index)
        start = time.perf_counter()
        try:
            response = self._create(messages, self.config.max_tokens, [STOP])
        except openai.APIError as exc:
            step.api_error = f"{type(exc).__name__}: {exc}"
            step.seconds = time.perf_counter() - start
            return step
        choices = getattr(response, "choices", None) or []
        if choices:
            step.raw = choices[0].message.content or ""
            step.finish_reason = choices[0].finish_reason
        usage = getattr(response, "usage", None)
        if usage is not None:
            step.prompt_tokens = usage.prompt_tokens
            step.completion_tokens = usage.completion_tokens
        counts = _spec_counts(response)
        step.spec_steps, step.drafted, step.accepted = (
            counts["steps"],
            counts["drafted"],
            counts["accepted"],
        )
        step.reply = complete_stop(step.raw, step.finish_reason)
        try:
            step.call = parse_tool_call(step.reply)
        except ToolCallError as exc:
            step.parse_error = str(exc)
            observation = Observation(_parse_error_observation(str(exc)), error=True)
        else:
            observation = tools.execute(step.call)
        step.tool_error = observation.error
        step.observation = truncate_text(observation.text, self.config.max_observation_chars)
        step.seconds = time.perf_counter() - start
        return step

    def _summarize(self, task: Task, result: RunResult) -> None:
        """The closing Summarize call (its text and counts go into ``result``)."""
        change = truncate_text(result.diff or "(no changes)\n", self.config.max_observation_chars)
        state = "passed" if result.check_passed else "failed"
        messages = [
            {"role": "system", "content": _SUMMARY_SYSTEM},
            {
                "role": "user",
                "content": f"Task: {task.instruction}\nDiff:\n{change}Check: {state}",
            },
        ]
        try:
            with agentspec.stage(STAGE_SUMMARIZE):
                response = self._create(messages, self.config.summary_max_tokens, None)
        except openai.APIError as exc:
            result.summary_error = f"{type(exc).__name__}: {exc}"
            return
        choices = getattr(response, "choices", None) or []
        result.summary = (choices[0].message.content or "").strip() if choices else ""
        result.summary_stats = _spec_counts(response)
        usage = getattr(response, "usage", None)
        result.summary_stats["completion_tokens"] = (
            usage.completion_tokens if usage is not None else None
        )

    def run(
        self, task: Task, workdir: str | os.PathLike[str], *, session: str | None = None
    ) -> RunResult:
        """Run ``task`` in ``workdir`` (already seeded) as one session.

        Never raises for model output, tool failures or API errors; those
        are in the result.
        """
        cfg = self.config
        session_id = session or f"codeact-{task.name}-{uuid.uuid4().hex[:8]}"
        tools = Toolbox(workdir, bash_timeout=cfg.bash_timeout)
        result = RunResult(task.name, session_id, str(tools.root))
        before = snapshot(tools.root)
        messages: list[Message] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            *FEW_SHOT,
            {"role": "user", "content": task.prompt()},
        ]
        t0 = time.perf_counter()
        with self._client.session(session_id, pipeline=cfg.pipeline):
            with agentspec.stage(STAGE_ACT):
                for index in range(cfg.max_steps):
                    step = self._step(index, messages, tools)
                    result.steps.append(step)
                    if step.api_error is not None:
                        result.stop_reason = "api_error"
                        break
                    if not self._client.flush(cfg.flush_timeout):
                        result.flush_timeouts += 1
                    if step.call is not None and step.call.name == "finish":
                        result.stop_reason = "finish"
                        break
                    messages.append({"role": "assistant", "content": step.reply})
                    messages.append(_observation_message(step.observation))
            result.diff = diff(before, snapshot(tools.root))
            check = task.check(tools.root, cfg.bash_timeout)
            result.check_passed, result.check_output = check.passed, check.output
            if cfg.summarize:
                self._summarize(task, result)
        result.seconds = time.perf_counter() - t0
        return result
