"""Read-only views of fleet subscribers and publishers, for dashboards and tests."""

from __future__ import annotations

from dataclasses import dataclass

from agentspec._core.shardkey import ShardKey

__all__ = ["FleetShardStats", "PublisherStats", "SubscriberStats"]


@dataclass(frozen=True, slots=True)
class FleetShardStats:
    """One shard of a subscriber.

    Attributes:
        key: the shard key.
        sequences, tokens: what the shard holds.
        last_id: stream id of the last entry for this shard read (or its
            snapshot's covered id).
        through: the covered id of the snapshot it was loaded from (``0-0``: none).
        applied, duplicates, evicted: entries learned, duplicates skipped,
            sequences evicted by the token budget, since it was loaded.
    """

    key: ShardKey
    sequences: int
    tokens: int
    last_id: str
    through: str
    applied: int
    duplicates: int
    evicted: int


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    """A subscriber at one moment.

    Attributes:
        tenant: its tenant.
        connected: whether it is connected to Redis now.
        position: id of the last stream entry it has read (``0-0``: none).
        head: the stream's last id when it last looked.
        lag_ms: wall-clock milliseconds since the oldest entry it has not applied
            yet was added (by that entry's stream id; 0 when caught up).  It
            keeps growing while the subscriber cannot advance.
        applied, duplicates, malformed: entries learned, skipped as
            duplicates, refused by validation.
        covered_skips: entries skipped because a loaded snapshot held them.
        loads: snapshot loads (the first one included; more after a
            trimmed-past or lost position).
        reconnects: connections made after the first.
        compactions: compaction rounds it completed.
        bad_snapshots: snapshots refused while loading.
        last_error: the last error, secrets removed (None: none yet).
        shards: per-shard stats, by key.
        id: its id in heartbeats (``P sub:<id>``).
        compacts: False once Redis refused it a compaction (a read-only user).
        heartbeats: heartbeats written.
        denied: writes Redis refused it (config, compaction, heartbeat, re-seed).
        bad_config: times the tenant's config in Redis was unusable (it kept its own).
        gaps: reads past a position the stream no longer backs, after
            repeated reloads found no snapshot that does (entries lost).
        seeded: times it re-seeded Redis from its shards after the tenant's
            data was gone.
        compaction_errors: compaction rounds Redis failed (e.g. damaged marks).
        evicted_shards: shards dropped by eviction entries (the tenant's shard
            cap, `FleetConfig.max_shards`), alike on every replica.
        dropped_local: shards dropped here for the subscriber's own memory
            budget (``max_bytes``); back at the next reload.
        bytes: what the trees of every shard hold (both of each left-right pair).
        lag_counts, lag_sum: the lag of every applied entry -- seconds from the
            time in its stream id (when Redis added it) to when it was applied
            here -- as counts per bucket of
            `agentspec.metrics.FLEET_LAG_SECONDS_BUCKETS` (``le`` bounds, +Inf
            last; not cumulative) and their sum.
        snapshot_age_ms: wall-clock milliseconds since the stream time of the
            newest snapshot round it knows (the stream position a compaction
            round covered: one it loaded, ran, or saw as the tenant's ``round``
            mark, read about once a second); None while it knows none.
    """

    tenant: str
    connected: bool
    position: str
    head: str
    lag_ms: int
    applied: int
    duplicates: int
    malformed: int
    covered_skips: int
    loads: int
    reconnects: int
    compactions: int
    bad_snapshots: int
    last_error: str | None
    shards: dict[ShardKey, FleetShardStats]
    id: str = ""
    compacts: bool = True
    heartbeats: int = 0
    denied: int = 0
    bad_config: int = 0
    gaps: int = 0
    seeded: int = 0
    compaction_errors: int = 0
    evicted_shards: int = 0
    dropped_local: int = 0
    bytes: int = 0
    lag_counts: tuple[int, ...] = ()
    lag_sum: float = 0.0
    snapshot_age_ms: int | None = None


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """A publisher at one moment.

    Attributes:
        connected: whether its last Redis call succeeded.
        pending: entries accepted and not yet settled (queued, in flight,
            or in the durability window).
        published: entries Redis acknowledged.
        refused_full: `FleetPublisher.publish` calls refused (queue full or closed).
        rejected: entries Redis refused for good (no permission, too large, ...).
        failures: failed attempts to reach Redis (entries kept and retried).
        last_error: the last failure or rejection, secrets removed (None: none
            since the last send that went through).
        unconfirmed: acknowledged entries waiting in the durability window.
        durable: entries known to be durable (verified, or acknowledged
            when there is no window).
        lost: acknowledged entries Redis lost (found missing), sent again.
    """

    connected: bool
    pending: int
    published: int
    refused_full: int
    rejected: int
    failures: int
    last_error: str | None
    unconfirmed: int = 0
    durable: int = 0
    lost: int = 0
