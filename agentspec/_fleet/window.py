"""The publisher's durability window: acknowledged entries not yet known to be durable.

Redis acknowledges an ``XADD`` once the entry is in memory.  With
``appendfsync everysec`` a crash (or a failover) can still lose the last
second or two of acknowledged writes, so an acknowledgement alone must not
let an outbox forget an entry.  Redis 7.0 has no ``WAITAOF`` (7.2+), and a
tenant's ACL user cannot run ``INFO`` (``@dangerous``) to watch the server's
``run_id``, so the window verifies the entries themselves:

- every acknowledged entry waits in the window with its stream id and the
  time of its acknowledgement;
- once ``after`` seconds have passed, the `VERIFY` script checks that the
  entry is still in the stream at its id (same key and identity), or below
  the tenant's ``trimmed`` mark (then a snapshot holds it).  Present means
  durable: either the server kept running for ``after`` seconds since the
  write (long enough for ``everysec`` to write and fsync it: Redis postpones
  a write behind a slow fsync by at most two seconds), or it restarted and
  loaded the entry back from its AOF.  Absent means Redis lost it: the
  publisher sends it again (its fleet id is the same, so a copy that did
  survive somewhere collapses);
- when the publisher's connection changes (a reconnect, perhaps to a
  restarted server, perhaps silently inside redis-py), the whole window is
  verified at once, so losses are resent without waiting ``after``
  seconds.  Every pipeline starts with ``CLIENT GETNAME`` and ``CLIENT
  SETNAME <token>`` (a random token per publisher): a connection that does
  not answer with the token was opened since the last pipeline.  (``CLIENT
  ID`` would not do: ids start again from 1 after a restart.)  In a
  Redis Cluster the name is per node and redis-py sends ``CLIENT`` commands
  to one node only, so there the client counts the connections it opened to
  any node (`FleetCluster.connections_made`): when the count moved since
  the last look (a node reconnected, or a promoted replica now serves a
  tenant's slot), the whole window is verified.  The timed verification
  alone would suffice for correctness; this only resends losses sooner.

Duplicates collapse on every replica, so verifying errs on the side of
resending.  With ``after`` = 0 (for ``appendfsync always``) there is no
window: an acknowledgement is durable.
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis

from agentspec._core.shardkey import key_json
from agentspec._fleet.connection import is_cluster
from agentspec._fleet.entry import FleetEntry
from agentspec._fleet.functions import fcall, is_missing, load_library
from agentspec._fleet.names import FleetKeys

__all__ = ["Acked", "DurableWindow", "verify"]

#: Entries checked per `VERIFY` call.
_CHUNK = 512


@dataclass(frozen=True, slots=True)
class Acked:
    """An acknowledged entry, its stream id and when it was acknowledged (monotonic)."""

    entry: FleetEntry
    stream_id: str
    at: float


class DurableWindow:
    """Acknowledged entries awaiting verification (the publisher's lock guards it)."""

    def __init__(self, after: float) -> None:
        """A window of ``after`` seconds."""
        self.after = after
        self.acked: deque[Acked] = deque()
        #: The connection name every pipeline checks, then sets.
        self.token = b"agentspec-pub-" + secrets.token_hex(8).encode()
        #: Cluster: (client serial, connections it made) at the last look.
        self.seen: tuple[int, int] | None = None

    def __len__(self) -> int:
        """Entries in the window."""
        return len(self.acked)

    def add(self, acked: Acked) -> None:
        """An entry Redis has just acknowledged."""
        self.acked.append(acked)

    def until_due(self, now: float) -> float | None:
        """Seconds until the oldest entry may be verified (None: the window is empty)."""
        return self.acked[0].at + self.after - now if self.acked else None

    def is_new_connection(self, name: Any) -> bool:
        """True when ``CLIENT GETNAME`` did not answer `token`: a connection not seen before.

        An error (``CLIENT`` refused by an ACL) tells nothing: the entries are
        then verified when they fall due, which is enough for correctness.
        """
        return not isinstance(name, Exception) and name != self.token

    def start(self, pipe: Any, client: redis.Redis) -> int:
        """Queue the connection check first on ``pipe``: the number of replies it takes.

        ``CLIENT GETNAME`` + ``CLIENT SETNAME``, except on a cluster (none:
        `reconnected` counts its connections instead).
        """
        if is_cluster(client):
            return 0
        pipe.client_getname()
        pipe.client_setname(self.token.decode())
        return 2

    def reconnected(self, client: redis.Redis, name: Any) -> bool:
        """Whether a connection was made since the last check (``name``: GETNAME's reply)."""
        if not is_cluster(client):
            return self.is_new_connection(name)
        mark = (int(getattr(client, "serial", 0)), int(getattr(client, "connections_made", 0)))
        new, self.seen = mark != self.seen, mark
        return new

    def candidates(self, now: float, everything: bool) -> list[Acked]:
        """The entries to verify now: the due ones, or all of them after a reconnect."""
        if everything:
            return list(self.acked)
        return [a for a in self.acked if a.at + self.after <= now]

    def resolve(
        self, checked: list[Acked], present: list[bool], checked_at: float
    ) -> tuple[list[FleetEntry], list[FleetEntry]]:
        """Take the verified entries out: ``(durable, lost)``.

        ``checked_at`` is when the verification was sent; an entry present
        then but acknowledged less than ``after`` seconds before stays.
        """
        durable: list[FleetEntry] = []
        lost: list[FleetEntry] = []
        done: set[int] = set()
        for a, ok in zip(checked, present, strict=True):
            if not ok:
                lost.append(a.entry)
            elif a.at + self.after <= checked_at:
                durable.append(a.entry)
            else:
                continue
            done.add(id(a))
        if done:
            self.acked = deque(a for a in self.acked if id(a) not in done)
        return durable, lost

    def drain(self) -> list[FleetEntry]:
        """Empty the window; its entries (for `FleetPublisher.close`)."""
        out = [a.entry for a in self.acked]
        self.acked.clear()
        return out


def verify(client: redis.Redis, entries: list[Acked]) -> list[bool]:
    """Whether each entry is still in its tenant's stream (or trimmed behind a snapshot).

    Raises:
        redis.RedisError: Redis could not be asked (nothing is decided).
    """
    pipe = client.pipeline(transaction=False)
    calls: list[list[int]] = []
    by_tenant: dict[str, list[int]] = {}
    for n, a in enumerate(entries):
        by_tenant.setdefault(a.entry.key[0], []).append(n)
    for tenant, idx in by_tenant.items():
        keys = FleetKeys.of(tenant)
        for start in range(0, len(idx), _CHUNK):
            part = idx[start : start + _CHUNK]
            args: list[str | bytes] = []
            for n in part:
                e = entries[n].entry
                args += (entries[n].stream_id, key_json(e.key), e.identity.encode("utf-8"))
            fcall(pipe, "verify", [keys.meta, keys.log], args)
            calls.append(part)
    present = [False] * len(entries)
    try:
        replies = pipe.execute()
    except redis.ResponseError as e:
        if not is_missing(e):
            raise
        load_library(client)
        return verify(client, entries)
    for part, reply in zip(calls, replies, strict=True):
        for n, ok in zip(part, reply, strict=True):
            present[n] = int(ok) == 1
    return present
