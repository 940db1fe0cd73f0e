"""Batched drafting: one native call per decode step for many requests."""

from __future__ import annotations

import array
import bisect
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from agentspec._core import lowlevel
from agentspec._core.cursor import Cursor
from agentspec._core.draft import Draft, DraftParams, make_draft, resolve_params
from agentspec._core.tokens import TokenArray, as_int32_buffer
from agentspec._core.tree import SuffixTree
from agentspec._util.args import as_int
from agentspec.exceptions import CapacityError, InvalidArgumentError

__all__ = ["BatchDrafter", "BatchItem", "draft_batch"]

#: One request of a batch: its cursor, the global tree(s) to draft from (one
#: tree, a sequence of at most `lowlevel.MAX_GLOBALS` trees in order of
#: preference on equal scores, or None) and the tokens accepted since its last
#: draft (or None).
BatchItem = tuple[Cursor, "SuffixTree | Sequence[SuffixTree] | None", "TokenArray | None"]

_MAX_THREADS = 1024


def _note(exc: BaseException, index: int) -> None:
    """Attach the batch item index to an exception raised while converting it."""
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(f"in batch item {index}")


class BatchDrafter:
    """Drafts for a whole batch of requests in one native call.

    For each item ``(cursor, global_trees, new_tokens)``, `draft` appends
    ``new_tokens`` (if not None) to the cursor, then drafts from the cursor
    and ``global_trees`` (one `SuffixTree`, a sequence of up to four, as
    `Speculator` drafts from, or None) with this drafter's params and, if
    given, a per-item cap on the draft length.  All items
    run in one C call that releases the GIL and, with ``threads > 1``, spreads
    the items over that many worker threads.

    Output buffers for ``max_batch`` rows are allocated once, so a drafter
    should be created once and reused every decode step.  A drafter is used
    by one thread at a time (a concurrent `draft` raises RuntimeError).

    Errors: items are converted and checked before anything is appended, so
    a bad item, a bad token (of any item) or a closed/busy cursor or tree
    raises before any change, naming the item.  An error the engine reports
    for one item during the call (running out of memory) does not stop the
    other items: they keep their appended tokens, and the exception of the
    first failing item is raised (its index in the message) instead of the
    drafts.
    """

    __slots__ = ("_bufs", "_lock", "_max_batch", "_params", "_threads")

    def __init__(
        self, params: DraftParams | None = None, *, max_batch: int = 256, threads: int = 1
    ) -> None:
        """Allocate buffers for up to ``max_batch`` items per call.

        Raises:
            InvalidArgumentError: max_batch or threads below 1 (or absurdly large).
        """
        self._params = resolve_params(params, {})
        self._max_batch = as_int(max_batch, "max_batch", 1, 2**24)
        self._threads = as_int(threads, "threads", 1, _MAX_THREADS)
        self._bufs = lowlevel.BatchBuffers(self._max_batch, self._params.max_spec_tokens)
        self._lock = threading.Lock()

    @property
    def params(self) -> DraftParams:
        """The parameters every draft of this drafter uses."""
        return self._params

    @property
    def max_batch(self) -> int:
        """Most items one `draft` call accepts."""
        return self._max_batch

    @property
    def threads(self) -> int:
        """Worker threads per call (1: the calling thread only)."""
        return self._threads

    def __repr__(self) -> str:
        """Short description."""
        return (
            f"<BatchDrafter max_batch={self._max_batch} threads={self._threads} "
            f"max_spec_tokens={self._params.max_spec_tokens}>"
        )

    def draft(self, items: Sequence[BatchItem], caps: Sequence[int] | None = None) -> list[Draft]:
        """Append each item's new tokens to its cursor, then draft; one result per item.

        ``caps``: per item, the most tokens its draft may hold (0: no draft,
        its tokens are still appended); values above the params'
        ``max_spec_tokens`` are clamped to it.

        Raises:
            CapacityError: more than ``max_batch`` items.
            TypeError: an item is not ``(Cursor, trees, tokens | None)``.
            InvalidArgumentError: the same cursor appears twice, more than
                four trees in an item, or bad caps.
            RuntimeError: a cursor or tree is in use by another thread, or
                this drafter is.
            TreeClosedError: a cursor or tree is closed.
        """
        return [d for d, _ in self.draft_indexed(items, caps)]

    def draft_indexed(
        self, items: Sequence[BatchItem], caps: Sequence[int] | None = None
    ) -> list[tuple[Draft, int]]:
        """`draft`, plus per item the index among its global trees of the tree
        its draft came from (0 when it came from none)."""
        items = list(items)
        n = len(items)
        if n == 0:
            return []
        if n > self._max_batch:
            raise CapacityError(
                f"batch of {n} items exceeds max_batch={self._max_batch}", "split the batch"
            )
        cursors, trees, new_tokens, offsets = self._convert(items)
        return self._draft_rows(
            cursors, trees, new_tokens, offsets, None if caps is None else _check_caps(caps, n)
        )

    def _draft_rows(
        self,
        cursors: Sequence[Cursor],
        trees: Sequence[Sequence[SuffixTree]],
        new_tokens: array.array[int] | None,
        offsets: list[int],
        caps: list[int] | None,
    ) -> list[tuple[Draft, int]]:
        """`draft_indexed` on checked input: distinct cursors, tuples of at most
        `lowlevel.MAX_GLOBALS` SuffixTrees, caps from `_check_caps` (or None)
        and new tokens from `_convert`.  Also `Speculator.draft_batch`'s path."""
        n = len(cursors)
        if n > self._max_batch:
            raise CapacityError(
                f"batch of {n} items exceeds max_batch={self._max_batch}", "split the batch"
            )
        if not self._lock.acquire(False):
            raise RuntimeError("concurrent use of a BatchDrafter from several threads")
        bufs = self._bufs
        c_cursors = bufs.cursors
        c_globals = bufs.globals
        n_globals = bufs.n_globals
        width = lowlevel.MAX_GLOBALS
        entered = 0
        reading: list[SuffixTree] = []
        try:
            for i in range(n):
                c_cursors[i] = cursors[i]._enter()
                entered += 1
                own = trees[i]
                n_globals[i] = len(own)
                base = i * width
                for k, tree in enumerate(own):
                    c_globals[base + k] = tree._read_begin()
                    reading.append(tree)
            if caps is not None:
                bufs.caps[0:n] = caps
            status = bufs.run(
                n, new_tokens, offsets, self._params._c, self._threads, caps=caps is not None
            )
            if status:
                failed = bufs.first_error(n)
                if failed is None:
                    raise lowlevel.error(status)
                raise lowlevel.error(failed[1], f"batch item {failed[0]}")
            return [(make_draft(row), row[6]) for row in bufs.results(n)]
        finally:
            # The pointer rows keep stale handles until the next call
            # overwrites them; they are never read past an item's count.
            for tree in reading:
                tree._readers.pop()
            for i in range(entered):
                cursors[i]._lock.release()
            self._lock.release()

    @staticmethod
    def _convert(
        items: list[Any],
    ) -> tuple[list[Cursor], list[tuple[SuffixTree, ...]], array.array[int] | None, list[int]]:
        """Check the items and pack their new tokens into one array; no side effects."""
        cursors: list[Cursor] = []
        trees: list[tuple[SuffixTree, ...]] = []
        packed = array.array("i")
        offsets = [0]
        any_tokens = False
        for i, item in enumerate(items):
            try:
                cursor, tree, tokens = item
            except (TypeError, ValueError):
                raise TypeError(
                    f"batch item {i} must be (cursor, global_trees_or_None, new_tokens_or_None)"
                ) from None
            if type(cursor) is not Cursor and not isinstance(cursor, Cursor):
                raise TypeError(f"batch item {i}: expected a Cursor, not {type(cursor).__name__}")
            cursors.append(cursor)
            trees.append(_item_trees(tree, i))
            if tokens is not None:
                any_tokens = True
                try:
                    if type(tokens) is list:
                        try:
                            packed.extend(tokens)
                        except (OverflowError, TypeError):
                            as_int32_buffer(tokens)  # raises the precise error
                            raise  # pragma: no cover  (as_int32_buffer raised)
                    else:
                        _, _, keep = as_int32_buffer(tokens)
                        packed.frombytes(memoryview(keep).cast("B"))
                except (TypeError, ValueError) as exc:
                    _note(exc, i)
                    raise
            offsets.append(len(packed))
        if len(set(map(id, cursors))) != len(cursors):
            seen: set[int] = set()
            for i, cursor in enumerate(cursors):
                if id(cursor) in seen:
                    raise InvalidArgumentError(
                        "the same cursor appears twice in a batch", f"item {i}"
                    )
                seen.add(id(cursor))
        if not any_tokens:
            return cursors, trees, None, offsets
        if packed and min(packed) < 0:
            first = next(j for j, v in enumerate(packed) if v < 0)
            i = bisect.bisect_right(offsets, first) - 1
            raise lowlevel.error(
                lowlevel.ERR_INVALID_TOKEN,
                f"batch item {i}",
                f"index {first - offsets[i]}: value {packed[first]}",
            )
        return cursors, trees, packed, offsets


def _item_trees(trees: object, index: int) -> tuple[SuffixTree, ...]:
    """An item's global trees as a checked tuple (None: none)."""
    if trees is None:
        return ()
    if isinstance(trees, SuffixTree):
        return (trees,)
    if isinstance(trees, (list, tuple)):
        out = tuple(trees)
        if len(out) > lowlevel.MAX_GLOBALS:
            raise InvalidArgumentError(
                f"batch item {index}: at most {lowlevel.MAX_GLOBALS} global trees",
                f"got {len(out)}",
            )
        for tree in out:
            if not isinstance(tree, SuffixTree):
                raise TypeError(
                    f"batch item {index}: expected SuffixTree global trees, "
                    f"not {type(tree).__name__}"
                )
        return out
    raise TypeError(
        f"batch item {index}: expected a SuffixTree, a list of them or None, "
        f"not {type(trees).__name__}"
    )


def _check_caps(caps: Sequence[int], n: int) -> list[int]:
    """Per-item draft caps: n non-negative ints."""
    out = list(caps)
    if len(out) != n:
        raise InvalidArgumentError(f"caps must have one entry per item ({n}), not {len(out)}")
    for i, cap in enumerate(out):
        out[i] = min(as_int(cap, f"caps[{i}]", 0), 2**32 - 1)
    return out


def draft_batch(
    items: Iterable[BatchItem], params: DraftParams | None = None, threads: int = 1
) -> list[Draft]:
    """One-shot `BatchDrafter.draft` (allocates buffers for exactly these items)."""
    batch = list(items)
    if not batch:
        return []
    return BatchDrafter(params, max_batch=len(batch), threads=threads).draft(batch)
