"""The per-request `Cursor`: a request's context, its own tree, and drafting from both."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from agentspec._core import lowlevel
from agentspec._core.draft import (
    DEFAULT_PARAMS,
    Draft,
    DraftParams,
    DraftResult,
    check_max_depth,
    make_draft,
    resolve_params,
)
from agentspec._core.tokens import _INT32, TokenArray, as_int32_buffer
from agentspec._core.tree import SuffixTree, TreeStats
from agentspec.exceptions import TreeClosedError

__all__ = ["Cursor", "read_begin"]

T = TypeVar("T")

_NDARRAY = np.ndarray
_int32_ptr = lowlevel.int32_ptr_fast
_draft_tail_c = lowlevel.draft_tail_c
_unpack = lowlevel.unpack_raw
_CHAIN_PARENTS = lowlevel.CHAIN_PARENTS


def read_begin(tree: SuffixTree) -> lowlevel.CData:
    """Register a reader of ``tree`` (a `SuffixTree`) and return its handle."""
    try:
        begin = tree._read_begin
    except AttributeError:
        raise TypeError(f"expected a SuffixTree or None, not {type(tree).__name__}") from None
    return begin()


class Cursor:
    """Per-request drafting state: the request's context and its own tree.

    A cursor holds the context of one request (prompt first, then every
    accepted token, appended with `extend`) and, with ``local_tree=True``, a
    per-request suffix tree over that context, so the request can draft from
    its own earlier text.  It matches the context incrementally: drafting
    after an extend costs about as much as the longest match, not the
    context length.

    A cursor belongs to one thread at a time; using it from a second thread
    while the first is inside a call raises RuntimeError.  Release it with
    `close` or a ``with`` block (garbage collection also frees it).
    """

    __slots__ = ("__weakref__", "_bufs", "_h", "_local", "_lock", "_max_depth")

    def __init__(
        self,
        max_depth: int = lowlevel.DEFAULT_MAX_DEPTH,
        *,
        local_tree: bool = True,
        prompt: TokenArray | None = None,
    ) -> None:
        """Create a cursor; ``prompt``, if given, is extended right away.

        Raises:
            InvalidArgumentError: max_depth outside [2, 1024].
            TypeError, InvalidTokenError: a bad prompt (nothing is kept).
        """
        depth = check_max_depth(max_depth)
        self._max_depth = depth
        self._local = bool(local_tree)
        self._lock = threading.Lock()
        self._h: lowlevel.CData | None = None
        prompt_buf = None if prompt is None else as_int32_buffer(prompt)
        handle = lowlevel.cursor_create(depth, self._local)
        if prompt_buf is not None:
            ptr, n, keep = prompt_buf
            try:
                lowlevel.cursor_extend(handle, ptr, n, keep)
            except BaseException:
                lowlevel.release(handle)
                raise
        self._h = handle
        self._bufs: lowlevel.DraftBuffers | None = None  # made on the first draft

    # --- state ------------------------------------------------------------

    def _buffers(self, cap: int) -> lowlevel.DraftBuffers:
        """This cursor's output buffers, with room for ``cap`` tokens."""
        bufs = self._bufs
        if bufs is None:
            bufs = self._bufs = lowlevel.DraftBuffers(max(cap, DEFAULT_PARAMS.max_spec_tokens))
        elif cap > bufs.cap:
            bufs.ensure(cap)
        return bufs

    def _enter(self) -> lowlevel.CData:
        """Take the cursor's lock (non-blocking) and return the live handle."""
        if not self._lock.acquire(False):
            raise RuntimeError("concurrent use of a Cursor: another thread is using it right now")
        h = self._h
        if h is None:
            self._lock.release()
            raise TreeClosedError("the cursor is closed")
        return h

    @property
    def max_depth(self) -> int:
        """Longest pattern + draft depth this cursor works with."""
        return self._max_depth

    @property
    def has_local_tree(self) -> bool:
        """Whether the cursor keeps a per-request tree over its context."""
        return self._local

    @property
    def closed(self) -> bool:
        """True after `close`."""
        return self._h is None

    def __len__(self) -> int:
        """Context length in tokens."""
        h = self._enter()
        try:
            return lowlevel.cursor_len(h)
        finally:
            self._lock.release()

    def __repr__(self) -> str:
        """Short description with depth and context length."""
        if self._h is None:
            return f"<Cursor max_depth={self._max_depth} closed>"
        return f"<Cursor max_depth={self._max_depth} len={lowlevel.cursor_len(self._h)}>"

    # --- operations -------------------------------------------------------

    def extend(self, tokens: TokenArray) -> None:
        """Append tokens to the context (the prompt, then accepted tokens).

        Raises:
            TypeError, InvalidTokenError: bad tokens (nothing is appended).
            TreeClosedError: the cursor is closed.
        """
        ptr, n, keep = as_int32_buffer(tokens)
        self._extend_buffer(ptr, n, keep)

    def _extend_buffer(self, ptr: lowlevel.CData, n: int, keep: Any) -> None:
        """`extend` for an already converted buffer (see `as_int32_buffer`)."""
        h = self._enter()
        try:
            lowlevel.cursor_extend(h, ptr, n, keep)
        finally:
            self._lock.release()

    def local_stats(self) -> TreeStats | None:
        """Statistics of the per-request tree, or None without one."""
        h = self._enter()
        try:
            local = lowlevel.cursor_local_tree(h)
            if local == lowlevel.NULL:
                return None
            return TreeStats(*lowlevel.tree_stats(local))
        finally:
            self._lock.release()

    def draft(
        self,
        global_tree: SuffixTree | None = None,
        params: DraftParams | None = None,
        **overrides: Any,
    ) -> Draft:
        """Draft the next tokens from this request's context.

        Uses the per-request tree (unless ``use_local=False`` or the cursor
        has none) and ``global_tree`` (unless None or ``use_global=False``).
        Keyword overrides replace fields of ``params``, e.g. ``tree=True``.

        Raises:
            TreeClosedError: the cursor or the global tree is closed.
            RuntimeError: another thread is modifying ``global_tree``.
        """
        p = params if params is not None and not overrides else resolve_params(params, overrides)
        return make_draft(self._draft_result(global_tree, p))

    def _draft_result(self, global_tree: SuffixTree | None, params: DraftParams) -> DraftResult:
        """`draft` returning the raw `DraftBuffers.result` tuple."""
        c_params = params._c
        h = self._enter()
        try:
            bufs = self._buffers(params.max_spec_tokens)
            if global_tree is None:
                return lowlevel.draft(h, lowlevel.NULL, c_params, bufs)
            g = read_begin(global_tree)
            try:
                return lowlevel.draft(h, g, c_params, bufs)
            finally:
                global_tree._read_end()
        finally:
            self._lock.release()

    def _draft_multi(
        self, trees: list[SuffixTree], params: DraftParams, handles: lowlevel.CData
    ) -> tuple[Draft, int]:
        """Draft from this cursor and several global trees (at most 4, checked
        `SuffixTree`s, in order of preference on equal scores); ``handles`` is
        scratch from `lowlevel.new_tree_array`.  Returns the draft and the
        index in ``trees`` of the tree it came from (0 when none).  The
        per-step path of `Speculator.draft`, so it makes few Python calls.
        """
        lock = self._lock
        if not lock.acquire(False):
            raise RuntimeError("concurrent use of a Cursor: another thread is using it right now")
        begun = 0
        try:
            h = self._h
            if h is None:
                raise TreeClosedError("the cursor is closed")
            for tree in trees:
                handles[begun] = tree._read_begin()
                begun += 1
            bufs = self._bufs
            if bufs is None or bufs.cap < params.max_spec_tokens:
                bufs = self._buffers(params.max_spec_tokens)
            row = lowlevel.draft_multi(h, handles, begun, params._c, bufs)
            return make_draft(row), row[6]
        finally:
            for i in range(begun):
                trees[i]._readers.pop()
            lock.release()

    def _draft_tail(
        self,
        context: TokenArray,
        global_tree: SuffixTree | None,
        params: DraftParams,
        make: Callable[[list[int], list[int], list[float], float, int], T],
    ) -> T:
        """Draft for a caller-supplied ``context`` (usually this cursor's own tail).

        When ``context`` ends with this cursor's last tokens and covers every
        pattern length it tracks, this is `draft` (incremental); otherwise the
        context is matched from scratch against this cursor's tree and
        ``global_tree``.  The check and the draft are one native call.
        Returns ``make(tokens, parents, probs, score, match_len)``, built
        straight from the buffers; a chain draft's parents are sliced from a
        prebuilt list rather than unpacked.
        """
        # This is arctic's `speculate` (once per request per vLLM step), so
        # as_int32_buffer's common case, `_enter`, `SuffixTree._read_begin`
        # and the native call are inlined (see lowlevel's "unwrapped" section).
        if type(context) is _NDARRAY and context.dtype is _INT32 and context.ndim == 1:
            try:
                ptr, n, keep = _int32_ptr(context), len(context), context
            except ValueError:  # not contiguous: the checked path says why
                ptr, n, keep = as_int32_buffer(context)
        else:
            ptr, n, keep = as_int32_buffer(context)
        lock = self._lock
        if not lock.acquire(False):
            raise RuntimeError("concurrent use of a Cursor: another thread is using it right now")
        try:
            h = self._h
            if h is None:
                raise TreeClosedError("the cursor is closed")
            bufs = self._bufs
            if bufs is None or params.max_spec_tokens > bufs.cap:
                bufs = self._buffers(params.max_spec_tokens)
            out = bufs.out
            if global_tree is None:
                status = _draft_tail_c(h, lowlevel.NULL, ptr, n, params._c, out)
            else:
                readers = global_tree._readers
                readers.append(None)  # registered before the writer's lock is checked
                g = global_tree._h
                if g is None or global_tree._wlock.locked():
                    readers.pop()
                    g = global_tree._read_begin()  # raises the error that applies
                try:
                    status = _draft_tail_c(h, g, ptr, n, params._c, out)
                finally:
                    readers.pop()
            if status:
                lowlevel.check_tokens(status, keep)
            k = out.n
            return make(
                _unpack(bufs.tokens, k),
                _unpack(bufs.parents, k) if params.tree else _CHAIN_PARENTS[:k],
                _unpack(bufs.probs, k),
                out.score,
                out.match_len,
            )
        finally:
            lock.release()

    def close(self) -> None:
        """Free the cursor's memory now; later use raises TreeClosedError.

        Closing twice is allowed.
        """
        if not self._lock.acquire(False):
            raise RuntimeError("cannot close a Cursor while another thread is using it")
        try:
            h, self._h = self._h, None
            if h is not None:
                lowlevel.release(h)
        finally:
            self._lock.release()

    def __enter__(self) -> Cursor:
        """Use the cursor in a ``with`` block; it is closed on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the cursor."""
        self.close()
