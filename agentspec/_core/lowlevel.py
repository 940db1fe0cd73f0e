"""Thin wrappers over the C engine: the only module that touches cffi.

Hazardous materials.  Everything here works on raw cffi handles and pointers
and trusts its caller to pass live handles of the right kind; the public
classes (`SuffixTree`, `Cursor`, `BatchDrafter`) do that bookkeeping.  Each
function makes one or two C calls, turns a non-zero ``as_status`` into the
matching exception of `agentspec.exceptions` (the C message in ``args[0]``)
and converts results to plain Python values.

Handles come from `tree_create`, `tree_from_bytes` and `cursor_create`
wrapped in ``ffi.gc`` so that the C object is freed when the handle is
garbage-collected; `release` frees it right away (``ffi.release``, which also
disarms the gc destructor so it runs exactly once).

Its length (over 600 lines) is one short wrapper per C entry point: keeping
them in one module keeps the cffi boundary in one place.
"""

from __future__ import annotations

import array
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:
    from agentspec._agentspec_cffi import ffi, lib
except ImportError as _exc:  # a source folder without the built extension
    _package = os.path.dirname(os.path.abspath(__file__))
    _checkout = os.path.dirname(_package)
    raise ImportError(
        f"the native module agentspec._agentspec_cffi is not built in {_package}: "
        "'agentspec' resolved to a source folder, not to the installed package. Install it "
        f"(python -m pip install -e {_checkout}) or run from another directory ({_exc})"
    ) from _exc
from agentspec.exceptions import (
    AgentSpecError,
    CapacityError,
    DepthMismatchError,
    InvalidArgumentError,
    InvalidTokenError,
    NativeMemoryError,
    SequenceClosedError,
    SequenceExistsError,
    SequenceNotFoundError,
    ShardChecksumError,
    ShardFormatError,
    ShardTruncatedError,
    ShardVersionError,
    ThreadStartError,
)

__all__ = [
    "CHAIN_PARENTS",
    "CONF_BINS",
    "CURSOR_LOCAL_TREE",
    "DEFAULT_MAX_DEPTH",
    "DRAFT_CONF",
    "DRAFT_MERGE",
    "DRAFT_NO_GLOBAL",
    "DRAFT_NO_LOCAL",
    "DRAFT_TREE",
    "ERR_INVALID_TOKEN",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_DEPTH_LIMIT",
    "MAX_SPEC_LIMIT",
    "NATIVE_VERSION",
    "NULL",
    "SHARD_HEADER_BYTES",
    "BatchBuffers",
    "CData",
    "DraftBuffers",
    "allocated_bytes",
    "check",
    "check_tokens",
    "cursor_create",
    "cursor_extend",
    "cursor_len",
    "cursor_local_tree",
    "draft",
    "draft_context",
    "draft_tail_c",
    "error",
    "ffi",
    "int32_ptr",
    "int32_ptr_fast",
    "int64_array",
    "lib",
    "new_params",
    "release",
    "shard_max_token",
    "shard_peek",
    "strerror",
    "token_detail",
    "tree_add",
    "tree_append",
    "tree_check",
    "tree_close",
    "tree_contains",
    "tree_count",
    "tree_create",
    "tree_from_bytes",
    "tree_live_bytes",
    "tree_load",
    "tree_max_depth",
    "tree_remove",
    "tree_save",
    "tree_save_delta",
    "tree_seq_ids",
    "tree_sequence",
    "tree_stats",
    "uint8_ptr",
    "unpack",
    "unpack_raw",
]

#: A cffi ``CData`` value (handle, pointer or struct); cffi ships no types.
CData = Any

NULL: CData = ffi.NULL

MAX_DEPTH_LIMIT: int = lib.AS_MAX_DEPTH_LIMIT
DEFAULT_MAX_DEPTH: int = lib.AS_DEFAULT_MAX_DEPTH
MAX_SPEC_LIMIT: int = lib.AS_MAX_SPEC_LIMIT
# Parents of a chain draft of up to MAX_SPEC_LIMIT tokens: each token follows the one before.
_CHAIN_PARENTS: list[int] = list(range(-1, MAX_SPEC_LIMIT - 1))
DRAFT_TREE: int = lib.AS_DRAFT_TREE
DRAFT_MERGE: int = lib.AS_DRAFT_MERGE
DRAFT_NO_LOCAL: int = lib.AS_DRAFT_NO_LOCAL
DRAFT_NO_GLOBAL: int = lib.AS_DRAFT_NO_GLOBAL
DRAFT_CONF: int = lib.AS_DRAFT_CONF
#: Bins per axis of the confidence table (`DraftParams.conf`).
CONF_BINS: int = lib.AS_CONF_BINS
CURSOR_LOCAL_TREE: int = lib.AS_CURSOR_LOCAL_TREE
ERR_INVALID_TOKEN: int = lib.AS_ERR_INVALID_TOKEN
SHARD_HEADER_BYTES: int = lib.AS_SHARD_HEADER_BYTES
NATIVE_VERSION: str = f"{lib.AS_VERSION_MAJOR}.{lib.AS_VERSION_MINOR}.{lib.AS_VERSION_PATCH}"

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

_ERRORS: dict[int, type[AgentSpecError]] = {
    lib.AS_ERR_NOMEM: NativeMemoryError,
    lib.AS_ERR_INVALID_ARG: InvalidArgumentError,
    lib.AS_ERR_INVALID_TOKEN: InvalidTokenError,
    lib.AS_ERR_SEQ_EXISTS: SequenceExistsError,
    lib.AS_ERR_SEQ_NOT_FOUND: SequenceNotFoundError,
    lib.AS_ERR_SEQ_CLOSED: SequenceClosedError,
    lib.AS_ERR_CAPACITY: CapacityError,
    lib.AS_ERR_FORMAT: ShardFormatError,
    lib.AS_ERR_VERSION: ShardVersionError,
    lib.AS_ERR_TRUNCATED: ShardTruncatedError,
    lib.AS_ERR_CHECKSUM: ShardChecksumError,
    lib.AS_ERR_DEPTH_MISMATCH: DepthMismatchError,
    lib.AS_ERR_THREAD: ThreadStartError,
}

_messages: dict[int, str] = {}

# Output buffers that C overwrites completely: skip cffi's zero-filling.
_new_raw = ffi.new_allocator(should_clear_after_alloc=False)


# --- errors ---------------------------------------------------------------


def strerror(status: int) -> str:
    """The C engine's description of a status code (``as_strerror``)."""
    msg = _messages.get(status)
    if msg is None:
        msg = ffi.string(lib.as_strerror(status)).decode("utf-8", "replace")
        _messages[status] = msg
    return msg


def error(status: int, *detail: object) -> AgentSpecError:
    """The exception for a non-zero status: C message in args[0], then ``detail``.

    A status this version does not know becomes a bare `AgentSpecError`.
    """
    cls = _ERRORS.get(status, AgentSpecError)
    return cls(strerror(status), *detail)


def check(status: int, *detail: object) -> None:
    """Raise the mapped exception if ``status`` is not ``AS_OK``."""
    if status:
        raise error(status, *detail)


def token_detail(tokens: object) -> str:
    """Describe the first negative token of an int32 buffer, for error messages."""
    values = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)  # type: ignore[call-overload]
    for i, v in enumerate(values):
        if v < 0:
            return f"index {i}: value {v}"
    return "a token is out of range"


def _check_tokens(status: int, keep: object) -> None:
    """Like `check`, naming the bad token when the status is INVALID_TOKEN."""
    if status:
        if status == ERR_INVALID_TOKEN:
            raise error(status, token_detail(keep))
        raise error(status)


# --- buffers --------------------------------------------------------------


def int32_ptr(obj: object) -> CData:
    """A ``int32_t *`` over a C-contiguous int32 buffer (no copy)."""
    return ffi.from_buffer("int32_t[]", obj)


def uint8_ptr(obj: object) -> CData:
    """A ``uint8_t *`` over any bytes-like object (no copy)."""
    return ffi.from_buffer("uint8_t[]", obj)


def unpack(ptr: CData, n: int) -> list[Any]:
    """The first ``n`` items at ``ptr`` as a list of Python numbers."""
    result: list[Any] = ffi.unpack(ptr, n)
    return result


def int64_array(values: list[int]) -> CData:
    """An ``int64_t[]`` holding ``values``; out-of-range ids raise InvalidArgumentError."""
    try:
        return ffi.new("int64_t[]", values)
    except OverflowError:
        bad = next(v for v in values if not INT64_MIN <= v <= INT64_MAX)
        raise InvalidArgumentError("sequence id out of the int64 range", f"seq_id {bad}") from None


def release(handle: CData) -> None:
    """Free the C object behind an ``ffi.gc`` handle now (its destructor runs once)."""
    ffi.release(handle)


# --- trees ----------------------------------------------------------------


def tree_create(max_depth: int) -> CData:
    """Create an empty tree; the handle frees itself when collected."""
    st = ffi.new("int *")
    ptr = lib.as_tree_create(max_depth, st)
    if ptr == NULL:
        raise error(st[0] or lib.AS_ERR_NOMEM)
    return ffi.gc(ptr, lib.as_tree_free)


def tree_from_bytes(data: object) -> CData:
    """Create a tree from snapshot bytes."""
    buf = uint8_ptr(data)
    st = ffi.new("int *")
    ptr = lib.as_tree_from_bytes(buf, len(buf), st)
    if ptr == NULL:
        raise error(st[0] or lib.AS_ERR_NOMEM)
    return ffi.gc(ptr, lib.as_tree_free)


def tree_max_depth(tree: CData) -> int:
    """The tree's max_depth."""
    depth: int = lib.as_tree_max_depth(tree)
    return depth


def tree_add(tree: CData, seq_id: int, ptr: CData, n: int, keep: object) -> None:
    """Add a closed sequence."""
    st = lib.as_tree_add(tree, seq_id, ptr, n)
    if st:
        raise error(st, token_detail(keep) if st == ERR_INVALID_TOKEN else f"seq_id {seq_id}")


def tree_append(tree: CData, seq_id: int, ptr: CData, n: int, keep: object) -> None:
    """Append to an open sequence, creating it if new."""
    st = lib.as_tree_append(tree, seq_id, ptr, n)
    if st:
        raise error(st, token_detail(keep) if st == ERR_INVALID_TOKEN else f"seq_id {seq_id}")


def tree_close(tree: CData, seq_id: int) -> None:
    """Close an open sequence."""
    st = lib.as_tree_close(tree, seq_id)
    if st:
        raise error(st, f"seq_id {seq_id}")


def tree_remove(tree: CData, seq_id: int) -> None:
    """Remove a sequence and its occurrences."""
    st = lib.as_tree_remove(tree, seq_id)
    if st:
        raise error(st, f"seq_id {seq_id}")


def tree_contains(tree: CData, seq_id: int) -> bool:
    """Whether the tree holds ``seq_id``."""
    return bool(lib.as_tree_contains(tree, seq_id))


def tree_sequence(tree: CData, seq_id: int) -> list[int]:
    """The tokens of one sequence."""
    n = ffi.new("uint64_t *")
    check(lib.as_tree_seq_len(tree, seq_id, n), f"seq_id {seq_id}")
    size = int(n[0])
    if size == 0:
        return []
    out = _new_raw("int32_t[]", size)
    check(lib.as_tree_seq_tokens(tree, seq_id, out, size), f"seq_id {seq_id}")
    return unpack(out, size)


def tree_seq_ids(tree: CData) -> list[int]:
    """All sequence ids, oldest first."""
    n = ffi.new("size_t *")
    check(lib.as_tree_seq_ids(tree, NULL, 0, n))
    size = int(n[0])
    if size == 0:
        return []
    out = _new_raw("int64_t[]", size)
    check(lib.as_tree_seq_ids(tree, out, size, n))
    return unpack(out, min(size, int(n[0])))


def tree_stats(tree: CData) -> tuple[int, int, int, int, int, int, int, int]:
    """``(sequences, open_sequences, tokens, nodes, bytes, retained_tokens, free_bytes,
    max_depth)``."""
    s = ffi.new("as_tree_stats *")
    check(lib.as_tree_stats_get(tree, s))
    return (
        int(s.sequences),
        int(s.open_sequences),
        int(s.tokens),
        int(s.nodes),
        int(s.bytes),
        int(s.retained_tokens),
        int(s.free_bytes),
        int(s.max_depth),
    )


def tree_live_bytes(tree: CData) -> int:
    """A tree's allocator bytes less its free node slots (see `agentspec._core.budget`)."""
    s = ffi.new("as_tree_stats *")
    check(lib.as_tree_stats_get(tree, s))
    return max(0, int(s.bytes) - int(s.free_bytes))


def tree_count(tree: CData, ptr: CData, n: int, keep: object) -> int:
    """Occurrence count of a token string."""
    c = ffi.new("uint64_t *")
    _check_tokens(lib.as_tree_count(tree, ptr, n, c), keep)
    return int(c[0])


def tree_check(tree: CData) -> None:
    """Verify the tree's invariants (raises ShardFormatError if unsound)."""
    check(lib.as_tree_check(tree))


def tree_save(tree: CData) -> bytes:
    """A snapshot of the whole tree."""
    bound = ffi.new("uint64_t *")
    check(lib.as_tree_save_bound(tree, bound))
    cap = int(bound[0])
    buf = _new_raw("uint8_t[]", cap)
    written = ffi.new("size_t *")
    check(lib.as_tree_save(tree, buf, cap, written))
    return ffi.buffer(buf, int(written[0]))[:]  # type: ignore[no-any-return]


def tree_save_delta(tree: CData, add_ids: list[int], remove_ids: list[int]) -> bytes:
    """A delta shard: the sequences ``add_ids`` (present in the tree) and removals."""
    adds = int64_array(add_ids)
    removes = int64_array(remove_ids)
    bound = ffi.new("uint64_t *")
    check(lib.as_tree_delta_bound(tree, adds, len(add_ids), len(remove_ids), bound))
    cap = int(bound[0])
    buf = _new_raw("uint8_t[]", cap)
    written = ffi.new("size_t *")
    check(
        lib.as_tree_save_delta(
            tree, adds, len(add_ids), removes, len(remove_ids), buf, cap, written
        )
    )
    return ffi.buffer(buf, int(written[0]))[:]  # type: ignore[no-any-return]


def tree_load(tree: CData, data: object) -> None:
    """Apply snapshot or delta bytes to a tree."""
    buf = uint8_ptr(data)
    check(lib.as_tree_load(tree, buf, len(buf)))


def shard_peek(data: object) -> tuple[int, int, int, int]:
    """``(kind, max_depth, n_sequences, n_removals)`` from the header alone (O(1)).

    Raises the ShardFormatError family for a bad header; the checksum and the
    payload are not read, so success does not mean the bytes are valid.
    """
    buf = uint8_ptr(data)
    kind = ffi.new("uint32_t *")
    depth = ffi.new("uint32_t *")
    nseq = ffi.new("uint64_t *")
    nrem = ffi.new("uint64_t *")
    check(lib.as_shard_peek(buf, len(buf), kind, depth, nseq, nrem))
    return int(kind[0]), int(depth[0]), int(nseq[0]), int(nrem[0])


def shard_max_token(data: object) -> int:
    """Validate shard bytes and return their largest token id (-1: no token)."""
    buf = uint8_ptr(data)
    top = ffi.new("int32_t *")
    check(lib.as_shard_max_token(buf, len(buf), top))
    return int(top[0])


# --- cursors --------------------------------------------------------------


def cursor_create(max_depth: int, local_tree: bool) -> CData:
    """Create a cursor; the handle frees itself when collected."""
    st = ffi.new("int *")
    flags = CURSOR_LOCAL_TREE if local_tree else 0
    ptr = lib.as_cursor_create(max_depth, flags, st)
    if ptr == NULL:
        raise error(st[0] or lib.AS_ERR_NOMEM)
    return ffi.gc(ptr, lib.as_cursor_free)


def cursor_extend(cur: CData, ptr: CData, n: int, keep: object) -> None:
    """Append tokens to a cursor's context."""
    _check_tokens(lib.as_cursor_extend(cur, ptr, n), keep)


def cursor_len(cur: CData) -> int:
    """Context length of a cursor."""
    n: int = lib.as_cursor_len(cur)
    return n


def cursor_local_tree(cur: CData) -> CData:
    """The cursor's own tree (borrowed pointer), or NULL."""
    return lib.as_cursor_local_tree(cur)


# --- drafting -------------------------------------------------------------


def new_params(
    max_spec_tokens: int,
    max_pattern: int,
    min_pattern: int,
    flags: int,
    alpha: float,
    offset: float,
    min_token_prob: float,
    min_score: float,
    vocab_size: int = 0,
    conf: Sequence[float] | None = None,
) -> CData:
    """An ``as_draft_params`` struct (values already validated; vocab_size 0: no
    bound; ``conf``: the CONF_BINS**2 confidence table, which sets DRAFT_CONF)."""
    p = ffi.new("as_draft_params *")
    p.max_spec_tokens = max_spec_tokens
    p.max_pattern = max_pattern
    p.min_pattern = min_pattern
    p.flags = flags
    p.vocab_size = vocab_size
    p.alpha = alpha
    p.offset = offset
    p.min_token_prob = min_token_prob
    p.min_score = min_score
    if conf is not None:
        p.flags = flags | DRAFT_CONF
        p.conf = list(conf)
    return p


class DraftBuffers:
    """Caller-owned output buffers for one draft (``as_draft_out`` + arrays)."""

    __slots__ = ("cap", "out", "parents", "probs", "tokens")

    def __init__(self, cap: int) -> None:
        """Allocate buffers for drafts of up to ``cap`` tokens."""
        self.cap = 0
        self.out: CData = ffi.new("as_draft_out *")
        self._grow(cap)

    def _grow(self, cap: int) -> None:
        self.tokens: CData = _new_raw("int32_t[]", cap)
        self.parents: CData = _new_raw("int32_t[]", cap)
        self.probs: CData = _new_raw("float[]", cap)
        out = self.out
        out.tokens = self.tokens
        out.parents = self.parents
        out.probs = self.probs
        out.cap = cap
        self.cap = cap

    def ensure(self, cap: int) -> None:
        """Make room for ``cap`` tokens."""
        if cap > self.cap:
            self._grow(cap)

    def result(self) -> tuple[list[int], list[int], list[float], float, int, int]:
        """``(tokens, parents, probs, score, match_len, source)`` of the last draft."""
        out = self.out
        n = out.n
        return (
            ffi.unpack(self.tokens, n),
            ffi.unpack(self.parents, n),
            ffi.unpack(self.probs, n),
            out.score,
            out.match_len,
            out.source,
        )


def draft(
    cur: CData, global_tree: CData, params: CData, bufs: DraftBuffers
) -> tuple[list[int], list[int], list[float], float, int, int]:
    """Draft from a cursor (and a global tree or NULL); returns `DraftBuffers.result`."""
    st = lib.as_draft(cur, global_tree, params, bufs.out)
    if st:
        raise error(st)
    return bufs.result()


MAX_GLOBALS: int = lib.AS_MAX_GLOBALS


def draft_multi(
    cur: CData, globals_: CData, n: int, params: CData, bufs: DraftBuffers
) -> tuple[list[int], list[int], list[float], float, int, int, int]:
    """Draft from a cursor and ``n`` global trees (an ``as_tree *[]``); returns
    ``(tokens, parents, probs, score, match_len, source, global_index)``, the
    global index naming the tree the draft came from (0 when none)."""
    out = bufs.out
    st = lib.as_draft_multi(cur, globals_, n, params, out)
    if st:
        raise error(st)
    k = out.n
    return (
        _unpack(bufs.tokens, k),
        _unpack(bufs.parents, k),
        _unpack(bufs.probs, k),
        out.score,
        out.match_len,
        out.source,
        out.global_index,
    )


_unpack = ffi.unpack


def new_tree_array(n: int) -> CData:
    """An ``as_tree *[n]`` to fill with handles for `draft_multi`."""
    return ffi.new("as_tree *[]", n)


# --- the per-step tail draft, unwrapped ------------------------------------
# `Cursor._draft_tail` (arctic's `speculate`: once per request per vLLM step)
# calls the C function itself: a wrapper frame here was 4% of that call (the
# replay in benchmarks/bench_native.py: 4.20 -> 4.05 us at p50 on spider).
# These are the only raw entry points used outside this module; statuses
# still become exceptions here (`check_tokens`).

#: ``as_draft_tail(cursor, global_tree or NULL, ptr, n, params, out) -> status``
draft_tail_c = lib.as_draft_tail
#: ``ffi.unpack``: the first ``n`` items of a C array as a list
unpack_raw = ffi.unpack
#: `_check_tokens`: raise the error of a nonzero status (naming a bad token)
check_tokens = _check_tokens
#: a chain draft's parents, ``[-1, 0, 1, ...]``: sliced rather than unpacked
CHAIN_PARENTS = _CHAIN_PARENTS
#: `int32_ptr` without a Python frame (the same call).
int32_ptr_fast: Callable[[object], CData] = functools.partial(ffi.from_buffer, "int32_t[]")


def draft_context(
    global_tree: CData,
    local_tree: CData,
    ptr: CData,
    n: int,
    keep: object,
    params: CData,
    bufs: DraftBuffers,
) -> None:
    """Draft from a context against a global and/or a per-request tree (NULL: none)."""
    st = lib.as_draft_context(global_tree, local_tree, ptr, n, params, bufs.out)
    if st:
        _check_tokens(st, keep)


class BatchBuffers:
    """Everything one ``as_draft_batch_multi`` call needs, allocated once for ``rows`` items.

    Output arrays are numpy arrays (``tokens``/``parents``/``probs`` are
    ``rows x stride``) so callers may also read them directly.  Before a
    call the caller fills ``cursors[i]``, item i's global trees at
    ``globals[i * MAX_GLOBALS + k]`` with their count in ``n_globals[i]``,
    and (when it passes caps) ``caps[i]``.
    """

    __slots__ = (
        "_out",
        "caps",
        "cursors",
        "global_index",
        "globals",
        "match_len",
        "n_globals",
        "n_out",
        "parents",
        "probs",
        "rows",
        "score",
        "source",
        "statuses",
        "stride",
        "tokens",
    )

    def __init__(self, rows: int, stride: int) -> None:
        """Allocate output rows of ``stride`` tokens each."""
        self.rows = rows
        self.stride = stride
        self.tokens = np.zeros((rows, stride), dtype=np.int32)
        self.parents = np.zeros((rows, stride), dtype=np.int32)
        self.probs = np.zeros((rows, stride), dtype=np.float32)
        self.n_out = np.zeros(rows, dtype=np.uint32)
        self.match_len = np.zeros(rows, dtype=np.uint32)
        self.source = np.zeros(rows, dtype=np.uint32)
        self.global_index = np.zeros(rows, dtype=np.uint32)
        self.score = np.zeros(rows, dtype=np.float64)
        self.statuses = np.zeros(rows, dtype=np.int32)
        self.n_globals: CData = ffi.new("uint32_t[]", rows)
        self.caps: CData = ffi.new("uint32_t[]", rows)
        fb = ffi.from_buffer
        out = self._out = ffi.new("as_batch_out *")
        out.tokens = fb("int32_t[]", self.tokens, require_writable=True)
        out.parents = fb("int32_t[]", self.parents, require_writable=True)
        out.probs = fb("float[]", self.probs, require_writable=True)
        out.stride = stride
        out.n_out = fb("uint32_t[]", self.n_out, require_writable=True)
        out.match_len = fb("uint32_t[]", self.match_len, require_writable=True)
        out.source = fb("uint32_t[]", self.source, require_writable=True)
        out.global_index = fb("uint32_t[]", self.global_index, require_writable=True)
        out.score = fb("double[]", self.score, require_writable=True)
        out.statuses = fb("int32_t[]", self.statuses, require_writable=True)
        self.cursors: CData = ffi.new("as_cursor *[]", rows)
        self.globals: CData = ffi.new("as_tree *[]", rows * MAX_GLOBALS)

    def run(
        self,
        n_items: int,
        new_tokens: array.array[int] | None,
        offsets: list[int],
        params: CData,
        n_threads: int,
        *,
        caps: bool = False,
    ) -> int:
        """Call ``as_draft_batch_multi`` on the first ``n_items`` rows; returns its status.

        ``new_tokens`` (or None: no appends) holds every item's new tokens,
        item i's at ``offsets[i]:offsets[i+1]``; ``caps``: pass the ``caps``
        array (else every item drafts up to ``params``' max_spec_tokens).
        """
        if new_tokens is None:
            tok_ptr = off_ptr = NULL
        else:
            tok_ptr = ffi.from_buffer("int32_t[]", new_tokens)
            off_ptr = ffi.from_buffer("uint64_t[]", array.array("Q", offsets))
        status: int = lib.as_draft_batch_multi(
            self.cursors,
            self.globals,
            MAX_GLOBALS,
            self.n_globals,
            n_items,
            tok_ptr,
            off_ptr,
            self.caps if caps else NULL,
            params,
            self._out,
            n_threads,
        )
        return status

    def first_error(self, n_items: int) -> tuple[int, int] | None:
        """``(item, status)`` of the first failing item of the last call, or None."""
        for i, status in enumerate(self.statuses[:n_items].tolist()):
            if status:
                return i, status
        return None

    def results(
        self, n_items: int
    ) -> list[tuple[list[int], list[int], list[float], float, int, int, int]]:
        """``(tokens, parents, probs, score, match_len, source, global_index)`` per
        item of the last call (read through the C pointers: cheaper than numpy
        slicing for a decode step's few rows)."""
        out = self._out
        unpack = ffi.unpack
        counts = unpack(out.n_out, n_items)
        scores = unpack(out.score, n_items)
        match_lens = unpack(out.match_len, n_items)
        sources = unpack(out.source, n_items)
        index = unpack(out.global_index, n_items)
        tok, par, prob = out.tokens, out.parents, out.probs
        stride = self.stride
        res = []
        for i in range(n_items):
            k = counts[i]
            row = i * stride
            res.append(
                (
                    unpack(tok + row, k),
                    unpack(par + row, k),
                    unpack(prob + row, k),
                    scores[i],
                    match_lens[i],
                    sources[i],
                    index[i],
                )
            )
        return res


def allocated_bytes() -> int:
    """Bytes currently allocated by the whole C library."""
    n: int = lib.as_allocated_bytes()
    return n
