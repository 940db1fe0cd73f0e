"""The embedded engine's link to the fleet: subscribed trees to draft from, finished responses out.

`EngineFleet` follows its tenants with one `FleetFollower` (one background
thread and one connection load every tenant's snapshots and tail their
streams) and publishes with one `FleetPublisher`.  The engine asks `tree`
for a request's shard key once per draft (never waiting on Redis) and calls
`publish` with each finished response.  Redis being down never stops the
engine: the subscribers keep their trees and reconnect, the publisher
queues (up to ``max_pending`` entries, then refuses with a count).  The
URL's password never appears in logs, errors or stats (`redact_url`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agentspec._core.tree import SuffixTree
from agentspec._fleet.config import FleetConfig
from agentspec._fleet.connection import redact_url
from agentspec._fleet.follow import FleetFollower
from agentspec._fleet.pub import FleetPublisher, PublishStatus
from agentspec._fleet.sub import FleetSubscriber
from agentspec._util.log import get_logger
from agentspec.protocol import DEFAULT_TENANT, ShardKey

__all__ = ["REDIS_URL_ENV", "EngineFleet", "fleet_tenants_for"]

_log = get_logger()

#: Environment variable holding the Redis URL of ``agentspec serve --engine embedded``.
REDIS_URL_ENV = "AGENTSPEC_REDIS_URL"


class EngineFleet:
    """Fleet subscribers (one per tenant, on one follower) and a publisher for one engine.

    Args:
        url: the Redis URL (its password is never shown).
        tenants: the tenants to follow (default: ``"default"``); requests of
            other tenants draft from the engine's own shards only, but their
            responses are still published.
        config: the config written for a tenant Redis has none for yet (the
            one in Redis wins); match the engine's ``max_depth``.
        max_pending: most responses queued while Redis is slow or down.
        block_ms: longest ``XREAD`` wait of the subscribers.
    """

    def __init__(
        self,
        url: str,
        tenants: Iterable[str] = (DEFAULT_TENANT,),
        *,
        config: FleetConfig | None = None,
        max_pending: int = 10_000,
        block_ms: int = 1000,
    ) -> None:
        """Start the subscribers and the publisher."""
        self.url = redact_url(url)
        self.config = config or FleetConfig()
        names = list(dict.fromkeys(tenants)) or [DEFAULT_TENANT]
        self.follower = FleetFollower(url, names, config=self.config, block_ms=block_ms)
        self.subscribers: dict[str, FleetSubscriber] = {
            t: self.follower.subscriber(t) for t in names
        }
        try:
            self.publisher = FleetPublisher(url, config=self.config, max_pending=max_pending)
        except BaseException:
            self.follower.close()
            raise
        self._n = dict.fromkeys(("queued", "refused", "invalid"), 0)

    @property
    def tenants(self) -> Sequence[str]:
        """The tenants followed."""
        return tuple(self.subscribers)

    def tree(self, key: ShardKey) -> SuffixTree | None:
        """The fleet's tree for ``key`` now (None: none, or the tenant is not followed)."""
        sub = self.subscribers.get(key[0])
        return None if sub is None else sub.tree(key)

    def publish(self, key: ShardKey, tokens: Sequence[int], identity: str) -> PublishStatus | None:
        """Queue a finished response for the fleet; never waits, never raises.

        None: the sequence was not valid for the fleet (counted as ``invalid``).
        """
        try:
            status = self.publisher.publish(key, list(tokens), identity)
        except (ValueError, TypeError) as exc:  # InvalidArgumentError is a ValueError
            self._n["invalid"] += 1
            _log.debug("agentspec.engine.fleet_publish_invalid", error=str(exc)[:200])
            return None
        self._n["queued" if status is PublishStatus.QUEUED else "refused"] += 1
        return status

    def stats(self) -> dict[str, Any]:
        """Publisher and subscriber counters (JSON-ready; the URL redacted)."""
        pub = self.publisher.stats()
        subs: dict[str, Any] = {}
        for tenant, sub in self.subscribers.items():
            s = sub.stats()
            subs[tenant] = {
                "connected": s.connected,
                "position": s.position,
                "head": s.head,
                "lag_ms": s.lag_ms,
                "shards": len(s.shards),
                "sequences": sum(x.sequences for x in s.shards.values()),
                "tokens": sum(x.tokens for x in s.shards.values()),
                "applied": s.applied,
                "duplicates": s.duplicates,
                "malformed": s.malformed,
                "loads": s.loads,
                "reconnects": s.reconnects,
                "last_error": s.last_error,
            }
        return {
            "redis": self.url,
            "publisher": {
                "connected": pub.connected,
                "pending": pub.pending,
                "published": pub.published,
                "queued": self._n["queued"],
                "refused": self._n["refused"],
                "invalid": self._n["invalid"],
                "rejected": pub.rejected,
                "failures": pub.failures,
                "last_error": pub.last_error,
            },
            "subscribers": subs,
        }

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued for up to ``timeout`` seconds, then stop every thread."""
        left = self.publisher.close(timeout)
        if left:
            _log.warning("agentspec.engine.fleet_unsent", entries=len(left))
        self.follower.close()

    def __repr__(self) -> str:
        """The redacted URL and the tenants."""
        return f"<EngineFleet url={self.url!r} tenants={list(self.subscribers)!r}>"


def fleet_tenants_for(
    tenants: Sequence[str] | None,
    tenant_keys: Mapping[str, str] | None,
    api_key: str | None = None,
) -> list[str]:
    """The tenants an engine follows: ``tenants`` if given, else the tenant map's.

    With a map, the ``"default"`` tenant joins when an ``api_key`` is also
    accepted (its requests are the default tenant's); without a map: ``"default"``.
    """
    if tenants:
        return list(dict.fromkeys(tenants))
    if tenant_keys:
        names = sorted(set(tenant_keys.values()))
        if api_key and DEFAULT_TENANT not in names:
            names.append(DEFAULT_TENANT)
        return names
    return [DEFAULT_TENANT]
