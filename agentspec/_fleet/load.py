"""Loading a tenant's snapshots: where a subscriber (re)starts.

The start position is the tenant's ``round`` mark: a finished compaction
round at R leaves every shard with a snapshot that holds all of its
entries up to R (a snapshot covering less belongs to a shard with no entry
since), and trimming stays behind the round before it, so every entry
after R is still in the stream.  Without a round (nothing compacted yet,
or only re-seeded snapshots covering ``0-0``) it is the lowest covered id,
or ``0-0``.  Each shard skips the entries its own snapshot already covers.
A snapshot that fails validation (native loader, depth, key) is counted and
its shard starts empty from that position; the next compaction writes it
anew, so a damaged snapshot never stops trimming.

Damaged metadata never stops a load: an index entry whose name is not
UTF-8 or not a shard name, a snapshot hash of the wrong type or with a
key that is not a flat JSON key, and a ``round`` mark that is not a stream
id are each counted as a bad snapshot (the mark is then ignored, and the
covered ids alone decide where to start).  ``epoch`` is the tenant's
re-seed mark (see `FleetSubscriber`): a subscriber reloads when it changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import redis

from agentspec._core.shardkey import ShardKey
from agentspec._fleet.connection import hash_reply
from agentspec._fleet.entry import parse_key_json
from agentspec._fleet.ids import ZERO, StreamId, parse_id
from agentspec._fleet.names import FleetKeys, is_shard_name, shard_name
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
    epoch: bytes | None = None


def load_snapshots(client: redis.Redis, keys: FleetKeys, depth: int) -> LoadedState:
    """Every snapshot of the tenant, validated, and the position to tail from."""
    state = LoadedState()
    pipe = client.pipeline(transaction=True)
    pipe.hmget(keys.meta, ["round", "epoch"])
    pipe.hgetall(keys.index)
    try:
        (round_raw, state.epoch), index = pipe.execute()
        index = hash_reply(index)  # a cluster transaction answers a flat list
    except redis.ResponseError as e:  # WRONGTYPE: damaged metadata, start from the stream
        state.bad_snapshots += 1
        _log.warning("agentspec fleet: unreadable snapshot index", error=str(e)[:200])
        return state
    try:
        low: StreamId | None = None if round_raw is None else parse_id(round_raw)
    except ValueError:
        state.bad_snapshots += 1
        _log.warning("agentspec fleet: the round mark is not a stream id; ignored")
        low = None
    covered_ids: list[StreamId] = []
    for raw_name in sorted(index):
        if not is_shard_name(raw_name):
            state.bad_snapshots += 1
            _log.warning("agentspec fleet: index entry with a bad shard name skipped")
            continue
        name = raw_name.decode("ascii")
        try:
            data, covered_raw, key_raw, gone = cast(
                "list[bytes | None]",
                client.hmget(keys.snap(name), ["data", "covered", "key", "gone"]),
            )
        except redis.ResponseError:
            state.bad_snapshots += 1
            _log.warning("agentspec fleet: unreadable snapshot skipped", shard=name)
            continue
        try:
            key = parse_key_json(key_raw) if key_raw is not None else None
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
        except (AgentSpecError, ValueError, TypeError) as e:
            state.bad_snapshots += 1
            _log.warning(
                "agentspec fleet: bad snapshot, shard restarts empty",
                shard=name,
                error=type(e).__name__,
            )
            state.shards[key] = empty = FleetShard.empty(key, depth)
            empty.dirty = True  # the next compaction rewrites the damaged snapshot
            continue
        state.shards[key] = shard
        covered_ids.append(shard.through)
    if low is None:
        # No (readable) round mark: nothing was compacted (or seeded snapshots cover
        # 0-0), or the mark is damaged: the covered ids alone say where to start.
        low = min(covered_ids, default=ZERO)
    # A finished round at R means every shard's snapshot holds all of its entries up
    # to R (a shard whose snapshot covers less had none since), so reading starts at R.
    state.position = low
    return state
