"""A tiny, deliberately naive pure-Python model of agentspec's suffix tree.

Written directly from the "Semantics" section of docs/design-native.md and
nothing else, so the native engine can be checked against it.  There is no
cleverness here on purpose: counts are a dict from token tuples to occurrence
counts, rebuilt by enumerating every window of every sequence; drafting
re-derives every candidate pattern from scratch.  It is slow and only meant for
small inputs in tests.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

Counts = dict[tuple[int, ...], int]
Children = dict[tuple[int, ...], dict[int, int]]


def build_counts(sequences: Iterable[Sequence[int]], max_depth: int) -> Counts:
    """Count every substring of length 1..max_depth of every sequence."""
    counts: Counter[tuple[int, ...]] = Counter()
    for seq in sequences:
        toks = tuple(seq)
        for start in range(len(toks)):
            for length in range(1, max_depth + 1):
                if start + length > len(toks):
                    break
                counts[toks[start : start + length]] += 1
    return dict(counts)


def build_children(counts: Mapping[tuple[int, ...], int]) -> Children:
    """Map every string x to {t: count(x + (t,))} for its continuations."""
    children: Children = {}
    for key, cnt in counts.items():
        children.setdefault(key[:-1], {})[key[-1]] = cnt
    return children


@dataclass(frozen=True)
class RefParams:
    """The drafting parameters of the semantics (mirrors DraftParams)."""

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


@dataclass(frozen=True)
class RefDraft:
    """A draft as the semantics define it (mirrors agentspec.Draft)."""

    token_ids: list[int]
    parents: list[int]
    probs: list[float]
    score: float
    match_len: int
    source: str


EMPTY = RefDraft([], [], [], 0.0, 0, "none")


class RefTree:
    """A set of sequences with the counting semantics of a suffix tree."""

    def __init__(self, max_depth: int = 64) -> None:
        """Create an empty tree of the given depth."""
        self.max_depth = max_depth
        self.seqs: dict[int, list[int]] = {}
        self.open: set[int] = set()

    def add(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Add a closed sequence (the id must be new)."""
        assert seq_id not in self.seqs
        self.seqs[seq_id] = list(tokens)

    def append(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append to an open sequence, creating it if new."""
        if seq_id not in self.seqs:
            self.seqs[seq_id] = []
            self.open.add(seq_id)
        assert seq_id in self.open
        self.seqs[seq_id].extend(tokens)

    def close(self, seq_id: int) -> None:
        """Close a sequence: it keeps its tokens."""
        assert seq_id in self.seqs
        self.open.discard(seq_id)

    def remove(self, seq_id: int) -> None:
        """Remove a sequence and all its occurrences."""
        del self.seqs[seq_id]
        self.open.discard(seq_id)

    def counts(self) -> Counts:
        """All occurrence counts of strings up to max_depth."""
        return build_counts(self.seqs.values(), self.max_depth)

    def count(self, tokens: Sequence[int]) -> int:
        """Occurrence count of one string (0 if longer than max_depth)."""
        if not 1 <= len(tokens) <= self.max_depth:
            return 0
        return self.counts().get(tuple(tokens), 0)

    def n_tokens(self) -> int:
        """Total tokens in live sequences."""
        return sum(len(s) for s in self.seqs.values())


def budget(p: int, params: RefParams) -> int:
    """B(p) = min(max_spec_tokens, floor(alpha*p + offset + 1e-6))."""
    return min(params.max_spec_tokens, math.floor(params.alpha * p + params.offset + 1e-6))


def _sorted_children(children: Children, x: tuple[int, ...]) -> tuple[list[tuple[int, int]], int]:
    """Children of x as (token, count) sorted by count desc, token asc; and total(x)."""
    kids = children.get(x, {})
    total = sum(kids.values())
    return sorted(kids.items(), key=lambda kv: (-kv[1], kv[0])), total


def _in_vocab(tok: int, vocab: int | None) -> bool:
    """Whether a drafted token is below the vocabulary bound (None: no bound)."""
    return vocab is None or tok < vocab


def linear_draft(
    children: Children, x: tuple[int, ...], limit: int, min_prob: float, vocab: int | None = None
) -> list[tuple[int, int, float]]:
    """Greedy chain of best children from x: (token, parent, prob) triples.

    The chain stops before a token outside the vocabulary.
    """
    out: list[tuple[int, int, float]] = []
    d = 1.0
    while len(out) < limit:
        kids, total = _sorted_children(children, x)
        if not kids:
            break
        tok, cnt = kids[0]
        if not _in_vocab(tok, vocab):
            break
        d = d * (float(cnt) / float(total))
        if d < min_prob:
            break
        out.append((tok, len(out) - 1, d))
        x = (*x, tok)
    return out


def tree_draft(
    children: Children, x: tuple[int, ...], limit: int, min_prob: float, vocab: int | None = None
) -> list[tuple[int, int, float]]:
    """Best-first tree draft from x: (token, parent, prob) triples.

    A child outside the vocabulary is never pushed (nor anything below it).
    """
    out: list[tuple[int, int, float]] = []
    heap: list[tuple[float, int, tuple[int, ...], int]] = []
    order = 0

    def push_children(node: tuple[int, ...], d_node: float, parent_index: int) -> None:
        nonlocal order
        kids, total = _sorted_children(children, node)
        for tok, cnt in kids:
            d = d_node * (float(cnt) / float(total))
            if d < min_prob:
                break
            if not _in_vocab(tok, vocab):
                continue
            heapq.heappush(heap, (-d, order, (*node, tok), parent_index))
            order += 1

    push_children(x, 1.0, -1)
    while len(out) < limit and heap:
        neg_d, _, node, parent_index = heapq.heappop(heap)
        out.append((node[-1], parent_index, -neg_d))
        push_children(node, -neg_d, len(out) - 1)
    return out


def draft_one_tree(
    counts: Mapping[tuple[int, ...], int],
    max_depth: int,
    context: Sequence[int],
    params: RefParams,
    pattern_depth: int | None = None,
) -> tuple[list[tuple[int, int, float]], float, int]:
    """Best draft over all candidate patterns of one tree: (draft, score, p).

    ``pattern_depth`` (a cursor's max_depth) further bounds p to
    pattern_depth - 1.  An empty result is ([], 0.0, 0).
    """
    children = build_children(counts)
    ctx = tuple(context)
    hi = max_depth - 1
    if pattern_depth is not None:
        hi = min(hi, pattern_depth - 1)
    if params.max_pattern:
        hi = min(hi, params.max_pattern)
    hi = min(hi, len(ctx))
    lo = max(1, params.min_pattern)
    best: tuple[list[tuple[int, int, float]], float, int] = ([], 0.0, 0)
    best_key = (-1.0, -1)
    for p in range(lo, hi + 1):
        pattern = ctx[len(ctx) - p :]
        if sum(children.get(pattern, {}).values()) <= 0:
            continue  # not a candidate
        limit = budget(p, params)
        grow = tree_draft if params.tree else linear_draft
        draft = (
            grow(children, pattern, limit, params.min_token_prob, params.vocab_size)
            if limit > 0
            else []
        )
        score = 0.0
        for _, _, d in draft:
            score += d
        if (score, p) > best_key:
            best_key = (score, p)
            best = (draft, score, p)
    if not best[0]:
        return [], 0.0, 0
    return best


def _as_draft(result: tuple[list[tuple[int, int, float]], float, int], source: str) -> RefDraft:
    draft, score, p = result
    return RefDraft(
        [t for t, _, _ in draft],
        [par for _, par, _ in draft],
        [d for _, _, d in draft],
        score,
        p,
        source,
    )


def reference_draft(
    context: Sequence[int],
    params: RefParams,
    global_tree: RefTree | None = None,
    local_tree: RefTree | None = None,
    cursor_depth: int | None = None,
) -> RefDraft:
    """The final draft of the semantics for a context, a global and a local tree.

    ``cursor_depth`` is the max_depth of the Cursor that drafts, if any: a
    cursor tracks patterns of at most cursor_depth - 1 tokens in every tree.
    """
    g = global_tree if params.use_global else None
    loc = local_tree if params.use_local else None
    if params.merge and g is not None and loc is not None:
        depth = min(g.max_depth, loc.max_depth)
        merged = build_counts(list(g.seqs.values()) + list(loc.seqs.values()), depth)
        res = draft_one_tree(merged, depth, context, params, cursor_depth)
        out = _as_draft(res, "merged") if res[0] else EMPTY
    else:
        none: tuple[list[tuple[int, int, float]], float, int] = ([], 0.0, 0)
        g_res = none
        if g is not None:
            g_res = draft_one_tree(g.counts(), g.max_depth, context, params, cursor_depth)
        l_res = none
        if loc is not None:
            l_res = draft_one_tree(loc.counts(), loc.max_depth, context, params, cursor_depth)
        if l_res[0] and l_res[1] >= g_res[1]:
            out = _as_draft(l_res, "local")
        elif g_res[0]:
            out = _as_draft(g_res, "global")
        else:
            out = EMPTY
    if out.score < params.min_score:
        return EMPTY
    return out
