"""`ShardIntake` under hostile or heavy input: the review's reproducers.

1. a shard of the wrong depth is refused from its header, before anything is built;
2. ``snapshot-file`` reads only regular files under the shm dir, size-capped;
3. a push to one key never waits for a push to another key (per-key locks);
4. (lone-surrogate keys: see test_shardkey.py);
5. the HTTP server's listen backlog holds a burst of 128 connections;
6. ``vocab_size``: shards holding token ids outside the vocabulary get 422.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
from build_spy import BuildSpy
from http_burst import get_round, handshakes_done, open_burst

from agentspec import SuffixTree
from agentspec._core import lowlevel
from agentspec._push.intake import IntakeHTTPServer, ShardIntake, serve_intake
from agentspec._push.wire import (
    DELTA_PATH,
    SHARD_CONTENT_TYPE,
    SHARDS_PATH,
    SNAPSHOT_FILE_PATH,
    SNAPSHOT_PATH,
    encode_key_query,
    parse_error,
    parse_shard_list,
)
from agentspec.exceptions import (
    DepthMismatchError,
    InvalidArgumentError,
    ShardChecksumError,
    ShardFormatError,
    ShardTruncatedError,
)

KEY = ("acme", "etl", "Extract")
OTHER = ("acme", "etl", "Load")
SHARD = {"Content-Type": SHARD_CONTENT_TYPE}


def put(intake: ShardIntake, body: bytes, key=KEY):
    return intake.handle("PUT", SNAPSHOT_PATH, encode_key_query(key), SHARD, body)


def post_delta(intake: ShardIntake, body: bytes, key=KEY):
    return intake.handle("POST", DELTA_PATH, encode_key_query(key), SHARD, body)


def file_request(intake: ShardIntake, path: Any, key=KEY):
    body = json.dumps({"path": str(path)}).encode()
    return intake.handle(
        "POST",
        SNAPSHOT_FILE_PATH,
        encode_key_query(key),
        {"Content-Type": "application/json"},
        body,
    )


def err(resp) -> tuple[str | None, str]:
    return parse_error(resp.body)


def assert_clean_error(resp, status: int, kind: str) -> str:
    """A JSON error of this status and type whose message holds no internal text."""
    assert resp.status == status, resp.body
    got_kind, message = err(resp)
    assert got_kind == kind
    for internal in ("Traceback", 'File "', "agentspec/", "Error(", "0x"):
        assert internal not in message, message
    return message


def big_tree(depth: int, n_seqs: int = 20, length: int = 5000, seed: int = 0) -> SuffixTree:
    """~n_seqs * length tokens of random ids (cheap to build at any depth)."""
    rng = random.Random(seed)
    t = SuffixTree(depth)
    for i in range(1, n_seqs + 1):
        t.add(i, [rng.randrange(1 << 30) for _ in range(length)])
    return t


# --- 1. depth from the header, before any build ------------------------------------


def test_wrong_depth_snapshot_is_refused_from_the_header(monkeypatch: pytest.MonkeyPatch) -> None:
    """The review's reproducer (a large snapshot at depth 1024 into a depth-64
    worker cost tokens x depth of CPU before the 409): now nothing is built."""
    data = big_tree(1024).to_bytes()
    assert len(data) > 300_000
    intake = ShardIntake(max_depth=64, vocab_size=1 << 30)
    spy = BuildSpy(monkeypatch)
    before = lowlevel.allocated_bytes()
    r = put(intake, data)
    msg = assert_clean_error(r, 409, "depth_mismatch")
    assert "1024" in msg
    assert "64" in msg
    r = post_delta(intake, data, key=OTHER)  # a delta to a missing shard: no empty tree either
    assert_clean_error(r, 409, "depth_mismatch")
    assert spy.calls == []  # no tree created, loaded, or even scanned
    assert lowlevel.allocated_bytes() == before
    assert intake.keys() == []


def test_depth_is_decided_by_the_header_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong-depth header over a corrupt payload is a 409 (the payload is never read)."""
    data = bytearray(big_tree(16, n_seqs=2, length=100).to_bytes())
    data[-1] ^= 0xFF  # checksum no longer matches
    intake = ShardIntake(max_depth=64)
    spy = BuildSpy(monkeypatch)
    assert_clean_error(put(intake, bytes(data)), 409, "depth_mismatch")
    assert spy.calls == []
    # at the right depth the corruption is found (400), the shard unchanged
    intake16 = ShardIntake(max_depth=16)
    assert_clean_error(put(intake16, bytes(data)), 400, "shard_format_error")
    assert intake16.keys() == []


def test_bad_headers_are_400_before_any_build(monkeypatch: pytest.MonkeyPatch) -> None:
    good = big_tree(64, n_seqs=2, length=50).to_bytes()
    intake = ShardIntake(max_depth=64)
    spy = BuildSpy(monkeypatch)
    for bad in (b"", b"ASHD", b"XXXX" + good[4:], good[:-1], good + b"\0"):
        assert_clean_error(put(intake, bad), 400, "shard_format_error")
        assert_clean_error(post_delta(intake, bad), 400, "shard_format_error")
    assert spy.calls == []
    assert intake.keys() == []


def test_right_depth_snapshot_is_still_built() -> None:
    src = big_tree(64, n_seqs=3, length=200)
    intake = ShardIntake(max_depth=64)
    r = put(intake, src.to_bytes())
    assert r.status == 200
    assert r.json()["sequences"] == 3
    assert intake.tree(KEY).sequence_ids() == [1, 2, 3]


# --- native helpers behind the checks ------------------------------------------


def test_shard_peek_and_max_token() -> None:
    t = SuffixTree(16)
    t.add(1, [5, 70_000, 3])
    t.add(2, [])
    snap = t.to_bytes()
    assert lowlevel.shard_peek(snap) == (0, 16, 2, 0)
    assert lowlevel.shard_max_token(snap) == 70_000
    delta = t.delta_bytes([2], [9, 10])
    assert lowlevel.shard_peek(delta) == (1, 16, 1, 2)
    assert lowlevel.shard_max_token(delta) == -1  # no token at all
    assert lowlevel.shard_max_token(SuffixTree(8).to_bytes()) == -1
    with pytest.raises(ShardTruncatedError):
        lowlevel.shard_peek(snap[:20])
    with pytest.raises(ShardFormatError):
        lowlevel.shard_peek(b"XXXX" + snap[4:])
    corrupt = bytearray(snap)
    corrupt[-1] ^= 1
    assert lowlevel.shard_peek(bytes(corrupt))[1] == 16  # the payload is not read
    with pytest.raises(ShardChecksumError):
        lowlevel.shard_max_token(bytes(corrupt))
    # memoryview / bytearray input (what snapshot-file hands over)
    assert lowlevel.shard_max_token(bytearray(snap)) == 70_000
    assert lowlevel.shard_peek(memoryview(snap))[1] == 16
    # the depth-mismatch error still exists for direct loads
    with pytest.raises(DepthMismatchError):
        SuffixTree(8).load(snap)


# --- 2. snapshot files ----------------------------------------------------------


@pytest.fixture
def shm(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return d


def run_bounded(fn: Any, timeout: float = 10.0) -> Any:
    """Run fn() on a thread; fail (instead of hanging the suite) if it blocks."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the request blocked"
    return out[0]


def test_snapshot_file_fifo_does_not_block(shm) -> None:
    """The review's reproducer: a FIFO in the shm dir blocked the handler thread."""
    fifo = shm / "agentspec-fifo.ashd"
    os.mkfifo(fifo)
    intake = ShardIntake(shm_dir=shm)
    r = run_bounded(lambda: file_request(intake, fifo))
    msg = assert_clean_error(r, 400, "invalid_request_error")
    assert "regular file" in msg
    assert intake.keys() == []


def test_snapshot_file_directory_and_socket_refused(shm) -> None:
    intake = ShardIntake(shm_dir=shm)
    (shm / "sub").mkdir()
    assert_clean_error(file_request(intake, shm / "sub"), 400, "invalid_request_error")
    sock_path = shm / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_path))
        r = run_bounded(lambda: file_request(intake, sock_path))
        assert_clean_error(r, 400, "invalid_request_error")
    assert_clean_error(file_request(intake, shm / "missing"), 400, "invalid_request_error")


def test_snapshot_file_symlinks_out_are_refused(shm, tmp_path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "s.ashd").write_bytes(big_tree(64, 1, 10).to_bytes())
    (shm / "dirlink").symlink_to(outside)  # a directory symlink pointing out
    (shm / "filelink.ashd").symlink_to(outside / "s.ashd")
    (shm / "loop").symlink_to(shm / "loop")
    intake = ShardIntake(shm_dir=shm)
    for path in (shm / "dirlink" / "s.ashd", shm / "filelink.ashd", outside / "s.ashd"):
        assert_clean_error(file_request(intake, path), 403, "permission_error")
    r = file_request(intake, shm / "loop")
    assert r.status in (400, 403)
    # a symlink inside the dir to a file inside the dir is resolved and read
    (shm / "real.ashd").write_bytes(big_tree(64, 2, 10).to_bytes())
    (shm / "inner.ashd").symlink_to(shm / "real.ashd")
    (shm / "nested").mkdir()
    (shm / "nested" / "n.ashd").write_bytes(big_tree(64, 3, 10).to_bytes())
    assert file_request(intake, shm / "inner.ashd").status == 200
    assert file_request(intake, shm / "nested" / "n.ashd").json()["sequences"] == 3
    assert intake.keys() == [KEY]


def test_snapshot_file_path_turned_into_symlink_is_not_followed(shm, tmp_path) -> None:
    """The path is checked, then opened component by component with O_NOFOLLOW:
    a component swapped for a symlink after the check fails instead of leading out."""
    from agentspec._push import intake as _intake

    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "f.ashd").write_bytes(big_tree(64, 1, 10).to_bytes())
    (shm / "d").mkdir()
    (shm / "d" / "f.ashd").write_bytes(b"x")
    # the race, replayed deterministically: open what a swapped path now holds
    os.rename(shm / "d", shm / "d.old")
    (shm / "d").symlink_to(tmp_path / "secret")
    with pytest.raises(OSError, match=r"symbolic links|Not a directory"):
        _intake._open_beneath(shm, ("d", "f.ashd"))
    (shm / "g.ashd").symlink_to(tmp_path / "secret" / "f.ashd")
    with pytest.raises(OSError, match="symbolic links"):
        _intake._open_beneath(shm, ("g.ashd",))


def test_snapshot_file_size_is_capped(shm) -> None:
    """The review's reproducer: a 600 MB file was read whole; now 413 unread."""
    huge = shm / "huge.ashd"
    with open(huge, "wb") as f:
        f.truncate(600 << 20)  # sparse: no disk used
    intake = ShardIntake(shm_dir=shm)  # the default limit, 256 MiB
    msg = assert_clean_error(file_request(intake, huge), 413, "payload_too_large")
    assert str(600 << 20) in msg
    data = big_tree(64, 2, 50).to_bytes()
    exact = shm / "exact.ashd"
    exact.write_bytes(data)
    small = ShardIntake(shm_dir=shm, max_body_bytes=len(data))
    assert file_request(small, exact).status == 200
    smaller = ShardIntake(shm_dir=shm, max_body_bytes=len(data) - 1)
    assert_clean_error(file_request(smaller, exact), 413, "payload_too_large")
    assert smaller.keys() == []


def test_snapshot_file_wrong_depth_and_vocab_refused_before_build(
    shm, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = shm / "deep.ashd"
    f.write_bytes(big_tree(1024, 4, 1000).to_bytes())
    g = shm / "oov.ashd"
    g.write_bytes(big_tree(64, 2, 10).to_bytes())
    intake = ShardIntake(shm_dir=shm, max_depth=64)
    spy = BuildSpy(monkeypatch)
    assert_clean_error(file_request(intake, f), 409, "depth_mismatch")
    assert spy.calls == []
    intake.vocab_size = 1000
    assert_clean_error(file_request(intake, g), 422, "out_of_vocabulary")
    assert spy.calls == ["shard_max_token"]
    assert intake.keys() == []


# --- 3. per-key locks ------------------------------------------------------------


def small_tree(start: int = 1, n: int = 2, depth: int = 64) -> SuffixTree:
    t = SuffixTree(depth)
    for i in range(start, start + n):
        t.add(i, [i, i + 1, i + 2])
    return t


def test_a_delta_to_one_key_never_waits_for_another_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The review's reproducer: a 3-token delta waited 4.6 s behind a 32 MB delta
    to an unrelated key.  Key A's apply is held inside SuffixTree.load by an
    event; key B's delta, snapshot, listing and delete all complete meanwhile."""
    intake = ShardIntake()
    assert put(intake, small_tree().to_bytes(), key=KEY).status == 200
    slow = intake.tree(KEY)
    entered, release = threading.Event(), threading.Event()
    real_load = SuffixTree.load

    def gated_load(self: SuffixTree, data: Any) -> None:
        if self is slow:
            entered.set()
            assert release.wait(30)
        real_load(self, data)

    monkeypatch.setattr(SuffixTree, "load", gated_load)
    src = small_tree()
    src.add(3, [7, 8, 9])
    results: dict[str, Any] = {}

    def push_a(name: str) -> None:
        results[name] = post_delta(intake, src.delta_bytes([3]), key=KEY)

    a = threading.Thread(target=push_a, args=("a",), daemon=True)
    a.start()
    try:
        assert entered.wait(10)  # A holds its key's lock inside load
        a2_done = threading.Event()
        a2 = threading.Thread(
            target=lambda: (push_a("a2"), a2_done.set()), daemon=True
        )  # a second push to A queues behind the first
        a2.start()

        def other_key() -> list[int]:
            other = small_tree(10, 3)
            statuses = [post_delta(intake, other.delta_bytes([10]), key=OTHER).status]
            statuses.append(put(intake, other.to_bytes(), key=OTHER).status)
            statuses.append(post_delta(intake, other.delta_bytes([11, 12]), key=OTHER).status)
            listing = intake.handle("GET", SHARDS_PATH, "", {}, b"")
            statuses.append(listing.status)
            _, shards = parse_shard_list(listing.body)
            results["listed"] = {s.key: s.sequences for s in shards}
            statuses.append(
                intake.handle("DELETE", SHARDS_PATH, encode_key_query(OTHER), {}, b"").status
            )
            return statuses

        assert run_bounded(other_key) == [200] * 5
        assert results["listed"] == {KEY: 2, OTHER: 3}  # A listed as of its last change
        assert a.is_alive()  # still held: B never waited for it
        assert not a2_done.is_set()  # same key: serialised behind A
    finally:
        release.set()
    a.join(10)
    a2.join(10)
    assert results["a"].status == 200
    assert results["a2"].status == 200  # idempotent re-apply
    assert intake.tree(KEY).sequence_ids() == [1, 2, 3]
    assert len(intake._key_locks) == 0  # no lock left behind per key


def test_a_snapshot_build_holds_no_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a snapshot (the long part) holds no lock: the same key's deltas
    proceed on the old tree, other keys are untouched; the swap is atomic."""
    intake = ShardIntake()
    assert put(intake, small_tree().to_bytes()).status == 200
    entered, release = threading.Event(), threading.Event()
    real = SuffixTree.from_bytes.__func__  # type: ignore[attr-defined]

    def gated(cls: type, data: Any) -> SuffixTree:
        entered.set()
        assert release.wait(30)
        return real(cls, data)

    monkeypatch.setattr(SuffixTree, "from_bytes", classmethod(gated))
    out: list[Any] = []
    t = threading.Thread(
        target=lambda: out.append(put(intake, small_tree(20, 4).to_bytes())), daemon=True
    )
    t.start()
    try:
        assert entered.wait(10)
        src = small_tree()
        src.add(3, [3, 4])
        assert run_bounded(lambda: post_delta(intake, src.delta_bytes([3]))).status == 200
        assert run_bounded(lambda: post_delta(intake, src.delta_bytes([3]), OTHER)).status == 200
    finally:
        release.set()
    t.join(10)
    assert out[0].status == 200
    assert intake.tree(KEY).sequence_ids() == [20, 21, 22, 23]


# --- 5. listen backlog -----------------------------------------------------------


def test_listen_backlog_holds_a_burst_of_128_connections() -> None:
    intake = ShardIntake()
    server = IntakeHTTPServer(("127.0.0.1", 0), intake)  # listening, not accepting yet
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    try:
        assert server.request_queue_size >= 1024
        socks = open_burst(server.port, 128)
        assert handshakes_done(socks)  # the default backlog of 5 leaves most in SYN_SENT
        thread.start()
        assert get_round(socks, SHARDS_PATH, time.monotonic() + 60) == []
    finally:
        if thread.is_alive():
            server.stop(thread)
        else:  # shutdown() would wait for a serve_forever that never started
            server.server_close()


def test_serve_intake_uses_the_backlog_and_sets_vocab() -> None:
    intake = ShardIntake()
    server, thread = serve_intake(intake, vocab_size=5000)
    try:
        assert server.request_queue_size >= 1024
        assert intake.vocab_size == 5000
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        t = SuffixTree(64)
        t.add(1, [4999, 5000])
        conn.request("PUT", f"{SNAPSHOT_PATH}?{encode_key_query(KEY)}", t.to_bytes(), SHARD)
        r = conn.getresponse()
        assert r.status == 422
        assert parse_error(r.read())[0] == "out_of_vocabulary"
        conn.close()
    finally:
        server.stop(thread)


# --- 6. vocabulary ---------------------------------------------------------------


def test_vocab_refuses_out_of_vocabulary_snapshots_and_deltas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    intake = ShardIntake(vocab_size=100)
    ok = SuffixTree(64)
    ok.add(1, [0, 99, 5])
    assert put(intake, ok.to_bytes()).status == 200
    before = intake.tree(KEY)
    bad = SuffixTree(64)
    bad.add(1, [1, 100, 2])
    spy = BuildSpy(monkeypatch)
    msg = assert_clean_error(put(intake, bad.to_bytes()), 422, "out_of_vocabulary")
    assert "100" in msg
    assert "vocabulary" in msg
    assert spy.calls == ["shard_max_token"]  # refused before any build
    assert intake.tree(KEY) is before
    # a delta adding one bad sequence among good ones changes nothing
    src = SuffixTree(64)
    src.add(1, [0, 99, 5])
    src.add(2, [3, 4])
    src.add(3, [7, 2**31 - 1])
    assert_clean_error(post_delta(intake, src.delta_bytes([2, 3], [1])), 422, "out_of_vocabulary")
    assert before.sequence_ids() == [1]
    assert_clean_error(
        post_delta(intake, src.delta_bytes([3]), key=OTHER), 422, "out_of_vocabulary"
    )
    assert intake.keys() == [KEY]
    # in-vocabulary deltas (removal-only ones included) apply
    assert post_delta(intake, src.delta_bytes([2], [1])).status == 200
    assert before.sequence_ids() == [2]
    assert post_delta(intake, src.delta_bytes([], [2])).status == 200
    assert before.sequence_ids() == []
    # corrupt bytes are a 400 (the scan validates), not a 422
    corrupt = bytearray(bad.to_bytes())
    corrupt[-2] ^= 0x10
    assert_clean_error(put(intake, bytes(corrupt)), 400, "shard_format_error")


def test_vocab_unset_accepts_any_id_and_can_be_set_later() -> None:
    intake = ShardIntake()
    assert intake.vocab_size is None
    t = SuffixTree(64)
    t.add(1, [2**31 - 1])
    assert put(intake, t.to_bytes()).status == 200
    intake.vocab_size = np.int64(2**31)  # every id is below: accepted
    assert intake.vocab_size == 2**31
    assert type(intake.vocab_size) is int
    assert put(intake, t.to_bytes()).status == 200
    intake.vocab_size = 10
    assert put(intake, t.to_bytes()).status == 422
    intake.vocab_size = None
    assert put(intake, t.to_bytes()).status == 200


@pytest.mark.parametrize("value", [0, -1, 2**31 + 1])
def test_vocab_size_range(value: int) -> None:
    with pytest.raises(InvalidArgumentError, match="vocab_size"):
        ShardIntake(vocab_size=value)


@pytest.mark.parametrize("value", [True, 1.5, "100"], ids=repr)
def test_vocab_size_type(value: object) -> None:
    with pytest.raises(TypeError, match="vocab_size must be an int or None"):
        ShardIntake(vocab_size=value)  # type: ignore[arg-type]


# --- malformed requests: 4xx, no internal text -------------------------------------


def test_malformed_requests_get_clean_4xx(shm) -> None:
    intake = ShardIntake(shm_dir=shm, vocab_size=50)
    q = encode_key_query(KEY)
    deep = str(shm) + "/a" * 3000  # inside, longer than PATH_MAX, absent
    cases = [
        ("PUT", SNAPSHOT_PATH, q, SHARD, b"\xff" * 100, 400),
        ("POST", DELTA_PATH, q, SHARD, b"ASHD" + b"\0" * 60, 400),
        ("POST", SNAPSHOT_FILE_PATH, q, {}, b'{"path": "\\ud800"}', 400),
        ("POST", SNAPSHOT_FILE_PATH, q, {}, json.dumps({"path": deep}).encode(), 400),
        ("POST", SNAPSHOT_FILE_PATH, q, {}, json.dumps({"path": "a/" * 3000}).encode(), 403),
        ("POST", SNAPSHOT_FILE_PATH, q, {}, b"\xff\xfe", 400),
        ("POST", SNAPSHOT_FILE_PATH, q, {}, json.dumps({"path": str(shm)}).encode(), 403),
        ("PUT", SNAPSHOT_PATH, "tenant=%ZZ", SHARD, b"", 400),
        ("PUT", SNAPSHOT_PATH, "tenant=" + "a" * 200, SHARD, b"", 400),
    ]
    for method, path, query, headers, body, status in cases:
        r = intake.handle(method, path, query, headers, body)
        assert 400 <= r.status < 500, (path, body[:40], r.status)
        assert r.status == status, (path, body[:40], r.body)
        kind, message = err(r)
        assert kind is not None
        assert "Traceback" not in message
        assert "Error(" not in message
    assert intake.keys() == []
