"""Learning finished responses off the caller's path: one worker thread per client.

`Recorder` takes finished calls (`Finished`: the API, the tags, the response
object, raw response or list of stream chunks, and, when traces are recorded,
a snapshot of the request) on a bounded queue and, on its worker thread:

1. pulls each choice's output out of the response (`extract_outputs`): the
   token ids when the server returned them (vLLM ``return_token_ids``:
   ``choices[i].token_ids``, summed over stream chunks), else the text;
2. learns the token ids -- or, lacking them, the text encoded by the
   configured tokenizer -- into ``store.learn((tenant, pipeline, stage), ids)``;
3. with a trace file, hands the call to `agentspec._client.trace.TraceSessions`.

`Recorder.submit` never blocks: when the queue is full the call is dropped,
counted and logged.  Nothing here logs prompt or output text.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from time import monotonic
from typing import TYPE_CHECKING, Any

import structlog

from agentspec._client.outputs import Api, Encoder, extract_outputs, extract_prompt_ids
from agentspec._client.tags import Tags
from agentspec._util.args import as_int
from agentspec._util.log import get_logger

if TYPE_CHECKING:
    from agentspec._client.trace import TraceSessions
    from agentspec._store.store import ShardStore

__all__ = ["Finished", "Recorder", "RecorderStats"]

_log = get_logger()


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
        self._learned_by: dict[tuple[str | None, str | None], int] = {}
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

    def learned_by_key(self) -> dict[tuple[str | None, str | None], int]:
        """Sequences learned so far per ``(pipeline, stage)`` (the tenant is the recorder's)."""
        with self._cond:
            return dict(self._learned_by)

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
                    by = self._learned_by
                    by[key[1:]] = by.get(key[1:], 0) + 1
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
