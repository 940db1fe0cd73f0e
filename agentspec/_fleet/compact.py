"""Compaction: snapshots of the shards that changed, then trimming the stream.

Any subscriber may compact; a short lease (the library's ``lock`` function
on the tenant's ``compacting`` key) keeps it to one at a time, but
correctness never depends on the lease: every write is a compare-and-set
on the covered id (see `_fleet_scripts`).  A round at stream position P
(every entry up to P applied, on the subscriber's own thread, between two
reads) costs what changed since the last round, not the number of shards:

1. each shard that changed since its snapshot was stored (``dirty``) is
   put with covered = max(P, its ``through``), unless another compactor
   already stored a snapshot covering its last entry (one pipelined read
   tells); a shard that did not change has no entry after its stored
   snapshot, so that snapshot already holds everything of it up to P;
2. the snapshots of shards evicted by eviction entries are deleted (unless
   a later snapshot of the shard exists);
3. ``finish_round`` raises ``round`` to P and trims the stream behind the
   previous round: after a round at R every shard's snapshot holds all of
   its entries up to R, so the stream only holds entries that some snapshot
   may lack, and Redis holds about one token budget per shard plus about
   two rounds of entries.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis

from agentspec._core.shardkey import key_json
from agentspec._fleet.entry import parse_key_json
from agentspec._fleet.functions import fcall
from agentspec._fleet.ids import StreamId, format_id, parse_id
from agentspec._fleet.names import FleetKeys, is_shard_name, shard_name
from agentspec._fleet.shard import FleetShard

__all__ = ["CompactionResult", "compact"]


@dataclass(frozen=True, slots=True)
class CompactionResult:
    """What one compaction round did.

    Attributes:
        written: snapshots put (bytes sent): the shards that changed since
            their snapshot was stored.
        bumped: changed shards another compactor had already stored.
        trimmed_to: the stream id the stream now starts at or after.
        removed: stream entries the trim removed.
        dropped: snapshots of evicted shards deleted.
    """

    written: int
    bumped: int
    trimmed_to: str
    removed: int
    dropped: int = 0


def compact(
    client: redis.Redis,
    keys: FleetKeys,
    shards: Iterable[FleetShard],
    position: StreamId,
    *,
    dropped: Mapping[str, StreamId] | None = None,
    repair: bool = False,
    lease_ms: int = 60_000,
) -> CompactionResult | None:
    """One compaction round at ``position``; None when another compactor holds the lease.

    ``dropped``: shard name -> id of the eviction entry that dropped it (their
    snapshots are deleted unless a later one exists).  ``repair``: also remove
    index entries that no valid snapshot backs (after a load found damage).
    """
    token = secrets.token_hex(8)
    if fcall(client, "lock", [keys.lock], [token, lease_ms]) != 1:
        return None
    try:
        return _round(client, keys, list(shards), position, dropped or {}, repair)
    finally:
        fcall(client, "unlock", [keys.lock], [token])


def _round(
    client: redis.Redis,
    keys: FleetKeys,
    shards: list[FleetShard],
    position: StreamId,
    dropped: Mapping[str, StreamId],
    repair: bool,
) -> CompactionResult:
    dirty = [s for s in shards if s.dirty]
    covers: list[Any] = []
    if dirty:  # one round trip: which dirty shards another compactor already stored
        pipe = client.pipeline(transaction=False)
        for shard in dirty:
            pipe.hget(keys.snap(shard_name(shard.key)), "covered")
        covers = pipe.execute(raise_on_error=False)
    written = bumped = 0
    for shard, have_raw in zip(dirty, covers, strict=True):
        name = shard_name(shard.key)
        try:
            have = parse_id(have_raw) if isinstance(have_raw, bytes) else None
        except ValueError:
            have = None
        if have is not None and have >= shard.last_id:
            shard.dirty = False  # stored already: a snapshot holding every entry we applied
            bumped += 1
            continue
        data, gone = shard.snapshot()
        covered = format_id(max(position, shard.through))
        args: list[Any] = [name, covered, "put", "0-0", data, key_json(shard.key), gone]
        fcall(client, "put_snapshot", [keys.snap(name), keys.index], args)
        shard.dirty = False
        written += 1
    removed_snapshots = 0
    for name, eid in dropped.items():
        removed_snapshots += int(
            fcall(client, "drop_snapshot", [keys.snap(name), keys.index], [name, format_id(eid)])
        )
    if repair:
        _drop_damaged(client, keys, {shard_name(s.key) for s in shards})
    low, removed = fcall(
        client, "finish_round", [keys.meta, keys.index, keys.log], [format_id(position)]
    )
    return CompactionResult(written, bumped, bytes(low).decode(), int(removed), removed_snapshots)


def _drop_damaged(client: redis.Redis, keys: FleetKeys, held: set[str]) -> None:
    """Remove index entries no snapshot can back (run after a load found damage).

    An entry whose name is not a shard name, or whose snapshot hash is
    missing, unreadable or names another shard, holds nothing a subscriber
    could load.  A valid snapshot of a shard this compactor has not met yet
    (another compactor may be ahead) is left alone.
    """
    try:
        index = cast("dict[bytes, bytes]", client.hgetall(keys.index))
    except redis.ResponseError:  # not a hash: damaged beyond use; puts write a new one
        client.delete(keys.index)
        return
    names = {n for n in index if not is_shard_name(n)}
    for raw in index:
        name = raw.decode("latin-1")
        if raw in names or name in held:
            continue
        try:
            key_raw = client.hget(keys.snap(name), "key")
            ok = isinstance(key_raw, bytes) and shard_name(parse_key_json(key_raw)) == name
        except (redis.ResponseError, ValueError):
            ok = False
        if not ok:
            names.add(raw)
    for raw in names:
        client.hdel(keys.index, raw)
        if is_shard_name(raw):
            client.delete(keys.snap(raw.decode()))
