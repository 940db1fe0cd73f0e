"""Transient refusals on a real redis-server lose nothing.

Checked: the classifier (`is_transient`) over every transient code, as
redis-py's class, as a plain reply, wrapped by a pipeline or a Lua script,
and the permanent ones; a publisher pointed at a replica (READONLY, as
right after a failover, from the config write or from inside the ``XADD``
script) keeps all 10 entries pending with ``last_error`` set and publishes
each once after ``REPLICAOF NO ONE``; the same through a ``ShardStore``
outbox, closed and reopened while writes are refused; NOREPLICAS
(``min-replicas-to-write 1`` and no replica) until the setting is dropped;
``last_error`` set by a permanent rejection and cleared by the next good
send.  Waits are predicates with timeouts.
"""

from __future__ import annotations

import array

import pytest
import redis
from redis_server import RedisServer, eventually, requires_redis_server

from agentspec._fleet.config import FleetConfig
from agentspec._fleet.connection import TRANSIENT_CODES, is_transient
from agentspec._fleet.entry import decode_entry
from agentspec._fleet.ids import fleet_seq_id
from agentspec._fleet.names import FleetKeys
from agentspec._fleet.pub import FleetPublisher, PublishStatus
from agentspec._store.fleet_outbox import FleetOptions
from agentspec._store.store import ShardStore

TENANT = "acme"
KEYS = FleetKeys.of(TENANT)
KEY = (TENANT, "sql", "plan")
CFG = FleetConfig(max_depth=16, max_shard_tokens=None)
WAIT = 30.0


def seq(i: int) -> list[int]:
    return [i % 97, i, i + 1, 7, (i * 31) % 1000]


def fid(i: int) -> int:
    return fleet_seq_id(KEY, f"req-{i}:0", memoryview(array.array("i", seq(i))))


def stream_ids(server: RedisServer) -> list[int]:
    """Fleet ids of the tenant's stream entries, in stream order (each decoded)."""
    rows = server.client().xrange(KEYS.log)
    return [decode_entry(fields, TENANT, CFG.max_depth).seq_id for _, fields in rows]


# --- the classifier ----------------------------------------------------------


@pytest.mark.parametrize("code", TRANSIENT_CODES)
def test_every_transient_code_is_transient_however_it_arrives(code):
    text = f"{code} the server says no for now"
    assert is_transient(redis.ResponseError(text))
    in_pipeline = f"Command # 1 (HSETNX m d 1) of pipeline caused error: {text}"
    assert is_transient(redis.ResponseError(in_pipeline))
    assert is_transient(redis.ResponseError(f"{text} script: 0a1b, on @user_script:2."))
    old_lua = f"Error running script (call to f_0a1b): @user_script:2: -{text}"
    assert is_transient(redis.ResponseError(old_lua))
    assert is_transient(redis.ResponseError("no for now", status_code=code))


@pytest.mark.parametrize(
    "exc",
    [
        redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
        redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"),
        redis.exceptions.TryAgainError("Multiple keys request during rehashing of slot"),
        redis.exceptions.ClusterDownError("The cluster is down"),
        redis.exceptions.MasterDownError("Link with MASTER is down"),
        redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
        redis.ConnectionError("Connection refused"),
        redis.TimeoutError("Timeout reading from socket"),
    ],
)
def test_redis_py_classes_are_transient(exc):
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        redis.exceptions.NoPermissionError("this user has no permissions to run the 'xadd' cmd"),
        redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        redis.ResponseError("BUSYKEY Target key name already exists."),
        redis.ResponseError(
            "Command # 1 (HSETNX agentspec:{BUSY}:meta READONLY 1) of pipeline caused error:"
            " WRONGTYPE Operation against a key holding the wrong kind of value"
        ),
        redis.ResponseError("AGENTSPEC_CONFIG depth 8 != 16"),
        redis.ResponseError("unknown command 'readonly'"),
        ValueError("READONLY"),
    ],
)
def test_permanent_refusals_are_not_transient(exc):
    assert not is_transient(exc)


# --- real servers --------------------------------------------------------------


@pytest.fixture
def pair():
    """A primary and a replica of it, both on TCP."""
    with RedisServer(tcp=True) as primary:
        follow = ["--replicaof", "127.0.0.1", str(primary.port)]
        with RedisServer(tcp=True, extra_args=follow) as replica:
            yield primary, replica


def publisher(url: str, **kw) -> FleetPublisher:
    return FleetPublisher(url, config=CFG, max_backoff=0.05, **kw)


@requires_redis_server
@pytest.mark.parametrize("config_first", [False, True], ids=["config-write", "xadd-script"])
def test_publisher_on_a_replica_keeps_everything_until_it_is_promoted(pair, config_first):
    primary, replica = pair
    if config_first:  # the replica then has the config: READONLY comes from the XADD script
        primary.client().hset(KEYS.meta, mapping=CFG.encode())
        assert eventually(lambda: replica.client().hget(KEYS.meta, "depth") is not None, WAIT)
    rejected: list[object] = []
    with publisher(replica.url, on_rejected=rejected.append) as pub:
        for i in range(10):
            assert pub.publish(KEY, seq(i), f"req-{i}:0") is PublishStatus.QUEUED
        assert eventually(lambda: pub.stats().failures >= 2, WAIT), pub.stats()
        st = pub.stats()
        assert "READONLY" in (st.last_error or "") or "read only" in (st.last_error or "")
        assert (st.pending, st.published, st.rejected, rejected) == (10, 0, 0, [])
        assert replica.client().xlen(KEYS.log) == 0
        replica.client().replicaof("NO", "ONE")
        assert pub.flush(WAIT), pub.stats()
        st = pub.stats()
        assert (st.pending, st.published, st.rejected, st.last_error) == (0, 10, 0, None)
    assert sorted(stream_ids(replica)) == sorted(fid(i) for i in range(10))


@requires_redis_server
def test_store_outbox_on_a_replica_publishes_every_learned_sequence_once(pair, tmp_path):
    primary, replica = pair
    options = FleetOptions(
        replica.url, config=CFG, durable_after=0.2, max_backoff=0.05, close_timeout=0
    )

    def refused(st: ShardStore) -> bool:
        assert st.fleet is not None
        s = st.fleet.stats()
        return s.pending == 5 and s.publisher.failures >= 2 and s.publisher.last_error is not None

    path = tmp_path / "store"
    with ShardStore(path, redis=options, fsync=False) as st:
        for i in range(5):
            st.learn(KEY, seq(i), identity=f"req-{i}:0")
        assert eventually(lambda: refused(st), WAIT), st.fleet.stats() if st.fleet else None
        s = st.fleet.stats() if st.fleet else None
        assert s is not None
        assert (s.rejected, s.settled, s.publisher.rejected) == (0, 0, 0)
        assert "read only" in (s.publisher.last_error or "")
    with ShardStore(path, redis=options, fsync=False) as st:  # reopened, still refused
        assert eventually(lambda: refused(st), WAIT)
    assert replica.client().xlen(KEYS.log) == 0
    replica.client().replicaof("NO", "ONE")
    with ShardStore(path, redis=options, fsync=False) as st:
        assert st.fleet is not None
        assert st.fleet.flush(WAIT), st.fleet.stats()
        s = st.fleet.stats()
        assert (s.pending, s.rejected, s.publisher.last_error) == (0, 0, None)
    ids = stream_ids(replica)
    assert len(ids) == len(set(ids)) == 5
    assert set(ids) == {fid(i) for i in range(5)}
    assert primary.client().xlen(KEYS.log) == 0  # nothing went to the old primary


@requires_redis_server
def test_noreplicas_keeps_entries_until_writes_are_allowed():
    with RedisServer(tcp=True, extra_args=["--min-replicas-to-write", "1"]) as server:
        with publisher(server.url) as pub:
            for i in range(10):
                pub.publish(KEY, seq(i), f"req-{i}:0")
            assert eventually(lambda: "NOREPLICAS" in (pub.stats().last_error or ""), WAIT)
            assert eventually(lambda: pub.stats().failures >= 2, WAIT)
            st = pub.stats()
            assert (st.pending, st.published, st.rejected) == (10, 0, 0)
            server.client().config_set("min-replicas-to-write", 0)
            assert pub.flush(WAIT), pub.stats()
            st = pub.stats()
            assert (st.pending, st.published, st.rejected, st.last_error) == (0, 10, 0, None)
        assert sorted(stream_ids(server)) == sorted(fid(i) for i in range(10))


@requires_redis_server
def test_a_rejection_sets_last_error_and_a_good_send_clears_it():
    with RedisServer() as server:
        admin = server.client()
        admin.set("agentspec:{bad}:meta", "not a hash")  # WRONGTYPE for tenant "bad"
        rejected: list[object] = []
        with publisher(server.url, on_rejected=rejected.append) as pub:
            pub.publish(("bad", "p", None), [1, 2, 3], "r1")
            assert eventually(lambda: pub.stats().rejected == 1, WAIT)
            assert "WRONGTYPE" in (pub.stats().last_error or "")
            assert len(rejected) == 1
            pub.publish(KEY, seq(1), "req-1:0")
            assert pub.flush(WAIT)
            assert eventually(lambda: pub.stats().last_error is None, WAIT), pub.stats()
            assert pub.stats().published == 1
