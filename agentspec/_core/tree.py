"""`SuffixTree`: a token suffix tree shared by requests, and its `TreeStats`."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from agentspec._core import lowlevel
from agentspec._core.draft import (
    Draft,
    DraftParams,
    check_max_depth,
    draft_from_buffers,
    resolve_params,
    thread_buffers,
)
from agentspec._core.tokens import TokenArray, as_int32_buffer
from agentspec._util.args import as_int
from agentspec.exceptions import InvalidArgumentError, TreeClosedError

__all__ = ["SuffixTree", "TreeStats"]


@dataclass(frozen=True, slots=True)
class TreeStats:
    """Size of a tree at one moment.

    Attributes:
        sequences: live sequences.
        open_sequences: sequences still accepting `SuffixTree.append`.
        tokens: tokens in live sequences.
        nodes: live tree nodes, the root included.
        bytes: exact bytes the tree holds from the allocator.
        retained_tokens: tokens of removed sequences still referenced by nodes.
        free_bytes: the part of ``bytes`` in free node slots, reused first (a
            tree compacts itself once half its slots are free).
        max_depth: the tree's depth limit.
    """

    sequences: int
    open_sequences: int
    tokens: int
    nodes: int
    bytes: int
    retained_tokens: int
    free_bytes: int
    max_depth: int


def check_seq_id(seq_id: object, name: str = "seq_id") -> int:
    """Validate a sequence id: an int in the int64 range, as a plain int."""
    sid = seq_id if type(seq_id) is int else as_int(seq_id, name)
    if not lowlevel.INT64_MIN <= sid <= lowlevel.INT64_MAX:
        raise InvalidArgumentError("sequence id out of the int64 range", f"{name} {sid}")
    return sid


def _id_list(ids: Iterable[Any], what: str) -> list[int]:
    """Validate an iterable of sequence ids."""
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"{what} must be an iterable of ints, not {type(ids).__name__}")
    return [check_seq_id(i, f"{what}[{k}]") for k, i in enumerate(ids)]


_BUSY = "concurrent modification: another thread is modifying this SuffixTree"
_READING = "concurrent modification: other threads are reading this SuffixTree"


class SuffixTree:
    """A suffix tree over token sequences, truncated at ``max_depth``.

    The tree counts every token string of length <= max_depth that occurs in
    its sequences; drafting follows the most frequent continuations of the
    context's suffixes.  It is the "global" tree of cached responses that
    many requests draft from (see `Cursor` for per-request state).

    Sequences have int64 ids.  `add` inserts a whole (closed) sequence;
    `append` grows an open one token batch by token batch, as a response is
    generated.  Trees serialise to snapshots (`to_bytes` / `from_bytes`) and
    deltas (`delta_bytes` / `load`).

    Thread safety: any number of threads may draft from (or otherwise read)
    a tree at once, as long as none modifies it.  A modifying call made while
    another thread modifies or reads the tree raises RuntimeError instead of
    waiting; so does a read while a modification runs.  Nothing ever blocks.
    """

    __slots__ = ("__weakref__", "_h", "_max_depth", "_readers", "_wlock")

    def __init__(self, max_depth: int = lowlevel.DEFAULT_MAX_DEPTH) -> None:
        """Create an empty tree indexing strings of up to ``max_depth`` tokens.

        Raises:
            InvalidArgumentError: max_depth outside [2, 1024].
        """
        depth = check_max_depth(max_depth)
        self._init(lowlevel.tree_create(depth), depth)

    def _init(self, handle: lowlevel.CData, depth: int) -> None:
        self._h: lowlevel.CData | None = handle
        self._max_depth = depth
        self._wlock = threading.Lock()
        # One entry per reader in flight: list.append/pop are atomic.
        self._readers: list[None] = []

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> SuffixTree:
        """Create a tree from a snapshot made by `to_bytes` (depth from the shard).

        Raises:
            ShardFormatError (or a subclass): malformed, truncated or corrupt bytes.
            TypeError: ``data`` is not bytes-like.
        """
        handle = lowlevel.tree_from_bytes(data)
        tree = cls.__new__(cls)
        tree._init(handle, lowlevel.tree_max_depth(handle))
        return tree

    # --- access guards ----------------------------------------------------

    def _read_begin(self) -> lowlevel.CData:
        """Register a reader and return the live handle (pair with `_read_end`)."""
        readers = self._readers
        readers.append(None)
        if self._wlock.locked():
            readers.pop()
            raise RuntimeError(_BUSY)
        h = self._h
        if h is None:
            readers.pop()
            raise TreeClosedError("the tree is closed")
        return h

    def _read_end(self) -> None:
        """Unregister a reader."""
        self._readers.pop()

    def _write_begin(self) -> lowlevel.CData:
        """Take the write lock (non-blocking) and return the live handle."""
        lock = self._wlock
        if not lock.acquire(False):
            raise RuntimeError(_BUSY)
        if self._readers:
            lock.release()
            raise RuntimeError(_READING)
        h = self._h
        if h is None:
            lock.release()
            raise TreeClosedError("the tree is closed")
        return h

    # --- properties -------------------------------------------------------

    @property
    def max_depth(self) -> int:
        """Longest token string the tree indexes."""
        return self._max_depth

    @property
    def closed(self) -> bool:
        """True after `close`."""
        return self._h is None

    def __repr__(self) -> str:
        """Short description with depth and size."""
        if self._h is None:
            return f"<SuffixTree max_depth={self._max_depth} closed>"
        return f"<SuffixTree max_depth={self._max_depth} sequences={len(self)}>"

    # --- modification -----------------------------------------------------

    def add(self, seq_id: int, tokens: TokenArray) -> None:
        """Insert a whole sequence, closed; ``seq_id`` must be new.

        Raises:
            SequenceExistsError: the id is already in the tree.
            TypeError, InvalidTokenError: bad tokens (nothing changes).
        """
        sid = check_seq_id(seq_id)
        ptr, n, keep = as_int32_buffer(tokens)
        h = self._write_begin()
        try:
            lowlevel.tree_add(h, sid, ptr, n, keep)
        finally:
            self._wlock.release()

    def append(self, seq_id: int, tokens: TokenArray) -> None:
        """Append tokens to an open sequence, creating it (open) if new.

        Raises:
            SequenceClosedError: the sequence was closed or added with `add`.
            TypeError, InvalidTokenError: bad tokens (nothing changes).
        """
        sid = check_seq_id(seq_id)
        ptr, n, keep = as_int32_buffer(tokens)
        self._append_buffer(sid, ptr, n, keep)

    def _append_buffer(self, seq_id: int, ptr: lowlevel.CData, n: int, keep: Any) -> None:
        """`append` for a checked id and an already converted buffer."""
        h = self._write_begin()
        try:
            lowlevel.tree_append(h, seq_id, ptr, n, keep)
        finally:
            self._wlock.release()

    def close_sequence(self, seq_id: int) -> None:
        """Stop accepting appends to a sequence (it keeps its tokens).

        Closing a closed sequence is allowed.

        Raises:
            SequenceNotFoundError: no such sequence.
        """
        sid = check_seq_id(seq_id)
        h = self._write_begin()
        try:
            lowlevel.tree_close(h, sid)
        finally:
            self._wlock.release()

    def remove(self, seq_id: int) -> None:
        """Remove a sequence and every occurrence it contributed.

        Raises:
            SequenceNotFoundError: no such sequence.
        """
        sid = check_seq_id(seq_id)
        h = self._write_begin()
        try:
            lowlevel.tree_remove(h, sid)
        finally:
            self._wlock.release()

    def load(self, data: bytes | bytearray | memoryview) -> None:
        """Apply shard bytes: a snapshot (into an empty tree) or a delta.

        A delta removes its listed ids (absent ones are skipped) and adds its
        sequences (ids already present are skipped), so applying the same
        delta twice changes nothing the second time.  Bytes are validated
        before anything changes.

        Raises:
            ShardFormatError (or a subclass): bad bytes; DepthMismatchError
            when the shard's depth differs from this tree's.
            InvalidArgumentError: a snapshot loaded into a non-empty tree.
        """
        h = self._write_begin()
        try:
            lowlevel.tree_load(h, data)
        finally:
            self._wlock.release()

    def close(self) -> None:
        """Free the tree's memory now; later use raises TreeClosedError.

        Closing twice is allowed.
        """
        lock = self._wlock
        if not lock.acquire(False):
            raise RuntimeError(_BUSY)
        try:
            if self._readers:
                raise RuntimeError("cannot close a SuffixTree while other threads read it")
            h, self._h = self._h, None
            if h is not None:
                lowlevel.release(h)
        finally:
            lock.release()

    def __enter__(self) -> SuffixTree:
        """Use the tree in a ``with`` block; it is closed on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the tree."""
        self.close()

    # --- reading ----------------------------------------------------------

    def __contains__(self, seq_id: object) -> bool:
        """Whether a sequence with this id is in the tree (False for non-ids)."""
        if type(seq_id) is not int:
            try:
                seq_id = check_seq_id(seq_id)
            except (TypeError, InvalidArgumentError):
                return False
        elif not lowlevel.INT64_MIN <= seq_id <= lowlevel.INT64_MAX:
            return False
        h = self._read_begin()
        try:
            return lowlevel.tree_contains(h, seq_id)
        finally:
            self._readers.pop()

    def __len__(self) -> int:
        """Number of sequences."""
        return self.stats().sequences

    def sequence(self, seq_id: int) -> list[int]:
        """The tokens of one sequence.

        Raises:
            SequenceNotFoundError: no such sequence.
        """
        sid = check_seq_id(seq_id)
        h = self._read_begin()
        try:
            return lowlevel.tree_sequence(h, sid)
        finally:
            self._readers.pop()

    def sequence_ids(self) -> list[int]:
        """Ids of all sequences, oldest first."""
        h = self._read_begin()
        try:
            return lowlevel.tree_seq_ids(h)
        finally:
            self._readers.pop()

    def count(self, tokens: TokenArray) -> int:
        """Occurrences of a token string (0 if absent or longer than max_depth)."""
        ptr, n, keep = as_int32_buffer(tokens)
        h = self._read_begin()
        try:
            return lowlevel.tree_count(h, ptr, n, keep)
        finally:
            self._readers.pop()

    def stats(self) -> TreeStats:
        """Current size of the tree."""
        h = self._read_begin()
        try:
            return TreeStats(*lowlevel.tree_stats(h))
        finally:
            self._readers.pop()

    def _live_bytes(self) -> int:
        """``stats().bytes - stats().free_bytes``, cheaply (for byte budgets)."""
        h = self._read_begin()
        try:
            return lowlevel.tree_live_bytes(h)
        finally:
            self._readers.pop()

    def check(self) -> None:
        """Verify the tree's internal invariants (for tests and debugging).

        Raises:
            ShardFormatError: the tree is internally inconsistent.
        """
        h = self._read_begin()
        try:
            lowlevel.tree_check(h)
        finally:
            self._readers.pop()

    def to_bytes(self) -> bytes:
        """A snapshot of every sequence (open ones load back closed)."""
        h = self._read_begin()
        try:
            return lowlevel.tree_save(h)
        finally:
            self._readers.pop()

    def delta_bytes(self, add_ids: Iterable[int], remove_ids: Iterable[int] = ()) -> bytes:
        """A delta shard: the sequences ``add_ids`` of this tree plus removals.

        Apply it to another tree with `load`.

        Raises:
            SequenceNotFoundError: an id of ``add_ids`` is not in this tree.
        """
        adds = _id_list(add_ids, "add_ids")
        removes = _id_list(remove_ids, "remove_ids")
        h = self._read_begin()
        try:
            return lowlevel.tree_save_delta(h, adds, removes)
        finally:
            self._readers.pop()

    def draft(
        self, context: TokenArray, params: DraftParams | None = None, **overrides: Any
    ) -> Draft:
        """Draft continuations of ``context`` from this tree alone.

        The tree acts as the global tree; there is no per-request tree.
        Keyword overrides replace fields of ``params``, e.g. ``tree=True``.
        """
        p = params if params is not None and not overrides else resolve_params(params, overrides)
        c_params = p._c
        ptr, n, keep = as_int32_buffer(context)
        bufs = thread_buffers(p.max_spec_tokens)
        h = self._read_begin()
        try:
            lowlevel.draft_context(h, lowlevel.NULL, ptr, n, keep, c_params, bufs)
        finally:
            self._readers.pop()
        return draft_from_buffers(bufs)
