"""The fleet: shards shared by every replica and learner through Redis Streams.

Public names for what ``docs/fleet.md`` describes:

- `FleetPublisher`: appends finished, tagged sequences to a tenant's stream
  (`FleetPublisher.publish`), never blocking the caller; queues while Redis
  is down.  `agentspec.ShardStore` and `agentspec.AgentSpecClient` publish
  through it with ``redis=`` (and a durable outbox).
- `FleetSubscriber`: follows one tenant's snapshots and stream into
  per-shard `agentspec.SuffixTree` objects to draft from; writes a
  heartbeat that `fleet_status` lists.
- `FleetFollower`: many tenants' subscribers on one connection and one
  thread (a replica that follows many tenants).
- `FleetConfig`: a tenant's tree depth and per-shard token budget (stored
  in Redis; the first writer wins).
- `fleet_status`: what ``agentspec fleet status`` prints, as a dict.
- `tenant_acl_rules`: the ``ACL SETUSER`` rules of a tenant's Redis user
  (read-write, or read-only for replicas that only subscribe).
- `redact_url`: a Redis URL with its password as ``***``; `Redactor`
  removes a URL's password from any text (error messages, logs).

Needs the ``redis`` client (``pip install 'agentspec-suffix[fleet]'``).
"""

from __future__ import annotations

try:
    import redis as _redis  # noqa: F401
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "agentspec.fleet needs the redis client: pip install 'agentspec-suffix[fleet]'"
    ) from _e

from agentspec._fleet.config import FleetConfig
from agentspec._fleet.connection import Redactor, redact_url
from agentspec._fleet.follow import FleetFollower
from agentspec._fleet.heartbeat import Heartbeat, read_heartbeats
from agentspec._fleet.ids import check_identity
from agentspec._fleet.names import tenant_acl_rules
from agentspec._fleet.pub import FleetPublisher, PublishStatus
from agentspec._fleet.stats import FleetShardStats, PublisherStats, SubscriberStats
from agentspec._fleet.status import fleet_status
from agentspec._fleet.sub import FleetSubscriber

__all__ = [
    "FleetConfig",
    "FleetFollower",
    "FleetPublisher",
    "FleetShardStats",
    "FleetSubscriber",
    "Heartbeat",
    "PublishStatus",
    "PublisherStats",
    "Redactor",
    "SubscriberStats",
    "check_identity",
    "fleet_status",
    "read_heartbeats",
    "redact_url",
    "tenant_acl_rules",
]
