"""The copy-drafting ceiling: the longest prefix of the truth that was seen before.

At each verification step the oracle drafts the longest prefix of the true
continuation (at most ``max_spec_tokens`` tokens) that occurs anywhere in the
data a drafter could have seen by then: the request's prompt, its output so
far, and every earlier finished response (any stage). Every copy-based drafter
(suffix trees, n-gram lookup) drafts a string that occurs in that data, so no
such drafter accepts more in one step. Taking the longest such prefix at every
step is also optimal over a whole response: from any position the oracle
reaches at least as far as a drafter that is behind it, since a suffix of a
seen string is itself seen. So its mean accepted tokens per step is an upper
bound for every copy-based method under the same verifier.

Both indexes are `agentspec.SuffixTree`s of depth ``max_spec_tokens + 1``
queried with `SuffixTree.count` (a prefix of a seen string is seen, so the
longest seen prefix is found by galloping then bisecting, O(log k) counts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from agentspec import SuffixTree
from agentspec._util.args import as_int

__all__ = ["Oracle", "longest_seen_prefix"]

_CONTEXT_SEQ = 0


def longest_seen_prefix(
    count: Callable[[Sequence[int]], int], cont: Sequence[int], known: int = 0
) -> int:
    """Longest L in ``[known, len(cont)]`` with ``count(cont[:L]) > 0``.

    ``count`` must be monotone on prefixes (as substring counts are). The
    result is ``known`` when ``cont[:known + 1]`` has no occurrence; ``known``
    itself is taken as already established (by another index) and not checked.
    """
    n = len(cont)
    lo = known + 1
    if lo > n or count(cont[:lo]) == 0:
        return known
    good, step = lo, 1
    bad = n + 1  # smallest length known to be absent (n + 1: none known)
    while good < n:
        probe = min(good + step, n)
        if count(cont[:probe]) > 0:
            good = probe
            step *= 2
        else:
            bad = probe
            break
    while bad - good > 1:
        mid = (good + bad) // 2
        if count(cont[:mid]) > 0:
            good = mid
        else:
            bad = mid
    return good


class Oracle:
    """Per-step ceiling drafts over one replay (one request active at a time).

    Args:
        max_spec_tokens: most tokens drafted per step.

    Call `add_response` for offline warm-up data, then per request `start`,
    `draft`/`extend` per step, and `finish` (which learns the response).
    """

    def __init__(self, max_spec_tokens: int) -> None:
        """Create an empty oracle (see the class docstring)."""
        max_spec_tokens = as_int(max_spec_tokens, "max_spec_tokens")
        if max_spec_tokens < 1:
            raise ValueError(f"max_spec_tokens must be >= 1, got {max_spec_tokens}")
        self.k = max_spec_tokens
        self._depth = max(max_spec_tokens + 1, 2)
        self._seen = SuffixTree(self._depth)
        self._next_id = 0
        self._ctx_tree: SuffixTree | None = None
        self._ctx: npt.NDArray[np.int32] = np.zeros(0, dtype=np.int32)
        self._ctx_parts: list[npt.NDArray[np.int32]] = []
        self._response: list[int] = []
        self._learn: npt.NDArray[np.int32] | None = None

    def add_response(self, tokens: Sequence[int] | npt.NDArray[np.int32]) -> None:
        """Add a finished response to the data seen by every later request."""
        if len(tokens):
            self._seen.add(self._next_id, tokens)
            self._next_id += 1

    def start(self, prompt: npt.NDArray[np.int32], response: Sequence[int]) -> None:
        """Begin a request: index its prompt; ``response`` is the truth to draft.

        When the prompt extends the previous request's whole context (the
        next turn of a conversation), only the new tokens are indexed.
        """
        prompt = np.ascontiguousarray(prompt, dtype=np.int32)
        ctx = self._context()
        if (
            self._ctx_tree is not None
            and len(prompt) >= len(ctx)
            and np.array_equal(prompt[: len(ctx)], ctx)
        ):
            delta = prompt[len(ctx) :]
            if len(delta):
                self._ctx_tree.append(_CONTEXT_SEQ, delta)
        else:
            if self._ctx_tree is not None:
                self._ctx_tree.close()
            self._ctx_tree = SuffixTree(self._depth)
            if len(prompt):
                self._ctx_tree.append(_CONTEXT_SEQ, prompt)
        self._ctx = prompt
        self._ctx_parts = []
        self._response = list(response)
        self._learn = np.asarray(response, dtype=np.int32)

    def _context(self) -> npt.NDArray[np.int32]:
        if self._ctx_parts:
            self._ctx = np.concatenate([self._ctx, *self._ctx_parts]).astype(np.int32, copy=False)
            self._ctx_parts = []
        return self._ctx

    def draft(self, pos: int) -> list[int]:
        """The longest seen prefix of ``response[pos:]``, at most ``max_spec_tokens`` long."""
        if self._ctx_tree is None:
            raise RuntimeError("Oracle.draft before Oracle.start")
        cont = self._response[pos : pos + self.k]
        n = longest_seen_prefix(self._seen.count, cont)
        n = longest_seen_prefix(self._ctx_tree.count, cont, n)
        return cont[:n]

    def extend(self, tokens: Sequence[int]) -> None:
        """Append accepted output tokens to the request's context."""
        if self._ctx_tree is None:
            raise RuntimeError("Oracle.extend before Oracle.start")
        if len(tokens):
            arr = np.asarray(tokens, dtype=np.int32)
            self._ctx_tree.append(_CONTEXT_SEQ, arr)
            self._ctx_parts.append(arr)

    def finish(self) -> None:
        """End the request and learn its response."""
        if self._learn is not None:
            self.add_response(self._learn)
            self._learn = None

    def tree_bytes(self) -> int:
        """Allocator bytes of both indexes."""
        n = self._seen.stats().bytes
        if self._ctx_tree is not None:
            n += self._ctx_tree.stats().bytes
        return n

    def close(self) -> None:
        """Free both indexes."""
        self._seen.close()
        if self._ctx_tree is not None:
            self._ctx_tree.close()
            self._ctx_tree = None
