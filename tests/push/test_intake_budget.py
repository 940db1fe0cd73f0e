"""Memory budgets of `ShardIntake`: the review's "pushed shards have no memory budget".

1. a push that would take a tenant over its budget gets 507 and changes
   nothing; other tenants are unaffected; the total budget holds across
   tenants; the accounting equals the trees' live bytes exactly;
2. a snapshot that cannot fit is refused from its header, before anything is
   built (the lower bound never exceeds a real tree); one that fails only the
   exact check is built, then dropped (the library's allocated bytes come
   back); builds in flight reserve their lower bound;
3. deltas: refused from the header when they only add, undone when they do
   not fit after applying; a retried delta at a full budget is still a no-op;
4. the review's scenario (12 snapshots of 4 MB, pushed over HTTP) stays
   within the budget; GET shards reports the bytes and refusals; the pusher
   treats 507 as final for that key and goes on with the others.
"""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from build_spy import BuildSpy
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec import ShardIntake, ShardPusher, ShardStore, SuffixTree, serve_intake
from agentspec._core import lowlevel
from agentspec._core.budget import (
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_MAX_TENANT_SHARD_BYTES,
    format_bytes,
    live_bytes,
    min_tree_bytes,
    parse_byte_size,
    shard_token_count,
)
from agentspec._push.wire import (
    DEFAULT_MAX_BODY_BYTES,
    DELTA_PATH,
    SHARD_CONTENT_TYPE,
    SHARDS_PATH,
    SNAPSHOT_FILE_PATH,
    SNAPSHOT_PATH,
    encode_key_query,
    parse_error,
)
from agentspec.exceptions import InvalidArgumentError

SHARD = {"Content-Type": SHARD_CONTENT_TYPE}


def put(intake: ShardIntake, body: bytes, key: tuple[str, str | None, str | None]) -> Any:
    return intake.handle("PUT", SNAPSHOT_PATH, encode_key_query(key), SHARD, body)


def post_delta(intake: ShardIntake, body: bytes, key: tuple[str, str | None, str | None]) -> Any:
    return intake.handle("POST", DELTA_PATH, encode_key_query(key), SHARD, body)


def tokens(n: int, seed: int, vocab: int = 32000) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n, dtype=np.int32)


def snapshot(n_seqs: int = 4, length: int = 500, seed: int = 0, depth: int = 64) -> bytes:
    """Snapshot bytes of random sequences (ids 1..n_seqs)."""
    with SuffixTree(depth) as t:
        for i in range(n_seqs):
            t.add(i + 1, tokens(length, seed * 1000 + i))
        return t.to_bytes()


def built_size(data: bytes) -> int:
    """Live bytes of the tree these snapshot bytes build."""
    with SuffixTree.from_bytes(data) as t:
        return live_bytes(t.stats())


def floor_of(data: bytes) -> int:
    """The intake's lower bound for these shard bytes."""
    _, _, n_seq, n_rem = lowlevel.shard_peek(data)
    return min_tree_bytes(n_seq, shard_token_count(len(data), n_seq, n_rem))


def refused(resp: Any) -> str:
    """The message of a 507 insufficient_storage answer."""
    assert resp.status == 507, resp.body[:300]
    kind, message = parse_error(resp.body)
    assert kind == "insufficient_storage"
    return message


def assert_exact(intake: ShardIntake) -> None:
    """The intake's accounting equals its trees' live bytes, per tenant and in total."""
    per_tenant: dict[str, int] = {}
    keys = intake.keys()
    for key in keys:
        tree = intake.tree(key)
        assert tree is not None
        per_tenant[key[0]] = per_tenant.get(key[0], 0) + live_bytes(tree.stats())
    assert intake.held_bytes() == sum(per_tenant.values())
    for tenant, held in per_tenant.items():
        assert intake.held_bytes(tenant) == held
    budget = intake.budget()
    assert budget["bytes"] == intake.held_bytes()
    assert {t: v["bytes"] for t, v in budget["tenants"].items() if v["shards"]} == per_tenant


# --- sizes and defaults ---------------------------------------------------------------


def test_defaults_are_the_documented_ones() -> None:
    intake = ShardIntake()
    assert intake.max_bytes == DEFAULT_MAX_SHARD_BYTES == 1 << 30
    assert intake.max_tenant_bytes == DEFAULT_MAX_TENANT_SHARD_BYTES == 256 << 20
    assert intake.max_body_bytes == DEFAULT_MAX_BODY_BYTES == 32 << 20
    unbounded = ShardIntake(max_bytes=None, max_tenant_bytes=None)
    assert not unbounded.budgeted
    assert ShardIntake(max_bytes="512MiB", max_tenant_bytes="64m").max_tenant_bytes == 64 << 20


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1GiB", 1 << 30),
        ("256MiB", 256 << 20),
        ("256M", 256 << 20),
        ("64 mb", 64 << 20),
        ("1.5G", 3 << 29),
        ("4096", 4096),
        ("0", 0),
        ("none", None),
        ("off", None),
        (None, None),
        (1234, 1234),
        (np.int64(7), 7),
    ],
)
def test_parse_byte_size(text: Any, value: int | None) -> None:
    assert parse_byte_size(text) == value


@pytest.mark.parametrize("bad", ["lots", "1 parsec", "-5", "1e9", ""])
def test_parse_byte_size_refuses_non_sizes(bad: str) -> None:
    if bad == "":
        assert parse_byte_size(bad) is None  # empty: no budget
        return
    with pytest.raises(InvalidArgumentError, match="byte count"):
        parse_byte_size(bad)


def test_bad_budget_arguments() -> None:
    with pytest.raises(InvalidArgumentError):
        ShardIntake(max_bytes=-1)
    with pytest.raises(TypeError):
        ShardIntake(max_tenant_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        ShardIntake(max_tenant_bytes="much")
    assert format_bytes(256 << 20) == "256 MiB"
    assert format_bytes(3 << 29) == "1.5 GiB"
    assert format_bytes(900) == "900 bytes"


# --- the lower bound ------------------------------------------------------------------


def _kinds() -> dict[str, bytes]:
    out = {}
    with SuffixTree(64) as t:
        for i in range(200):
            t.add(i, [7] * 50)
        out["constant"] = t.to_bytes()
    with SuffixTree(64) as t:
        for i in range(2000):
            t.add(i, [])
        out["empty sequences"] = t.to_bytes()
    with SuffixTree(64) as t:
        for i in range(2000):
            t.add(i, [5])
        out["one-token sequences"] = t.to_bytes()
    with SuffixTree(64) as t:
        t.add(1, [3] * 200_000)
        out["one long repetitive sequence"] = t.to_bytes()
    out["random"] = snapshot(20, 1000)
    out["random depth 2"] = snapshot(20, 1000, depth=2)
    out["random depth 1024"] = snapshot(2, 2000, depth=1024)
    with SuffixTree(64) as t:
        out["empty tree"] = t.to_bytes()
    return out


@pytest.mark.parametrize(("name", "data"), list(_kinds().items()))
def test_lower_bound_never_exceeds_a_built_tree(name: str, data: bytes) -> None:
    """The early refusal only refuses shards that could never fit."""
    assert floor_of(data) <= built_size(data), name


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5), max_size=40), max_size=30),
    st.sampled_from([2, 3, 16, 64]),
)
def test_lower_bound_property(seqs: list[list[int]], depth: int) -> None:
    with SuffixTree(depth) as t:
        for i, s in enumerate(seqs):
            t.add(i, s)
        data = t.to_bytes()
        assert floor_of(data) <= live_bytes(t.stats())
    assert floor_of(data) <= built_size(data)


# --- 1. tenant and total budgets ----------------------------------------------------


def test_tenant_over_budget_gets_507_and_other_tenants_are_unaffected() -> None:
    data = snapshot()
    size = built_size(data)
    intake = ShardIntake(max_tenant_bytes=3 * size + size // 2, max_bytes=None)
    for i in range(3):
        assert put(intake, data, ("acme", "p", f"s{i}")).status == 200
    held = intake.keys()
    before = {k: intake.tree(k) for k in held}
    msg = refused(put(intake, data, ("acme", "p", "s3")))
    assert "'acme'" in msg
    assert "max_tenant_shard_bytes" in msg
    assert format_bytes(3 * size + size // 2) in msg
    assert intake.keys() == held
    assert {k: intake.tree(k) for k in held} == before  # nothing changed
    # replacing one of acme's shards by one of the same size still fits
    assert put(intake, data, ("acme", "p", "s0")).status == 200
    # another tenant pushes as if acme did not exist
    for i in range(3):
        assert put(intake, data, ("globex", None, f"s{i}")).status == 200
    budget = intake.budget()
    assert budget["tenants"]["acme"]["refused"] == 1
    assert budget["tenants"]["globex"]["refused"] == 0
    assert budget["tenants"]["globex"]["shards"] == 3
    assert budget["refused"] == 1
    assert intake.held_bytes("acme") <= intake.max_tenant_bytes  # type: ignore[operator]
    assert_exact(intake)
    # deleting frees the room
    r = intake.handle("DELETE", SHARDS_PATH, encode_key_query(("acme", "p", "s1")), {}, b"")
    assert r.status == 200
    assert put(intake, data, ("acme", "p", "s3")).status == 200
    assert_exact(intake)


def test_total_budget_holds_across_tenants() -> None:
    data = snapshot(seed=1)
    size = built_size(data)
    intake = ShardIntake(max_bytes=5 * size + size // 2, max_tenant_bytes=None)
    statuses = []
    for i in range(8):
        statuses.append(put(intake, data, (f"tenant{i}", None, "S")).status)
        assert intake.held_bytes() <= intake.max_bytes  # type: ignore[operator]
    assert statuses == [200] * 5 + [507] * 3
    msg = refused(put(intake, data, ("tenant9", None, "S")))
    assert "max_shard_bytes" in msg
    assert "total budget" in msg
    assert intake.budget()["refused"] == 4
    assert_exact(intake)


def test_no_budget_takes_everything() -> None:
    data = snapshot(seed=2)
    intake = ShardIntake(max_bytes=None, max_tenant_bytes=None)
    for i in range(4):
        assert put(intake, data, ("acme", None, f"s{i}")).status == 200
    assert intake.budget()["refused"] == 0
    assert_exact(intake)  # still accounted, for GET shards


# --- 2. snapshots: early refusal, exact check, reservations -------------------------


def test_snapshot_that_cannot_fit_is_refused_from_its_header(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data = snapshot(8, 5000)
    intake = ShardIntake(max_tenant_bytes=floor_of(data) - 1, vocab_size=1 << 20, shm_dir=tmp_path)
    spy = BuildSpy(monkeypatch)
    before = lowlevel.allocated_bytes()
    msg = refused(put(intake, data, ("acme", None, "S")))
    assert "at least" in msg
    (tmp_path / "snap.bin").write_bytes(data)
    body = json.dumps({"path": str(tmp_path / "snap.bin")}).encode()
    r = intake.handle(
        "POST",
        SNAPSHOT_FILE_PATH,
        encode_key_query(("acme", None, "S")),
        {"Content-Type": "application/json"},
        body,
    )
    refused(r)
    assert spy.calls == []  # no tree built, not even the vocabulary pass
    assert lowlevel.allocated_bytes() == before
    assert intake.keys() == []
    assert intake.budget()["tenants"]["acme"]["refused"] == 2


def test_snapshot_failing_the_exact_check_is_built_then_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = snapshot(8, 5000)
    size = built_size(data)
    assert floor_of(data) < size
    intake = ShardIntake(max_tenant_bytes=(floor_of(data) + size) // 2)
    built: list[SuffixTree] = []
    real = SuffixTree.from_bytes.__func__  # type: ignore[attr-defined]

    def recording(cls: type, raw: Any) -> SuffixTree:
        tree = real(cls, raw)
        built.append(tree)
        return tree

    monkeypatch.setattr(SuffixTree, "from_bytes", classmethod(recording))
    before = lowlevel.allocated_bytes()
    msg = refused(put(intake, data, ("acme", None, "S")))
    assert "at least" not in msg  # the exact size, measured
    assert len(built) == 1
    assert built[0].closed  # dropped at once, not left to the garbage collector
    assert intake._reserved == 0
    assert lowlevel.allocated_bytes() == before
    assert intake.keys() == []
    assert intake.held_bytes() == 0


def test_builds_in_flight_reserve_their_lower_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two snapshots that cannot both fit: while the first is being built the
    second is refused from its header, without a build of its own."""
    with SuffixTree(64) as t:  # repetitive text: a tree barely larger than its floor
        for i in range(8):
            t.add(i, [7] * 20_000)
        data = t.to_bytes()
    floor = floor_of(data)
    assert built_size(data) < 1.5 * floor
    intake = ShardIntake(max_tenant_bytes=built_size(data) + floor // 2)
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []
    real = SuffixTree.from_bytes.__func__  # type: ignore[attr-defined]

    def gated(cls: type, raw: Any) -> SuffixTree:
        calls.append(len(raw))
        entered.set()
        assert release.wait(30)
        return real(cls, raw)

    monkeypatch.setattr(SuffixTree, "from_bytes", classmethod(gated))
    out: list[Any] = []
    first = threading.Thread(target=lambda: out.append(put(intake, data, ("acme", None, "A"))))
    first.start()
    try:
        assert entered.wait(10)
        msg = refused(put(intake, data, ("acme", None, "B")))
        assert "at least" in msg
        assert len(calls) == 1
    finally:
        release.set()
    first.join(30)
    assert out[0].status == 200
    assert intake.keys() == [("acme", None, "A")]
    assert intake.budget()["tenants"]["acme"]["refused"] == 1
    assert intake._reserved == 0  # released by the swap
    assert_exact(intake)


# --- 3. deltas --------------------------------------------------------------------------


def _source(n: int, length: int = 500) -> SuffixTree:
    t = SuffixTree(64)
    for i in range(n):
        t.add(i + 1, tokens(length, 100 + i))
    return t


def test_delta_that_only_adds_is_refused_from_its_header(monkeypatch: pytest.MonkeyPatch) -> None:
    src = _source(4)
    key = ("acme", None, "S")
    intake = ShardIntake()
    assert put(intake, src.to_bytes(), key).status == 200
    held = intake.held_bytes()
    src.add(10, tokens(50_000, 7))
    delta = src.delta_bytes([10])
    intake.max_tenant_bytes = held + 4 * 50_000 - 1  # below even 4 bytes per new token
    spy = BuildSpy(monkeypatch)
    msg = refused(post_delta(intake, delta, key))
    assert "at least" in msg
    assert "tree_load" not in spy.calls
    tree = intake.tree(key)
    assert tree is not None
    assert tree.sequence_ids() == [1, 2, 3, 4]
    assert intake.held_bytes() == held
    # a delta to a missing shard that cannot fit creates nothing
    refused(post_delta(intake, delta, ("acme", None, "T")))
    assert intake.tree(("acme", None, "T")) is None


def test_delta_over_budget_after_applying_is_undone() -> None:
    src = _source(4)
    key = ("acme", None, "S")
    intake = ShardIntake()
    assert put(intake, src.to_bytes(), key).status == 200
    tree = intake.tree(key)
    assert tree is not None
    contents = {sid: tree.sequence(sid) for sid in tree.sequence_ids()}
    held = intake.held_bytes()
    src.remove(2)  # the delta removes a sequence: only its exact size can decide
    src.add(10, tokens(20_000, 8))
    delta = src.delta_bytes([10], [2])
    intake.max_tenant_bytes = held + 4 * 20_000 + 1000  # passes the floor, not the tree
    msg = refused(post_delta(intake, delta, key))
    assert "at least" not in msg
    # undone, and rebuilt compact (the undo leaves the removed tokens referenced)
    tree = intake.tree(key)
    assert tree is not None
    assert sorted(tree.sequence_ids()) == [1, 2, 3, 4]
    assert {sid: tree.sequence(sid) for sid in tree.sequence_ids()} == contents
    tree.check()
    assert_exact(intake)
    assert intake.held_bytes() <= held
    listed = json.loads(intake.handle("GET", SHARDS_PATH, "", {}, b"").body)["shards"]
    assert [(s["sequences"], s["max_seq"]) for s in listed] == [(4, 4)]
    # with room, the same delta applies
    intake.max_tenant_bytes = None
    assert post_delta(intake, delta, key).status == 200
    assert sorted(tree.sequence_ids()) == [1, 3, 4, 10]
    assert_exact(intake)


def test_retried_delta_at_a_full_budget_is_still_accepted() -> None:
    src = _source(3)
    key = ("acme", None, "S")
    intake = ShardIntake()
    assert put(intake, src.to_bytes(), key).status == 200
    src.add(9, tokens(400, 9))
    delta = src.delta_bytes([9])
    assert post_delta(intake, delta, key).status == 200
    intake.max_tenant_bytes = intake.held_bytes()  # full to the byte
    assert post_delta(intake, delta, key).status == 200  # nothing new: no refusal
    tree = intake.tree(key)
    assert tree is not None
    assert tree.sequence_ids() == [1, 2, 3, 9]
    assert_exact(intake)


# --- 4. the review's scenario, HTTP, counters, pusher ---------------------------------


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_twelve_4mb_snapshots_stay_within_the_budget() -> None:
    """The review pushed 12 snapshots of 4 MB and the worker grew by 740 MB
    (15.4x the bytes sent).  With the default budgets one tenant holds at
    most 256 MiB; the rest is refused with 507."""
    with SuffixTree(64) as t:
        for i in range(4):
            t.add(i + 1, tokens(250_000, 50 + i))
        data = t.to_bytes()
    assert len(data) > 4_000_000
    intake = ShardIntake()
    server, thread = serve_intake(intake)
    rss_before = _rss()
    statuses = []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        for i in range(12):
            query = encode_key_query(("acme", "etl", f"stage{i}"))
            conn.request("PUT", f"{SNAPSHOT_PATH}?{query}", body=data, headers=SHARD)
            resp = conn.getresponse()
            resp.read()
            statuses.append(resp.status)
            assert intake.held_bytes("acme") <= DEFAULT_MAX_TENANT_SHARD_BYTES
        conn.request("GET", SHARDS_PATH)
        listing = json.loads(conn.getresponse().read())
        conn.close()
    finally:
        server.stop(thread)
    accepted = statuses.count(200)
    assert accepted >= 1
    assert statuses == [200] * accepted + [507] * (12 - accepted)
    budget = listing["budget"]
    assert budget["tenants"]["acme"] == {
        "bytes": intake.held_bytes("acme"),
        "shards": accepted,
        "refused": 12 - accepted,
    }
    assert budget["bytes"] <= budget["max_tenant_bytes"] == 256 << 20
    assert_exact(intake)
    # loosely: the process grew by what is held plus transient builds, not 12 trees
    assert _rss() - rss_before < 2 * DEFAULT_MAX_TENANT_SHARD_BYTES


def test_oversized_body_is_413_naming_the_cap() -> None:
    intake = ShardIntake(max_body_bytes=1000)
    r = put(intake, snapshot(2, 500), ("acme", None, "S"))
    assert r.status == 413
    kind, message = parse_error(r.body)
    assert kind == "payload_too_large"
    assert "max_body_bytes" in message
    assert intake.budget()["too_large"] == 1


def test_extra_stats_appear_in_the_shard_list() -> None:
    intake = ShardIntake()
    intake.add_stats("learned", lambda: {"bytes": 5})
    intake.add_stats("broken", lambda: 1 / 0)
    obj = json.loads(intake.handle("GET", SHARDS_PATH, "", {}, b"").body)
    assert obj["learned"] == {"bytes": 5}
    assert "broken" not in obj
    assert obj["budget"]["max_bytes"] == 1 << 30


def test_pusher_takes_507_as_final_for_the_key_and_pushes_the_others() -> None:
    small = ("small", None, "S")
    big = ("big", None, "S")
    arrived = threading.Event()
    intake = ShardIntake(max_tenant_bytes=200_000)
    intake.add_listener(lambda key, tree: arrived.set() if key == small else None)
    server, thread = serve_intake(intake)
    store = ShardStore()
    pusher = ShardPusher(store, [server.url])
    try:
        store.learn(big, [int(t) for t in tokens(60_000, 3)])  # ~4 MB as a tree
        store.learn(small, [1, 2, 3, 4])
        # "big" was learned first, so it was pushed (and refused) before "small".
        assert arrived.wait(30)
        status = next(iter(pusher.status().values()))
        assert status.errors == 1
        assert "507" in (status.last_error or "")
        assert status.retries == 0  # not retried: 507 is not transient
        assert big not in status.acked
        assert intake.keys() == [small]
        assert intake.budget()["tenants"]["big"]["refused"] == 1
    finally:
        pusher.close()
        store.close()
        server.stop(thread)
