"""Drafting: `DraftParams`, `Draft` and the per-request `Cursor`."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from agentspec import _lowlevel
from agentspec._args import as_int
from agentspec._tokens import TokenArray, as_int32_buffer
from agentspec.exceptions import InvalidArgumentError, TreeClosedError

if TYPE_CHECKING:
    from agentspec._tree import SuffixTree, TreeStats

__all__ = ["Cursor", "Draft", "DraftParams"]

T = TypeVar("T")

#: Draft.source for the C ``source`` codes 0..3.
SOURCES = ("none", "global", "local", "merged")

#: ``(tokens, parents, probs, score, match_len, source code)`` as read from C.
DraftResult = tuple[list[int], list[int], list[float], float, int, int]

_UINT32_MAX = 2**32 - 1
#: Largest vocab_size: token ids are int32 values >= 0, so 2**31 bounds nothing.
_VOCAB_MAX = 2**31


def check_max_depth(max_depth: object, name: str = "max_depth") -> int:
    """Validate a tree/cursor depth: an int in [2, AS_MAX_DEPTH_LIMIT], as a plain int."""
    return as_int(max_depth, name, 2, _lowlevel.MAX_DEPTH_LIMIT)


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be finite", f"got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, not {type(value).__name__}")


@dataclass(frozen=True)
class DraftParams:
    """How drafts are built (see docs/design-native.md for the exact semantics).

    Attributes:
        max_spec_tokens: most tokens in one draft, 1..AS_MAX_SPEC_LIMIT (1024).
        alpha: draft budget per matched token (>= 0): a match of length p
            drafts at most ``floor(alpha*p + offset)`` tokens.
        offset: constant part of that budget.
        min_token_prob: tokens whose path probability falls below this are
            not drafted; in [0, 1].
        tree: best-first tree drafts instead of a single chain.
        merge: add the counts of the global and per-request trees per string
            instead of drafting from each and keeping the better.
        use_local: draft from the per-request tree of a Cursor.
        use_global: draft from the global tree.
        min_score: drafts scoring below this are returned empty.
        max_pattern: longest pattern (context suffix) tried; 0 = max_depth-1.
        min_pattern: shortest pattern tried; 0 = 1.
        vocab_size: the model's vocabulary size, or None (no bound).  A
            token id >= vocab_size ends its branch: a chain stops before it,
            a tree draft leaves it (and everything below it) out; the other
            tokens keep their probabilities.  Shards learned from another
            model's tokenizer then never put unverifiable ids in a draft.

    Instances are immutable and cache their C struct, so reusing one instance
    across calls is the cheap way to draft.
    """

    max_spec_tokens: int = 32
    alpha: float = 1.0
    offset: float = 0.0
    min_token_prob: float = 0.1
    tree: bool = False
    merge: bool = False
    use_local: bool = True
    use_global: bool = True
    min_score: float = 0.0
    max_pattern: int = 0
    min_pattern: int = 0
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        """Validate every field; bad values raise TypeError or InvalidArgumentError."""
        # Integer fields may be any integral type (numpy scalars included):
        # stored as plain ints, so equal params hash alike and C gets ints.
        for name, lo, hi in (
            ("max_spec_tokens", 1, _lowlevel.MAX_SPEC_LIMIT),
            ("max_pattern", 0, _UINT32_MAX),
            ("min_pattern", 0, _UINT32_MAX),
        ):
            value = getattr(self, name)
            if type(value) is not int or not lo <= value <= hi:
                object.__setattr__(self, name, as_int(value, name, lo, hi))
        if self.vocab_size is not None and (
            type(self.vocab_size) is not int or not 1 <= self.vocab_size <= _VOCAB_MAX
        ):
            object.__setattr__(
                self,
                "vocab_size",
                as_int(self.vocab_size, "vocab_size", 1, _VOCAB_MAX, expected="an int or None"),
            )
        _check_float("alpha", self.alpha)
        if self.alpha < 0:
            raise InvalidArgumentError("alpha must be >= 0", f"got {self.alpha}")
        _check_float("offset", self.offset)
        _check_float("min_token_prob", self.min_token_prob)
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise InvalidArgumentError(
                "min_token_prob must be in [0, 1]", f"got {self.min_token_prob}"
            )
        _check_float("min_score", self.min_score)
        if self.max_pattern != 0 and self.min_pattern > self.max_pattern:
            raise InvalidArgumentError(
                "min_pattern must not exceed max_pattern",
                f"got {self.min_pattern} > {self.max_pattern}",
            )
        for name in ("tree", "merge", "use_local", "use_global"):
            _check_bool(name, getattr(self, name))

    def __getstate__(self) -> dict[str, Any]:
        """Pickle/copy the fields only, never the cached C struct."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @cached_property
    def _c(self) -> _lowlevel.CData:
        """The ``as_draft_params`` struct, built once per instance."""
        flags = (
            (_lowlevel.DRAFT_TREE if self.tree else 0)
            | (_lowlevel.DRAFT_MERGE if self.merge else 0)
            | (0 if self.use_local else _lowlevel.DRAFT_NO_LOCAL)
            | (0 if self.use_global else _lowlevel.DRAFT_NO_GLOBAL)
        )
        return _lowlevel.new_params(
            self.max_spec_tokens,
            self.max_pattern,
            self.min_pattern,
            flags,
            float(self.alpha),
            float(self.offset),
            float(self.min_token_prob),
            float(self.min_score),
            self.vocab_size or 0,
        )


_DEFAULT_PARAMS = DraftParams()


def resolve_params(params: DraftParams | None, overrides: dict[str, Any]) -> DraftParams:
    """``params`` (default `DraftParams()`) with keyword ``overrides`` applied."""
    if params is None:
        return DraftParams(**overrides) if overrides else _DEFAULT_PARAMS
    if not isinstance(params, DraftParams):
        raise TypeError(f"params must be a DraftParams, not {type(params).__name__}")
    return dataclasses.replace(params, **overrides) if overrides else params


@dataclass(frozen=True, slots=True)
class Draft:
    """One draft: tokens to verify next, as a chain or a tree.

    Attributes:
        token_ids: the drafted tokens.
        parents: for each token, the index of its parent token in this draft,
            or -1 when it follows the context directly; a chain has
            ``[-1, 0, 1, ...]``.
        probs: each token's estimated probability of being accepted (the
            product of the branch frequencies along its path).
        score: the sum of ``probs``, the expected number of accepted tokens.
        match_len: length of the context suffix the draft continues (0: none).
        source: which tree the draft came from: "none", "global", "local"
            (the per-request tree) or "merged".
    """

    token_ids: list[int]
    parents: list[int]
    probs: list[float]
    score: float
    match_len: int
    source: str

    def __len__(self) -> int:
        """Number of drafted tokens."""
        return len(self.token_ids)


_DRAFT_SLOTS = tuple(
    getattr(Draft, f.name).__set__ for f in dataclasses.fields(Draft)
)  # slot setters: build frozen drafts without frozen __setattr__'s per-field cost


def make_draft(result: tuple[Any, ...]) -> Draft:
    """A `Draft` from a raw ``(tokens, parents, probs, score, match_len, source,
    ...)`` row (further fields, e.g. a global tree index, are ignored).

    Equivalent to ``Draft(*result[:5], SOURCES[result[5]])``, about 3x cheaper:
    drafting is on the decode step's critical path.
    """
    d = object.__new__(Draft)
    s = _DRAFT_SLOTS
    s[0](d, result[0])
    s[1](d, result[1])
    s[2](d, result[2])
    s[3](d, result[3])
    s[4](d, result[4])
    s[5](d, SOURCES[result[5]])
    return d


def draft_from_buffers(bufs: _lowlevel.DraftBuffers) -> Draft:
    """Convert the C output in ``bufs`` to a `Draft`."""
    return make_draft(bufs.result())


_tls = threading.local()


def thread_buffers(cap: int) -> _lowlevel.DraftBuffers:
    """Output buffers private to the calling thread, with room for ``cap`` tokens."""
    bufs: _lowlevel.DraftBuffers | None = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = _lowlevel.DraftBuffers(max(cap, _DEFAULT_PARAMS.max_spec_tokens))
    elif cap > bufs.cap:
        bufs.ensure(cap)
    return bufs


def read_begin(tree: SuffixTree) -> _lowlevel.CData:
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
        max_depth: int = _lowlevel.DEFAULT_MAX_DEPTH,
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
        self._h: _lowlevel.CData | None = None
        prompt_buf = None if prompt is None else as_int32_buffer(prompt)
        handle = _lowlevel.cursor_create(depth, self._local)
        if prompt_buf is not None:
            ptr, n, keep = prompt_buf
            try:
                _lowlevel.cursor_extend(handle, ptr, n, keep)
            except BaseException:
                _lowlevel.release(handle)
                raise
        self._h = handle
        self._bufs: _lowlevel.DraftBuffers | None = None  # made on the first draft

    # --- state ------------------------------------------------------------

    def _buffers(self, cap: int) -> _lowlevel.DraftBuffers:
        """This cursor's output buffers, with room for ``cap`` tokens."""
        bufs = self._bufs
        if bufs is None:
            bufs = self._bufs = _lowlevel.DraftBuffers(max(cap, _DEFAULT_PARAMS.max_spec_tokens))
        elif cap > bufs.cap:
            bufs.ensure(cap)
        return bufs

    def _enter(self) -> _lowlevel.CData:
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
            return _lowlevel.cursor_len(h)
        finally:
            self._lock.release()

    def __repr__(self) -> str:
        """Short description with depth and context length."""
        if self._h is None:
            return f"<Cursor max_depth={self._max_depth} closed>"
        return f"<Cursor max_depth={self._max_depth} len={_lowlevel.cursor_len(self._h)}>"

    # --- operations -------------------------------------------------------

    def extend(self, tokens: TokenArray) -> None:
        """Append tokens to the context (the prompt, then accepted tokens).

        Raises:
            TypeError, InvalidTokenError: bad tokens (nothing is appended).
            TreeClosedError: the cursor is closed.
        """
        ptr, n, keep = as_int32_buffer(tokens)
        self._extend_buffer(ptr, n, keep)

    def _extend_buffer(self, ptr: _lowlevel.CData, n: int, keep: Any) -> None:
        """`extend` for an already converted buffer (see `as_int32_buffer`)."""
        h = self._enter()
        try:
            _lowlevel.cursor_extend(h, ptr, n, keep)
        finally:
            self._lock.release()

    def local_stats(self) -> TreeStats | None:
        """Statistics of the per-request tree, or None without one."""
        from agentspec._tree import TreeStats  # here: _tree imports this module

        h = self._enter()
        try:
            local = _lowlevel.cursor_local_tree(h)
            if local == _lowlevel.NULL:
                return None
            return TreeStats(*_lowlevel.tree_stats(local))
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
                return _lowlevel.draft(h, _lowlevel.NULL, c_params, bufs)
            g = read_begin(global_tree)
            try:
                return _lowlevel.draft(h, g, c_params, bufs)
            finally:
                global_tree._read_end()
        finally:
            self._lock.release()

    def _draft_multi(
        self, trees: list[SuffixTree], params: DraftParams, handles: _lowlevel.CData
    ) -> tuple[Draft, int]:
        """Draft from this cursor and several global trees (at most 4, checked
        `SuffixTree`s, in order of preference on equal scores); ``handles`` is
        scratch from `_lowlevel.new_tree_array`.  Returns the draft and the
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
            row = _lowlevel.draft_multi(h, handles, begun, params._c, bufs)
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
        Returns ``make(tokens, parents, probs, score, match_len)``.
        """
        ptr, n, keep = as_int32_buffer(context)
        # _enter and read_begin inlined: this is vLLM's per-request, per-step call
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
            if global_tree is None:
                return _lowlevel.draft_tail(
                    h, _lowlevel.NULL, ptr, n, keep, params._c, bufs, make, params.tree
                )
            g = global_tree._read_begin()
            try:
                return _lowlevel.draft_tail(h, g, ptr, n, keep, params._c, bufs, make, params.tree)
            finally:
                global_tree._read_end()
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
                _lowlevel.release(h)
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
