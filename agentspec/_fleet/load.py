"""Loading a tenant's snapshots: where a subscriber (re)starts.

The start position is the lowest of the tenant's ``round`` mark and the
covered ids of the snapshots loaded (``0-0`` when nothing was ever
compacted, and then nothing was ever trimmed either).  Every entry after
it is still in the stream, and each shard skips the entries its own
snapshot already covers.  A snapshot that fails validation (native loader,
depth, key) is counted and its shard starts empty from that position; the
next compaction writes it anew, so a damaged snapshot never stops trimming.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import cast

import redis

from agentspec._core.shardkey import ShardKey, check_key
from agentspec._fleet.ids import ZERO, StreamId, parse_id
from agentspec._fleet.names import FleetKeys, shard_name
from agentspec._fleet.shard import FleetShard
from agentspec._util.log import get_logger
from agentspec.exceptions import AgentSpecError

__all__ = ["LoadedState", "load_snapshots"]

_log = get_logger()


@dataclass
class LoadedState:
    """Shards from snapshots, the stream position to read after, and the failures."""

    shards: dict[ShardKey, FleetShard] = field(default_factory=dict)
    position: StreamId = ZERO
    bad_snapshots: int = 0


def load_snapshots(client: redis.Redis, keys: FleetKeys, depth: int) -> LoadedState:
    """Every snapshot of the tenant, validated, and the position to tail from."""
    pipe = client.pipeline(transaction=True)
    pipe.hget(keys.meta, "round")
    pipe.hgetall(keys.index)
    round_raw, index = pipe.execute()
    state = LoadedState()
    low = ZERO if round_raw is None else parse_id(round_raw)
    for raw_name in sorted(index):
        name = raw_name.decode()
        data, covered_raw, key_raw, gone = cast(
            "list[bytes | None]", client.hmget(keys.snap(name), ["data", "covered", "key", "gone"])
        )
        try:
            key = check_key(json.loads(key_raw)) if key_raw is not None else None
        except ValueError:
            key = None
        if key is None or key[0] != keys.tenant or shard_name(key) != name:
            state.bad_snapshots += 1
            _log.warning("agentspec fleet: snapshot with a bad key skipped", shard=name)
            continue
        try:
            if data is None or covered_raw is None:
                raise ValueError("incomplete snapshot")
            covered = parse_id(covered_raw)
            shard = FleetShard.from_snapshot(key, data, gone or b"", covered, depth)
        except (AgentSpecError, ValueError) as e:
            state.bad_snapshots += 1
            _log.warning(
                "agentspec fleet: bad snapshot, shard restarts empty",
                shard=name,
                error=type(e).__name__,
            )
            state.shards[key] = FleetShard.empty(key, depth)
            continue
        state.shards[key] = shard
        low = min(low, shard.through)
    state.position = low
    return state
