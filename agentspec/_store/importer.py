"""The new state of a shard after `ShardStore.import_shard` (computed in memory)."""

from __future__ import annotations

import struct
from collections import deque

from agentspec._core.shardkey import ShardKey
from agentspec._core.tree import SuffixTree
from agentspec._store.journal import ADD, REMOVE
from agentspec._store.outbox import ShardOutbox
from agentspec._store.shard import Shard
from agentspec.exceptions import DepthMismatchError, InvalidArgumentError, ShardFormatError

__all__ = ["imported_shard", "incoming_tree"]

_DELTA_KIND = 1
_HEADER_BYTES = 48  # native shard header: magic, version, kind, depth, counts, checksum


def incoming_tree(data: bytes) -> tuple[SuffixTree, list[int] | None]:
    """Validate shard bytes into a fresh tree; also the removal ids of a delta.

    Raises:
        ShardFormatError (or a subclass): malformed bytes.
    """
    if len(data) >= _HEADER_BYTES and data[:4] == b"ASHD":
        kind, depth = struct.unpack_from("<HI", data, 6)
        if kind == _DELTA_KIND:
            try:
                tree = SuffixTree(depth)
            except (InvalidArgumentError, TypeError):
                raise ShardFormatError("shard header: max_depth out of range", depth) from None
            tree.load(data)  # validates everything before use
            (n_rem,) = struct.unpack_from("<Q", data, 24)
            return tree, list(struct.unpack_from(f"<{n_rem}q", data, _HEADER_BYTES))
    return SuffixTree.from_bytes(data), None


def _merged_tree(old: SuffixTree, raw: bytes, incoming: SuffixTree, is_delta: bool) -> SuffixTree:
    """A copy of ``old`` with the shard bytes merged in."""
    tree = SuffixTree.from_bytes(old.to_bytes())
    if is_delta:
        tree.load(raw)
        return tree
    if incoming.max_depth != tree.max_depth:
        raise DepthMismatchError(
            "shard max_depth differs from the store's shard",
            f"{incoming.max_depth} != {tree.max_depth}",
        )
    for sid in incoming.sequence_ids():
        if sid not in tree:
            tree.add(sid, incoming.sequence(sid))
    return tree


def imported_shard(
    key: ShardKey, raw: bytes, old: Shard | None, *, replace: bool, version: int, log_limit: int
) -> Shard:
    """The shard ``key`` becomes when ``raw`` is imported at ``version``.

    Replacing (or creating) takes the bytes' sequences and starts a fresh
    change log; merging keeps the old sequences' order and stamps, logs the
    removed and added ids, and treats ids a delta removes and re-adds as new.
    ``old`` is not modified.  The fleet outbox keeps the old watermark and,
    when merging, the pending sequences still in the tree untouched by the
    import (imported sequences are never published: they came from elsewhere).

    Raises:
        ShardFormatError (or a subclass): bad bytes or a depth mismatch.
    """
    incoming, removals = incoming_tree(raw)
    if old is None or replace:
        tree = incoming
        old_order: dict[int, int] = {}
    else:
        tree = _merged_tree(old.tree, raw, incoming, removals is not None)
        old_order = old.order
    ids = tree.sequence_ids()
    present = set(ids)
    readded = set() if removals is None else set(removals) & present
    order = {s: t for s, t in old_order.items() if s in present and s not in readded}
    gone = [s for s in old_order if s not in order]
    added = [s for s in ids if s not in order]
    for s in added:
        order[s] = version
    shard = Shard(
        key,
        tree,
        next_seq=max(1 if old is None else old.next_seq, max(ids, default=0) + 1),
        version=version,
        evicted=0 if old is None else old.evicted,
        order=order,
    )
    if old is not None:
        new = set(added)
        kept = (
            [] if replace else [p for p in old.outbox.items() if p[0] in order and p[0] not in new]
        )
        shard.outbox = ShardOutbox(old.outbox.published, kept)
        shard.outbox.settle((), shard.next_seq)
    if old is not None and not replace:
        shard.log, shard.floor = deque(old.log), old.floor
        for s in gone:
            shard.note(version, REMOVE, s, log_limit)
        for s in added:
            shard.note(version, ADD, s, log_limit)
    return shard
