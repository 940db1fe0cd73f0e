"""Simulated greedy verifier: how many draft tokens a greedy target model accepts.

With greedy decoding the target model's output is fixed, so replaying a
recorded response tells exactly what a verification step accepts: the draft
tokens that equal the true continuation, plus one "bonus" token the target
model produces itself in the same forward pass.

- Linear draft: the longest prefix of the draft equal to the continuation.
- Tree draft (``parents[i]`` is the draft index of token i's parent, -1 for
  a root-level token): the longest root-to-node path whose tokens equal the
  continuation.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["accept_linear", "accept_tree", "advance"]


def accept_linear(draft: Sequence[int], response: Sequence[int], pos: int) -> int:
    """Accepted length of a linear draft against ``response[pos:]``.

    Returns the length of the longest prefix of ``draft`` equal to the
    continuation ``response[pos:]`` (never longer than what is left of it).

    Raises:
        ValueError: ``pos`` is outside ``[0, len(response)]``.
    """
    n = len(response)
    if not 0 <= pos <= n:
        raise ValueError(f"pos {pos} is outside [0, {n}]")
    lim = min(len(draft), n - pos)
    acc = 0
    while acc < lim and draft[acc] == response[pos + acc]:
        acc += 1
    return acc


def accept_tree(
    tokens: Sequence[int], parents: Sequence[int], response: Sequence[int], pos: int
) -> int:
    """Accepted length of a tree draft against ``response[pos:]``.

    The tree is given in the engine's layout: node i has token ``tokens[i]``
    and parent ``parents[i]`` (-1 for a child of the match point), and every
    parent comes before its children. The result is the depth of the deepest
    node whose root-to-node path spells a prefix of the continuation.

    Raises:
        ValueError: ``pos`` is outside ``[0, len(response)]``, the two lists
            differ in length, or a parent index is not in ``[-1, i)``.
    """
    n = len(response)
    if not 0 <= pos <= n:
        raise ValueError(f"pos {pos} is outside [0, {n}]")
    if len(tokens) != len(parents):
        raise ValueError(f"{len(tokens)} tokens but {len(parents)} parents")
    remaining = n - pos
    # depth[i] = depth of node i if its whole path matches the continuation, else 0
    depth = [0] * len(tokens)
    best = 0
    for i, (tok, par) in enumerate(zip(tokens, parents, strict=True)):
        if not -1 <= par < i:
            raise ValueError(f"parent {par} of draft node {i} is not in [-1, {i})")
        if par == -1:
            d = 1
        else:
            pd = depth[par]
            if pd == 0:
                continue
            d = pd + 1
        if d <= remaining and tok == response[pos + d - 1]:
            depth[i] = d
            if d > best:
                best = d
    return best


def advance(accepted: int, remaining: int) -> int:
    """Tokens one verification step adds: the accepted ones plus the bonus token.

    There is no bonus token once the accepted draft already reaches the end
    of the response (``accepted == remaining``).

    Raises:
        ValueError: ``accepted`` is negative or larger than ``remaining``.
    """
    if not 0 <= accepted <= remaining:
        raise ValueError(f"accepted {accepted} is outside [0, {remaining}]")
    return accepted + 1 if accepted < remaining else accepted
