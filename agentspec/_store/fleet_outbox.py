"""`FleetOutbox`: publishes what a `ShardStore` learns, with the store's journal as outbox.

Design.  The store keeps, per shard, the sequences it still has to publish
(`agentspec._store.outbox`: identities in the journal, a published
watermark).  This module moves them to Redis without ever blocking
learning:

- `ShardStore.learn` notes the new sequence and calls `kick` (no I/O);
- the outbox thread takes pending sequences from the store (tokens read
  from the tree under the store's lock), makes their fleet entries, and
  offers them to a `FleetPublisher` (bounded; when it is full the thread
  waits for room, and the rest stays pending in the store);
- the publisher reports an entry durable (``on_durable``: acknowledged
  and verified by its durability window, `agentspec._fleet.window`) or
  refused for good (``on_rejected``); either settles the sequence in the
  store, which raises the shard's watermark and journals it.

Nothing acknowledged by the store is lost: Redis down means sequences stay
pending (in memory and in the journal) and go out when it is back; a
crash of this process means the reopened store republishes everything
above the watermarks; Redis losing acknowledged writes means the window
resends them.  Every resend is idempotent: the fleet id is a hash of
(key, identity, tokens), so a copy that arrives twice is learned once.

Lock order: store lock and outbox condition are never held together by
this thread; the publisher calls back without its own lock held.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from agentspec._core.shardkey import ShardKey
from agentspec._fleet.config import FleetConfig
from agentspec._fleet.entry import FleetEntry
from agentspec._fleet.pub import FleetPublisher, Published, PublishStatus
from agentspec._fleet.stats import PublisherStats
from agentspec._store.outbox import OutboxItem
from agentspec._util.args import as_int
from agentspec._util.log import get_logger
from agentspec.exceptions import InvalidArgumentError

__all__ = ["FleetOptions", "FleetOutbox", "OutboxSource", "OutboxStats"]

_log = get_logger()


@dataclass(frozen=True, slots=True)
class FleetOptions:
    """How a `ShardStore` publishes to the fleet.

    Attributes:
        url: Redis URL (``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://``);
            never shown in reprs.
        config: the tenant config written where Redis has none yet.
        durable_after: the publisher's durability window, seconds (see
            `agentspec._fleet.window`); 3 suits ``appendfsync everysec``, 0
            trusts every acknowledgement (``appendfsync always``).
        max_pending: most entries the publisher holds (queued, in flight or
            in the window); the rest waits in the store.
        batch: entries per pipelined send (and per take from the store).
        max_backoff: longest wait between attempts to reach Redis, seconds.
        close_timeout: how long `ShardStore.close` lets queued entries go
            out; what is left is republished when the store opens again.
    """

    url: str = field(repr=False)
    config: FleetConfig = field(default_factory=FleetConfig)
    durable_after: float = 3.0
    max_pending: int = 10_000
    batch: int = 128
    max_backoff: float = 2.0
    close_timeout: float = 2.0

    def __post_init__(self) -> None:
        """Validate the fields."""
        if not isinstance(self.url, str) or not self.url:
            raise InvalidArgumentError("the fleet needs a Redis URL (a non-empty str)")
        for name in ("durable_after", "max_backoff", "close_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, not {type(value).__name__}")
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgumentError(f"{name} must be >= 0 seconds", f"got {value}")
        as_int(self.max_pending, "max_pending", 1)
        as_int(self.batch, "batch", 1)


class OutboxSource(Protocol):
    """The store's side (`agentspec._store.outbox_source.StoreOutboxSource`)."""

    def take(self, limit: int) -> list[OutboxItem]:
        """Up to ``limit`` unsent sequences (they stay unsent until `mark_sent`)."""

    def mark_sent(self, items: Iterable[OutboxItem]) -> None:
        """The publisher took these."""

    def settle(self, done: Iterable[tuple[ShardKey, int]]) -> None:
        """These are durably in the fleet, or never will be."""

    def pending(self) -> int:
        """Sequences not settled yet."""


@dataclass(frozen=True, slots=True)
class OutboxStats:
    """The outbox at one moment.

    Attributes:
        pending: sequences the store has not settled (all shards).
        handed: entries handed to the publisher (resends after a restart included).
        settled: sequences settled as durable in the fleet.
        rejected: sequences Redis refused for good, or too large for an entry.
        publisher: the publisher's own stats.
    """

    pending: int
    handed: int
    settled: int
    rejected: int
    publisher: PublisherStats


class FleetOutbox:
    """The thread that drains a store's pending sequences into a `FleetPublisher`."""

    def __init__(self, options: FleetOptions, source: OutboxSource) -> None:
        """Start the publisher and the outbox thread (they wait for `kick`)."""
        self.options = options
        self._source = source
        self._cond = threading.Condition()
        self._work = True  # the store may hold pending sequences from its files
        self._stop = False
        self._freed = 0  # entries settled or refused: the publisher has room again
        self._refs: dict[int, tuple[FleetEntry, ShardKey, int]] = {}
        self._n = dict.fromkeys(("handed", "settled", "rejected"), 0)
        self._publisher = FleetPublisher(
            options.url,
            config=options.config,
            max_pending=options.max_pending,
            batch=options.batch,
            max_backoff=options.max_backoff,
            durable_after=options.durable_after,
            on_published=self._on_published,
            on_durable=self._on_durable,
            on_rejected=lambda e: self._on_done([e], rejected=True),
        )
        self._thread = threading.Thread(target=self._run, name="agentspec-outbox", daemon=True)
        self._thread.start()

    # --- callers --------------------------------------------------------------

    def kick(self) -> None:
        """The store has new pending sequences (never blocks on Redis)."""
        with self._cond:
            self._work = True
            self._cond.notify_all()

    def stats(self) -> OutboxStats:
        """Counters, the store's pending count and the publisher's stats."""
        pending = self._source.pending()
        with self._cond:
            n = dict(self._n)
        return OutboxStats(
            pending, n["handed"], n["settled"], n["rejected"], self._publisher.stats()
        )

    def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds (checked at each acknowledgement and settlement)."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def flush(self, timeout: float) -> bool:
        """Wait until every sequence the store learned is settled; False on timeout."""
        return self.wait_until(lambda: self._source.pending() == 0, timeout)

    def close(self) -> None:
        """Stop the thread and the publisher (after ``close_timeout``); pending stays pending."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        self._publisher.close(self.options.close_timeout)

    def __enter__(self) -> FleetOutbox:
        """Use in a ``with`` block; closed on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the outbox."""
        self.close()

    # --- publisher callbacks (publisher thread) ---------------------------------

    def _on_published(self, _: Published) -> None:
        with self._cond:  # wakes `wait_until` callers watching the publisher's counts
            self._cond.notify_all()

    def _on_durable(self, entries: list[FleetEntry]) -> None:
        self._on_done(entries, rejected=False)

    def _on_done(self, entries: list[FleetEntry], *, rejected: bool) -> None:
        done: list[tuple[ShardKey, int]] = []
        with self._cond:
            for e in entries:
                ref = self._refs.pop(id(e), None)
                if ref is not None:
                    done.append((ref[1], ref[2]))
        self._source.settle(done)
        with self._cond:
            self._n["rejected" if rejected else "settled"] += len(entries)
            self._freed += len(entries)
            self._cond.notify_all()

    # --- the thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._work)
                if self._stop:
                    return
                self._work = False
            try:
                self._drain()
            except Exception as e:  # never let the thread die; the journal keeps everything
                _log.error("agentspec fleet: outbox failed", error=repr(e)[:300])
                with self._cond:
                    self._work = True
                    self._cond.wait(1.0)

    def _drain(self) -> None:
        """Offer pending sequences until none is left, the publisher is full, or stop."""
        batch = self.options.batch
        while True:
            with self._cond:
                if self._stop:
                    return
                freed = self._freed
            items = self._source.take(batch)
            if not items:
                return
            taken: list[OutboxItem] = []
            refused: list[tuple[ShardKey, int]] = []
            full = False
            for it in items:
                entry = FleetEntry.make(it.key, it.identity, it.tokens)
                with self._cond:
                    self._refs[id(entry)] = (entry, it.key, it.seq_id)
                try:
                    status = self._publisher.offer(entry)
                except InvalidArgumentError:
                    status = None
                    refused.append((it.key, it.seq_id))
                if status is PublishStatus.QUEUED:
                    taken.append(it)
                    continue
                with self._cond:
                    self._refs.pop(id(entry), None)
                if status is not None:  # FULL, or CLOSED while stopping
                    full = True
                    break
            self._source.mark_sent(taken)
            if refused:
                _log.warning("agentspec fleet: sequences too large to publish", n=len(refused))
                self._source.settle(refused)
            with self._cond:
                self._n["handed"] += len(taken)
                self._n["rejected"] += len(refused)
                if full:
                    self._work = True
                    self._cond.wait_for(
                        lambda: self._stop or self._freed != freed  # noqa: B023 (called at once)
                    )
                    return
            if len(items) < batch:
                return
