"""One shard of a `ShardStore` in memory: its tree, bookkeeping and change log."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agentspec._core.shardkey import ShardKey
from agentspec._core.tree import SuffixTree
from agentspec._store.files import (
    JOURNAL,
    SnapshotMeta,
    create_shard_dir,
    replace_shard_dir,
    write_snapshot,
)
from agentspec._store.journal import ADD, REMOVE, JournalWriter, encode_remove
from agentspec._store.outbox import ShardOutbox
from agentspec._util.log import get_logger

__all__ = ["Shard", "ShardStats", "oldest_shard"]

_log = get_logger()


@dataclass(frozen=True, slots=True)
class ShardStats:
    """Size and position of one shard at one moment.

    Attributes:
        key: the shard key ``(tenant, pipeline, stage)``.
        sequences: live sequences.
        tokens: tokens in live sequences.
        bytes: bytes the shard's tree holds from the allocator.
        version: the shard's version (it grows with every change).
        first_seq: id of the oldest live sequence (None when empty).
        last_seq: id of the newest live sequence (None when empty).
        evicted: sequences evicted by the store's byte budget so far.
    """

    key: ShardKey
    sequences: int
    tokens: int
    bytes: int
    version: int
    first_seq: int | None
    last_seq: int | None
    evicted: int


class Shard:
    """The state of one shard; the store's lock guards every use.

    ``order`` maps each live sequence id to its stamp (the store version at
    which it arrived), oldest first: the eviction order.  ``log`` holds
    ``(version, ADD | REMOVE, seq_id)`` of recent changes, complete for all
    versions above ``floor``.  ``outbox`` is what the shard still has to
    publish to the fleet (`agentspec._store.outbox`).
    """

    __slots__ = (
        "directory",
        "dirty",
        "evicted",
        "floor",
        "journal",
        "key",
        "live_bytes",
        "log",
        "next_seq",
        "order",
        "outbox",
        "tree",
        "version",
    )

    def __init__(
        self,
        key: ShardKey,
        tree: SuffixTree,
        *,
        next_seq: int = 1,
        version: int = 0,
        evicted: int = 0,
        order: dict[int, int] | None = None,
        directory: Path | None = None,
        journal: JournalWriter | None = None,
        outbox: ShardOutbox | None = None,
    ) -> None:
        """A shard with an empty change log starting at ``version``."""
        self.key = key
        self.tree = tree
        self.next_seq = next_seq
        self.version = version
        self.evicted = evicted
        self.order: dict[int, int] = {} if order is None else order
        self.directory = directory
        self.journal = journal
        self.outbox = outbox if outbox is not None else ShardOutbox()
        self.log: deque[tuple[int, int, int]] = deque()
        self.floor = version
        self.dirty = False
        self.live_bytes = 0
        self.refresh_bytes()

    def refresh_bytes(self) -> int:
        """Re-measure the tree's live bytes; return the change.

        Live bytes are the allocator bytes less free node slots (which the
        tree reuses before taking new memory): what the byte budget counts.
        """
        s = self.tree.stats()
        old, self.live_bytes = self.live_bytes, s.bytes - s.free_bytes
        return self.live_bytes - old

    def note(self, version: int, op: int, seq_id: int, limit: int) -> None:
        """Record a change in the bounded change log."""
        self.version = version
        log = self.log
        log.append((version, op, seq_id))
        while len(log) > limit:
            self.floor = log.popleft()[0]

    def reset_log(self, version: int) -> None:
        """Forget the change log: deltas from before ``version`` are gone."""
        self.version = version
        self.log.clear()
        self.floor = version

    def delta_since(self, version: int) -> bytes | None:
        """Native delta bytes from ``version`` to now, or None when not kept."""
        if version == self.version:
            return self.tree.delta_bytes((), ())
        if version > self.version or version < self.floor:
            return None
        added: dict[int, None] = {}
        removed: dict[int, None] = {}
        changes = []
        for entry in reversed(self.log):
            if entry[0] <= version:
                break
            changes.append(entry)
        for _, op, sid in reversed(changes):
            if op == ADD:
                added[sid] = None
            else:
                removed[sid] = None
                added.pop(sid, None)
        tree = self.tree
        return tree.delta_bytes([s for s in added if s in tree], list(removed))

    def stats(self) -> ShardStats:
        """The shard's `ShardStats`."""
        s = self.tree.stats()
        first = next(iter(self.order), None)
        last = next(reversed(self.order), None) if self.order else None
        return ShardStats(
            key=self.key,
            sequences=s.sequences,
            tokens=s.tokens,
            bytes=s.bytes,
            version=self.version,
            first_seq=first,
            last_seq=last,
            evicted=self.evicted,
        )

    def meta(self) -> SnapshotMeta:
        """The bookkeeping to store next to a snapshot of the shard."""
        return SnapshotMeta(
            key=self.key,
            max_depth=self.tree.max_depth,
            next_seq=self.next_seq,
            version=self.version,
            evicted=self.evicted,
            order=list(self.order.items()),
            published=self.outbox.published,
            outbox=self.outbox.items(),
        )

    # --- disk -----------------------------------------------------------------

    def write_dir(self, shards_dir: Path, fsync: bool, old: Shard | None = None) -> None:
        """Persist the shard as a new directory (replacing ``old``'s), with an empty journal.

        The directory's appearance is the commit: on an exception the store
        on disk is unchanged.
        """
        if old is None:
            d = create_shard_dir(shards_dir, self.tree.to_bytes(), self.meta(), fsync)
        else:
            d = replace_shard_dir(shards_dir, self.tree.to_bytes(), self.meta(), fsync)
            if old.journal is not None:
                old.journal.close()
        self.directory = d
        self.journal = JournalWriter(d / JOURNAL, size=0, crc=0, count=0, fsync=fsync)

    def compact(self, fsync: bool) -> None:
        """Write the shard's snapshot atomically, then empty its journal."""
        journal, directory = self.journal, self.directory
        if journal is None or directory is None:
            return
        data = self.tree.to_bytes()
        write_snapshot(directory, data, self.meta(), fsync, journal.size, journal.crc)
        journal.reset()
        self.dirty = False

    def evict_oldest(self, version: int, log_limit: int) -> int:
        """Remove the oldest sequence (journaled, not synced); return the live-byte change.

        Raises:
            RuntimeError: another thread reads the tree (nothing changes).
        """
        sid = next(iter(self.order))
        self.tree.remove(sid)
        if self.journal is not None:
            try:
                self.journal.append(encode_remove(sid), 1, sync=False)
            except OSError as e:  # it comes back at the next open, and goes again
                _log.error("agentspec shard store: cannot journal an eviction", error=str(e))
        del self.order[sid]
        self.outbox.drop(sid)  # evicted before it was published: it never will be
        self.evicted += 1
        self.note(version, REMOVE, sid, log_limit)
        return self.refresh_bytes()


def oldest_shard(shards: Iterable[Shard]) -> Shard | None:
    """The shard holding the store's oldest sequence (None when all are empty)."""
    victim: Shard | None = None
    oldest = 0
    for s in shards:
        if s.order:
            stamp = next(iter(s.order.values()))
            if victim is None or stamp < oldest:
                victim, oldest = s, stamp
    return victim
