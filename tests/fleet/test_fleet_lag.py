"""Fleet lag histogram and snapshot age on a real redis-server.

Entries written with stream ids 120 s, 30 s and 7 s in the past, then one
published now, land in the lag buckets their age says (`SubscriberStats.lag_counts`,
the library's ``agentspec_fleet_lag_seconds``); the snapshot age starts
unknown, grows, resets after a compaction covering a newer entry, and reaches
a replica that did not compact (it reads the tenant's ``round`` mark).
Waits are events or polled conditions with timeouts.
"""

from __future__ import annotations

import array

from prometheus_client.parser import text_string_to_metric_families
from redis_server import RedisServer, eventually, requires_redis_server

from agentspec import metrics as m
from agentspec._fleet.config import FleetConfig
from agentspec._fleet.entry import FleetEntry
from agentspec._fleet.names import FleetKeys
from agentspec._fleet.pub import FleetPublisher
from agentspec._fleet.sub import FleetSubscriber

pytestmark = requires_redis_server

CFG = FleetConfig(max_depth=16, max_shard_tokens=1000)
WAIT = 60.0
TENANT = "t-lag"
KEY = (TENANT, "p", "s")


def _library() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = m.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith((m.FLEET_LAG_SECONDS, m.FLEET_SNAPSHOT_AGE_SECONDS))
    }


def _buckets(rows):
    name = f"{m.FLEET_LAG_SECONDS}_bucket"
    return {dict(labels)["le"]: v for (n, labels), v in rows.items() if n == name}


def test_lag_buckets_and_snapshot_age():
    before = _buckets(_library())
    with (
        RedisServer() as server,
        FleetSubscriber(server.url, TENANT, config=CFG, block_ms=100, compact_every=0) as sub,
        FleetSubscriber(server.url, TENANT, config=CFG, block_ms=100, compact_every=0) as other,
        FleetPublisher(server.url, config=CFG) as pub,
    ):
        assert sub.wait_until(lambda: sub.stats().loads >= 1, WAIT)
        assert sub.stats().snapshot_age_ms is None  # no snapshot yet
        admin = server.client()
        now_ms = int(admin.time()[0]) * 1000
        last = ""
        for age_s, n in ((120, 1), (30, 2), (7, 3)):
            fields = FleetEntry.make(KEY, f"old-{age_s}", array.array("i", [n, n, n])).fields(16)
            last = admin.xadd(FleetKeys.of(TENANT).log, fields, id=f"{now_ms - age_s * 1000}-0")
        assert sub.wait_for(last, WAIT)
        assert other.wait_for(last, WAIT)

        # compaction at the 7 s old entry: the age is about 7 s, and grows
        assert sub.compact() is not None
        first = sub.stats().snapshot_age_ms
        assert first is not None
        assert 7000 <= first < 30_000
        assert eventually(lambda: (sub.stats().snapshot_age_ms or 0) > first + 300, WAIT)

        # an entry published now, then a compaction covering it: the age resets
        pub.publish(KEY, [9, 9, 9], "now")
        assert pub.flush(WAIT)
        assert sub.wait_for(pub.last_id, WAIT)
        assert other.wait_for(pub.last_id, WAIT)
        assert sub.compact() is not None
        reset = sub.stats().snapshot_age_ms
        assert reset is not None
        assert reset < 5000
        # the replica that did not compact sees the round mark too
        assert eventually(lambda: (other.stats().snapshot_age_ms or 10**9) < 5000, WAIT)
        assert other.stats().compactions == 0
        # a replica starting now loads the snapshot: it knows its age at once
        with FleetSubscriber(server.url, TENANT, config=CFG, compact_every=0) as late:
            assert late.wait_until(lambda: late.stats().loads >= 1, WAIT)
            assert (late.stats().snapshot_age_ms or 10**9) < 5000
        admin.close()

        # lag per applied entry: +Inf (120 s), le 60 (30 s), le 10 (7 s), le 5 (now)
        bounds = m.FLEET_LAG_SECONDS_BUCKETS
        for st in (sub.stats(), other.stats()):
            counts = st.lag_counts
            assert len(counts) == len(bounds) + 1
            assert counts[-1] == 1
            assert counts[bounds.index(60.0)] == 1
            assert counts[bounds.index(10.0)] == 1
            assert sum(counts[: bounds.index(5.0) + 1]) == 1
            assert sum(counts) == st.applied == 4
            assert 157 <= st.lag_sum < 175

        # the library's default registry renders both subscribers' histogram and the age
        rows = _library()
        after = _buckets(rows)
        both = [
            a + b for a, b in zip(sub.stats().lag_counts, other.stats().lag_counts, strict=True)
        ]
        cumulative = 0
        for bound, n in zip([*map(repr, bounds), "+Inf"], both, strict=True):
            cumulative += n
            assert after[bound] - before.get(bound, 0.0) == cumulative, bound
        age = rows[(m.FLEET_SNAPSHOT_AGE_SECONDS, (("tenant", TENANT),))]
        assert abs(age - (sub.stats().snapshot_age_ms or 0) / 1000) < 2.0
