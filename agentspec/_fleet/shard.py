"""One shard of a fleet subscriber: its tree and the state that makes replicas agree.

A shard's state is a pure function of the stream entries applied to it, in
stream order, and of the snapshot it started from, so every replica that
has read the stream up to the same id holds the same sequences:

- an entry whose id is already live, or among the ``gone`` ring of the
  last `GONE_RING` evicted ids, is a duplicate and changes nothing;
- otherwise its sequence is added last, and while the shard holds more than
  the tenant's token budget, its oldest sequence goes (the newest always
  stays), exactly like `Speculator`'s ``max_shard_tokens``;
- a snapshot stores the tree (whose `SuffixTree.sequence_ids` order is the
  arrival order, kept by `to_bytes`) and the ``gone`` ring, so a replica that
  starts from it continues exactly where the writer was.

``through`` is the stream id the shard's state already reflects (its
snapshot's covered id): entries up to it are skipped.  ``dirty`` says the
shard changed since its snapshot was stored, so a compaction round writes
only what changed.  ``last_id`` is the
last entry that touched the shard (a compactor may keep a stored snapshot
that covers it instead of writing a new one).

Drafting threads read ``tree`` at any time and never wait (left-right
double buffering): a shard keeps two identical trees.  Readers get the
front one; the subscriber applies a batch of entries to the back one,
swaps the two (`sync`), then replays the batch on the new back one, once
the readers that took it before the swap have left (a tree refuses a
change while a reader is inside it, so the change is retried,
`busy_retry`).  A reader that looks the tree up per draft therefore never
holds the writer up for longer than one draft, however many readers
there are; the price is twice the memory of one tree.
"""

from __future__ import annotations

import array
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from agentspec._core.shardkey import ShardKey
from agentspec._core.tree import SuffixTree
from agentspec._fleet.entry import FleetEntry
from agentspec._fleet.ids import ZERO, StreamId
from agentspec.exceptions import InvalidArgumentError

__all__ = ["GONE_RING", "FleetShard", "busy_retry"]

#: Evicted ids remembered per shard, so a late duplicate of one is still skipped.
GONE_RING = 1024

_T = TypeVar("_T")


def busy_retry(fn: Callable[[], _T]) -> _T:
    """Call ``fn`` until no drafting thread is inside the tree it changes."""
    pause = 1e-6
    while True:
        try:
            return fn()
        except RuntimeError as e:
            if "concurrent modification" not in str(e):
                raise
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def _pack_ids(ids: deque[int]) -> bytes:
    a = array.array("q", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _unpack_ids(data: bytes) -> list[int]:
    if len(data) % 8:
        raise InvalidArgumentError("snapshot gone ring is not a list of int64")
    a = array.array("q")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


class FleetShard:
    """The trees of one shard key plus its order, budget bookkeeping and positions."""

    __slots__ = (
        "_front",
        "_pending",
        "_trees",
        "applied",
        "dirty",
        "duplicates",
        "evicted",
        "gone",
        "gone_set",
        "key",
        "last_id",
        "live",
        "nbytes",
        "order",
        "through",
        "tokens",
    )

    def __init__(
        self,
        key: ShardKey,
        tree: SuffixTree,
        through: StreamId = ZERO,
        twin: SuffixTree | None = None,
    ) -> None:
        """A shard over ``tree`` (order and sizes are read from it); ``twin``: its copy."""
        self.key = key
        self._trees = [tree, twin if twin is not None else SuffixTree.from_bytes(tree.to_bytes())]
        self._front = 0
        self._pending: list[tuple[int, array.array[int] | None]] = []  # (id, tokens | None: remove)
        self.through = through
        self.last_id = through
        self.order: deque[tuple[int, int]] = deque(
            (sid, len(tree.sequence(sid))) for sid in tree.sequence_ids()
        )
        self.live = {sid for sid, _ in self.order}
        self.tokens = sum(n for _, n in self.order)
        self.gone: deque[int] = deque(maxlen=GONE_RING)
        self.gone_set: set[int] = set()
        self.applied = self.duplicates = self.evicted = 0
        #: Whether the shard changed since its snapshot was stored (or loaded).
        self.dirty = False
        #: Bytes both trees hold (as of the last `sync`).
        self.nbytes = 2 * tree.stats().bytes

    @classmethod
    def empty(cls, key: ShardKey, depth: int) -> FleetShard:
        """A shard with no sequence."""
        return cls(key, SuffixTree(depth), twin=SuffixTree(depth))

    @classmethod
    def from_snapshot(
        cls, key: ShardKey, data: bytes, gone: bytes, covered: StreamId, depth: int
    ) -> FleetShard:
        """A shard from stored snapshot fields.

        Raises:
            ShardFormatError (or a subclass): bad snapshot bytes.
            InvalidArgumentError: the tree's depth is not ``depth``, or a bad ring.
        """
        ring = _unpack_ids(gone)[-GONE_RING:]
        tree = SuffixTree.from_bytes(data)
        if tree.max_depth != depth:
            tree.close()
            raise InvalidArgumentError("snapshot depth differs from the tenant's")
        shard = cls(key, tree, covered, SuffixTree.from_bytes(data))
        for sid in ring:
            shard._remember_gone(sid)
        return shard

    @property
    def tree(self) -> SuffixTree:
        """The tree readers draft from (it changes only at `sync`)."""
        return self._trees[self._front]

    def snapshot(self) -> tuple[bytes, bytes]:
        """``(tree snapshot bytes, gone ring bytes)``; call after `sync`."""
        assert not self._pending
        return self._trees[1 - self._front].to_bytes(), _pack_ids(self.gone)

    def _remember_gone(self, sid: int) -> None:
        if len(self.gone) == self.gone.maxlen:
            self.gone_set.discard(self.gone[0])
        self.gone.append(sid)
        self.gone_set.add(sid)

    def apply(self, entry: FleetEntry, entry_id: StreamId, budget: int | None) -> bool:
        """Apply a validated entry read at ``entry_id`` (visible after `sync`); False: duplicate."""
        self.last_id = entry_id
        sid = entry.seq_id
        if sid in self.live or sid in self.gone_set:
            self.duplicates += 1
            return False
        self.dirty = True
        self._change(sid, entry.tokens)
        self.order.append((sid, len(entry.tokens)))
        self.live.add(sid)
        self.tokens += len(entry.tokens)
        self.applied += 1
        while budget is not None and self.tokens > budget and len(self.order) > 1:
            old, size = self.order.popleft()
            self._change(old, None)
            self.live.discard(old)
            self.tokens -= size
            self.evicted += 1
            self._remember_gone(old)
        return True

    def _change(self, sid: int, tokens: array.array[int] | None) -> None:
        _replay(self._trees[1 - self._front], [(sid, tokens)])
        self._pending.append((sid, tokens))

    def sync(self) -> None:
        """Show the applied entries to readers, then bring the other tree level."""
        if not self._pending:
            return
        self._front = 1 - self._front
        _replay(self._trees[1 - self._front], self._pending)
        self._pending = []
        self.nbytes = self._trees[0].stats().bytes + self._trees[1].stats().bytes


def _replay(tree: SuffixTree, ops: list[tuple[int, array.array[int] | None]]) -> None:
    for sid, tokens in ops:
        if tokens is None:
            busy_retry(lambda: tree.remove(sid))  # noqa: B023 (called at once)
        else:
            busy_retry(lambda: tree.add(sid, tokens))  # noqa: B023 (called at once)
