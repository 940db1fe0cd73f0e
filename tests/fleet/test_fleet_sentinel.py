"""The fleet behind Redis Sentinel: URLs, and a failover in the middle of a publishing run.

Checked: ``redis+sentinel://`` URLs parse (hosts, ports, IPv6, service,
database, the sentinels' own auth) and bad ones fail with a clear error
that holds no password; their passwords are redacted; a ShardStore
outbox (the store's durability window) and a FleetSubscriber, both on the
sentinel URL, keep going when the primary is SIGKILLed mid-run and a
sentinel promotes the replica: every sequence the store acknowledged ends
up in the fleet exactly once.  Waits are sentinel log lines and
predicates with timeouts.
"""

from __future__ import annotations

import pytest
from failover_run import learn_through_a_failover
from redis_sentinel import RedisSentinel, requires_redis_sentinel, sentinel_url
from redis_server import RedisServer, eventually, requires_redis_server

from agentspec._fleet.config import FleetConfig
from agentspec._fleet.connection import (
    Redactor,
    open_client,
    parse_sentinel_url,
    redact_url,
)
from agentspec._fleet.pub import FleetPublisher
from agentspec._fleet.stats import PublisherStats
from agentspec.exceptions import InvalidArgumentError

TENANT = "acme"
KEY = (TENANT, "sql", "plan")
CFG = FleetConfig(max_depth=16, max_shard_tokens=None)
SERVICE = "fleet"
WAIT = 60.0


# --- URLs -----------------------------------------------------------------------


def test_sentinel_urls_parse():
    u = parse_sentinel_url(
        "redis+sentinel://alice:p%40ss@10.0.0.1:26380,[::1]:5000,sent-3/my%20svc/2"
        "?sentinel_username=watch&sentinel_password=s3"
    )
    assert u.sentinels == (("10.0.0.1", 26380), ("::1", 5000), ("sent-3", 26379))
    assert (u.service, u.db, u.username, u.password) == ("my svc", 2, "alice", "p@ss")
    assert (u.sentinel_username, u.sentinel_password) == ("watch", "s3")
    assert "p@ss" not in repr(u)
    plain = parse_sentinel_url("redis+sentinel://h/svc")
    assert (plain.sentinels, plain.db, plain.username, plain.password) == (
        (("h", 26379),),
        0,
        None,
        None,
    )
    assert parse_sentinel_url("redis+sentinel://:pw@h:1/svc").password == "pw"


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://:s3cret@h:1",  # no service
        "redis+sentinel://:s3cret@h:1/",
        "redis+sentinel://:s3cret@h:1/svc/x",  # db not a number
        "redis+sentinel://:s3cret@h:1/svc/0/more",
        "redis+sentinel://:s3cret@h:0/svc",  # port out of range
        "redis+sentinel://:s3cret@h:99999/svc",
        "redis+sentinel://:s3cret@h:1,,h2/svc",  # empty host
        "redis+sentinel://:s3cret@h:1/svc?password=s3cret",  # unknown parameter
        "redis://:s3cret@h:1/0",  # not a sentinel url
    ],
)
def test_bad_sentinel_urls_are_clear_errors_without_the_password(url):
    with pytest.raises(InvalidArgumentError) as info:
        parse_sentinel_url(url)
    assert "s3cret" not in str(info.value)
    if url.startswith("redis+sentinel"):
        with pytest.raises(InvalidArgumentError):
            open_client(url)
        with pytest.raises(InvalidArgumentError):
            FleetPublisher(url)  # refused at once, not retried forever in the thread


def test_sentinel_url_passwords_are_redacted():
    url = "redis+sentinel://alice:p%40ss@h1:1,h2:2/svc/0?sentinel_password=s3"
    assert redact_url(url) == "redis+sentinel://alice:***@h1:1,h2:2/svc/0?sentinel_password=***"
    text = Redactor(url).scrub("auth p@ss or p%40ss failed, sentinel s3 too")
    assert "p@ss" not in text
    assert "p%40ss" not in text
    assert " s3 " not in text


# --- a failover --------------------------------------------------------------------


def replica_synced(replica: RedisServer) -> bool:
    return replica.client().info("replication").get("master_link_status") == "up"


@requires_redis_server
@requires_redis_sentinel
@pytest.mark.parametrize("synced", [True, False], ids=["replica-in-sync", "replica-never-synced"])
def test_primary_sigkilled_mid_run_sentinel_promotes_and_nothing_is_lost(tmp_path, synced):
    """``synced``: the replica holds what the primary acknowledged (up to the last
    moments); else its first sync is still held back when the primary dies, so the
    promoted replica has lost everything and the durability window resends it all."""
    delay = "0" if synced else "60"
    primary = RedisServer(
        tcp=True, appendfsync="everysec", extra_args=["--repl-diskless-sync-delay", delay]
    )
    primary.start()
    follow = ["--replicaof", "127.0.0.1", str(primary.port)]
    try:
        with (
            RedisServer(tcp=True, appendfsync="everysec", extra_args=follow) as replica,
            RedisSentinel(primary.port, service=SERVICE) as s1,
            RedisSentinel(primary.port, service=SERVICE) as s2,
        ):
            # The sentinels know the replica and each other before the primary dies.
            for s in (s1, s2):
                assert s.wait_log(f"+slave slave 127.0.0.1:{replica.port}", WAIT), s.log
                assert s.wait_log("+sentinel sentinel", WAIT), s.log
            if synced:
                assert eventually(lambda: replica_synced(replica), WAIT)
            else:
                assert not replica_synced(replica)
            dead = RedisSentinel(primary.port)  # never started: a sentinel that is down
            url = sentinel_url([dead.port, s1.port, s2.port], SERVICE)
            dead.stop()
            stats = run(tmp_path, url, primary, replica, (s1, s2))
            if not synced:
                assert stats.lost > 0  # the window found them missing and resent them
    finally:
        primary.__exit__(None, None, None)  # stopped if alive, directory removed


def run(tmp_path, url, primary, replica, sentinels) -> PublisherStats:
    """Learn through a store while the primary dies; checks; the publisher's stats."""

    def fail() -> None:
        primary.kill()  # SIGKILL mid-run
        for s in sentinels:
            assert s.wait_log("+switch-master", WAIT), s.log
            assert s.master() == ("127.0.0.1", replica.port)

    learned, publisher = learn_through_a_failover(
        tmp_path, url, CFG, fail, compact_every=0, max_backoff=0.1
    )
    with open_client(url) as c:  # the service's master now is the old replica
        assert c.xlen(f"agentspec:{{{TENANT}}}:log") >= learned
        assert int(c.connection_pool.get_master_address()[1]) == replica.port
    return publisher
