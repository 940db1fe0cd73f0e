"""A `ShardStore`'s journal as the fleet's outbox: what each shard still has to publish.

Design.  A store with a fleet (``ShardStore(redis=...)``) journals each
learned sequence as an ``ADD_ID`` record: the tokens plus the request
identity the fleet id is computed from (`agentspec._fleet.ids`).  So the
journal already holds, durably and before `learn` returns, everything the
outbox needs; nothing is copied elsewhere.  Per shard, `ShardOutbox` keeps:

- ``published``, the watermark: every sequence up to this id is settled,
  i.e. Redis holds it durably (the publisher's verified window, see
  `agentspec._fleet.window`), Redis refused it for good, or the store evicted
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

`agentspec._store.outbox_source.StoreOutboxSource` is the store side of
`agentspec._store.fleet_outbox.FleetOutbox`:
it takes pending sequences (with their tokens read from the tree under the
store's lock), marks the ones the publisher took, and settles what the
publisher reports durable.
"""

from __future__ import annotations

import array
from collections.abc import Iterable
from dataclasses import dataclass

from agentspec._core.shardkey import ShardKey
from agentspec._util.log import get_logger

__all__ = ["OutboxItem", "ShardOutbox"]

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
