"""The worker's link to the fleet: Redis-backed shards shared by every replica.

With ``redis_url`` set (``AGENTSPEC_VLLM_REDIS_URL``), the proposer makes one
`WorkerFleet`:

- **Subscribing.** The first request of a tenant adds it to the worker's
  one `agentspec.fleet.FleetFollower` (at most ``fleet_max_tenants`` per
  worker; later tenants draft without fleet shards, logged once).  Its one
  background thread and one connection load each tenant's snapshots and
  tail every tenant's stream; the proposer drafts from the fleet tree of a request's shard key as
  one more tree beside its own learned and pushed shards.  Looking a tree up
  never waits on Redis (the subscriber double-buffers its trees).
- **Publishing.** Each finished response is handed to one
  `agentspec.fleet.FleetPublisher`, whose queue and thread send it; the
  decode step only hashes it.  Its tokens are the prompt's last
  ``lead_tokens`` tokens followed by the output (what `agentspec.Speculator`
  learns, and what the client side learns with the same ``lead_tokens``);
  its identity is ``extra_args["agentspec_request_id"]`` when the client sent
  one, else vLLM's request id.  A client publishing the same response under
  the same identity produces the same fleet id, so the fleet learns it once.

Redis down or slow never stops drafting or serving: the threads retry with
backoff, the trees already loaded stay, a full publish queue drops the
response (counted).  The URL's password never reaches a log line or a stat.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from agentspec import ShardKey, SuffixTree
from agentspec.exceptions import AgentSpecError, InvalidArgumentError
from agentspec.fleet import (
    FleetConfig,
    FleetFollower,
    FleetPublisher,
    FleetSubscriber,
    PublishStatus,
    check_identity,
    redact_url,
)
from agentspec.integration import get_logger
from agentspec.metrics import FLEET_LAG_SECONDS_BUCKETS

__all__ = ["WorkerFleet"]

_log = get_logger()


class WorkerFleet:
    """One worker's fleet subscribers (per tenant, added lazily to one follower) and publisher.

    Args:
        url: the Redis URL (its password is never logged).
        config: depth and per-shard token budget written for a tenant Redis
            has no config for yet (Redis's own always wins).
        max_tenants: most tenants subscribed at once.
        publish: publish finished responses (False: subscribe only, e.g.
            with a read-only Redis user; `publish` then returns False).
        **subscriber_options: passed to the `FleetFollower` (e.g. ``block_ms``).
    """

    def __init__(
        self,
        url: str,
        config: FleetConfig,
        *,
        max_tenants: int = 16,
        publish: bool = True,
        publisher_options: dict[str, Any] | None = None,
        **subscriber_options: Any,
    ) -> None:
        """Start the publisher; subscribers start with their tenant's first request."""
        self.url = redact_url(url)
        self._url = url
        self._config = config
        self.max_tenants = max_tenants
        self._sub_options = subscriber_options
        self._subs: dict[str, FleetSubscriber] = {}
        self._follower: FleetFollower | None = None  # started with the first tenant
        self._lock = threading.Lock()
        self._warned_tenants = False
        self.refused_tenants = 0
        self.published = 0
        self.dropped = 0  # queue full, closed, or a sequence the fleet cannot take
        self.publisher: FleetPublisher | None = None
        if publish:
            self.publisher = FleetPublisher(url, config=config, **(publisher_options or {}))
        _log.info("agentspec.vllm.fleet", url=self.url, max_tenants=max_tenants, publish=publish)

    def subscribe(self, tenant: str) -> FleetSubscriber | None:
        """The tenant's subscriber, started on the first call (None: over ``max_tenants``)."""
        sub = self._subs.get(tenant)
        if sub is not None:
            return sub
        with self._lock:
            sub = self._subs.get(tenant)
            if sub is None:
                if len(self._subs) >= self.max_tenants:
                    self.refused_tenants += 1
                    if not self._warned_tenants:
                        self._warned_tenants = True
                        _log.warning(
                            "agentspec.vllm.fleet_tenants_full",
                            max_tenants=self.max_tenants,
                            hint="later tenants draft without fleet shards "
                            "(raise fleet_max_tenants)",
                        )
                    return None
                try:
                    if self._follower is None:
                        self._follower = FleetFollower(
                            self._url, [], config=self._config, **self._sub_options
                        )
                    sub = self._follower.follow(tenant)
                except Exception as e:  # e.g. no thread could start: serve without it
                    _log.error("agentspec.vllm.fleet_subscribe_failed", error=repr(e)[:200])
                    return None
                self._subs[tenant] = sub
            return sub

    def tree(self, key: ShardKey) -> SuffixTree | None:
        """The fleet tree of ``key`` now, or None (no subscriber or no such shard yet)."""
        sub = self._subs.get(key[0])
        return None if sub is None else sub.tree(key)

    def subscriber(self, tenant: str) -> FleetSubscriber | None:
        """The tenant's subscriber if one was started."""
        return self._subs.get(tenant)

    def publish(self, key: ShardKey, tokens: Sequence[int] | Any, identity: str) -> bool:
        """Queue one finished response for the fleet; never raises, never waits on Redis."""
        if self.publisher is None:
            return False
        try:
            status = self.publisher.publish(key, tokens, check_identity(identity))
        except (AgentSpecError, TypeError, ValueError) as e:
            self.dropped += 1
            _log.warning("agentspec.vllm.fleet_publish_refused", error=str(e)[:200])
            return False
        if status is PublishStatus.QUEUED:
            self.published += 1
            return True
        self.dropped += 1
        return False

    def stats(self) -> dict[str, Any]:
        """Publisher and per-tenant subscriber stats (JSON-ready, no secrets)."""
        tenants: dict[str, Any] = {}
        for tenant, sub in sorted(self._subs.items()):
            s = sub.stats()
            tenants[tenant] = {
                "connected": s.connected,
                "position": s.position,
                "lag_ms": s.lag_ms,
                "shards": len(s.shards),
                "applied": s.applied,
                "duplicates": s.duplicates,
                "malformed": s.malformed,
                "reconnects": s.reconnects,
                "last_error": s.last_error,
                "compacts": s.compacts,
                "denied": s.denied,
            }
        publisher: dict[str, Any] | None = None
        if self.publisher is not None:
            pub = self.publisher.stats()
            publisher = {
                "connected": pub.connected,
                "pending": pub.pending,
                "acknowledged": pub.published,
                "rejected": pub.rejected,
                "failures": pub.failures,
                "last_error": pub.last_error,
                "last_id": self.publisher.last_id,
            }
        return {
            "url": self.url,
            "published": self.published,
            "dropped": self.dropped,
            "refused_tenants": self.refused_tenants,
            "publisher": publisher,
            "tenants": tenants,
        }

    def metrics(self, lag_buckets: Sequence[float]) -> dict[str, Any]:
        """The counters behind the plugin's fleet metrics (JSON-ready, see
        `agentspec_vllm.metrics`).  ``lag``: the subscribers' lag of every applied
        entry (`SubscriberStats.lag_counts`: counts per bucket of ``lag_buckets``,
        which must be `agentspec.metrics.FLEET_LAG_SECONDS_BUCKETS`, +Inf last,
        summed over the subscribers; and their sum).  ``snapshot_age``: per
        tenant, seconds since the newest snapshot round its subscriber knows
        (`SubscriberStats.snapshot_age_ms`; tenants knowing none are left out)."""
        if tuple(lag_buckets) != FLEET_LAG_SECONDS_BUCKETS:
            raise InvalidArgumentError("lag_buckets must be FLEET_LAG_SECONDS_BUCKETS")
        subs = [sub.stats() for _, sub in sorted(self._subs.items())]
        counts = [0] * (len(FLEET_LAG_SECONDS_BUCKETS) + 1)
        for s in subs:
            if len(s.lag_counts) == len(counts):
                counts = [a + b for a, b in zip(counts, s.lag_counts, strict=True)]
        pub = self.publisher.stats() if self.publisher is not None else None
        return {
            "published": 0 if pub is None else pub.published,
            "publish_failures": 0 if pub is None else pub.failures + pub.rejected,
            "publish_backlog": 0 if pub is None else pub.pending,
            "dropped": self.dropped,
            "applied": sum(s.applied for s in subs),
            "malformed": sum(s.malformed for s in subs),
            "reconnects": sum(s.reconnects for s in subs),
            "compactions": sum(s.compactions for s in subs),
            "evicted": sum(s.evicted_shards for s in subs),
            "bytes": sum(s.bytes for s in subs),
            "shards": [
                [k[0], k[1] or "", k[2] or "", sh.tokens]
                for s in subs
                for k, sh in s.shards.items()
            ],
            "lag": {"counts": counts, "sum": sum(s.lag_sum for s in subs)},
            "snapshot_age": {
                s.tenant: s.snapshot_age_ms / 1000.0 for s in subs if s.snapshot_age_ms is not None
            },
        }

    def close(self, timeout: float = 2.0) -> None:
        """Stop the subscribers and the publisher (unsent responses are dropped)."""
        if self._follower is not None:
            self._follower.close(timeout)
        left = [] if self.publisher is None else self.publisher.close(timeout)
        if left:
            _log.warning("agentspec.vllm.fleet_unsent", responses=len(left))
