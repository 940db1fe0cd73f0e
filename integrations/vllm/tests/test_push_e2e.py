"""Shards pushed from `AgentSpecClient` / `ShardPusher` into a real vLLM server.

One vLLM server (SmolLM2-135M on CPU, started like ``agentspec serve``) is
shared by the module; the last test restarts it.  Every check reads the
worker's copy back through ``GET /v1/agentspec/shards``.
"""

from __future__ import annotations

import json
import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_endpoint import API_KEY, SHARD_HEADERS, VllmServer, need_vllm

from agentspec import AgentSpecClient, ShardPusher, ShardStore
from agentspec._push.wire import DELTA_PATH, INSTANCE_HEADER

pytestmark = pytest.mark.vllm

STAGES = ("plan", "sql", "review", "answer")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_vllm()
    srv = VllmServer(tmp_path_factory.mktemp("vllm-e2e"))
    try:
        srv.start()
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def model_dir():
    from agentspec.models import ensure_default_model

    return ensure_default_model()


def wait_pushed(pusher, timeout=120.0):
    assert pusher.flush(timeout), pusher.status()
    (status,) = pusher.status().values()
    return status


def assert_worker_matches(server, store, keys=None):
    """The worker holds every shard of the store with the same sequences; returns its instance."""
    instance, shards = server.shards()
    for key in keys or store.keys():
        st = store.stats(key)
        got = shards.get(key)
        assert got is not None, (key, sorted(shards))
        assert (got["sequences"], got["tokens"], got["max_seq"]) == (
            st.sequences,
            st.tokens,
            st.last_seq,
        ), key
    return instance, shards


def learn_random(store, key, n, rng, length=(20, 60)):
    for _ in range(n):
        store.learn(key, [rng.randrange(1, 30000) for _ in range(rng.randrange(*length))])


def test_client_outputs_reach_the_worker(server, model_dir):
    store = ShardStore()
    client = AgentSpecClient(
        base_url=server.url + "/v1",
        api_key=API_KEY,
        store=store,
        tokenizer=model_dir,
        return_token_ids=True,
        push_to=server.url,
        push_api_key=API_KEY,
    )
    try:
        for i in range(3):
            out = client.chat.completions.create(
                model="smollm2-135m",
                messages=[{"role": "user", "content": f"Write SQL selecting row {i} of t."}],
                max_tokens=12,
                temperature=0,
                stage="sql",
                pipeline="text2sql",
            )
            assert out.choices[0].message.content
        assert client.flush(120)
        key = ("default", "text2sql", "sql")
        assert store.stats(key).sequences == 3
        assert_worker_matches(server, store, [key])
        # More calls: the pusher sends deltas on top of what the worker has.
        with client.session("s-1", pipeline="text2sql", stage="sql"):
            client.completions.create(
                model="smollm2-135m", prompt="SELECT name FROM", max_tokens=10, temperature=0
            )
        assert client.flush(120)
        assert store.stats(key).sequences == 4
        assert_worker_matches(server, store, [key])
    finally:
        client.close()


def test_snapshots_deltas_and_repeats(server):
    rng = random.Random(7)
    store = ShardStore()
    big, small = ("default", "p", "big"), ("t2", None, "small")
    learn_random(store, big, 400, rng, (100, 300))  # a snapshot of several hundred KiB
    learn_random(store, small, 5, rng)
    with ShardPusher(
        store, [server.url], api_key=API_KEY, shm_dir=server.shm_dir, shm_threshold=64 << 10
    ) as pusher:
        st = wait_pushed(pusher)
        assert (st.snapshots, st.errors) == (2, 0), st
        instance, before = assert_worker_matches(server, store)
        assert list(server.shm_dir.iterdir()) == []  # the shm file is gone after the push
        learn_random(store, big, 3, rng)
        learn_random(store, small, 2, rng)
        st = wait_pushed(pusher)
        assert (st.snapshots, st.errors) == (2, 0), st
        assert st.deltas >= 2, st  # one per shard at least (more if it woke between learns)
        after_inst, after = assert_worker_matches(server, store)
        assert after_inst == instance
    # A fresh pusher knows nothing and sends full snapshots again: nothing changes.
    with ShardPusher(store, [server.url], api_key=API_KEY) as again:
        st = wait_pushed(again)
        assert st.snapshots == 2, st
        _, repeated = assert_worker_matches(server, store)
        assert repeated == after
    # The same delta applied twice changes nothing the second time.
    tree = store.tree(small)
    delta = tree.delta_bytes(tree.sequence_ids()[-2:])
    for _ in range(2):
        status, _, body = server.request(
            "POST",
            DELTA_PATH + "?tenant=t2&stage=small",
            delta,
            {**SHARD_HEADERS, INSTANCE_HEADER: instance},
        )
        assert status == 200, body
        assert json.loads(body)["sequences"] == store.stats(small).sequences
    assert server.shards()[1] == repeated
    assert len(before) <= len(after)


def test_unauthenticated_pusher_gets_401(server):
    store = ShardStore()
    store.learn(("default", None, "x"), [1, 2, 3, 4])
    with ShardPusher(store, [server.url], api_key="wrong") as pusher:
        assert not pusher.flush(5)
        (st,) = pusher.status().values()
        assert st.errors >= 1
        assert "HTTP 401" in (st.last_error or "")
    assert ("default", None, "x") not in server.shards()[1]


def test_concurrent_streams_while_pushing(server, model_dir):
    rng = random.Random(3)
    store = ShardStore()
    stop = threading.Event()
    learner_error = []

    def keep_learning():
        try:
            i = 0
            while not stop.wait(0.05):
                learn_random(store, ("default", None, STAGES[i % 4]), 2, rng)
                i += 1
        except Exception as e:  # reported below
            learner_error.append(e)

    client = AgentSpecClient(
        base_url=server.url + "/v1",
        api_key=API_KEY,
        store=store,
        tokenizer=model_dir,
        return_token_ids=True,
        push_to=server.url,
        push_api_key=API_KEY,
        max_retries=0,
        timeout=240,
    )

    def one(i):
        stream = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": f"Request {i}: list three colors."}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stage=STAGES[i % 4],
        )
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    learner = threading.Thread(target=keep_learning, daemon=True)
    learner.start()
    try:
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, range(32), timeout=280))
    finally:
        stop.set()
        learner.join(10)
    try:
        assert not learner_error
        assert all(text and finish in ("stop", "length") for text, finish in results), results
        assert client.flush(120)
        assert_worker_matches(server, store)
        _, shards = server.shards()
        assert {("default", None, s) for s in STAGES} <= set(shards)
    finally:
        client.close()
    out = server.complete()
    assert out["choices"][0]["text"]


def test_worker_restart_is_followed_by_a_full_resync(server):
    rng = random.Random(11)
    store = ShardStore()
    keys = [("default", None, "r1"), ("default", "pp", "r2"), ("acme", None, "r3")]
    for key in keys:
        learn_random(store, key, 4, rng)
    with ShardPusher(store, [server.url], api_key=API_KEY) as pusher:
        wait_pushed(pusher)
        old_instance, _ = assert_worker_matches(server, store)
        server.stop()
        server.start()
        fresh_instance, _ = server.shards()
        assert fresh_instance != old_instance
        # The restarted worker lost everything; the pusher notices the new instance (on its
        # idle probe, in flush, or when a delta is refused) and resends every shard.
        learn_random(store, keys[0], 1, rng)
        st = wait_pushed(pusher)
        assert st.instance == fresh_instance
        assert st.snapshots >= 2 * len(keys), st
        instance, _ = assert_worker_matches(server, store)
        assert instance == fresh_instance
