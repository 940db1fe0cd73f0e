"""What a tenant's fleet log on Redis holds, per shard: `fleet_status`.

For each tenant it reads the stream (length, last id, compaction marks) and
the snapshot index, then replays the log the way a subscriber does (a
temporary, read-only `FleetSubscriber` that never compacts) to count each
shard's sequences and tokens, and lists the live subscribers from their
heartbeats (read through the library's ``beats`` function, no ``SCAN``):
a subscriber whose tree config (depth, budget) differs from the tenant's
``meta`` is flagged ``config_mismatch``, and a malformed or oversize record
is listed under ``malformed_heartbeat_records`` (an oversize one is never
fetched).  ``agentspec fleet status`` (`agentspec._cli.fleet`) prints it
as tables; `agentspec.fleet.fleet_status` is the same dict.  Nothing is
written to Redis, and the password never appears in the result.
"""

from __future__ import annotations

import time
from typing import Any

from agentspec.exceptions import AgentSpecError

__all__ = ["fleet_status"]


def _ms(sid: str) -> int:
    return int(sid.split("-", 1)[0])


def _config_of(depth: int, budget: int | None) -> tuple[bytes, bytes]:
    """A heartbeat's config as the tenant's ``meta`` fields hold it."""
    return str(depth).encode(), b"none" if budget is None else str(budget).encode()


def fleet_status(url: str, tenants: list[str], timeout: float = 30.0) -> dict[str, Any]:
    """The status of each tenant's fleet log (JSON-ready; the URL redacted).

    Raises:
        AgentSpecError: Redis cannot be reached or the log cannot be replayed
            (the message has no password).
    """
    import redis

    from agentspec._fleet.connection import Redactor, hash_reply, open_client
    from agentspec._fleet.heartbeat import BadHeartbeat, read_heartbeat_records
    from agentspec._fleet.ids import format_id, parse_id
    from agentspec._fleet.names import FleetKeys, shard_name
    from agentspec._fleet.sub import FleetSubscriber

    redactor = Redactor(url)
    out: dict[str, Any] = {
        "redis": redactor.url,
        "note": (
            "snapshot_lag_ms = stream last id - covered id; a subscriber's lag_ms = its head - "
            "its position at its last heartbeat, behind_ms = stream last id now - its position"
        ),
        "tenants": {},
    }
    try:
        client = open_client(url)
    except (redis.RedisError, redis.exceptions.RedisClusterException, ValueError) as exc:
        raise AgentSpecError(f"cannot open {redactor.url}: {redactor.error(exc)}") from None
    try:
        for tenant in tenants:
            keys = FleetKeys.of(tenant)
            try:
                pipe = client.pipeline(transaction=True)
                pipe.exists(keys.meta)
                pipe.hgetall(keys.meta)
                pipe.hgetall(keys.index)
                pipe.xlen(keys.log)
                pipe.xrevrange(keys.log, count=1)
                has_meta, meta, index, length, last = pipe.execute()
                meta, index = hash_reply(meta), hash_reply(index)  # raw in a cluster transaction
                try:
                    beats, bad_beats = read_heartbeat_records(client, keys)
                except redis.ResponseError as exc:  # e.g. a heartbeat key of another type
                    beats, bad_beats = [], [BadHeartbeat("*", redactor.error(exc)[:200], 0)]
            except redis.RedisError as exc:
                raise AgentSpecError(f"cannot read {redactor.url}: {redactor.error(exc)}") from None
            if not has_meta:
                out["tenants"][tenant] = {"exists": False, "shards": []}
                continue
            covered = {bytes(k).decode(): bytes(v).decode() for k, v in index.items()}
            config = (meta.get(b"depth"), meta.get(b"budget"))
            stream_last = bytes(last[0][0]).decode() if last else "0-0"
            head = max(
                [parse_id(stream_last), *(parse_id(c) for c in covered.values())],
                default=(0, 0),
            )
            sub = FleetSubscriber(url, tenant, compact_every=0, block_ms=100, heartbeat_s=0)
            try:
                if not sub.wait_for(format_id(head), timeout):
                    err = sub.stats().last_error
                    raise AgentSpecError(
                        f"could not replay tenant {tenant!r}'s log within {timeout:g}s"
                        + (f": {err}" if err else "")
                    )
                stats = sub.stats()
            finally:
                sub.close()
            now_ms = int(time.time() * 1000)
            shards = []
            for key, s in sorted(stats.shards.items(), key=lambda kv: repr(kv[0])):
                cov = covered.get(shard_name(key))
                shards.append(
                    {
                        "key": list(key),
                        "name": shard_name(key),
                        "sequences": s.sequences,
                        "tokens": s.tokens,
                        "last_id": s.last_id,
                        "covered": cov,
                        "snapshot_age_s": None
                        if cov is None
                        else round(max(0, now_ms - _ms(cov)) / 1000, 3),
                        "snapshot_lag_ms": None
                        if cov is None
                        else max(0, _ms(stream_last) - _ms(cov)),
                    }
                )
            out["tenants"][tenant] = {
                "exists": True,
                "stream": {
                    "length": int(length),
                    "last_id": stream_last,
                    **{
                        bytes(k).decode(): bytes(v).decode()
                        for k, v in meta.items()
                        if bytes(k) in (b"depth", b"budget", b"round", b"trimmed")
                    },
                },
                "shards": shards,
                "subscribers": [
                    {
                        "id": b.id,
                        "name": b.name,
                        "host": b.host,
                        "pid": b.pid,
                        "position": b.position,
                        "lag_ms": b.lag_ms,
                        "behind_ms": max(0, _ms(stream_last) - _ms(b.position))
                        if parse_id(b.position) < parse_id(stream_last)
                        else 0,
                        "seen_s_ago": round(max(0, now_ms - b.at_ms) / 1000, 3),
                        "applied": b.applied,
                        "malformed": b.malformed,
                        "loads": b.loads,
                        "reconnects": b.reconnects,
                        "compacts": b.compacts,
                        "depth": b.depth,
                        "budget": b.budget,
                        "config_mismatch": _config_of(b.depth, b.budget) != config,
                    }
                    for b in beats
                ],
                "malformed_heartbeats": len(bad_beats),
                "malformed_heartbeat_records": [
                    {"id": b.id, "reason": b.reason, "bytes": b.size} for b in bad_beats
                ],
            }
    finally:
        client.close()
    return out
