"""Bad input of every kind gives the documented exception, never a crash.

After every rejected call the tree must be exactly as before (same sequences,
counts and stats) and still usable.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import build_counts

from agentspec import BatchDrafter, Cursor, DraftParams, SuffixTree, draft_batch
from agentspec._core.lowlevel import ffi, lib
from agentspec.exceptions import (
    AgentSpecError,
    CapacityError,
    DepthMismatchError,
    InvalidArgumentError,
    InvalidTokenError,
    SequenceClosedError,
    SequenceExistsError,
    SequenceNotFoundError,
    ShardChecksumError,
    ShardFormatError,
    ShardTruncatedError,
    ShardVersionError,
    TreeClosedError,
)

DEPTH = 6
SEQS = {1: [1, 2, 3, 1, 2, 4], -5: [2**31 - 1, 0, 2**31 - 1], 2**62: [7, 7, 7, 7]}
OPEN_ID = 99
OPEN_TOKENS = [1, 2, 9]

BAD_TOKENS: list[Any] = [-1, 2**31, 2**63, -(2**63) - 1, 2**64]
NOT_INT_TOKENS: list[Any] = [1.0, None, "1", 2.5, [1]]
BAD_IDS: list[Any] = [2**63, -(2**63) - 1, 2**64]
NOT_INT_IDS: list[Any] = [1.5, None, "3", (1,)]


def make_tree() -> SuffixTree:
    """A small tree with closed sequences and one open sequence."""
    tree = SuffixTree(DEPTH)
    for sid, toks in SEQS.items():
        tree.add(sid, toks)
    tree.append(OPEN_ID, OPEN_TOKENS)
    return tree


def state(tree: SuffixTree) -> tuple[Any, ...]:
    """Everything observable about a tree: ids, tokens, stats and all counts."""
    ids = tree.sequence_ids()
    seqs = [tree.sequence(i) for i in ids]
    counts = build_counts(seqs, tree.max_depth)
    probes = {k: tree.count(list(k)) for k in counts}
    return ids, seqs, tree.stats(), probes


@pytest.fixture
def tree() -> Iterator[SuffixTree]:
    """A fresh small tree, checked to be unchanged-and-usable by each test."""
    t = make_tree()
    yield t
    t.check()
    t.add(123456, [5, 6, 5, 6])  # still usable
    assert t.count([5, 6]) == 2
    t.close()


def assert_rejected(tree: SuffixTree, exc: Any, call: Callable[[], object]) -> None:
    """call() raises exc and leaves the tree exactly as it was."""
    before = state(tree)
    with pytest.raises(exc):
        call()
    assert state(tree) == before
    tree.check()


# --- tokens -------------------------------------------------------------------


@pytest.mark.parametrize("bad", BAD_TOKENS)
def test_out_of_range_tokens(tree: SuffixTree, bad: int) -> None:
    """Tokens < 0 or > 2**31-1 raise InvalidTokenError everywhere, changing nothing."""
    assert_rejected(tree, InvalidTokenError, lambda: tree.add(500, [1, bad, 2]))
    assert_rejected(tree, InvalidTokenError, lambda: tree.append(500, [1, 2, bad]))
    assert_rejected(tree, InvalidTokenError, lambda: tree.append(OPEN_ID, [4, bad]))
    assert_rejected(tree, InvalidTokenError, lambda: tree.count([1, bad]))
    assert_rejected(tree, InvalidTokenError, lambda: tree.draft([1, 2, bad]))
    assert 500 not in tree
    assert tree.sequence(OPEN_ID) == OPEN_TOKENS
    with Cursor(DEPTH) as cur:
        cur.extend([1, 2])
        with pytest.raises(InvalidTokenError):
            cur.extend([3, bad])
        assert len(cur) == 2
    with pytest.raises(InvalidTokenError):
        Cursor(DEPTH, prompt=[bad])


def test_invalid_token_is_value_error(tree: SuffixTree) -> None:
    """InvalidTokenError is a ValueError and an AgentSpecError."""
    with pytest.raises(ValueError, match=r".") as info:
        tree.add(500, [-1])
    assert isinstance(info.value, AgentSpecError)


@pytest.mark.parametrize("bad", NOT_INT_TOKENS)
def test_non_int_tokens(tree: SuffixTree, bad: Any) -> None:
    """A non-int element raises TypeError, changing nothing."""
    assert_rejected(tree, TypeError, lambda: tree.add(500, [1, bad]))
    assert_rejected(tree, TypeError, lambda: tree.append(OPEN_ID, [bad]))
    assert_rejected(tree, TypeError, lambda: tree.count([bad]))
    assert_rejected(tree, TypeError, lambda: tree.draft([1, bad]))
    with Cursor(DEPTH) as cur, pytest.raises(TypeError):
        cur.extend([bad])


def test_non_sequence_tokens(tree: SuffixTree) -> None:
    """Something that is not a token sequence at all raises TypeError."""
    bad: Any
    for bad in (None, 5, 1.5):
        assert_rejected(tree, TypeError, functools.partial(tree.add, 500, bad))
        assert_rejected(tree, TypeError, functools.partial(tree.count, bad))


BAD_ARRAYS = [
    np.array([1, 2, 3], dtype=np.int64),
    np.array([1, 2, 3], dtype=np.uint32),
    np.array([1.0, 2.0], dtype=np.float32),
    np.array([[1, 2], [3, 4]], dtype=np.int32),
    np.array(5, dtype=np.int32),
]


@pytest.mark.parametrize("arr", BAD_ARRAYS, ids=lambda a: f"{a.dtype}-{a.ndim}d")
def test_wrong_numpy_arrays(tree: SuffixTree, arr: np.ndarray[Any, Any]) -> None:
    """A numpy array of another dtype or shape raises TypeError or InvalidArgumentError."""
    bad = (TypeError, InvalidArgumentError)
    assert_rejected(tree, bad, lambda: tree.add(500, arr))
    assert_rejected(tree, bad, lambda: tree.append(OPEN_ID, arr))
    assert_rejected(tree, bad, lambda: tree.count(arr))
    assert_rejected(tree, bad, lambda: tree.draft(arr))
    with Cursor(DEPTH) as cur, pytest.raises(bad):
        cur.extend(arr)


def test_non_contiguous_array(tree: SuffixTree) -> None:
    """A strided int32 view raises TypeError (it cannot be read in place), changing nothing."""
    view = np.array([1, 100, 2, 100, 3, 100], dtype=np.int32)[::2]
    assert_rejected(tree, TypeError, lambda: tree.add(500, view))
    assert_rejected(tree, TypeError, lambda: tree.count(view))
    with Cursor(DEPTH) as cur, pytest.raises(TypeError):
        cur.extend(view)


def test_numpy_negative_token(tree: SuffixTree) -> None:
    """A negative value inside a valid int32 array raises InvalidTokenError."""
    arr = np.array([1, -7, 2], dtype=np.int32)
    assert_rejected(tree, InvalidTokenError, lambda: tree.add(500, arr))
    assert_rejected(tree, InvalidTokenError, lambda: tree.append(OPEN_ID, arr))


def test_numpy_int32_is_accepted(tree: SuffixTree) -> None:
    """A valid 1-D int32 array works and equals the list form."""
    arr = np.array([1, 2, 3, 1, 2, 5], dtype=np.int32)
    tree.add(500, arr)
    assert tree.sequence(500) == arr.tolist()
    assert tree.count(np.array([1, 2], dtype=np.int32)) == tree.count([1, 2]) == 5


def test_empty_sequences(tree: SuffixTree) -> None:
    """Empty sequences and empty appends are allowed and change no counts."""
    before = state(tree)[3]
    tree.add(500, [])
    tree.append(501, [])
    tree.append(OPEN_ID, [])
    assert 500 in tree
    assert 501 in tree
    assert tree.sequence(500) == []
    assert state(tree)[3] == before
    assert tree.draft([]).token_ids == []
    assert tree.draft([]).source == "none"


def test_count_of_empty_or_too_long_string(tree: SuffixTree) -> None:
    """count() of a string longer than max_depth is 0; the empty string is 0 or refused."""
    assert tree.count([7] * (DEPTH + 1)) == 0
    assert tree.count([7] * 4) == 1
    try:
        empty = tree.count([])
    except InvalidArgumentError:
        pass
    else:
        assert empty == 0


# --- sequence ids ---------------------------------------------------------------


@pytest.mark.parametrize("bad", BAD_IDS)
def test_out_of_range_ids(tree: SuffixTree, bad: int) -> None:
    """Seq ids outside int64 are refused with a clear exception, changing nothing."""
    exc = (InvalidArgumentError, CapacityError, OverflowError)
    assert_rejected(tree, exc, lambda: tree.add(bad, [1]))
    assert_rejected(tree, exc, lambda: tree.append(bad, [1]))
    assert_rejected(tree, exc, lambda: tree.remove(bad))
    assert bad not in tree


@pytest.mark.parametrize("bad", NOT_INT_IDS)
def test_non_int_ids(tree: SuffixTree, bad: Any) -> None:
    """A seq id that is not an int raises TypeError."""
    assert_rejected(tree, TypeError, lambda: tree.add(bad, [1]))
    assert_rejected(tree, TypeError, lambda: tree.append(bad, [1]))
    assert_rejected(tree, TypeError, lambda: tree.remove(bad))


def test_sequence_state_errors(tree: SuffixTree) -> None:
    """Existing, missing and closed sequences raise their specific errors."""
    assert_rejected(tree, SequenceExistsError, lambda: tree.add(1, [4, 4]))
    assert_rejected(tree, SequenceExistsError, lambda: tree.add(OPEN_ID, [4]))
    assert_rejected(tree, SequenceNotFoundError, lambda: tree.remove(424242))
    assert_rejected(tree, SequenceNotFoundError, lambda: tree.close_sequence(424242))
    assert_rejected(tree, SequenceNotFoundError, lambda: tree.sequence(424242))
    assert_rejected(tree, SequenceClosedError, lambda: tree.append(1, [4]))
    tree.close_sequence(OPEN_ID)
    tree.close_sequence(OPEN_ID)  # closing a closed sequence is fine
    assert_rejected(tree, SequenceClosedError, lambda: tree.append(OPEN_ID, [4]))
    assert isinstance(SequenceNotFoundError("x"), KeyError)


@pytest.mark.parametrize("depth", [0, 1, -1, 1025, 2**32 + 8, 2**70])
def test_bad_max_depth(depth: int) -> None:
    """max_depth outside [2, 1024] raises InvalidArgumentError (trees and cursors)."""
    with pytest.raises(InvalidArgumentError):
        SuffixTree(depth)
    with pytest.raises(InvalidArgumentError):
        Cursor(depth)


@pytest.mark.parametrize("depth", [8.0, "8", None])
def test_non_int_max_depth(depth: Any) -> None:
    """A max_depth that is not an int raises TypeError."""
    with pytest.raises(TypeError):
        SuffixTree(depth)


def test_closed_tree_and_cursor() -> None:
    """Any use after close() raises TreeClosedError; close() twice is fine."""
    t = make_tree()
    t.close()
    t.close()
    assert t.closed
    for call in (
        lambda: t.add(5, [1]),
        lambda: t.count([1]),
        lambda: t.draft([1]),
        lambda: t.stats(),
        lambda: t.to_bytes(),
    ):
        with pytest.raises(TreeClosedError):
            call()
    cur = Cursor(DEPTH)
    cur.close()
    cur.close()
    with pytest.raises(TreeClosedError):
        cur.extend([1])
    with pytest.raises(TreeClosedError):
        cur.draft(None)
    with Cursor(DEPTH, prompt=[1, 2]) as live, pytest.raises(TreeClosedError):
        live.draft(t)  # a closed global tree


# --- draft parameters -------------------------------------------------------------

BAD_PARAMS: list[dict[str, Any]] = [
    {"max_spec_tokens": 0},
    {"max_spec_tokens": -1},
    {"max_spec_tokens": 1025},
    {"max_spec_tokens": 2**40},
    {"alpha": math.nan},
    {"alpha": -1.0},
    {"offset": math.nan},
    {"min_token_prob": -0.1},
    {"min_token_prob": math.nan},
    {"min_score": math.nan},
    {"max_pattern": -1},
    {"min_pattern": -1},
    {"max_pattern": 2**40},
    {"min_token_prob": 1.5},
    {"offset": math.inf},
    {"min_pattern": 3, "max_pattern": 2},
]


@pytest.mark.parametrize("bad", BAD_PARAMS, ids=lambda d: repr(d))
def test_bad_params(tree: SuffixTree, bad: dict[str, Any]) -> None:
    """Out-of-range parameters raise InvalidArgumentError (at construction or draft)."""
    with pytest.raises(InvalidArgumentError):
        tree.draft([1, 2], DraftParams(**bad))
    with pytest.raises(InvalidArgumentError):
        tree.draft([1, 2], **bad)
    with Cursor(DEPTH, prompt=[1, 2]) as cur:
        with pytest.raises(InvalidArgumentError):
            cur.draft(tree, DraftParams(**bad))
        with pytest.raises(InvalidArgumentError):
            BatchDrafter(DraftParams(**bad)).draft([(cur, tree, [1])])
        assert len(cur) == 2  # the rejected batch appended nothing


def test_unknown_param_override(tree: SuffixTree) -> None:
    """An unknown keyword override raises TypeError."""
    with pytest.raises(TypeError):
        tree.draft([1, 2], max_spec=4)


def test_huge_context_is_fine(tree: SuffixTree) -> None:
    """A context far longer than max_depth drafts like its last max_depth tokens."""
    long_ctx = [0] * 10_000 + [1, 2]
    assert tree.draft(long_ctx) == tree.draft([1, 2])


# --- batches ----------------------------------------------------------------------


def test_batch_bad_items(tree: SuffixTree) -> None:
    """Malformed batch items raise clear errors; a bad token changes no cursor."""
    with Cursor(DEPTH, prompt=[1]) as a, Cursor(DEPTH, prompt=[1]) as b:
        with pytest.raises(InvalidTokenError):
            draft_batch([(a, tree, [2]), (b, tree, [2, -1])])
        assert len(b) == 1
        with pytest.raises(TypeError):
            draft_batch([(a, "tree", None)])  # type: ignore[list-item]
        with pytest.raises((TypeError, ValueError)):
            draft_batch([(a,)])  # type: ignore[list-item]
        with pytest.raises(InvalidArgumentError):
            draft_batch([(a, tree, None), (a, tree, None)])  # same cursor twice
        with pytest.raises((InvalidArgumentError, CapacityError)):
            BatchDrafter(max_batch=1).draft([(a, tree, None), (b, tree, None)])
        for bad_threads in (-1, 0, 10**6):
            with pytest.raises(InvalidArgumentError):
                draft_batch([(a, tree, None)], threads=bad_threads)
        assert draft_batch([]) == []


# --- shards -----------------------------------------------------------------------

HEADER = 48


def small_shard() -> bytes:
    """A small valid snapshot (closed and open sequences)."""
    t = make_tree()
    with t:
        return t.to_bytes()


def test_shard_layout_is_as_documented() -> None:
    """The header is magic, version, kind, max_depth, reserved, counts, payload size, checksum."""
    blob = small_shard()
    assert blob[:4] == b"ASHD"
    kind, depth, reserved, n_seq, n_rem, payload = struct.unpack_from("<HIIQQQ", blob, 6)
    assert (kind, depth, reserved, n_seq, n_rem) == (0, DEPTH, 0, len(SEQS) + 1, 0)
    assert payload == len(blob) - HEADER
    n_tokens = sum(map(len, SEQS.values())) + len(OPEN_TOKENS)
    assert payload == 12 * n_seq + 4 * n_tokens


def _check_rejects(blob: bytes, exc: Any = ShardFormatError) -> None:
    """from_bytes and load (into empty and non-empty trees) all refuse blob."""
    with pytest.raises(exc):
        SuffixTree.from_bytes(blob)
    with SuffixTree(DEPTH) as empty:
        assert_rejected(empty, exc, lambda: empty.load(blob))
        assert len(empty) == 0
    with make_tree() as full:
        assert_rejected(full, exc, lambda: full.load(blob))


def test_every_truncation_is_rejected() -> None:
    """Every proper prefix of a valid shard is refused as truncated."""
    blob = small_shard()
    for n in range(len(blob)):
        _check_rejects(blob[:n], ShardTruncatedError)


def test_trailing_bytes_are_rejected() -> None:
    """Bytes after the declared payload make the shard malformed."""
    _check_rejects(small_shard() + b"\0")


def _field(offset: int) -> str:
    if offset < 4:
        return "magic"
    if offset < 6:
        return "version"
    if offset < 8:
        return "kind"
    if offset < 12:
        return "max_depth"
    if offset < 16:
        return "reserved"
    if offset < 40:
        return "lengths"
    if offset < HEADER:
        return "checksum"
    return "payload"


# The errors a flip in each field may give: structural checks come first, then
# the checksum, which covers the header (bytes 0..39) and the payload.
FLIP_ERRORS: dict[str, Any] = {
    "magic": ShardFormatError,
    "version": ShardVersionError,
    "kind": ShardFormatError,  # kind > 1, or a checksum mismatch
    "max_depth": ShardFormatError,  # out of range, or a checksum mismatch
    "reserved": ShardFormatError,
    "lengths": ShardFormatError,  # truncated, trailing bytes, or a checksum mismatch
    "checksum": ShardChecksumError,
    "payload": ShardChecksumError,
}


def _outcome(call: Callable[[], Any]) -> Any:
    """The result of call(), or the ShardFormatError it raised."""
    try:
        return call()
    except ShardFormatError as exc:
        return exc


def test_every_bit_flip_is_rejected() -> None:
    """Every single bit flip of a shard is refused, by from_bytes and by load."""
    blob = small_shard()
    for bit in range(len(blob) * 8):
        flipped = bytearray(blob)
        flipped[bit // 8] ^= 1 << (bit % 8)
        data = bytes(flipped)
        where = _field(bit // 8)
        loaded = _outcome(lambda: SuffixTree.from_bytes(data))  # noqa: B023
        assert isinstance(loaded, FLIP_ERRORS[where]), (bit, where, loaded)
        with SuffixTree(DEPTH) as empty:
            result = _outcome(lambda: empty.load(data))  # noqa: B023
            assert isinstance(result, FLIP_ERRORS[where]), (bit, where, result)
            assert len(empty) == 0
            assert empty.stats().nodes == 1
            empty.check()


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    garbage=st.one_of(
        st.binary(max_size=200),
        st.binary(max_size=200).map(lambda b: b"ASHD" + b),
        st.binary(max_size=200).map(lambda b: b"ASHD\x01\x00\x00\x00" + b),
        st.binary(max_size=200).map(lambda b: small_shard()[:HEADER] + b),
    )
)
def test_random_garbage_is_rejected(garbage: bytes) -> None:
    """Random bytes (with or without a plausible header) are refused cleanly."""
    _check_rejects(garbage)


def _header(
    *,
    n_seq: int,
    n_rem: int,
    payload: int,
    kind: int = 0,
    depth: int = DEPTH,
    version: int = 1,
    checksum: int = 0,
) -> bytes:
    return b"ASHD" + struct.pack(
        "<HHIIQQQQ", version, kind, depth, 0, n_seq, n_rem, payload, checksum
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"n_seq": 2**64 - 1, "n_rem": 0, "payload": 16},
        {"n_seq": 1, "n_rem": 2**63, "payload": 16},
        {"n_seq": 1, "n_rem": 0, "payload": 2**64 - 1},
        {"n_seq": 2**61, "n_rem": 2**61, "payload": 2**63},
        {"n_seq": 1, "n_rem": 0, "payload": 2**64 - 8, "kind": 1},
    ],
)
def test_header_claiming_huge_lengths(fields: dict[str, int]) -> None:
    """A header declaring enormous lengths is refused without reading or allocating them."""
    version = small_shard()[4:6]
    blob = bytearray(_header(**fields)) + b"\x00" * 16
    blob[4:6] = version
    assert len(blob) == HEADER + 16
    _check_rejects(bytes(blob))


def test_huge_token_count_in_payload() -> None:
    """A sequence record claiming 2**32-1 tokens is refused."""
    blob = bytearray(small_shard())
    struct.pack_into("<I", blob, HEADER + 8, 2**32 - 1)
    _check_rejects(bytes(blob))


def test_wrong_max_depth_on_load() -> None:
    """Loading a shard of another depth raises DepthMismatchError, changing nothing."""
    blob = small_shard()
    for depth in (DEPTH - 1, DEPTH + 1, 64):
        with SuffixTree(depth) as t:
            assert_rejected(t, DepthMismatchError, functools.partial(t.load, blob))
        with SuffixTree(depth) as t:
            t.add(1, [1, 2, 3])
            assert_rejected(t, DepthMismatchError, functools.partial(t.load, blob))


def test_snapshot_into_non_empty_tree(tree: SuffixTree) -> None:
    """A snapshot can only be loaded into an empty tree (InvalidArgumentError)."""
    assert_rejected(tree, InvalidArgumentError, lambda: tree.load(small_shard()))


def test_load_non_bytes(tree: SuffixTree) -> None:
    """load/from_bytes with a non-bytes argument raise TypeError."""
    assert_rejected(tree, TypeError, lambda: tree.load("ASHD"))  # type: ignore[arg-type]
    assert_rejected(tree, TypeError, lambda: tree.load(None))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        SuffixTree.from_bytes(12)  # type: ignore[arg-type]


def test_delta_with_unknown_ids(tree: SuffixTree) -> None:
    """delta_bytes of an id not in the tree raises SequenceNotFoundError."""
    with pytest.raises(SequenceNotFoundError):
        tree.delta_bytes([424242])
    with pytest.raises(TypeError):
        tree.delta_bytes([1.5])  # type: ignore[list-item]


# --- raw C API with NULL pointers -------------------------------------------------


@pytest.fixture
def raw() -> Iterator[tuple[Any, Any]]:
    """A raw tree and cursor from the C API, freed afterwards."""
    status = ffi.new("int *")
    t = lib.as_tree_create(DEPTH, status)
    c = lib.as_cursor_create(DEPTH, lib.AS_CURSOR_LOCAL_TREE, status)
    assert t != ffi.NULL
    assert c != ffi.NULL
    toks = ffi.new("int32_t[]", [1, 2, 3, 1, 2, 4])
    assert lib.as_tree_add(t, 1, toks, 6) == lib.AS_OK
    yield t, c
    assert lib.as_tree_check(t) == lib.AS_OK
    lib.as_cursor_free(c)
    lib.as_tree_free(t)


def test_raw_null_pointers(raw: tuple[Any, Any]) -> None:
    """Every entry point refuses NULL handles/buffers with AS_ERR_INVALID_ARG."""
    t, c = raw
    null = ffi.NULL
    inv = lib.AS_ERR_INVALID_ARG
    u64 = ffi.new("uint64_t *")
    size = ffi.new("size_t *")
    toks = ffi.new("int32_t[]", [1, 2])
    stats = ffi.new("as_tree_stats *")
    params = ffi.new("as_draft_params *")
    lib.as_draft_params_default(params)
    buf_t = ffi.new("int32_t[]", 32)
    buf_p = ffi.new("int32_t[]", 32)
    buf_f = ffi.new("float[]", 32)
    out = ffi.new("as_draft_out *", {"tokens": buf_t, "parents": buf_p, "probs": buf_f, "cap": 32})
    assert lib.as_tree_add(null, 5, toks, 2) == inv
    assert lib.as_tree_add(t, 5, null, 2) == inv
    assert lib.as_tree_append(null, 5, toks, 2) == inv
    assert lib.as_tree_append(t, 5, null, 2) == inv
    assert lib.as_tree_close(null, 1) == inv
    assert lib.as_tree_remove(null, 1) == inv
    assert lib.as_tree_contains(null, 1) == 0
    assert lib.as_tree_seq_len(null, 1, u64) == inv
    assert lib.as_tree_seq_len(t, 1, null) == inv
    assert lib.as_tree_seq_tokens(null, 1, buf_t, 32) == inv
    assert lib.as_tree_seq_tokens(t, 1, null, 32) == inv
    assert lib.as_tree_seq_ids(null, ffi.new("int64_t[]", 4), 4, size) == inv
    assert lib.as_tree_seq_ids(t, null, 4, size) == inv
    assert lib.as_tree_seq_ids(t, ffi.new("int64_t[]", 4), 4, null) == inv
    assert lib.as_tree_stats_get(null, stats) == inv
    assert lib.as_tree_stats_get(t, null) == inv
    assert lib.as_tree_count(null, toks, 2, u64) == inv
    assert lib.as_tree_count(t, null, 2, u64) == inv
    assert lib.as_tree_count(t, toks, 2, null) == inv
    assert lib.as_tree_check(null) == inv
    assert lib.as_tree_save_bound(null, u64) == inv
    assert lib.as_tree_save_bound(t, null) == inv
    assert lib.as_tree_save(null, ffi.new("uint8_t[]", 8), 8, size) == inv
    assert lib.as_tree_save(t, null, 1000, size) == inv
    assert lib.as_tree_save(t, ffi.new("uint8_t[]", 1000), 1000, null) == inv
    assert lib.as_tree_delta_bound(null, null, 0, 0, u64) == inv
    assert lib.as_tree_delta_bound(t, null, 1, 0, u64) == inv
    assert lib.as_tree_save_delta(null, null, 0, null, 0, ffi.new("uint8_t[]", 64), 64, size) == inv
    assert lib.as_tree_save_delta(t, null, 1, null, 0, ffi.new("uint8_t[]", 64), 64, size) == inv
    assert lib.as_tree_save_delta(t, null, 0, null, 1, ffi.new("uint8_t[]", 64), 64, size) == inv
    assert lib.as_shard_inspect(null, 64, null, null, null, null, null) == inv
    assert lib.as_tree_load(null, ffi.new("uint8_t[]", 64), 64) == inv
    assert lib.as_tree_load(t, null, 64) == inv
    status = ffi.new("int *", -1)
    assert lib.as_tree_from_bytes(null, 64, status) == null
    assert status[0] == inv
    assert lib.as_tree_from_bytes(null, 64, null) == null
    assert lib.as_cursor_extend(null, toks, 2) == inv
    assert lib.as_cursor_extend(c, null, 2) == inv
    assert lib.as_cursor_len(null) == 0
    assert lib.as_cursor_local_tree(null) == null
    assert lib.as_draft(null, t, params, out) == inv
    assert lib.as_draft(c, t, null, out) == inv
    assert lib.as_draft(c, t, params, null) == inv
    assert lib.as_draft_context(t, null, null, 2, params, out) == inv
    assert lib.as_draft_context(t, null, toks, 2, null, out) == inv
    assert lib.as_draft_context(t, null, toks, 2, params, null) == inv
    null_out = ffi.new(
        "as_draft_out *", {"tokens": null, "parents": buf_p, "probs": buf_f, "cap": 32}
    )
    assert lib.as_draft_context(t, null, toks, 2, params, null_out) == inv
    assert lib.as_draft(c, t, params, null_out) == inv
    assert lib.as_tree_check(t) == lib.AS_OK
    assert lib.as_cursor_len(c) == 0


def test_raw_bad_sizes(raw: tuple[Any, Any]) -> None:
    """Huge lengths with NULL, small output capacities and bad params are refused."""
    t, c = raw
    params = ffi.new("as_draft_params *")
    lib.as_draft_params_default(params)
    small = ffi.new("as_draft_out *")
    small.tokens = ffi.new("int32_t[]", 1)
    small.parents = ffi.new("int32_t[]", 1)
    small.probs = ffi.new("float[]", 1)
    small.cap = 1
    ctx = ffi.new("int32_t[]", [1, 2])
    assert lib.as_draft_context(t, ffi.NULL, ctx, 2, params, small) == lib.AS_ERR_CAPACITY
    for field, value in (("max_spec_tokens", 0), ("max_spec_tokens", 1025), ("alpha", math.nan)):
        p = ffi.new("as_draft_params *")
        lib.as_draft_params_default(p)
        setattr(p, field, value)
        big = ffi.new("as_draft_out *")
        big.tokens = ffi.new("int32_t[]", 2048)
        big.parents = ffi.new("int32_t[]", 2048)
        big.probs = ffi.new("float[]", 2048)
        big.cap = 2048
        assert lib.as_draft_context(t, ffi.NULL, ctx, 2, p, big) == lib.AS_ERR_INVALID_ARG
    bad = ffi.new("int32_t[]", [1, -1])
    assert lib.as_tree_add(t, 9, bad, 2) == lib.AS_ERR_INVALID_TOKEN
    assert lib.as_cursor_extend(c, bad, 2) == lib.AS_ERR_INVALID_TOKEN
    status = ffi.new("int *")
    for depth in (0, 1, 1025, 2**32 - 1):
        assert lib.as_tree_create(depth, status) == ffi.NULL
        assert status[0] == lib.AS_ERR_INVALID_ARG
        assert lib.as_cursor_create(depth, 0, status) == ffi.NULL
        assert status[0] == lib.AS_ERR_INVALID_ARG
    assert lib.as_tree_from_bytes(ffi.new("uint8_t[]", 3), 3, status) == ffi.NULL
    assert status[0] != lib.AS_OK


def test_raw_batch_bad_arguments(raw: tuple[Any, Any]) -> None:
    """as_draft_batch refuses NULL arrays, bad offsets, a short stride; a NULL item fails alone."""
    t, c = raw
    null = ffi.NULL
    params = ffi.new("as_draft_params *")
    lib.as_draft_params_default(params)
    n, stride = 2, 32
    cursors = ffi.new("as_cursor *[]", [c, null])
    globals_ = ffi.new("as_tree *[]", [t, t])
    toks = ffi.new("int32_t[]", n * stride)
    pars = ffi.new("int32_t[]", n * stride)
    probs = ffi.new("float[]", n * stride)
    n_out = ffi.new("uint32_t[]", n)
    match_len = ffi.new("uint32_t[]", n)
    source = ffi.new("uint32_t[]", n)
    score = ffi.new("double[]", n)
    statuses = ffi.new("int32_t[]", n)
    new = ffi.new("int32_t[]", [1, 2, 3])
    outs = (toks, pars, probs, stride, n_out, match_len, source, score, statuses)

    def call(
        cur: Any, offsets: Any, new_tokens: Any = new, p: Any = params, s: int = stride
    ) -> int:
        rc: int = lib.as_draft_batch(
            cur, globals_, n, new_tokens, offsets, p, *outs[:3], s, *outs[4:], 2
        )
        return rc

    inv = lib.AS_ERR_INVALID_ARG
    good_offsets = ffi.new("uint64_t[]", [0, 2, 3])
    assert call(null, good_offsets) == inv
    assert call(cursors, null) == inv  # new_tokens without offsets
    assert call(cursors, ffi.new("uint64_t[]", [0, 3, 2])) == inv  # decreasing offsets
    assert call(cursors, good_offsets, p=null) == inv
    assert call(cursors, good_offsets, s=1) == lib.AS_ERR_CAPACITY
    assert lib.as_cursor_len(c) == 0  # nothing above appended anything
    # A NULL cursor inside the array fails its own item only.
    assert call(cursors, good_offsets) == inv
    assert statuses[0] == lib.AS_OK
    assert statuses[1] == inv
    assert lib.as_cursor_len(c) == 2
