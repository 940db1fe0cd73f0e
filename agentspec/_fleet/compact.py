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

import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import redis

from agentspec._core.shardkey import key_json
from agentspec._fleet.functions import fcall
from agentspec._fleet.ids import StreamId, format_id, parse_id
from agentspec._fleet.names import FleetKeys, shard_name
from agentspec._fleet.shard import FleetShard

__all__ = ["CompactionResult", "compact"]


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
    index = cast("dict[bytes, bytes]", client.hgetall(keys.index))
    stored = {n.decode(): parse_id(c) for n, c in index.items()}
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
    low, removed = fcall(
        client, "finish_round", [keys.meta, keys.index, keys.log], [format_id(position)]
    )
    return CompactionResult(written, bumped, bytes(low).decode(), int(removed))
