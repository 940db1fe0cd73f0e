"""The fleet on Redis Cluster: URLs, setup, tenants over slots, and a failover mid-run.

Checked: ``redis+cluster://`` URLs parse (hosts, default port, IPv6) and bad
ones fail with a clear error that holds no password; ``agentspec fleet
setup`` on a cluster URL loads the library on every primary and creates
the tenant users on every node; tenants whose keys hash to different
masters publish (a `FleetPublisher` with a durability window, and a
`ShardStore` outbox), subscribe, compact and trim through their own
least-privilege users, and ``agentspec fleet status`` reads them; a master
SIGKILLed mid-run, its replica promoted by the cluster: every sequence a
store acknowledged ends up in the fleet exactly once.  Every wait is a
predicate polled against a deadline.
"""

from __future__ import annotations

import json

import pytest
from failover_run import KEY as FAILOVER_KEY
from failover_run import learn_through_a_failover
from redis_cluster import RedisCluster, requires_redis_cluster
from redis_server import eventually

from agentspec.__main__ import main
from agentspec._fleet.config import FleetConfig
from agentspec._fleet.connection import (
    FleetCluster,
    is_transient,
    open_client,
    parse_cluster_url,
    redact_url,
)
from agentspec._fleet.follow import FleetFollower
from agentspec._fleet.names import FleetKeys, tenant_acl_rules
from agentspec._fleet.pub import FleetPublisher
from agentspec._fleet.scripts import LIBRARY_NAME
from agentspec._fleet.sub import FleetSubscriber
from agentspec._store.fleet_outbox import FleetOptions
from agentspec._store.store import ShardStore
from agentspec.exceptions import InvalidArgumentError

CFG = FleetConfig(max_depth=16, max_shard_tokens=None)
WAIT = 60.0
PASSWORD = "cl-s3cret"


# --- URLs ---------------------------------------------------------------------------


def test_cluster_urls_parse_and_redact():
    u = parse_cluster_url("redis+cluster://alice:p%40ss@10.0.0.1:7000,[::1]:7001,node-3")
    assert u.nodes == (("10.0.0.1", 7000), ("::1", 7001), ("node-3", 6379))
    assert (u.username, u.password) == ("alice", "p@ss")
    assert "p@ss" not in repr(u)
    assert parse_cluster_url("redis+cluster://h:1/0").username is None
    shown = redact_url("redis+cluster://alice:p%40ss@10.0.0.1:7000,node-3")
    assert shown == "redis+cluster://alice:***@10.0.0.1:7000,node-3"


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://u:pw-1@h:99999",
        "redis+cluster://u:pw-1@h:1,,h:2",
        "redis+cluster://u:pw-1@h:1/3",
        "redis+cluster://u:pw-1@h:1?ssl=true",
        "redis+cluster://u:pw-1@[zz]:1",
    ],
)
def test_bad_cluster_urls_are_clear_errors_without_the_password(url):
    with pytest.raises(InvalidArgumentError) as err:
        parse_cluster_url(url)
    assert "pw-1" not in str(err.value)
    with pytest.raises(InvalidArgumentError):
        FleetPublisher(url)  # refused at once, not retried forever in the thread


def test_cluster_acl_rules_add_only_the_topology_commands():
    plain, cl = tenant_acl_rules("alice"), tenant_acl_rules("alice", cluster=True)
    assert sorted(set(cl) - set(plain)) == ["+asking", "+cluster|slots"]
    assert set(plain) <= set(cl)
    ro = tenant_acl_rules("alice", read_only=True, cluster=True)
    assert "+cluster|slots" in ro
    assert "+fcall|agentspec_v1_xadd" not in ro


def test_cluster_redirection_errors_are_transient():
    import redis

    for exc in (
        redis.exceptions.MovedError("3999 127.0.0.1:6381"),
        redis.exceptions.AskError("3999 127.0.0.1:6381"),
        redis.exceptions.TryAgainError("TRYAGAIN"),
        redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"),
        redis.exceptions.ClusterError("TTL exhausted."),
        redis.exceptions.SlotNotCoveredError("slot 3 not covered"),
    ):
        assert is_transient(exc), exc


# --- a cluster of three masters -------------------------------------------------------

TENANTS = [f"team{i}" for i in range(8)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with RedisCluster(masters=3, replicas=0) as c:
        # The CLI sets everything up: the library on every primary, users on every node.
        folder = tmp_path_factory.mktemp("cluster")
        pw = folder / "passwords"
        lines = [f"agentspec.{t} {PASSWORD}\nagentspec-ro.{t} {PASSWORD}" for t in TENANTS]
        pw.write_text("\n".join(lines) + "\n")
        url_file = folder / "url"
        url_file.write_text(c.url() + "\n")
        url_file.chmod(0o600)
        argv = ["fleet", "setup", "--redis-file", str(url_file), "--apply"]
        assert main([*argv, "--password-file", str(pw), *(f"--tenant={t}" for t in TENANTS)]) == 0
        yield c


def user_url(c: RedisCluster, tenant: str, *, ro: bool = False) -> str:
    return c.url(f"agentspec{'-ro' if ro else ''}.{tenant}", PASSWORD)


@requires_redis_cluster
def test_setup_reaches_every_node(cluster):
    for node in cluster.live():
        with node.client() as c:
            assert len(c.function_list(library=LIBRARY_NAME)) == 1, node.port
            rules = c.execute_command("ACL", "GETUSER", f"agentspec.{TENANTS[0]}")
            assert rules is not None, node.port
    masters = {cluster.master_of(FleetKeys.of(t).log).port for t in TENANTS}
    assert len(masters) == 3  # the tenants' slots spread over all three masters


@requires_redis_cluster
def test_tenants_publish_subscribe_compact_and_trim_on_their_own_masters(cluster, capsys):
    n = 40
    subs = [
        FleetSubscriber(user_url(cluster, t), t, config=CFG, block_ms=100, compact_every=8)
        for t in TENANTS[:4]
    ]
    readers = [
        FleetSubscriber(user_url(cluster, t, ro=True), t, config=CFG, block_ms=100)
        for t in TENANTS[:4]
    ]
    pubs = [FleetPublisher(user_url(cluster, t), config=CFG, durable_after=0.5) for t in TENANTS]
    try:
        for wave in range(4):  # waves: a compaction round each, the second one trims
            for i in range(wave * n // 4, (wave + 1) * n // 4):
                for t, p in zip(TENANTS[:4], pubs, strict=False):
                    p.publish((t, "p", "s"), [i, i + 1, 7, i % 5], f"req-{i}")
            for p in pubs[:4]:
                assert p.flush(WAIT, durable=True), p.stats()
            for s in subs:
                assert s.wait_until(lambda s=s, w=wave: s.stats().applied >= (w + 1) * n // 4, WAIT)
        for p in pubs[:4]:
            st = p.stats()
            assert (st.published, st.durable, st.rejected, st.lost) == (n, n, 0, 0), st
        for t, s in zip(TENANTS[:4], subs, strict=True):
            key = (t, "p", "s")

            def done(s: FleetSubscriber = s, key: tuple[str, str, str] = key) -> bool:
                shard = s.stats().shards.get(key)
                return shard is not None and shard.sequences == n

            assert s.wait_until(done, WAIT), s.stats()
        for r in readers:
            assert r.wait_until(lambda r=r: r.stats().applied >= n, WAIT), r.stats()
        admin = cluster.admin()
        for t, s in zip(TENANTS[:4], subs, strict=True):
            keys = FleetKeys.of(t)
            # Compaction rounds trimmed the stream behind the snapshots.
            assert s.wait_until(lambda s=s: s.stats().compactions >= 2, WAIT), s.stats()
            assert eventually(lambda keys=keys: admin.hget(keys.meta, "trimmed") is not None, WAIT)
            assert admin.xlen(keys.log) < n
        # `agentspec fleet status` on the cluster, as a tenant's user.
        capsys.readouterr()
        url = user_url(cluster, TENANTS[1])
        assert main(["fleet", "status", "--redis", url, "--tenant", TENANTS[1], "--json"]) == 0
        out = capsys.readouterr()
        status = json.loads(out.out)
        assert PASSWORD not in out.out + out.err
        t1 = status["tenants"][TENANTS[1]]
        assert t1["exists"]
        assert t1["shards"][0]["sequences"] == n
        assert t1["stream"]["trimmed"]
        assert len(t1["subscribers"]) == 2  # the writer and the read-only replica beat
    finally:
        for x in (*subs, *readers):
            x.close()
        for p in pubs:
            p.close()


@requires_redis_cluster
def test_a_store_outbox_publishes_to_the_cluster(cluster, tmp_path):
    t = TENANTS[5]
    key = (t, "sql", "plan")
    url = user_url(cluster, t)
    options = FleetOptions(url, config=CFG, max_backoff=0.1, close_timeout=0)
    with (
        FleetSubscriber(url, t, config=CFG, block_ms=100, compact_every=0) as sub,
        ShardStore(tmp_path / "store", redis=options, fsync=False) as store,
    ):
        assert store.fleet is not None
        for i in range(50):
            store.learn(key, [i, i + 2, 9], identity=f"q-{i}")
        assert store.fleet.flush(WAIT), store.fleet.stats()
        assert store.fleet.stats().pending == 0
        assert sub.wait_until(
            lambda: (sub.stats().shards.get(key) or _NoShard()).sequences == 50, WAIT
        )


class _NoShard:  # an absent shard, as the predicate above reads it
    sequences = 0


@requires_redis_cluster
def test_one_follower_follows_tenants_on_every_master(cluster):
    tenants = [f"followed-{i}" for i in range(9)]  # fresh tenants (admin URL)
    with (
        FleetPublisher(cluster.url(), config=CFG) as pub,
        FleetFollower(cluster.url(), tenants, config=CFG, block_ms=200, compact_every=0) as f,
    ):
        assert len({cluster.master_of(FleetKeys.of(t).log).port for t in tenants}) >= 2
        for i in range(10):
            for t in tenants:
                pub.publish((t, "p", "s"), [i, 3, 4], f"follow-{t}-{i}")
        assert pub.flush(WAIT)
        for t in tenants:
            sub = f.subscriber(t)
            assert sub.wait_until(lambda s=sub: s.stats().applied == 10, WAIT), t
            assert sub.stats().last_error is None


@requires_redis_cluster
def test_a_tenant_user_cannot_reach_another_tenants_slot(cluster):
    import redis

    c = open_client(user_url(cluster, TENANTS[0]))
    try:
        assert isinstance(c, FleetCluster)
        with pytest.raises(redis.exceptions.NoPermissionError):
            c.hgetall(FleetKeys.of(TENANTS[1]).meta)
    finally:
        c.close()


# --- a master SIGKILLed, its replica promoted -------------------------------------------


@requires_redis_cluster
@pytest.mark.slow
def test_master_sigkilled_mid_run_replica_promoted_and_nothing_is_lost(tmp_path):
    with RedisCluster(masters=3, replicas=1, node_timeout_ms=1000) as c:
        tenant = FAILOVER_KEY[0]
        pw = tmp_path / "pw"
        pw.write_text(f"agentspec.{tenant} {PASSWORD}\nagentspec-ro.{tenant} {PASSWORD}\n")
        argv = ["fleet", "setup", "--redis", c.url(), "--tenant", tenant, "--apply"]
        assert main([*argv, "--password-file", str(pw)]) == 0
        url = user_url(c, tenant)  # a tenant user: it may not load the library
        log = FleetKeys.of(tenant).log
        master = c.master_of(log)
        promoted = []

        def fail() -> None:
            c.kill(master)  # SIGKILL mid-run
            promoted.append(c.wait_promoted(master, log))

        learn_through_a_failover(tmp_path, url, CFG, fail, compact_every=50)
        with promoted[0].client() as admin:  # the promoted replica had the library already
            assert len(admin.function_list(library=LIBRARY_NAME)) == 1
