"""A store learning through a Redis failover, for the Sentinel and Cluster tests.

`learn_through_a_failover` runs a `ShardStore` whose fleet outbox (with its
durability window) publishes about 250 sequences a second while a
`FleetSubscriber` follows the tenant; once the subscriber holds 200, it
calls ``fail`` (the test kills the master and waits for the promotion),
waits for 200 more, stops learning, and checks that every sequence the
store learned is in the subscriber's tree exactly once.  Waits are events
with timeouts.
"""

from __future__ import annotations

import array
import threading
from collections.abc import Callable
from pathlib import Path

from agentspec._fleet.config import FleetConfig
from agentspec._fleet.ids import fleet_seq_id
from agentspec._fleet.stats import PublisherStats
from agentspec._fleet.sub import FleetSubscriber
from agentspec._store.fleet_outbox import FleetOptions
from agentspec._store.store import ShardStore

KEY = ("acme", "sql", "plan")
WAIT = 60.0


def seq(i: int) -> list[int]:
    """The ``i``-th sequence learned."""
    return [i % 97, i, i + 1, 7, (i * 31) % 1000]


def fid(i: int) -> int:
    """The fleet id of the ``i``-th sequence (its identity is ``req-<i>:0``)."""
    return fleet_seq_id(KEY, f"req-{i}:0", memoryview(array.array("i", seq(i))))


def sequences(sub: FleetSubscriber) -> int:
    """Sequences the subscriber holds in `KEY`'s shard."""
    shard = sub.stats().shards.get(KEY)
    return 0 if shard is None else shard.sequences


def learn_through_a_failover(
    folder: Path, url: str, config: FleetConfig, fail: Callable[[], None], **sub_options: object
) -> tuple[int, PublisherStats]:
    """Learn while ``fail()`` runs; assert nothing acknowledged is lost.

    Returns the number of sequences learned and the publisher's stats.
    """
    options = FleetOptions(url, config=config, max_backoff=0.1, close_timeout=0)  # window 3 s
    sub = FleetSubscriber(url, KEY[0], config=config, block_ms=100, **sub_options)  # type: ignore[arg-type]
    learned = 0
    stop = threading.Event()
    with sub, ShardStore(folder / "store", redis=options, fsync=False) as store:
        assert store.fleet is not None

        def learn() -> None:
            nonlocal learned
            while not stop.is_set():
                store.learn(KEY, seq(learned), identity=f"req-{learned}:0")
                learned += 1
                stop.wait(0.004)  # pacing: about 250 sequences a second

        worker = threading.Thread(target=learn)
        worker.start()
        try:
            assert sub.wait_until(lambda: sequences(sub) >= 200, WAIT), sub.stats()
            fail()  # e.g. SIGKILL the master mid-run and wait for its replica's promotion
            at_switch = learned
            # Both sides follow the new master: new sequences reach the subscriber.
            assert sub.wait_until(lambda: sequences(sub) >= at_switch + 200, WAIT), sub.stats()
        finally:
            stop.set()
            worker.join()
        assert store.fleet.flush(WAIT), store.fleet.stats()
        st = store.fleet.stats()
        assert (st.pending, st.rejected) == (0, 0)
        assert st.publisher.failures >= 1  # it did see the master go
        assert sub.wait_until(lambda: sequences(sub) >= learned, WAIT), sub.stats()
        tree = sub.tree(KEY)
        assert tree is not None
        ids = tree.sequence_ids()
        assert len(ids) == len(set(ids)) == learned
        assert set(ids) == {fid(i) for i in range(learned)}
        assert sub.stats().reconnects >= 1
        print(f"learned {learned}, at switch {at_switch}, publisher {st.publisher}")
        return learned, st.publisher
