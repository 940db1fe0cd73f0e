"""`ShardIntake`: every route and error, and the stdlib HTTP adapter."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading

import numpy as np
import pytest

from agentspec import SuffixTree
from agentspec._core.budget import MIN_TOKEN_BYTES
from agentspec._push.intake import ShardIntake, serve_intake
from agentspec._push.wire import (
    DELTA_PATH,
    INSTANCE_HEADER,
    SHARD_CONTENT_TYPE,
    SHARDS_PATH,
    SNAPSHOT_FILE_PATH,
    SNAPSHOT_PATH,
    encode_key_query,
    parse_error,
    parse_shard_list,
)
from agentspec.exceptions import InvalidArgumentError

KEY = ("acme", "etl", "Extract")
Q = encode_key_query(KEY)
SHARD = {"Content-Type": SHARD_CONTENT_TYPE}


def source_tree(n=5, depth=64, start=1):
    """A tree with sequences start..start+n-1 of distinct tokens."""
    t = SuffixTree(depth)
    for i in range(start, start + n):
        t.add(i, [i, i + 1, i + 2, 9999, 9999])
    return t


def put(intake, body, key=KEY, headers=SHARD):
    return intake.handle("PUT", SNAPSHOT_PATH, encode_key_query(key), headers, body)


def post_delta(intake, body, key=KEY, headers=SHARD):
    return intake.handle("POST", DELTA_PATH, encode_key_query(key), headers, body)


def err_type(resp):
    return parse_error(resp.body)[0]


def test_empty_list_and_instance():
    a, b = ShardIntake(), ShardIntake()
    r = a.handle("GET", SHARDS_PATH, "", {}, b"")
    assert r.status == 200
    assert r.json() == {"instance": a.instance, "shards": [], "budget": a.budget()}
    assert a.budget()["bytes"] == 0
    assert r.headers[INSTANCE_HEADER] == a.instance
    assert a.instance != b.instance
    assert a.keys() == []
    assert a.tree(KEY) is None


def test_snapshot_replaces_atomically():
    intake = ShardIntake()
    src = source_tree(5)
    r = put(intake, src.to_bytes())
    assert r.status == 200, r.body
    body = r.json()
    assert body["sequences"] == 5
    assert body["max_seq"] == 5
    assert body["instance"] == intake.instance
    old = intake.tree(KEY)
    assert old.sequence_ids() == [1, 2, 3, 4, 5]
    r = put(intake, source_tree(2, start=10).to_bytes())
    assert r.status == 200
    new = intake.tree(KEY)
    assert new is not old
    assert new.sequence_ids() == [10, 11]
    # a reader still holding the old tree can keep using it
    assert old.count([9999, 9999]) == 5
    instance, shards = parse_shard_list(intake.handle("GET", SHARDS_PATH, "", {}, b"").body)
    assert instance == intake.instance
    assert [(s.key, s.sequences, s.max_seq) for s in shards] == [(KEY, 2, 11)]
    assert intake.keys() == [KEY]


def test_delta_is_idempotent():
    intake = ShardIntake()
    src = source_tree(3)
    assert put(intake, src.to_bytes()).status == 200
    src.add(4, [4, 5, 6, 9999, 9999])
    src.remove(1)
    delta = src.delta_bytes([4], [1])
    for _ in range(3):  # a retried delta never double-counts
        r = post_delta(intake, delta)
        assert r.status == 200, r.body
        assert r.json()["sequences"] == 3
        t = intake.tree(KEY)
        assert t.sequence_ids() == src.sequence_ids()
        assert t.count([9999, 9999]) == src.count([9999, 9999]) == 3
        assert t.count([4, 5, 6]) == src.count([4, 5, 6]) == 1


def test_delta_creates_missing_shard():
    intake = ShardIntake()
    src = source_tree(2)
    r = post_delta(intake, src.delta_bytes([1, 2]), key=("t", None, None))
    assert r.status == 200
    assert intake.tree(("t", None, None)).sequence_ids() == [1, 2]


def test_instance_header_on_deltas():
    intake = ShardIntake()
    src = source_tree(2)
    delta = src.delta_bytes([1])
    r = post_delta(intake, delta, headers={**SHARD, INSTANCE_HEADER: "someone-else"})
    assert r.status == 409
    assert err_type(r) == "instance_mismatch"
    assert intake.tree(KEY) is None
    r = post_delta(intake, delta, headers={**SHARD, INSTANCE_HEADER: intake.instance})
    assert r.status == 200


def corruptions(data):
    """Truncated, bit-flipped and garbage variants of shard bytes."""
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x5A
    return [b"", b"garbage", data[:-3], data[: len(data) // 2], bytes(flipped)]


def test_malformed_bytes_leave_shard_unchanged():
    intake = ShardIntake()
    src = source_tree(4)
    assert put(intake, src.to_bytes()).status == 200
    before = intake.tree(KEY)
    src.add(9, [9, 9, 9])
    delta = src.delta_bytes([9], [2])
    for bad in corruptions(delta):
        r = post_delta(intake, bad)
        assert r.status == 400, bad
        assert err_type(r) == "shard_format_error"
    for bad in corruptions(src.to_bytes()):
        r = put(intake, bad)
        assert r.status == 400
        assert err_type(r) == "shard_format_error"
    assert intake.tree(KEY) is before
    assert before.sequence_ids() == [1, 2, 3, 4]
    # a delta sent as a snapshot, a snapshot sent as a delta to a live shard
    assert put(intake, delta).status == 400
    r = post_delta(intake, src.to_bytes())
    assert r.status == 400
    assert err_type(r) == "shard_format_error"
    assert before.sequence_ids() == [1, 2, 3, 4]
    before.check()


def test_depth_mismatch_is_409():
    intake = ShardIntake(max_depth=64)
    assert put(intake, source_tree(2).to_bytes()).status == 200
    other = source_tree(3, depth=16)
    r = put(intake, other.to_bytes())
    assert r.status == 409
    assert err_type(r) == "depth_mismatch"
    r = post_delta(intake, other.delta_bytes([3]))
    assert r.status == 409
    assert err_type(r) == "depth_mismatch"
    assert intake.tree(KEY).sequence_ids() == [1, 2]
    r = post_delta(intake, other.delta_bytes([3]), key=("fresh", None, None))
    assert r.status == 409
    assert intake.tree(("fresh", None, None)) is None


def test_delete():
    intake = ShardIntake()
    seen = []
    intake.add_listener(lambda k, t: seen.append((k, t is None)))
    assert put(intake, source_tree(1).to_bytes()).status == 200
    r = intake.handle("DELETE", SHARDS_PATH, Q, {}, b"")
    assert r.status == 200
    assert r.json()["deleted"] is True
    assert intake.tree(KEY) is None
    r = intake.handle("DELETE", SHARDS_PATH, Q, {}, b"")
    assert r.status == 200
    assert r.json()["deleted"] is False
    assert seen == [(KEY, False), (KEY, True)]


def test_listeners_see_changes_and_may_fail():
    intake = ShardIntake()
    seen = []

    def broken(key, tree):
        raise RuntimeError("listener bug")

    intake.add_listener(broken)
    intake.add_listener(lambda k, t: seen.append((k, len(t))))
    src = source_tree(2)
    assert put(intake, src.to_bytes()).status == 200
    src.add(3, [1])
    assert post_delta(intake, src.delta_bytes([3])).status == 200
    assert seen == [(KEY, 2), (KEY, 3)]


def test_auth():
    intake = ShardIntake(api_key="sekrit")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"authorization": "sekrit"}):
        r = intake.handle("GET", SHARDS_PATH, "", headers, b"")
        assert r.status == 401
        assert err_type(r) == "authentication_error"
        assert r.headers["WWW-Authenticate"] == "Bearer"
        # nothing is applied without the token
        assert put(intake, source_tree(1).to_bytes(), headers={**SHARD, **headers}).status == 401
        assert intake.handle("GET", "/v1/agentspec/nope", "", headers, b"").status == 401
    assert intake.keys() == []
    ok = {"authorization": "Bearer sekrit"}
    assert intake.handle("GET", SHARDS_PATH, "", ok, b"").status == 200
    assert put(intake, source_tree(1).to_bytes(), headers={**SHARD, **ok}).status == 200


def test_unknown_route_and_method():
    intake = ShardIntake()
    for path in ("/v1/agentspec/nope", "/v1/models", "/", SHARDS_PATH + "/"):
        r = intake.handle("GET", path, "", {}, b"")
        assert r.status == 404
        assert err_type(r) == "not_found_error"
    for method, path, allow in [
        ("POST", SHARDS_PATH, "GET, DELETE"),
        ("GET", SNAPSHOT_PATH, "PUT"),
        ("PUT", DELTA_PATH, "POST"),
        ("DELETE", SNAPSHOT_FILE_PATH, "POST"),
        ("PATCH", SNAPSHOT_PATH, "PUT"),
    ]:
        r = intake.handle(method, path, Q, {}, b"")
        assert r.status == 405
        assert r.headers["Allow"] == allow
    # method names are case-insensitive
    assert intake.handle("get", SHARDS_PATH, "", {}, b"").status == 200


def test_body_limit():
    intake = ShardIntake(max_body_bytes=100)
    big = source_tree(20).to_bytes()
    assert len(big) > 100
    r = put(intake, big)
    assert r.status == 413
    assert err_type(r) == "payload_too_large"
    assert intake.tree(KEY) is None
    assert intake.precheck("PUT", SNAPSHOT_PATH, {}, 101).status == 413
    assert intake.precheck("PUT", SNAPSHOT_PATH, {}, 100) is None


def test_bad_query_and_content_type():
    intake = ShardIntake()
    data = source_tree(1).to_bytes()
    for query in ("stage=", "tenant=a&tenant=b", "bogus=1", "stage=a%00"):
        r = intake.handle("PUT", SNAPSHOT_PATH, query, SHARD, data)
        assert r.status == 400
        assert err_type(r) == "invalid_request_error"
        assert intake.handle("DELETE", SHARDS_PATH, query, {}, b"").status == 400
    r = intake.handle("PUT", SNAPSHOT_PATH, Q, {"Content-Type": "application/json"}, data)
    assert r.status == 415
    # untyped bytes and octet-stream are accepted
    assert intake.handle("PUT", SNAPSHOT_PATH, Q, {}, data).status == 200
    octet = {"content-type": "application/octet-stream"}
    assert intake.handle("PUT", SNAPSHOT_PATH, Q, octet, data).status == 200
    # an absent tenant means "default"
    assert intake.handle("PUT", SNAPSHOT_PATH, "stage=S", SHARD, data).status == 200
    assert ("default", None, "S") in set(intake.keys())


def test_delta_beside_readers_goes_into_a_copy_swapped_in():
    intake = ShardIntake(busy_timeout=0.02)
    src = source_tree(2)
    assert put(intake, src.to_bytes()).status == 200
    tree = intake.tree(KEY)
    seen = []
    intake.add_listener(lambda key, t: seen.append(t))
    src.add(3, [3])
    delta = src.delta_bytes([3])
    tree._readers.append(None)  # a reader is drafting from the tree right now
    try:
        r = post_delta(intake, delta)  # answered at once: no wait for the reader
        assert r.status == 200
        assert json.loads(r.body)["sequences"] == 3
        assert tree.sequence_ids() == [1, 2]  # the reader's tree is left as it was
    finally:
        tree._readers.pop()
    new = intake.tree(KEY)
    assert new is not tree
    assert seen == [new]
    assert {s: new.sequence(s) for s in new.sequence_ids()} == {
        s: src.sequence(s) for s in src.sequence_ids()
    }
    assert post_delta(intake, delta).status == 200  # idempotent, now in place
    assert intake.tree(KEY) is new
    assert new.sequence_ids() == [1, 2, 3]
    (listed,) = intake.shards()
    assert (listed.sequences, listed.max_seq) == (3, 3)


def test_delta_beside_readers_over_the_budget_leaves_the_shard():
    src = source_tree(2)
    intake = ShardIntake(max_bytes=None, max_tenant_bytes=None)
    assert put(intake, src.to_bytes()).status == 200
    size = intake.held_bytes()
    # room for the delta's lower bound (so it is applied), not for its exact size
    tight = ShardIntake(max_bytes=size + MIN_TOKEN_BYTES * 499 + 8, max_tenant_bytes=None)
    assert put(tight, src.to_bytes()).status == 200
    tree = tight.tree(KEY)
    src.add(3, list(range(1, 500)))
    tree._readers.append(None)
    try:
        r = post_delta(tight, src.delta_bytes([3]))
    finally:
        tree._readers.pop()
    assert r.status == 507
    assert tight.tree(KEY) is tree
    assert tree.sequence_ids() == [1, 2]


# --- snapshot files ---------------------------------------------------------


def file_request(intake, path, content_type="application/json"):
    body = json.dumps({"path": str(path)}).encode()
    return intake.handle("POST", SNAPSHOT_FILE_PATH, Q, {"Content-Type": content_type}, body)


def test_snapshot_file(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    intake = ShardIntake(shm_dir=shm)
    f = shm / "agentspec-1.ashd"
    f.write_bytes(source_tree(3).to_bytes())
    r = file_request(intake, f)
    assert r.status == 200, r.body
    assert r.json()["sequences"] == 3
    assert intake.tree(KEY).sequence_ids() == [1, 2, 3]
    assert f.exists()  # the sender removes its file


def test_snapshot_file_refusals(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    outside = tmp_path / "outside.ashd"
    outside.write_bytes(source_tree(3).to_bytes())
    (shm / "link.ashd").symlink_to(outside)
    (shm / "sub").mkdir()
    intake = ShardIntake(shm_dir=shm)
    for path in (
        outside,
        shm / "link.ashd",  # a symlink out of the directory
        shm / ".." / "outside.ashd",
        shm / "sub" / ".." / ".." / "outside.ashd",
        shm,
        "/etc/passwd",
    ):
        r = file_request(intake, path)
        assert r.status == 403, path
        assert err_type(r) == "permission_error"
    assert intake.tree(KEY) is None
    # disabled without shm_dir
    f = shm / "ok.ashd"
    f.write_bytes(source_tree(1).to_bytes())
    assert file_request(ShardIntake(), f).status == 403
    # missing / unreadable / malformed
    assert file_request(intake, shm / "missing.ashd").status == 400
    assert file_request(intake, shm / "sub").status == 400
    (shm / "bad.ashd").write_bytes(b"not a shard")
    r = file_request(intake, shm / "bad.ashd")
    assert r.status == 400
    assert err_type(r) == "shard_format_error"
    assert file_request(intake, f, content_type=SHARD_CONTENT_TYPE).status == 415
    for body in (b"{}", b"[]", b"nope", b'{"path": 3}', b'{"path": ""}', b'{"path": "a\\u0000"}'):
        r = intake.handle("POST", SNAPSHOT_FILE_PATH, Q, {}, body)
        assert r.status == 400, body
        assert err_type(r) == "invalid_request_error"
    assert intake.tree(KEY) is None


def test_snapshot_file_symlinked_shm_dir(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    intake = ShardIntake(shm_dir=link)
    (real / "s.ashd").write_bytes(source_tree(2).to_bytes())
    assert file_request(intake, link / "s.ashd").status == 200
    assert file_request(intake, real / "s.ashd").status == 200


# --- the HTTP adapter -------------------------------------------------------


@pytest.fixture
def served():
    intake = ShardIntake(api_key="k", max_body_bytes=4096)
    server, thread = serve_intake(intake)
    try:
        yield intake, server
    finally:
        server.stop(thread)
        assert not thread.is_alive()


AUTH = {"Authorization": "Bearer k"}


def test_http_round_trip_keep_alive(served):
    intake, server = served
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        src = source_tree(3)
        conn.request("PUT", f"{SNAPSHOT_PATH}?{Q}", src.to_bytes(), {**AUTH, **SHARD})
        r = conn.getresponse()
        assert r.status == 200
        assert json.loads(r.read())["sequences"] == 3
        src.add(4, [4])
        conn.request("POST", f"{DELTA_PATH}?{Q}", src.delta_bytes([4]), {**AUTH, **SHARD})
        r = conn.getresponse()
        assert r.status == 200
        assert r.getheader(INSTANCE_HEADER) == intake.instance
        r.read()
        conn.request("GET", SHARDS_PATH, headers=AUTH)
        r = conn.getresponse()
        _, shards = parse_shard_list(r.read())
        assert [(s.key, s.sequences, s.max_seq) for s in shards] == [(KEY, 4, 4)]
        conn.request("DELETE", f"{SHARDS_PATH}?{Q}", headers=AUTH)
        r = conn.getresponse()
        assert r.status == 200
        r.read()
        assert intake.keys() == []
        conn.request("GET", SHARDS_PATH)
        r = conn.getresponse()
        assert r.status == 401
        r.read()
    finally:
        conn.close()


def raw_exchange(port, request: bytes) -> bytes:
    """Send raw bytes, read until the server closes (or 5 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        chunks = []
        while True:
            try:
                c = s.recv(65536)
            except TimeoutError:
                break
            if not c:
                break
            chunks.append(c)
    return b"".join(chunks)


def test_http_oversize_refused_unread(served):
    _, server = served
    # declares 2 MB but sends none of it: answered 413 and closed, without waiting
    req = (
        f"PUT {SNAPSHOT_PATH}?{Q} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
        f"Content-Type: {SHARD_CONTENT_TYPE}\r\nContent-Length: 2000000\r\n\r\n"
    ).encode()
    out = raw_exchange(server.port, req)
    assert out.startswith(b"HTTP/1.1 413")
    assert b"Connection: close" in out
    # unauthenticated: 401 before reading the body
    out = raw_exchange(server.port, req.replace(b"Bearer k", b"Bearer x"))
    assert out.startswith(b"HTTP/1.1 401")


def test_http_small_refused_body_is_drained(served):
    intake, server = served
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        data = source_tree(3).to_bytes()
        conn.request("PUT", f"{SNAPSHOT_PATH}?{Q}", data, {**SHARD, "Authorization": "Bearer x"})
        r = conn.getresponse()
        assert r.status == 401
        r.read()
        # the connection is still usable
        conn.request("PUT", f"{SNAPSHOT_PATH}?{Q}", data, {**SHARD, **AUTH})
        r = conn.getresponse()
        assert r.status == 200
        r.read()
        assert intake.tree(KEY).sequence_ids() == [1, 2, 3]
    finally:
        conn.close()


def test_http_length_required_and_bad_length(served):
    _, server = served
    base = f"POST {DELTA_PATH}?{Q} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
    out = raw_exchange(server.port, (base + "Connection: close\r\n\r\n").encode())
    assert out.startswith(b"HTTP/1.1 411")
    out = raw_exchange(server.port, (base + "Content-Length: -5\r\n\r\n").encode())
    assert out.startswith(b"HTTP/1.1 400")


def test_http_stop_drops_keep_alive_connections():
    intake = ShardIntake()
    server, thread = serve_intake(intake)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("GET", SHARDS_PATH)
        r = conn.getresponse()
        assert r.status == 200
        r.read()
        server.stop(thread)
        assert not thread.is_alive()
        with pytest.raises((http.client.HTTPException, OSError)):  # noqa: PT012
            conn.request("GET", SHARDS_PATH)
            conn.getresponse()
    finally:
        conn.close()
        server.stop(thread)


def test_http_concurrent_pushes(served):
    intake, server = served
    errors = []

    def push(i):
        key = (f"t{i}", None, "s")
        src = source_tree(4, start=10 * i + 1)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        try:
            for sid in src.sequence_ids():
                conn.request(
                    "POST",
                    f"{DELTA_PATH}?{encode_key_query(key)}",
                    src.delta_bytes([sid]),
                    {**AUTH, **SHARD},
                )
                r = conn.getresponse()
                r.read()
                if r.status != 200:
                    errors.append((i, r.status))
        except Exception as e:
            errors.append((i, e))
        finally:
            conn.close()

    threads = [threading.Thread(target=push, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert sorted(intake.keys()) == sorted((f"t{i}", None, "s") for i in range(6))
    for i in range(6):
        assert intake.tree((f"t{i}", None, "s")).sequence_ids() == [10 * i + j for j in range(1, 5)]


def test_bad_constructor_arguments(tmp_path):
    with pytest.raises(InvalidArgumentError, match="max_depth"):
        ShardIntake(max_depth=1)
    with pytest.raises(InvalidArgumentError, match="max_body_bytes"):
        ShardIntake(max_body_bytes=0)
    assert ShardIntake(shm_dir=os.fspath(tmp_path)).shm_dir == tmp_path.resolve()


@pytest.mark.parametrize("kind", [np.int32, np.int64, np.uint16, np.uint32], ids=repr)
def test_integer_arguments_accept_numpy_integers(kind):
    """max_depth and max_body_bytes accept numpy integers, kept as plain ints."""
    intake = ShardIntake(max_depth=kind(16), max_body_bytes=kind(4096))
    assert (intake.max_depth, intake.max_body_bytes) == (16, 4096)
    assert type(intake.max_depth) is int
    assert type(intake.max_body_bytes) is int
    tree = SuffixTree(16)
    tree.add(1, [1, 2, 3])
    assert intake._build(tree.to_bytes()).sequence(1) == [1, 2, 3]


@pytest.mark.parametrize("value", [True, np.True_, 16.0, "16"], ids=repr)
def test_integer_arguments_refuse_bool_and_non_integers(value):
    """bool and non-integers raise TypeError naming the argument."""
    name = "bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__
    for kw in ("max_depth", "max_body_bytes"):
        with pytest.raises(TypeError, match=f"^{kw} must be an int, not {name}$"):
            ShardIntake(**{kw: value})


def test_push_counts_by_result_and_status():
    intake = ShardIntake(api_key="sekrit")
    ok = {**SHARD, "authorization": "Bearer sekrit"}
    assert put(intake, source_tree(1).to_bytes(), headers=ok).status == 200
    assert put(intake, source_tree(1).to_bytes(), headers=SHARD).status == 401
    assert put(intake, b"junk", headers=ok).status == 400
    assert intake.handle("GET", SHARDS_PATH, "", ok, b"").status == 200  # not a push
    assert intake.push_counts() == {
        ("accepted", "200"): 1,
        ("refused", "401"): 1,
        ("refused", "400"): 1,
    }
