"""`StoreOutboxSource`: the store's side of its fleet outbox thread.

The outbox thread (`agentspec._store.fleet_outbox.FleetOutbox`) takes pending
sequences from here (their tokens read from the tree under the store's lock),
marks the ones the publisher took, and settles what the publisher reports
durable, which raises each shard's published watermark (`ShardOutbox`, see
`agentspec._store.outbox` for the design).
"""

from __future__ import annotations

import array
import threading
from collections.abc import Iterable

from agentspec._core.shardkey import ShardKey
from agentspec._store.journal import encode_published
from agentspec._store.outbox import OutboxItem
from agentspec._store.shard import Shard
from agentspec._util.log import get_logger

__all__ = ["StoreOutboxSource"]

_log = get_logger()


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
