"""`FleetFollower`: many tenants on one connection and one thread, on a real redis-server.

Checked: a follower of 100 tenants holds one connection (``CLIENT LIST``
on the server) and one thread, and every member converges to what a
plain `FleetSubscriber` of its tenant holds; pause, resume and compaction
work on a member; a Redis restart reconnects every member.  Waits are
events with timeouts.
"""

from __future__ import annotations

import threading

import pytest
from redis_server import RedisServer, requires_redis_server

from agentspec._fleet.config import FleetConfig
from agentspec._fleet.follow import FleetFollower
from agentspec._fleet.pub import FleetPublisher
from agentspec._fleet.sub import FleetSubscriber
from agentspec.exceptions import InvalidArgumentError

pytestmark = requires_redis_server

CFG = FleetConfig(max_depth=16, max_shard_tokens=1000)
WAIT = 60.0
TENANTS = [f"t{i:03d}" for i in range(100)]


def contents(sub):
    return {k: sorted(t.sequence(i) for i in t.sequence_ids()) for k, t in sub.trees().items()}


def connections(admin):
    return [
        c for c in admin.client_list() if c.get("name") != "admin" and c["cmd"] != "client|list"
    ]


def test_a_follower_of_100_tenants_uses_one_connection_and_one_thread():
    with RedisServer() as server:
        admin = server.client()
        admin.client_setname("admin")
        before = threading.active_count()
        with (
            FleetPublisher(server.url, config=CFG) as pub,
            FleetFollower(server.url, TENANTS, config=CFG, block_ms=200, compact_every=0) as f,
        ):
            assert threading.active_count() == before + 2  # the publisher's and the follower's
            for round_ in range(3):
                for i, tenant in enumerate(TENANTS):
                    pub.publish((tenant, "p", f"s{i % 3}"), [i, round_, 1], f"r{i}-{round_}")
            assert pub.flush(WAIT)
            last = {}
            for entry_id, tenant in _last_ids(admin):
                last[tenant] = entry_id
            for tenant in TENANTS:
                assert f.subscriber(tenant).wait_for(last[tenant], WAIT), tenant
            pub_conns = 1
            assert len(connections(admin)) == 1 + pub_conns
            for tenant in ("t000", "t057", "t099"):
                with FleetSubscriber(server.url, tenant, config=CFG, block_ms=100) as alone:
                    assert alone.wait_for(last[tenant], WAIT)
                    assert contents(alone) == contents(f.subscriber(tenant))
            st = f.stats()
            assert sum(s.applied for s in st.values()) == 300
            assert all(s.connected and s.last_error is None for s in st.values())
        admin.close()


def _last_ids(admin):
    from agentspec._fleet.names import FleetKeys

    for tenant in TENANTS:
        ((entry_id, _fields),) = admin.xrevrange(FleetKeys.of(tenant).log, count=1)
        yield entry_id, tenant


def test_members_pause_resume_compact_and_reconnect_after_a_restart():
    with (
        RedisServer() as server,
        FleetPublisher(server.url, config=CFG, max_backoff=0.2) as pub,
        FleetFollower(
            server.url, ["a", "b"], config=CFG, block_ms=100, max_backoff=0.2, compact_every=0
        ) as f,
    ):
        a, b = f.subscriber("a"), f.subscriber("b")
        with pytest.raises(InvalidArgumentError, match="FleetFollower drives"):
            a.start()  # a member has no thread of its own
        pub.publish(("a", "p", "s"), [1, 2, 3], "r1")
        assert pub.flush(WAIT)
        assert a.wait_for(pub.last_id, WAIT)
        assert a.pause()
        pub.publish(("a", "p", "s"), [4, 5, 6], "r2")
        pub.publish(("b", "p", "s"), [7, 8, 9], "r3")
        assert pub.flush(WAIT)
        assert b.wait_for(pub.last_id, WAIT)  # b goes on while a is paused
        assert a.stats().applied == 1
        a.resume()
        assert a.wait_until(lambda: a.stats().applied == 2, WAIT)
        assert a.compact() is not None
        server.kill()
        assert a.wait_until(lambda: not a.stats().connected, WAIT)
        server.start()
        pub.publish(("b", "p", "s"), [1, 1, 1], "r4")
        assert pub.flush(WAIT)
        assert b.wait_for(pub.last_id, WAIT)
        assert a.wait_until(lambda: a.stats().connected, WAIT)
        assert b.stats().reconnects >= 1
        assert len(b.tree(("b", "p", "s"))) == 2


def test_one_tenant_with_a_broken_stream_key_does_not_stop_the_others():
    with (
        RedisServer() as server,
        FleetPublisher(server.url, config=CFG) as pub,
    ):
        admin = server.client()
        from agentspec._fleet.names import FleetKeys

        admin.hset(FleetKeys.of("bad").log, "not", "a stream")  # a tenant's own key, misused
        with FleetFollower(
            server.url, ["a", "bad", "c"], config=CFG, block_ms=200, max_backoff=0.5
        ) as f:
            for i in range(20):
                pub.publish(("a", "p", "s"), [i, 1], f"a{i}")
                pub.publish(("c", "p", "s"), [i, 2], f"c{i}")
            assert pub.flush(WAIT)
            for tenant in ("a", "c"):
                sub = f.subscriber(tenant)
                assert sub.wait_until(lambda s=sub: s.stats().applied == 20, WAIT)
            bad = f.subscriber("bad")
            assert bad.wait_until(lambda: "WRONGTYPE" in (bad.stats().last_error or ""), WAIT)
            admin.delete(FleetKeys.of("bad").log)  # repaired: it recovers
            pub.publish(("bad", "p", "s"), [5, 5], "b1")
            assert pub.flush(WAIT)
            assert bad.wait_for(pub.last_id, WAIT)
            assert f.subscriber("a").stats().reconnects == 0
        admin.close()
