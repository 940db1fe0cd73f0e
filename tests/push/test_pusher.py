"""`ShardPusher` against real `ShardIntake` HTTP servers, flaky ones included."""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import pytest
import tenacity

from agentspec._cli.push import (
    add_push_arguments,
    add_status_arguments,
    run_push,
    run_status,
)
from agentspec._push.intake import IntakeRequestHandler, ShardIntake, serve_intake
from agentspec._push.pusher import (
    PushError,
    ShardPusher,
    default_retrying,
    is_transient,
    wait_retry_after,
)
from agentspec._push.wire import error_response
from agentspec._store.store import ShardStore
from agentspec.exceptions import InvalidArgumentError

KEYS = [("acme", "etl", "Extract"), ("acme", "etl", "SQL"), ("default", None, None)]
PATTERNS = [[1, 2], [2, 3, 4], [9999], [9999, 9999], [5, 6, 7, 8]]


def fast_retrying(**kw):
    """The default predicate and Retry-After wait, quicker backoff for tests."""
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        wait=wait_retry_after(
            tenacity.wait_exponential_jitter(multiplier=0.01, max=0.2, jitter=0.01)
        ),
        stop=tenacity.stop_after_attempt(kw.pop("attempts", 10)),
        reraise=True,
        **kw,
    )


class Learner:
    """Learns distinct-looking responses into a store."""

    def __init__(self, store):
        self.store = store
        self.n = 0

    def learn(self, count, keys=KEYS):
        for _ in range(count):
            self.n += 1
            key = keys[self.n % len(keys)]
            i = self.n
            self.store.learn(key, [1, 2, 3, 4, i % 50, 9999, 5, 6, 7, 8, i % 7])


def assert_mirrors(intake, store):
    """The worker holds exactly the store's shards: same ids, same counts."""
    keys = store.keys()
    assert set(intake.keys()) == set(keys)
    for key in keys:
        mine, theirs = store.tree(key), intake.tree(key)
        assert theirs.sequence_ids() == mine.sequence_ids(), key
        st_m, st_t = mine.stats(), theirs.stats()
        assert (st_t.sequences, st_t.tokens) == (st_m.sequences, st_m.tokens)
        for p in PATTERNS:
            assert theirs.count(p) == mine.count(p), (key, p)
        theirs.check()


class Worker:
    """A served intake that can be restarted on the same port."""

    def __init__(self, handler=None, **intake_kw):
        self.handler = handler
        self.intake_kw = intake_kw
        self.intake = ShardIntake(**intake_kw)
        self.server, self.thread = serve_intake(self.intake, handler=handler)
        self.port = self.server.port
        self.url = self.server.url

    def stop(self):
        self.server.stop(self.thread)
        assert not self.thread.is_alive()

    def start_again(self):
        self.intake = ShardIntake(**self.intake_kw)
        self.server, self.thread = serve_intake(self.intake, port=self.port, handler=self.handler)


@pytest.fixture
def cleanup():
    """Close what a test registers, even when it fails."""
    items = []
    yield items
    for x in reversed(items):
        x.stop() if isinstance(x, Worker) else x.close()


def test_snapshots_then_deltas(cleanup):
    store = ShardStore()
    worker = Worker()
    cleanup += [worker, store]
    learner = Learner(store)
    learner.learn(30)
    pusher = ShardPusher(store, [worker.url], retrying=fast_retrying())
    cleanup.append(pusher)
    assert pusher.flush(20)
    assert_mirrors(worker.intake, store)
    st = pusher.status()[worker.url]
    assert st.snapshots == len(KEYS)
    assert st.deltas == 0
    assert st.connected
    assert st.instance == worker.intake.instance
    assert st.pending == ()
    assert st.errors == 0
    assert st.acked == {k: store.version(k) for k in KEYS}
    learner.learn(10)
    assert pusher.flush(20)
    assert_mirrors(worker.intake, store)
    st = pusher.status()[worker.url]
    assert st.snapshots == len(KEYS)  # only deltas after first contact
    assert st.deltas >= 1
    # a dropped shard is deleted on the worker
    store.drop(KEYS[0])
    assert pusher.flush(20)
    assert worker.intake.tree(KEYS[0]) is None
    assert pusher.status()[worker.url].deletes == 1
    assert_mirrors(worker.intake, store)


def test_several_endpoints_and_evictions(cleanup):
    store = ShardStore(max_bytes=60_000)
    a, b = Worker(), Worker()
    cleanup += [a, b, store]
    learner = Learner(store)
    learner.learn(20)
    pusher = ShardPusher(store, [a.url, b.url + "/v1/"], retrying=fast_retrying())
    cleanup.append(pusher)
    assert pusher.flush(20)
    learner.learn(400)  # evicts the oldest sequences: deltas carry removals
    assert sum(store.stats(k).evicted for k in KEYS) > 0
    assert pusher.flush(20)
    assert_mirrors(a.intake, store)
    assert_mirrors(b.intake, store)
    assert set(pusher.status()) == {a.url, b.url + "/v1/"}


class Script:
    """Faults to inject into the next mutating requests, in order."""

    def __init__(self, faults=()):
        self.faults = list(faults)
        self.seen = []
        self.lock = threading.Lock()

    def add(self, *faults):
        with self.lock:
            self.faults.extend(faults)

    def next(self, method, path):
        with self.lock:
            fault = self.faults.pop(0) if self.faults and method != "GET" else None
            self.seen.append((method, path, fault))
            return fault

    def left(self):
        with self.lock:
            return list(self.faults)


def flaky_handler(script):
    """A handler that drops connections and answers 503 / 429 as scripted."""

    class Flaky(IntakeRequestHandler):
        def dispatch(self, method, path, query, headers, body):
            fault = script.next(method, path)
            if fault is None:
                return super().dispatch(method, path, query, headers, body)
            if fault == "drop":  # lost before the worker saw it
                return None
            if fault == "503":
                return error_response(503, "overloaded", "busy", {"Retry-After": "0.05"})
            if fault == "429":
                return error_response(429, "slow down", "rate_limit", {"retry-after-ms": "30"})
            if fault == "500":
                return error_response(500, "boom", "internal")
            response = super().dispatch(method, path, query, headers, body)
            if fault == "drop_after":  # applied, but the answer is lost
                return None
            return response

    return Flaky


def test_flaky_worker_converges_without_double_counting(cleanup):
    script = Script(["drop", "503", "drop_after", "429", "500", "drop_after", "drop_after"])
    store = ShardStore()
    worker = Worker(handler=flaky_handler(script))
    cleanup += [worker, store]
    learner = Learner(store)
    learner.learn(12)
    sleeps = []
    pusher = ShardPusher(
        store,
        [worker.url],
        retrying=fast_retrying(before_sleep=lambda rs: sleeps.append(rs.upcoming_sleep)),
    )
    cleanup.append(pusher)
    assert pusher.flush(30)
    learner.learn(9)  # deltas, some applied twice
    script.add("drop_after", "503", "drop_after", "drop_after")
    learner.learn(9)
    assert pusher.flush(30)
    assert script.left() == []
    assert_mirrors(worker.intake, store)
    st = pusher.status()[worker.url]
    assert st.retries >= 11
    assert st.errors == 0  # every failure was transient and retried away
    # the waits honoured Retry-After (0.05 s) and retry-after-ms (30 ms)
    assert 0.05 in sleeps
    assert 0.03 in sleeps
    # delta requests were retried after being applied: still no double count
    faults = [(m, p.rsplit("/", 1)[-1], f) for m, p, f in script.seen if f == "drop_after"]
    assert any(p == "delta" for _, p, _ in faults)

    # restart: the worker comes back empty, as a new instance, on the same port
    worker.stop()
    old_instance = st.instance
    learner.learn(6)  # pushes fail while the worker is down
    deadline = time.monotonic() + 10
    while pusher.status()[worker.url].errors == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pusher.status()[worker.url].errors >= 1
    assert not pusher.flush(0.05)
    worker.start_again()
    script.add("503", "drop")
    learner.learn(6)
    assert pusher.flush(30)
    assert_mirrors(worker.intake, store)
    st = pusher.status()[worker.url]
    assert st.instance == worker.intake.instance != old_instance
    assert st.snapshots >= 2 * len(KEYS)
    assert st.connected


def test_delta_history_gone_sends_snapshot(cleanup):
    script = Script()
    store = ShardStore()
    store.change_log_limit = 3
    worker = Worker(handler=flaky_handler(script))
    cleanup += [worker, store]
    learner = Learner(store)
    learner.learn(3, keys=KEYS[:1])
    pusher = ShardPusher(store, [worker.url], retrying=fast_retrying())
    cleanup.append(pusher)
    assert pusher.flush(20)
    acked = pusher.status()[worker.url].acked[KEYS[0]]
    script.add(*["503"] * 30)  # the worker is overloaded while the change log overflows
    learner.learn(10, keys=KEYS[:1])
    assert store.delta_since(KEYS[0], acked) is None
    with script.lock:
        script.faults.clear()
    assert pusher.flush(20)
    assert_mirrors(worker.intake, store)
    # the lost history was replaced by (at least) one more snapshot
    assert pusher.status()[worker.url].snapshots >= 2


def test_restart_noticed_by_instance_header(cleanup):
    store = ShardStore()
    worker = Worker()
    cleanup += [worker, store]
    learner = Learner(store)
    learner.learn(9)
    pusher = ShardPusher(store, [worker.url], retrying=fast_retrying())
    cleanup.append(pusher)
    assert pusher.flush(20)
    worker.stop()
    worker.start_again()  # restarted while nothing changed
    learner.learn(1, keys=KEYS[:1])  # a delta to the new instance: 409, then snapshots
    assert pusher.flush(20)
    assert_mirrors(worker.intake, store)  # every shard, not only the changed one
    st = pusher.status()[worker.url]
    assert st.errors == 0
    assert st.snapshots == 2 * len(KEYS)


def test_restart_without_changes_is_resynced_by_flush(cleanup):
    store = ShardStore()
    worker = Worker()
    cleanup += [worker, store]
    Learner(store).learn(6)
    pusher = ShardPusher(store, [worker.url], retrying=fast_retrying())
    cleanup.append(pusher)
    assert pusher.flush(20)
    worker.stop()
    worker.start_again()  # restarted, empty, and the store does not change
    assert worker.intake.keys() == []
    assert pusher.flush(20)  # flush asks the worker for its instance first
    assert_mirrors(worker.intake, store)
    assert pusher.status()[worker.url].snapshots == 2 * len(KEYS)


def test_missing_token_is_401_and_not_retried(cleanup):
    store = ShardStore()
    worker = Worker(api_key="sekrit")
    cleanup += [worker, store]
    Learner(store).learn(3)
    pusher = ShardPusher(store, [worker.url], retrying=fast_retrying())
    cleanup.append(pusher)
    assert not pusher.flush(0.5)
    st = pusher.status()[worker.url]
    assert st.errors >= 1
    assert "401" in st.last_error
    assert st.retries == 0
    assert set(st.pending) == set(KEYS)
    assert worker.intake.keys() == []
    pusher.close()
    good = ShardPusher(store, [worker.url], api_key="sekrit", retrying=fast_retrying())
    cleanup.append(good)
    assert good.flush(20)
    assert_mirrors(worker.intake, store)


def test_depth_mismatch_is_not_retried(cleanup):
    store = ShardStore(max_depth=16)
    worker = Worker(max_depth=64)
    cleanup += [worker, store]
    Learner(store).learn(2)
    pusher = ShardPusher(store, [worker.url], retrying=fast_retrying())
    cleanup.append(pusher)
    assert not pusher.flush(0.5)
    st = pusher.status()[worker.url]
    assert st.retries == 0
    assert st.errors >= 1
    assert "409" in st.last_error
    assert worker.intake.keys() == []


def test_full_queue_marks_keys_dirty(cleanup):
    store = ShardStore()
    worker = Worker()
    cleanup += [worker, store]
    pusher = ShardPusher(store, [worker.url], queue_size=1, retrying=fast_retrying())
    cleanup.append(pusher)
    keys = [("t", "p", f"s{i}") for i in range(40)]
    learner = Learner(store)
    learner.learn(200, keys=keys)
    for _ in range(1000):  # never blocks
        pusher.notify(keys[0])
    pusher.notify()
    assert pusher.flush(30)
    assert_mirrors(worker.intake, store)


def test_snapshot_files_through_shm_dir(cleanup, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    store = ShardStore()
    worker = Worker(shm_dir=shm)
    refusing = Worker()  # no shm dir: refuses files, the pusher uploads instead
    cleanup += [worker, refusing, store]
    Learner(store).learn(12)
    pusher = ShardPusher(
        store,
        [worker.url, refusing.url],
        shm_dir=shm,
        shm_threshold=0,
        retrying=fast_retrying(),
    )
    cleanup.append(pusher)
    assert pusher.flush(20)
    assert_mirrors(worker.intake, store)
    assert_mirrors(refusing.intake, store)
    assert list(shm.iterdir()) == []  # every file removed after use
    st = pusher.status()
    assert st[worker.url].errors == 0
    assert st[refusing.url].errors == 0


def test_close_interrupts_retry_waits(cleanup):
    script = Script(["503"] * 50)

    class SlowDown(IntakeRequestHandler):
        def dispatch(self, method, path, query, headers, body):
            if script.next(method, path) == "503":
                return error_response(503, "busy", "busy", {"Retry-After": "60"})
            return super().dispatch(method, path, query, headers, body)

    store = ShardStore()
    worker = Worker(handler=SlowDown)
    cleanup += [worker, store]
    Learner(store).learn(1)
    pusher = ShardPusher(store, [worker.url])
    cleanup.append(pusher)
    deadline = time.monotonic() + 10
    while not script.seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert script.seen  # the first attempt was answered 503: now waiting 60 s
    pusher.close(timeout=10)
    assert not pusher._thread.is_alive()
    assert pusher.closed
    assert not pusher.flush(0.1)
    pusher.notify(KEYS[0])  # a no-op once closed


def test_unreachable_endpoint_rests_then_recovers(cleanup):
    store = ShardStore()
    worker = Worker()
    port = worker.port
    worker.stop()
    cleanup += [store]
    Learner(store).learn(3)
    pusher = ShardPusher(
        store, [f"http://127.0.0.1:{port}"], retrying=fast_retrying(attempts=2), timeout=2
    )
    cleanup.append(pusher)
    assert not pusher.flush(0.3)
    st = pusher.status()[f"http://127.0.0.1:{port}"]
    assert not st.connected
    assert st.errors >= 1
    worker.start_again()
    cleanup.append(worker)
    assert pusher.flush(20)
    assert_mirrors(worker.intake, store)


def test_transient_classification():
    assert is_transient(PushError("refused"))
    for status in (408, 429, 500, 502, 503, 504, 599):
        assert is_transient(PushError("x", status=status))
    assert is_transient(PushError("x", status=409, error_type="conflict"))
    for status in (400, 401, 403, 404, 405, 413, 415, 422, 507):
        assert not is_transient(PushError("x", status=status))
    assert not is_transient(PushError("x", status=409, error_type="depth_mismatch"))
    assert not is_transient(PushError("x", status=409, error_type="instance_mismatch"))
    assert not is_transient(ValueError("x"))
    assert isinstance(default_retrying(), tenacity.Retrying)


def test_bad_arguments():
    store = ShardStore()
    try:
        for endpoints in (
            [],
            ["ftp://x"],
            ["http://"],
            ["http://h/?q=1"],
            ["http://h", "http://h"],
        ):
            with pytest.raises(InvalidArgumentError):
                ShardPusher(store, endpoints)
        with pytest.raises(InvalidArgumentError):
            ShardPusher(store, ["http://h"], queue_size=0)
        with pytest.raises(InvalidArgumentError):
            ShardPusher(store, ["http://h"], timeout=0)
    finally:
        store.close()


@pytest.mark.parametrize("kind", [np.int32, np.int64, np.uint16, np.uint32], ids=repr)
def test_integer_arguments_accept_numpy_integers(kind):
    """queue_size, shm_threshold (and serve_intake's port) accept numpy integers."""
    store = ShardStore()
    intake = ShardIntake()
    server, thread = serve_intake(intake, port=kind(0))
    pusher = None
    try:
        pusher = ShardPusher(store, [server.url], queue_size=kind(4), shm_threshold=kind(1 << 10))
        assert pusher._queue.maxsize == 4
        assert type(pusher._shm_threshold) is int
        store.learn(("t", None, "s"), [kind(1), kind(2), kind(3)])
        assert pusher.flush(10)
        assert intake.tree(("t", None, "s")).sequence(1) == [1, 2, 3]
    finally:
        if pusher is not None:
            pusher.close()
        server.stop(thread)
        store.close()


@pytest.mark.parametrize("value", [True, np.True_, 4.0, "4"], ids=repr)
def test_integer_arguments_refuse_bool_and_non_integers(value):
    """bool and non-integers raise TypeError naming the argument (nothing starts)."""
    name = "bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__
    store = ShardStore()
    try:
        for kw in ("queue_size", "shm_threshold"):
            with pytest.raises(TypeError, match=f"^{kw} must be an int, not {name}$"):
                ShardPusher(store, ["http://h"], **{kw: value})
        assert store._listeners == []
        with pytest.raises(TypeError, match=f"^port must be an int, not {name}$"):
            serve_intake(ShardIntake(), port=value)
    finally:
        store.close()


# --- the command line -------------------------------------------------------


def cli_args(add, argv):
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def test_cli_push_and_status(cleanup, tmp_path, capsys):
    path = tmp_path / "store"
    with ShardStore(path, fsync=False) as store:
        Learner(store).learn(15)
    a, b = Worker(api_key="k"), Worker(api_key="k")
    cleanup += [a, b]
    common = ["--store", str(path), "--endpoint", a.url, "--endpoint", b.url, "--timeout", "20"]
    assert run_status(cli_args(add_status_arguments, [*common, "--api-key", "k"])) == 1
    out = capsys.readouterr().out
    assert out.count("missing") == 2 * len(KEYS)
    assert run_push(cli_args(add_push_arguments, [*common, "--api-key", "k"])) == 0
    out = capsys.readouterr().out
    assert out.count(": ok,") == 2
    assert run_status(cli_args(add_status_arguments, [*common, "--api-key", "k"])) == 0
    out = capsys.readouterr().out
    assert out.count("in-sync") == 2 * len(KEYS)
    with ShardStore(path, fsync=False) as store:
        store.learn(KEYS[0], [1, 2, 3])  # one more response the workers lack
    assert run_status(cli_args(add_status_arguments, [*common, "--api-key", "k"])) == 1
    out = capsys.readouterr().out
    assert out.count("behind") == 2
    assert out.count("in-sync") == 2 * (len(KEYS) - 1)
    # a worker shard the store does not have
    r = b.intake.handle(
        "PUT",
        "/v1/agentspec/shards/snapshot",
        "tenant=other",
        {"Authorization": "Bearer k"},
        a.intake.tree(KEYS[0]).to_bytes(),
    )
    assert r.status == 200
    assert run_status(cli_args(add_status_arguments, [*common, "--api-key", "k"])) == 1
    assert "worker-only" in capsys.readouterr().out


def test_cli_failures(cleanup, tmp_path, capsys, monkeypatch):
    path = tmp_path / "store"
    with ShardStore(path, fsync=False) as store:
        Learner(store).learn(3)
    worker = Worker(api_key="k")
    cleanup.append(worker)
    common = ["--store", str(path), "--endpoint", worker.url, "--timeout", "1"]
    assert run_push(cli_args(add_push_arguments, common)) == 1  # no token
    assert "FAILED" in capsys.readouterr().out
    assert run_status(cli_args(add_status_arguments, common)) == 1
    assert "HTTP 401" in capsys.readouterr().out
    monkeypatch.setenv("AGENTSPEC_API_KEY", "k")  # the key from the environment
    assert run_push(cli_args(add_push_arguments, common)) == 0
    with pytest.raises(FileNotFoundError):
        run_push(
            cli_args(
                add_push_arguments, ["--store", str(tmp_path / "no"), "--endpoint", "http://h"]
            )
        )


class Silent:
    """A worker that accepts connections (the kernel's backlog) and never answers."""

    def __init__(self):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self):
        self.sock.close()


def test_close_cuts_a_request_to_a_worker_that_never_answers(cleanup):
    silent = Silent()
    store = ShardStore()
    cleanup += [silent, store]
    Learner(store).learn(2)
    pusher = ShardPusher(store, [silent.url], timeout=60)  # one request could take 60 s
    cleanup.append(pusher)
    assert not pusher.flush(0.5)  # the snapshot is sent; no answer ever comes
    (status,) = pusher.status().values()
    assert status.pending
    start = time.monotonic()
    pusher.close(timeout=30)
    assert time.monotonic() - start < 5
    assert not pusher._thread.is_alive()


def test_flush_bounds_the_probe_of_a_worker_that_hangs(cleanup):
    """A worker that answered once, then hangs: flush(timeout) still returns in time."""
    hang, release = threading.Event(), threading.Event()

    class Hangs(IntakeRequestHandler):
        def dispatch(self, method, path, query, headers, body):
            if hang.is_set():
                release.wait(30)  # holds the request until the test ends
            return super().dispatch(method, path, query, headers, body)

    store = ShardStore()
    worker = Worker(handler=Hangs)
    cleanup += [worker, store]
    Learner(store).learn(3)
    pusher = ShardPusher(store, [worker.url], timeout=60)
    cleanup.append(pusher)
    assert pusher.flush(20)
    hang.set()
    start = time.monotonic()
    try:
        pusher.flush(1.0)  # probes the known worker on its own connection: no answer
        assert time.monotonic() - start < 4  # not the 60 s request timeout
    finally:
        release.set()
