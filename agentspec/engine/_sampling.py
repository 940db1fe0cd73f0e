"""Lossless speculative sampling for point-mass (model-free) drafts, as pure functions.

A suffix-tree draft proposes tokens deterministically: its "draft
distribution" q at each node is a point mass on the proposed child.  The
standard speculative sampling rule (accept x with probability
``min(1, p(x)/q(x))``, else sample from ``max(0, p - q)`` normalised) then
reads: accept child x with probability ``p(x)``; on rejection, remove x from
p and renormalise.  With several children (a tree), the children are tried
in order, each rejection removing its token; when all are rejected the
output token is drawn from what is left of p.  Each emitted token is thus
distributed exactly as p, whatever the draft (see `branch_probabilities`).

Tiny temperatures follow vLLM (``vllm/sampling_params.py``): below
`SAMPLING_EPS` (1e-5) decoding is greedy, and a temperature in
``[SAMPLING_EPS, MIN_TEMPERATURE)`` is raised to `MIN_TEMPERATURE` (1e-2),
so ``logits / temperature`` never overflows into NaN probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agentspec.exceptions import InvalidArgumentError

__all__ = [
    "MIN_TEMPERATURE",
    "SAMPLING_EPS",
    "SamplingParams",
    "accept_sampling",
    "branch_probabilities",
    "effective_temperature",
    "target_probs",
]

#: A temperature below this decodes greedily (vLLM's ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5
#: The smallest temperature sampled with; smaller ones (>= `SAMPLING_EPS`) are
#: raised to it (vLLM's ``_MAX_TEMP``).
MIN_TEMPERATURE = 1e-2


def effective_temperature(temperature: float) -> float:
    """The temperature sampled with: 0 (greedy) below `SAMPLING_EPS`, else >= `MIN_TEMPERATURE`."""
    if temperature < SAMPLING_EPS:
        return 0.0
    return max(temperature, MIN_TEMPERATURE)


@dataclass(frozen=True)
class SamplingParams:
    """Target-side sampling: ``temperature`` (0 = greedy) and nucleus ``top_p``."""

    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        """Validate: temperature finite and >= 0, top_p in (0, 1]."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgumentError("temperature must be finite and >= 0", str(self.temperature))
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidArgumentError("top_p must be in (0, 1]", str(self.top_p))

    @property
    def greedy(self) -> bool:
        """Whether this is greedy decoding (temperature below `SAMPLING_EPS`, e.g. 0)."""
        return self.temperature < SAMPLING_EPS


def target_probs(logits: np.ndarray, temperature: float = 1.0, top_p: float = 1.0) -> np.ndarray:
    """Softmax of ``logits / temperature`` over the last axis, restricted to the top-p nucleus.

    Temperature 0 (or below `SAMPLING_EPS`) gives the one-hot of the argmax;
    one below `MIN_TEMPERATURE` is raised to it (see `effective_temperature`).
    The nucleus is the smallest set of most likely tokens whose mass reaches
    ``top_p`` (never empty).  Returns float64 rows summing to 1.
    """
    SamplingParams(temperature, top_p)  # validation
    x = np.asarray(logits, dtype=np.float64)
    temperature = effective_temperature(temperature)
    if temperature == 0:
        out = np.zeros_like(x)
        np.put_along_axis(out, x.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return out
    z = x / temperature
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < top_p  # the first token always has 0 before it
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    out_p: np.ndarray = p
    return out_p


def branch_probabilities(p: np.ndarray, candidates: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The outcome probabilities of trying ``candidates`` in order against target ``p``.

    Returns ``(branch, residual)``: ``branch[i]`` (i < k) is the probability
    that candidate i is the one accepted, ``branch[k]`` the probability that
    all k are rejected, and ``residual`` the (normalised) distribution the
    output token is then drawn from.  By construction
    ``sum_i branch[i] * onehot(candidates[i]) + branch[k] * residual == p``.
    """
    w = np.array(p, dtype=np.float64)  # remaining (unnormalised) target mass
    branch = np.zeros(len(candidates) + 1)
    reach = 1.0  # probability that every earlier candidate was rejected
    for i, x in enumerate(candidates):
        total = w.sum()
        accept = w[x] / total if total > 0 else 0.0
        branch[i] = reach * accept
        reach *= 1.0 - accept
        w[x] = 0.0
    branch[-1] = max(reach, 0.0)
    total = w.sum()
    residual = w / total if total > 0 else w
    return branch, residual


def accept_sampling(
    probs: np.ndarray,
    token_ids: Sequence[int],
    parents: Sequence[int],
    rng: np.random.Generator,
) -> tuple[list[int], int]:
    """Walk a draft tree with the speculative sampling rule.

    Args:
        probs: ``(1 + n, V)`` target distributions: row 0 after the context,
            row ``1 + i`` after draft node i (see `target_probs`).
        token_ids, parents: the draft (parents[i] = -1 or an earlier node).
        rng: the random source.

    Returns:
        ``(path, token)``: the accepted draft nodes from the root down, and the
        token sampled after the last of them (from the residual when a child
        was rejected there).  The emitted tokens are
        ``[token_ids[i] for i in path] + [token]``.
    """
    n = len(token_ids)
    if len(parents) != n or probs.shape[0] != n + 1:
        raise InvalidArgumentError(
            "probs needs one row per draft node plus one", f"{probs.shape[0]} rows, {n} nodes"
        )
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for i, par in enumerate(parents):
        children[par + 1].append(i)
    path: list[int] = []
    node = -1
    while True:
        kids = children[node + 1]
        if not kids:
            row = probs[node + 1]
            return path, int(rng.choice(row.shape[0], p=row / row.sum()))
        branch, residual = branch_probabilities(probs[node + 1], [token_ids[k] for k in kids])
        pick = int(rng.choice(branch.shape[0], p=branch / branch.sum()))
        if pick == len(kids):
            return path, int(rng.choice(residual.shape[0], p=residual))
        node = kids[pick]
        path.append(node)
