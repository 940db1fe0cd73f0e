"""vLLM's n-gram ("prompt lookup") proposer, reimplemented from its documented behaviour.

vLLM's ``NgramProposer`` drafts from the request's own context (prompt plus
output so far): it finds the longest n in ``[min_n, max_n]`` such that the
last n tokens of the context also occur earlier in the context, takes the
*earliest* such occurrence (vLLM scans the reversed context with KMP and
keeps the last hit, i.e. the earliest one in the original order), and
proposes the (at most k) tokens that follow that occurrence. An occurrence
may overlap the suffix itself but may not be it; the proposal never runs
past the end of the context. No draft when no n in range matches.

vLLM rescans the whole context at every step. This version gives the same
drafts incrementally: for each n it keeps a dict from n-gram to the start of
its earliest occurrence, updated in O(max_n - min_n + 1) per appended token,
so a step costs O(max_n) dict lookups whatever the context length.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentspec._util.args import as_int

__all__ = ["NgramProposer"]


class NgramProposer:
    """Prompt-lookup drafts for one request at a time.

    Args:
        min_n: smallest n-gram length matched (>= 1).
        max_n: largest n-gram length matched (>= min_n).
        k: most tokens proposed per step (>= 1).

    Use `reset` with a request's prompt, `extend` with every accepted batch of
    tokens, and `propose` before each verification step.
    """

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        """Create a proposer (see the class docstring for the arguments)."""
        min_n = as_int(min_n, "min_n")
        max_n = as_int(max_n, "max_n")
        k = as_int(k, "k")
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.min_n = min_n
        self.max_n = max_n
        self.k = k
        self._ctx: list[int] = []
        # _first[n - min_n]: n-gram tuple -> start index of its earliest occurrence
        self._first: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]

    @property
    def context(self) -> list[int]:
        """The current context (do not modify it)."""
        return self._ctx

    def __len__(self) -> int:
        """Length of the current context."""
        return len(self._ctx)

    def reset(self, prompt: Sequence[int]) -> None:
        """Start a new request whose context is ``prompt``."""
        self._ctx = []
        self._first = [{} for _ in range(self.min_n, self.max_n + 1)]
        self.extend(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the context and index the n-grams they complete."""
        ctx = self._ctx
        old = len(ctx)
        ctx.extend(int(t) for t in tokens)
        new = len(ctx)
        if new - old > 64:
            self._index_bulk(old, new)
            return
        for j in range(old, new):  # j = index of the newly added token
            for slot, first in enumerate(self._first):
                n = self.min_n + slot
                s = j - n + 1
                if s < 0:
                    break
                key = tuple(ctx[s : j + 1])
                if key not in first:
                    first[key] = s

    def _index_bulk(self, old: int, new: int) -> None:
        """Index the n-grams ending at positions old..new-1 in C-speed passes."""
        ctx = self._ctx
        for slot, first in enumerate(self._first):
            n = self.min_n + slot
            lo = max(old - n + 1, 0)  # first start of a new n-gram
            hi = new - n + 1  # one past the last start
            if hi <= lo:
                continue
            keys = list(zip(*(ctx[lo + j : hi + j] for j in range(n)), strict=True))
            # reversed insertion: for repeated keys the smallest start is written last
            fresh = dict(zip(reversed(keys), range(hi - 1, lo - 1, -1), strict=True))
            for key, s in fresh.items():
                if key not in first:
                    first[key] = s

    def propose(self) -> list[int]:
        """The draft for the current context (empty when no n-gram matches)."""
        ctx = self._ctx
        t = len(ctx)
        for slot in range(len(self._first) - 1, -1, -1):
            n = self.min_n + slot
            if n >= t:  # an earlier occurrence needs at least n + 1 tokens
                continue
            s = self._first[slot].get(tuple(ctx[t - n :]))
            if s is not None and s < t - n:
                start = s + n
                return ctx[start : start + self.k]
        return []
