"""Subscriber heartbeats: who follows a tenant's stream, and how far behind each is.

Each `FleetSubscriber` writes a small JSON record under ``P sub:<id>`` about
once a second (``SET PX``: it expires when the subscriber is gone, so a
crashed replica drops out on its own).  `agentspec fleet status` lists the
records and computes each subscriber's lag against the stream's last id.

A heartbeat is only bookkeeping: a subscriber whose user may not write its
heartbeat key (an ACL without ``%RW~P sub:*``) stops sending them, counts
the refusal, and keeps following the stream.  Records read back are
validated field by field; a malformed one is shown as such, never trusted.
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

from agentspec._fleet.names import FleetKeys

__all__ = ["Heartbeat", "new_subscriber_id", "read_heartbeats", "write_heartbeat"]

#: Most heartbeat records `read_heartbeats` returns for one tenant.
MAX_LISTED = 1000
#: Largest record read back (bytes); larger ones are reported as malformed.
_MAX_RECORD = 4096


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
            if type(value) is not want:
                raise ValueError(f"heartbeat field {field} is not {want.__name__}")
        return cls(**data)


def write_heartbeat(client: redis.Redis, keys: FleetKeys, beat: Heartbeat, ttl_ms: int) -> None:
    """Write ``beat`` under the subscriber's key, expiring after ``ttl_ms``."""
    client.set(keys.heartbeat(beat.id), beat.encode(), px=ttl_ms)


def read_heartbeats(client: redis.Redis, keys: FleetKeys) -> tuple[list[Heartbeat], int]:
    """The tenant's live heartbeat records (by name) and the count of malformed ones."""
    found: list[bytes] = []
    for key in client.scan_iter(match=keys.heartbeats, count=500):
        found.append(key)
        if len(found) >= MAX_LISTED:
            break
    beats: list[Heartbeat] = []
    bad = 0
    for raw in client.mget(found) if found else []:
        if not isinstance(raw, bytes):  # None: expired between SCAN and MGET
            continue
        try:
            beats.append(Heartbeat.decode(raw))
        except (ValueError, TypeError):
            bad += 1
    beats.sort(key=lambda b: (b.name, b.id))
    return beats, bad
