"""Compaction: snapshots of every shard a subscriber holds, then trimming the stream.

Any subscriber may compact; a short lease (``SET NX PX`` on the tenant's
``compacting`` key) keeps it to one at a time, but correctness never
depends on the lease: every write is a compare-and-set on the covered id
(see `_fleet_scripts`).  A round at stream position P (every entry up to P
applied, on the subscriber's own thread, between two reads):

1. for each shard, covered = max(P, the shard's ``through``); if the stored
   snapshot already covers the shard's last entry, it only has its covered
   id moved forward (no bytes sent); otherwise the shard's snapshot is put;
2. `FINISH_ROUND` raises ``round`` to P and trims the stream behind the
   lowest covered id, so the stream only holds entries that some snapshot
   lacks, and Redis holds about one token budget per shard plus the entries
   since the oldest snapshot.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import redis

from agentspec._core.shardkey import key_json
from agentspec._fleet.entry import parse_key_json
from agentspec._fleet.functions import fcall
from agentspec._fleet.ids import StreamId, format_id, parse_id
from agentspec._fleet.names import FleetKeys, shard_name
from agentspec._fleet.shard import FleetShard

__all__ = ["CompactionResult", "compact"]

_NAME = re.compile(rb"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class CompactionResult:
    """What one compaction round did.

    Attributes:
        written: snapshots put (bytes sent).
        bumped: stored snapshots whose covered id only moved forward.
        trimmed_to: the stream id the stream now starts at or after.
        removed: stream entries the trim removed.
    """

    written: int
    bumped: int
    trimmed_to: str
    removed: int


def compact(
    client: redis.Redis,
    keys: FleetKeys,
    shards: Iterable[FleetShard],
    position: StreamId,
    *,
    lease_ms: int = 60_000,
) -> CompactionResult | None:
    """One compaction round at ``position``; None when another compactor holds the lease."""
    token = secrets.token_hex(8)
    if fcall(client, "lock", [keys.lock], [token, lease_ms]) != 1:
        return None
    try:
        return _round(client, keys, list(shards), position)
    finally:
        fcall(client, "unlock", [keys.lock], [token])


def _round(
    client: redis.Redis, keys: FleetKeys, shards: list[FleetShard], position: StreamId
) -> CompactionResult:
    try:
        index = cast("dict[bytes, bytes]", client.hgetall(keys.index))
    except redis.ResponseError:  # not a hash: damaged beyond use; the round writes a new one
        client.delete(keys.index)
        index = {}
    stored: dict[str, StreamId] = {}
    for raw_name, raw_covered in index.items():
        try:  # a damaged index entry is rewritten (a put) rather than trusted
            stored[raw_name.decode("ascii")] = parse_id(raw_covered)
        except ValueError:
            continue
    written = bumped = 0
    for shard in shards:
        name = shard_name(shard.key)
        covered = format_id(max(position, shard.through))
        common: list[Any] = [name, covered]
        have = stored.get(name)
        if have is not None and have >= shard.last_id:
            args = [*common, "bump", format_id(shard.last_id)]
            if fcall(client, "put_snapshot", [keys.snap(name), keys.index], args) == 1:
                bumped += 1
                continue
        data, gone = shard.snapshot()
        args = [*common, "put", "0-0", data, key_json(shard.key), gone]
        fcall(client, "put_snapshot", [keys.snap(name), keys.index], args)
        written += 1
    _drop_damaged(client, keys, set(stored) - {shard_name(s.key) for s in shards}, index)
    low, removed = fcall(
        client, "finish_round", [keys.meta, keys.index, keys.log], [format_id(position)]
    )
    return CompactionResult(written, bumped, bytes(low).decode(), int(removed))


def _drop_damaged(
    client: redis.Redis, keys: FleetKeys, unknown: set[str], index: dict[bytes, bytes]
) -> None:
    """Remove index entries no snapshot can back (they would hold trimming back forever).

    An entry whose name is not a shard name, or whose snapshot hash is
    missing, unreadable or names another shard, holds nothing a subscriber
    could load.  A valid snapshot of a shard this compactor has not met yet
    (another compactor may be ahead) is left alone.
    """
    names = {n for n in index if not _NAME.fullmatch(n)}
    for name in unknown:
        try:
            key_raw = client.hget(keys.snap(name), "key")
            ok = isinstance(key_raw, bytes) and shard_name(parse_key_json(key_raw)) == name
        except (redis.ResponseError, ValueError):
            ok = False
        if not ok:
            names.add(name.encode())
    for raw in names:
        client.hdel(keys.index, raw)
        if _NAME.fullmatch(raw):
            client.delete(keys.snap(raw.decode()))
