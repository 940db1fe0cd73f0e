"""Learning finished answers into the shard store, off the proxy's event loop.

`Learner` owns a daemon thread and a bounded queue of `Job`s (a shard key,
the answer's `Outputs` and its model group).  For each choice it learns the
upstream's token ids -- behind the last ``lead_tokens`` prompt tokens when
the upstream returned those -- or, lacking ids, the text encoded by the
model group's configured tokenizer.  `ShardStore.learn` writes (and fsyncs)
a journal record, which is why it never runs on the event loop.  Every
choice of a job is learned under the job's ``identity`` (the call's
``agentspec_request_id``) when it has one: a store with a fleet publishes it
under that identity, as a vLLM worker serving the call does.

`Counters` are shared with the hook: every failure anywhere is counted
there, and the worker writes them to ``stats_file`` (atomically) whenever
its queue runs empty.  `submit` never blocks; a full queue drops the job and
counts it.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentspec.integration import get_logger
from agentspec_litellm.outputs import Outputs

if TYPE_CHECKING:
    from agentspec import ShardStore
    from agentspec_litellm.metrics import HookMetrics

__all__ = ["Counters", "Job", "Learner"]

_log = get_logger()

Encoder = Callable[[str], Sequence[int]]


class Counters:
    """Thread-safe event counters of the hook (``requests``, ``learned``, ``errors``...)."""

    def __init__(self) -> None:
        """All zero."""
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> int:
        """Add ``n`` to ``name``; return the new value."""
        with self._lock:
            self._counts[name] += n
            return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter."""
        with self._lock:
            return dict(self._counts)


@dataclass(frozen=True)
class Job:
    """One finished answer to learn."""

    key: tuple[str, str | None, str | None]
    outputs: Outputs
    model: str | None
    #: The call's request identity in the fleet (None: a random one per choice).
    identity: str | None = None


class Learner:
    """The background worker learning `Job`s into a store (see the module docstring)."""

    def __init__(
        self,
        store: ShardStore | None,
        counters: Counters,
        *,
        encoders: Mapping[str, Encoder] | None = None,
        lead_tokens: int = 8,
        queue_size: int = 1024,
        stats_file: Path | None = None,
        scrub: Callable[[str], str] | None = None,
        metrics: HookMetrics | None = None,
    ) -> None:
        """Learn into ``store`` (None: count the answers, learn nothing).

        ``scrub`` removes secrets (the fleet's Redis password) from error
        texts before they are logged.
        """
        self.store = store
        self.counters = counters
        self._encoders = dict(encoders or {})
        self._lead = lead_tokens
        self._max = queue_size
        self._stats_file = stats_file
        self._scrub: Callable[[str], str] = scrub or (lambda text: text)
        self._metrics = metrics
        self._queue: deque[Job | None] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="agentspec-litellm", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> bool:
        """Queue a job; False (counted as ``dropped``) when the queue is full or closed."""
        with self._cond:
            if self._closed or len(self._queue) >= self._max:
                accepted = False
            else:
                self._queue.append(job)
                self._cond.notify()
                accepted = True
        if not accepted:
            dropped = self.counters.add("dropped")
            if dropped & (dropped - 1) == 0:
                _log.warning("agentspec_litellm_learn_dropped", dropped=dropped)
        return accepted

    def depth(self) -> int:
        """Jobs waiting in the queue."""
        with self._cond:
            return sum(1 for job in self._queue if job is not None)

    def poke(self) -> None:
        """Ask the worker to write the stats file (after a counter changed)."""
        with self._cond:
            self._queue.append(None)
            self._cond.notify()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queue is empty and nothing is in progress; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Finish what is queued and stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # -- worker side

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._busy = True
            try:
                if job is not None:
                    self._learn(job)
            except Exception as exc:
                self.counters.add("errors")
                self.counters.add(f"errors.{type(exc).__name__}")
                _log.warning("agentspec_litellm_learn_failed", error=type(exc).__name__)
                _log.debug("agentspec_litellm_learn_failed", detail=self._scrub(str(exc))[:500])
            finally:
                with self._cond:
                    idle = not self._queue
                if idle:
                    self._write_stats()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _learn(self, job: Job) -> None:
        out = job.outputs
        lead = out.prompt_ids[-self._lead :] if out.prompt_ids and self._lead else []
        encoder = self._encoders.get(job.model or "") or self._encoders.get("*")
        for ids, text in zip(out.token_ids, out.texts, strict=True):
            seq: Sequence[int] | None = None
            if ids:
                seq = lead + ids
            elif encoder is not None and text:
                seq = list(encoder(text))
            if not seq:
                self.counters.add("unlearned")
                self._warn_once(job.model)
                continue
            if self.store is None:
                self.counters.add("not_stored")  # no store (none configured, or it failed)
                continue
            self.store.learn(job.key, seq, identity=job.identity)
            self.counters.add("learned")
            if self._metrics is not None:
                self._metrics.learned_sequence(job.key)
            self.counters.add("learned_tokens", len(seq))

    def _warn_once(self, model: str | None) -> None:
        name = model or ""
        if name in self._warned:
            return
        self._warned.add(name)
        _log.warning(
            "agentspec_litellm_no_token_ids",
            model=model,
            hint="the upstream returned no token ids and no tokenizer is configured for "
            "this model group, so its answers are not learned",
        )

    def _write_stats(self) -> None:
        if self._stats_file is None:
            return
        try:
            data: dict[str, Any] = {"counters": self.counters.snapshot()}
            if self.store is not None:
                shards = []
                for key in sorted(self.store.keys(), key=str):
                    st = self.store.stats(key)
                    shards.append(
                        {"key": list(key), "sequences": st.sequences, "tokens": st.tokens}
                    )
                data["shards"] = shards
                if self.store.fleet is not None:
                    data["fleet"] = _fleet_stats(self.store)
            tmp = self._stats_file.with_name(f".{self._stats_file.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self._stats_file)
        except Exception as exc:
            self.counters.add("errors")
            _log.warning("agentspec_litellm_stats_write_failed", error=type(exc).__name__)


def _fleet_stats(store: ShardStore) -> dict[str, Any]:
    """The store's fleet outbox for the stats file (the Redis URL's password as ``***``)."""
    from agentspec_litellm.config import redacted_url

    fleet = store.fleet
    assert fleet is not None
    st = fleet.stats()
    pub = st.publisher
    return {
        "redis": redacted_url(fleet.options.url),
        "pending": st.pending,
        "settled": st.settled,
        "rejected": st.rejected,
        "connected": pub.connected,
        "published": pub.published,
        "failures": pub.failures,
        "last_error": pub.last_error,
    }
