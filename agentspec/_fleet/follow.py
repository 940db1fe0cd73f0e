"""`FleetFollower`: many tenants' shards on one connection and one thread.

A replica that follows 100 tenants with one `FleetSubscriber` each would
hold 100 threads and 100 blocking Redis connections.  A follower holds one
of each: its members are ordinary `FleetSubscriber` objects (same trees,
stats, waits, pause and compaction) whose own threads never start; the
follower's thread drives them in turn, each by one bounded read
(`FleetSubscriber._step`), and when every member is caught up it waits for
any of their streams with a single ``XREAD BLOCK`` over all of them
(``COUNT 1`` per stream: only the arrival matters, the member's bounded
read fetches the entries).  A timeout wakes every member for one read, so
restarts, config changes and re-seeds are noticed within ``block_ms`` as
with one subscriber.  Under load it lingers ``linger_ms`` before the next
wait, so that one wait (whose cost grows with the number of tenants)
collects many entries.

All members share the follower's connection, hence its Redis user: follow
tenants that need different users with different followers.  A lost
connection reconnects every member, with backoff.  A member whose reads
fail for its own reasons (say its tenant wrote a hash where its stream
belongs) is kept out of the reads and the shared wait, with its own
doubling backoff, so one tenant cannot stop the others.  On Redis Cluster
one ``XREAD`` cannot name keys of several slots, so there the follower
waits ``block_ms / 10`` between rounds of reads instead of blocking.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import redis

from agentspec._core.shardkey import ShardKey, check_key
from agentspec._core.tree import SuffixTree
from agentspec._fleet.connection import Redactor, open_client, retry_until_stopped
from agentspec._fleet.ids import format_id
from agentspec._fleet.stats import SubscriberStats
from agentspec._fleet.sub import FleetSubscriber
from agentspec._util import live_metrics
from agentspec.exceptions import InvalidArgumentError

__all__ = ["FleetFollower"]


class FleetFollower:
    """Follows several tenants' fleet streams on one connection and one thread.

    Args:
        url: Redis URL (as `FleetSubscriber`); one user for every tenant.
        tenants: the tenants to follow (duplicates ignored; `follow` adds more).
        block_ms: longest wait of the shared ``XREAD`` (and of `close`).
        linger_ms: after a wait that ended with entries, pause this long before
            the next one, so that under load one ``XREAD`` (whose cost grows with
            the number of tenants) wakes for many entries rather than one; it
            adds at most this much to the lag of an entry.
        max_backoff: longest wait between reconnection attempts, seconds.
        **options: passed to each member `FleetSubscriber` (``config``,
            ``batch``, ``compact_every``, ``max_bytes``, ``heartbeat_s`` ...).
    """

    def __init__(
        self,
        url: str,
        tenants: Iterable[str],
        *,
        block_ms: int = 1000,
        linger_ms: float = 5.0,
        max_backoff: float = 2.0,
        start: bool = True,
        **options: Any,
    ) -> None:
        """Create the members and start the thread."""
        names = list(dict.fromkeys(tenants))
        if "start" in options:
            raise InvalidArgumentError("members are driven by the follower; do not pass start")
        self._url = url
        self._redactor = Redactor(url)
        self._block_ms = block_ms
        self._linger_s = max(0.0, linger_ms / 1000)
        self._busy = False  # the last wait ended with entries
        self.waits = 0  #: shared waits (``XREAD`` calls, or polls on a cluster) so far
        self._max_backoff = max_backoff
        self._options = {"block_ms": block_ms, "max_backoff": max_backoff, **options}
        self._lock = threading.Lock()
        self._members = {t: self._member(t) for t in names}
        self._fresh: set[str] = set()  # added since the session began: not yet begun
        self._backoff: dict[str, tuple[float, float]] = {}  # failing: (retry at, delay)
        self._stop = threading.Event()
        self._sessions = 0
        self._thread = threading.Thread(
            target=self._run, name="agentspec-fleet-follow", daemon=True
        )
        if start:
            self._thread.start()

    # --- public surface -----------------------------------------------------

    @property
    def tenants(self) -> tuple[str, ...]:
        """The tenants followed."""
        return tuple(self._members)

    def subscriber(self, tenant: str) -> FleetSubscriber:
        """The member that follows ``tenant`` (read trees, stats, wait on it).

        Raises:
            KeyError: the tenant is not followed.
        """
        return self._members[tenant]

    def follow(self, tenant: str) -> FleetSubscriber:
        """Follow one more tenant (from the next read on); its member, new or not."""
        with self._lock:
            member = self._members.get(tenant)
            if member is None:
                member = self._member(tenant)
                self._members = {**self._members, tenant: member}
                self._fresh.add(tenant)
        return member

    def _member(self, tenant: str) -> FleetSubscriber:
        member = FleetSubscriber(self._url, tenant, start=False, **self._options)
        member._driven = True
        return member

    def tree(self, key: object) -> SuffixTree | None:
        """The current tree of a shard key (None: none, or its tenant is not followed)."""
        k: ShardKey = check_key(key)
        member = self._members.get(k[0])
        return None if member is None else member.tree(k)

    def stats(self) -> dict[str, SubscriberStats]:
        """Each member's stats, by tenant."""
        return {t: m.stats() for t, m in self._members.items()}

    def start(self) -> None:
        """Start the thread (once; ``start=False`` at construction)."""
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread (it finishes its current read); the trees stay readable."""
        self._stop.set()
        for member in self._members.values():
            member._stop.set()
            member._unpaused.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for member in self._members.values():
            member._changed_now(_connected=False)
            live_metrics.retire(member)

    def __enter__(self) -> FleetFollower:
        """Use in a ``with`` block; closed on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the follower."""
        self.close()

    def __repr__(self) -> str:
        """Redacted URL and tenant count."""
        return f"<FleetFollower url={self._redactor.url!r} tenants={len(self._members)}>"

    # --- the thread -----------------------------------------------------------

    def _run(self) -> None:
        retry_until_stopped(self._session, self._stop, self._on_error, maximum=self._max_backoff)

    def _on_error(self, exc: BaseException) -> None:
        for member in self._members.values():
            member._on_error(exc)

    def _session(self) -> None:
        client = open_client(self._url, socket_timeout=self._block_ms / 1000 + 10)
        try:
            client.ping()
            with self._lock:
                self._fresh.clear()
            for member in self._members.values():
                member._begin(client)
            self._sessions += 1
            self._drive(client)
        finally:
            for member in self._members.values():
                member._end(client)
            client.close()

    def _drive(self, client: redis.Redis) -> None:
        awake = set(self._members)  # members to read from before waiting again
        cluster = isinstance(client, redis.cluster.RedisCluster)
        while not self._stop.is_set():
            if self._fresh:
                with self._lock:
                    fresh, self._fresh = self._fresh, set()
                for tenant in fresh:
                    self._members[tenant]._begin(client)
                awake |= fresh
            now = time.monotonic()
            awake |= {t for t, (at, _) in self._backoff.items() if at <= now}  # try again
            for tenant, member in self._members.items():
                if member._stop.is_set() or member._held() or self._benched(tenant, now):
                    awake.discard(tenant)
                    continue
                if tenant not in awake and not member._wanted():
                    continue
                try:
                    caught_up = member._step(client)
                except (redis.ConnectionError, redis.TimeoutError):
                    raise  # the connection: every member reconnects
                except redis.RedisError as e:  # this tenant only: it waits, the others go on
                    self._bench(tenant, e)
                    caught_up = True
                else:
                    self._backoff.pop(tenant, None)
                if caught_up:
                    awake.discard(tenant)
                else:
                    awake.add(tenant)
            if awake or self._stop.is_set():
                continue
            awake = self._wait(client, cluster)

    def _benched(self, tenant: str, now: float) -> bool:
        entry = self._backoff.get(tenant)
        return entry is not None and now < entry[0]

    def _bench(self, tenant: str, exc: BaseException) -> None:
        """Keep a failing member out of reads and waits for a while (doubling, capped)."""
        self._members[tenant]._on_error(exc)
        _, last = self._backoff.get(tenant, (0.0, 0.0))
        delay = min(self._max_backoff, max(0.05, 2 * last))
        self._backoff[tenant] = (time.monotonic() + delay, delay)

    def _wait(self, client: redis.Redis, cluster: bool) -> set[str]:
        """Wait for an entry on any member's stream; the members to read from next."""
        now = time.monotonic()
        waiting = {
            m._keys.log: (t, format_id(m._position))
            for t, m in self._members.items()
            if not m._stop.is_set() and m._unpaused.is_set() and not self._benched(t, now)
        }
        block_s = self._block_ms / 1000
        if self._backoff:  # wake up when the first benched member may try again
            block_s = min(block_s, max(0.001, min(t for t, _ in self._backoff.values()) - now))
        if not waiting or cluster:
            self._stop.wait(block_s / (10 if waiting and cluster else 1))
            return set(self._members)
        if self._busy and self._linger_s:
            self._stop.wait(self._linger_s)  # let more entries arrive: one wake-up for many
        self.waits += 1
        streams: dict[Any, Any] = {log: pos for log, (_, pos) in waiting.items()}
        try:
            reply = client.xread(streams, count=1, block=max(1, int(block_s * 1000)))
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except redis.ResponseError:
            # One stream is not a stream (a tenant wrote another type under its key):
            # find it and bench it, so it cannot stop the other tenants' waits.
            for log, (tenant, _) in waiting.items():
                try:
                    client.xlen(log)
                except redis.ResponseError as e:
                    self._bench(tenant, e)
            return set(self._members)
        self._busy = bool(reply)
        if not reply:  # a timeout: every member reads once (restarts, config, re-seeds)
            return set(self._members)
        woken: set[str] = set()
        for item in reply:
            stream = item[0]
            name = stream.decode() if isinstance(stream, bytes) else str(stream)
            if name in waiting:
                woken.add(waiting[name][0])
        return woken
