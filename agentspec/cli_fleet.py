"""``agentspec fleet status``: what a tenant's fleet log on Redis holds, per shard.

For each tenant (``--tenant``, repeatable; default ``default``) it reads the
stream (length, last id, compaction marks) and the snapshot index, then
replays the log the way a subscriber does (a temporary, read-only
`FleetSubscriber` that never compacts) to count each shard's sequences and
tokens.  Per shard it shows:

- ``sequences``, ``tokens``: what every subscriber at the log's end holds;
- ``last id``: the shard's last stream entry (or its snapshot's covered id);
- ``covered``: the stream id its snapshot covers, and ``snapshot age``:
  now minus that id's time;
- ``snapshot lag``: the stream's last id minus the covered id, in
  milliseconds: how far a subscriber starting from the snapshots has to read.

Then each live subscriber (replicas and other followers write a heartbeat
about once a second; a gone one drops out within seconds): its name, host
and pid, position, ``lag ms`` (the stream's last id minus its position
when it wrote the heartbeat), ``behind ms`` (the stream's last id now minus
its position), when it was last heard from, and whether it compacts (a
read-only user does not).

The Redis password never appears in the output (``***``).  A tenant without
fleet data is reported as such; nothing is written to Redis.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from agentspec.exceptions import AgentSpecError, InvalidArgumentError

__all__ = ["add_arguments", "fleet_status", "run_status"]

#: Environment variable with the Redis URL (as ``agentspec serve --redis``).
_REDIS_ENV = "AGENTSPEC_REDIS_URL"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fleet`` subcommands to ``parser``."""
    sub = parser.add_subparsers(dest="fleet_command", metavar="COMMAND")
    st = sub.add_parser(
        "status",
        help="per shard: sequences, tokens, last id, snapshot age and lag",
        description=(__doc__ or "").split("\n\n", 1)[-1].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    st.add_argument(
        "--redis", default=None, metavar="URL", help=f"Redis URL (default: ${_REDIS_ENV})"
    )
    st.add_argument(
        "--tenant",
        action="append",
        default=None,
        metavar="T",
        help="tenant to show (repeatable; default: default)",
    )
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="longest wait for replaying one tenant's log (default 30)",
    )
    st.set_defaults(func=run_status)
    parser.set_defaults(func=None, _help=parser.print_help)


def _ms(sid: str) -> int:
    return int(sid.split("-", 1)[0])


def fleet_status(url: str, tenants: list[str], timeout: float = 30.0) -> dict[str, Any]:
    """The status of each tenant's fleet log (JSON-ready; the URL redacted).

    Raises:
        AgentSpecError: Redis cannot be reached or the log cannot be replayed
            (the message has no password).
    """
    import redis

    from agentspec._fleet_heartbeat import read_heartbeats
    from agentspec._fleet_ids import format_id, parse_id
    from agentspec._fleet_names import FleetKeys, shard_name
    from agentspec._fleet_redis import Redactor, open_client
    from agentspec._fleet_sub import FleetSubscriber

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
    except (redis.RedisError, ValueError) as exc:
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
                beats, bad_beats = read_heartbeats(client, keys)
            except redis.RedisError as exc:
                raise AgentSpecError(f"cannot read {redactor.url}: {redactor.error(exc)}") from None
            if not has_meta:
                out["tenants"][tenant] = {"exists": False, "shards": []}
                continue
            covered = {bytes(k).decode(): bytes(v).decode() for k, v in index.items()}
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
                    }
                    for b in beats
                ],
                "malformed_heartbeats": bad_beats,
            }
    finally:
        client.close()
    return out


def _aligned(rows: list[tuple[str, ...]], indent: str) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def _table(status: dict[str, Any]) -> str:
    lines = [f"redis {status['redis']}"]
    for tenant, t in status["tenants"].items():
        if not t["exists"]:
            lines.append(f"tenant {tenant}: no fleet data")
            continue
        st = t["stream"]
        marks = ", ".join(
            f"{k} {st[k]}" for k in ("depth", "budget", "round", "trimmed") if k in st
        )
        lines.append(
            f"tenant {tenant}: stream {st['length']} entries, last id {st['last_id']}; {marks}"
        )
        header = (
            "pipeline",
            "stage",
            "sequences",
            "tokens",
            "last id",
            "covered",
            "age s",
            "lag ms",
        )
        rows: list[tuple[str, ...]] = [header]
        for s in t["shards"]:
            _, pipeline, stage = s["key"]
            rows.append(
                (
                    pipeline or "-",
                    stage or "-",
                    str(s["sequences"]),
                    str(s["tokens"]),
                    s["last_id"],
                    s["covered"] or "-",
                    "-" if s["snapshot_age_s"] is None else f"{s['snapshot_age_s']:.1f}",
                    "-" if s["snapshot_lag_ms"] is None else str(s["snapshot_lag_ms"]),
                )
            )
        lines += _aligned(rows, "  ")
        if not t["shards"]:
            lines.append("  (no shards)")
        subs = t["subscribers"]
        lines.append(f"  subscribers: {len(subs)}")
        rows = [("name", "position", "lag ms", "behind ms", "seen s ago", "applied", "compacts")]
        for b in subs:
            rows.append(
                (
                    b["name"],
                    b["position"],
                    str(b["lag_ms"]),
                    str(b["behind_ms"]),
                    f"{b['seen_s_ago']:.1f}",
                    str(b["applied"]),
                    "yes" if b["compacts"] else "no",
                )
            )
        if subs:
            lines += _aligned(rows, "    ")
        if t["malformed_heartbeats"]:
            lines.append(f"  malformed heartbeats: {t['malformed_heartbeats']}")
    lines.append(f"note: {status['note']}")
    return "\n".join(lines)


def run_status(args: argparse.Namespace) -> int:
    """``agentspec fleet status``."""
    url = args.redis or os.environ.get(_REDIS_ENV)
    if not url:
        raise InvalidArgumentError(f"give --redis URL (or set ${_REDIS_ENV})")
    status = fleet_status(url, list(dict.fromkeys(args.tenant or ["default"])), args.timeout)
    if args.json:
        json.dump(status, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(_table(status))
    return 0
