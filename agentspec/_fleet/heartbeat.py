"""Subscriber heartbeats: who follows a tenant's stream, how far behind, with which config.

Each `FleetSubscriber` writes a small JSON record about once a second
through the library's ``beat`` function (`_fleet_scripts`): into the
tenant's heartbeat hash (``P sub:records``, id -> record) with its expiry
time in a sorted set (``P sub:expiry``), so a crashed replica drops out on
its own.  The function caps a record's size and the records per tenant,
and prunes expired or oversize records a bounded number at a time.
`agentspec fleet status` reads the live records through the read-only
``beats`` function (no ``SCAN``), which returns an oversize record by its
size only, and computes each subscriber's lag against the stream's last id.

A heartbeat is only bookkeeping: a subscriber whose user may not write it
stops sending them, counts the refusal, and keeps following the stream.
Records read back are validated field by field; a malformed one is
reported as such (`read_heartbeat_records`), never trusted.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

import redis

from agentspec._fleet.functions import fcall
from agentspec._fleet.ids import parse_id
from agentspec._fleet.names import FleetKeys
from agentspec._fleet.scripts import MAX_BEAT, MAX_BEAT_TTL_MS, MAX_BEATS

__all__ = [
    "BadHeartbeat",
    "Heartbeat",
    "new_subscriber_id",
    "read_heartbeat_records",
    "read_heartbeats",
    "remove_heartbeat",
    "write_heartbeat",
]

#: Most heartbeat records `read_heartbeats` returns for one tenant.
MAX_LISTED = MAX_BEATS
#: Largest record read back (bytes); larger ones are reported as malformed.
_MAX_RECORD = MAX_BEAT


def new_subscriber_id() -> str:
    """A fresh random subscriber id (16 hex digits)."""
    return secrets.token_hex(8)


def _host() -> str:
    return socket.gethostname()[:64]


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One subscriber's record, as written (times in Unix milliseconds).

    Attributes:
        id: the subscriber id (the key's suffix).
        name: the name it was given (default ``host:pid``).
        host, pid: where it runs.
        position: id of the last stream entry it has read.
        head: the stream's last id when it last looked.
        lag_ms: ``head`` minus ``position`` then, in milliseconds.
        applied, malformed, loads, reconnects: its counters.
        compacts: whether it may compact (False for a read-only user).
        depth, budget: the tree config it builds with (budget None: unbounded).
        at_ms: when the record was written.
    """

    id: str
    name: str
    host: str
    pid: int
    position: str
    head: str
    lag_ms: int
    applied: int
    malformed: int
    loads: int
    reconnects: int
    compacts: bool
    depth: int
    budget: int | None
    at_ms: int

    @classmethod
    def now(cls, subscriber_id: str, name: str | None, **fields: Any) -> Heartbeat:
        """A record stamped now, for this host and process."""
        pid = os.getpid()
        host = _host()
        return cls(
            id=subscriber_id,
            name=name or f"{host}:{pid}",
            host=host,
            pid=pid,
            at_ms=int(time.time() * 1000),
            **fields,
        )

    def encode(self) -> bytes:
        """The record as compact JSON."""
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Heartbeat:
        """A record read back.

        Raises:
            ValueError: not a well-formed record.
        """
        if len(raw) > _MAX_RECORD:
            raise ValueError("heartbeat record too large")
        data = json.loads(raw)
        if not isinstance(data, dict) or set(data) != set(cls.__slots__):
            raise ValueError("heartbeat record has the wrong fields")
        types = {"name": str, "host": str, "id": str, "position": str, "head": str}
        for field in cls.__slots__:
            want = types.get(field, bool if field == "compacts" else int)
            value = data[field]
            if field == "budget" and value is None:
                continue
            if type(value) is not want:
                raise ValueError(f"heartbeat field {field} is not {want.__name__}")
            if isinstance(value, int) and not 0 <= value < 1 << 63:
                raise ValueError(f"heartbeat field {field} is out of range")
        for field in ("position", "head"):
            try:
                parse_id(data[field])
            except ValueError:
                raise ValueError(f"heartbeat field {field} is not a stream id") from None
        return cls(**data)


@dataclass(frozen=True, slots=True)
class BadHeartbeat:
    """A heartbeat record that is not well formed (never trusted, never fetched if too large).

    Attributes:
        id: the subscriber id it is stored under.
        reason: why it was refused.
        size: its size in bytes.
    """

    id: str
    reason: str
    size: int


def write_heartbeat(client: redis.Redis, keys: FleetKeys, beat: Heartbeat, ttl_ms: int) -> None:
    """Write ``beat`` into the tenant's heartbeats, expiring after ``ttl_ms`` (capped).

    Raises:
        redis.RedisError: refused (e.g. no permission, or the tenant's
            record cap reached) or Redis unreachable.
    """
    ttl = max(1, min(int(ttl_ms), MAX_BEAT_TTL_MS))
    fcall(client, "beat", [keys.beats, keys.beat_expiry], [beat.id, beat.encode(), ttl])


def remove_heartbeat(client: redis.Redis, keys: FleetKeys, subscriber_id: str) -> None:
    """Remove the heartbeat of ``subscriber_id`` (a subscriber that closes)."""
    fcall(client, "beat", [keys.beats, keys.beat_expiry], [subscriber_id, b"", 1])


def read_heartbeat_records(
    client: redis.Redis, keys: FleetKeys
) -> tuple[list[Heartbeat], list[BadHeartbeat]]:
    """The tenant's live heartbeat records (by name) and the malformed ones (by id).

    Records over the size limit are reported by their size, never fetched.

    Raises:
        redis.RedisError: Redis could not be asked.
    """
    reply = fcall(client, "beats", [keys.beats, keys.beat_expiry], [MAX_LISTED])
    beats: list[Heartbeat] = []
    bad: list[BadHeartbeat] = []
    for n in range(1, len(reply) - 2, 3):
        rid = bytes(reply[n]).decode("utf-8", "replace")
        kind, value = bytes(reply[n + 1]), bytes(reply[n + 2])
        if kind == b"big":
            bad.append(BadHeartbeat(rid, "record too large", int(value)))
            continue
        try:
            beat = Heartbeat.decode(value)
            if beat.id != rid:
                raise ValueError("heartbeat record stored under another id")
        except (ValueError, TypeError, RecursionError) as e:
            bad.append(BadHeartbeat(rid, str(e)[:200], len(value)))
        else:
            beats.append(beat)
    beats.sort(key=lambda b: (b.name, b.id))
    bad.sort(key=lambda b: b.id)
    return beats, bad


def read_heartbeats(client: redis.Redis, keys: FleetKeys) -> tuple[list[Heartbeat], int]:
    """The tenant's live heartbeat records (by name) and the count of malformed ones."""
    beats, bad = read_heartbeat_records(client, keys)
    return beats, len(bad)
