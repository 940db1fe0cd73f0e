"""A `ShardStore`'s journal as the fleet's outbox: what each shard still has to publish.

Design.  A store with a fleet (``ShardStore(redis=...)``) journals each
learned sequence as an ``ADD_ID`` record: the tokens plus the request
identity the fleet id is computed from (`agentspec._fleet_ids`).  So the
journal already holds, durably and before `learn` returns, everything the
outbox needs; nothing is copied elsewhere.  Per shard, `ShardOutbox` keeps:

- ``published``, the watermark: every sequence up to this id is settled,
  i.e. Redis holds it durably (the publisher's verified window, see
  `agentspec._fleet_window`), Redis refused it for good, or the store evicted
  it first.  It only grows, and it is persisted as a ``PUBLISHED`` journal
  record (no fsync: losing one only republishes, which the fleet ids make
  harmless) and in ``snapshot.json`` when the journal is compacted;
- ``unsent`` / ``sent``: identities of the sequences above the watermark,
  not yet handed to the publisher / handed and not yet settled, both in id
  order (ids only grow, and sequences are handed over oldest first), so
  the watermark is the lowest pending id less one.

At open the pending set is rebuilt from ``snapshot.json``'s ``outbox`` list
and the journal tail's ``ADD_ID`` records above the watermark whose
sequence is still in the tree, and all of it is republished.  A sequence
evicted by the byte budget before it was published is not published.  A
store without a fleet writes plain ``ADD`` records, and what it learns is
never published (sequences are published iff learned with a fleet).

`StoreOutboxSource` is the store side of `agentspec._fleet_outbox.FleetOutbox`:
it takes pending sequences (with their tokens read from the tree under the
store's lock), marks the ones the publisher took, and settles what the
publisher reports durable.
"""

from __future__ import annotations

import array
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentspec._journal import encode_published
from agentspec._log import get_logger
from agentspec._shardkey import ShardKey
from agentspec.exceptions import InvalidArgumentError

if TYPE_CHECKING:
    from agentspec._fleet_outbox import FleetOptions, FleetOutbox
    from agentspec._store_shard import Shard

__all__ = [
    "REDIS_URL_ENV",
    "OutboxItem",
    "ShardOutbox",
    "StoreOutboxSource",
    "fleet_options",
    "start_outbox",
]

#: The environment variable a `ShardStore` reads its Redis URL from by default.
REDIS_URL_ENV = "AGENTSPEC_REDIS_URL"

_log = get_logger()


class ShardOutbox:
    """One shard's published watermark and pending sequences (see the module docstring)."""

    __slots__ = ("published", "sent", "unsent")

    def __init__(self, published: int = 0, pending: Iterable[tuple[int, str]] = ()) -> None:
        """Pending sequences above ``published`` start as unsent."""
        self.published = published
        self.unsent: dict[int, str] = dict(sorted(p for p in pending if p[0] > published))
        self.sent: dict[int, str] = {}

    def __len__(self) -> int:
        """Sequences not settled yet."""
        return len(self.unsent) + len(self.sent)

    def add(self, seq_id: int, identity: str) -> None:
        """A newly learned sequence (its id is above every pending one)."""
        self.unsent[seq_id] = identity

    def drop(self, seq_id: int) -> None:
        """Forget a sequence (evicted or settled)."""
        if self.unsent.pop(seq_id, None) is None:
            self.sent.pop(seq_id, None)

    def settle(self, seq_ids: Iterable[int], next_seq: int) -> bool:
        """Forget settled sequences and raise the watermark; True when it moved."""
        for sid in seq_ids:
            self.drop(sid)
        low = next_seq
        for d in (self.sent, self.unsent):
            if d:
                low = min(low, next(iter(d)))
        if low - 1 > self.published:
            self.published = low - 1
            return True
        return False

    def items(self) -> list[tuple[int, str]]:
        """``(seq_id, identity)`` of every pending sequence, in id order."""
        return sorted([*self.sent.items(), *self.unsent.items()])


@dataclass(frozen=True, slots=True)
class OutboxItem:
    """A pending sequence handed to the outbox thread: key, id, identity and tokens."""

    key: ShardKey
    seq_id: int
    identity: str
    tokens: array.array[int]


class StoreOutboxSource:
    """The store's side of the outbox thread; every method takes the store's lock."""

    def __init__(self, lock: threading.Lock, shards: dict[ShardKey, Shard]) -> None:
        """Work on the store's shards under its lock."""
        self._lock = lock
        self._shards = shards
        self._waiting: dict[ShardKey, None] = {}  # shards with unsent sequences (ordered set)

    def wake(self, key: ShardKey) -> None:
        """Note that ``key`` has unsent sequences (store lock held by the caller)."""
        self._waiting[key] = None

    def wake_all(self) -> None:
        """Note every shard with unsent sequences (at open; store lock held)."""
        for key, shard in self._shards.items():
            if shard.outbox.unsent:
                self._waiting[key] = None

    def take(self, limit: int) -> list[OutboxItem]:
        """Up to ``limit`` unsent sequences, oldest first per shard, shards in turn.

        They stay unsent until `mark_sent`; a sequence no longer in the
        tree is settled here instead.  A shard taken from goes to the back
        of the line, so one large backlog does not hold the others up.
        """
        out: list[OutboxItem] = []
        with self._lock:
            for key in list(self._waiting):
                if len(out) >= limit:
                    break
                del self._waiting[key]
                shard = self._shards.get(key)
                if shard is None or not shard.outbox.unsent:
                    continue
                gone: list[int] = []
                for sid, identity in shard.outbox.unsent.items():
                    if len(out) >= limit:
                        break
                    if sid in shard.tree:
                        tokens = array.array("i", shard.tree.sequence(sid))
                        out.append(OutboxItem(key, sid, identity, tokens))
                    else:
                        gone.append(sid)
                if gone:
                    self._settle_locked(shard, gone)
                if shard.outbox.unsent:
                    self._waiting[key] = None  # back of the line
        return out

    def mark_sent(self, items: Iterable[OutboxItem]) -> None:
        """The publisher took these: move them from unsent to sent."""
        with self._lock:
            for it in items:
                shard = self._shards.get(it.key)
                if shard is None:
                    continue
                ident = shard.outbox.unsent.pop(it.seq_id, None)
                if ident is not None:
                    shard.outbox.sent[it.seq_id] = ident
                if not shard.outbox.unsent:
                    self._waiting.pop(it.key, None)

    def settle(self, done: Iterable[tuple[ShardKey, int]]) -> None:
        """Sequences now durably in the fleet (or refused for good): raise the watermarks."""
        by_key: dict[ShardKey, list[int]] = {}
        for key, sid in done:
            by_key.setdefault(key, []).append(sid)
        with self._lock:
            for key, sids in by_key.items():
                shard = self._shards.get(key)
                if shard is not None:
                    self._settle_locked(shard, sids)

    def pending(self) -> int:
        """Sequences of all shards not settled yet."""
        with self._lock:
            return sum(len(s.outbox) for s in self._shards.values())

    @staticmethod
    def _settle_locked(shard: Shard, sids: list[int]) -> None:
        if not shard.outbox.settle(sids, shard.next_seq) or shard.journal is None:
            return
        try:
            shard.journal.append(encode_published(shard.outbox.published), 1, sync=False)
        except OSError as e:  # the next marker or compaction records it
            _log.warning("agentspec shard store: cannot journal the fleet watermark", error=str(e))


def fleet_options(redis: object) -> FleetOptions | None:
    """The store's ``redis=`` argument as options (None: no fleet).

    None reads ``AGENTSPEC_REDIS_URL`` (unset or empty: no fleet); False
    means no fleet whatever the environment says.

    Raises:
        InvalidArgumentError: anything else than a URL, `FleetOptions`, None or False,
            or the ``redis`` package is missing (``pip install agentspec[fleet]``).
    """
    if redis is False:
        return None
    if redis is None:
        redis = os.environ.get(REDIS_URL_ENV) or None
        if redis is None:
            return None
    try:
        from agentspec._fleet_outbox import FleetOptions
    except ImportError as e:
        raise InvalidArgumentError(
            "ShardStore(redis=...) needs the redis package: pip install 'agentspec[fleet]'",
            str(e),
        ) from None
    if isinstance(redis, str):
        return FleetOptions(redis)
    if isinstance(redis, FleetOptions):
        return redis
    raise InvalidArgumentError(
        "redis must be a Redis URL, FleetOptions, None or False", f"got {type(redis).__name__}"
    )


def start_outbox(
    options: FleetOptions, lock: threading.Lock, shards: dict[ShardKey, Shard]
) -> tuple[FleetOutbox, StoreOutboxSource]:
    """The outbox thread of a store, already told about the pending sequences of its files."""
    from agentspec._fleet_outbox import FleetOutbox

    source = StoreOutboxSource(lock, shards)
    with lock:
        source.wake_all()
    return FleetOutbox(options, source), source
