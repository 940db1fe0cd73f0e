"""A copy pointer: follow the one earlier copy a request is reproducing.

A suffix tree knows how often a string occurred, not where. `CopyPointer` keeps
positions instead: every n-gram of the sources seen so far (earlier requests'
contexts and responses, and the current request's context) maps to the end of
its most recent occurrence. After each verification step the pointer either
advances (the accepted tokens are what followed the copy it follows) or is
re-acquired from the context's last n tokens. `propose` returns what follows
the copy. The bench method ``copy-pointer`` uses it to test whether knowing
*which* copy the request follows beats the tree's most frequent continuation
(docs/benchmarks.md, "Confidence drafting").

Research code for the replay bench: pure Python, one dict entry per indexed
token.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CopyPointer"]


class CopyPointer:
    """Positions of every n-gram seen so far, and the copy the request follows.

    Args:
        n: length of the n-grams that (re-)acquire a copy (>= 1).
    """

    def __init__(self, n: int = 6) -> None:
        """Create an empty index (see the class docstring)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self._sources: list[list[int]] = []
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}
        self._cur = -1  # the current request's source
        self._ptr: tuple[int, int] | None = None
        self.streak = 0  # tokens followed since the copy was acquired

    def _index_from(self, sid: int, lo: int) -> None:
        # n-grams ending at lo .. len - 1: those with a token after them
        src, n = self._sources[sid], self.n
        for end in range(max(lo, n), len(src)):
            self._index[tuple(src[end - n : end])] = (sid, end)

    def begin(self, prompt: Sequence[int]) -> None:
        """Start a request whose context is ``prompt``.

        A prompt that extends the previous request's context (the next turn of a
        conversation) continues that source instead of indexing it again.
        """
        prompt = [int(t) for t in prompt]
        prev = self._sources[self._cur] if self._cur >= 0 else None
        if prev is not None and len(prompt) >= len(prev) and prompt[: len(prev)] == prev:
            old = len(prev)
            prev.extend(prompt[old:])
            self._index_from(self._cur, old)
        else:
            self._sources.append(prompt)
            self._cur = len(self._sources) - 1
            self._index_from(self._cur, 0)
        self._acquire()

    def _acquire(self) -> None:
        self._ptr, self.streak = None, 0
        ctx = self._sources[self._cur]
        if len(ctx) < self.n:
            return
        hit = self._index.get(tuple(ctx[-self.n :]))
        if hit is None or (hit[0] == self._cur and hit[1] >= len(ctx)):
            return  # only the context's own end: nothing follows it yet
        self._ptr = hit

    def observe(self, tokens: Sequence[int]) -> None:
        """Append accepted tokens: advance along the copy, or re-acquire one."""
        ctx = self._sources[self._cur]
        old = len(ctx)
        tokens = [int(t) for t in tokens]
        ptr = self._ptr
        follows = False
        if ptr is not None:
            sid, end = ptr
            src = self._sources[sid]
            follows = src[end : end + len(tokens)] == tokens and not (
                sid == self._cur and end + len(tokens) > old
            )
        ctx.extend(tokens)
        self._index_from(self._cur, old)
        if follows and ptr is not None:
            self._ptr = (ptr[0], ptr[1] + len(tokens))
            self.streak += len(tokens)
        else:
            self._acquire()

    def propose(self, length: int) -> list[int]:
        """Up to ``length`` tokens that followed the copy (empty without one)."""
        if self._ptr is None or length <= 0:
            return []
        sid, end = self._ptr
        return list(self._sources[sid][end : end + length])
