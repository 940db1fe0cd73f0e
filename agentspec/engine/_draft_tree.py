"""Draft trees as the verifier sees them: tokens, parents, depths, ancestor sets.

`DraftTree` is the one draft type of the engine path.  A draft from a shard
(an `agentspec.Draft`, or anything `DraftLike`) becomes one once, at the
entry: `prune_draft_tree` (the engine: tokens the model cannot take end their
branch) or `as_draft_tree` (strict: they raise), each cutting the tree to
``max_depth`` in the same call.  A tree built by either remembers the
vocabulary it was checked against, so the verifier takes it as it is.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from agentspec.exceptions import InvalidArgumentError, InvalidTokenError

__all__ = ["DraftLike", "DraftTree", "as_draft_tree", "prune_draft_tree"]


@runtime_checkable
class DraftLike(Protocol):
    """Anything with ``token_ids`` and ``parents`` (e.g. `agentspec.Draft`)."""

    @property
    def token_ids(self) -> Sequence[int]:
        """The drafted tokens."""

    @property
    def parents(self) -> Sequence[int] | None:
        """Each token's parent index (-1: the context), or None for a chain."""


@dataclass(frozen=True)
class DraftTree:
    """A validated draft: ``tokens[i]`` follows ``tokens[parents[i]]`` (-1: the context).

    Every parent index is smaller than its child's index, so the nodes are in
    topological order.  ``depths[i]`` is 1 for a root node, and a chain has
    ``parents == [-1, 0, 1, ...]``.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False)
    children: tuple[tuple[int, ...], ...] = field(init=False)  # [0] = roots, [1+i] = of node i
    # Every token is known to be below this (0: not checked); see `_checked`.
    _below: int = field(default=0, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Derive depths and children lists (parents are assumed validated)."""
        depths: list[int] = []
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            depths.append(1 if p < 0 else depths[p] + 1)
            kids[p + 1].append(i)
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "children", tuple(tuple(k) for k in kids))

    def __len__(self) -> int:
        """Number of draft nodes."""
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Whether the draft is a single chain ``[-1, 0, 1, ...]``."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def ancestors(self) -> np.ndarray:
        """``(n, n)`` bool matrix: ``[i, j]`` is True when j is i or an ancestor of i."""
        n = len(self.tokens)
        anc = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                anc[i] = anc[p]
            anc[i, i] = True
        return anc

    def trimmed(self, max_depth: int, max_nodes: int | None = None) -> DraftTree:
        """The nodes of depth <= ``max_depth`` among the first ``max_nodes``, re-indexed."""
        limit = len(self.tokens) if max_nodes is None else min(max_nodes, len(self.tokens))
        keep = [i for i in range(limit) if self.depths[i] <= max_depth]
        if len(keep) == len(self.tokens):
            return self
        new_index = {old: new for new, old in enumerate(keep)}
        # A kept node's ancestors are kept too: they have smaller indices and depths.
        parents = tuple(-1 if self.parents[i] < 0 else new_index[self.parents[i]] for i in keep)
        return _checked(DraftTree(tuple(self.tokens[i] for i in keep), parents), self._below)


def _checked(tree: DraftTree, below: int) -> DraftTree:
    """``tree``, marked as holding only tokens in ``[0, below)``."""
    object.__setattr__(tree, "_below", below)
    return tree


_EMPTY = DraftTree((), ())


def _int_list(name: str, values: Any) -> list[int]:
    """``values`` as a list of Python ints, or TypeError."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints, not {type(values).__name__}")
    try:
        return [operator.index(v) for v in values]
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints") from None


def _shape(
    draft: DraftLike | tuple[Sequence[int], Sequence[int] | None] | Sequence[int],
) -> tuple[list[int], list[int]]:
    """A non-tree draft's ``(tokens, parents)`` as int lists, the parents validated."""
    if isinstance(draft, DraftLike):
        tokens, parents = draft.token_ids, draft.parents
    elif isinstance(draft, tuple) and len(draft) == 2 and not isinstance(draft[0], int):
        tokens, parents = draft
    else:
        tokens, parents = draft, None
    toks = _int_list("token_ids", tokens)
    if not toks:
        return [], []
    pars = list(range(-1, len(toks) - 1)) if parents is None else _int_list("parents", parents)
    if len(pars) != len(toks):
        raise InvalidArgumentError(
            "parents must have one entry per draft token", f"{len(pars)} != {len(toks)}"
        )
    for i, p in enumerate(pars):
        if not -1 <= p < i:
            raise InvalidArgumentError("each parent must be -1 or an earlier node", f"node {i}")
    return toks, pars


def as_draft_tree(
    draft: DraftTree
    | DraftLike
    | tuple[Sequence[int], Sequence[int] | None]
    | Sequence[int]
    | None,
    vocab_size: int | None = None,
    max_depth: int | None = None,
) -> DraftTree:
    """Normalise a draft to a validated `DraftTree`.

    Accepts None (no draft), a `DraftTree` (returned as is), a `DraftLike`
    (``token_ids`` + ``parents``, with ``parents=None`` meaning a chain), a
    ``(token_ids, parents)`` pair, or a plain sequence of token ids (a chain).
    With ``max_depth`` the nodes deeper than that are dropped
    (`DraftTree.trimmed`), after every token was checked.

    Raises:
        TypeError: not one of those shapes.
        InvalidTokenError: a token outside ``[0, vocab_size)``.
        InvalidArgumentError: parents of the wrong length, or a parent index
            not in ``[-1, i)`` for node i.
    """
    if draft is None:
        return _EMPTY
    if isinstance(draft, DraftTree):
        if (
            vocab_size is not None
            and not 0 < draft._below <= vocab_size  # not already checked against it
            and any(not 0 <= t < vocab_size for t in draft.tokens)
        ):
            raise InvalidTokenError(f"draft token outside [0, {vocab_size})")
        return draft if max_depth is None else draft.trimmed(max_depth)
    toks, pars = _shape(draft)
    if not toks:
        return _EMPTY
    hi = vocab_size if vocab_size is not None else 2**31
    for i, t in enumerate(toks):
        if not 0 <= t < hi:
            raise InvalidTokenError(f"draft token {t} outside [0, {hi})", f"node {i}")
    tree = _checked(DraftTree(tuple(toks), tuple(pars)), hi)
    return tree if max_depth is None else tree.trimmed(max_depth)


def prune_draft_tree(
    draft: DraftTree
    | DraftLike
    | tuple[Sequence[int], Sequence[int] | None]
    | Sequence[int]
    | None,
    vocab_size: int,
    max_depth: int | None = None,
) -> DraftTree:
    """Like `as_draft_tree`, but a token outside ``[0, vocab_size)`` ends its branch.

    Such a node is dropped together with its subtree: a chain keeps the
    prefix before its first bad token, a tree every node whose path from
    the context holds only valid tokens.  Drafts come from shards (a pushed
    shard may hold any ids), and a draft is only a guess: the model is never
    given a token it cannot take.  With ``max_depth`` the nodes deeper than
    that are dropped in the same pass (as `DraftTree.trimmed` does).

    Raises:
        TypeError, InvalidArgumentError: a malformed draft (see `as_draft_tree`).
    """
    if draft is None:
        return _EMPTY
    if isinstance(draft, DraftTree):
        toks, pars = list(draft.tokens), list(draft.parents)
    else:
        toks, pars = _shape(draft)
    deepest = len(toks) if max_depth is None else max_depth
    keep: list[int] = []
    new_index: dict[int, int] = {}
    depth: dict[int, int] = {}
    for i, (t, p) in enumerate(zip(toks, pars, strict=True)):
        if 0 <= t < vocab_size and (p < 0 or p in new_index):
            d = 1 if p < 0 else depth[p] + 1
            if d <= deepest:
                depth[i] = d
                new_index[i] = len(keep)
                keep.append(i)
    if len(keep) == len(toks):
        if isinstance(draft, DraftTree):
            return draft if 0 < draft._below <= vocab_size else _checked(draft, vocab_size)
        return _checked(DraftTree(tuple(toks), tuple(pars)), vocab_size)
    parents = tuple(-1 if pars[i] < 0 else new_index[pars[i]] for i in keep)
    return _checked(DraftTree(tuple(toks[i] for i in keep), parents), vocab_size)
