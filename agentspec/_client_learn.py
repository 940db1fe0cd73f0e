"""Learning finished responses off the caller's path: one worker thread per client.

`Recorder` takes finished calls (`Finished`: the API, the tags, the response
object, raw response or list of stream chunks, and, when traces are recorded,
a snapshot of the request) on a bounded queue and, on its worker thread:

1. pulls each choice's output out of the response (`extract_outputs`): the
   token ids when the server returned them (vLLM ``return_token_ids``:
   ``choices[i].token_ids``, summed over stream chunks), else the text;
2. learns the token ids -- or, lacking them, the text encoded by the
   configured tokenizer -- into ``store.learn((tenant, pipeline, stage), ids)``;
3. with a trace file, hands the call to `agentspec._client_trace.TraceSessions`.

`Recorder.submit` never blocks: when the queue is full the call is dropped,
counted and logged.  Nothing here logs prompt or output text.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from time import monotonic
from typing import TYPE_CHECKING, Any, Literal, cast

import structlog

from agentspec._args import as_int
from agentspec._log import get_logger
from agentspec._tags import Tags
from agentspec.exceptions import InvalidArgumentError

if TYPE_CHECKING:
    from agentspec._client_trace import TraceSessions
    from agentspec._store import ShardStore

__all__ = [
    "Api",
    "Finished",
    "Output",
    "Recorder",
    "RecorderStats",
    "extract_outputs",
    "join_texts",
    "load_tokenizer",
    "tool_calls_text",
]

#: The wrapped model-call APIs.
Api = Literal["chat", "completions", "responses"]

#: ``text -> token ids``, the tokenizer fallback.
Encoder = Callable[[str], Sequence[int]]

_log = get_logger()


# --- the tokenizer fallback -----------------------------------------------------------


def load_tokenizer(spec: object) -> Encoder | None:
    """Turn the client's ``tokenizer=`` argument into ``text -> ids``.

    Accepted: None (no fallback); a path to a ``tokenizer.json`` or to a
    directory holding one; a ``tokenizers.Tokenizer``; any callable taking a
    str and returning a sequence of ints.  A missing or unreadable file raises
    `InvalidArgumentError` at once.  Text is encoded without added special
    tokens, as the model produced it.
    """
    if spec is None:
        return None
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise InvalidArgumentError(f"tokenizer file not found: {path}")
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise InvalidArgumentError(
                f"tokenizer={str(spec)!r} needs the tokenizers package ({exc})"
            ) from exc
        try:
            spec = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise InvalidArgumentError(f"{path}: cannot load tokenizer ({exc})") from exc
    if type(spec).__name__ == "Tokenizer" and callable(getattr(spec, "encode", None)):
        tok: Any = spec

        def encode_text(text: str) -> Sequence[int]:
            ids: Sequence[int] = tok.encode(text, add_special_tokens=False).ids
            return ids

        return encode_text
    if callable(spec):
        return cast(Encoder, spec)
    raise InvalidArgumentError(
        "tokenizer must be None, a path to tokenizer.json, a tokenizers.Tokenizer or a "
        f"callable str -> list[int], got {type(spec).__name__}"
    )


# --- pulling outputs out of responses ---------------------------------------------------


@dataclass(frozen=True)
class Output:
    """One choice of a finished response: its token ids (when returned) and text."""

    index: int
    token_ids: list[int] | None
    text: str


def as_json(obj: Any) -> Any:
    """A response object (openai model, raw response, dict) as plain JSON data."""
    if isinstance(obj, Mapping):
        return obj
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    http = getattr(obj, "http_response", None)
    if http is not None:  # a LegacyAPIResponse of a non-streamed call
        return json.loads(http.content)
    raise TypeError(f"cannot read a response of type {type(obj).__name__}")


def _token_list(value: object) -> list[int] | None:
    """``value`` as a list of ints, or None if it is not one."""
    if isinstance(value, list) and all(type(v) is int for v in value):
        return value
    return None


def tool_calls_text(calls: object) -> str:
    """Tool calls of a message as JSON text (name + arguments of each)."""
    if not isinstance(calls, list) or not calls:
        return ""
    parts = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping):
            parts.append(
                json.dumps(
                    {"name": fn.get("name") or "", "arguments": fn.get("arguments") or ""},
                    ensure_ascii=False,
                )
            )
    return "\n".join(parts)


def join_texts(*texts: str) -> str:
    """The non-empty ``texts`` joined by newlines."""
    return "\n".join(t for t in texts if t)


def _chat_outputs(resp: Mapping[str, Any]) -> list[Output]:
    out = []
    for i, ch in enumerate(resp.get("choices") or ()):
        msg = ch.get("message") or {}
        content = msg.get("content")
        text = join_texts(
            content if isinstance(content, str) else "", tool_calls_text(msg.get("tool_calls"))
        )
        out.append(Output(ch.get("index", i), _token_list(ch.get("token_ids")), text))
    return out


def _completion_outputs(resp: Mapping[str, Any]) -> list[Output]:
    out = []
    for i, ch in enumerate(resp.get("choices") or ()):
        text = ch.get("text")
        out.append(
            Output(
                ch.get("index", i),
                _token_list(ch.get("token_ids")),
                text if isinstance(text, str) else "",
            )
        )
    return out


def _response_text(resp: Mapping[str, Any]) -> str:
    """The output text of a Responses API response (messages and function calls)."""
    parts: list[str] = []
    for item in resp.get("output") or ():
        kind = item.get("type")
        if kind == "message":
            for c in item.get("content") or ():
                if c.get("type") == "output_text" and isinstance(c.get("text"), str):
                    parts.append(c["text"])
        elif kind == "function_call":
            parts.append(
                json.dumps(
                    {"name": item.get("name") or "", "arguments": item.get("arguments") or ""},
                    ensure_ascii=False,
                )
            )
    return join_texts(*parts)


def _stream_outputs(api: Api, chunks: Sequence[Any]) -> list[Output]:
    """Assemble per-choice outputs from the chunks of a chat / completions stream."""
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    has_ids: set[int] = set()
    calls: dict[int, dict[int, list[str]]] = {}
    for raw in chunks:
        chunk = as_json(raw)
        for ch in chunk.get("choices") or ():
            idx = ch.get("index", 0)
            buf = texts.setdefault(idx, [])
            tok = _token_list(ch.get("token_ids"))
            if tok is not None:
                has_ids.add(idx)
                ids.setdefault(idx, []).extend(tok)
            if api == "completions":
                if isinstance(ch.get("text"), str):
                    buf.append(ch["text"])
                continue
            delta = ch.get("delta") or {}
            if isinstance(delta.get("content"), str):
                buf.append(delta["content"])
            for tc in delta.get("tool_calls") or ():
                fn = tc.get("function") or {}
                acc = calls.setdefault(idx, {}).setdefault(tc.get("index", 0), ["", ""])
                acc[0] += fn.get("name") or ""
                acc[1] += fn.get("arguments") or ""
    out = []
    for idx in sorted(texts):
        tool_text = "\n".join(
            json.dumps({"name": n, "arguments": a}, ensure_ascii=False)
            for _, (n, a) in sorted(calls.get(idx, {}).items())
        )
        out.append(
            Output(
                idx,
                ids.get(idx, []) if idx in has_ids else None,
                join_texts("".join(texts[idx]), tool_text),
            )
        )
    return out


def extract_prompt_ids(result: Any, streamed: bool) -> list[int] | None:
    """The prompt's token ids when the server returned them (vLLM ``return_token_ids``).

    vLLM puts ``prompt_token_ids`` at the top of a chat completion (first
    chunk of a stream) and in each choice of a text completion.
    """
    for raw in result if streamed else (result,):
        try:
            obj = as_json(raw)
        except TypeError:
            return None
        ids = _token_list(obj.get("prompt_token_ids"))
        if ids is None:
            choices = obj.get("choices") or ()
            ids = _token_list(choices[0].get("prompt_token_ids")) if choices else None
        if ids is not None:
            return ids
    return None


def extract_outputs(api: Api, result: Any, streamed: bool) -> list[Output]:
    """The per-choice outputs of a finished call (``result``: response or chunk list)."""
    if streamed:
        if api == "responses":
            for raw in reversed(result):
                event = as_json(raw)
                if event.get("type") == "response.completed":
                    return [Output(0, None, _response_text(event.get("response") or {}))]
            return []
        return _stream_outputs(api, result)
    resp = as_json(result)
    if api == "chat":
        return _chat_outputs(resp)
    if api == "completions":
        return _completion_outputs(resp)
    return [Output(0, None, _response_text(resp))]


# --- the recorder ----------------------------------------------------------------------


@dataclass(frozen=True)
class Finished:
    """One finished call handed to the recorder.

    ``result`` is the response model, the raw response of a non-streamed
    ``with_raw_response`` call, or the list of stream chunks / events.
    ``request`` is the snapshot of the call's arguments kept for traces
    (None when no trace is recorded).  ``request_id`` is the call's
    ``agentspec_request_id`` when the store publishes to a fleet: every
    choice is learned under it as the identity, as the worker publishes it.
    """

    api: Api
    tags: Tags
    result: Any
    streamed: bool
    request: Mapping[str, Any] | None = None
    request_id: str | None = None


@dataclass(frozen=True)
class _EndSession:
    session: str


@dataclass(frozen=True)
class RecorderStats:
    """Counters of a client's recorder.

    ``submitted``: calls handed over; ``learned``: sequences added to the
    store; ``unlearned``: choices with neither token ids nor a tokenizer (or
    empty); ``dropped``: calls lost because the queue was full; ``failed``:
    calls whose processing raised (logged); ``traced``: trace records written;
    ``pending``: calls not processed yet.
    """

    submitted: int
    learned: int
    unlearned: int
    dropped: int
    failed: int
    traced: int
    pending: int


class Recorder:
    """The background worker of a client: learns (and traces) finished calls.

    One daemon thread, started on the first submission; a bounded queue of
    ``queue_size`` calls.  Thread-safe.
    """

    def __init__(
        self,
        store: ShardStore,
        *,
        tenant: str,
        encoder: Encoder | None = None,
        trace: TraceSessions | None = None,
        queue_size: int = 1024,
        lead_tokens: int = 8,
    ) -> None:
        """Learn into ``store`` under ``tenant``; see the class docstring."""
        queue_size = as_int(queue_size, "queue_size", 1)
        lead_tokens = as_int(lead_tokens, "lead_tokens", 0)
        self._lead_tokens = lead_tokens
        self.store = store
        self.tenant = tenant
        self.trace = trace
        self._encoder = encoder
        self._max = queue_size
        self._queue: deque[Finished | _EndSession | None] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._busy = 0  # items taken off the queue and not finished
        self._thread: threading.Thread | None = None
        self._closed = False
        self._submitted = self._learned = self._unlearned = 0
        self._dropped = self._failed = 0
        self._warned_no_tokens = False

    # -- caller side

    def submit(self, item: Finished) -> bool:
        """Queue a finished call; False (and counted, logged) if the queue is full or closed."""
        with self._cond:
            if self._closed or len(self._queue) >= self._max:
                self._dropped += 1
                dropped = self._dropped
                accepted = False
            else:
                self._queue.append(item)
                self._submitted += 1
                accepted = True
                if self._thread is None:
                    self._start()
                self._cond.notify()
        if not accepted and dropped & (dropped - 1) == 0:  # 1, 2, 4, 8, ...
            _log.warning(
                "agentspec_learn_dropped",
                dropped=dropped,
                queue_size=self._max,
                closed=self._closed,
            )
        return accepted

    def end_session(self, session: str) -> None:
        """Tell the trace recorder that ``session``'s scope ended (no-op without traces)."""
        if self.trace is None:
            return
        with self._cond:
            if self._closed:
                return
            self._queue.append(_EndSession(session))
            if self._thread is None:
                self._start()
            self._cond.notify()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued call is processed; False on timeout.

        With a trace file, open conversations are written too.
        """
        deadline = None if timeout is None else monotonic() + timeout
        with self._cond:
            if self.trace is not None and not self._closed:
                self._queue.append(None)  # the "write open conversations" marker
                if self._thread is None:
                    self._start()
                self._cond.notify()
            while self._queue or self._busy:
                left = None if deadline is None else deadline - monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Process what is queued, stop the thread, close the trace file.  Idempotent.

        Returns False if the worker did not finish within ``timeout``.
        """
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout)
            done = done and not thread.is_alive()
        if self.trace is not None and (thread is None or not thread.is_alive()):
            try:
                self.trace.close()
            except Exception as exc:
                self._log_error("agentspec_trace_close_failed", exc)
        return done

    def stats(self) -> RecorderStats:
        """A snapshot of the counters."""
        with self._cond:
            return RecorderStats(
                submitted=self._submitted,
                learned=self._learned,
                unlearned=self._unlearned,
                dropped=self._dropped,
                failed=self._failed,
                traced=0 if self.trace is None else self.trace.records,
                pending=len(self._queue) + self._busy,
            )

    # -- worker side

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="agentspec-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._busy += 1
            try:
                self._process(item)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def _process(self, item: Finished | _EndSession | None) -> None:
        if item is None or isinstance(item, _EndSession):
            if self.trace is None:
                return
            try:
                if item is None:
                    self.trace.flush_all()
                else:
                    self.trace.end(item.session)
            except Exception as exc:
                self._log_error("agentspec_trace_write_failed", exc)
            return
        tags = item.tags
        with structlog.contextvars.bound_contextvars(
            session_id=tags.session, stage=tags.stage, pipeline=tags.pipeline, tenant=self.tenant
        ):
            try:
                self._learn(item)
            except Exception as exc:
                with self._cond:
                    self._failed += 1
                self._log_error("agentspec_learn_failed", exc)

    def _learn(self, item: Finished) -> None:
        """Learn (and trace) one finished call; runs with its tags bound for logging."""
        tags = item.tags
        outputs = extract_outputs(item.api, item.result, item.streamed)
        key = (self.tenant, tags.pipeline, tags.stage)
        lead: list[int] = []
        if self._lead_tokens:
            prompt_ids = extract_prompt_ids(item.result, item.streamed)
            if prompt_ids:
                lead = prompt_ids[-self._lead_tokens :]
        for out in outputs:
            ids = out.token_ids
            if ids and lead:  # the server's own ids: put the prompt's lead in front
                ids = lead + ids
            if ids is None and self._encoder is not None and out.text:
                ids = list(self._encoder(out.text))
            if ids:
                self.store.learn(key, ids, identity=item.request_id)
                with self._cond:
                    self._learned += 1
                continue
            with self._cond:
                self._unlearned += 1
            if self._encoder is None and not self._warned_no_tokens:
                self._warned_no_tokens = True
                _log.warning(
                    "agentspec_no_token_ids",
                    api=item.api,
                    hint="the response has no token ids and no tokenizer= is set, so it is "
                    "not learned (set return_token_ids=True for vLLM, or pass tokenizer=)",
                )
        if self.trace is not None and item.request is not None and outputs:
            first = min(outputs, key=lambda o: o.index)
            self.trace.add(
                tags, self.tenant, item.api, item.request, item.request.get("model"), first.text
            )

    def _log_error(self, event: str, exc: BaseException) -> None:
        """Log a failure: the error type above DEBUG, its message (may hold text) at DEBUG."""
        _log.warning(event, error=type(exc).__name__)
        _log.debug(event, error=type(exc).__name__, detail=str(exc))
