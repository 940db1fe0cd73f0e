"""A ShardStore publishing to a real redis-server, its journal as the outbox.

Checked, each time by a subscriber that must end up holding every sequence
the store acknowledged exactly once (its fleet ids, its tokens, nothing
else): learning while Redis is down, then publishing the backlog once it is
up (and nothing again after a reopen); a store process SIGKILLed with
sequences unpublished or half published, then reopened; Redis SIGKILLed and
restarted 20 times during a publishing run with ``appendfsync everysec``;
Redis losing entries it had acknowledged (restarted without its data),
which the durability window sends again; and a response published both by
the store and by a second publisher under one identity (the vLLM worker's
side), learned once.  Waits are events with generous timeouts.
"""

from __future__ import annotations

import array
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from redis_server import RedisServer, requires_redis_server

from agentspec._fleet.config import FleetConfig
from agentspec._fleet.ids import fleet_seq_id
from agentspec._fleet.pub import FleetPublisher
from agentspec._fleet.sub import FleetSubscriber
from agentspec._store.fleet_outbox import FleetOptions
from agentspec._store.store import ShardStore

pytestmark = requires_redis_server

TENANT = "acme"
KEY = (TENANT, "sql", "plan")
CFG = FleetConfig(max_depth=16, max_shard_tokens=None)  # unbounded: every sequence stays
WAIT = 60.0


def seq(i: int) -> list[int]:
    return [i % 97, i, i + 1, 7, (i * 31) % 1000]


def ident(i: int) -> str:
    return f"req-{i}:0"


def fid(i: int) -> int:
    return fleet_seq_id(KEY, ident(i), memoryview(array.array("i", seq(i))))


def opts(url: str, **kw) -> FleetOptions:
    kw.setdefault("durable_after", 0.2)
    kw.setdefault("max_backoff", 0.05)
    kw.setdefault("close_timeout", 0)
    return FleetOptions(url, config=CFG, **kw)


def subscriber(url: str) -> FleetSubscriber:
    return FleetSubscriber(url, TENANT, config=CFG, block_ms=100, compact_every=0, max_backoff=0.05)


def sequences(sub: FleetSubscriber) -> int:
    shard = sub.stats().shards.get(KEY)
    return 0 if shard is None else shard.sequences


def assert_holds_exactly(sub: FleetSubscriber, numbers: range | list[int]) -> None:
    """The subscriber's shard is exactly these sequences, each once."""
    want = {fid(i): seq(i) for i in numbers}
    assert sub.wait_until(lambda: sequences(sub) >= len(want), WAIT), sub.stats()
    tree = sub.tree(KEY)
    assert tree is not None
    ids = tree.sequence_ids()
    assert len(ids) == len(set(ids)) == len(want)
    assert {i: tree.sequence(i) for i in ids} == want


@pytest.fixture
def server():
    with RedisServer() as s:
        yield s


def test_learning_while_redis_is_down_publishes_the_backlog_once_up(tmp_path):
    srv = RedisServer()  # not started yet: its socket does not exist
    try:
        with ShardStore(tmp_path / "s", redis=opts(srv.url), fsync=False) as st:
            assert st.fleet is not None
            for i in range(40):
                st.learn(KEY, seq(i), identity=ident(i))
            assert st.fleet.stats().pending == 40
            srv.start()
            with subscriber(srv.url) as sub:
                assert st.fleet.flush(WAIT), st.fleet.stats()
                assert_holds_exactly(sub, range(40))
        with ShardStore(tmp_path / "s", redis=opts(srv.url), fsync=False) as st:
            assert st.fleet is not None
            assert st.fleet.stats().pending == 0  # the watermark says all of it is durable
    finally:
        srv.stop()
        shutil.rmtree(srv.dir, ignore_errors=True)


CHILD = r"""
import os, signal, sys
from agentspec._fleet.config import FleetConfig
from agentspec._store.fleet_outbox import FleetOptions
from agentspec._store.store import ShardStore

path, url, n, settle = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
key = ("acme", "sql", "plan")
options = FleetOptions(url, config=FleetConfig(16, None), durable_after=0.2, max_backoff=0.05)
st = ShardStore(path, redis=options)
for i in range(n):
    st.learn(key, [i % 97, i, i + 1, 7, (i * 31) % 1000], identity=f"req-{i}:0")
if settle:
    assert st.fleet.wait_until(lambda: st.fleet.stats().settled >= settle, 60)
print("SETTLED", st.fleet.stats().settled, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("redis_up", [False, True], ids=["redis-down", "half-published"])
def test_a_store_reopened_after_a_crash_republishes_what_is_unpublished(tmp_path, server, redis_up):
    n = 60
    url = server.url if redis_up else f"unix://{tmp_path}/none.sock"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "s"), url, str(n), str(n // 2 * redis_up)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    settled = int(proc.stdout.split()[1])
    assert settled >= n // 2 if redis_up else settled == 0
    with subscriber(server.url) as sub, ShardStore(tmp_path / "s", redis=opts(server.url)) as st:
        assert st.fleet is not None
        assert st.fleet.stats().pending <= n - settled  # the watermark spares the settled part
        assert st.fleet.flush(WAIT), st.fleet.stats()
        assert_holds_exactly(sub, range(n))


def test_redis_sigkilled_and_restarted_20_times_while_publishing(tmp_path):
    n, kills, ahead = 300, 20, 12
    srv = RedisServer(appendfsync="everysec")
    srv.start()
    try:
        options = opts(srv.url, durable_after=3.0, batch=4)
        with (
            ShardStore(tmp_path / "s", redis=options, fsync=False) as st,
            subscriber(srv.url) as sub,
        ):
            fleet = st.fleet
            assert fleet is not None

            def acked() -> int:
                return fleet.stats().publisher.published

            def learn() -> None:  # keeps about `ahead` sequences in flight
                for i in range(n):
                    fleet.wait_until(lambda: acked() >= i - ahead, WAIT)  # noqa: B023
                    st.learn(KEY, seq(i), identity=ident(i))

            learner = threading.Thread(target=learn)
            learner.start()
            try:
                for k in range(kills):
                    target = (k + 1) * n // (kills + 1)
                    reached = fleet.wait_until(lambda: acked() >= target, WAIT)  # noqa: B023
                    assert reached, fleet.stats()
                    srv.kill()  # with entries queued and in the durability window
                    srv.start()
            finally:
                learner.join(2 * WAIT)
            assert not learner.is_alive()
            assert fleet.flush(2 * WAIT), fleet.stats()
            assert_holds_exactly(sub, range(n))
            stats = fleet.stats()
            assert stats.settled >= n
            assert stats.publisher.durable >= n
            assert stats.publisher.failures > 0
            assert sub.stats().reconnects > 0
            # stats.publisher.lost counts acknowledged entries the restarts lost (sent again)
    finally:
        srv.stop()
        shutil.rmtree(srv.dir, ignore_errors=True)


def test_entries_redis_acknowledged_then_lost_are_sent_again(server):
    with (
        ShardStore(redis=opts(server.url, durable_after=600.0)) as st,
        subscriber(server.url) as sub,
    ):
        fleet = st.fleet
        assert fleet is not None
        for i in range(10):
            st.learn(KEY, seq(i), identity=ident(i))
        assert fleet.wait_until(lambda: fleet.stats().publisher.published >= 10, WAIT)
        assert fleet.stats().pending == 10  # acknowledged, not yet known durable
        server.kill()
        shutil.rmtree(server.dir / "appendonlydir")  # the restart loses everything
        server.start()
        st.learn(KEY, seq(10), identity=ident(10))  # its send finds a new connection
        assert fleet.wait_until(lambda: fleet.stats().publisher.lost >= 10, WAIT), fleet.stats()
        assert_holds_exactly(sub, range(11))


def test_a_response_published_by_the_store_and_by_the_worker_is_learned_once(server):
    with (
        ShardStore(redis=opts(server.url, durable_after=0)) as st,
        FleetPublisher(server.url, config=CFG) as worker,
        subscriber(server.url) as sub,
    ):
        assert st.fleet is not None
        st.learn(KEY, seq(1), identity=ident(1))
        worker.publish(KEY, seq(1), ident(1))  # the same response, the same identity
        worker.publish(KEY, seq(2), ident(2))  # another request
        assert st.fleet.flush(WAIT)
        assert worker.flush(WAIT)
        assert sub.wait_until(lambda: sub.stats().applied + sub.stats().duplicates >= 3, WAIT), (
            sub.stats()
        )
        assert_holds_exactly(sub, [1, 2])
        assert sub.stats().shards[KEY].duplicates == 1
