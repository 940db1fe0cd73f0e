"""Lossless speculative sampling for point-mass (model-free) drafts, as pure functions.

Sampling is an *exponential race* (the Gumbel-max trick): output position k
gets one standard exponential ``E[k, t]`` per vocabulary token t, and the
emitted token is ``argmax_t p(t) / E[k, t]`` over the tokens with p(t) > 0
(`race_pick`), which is distributed exactly as p.  Non-speculative decoding
does that at every position.  Verification does exactly the same: at a
draft node it computes p for the next position and the token the race
picks; when a child of the node carries that token the child is accepted
and the walk goes on to the next position, otherwise the token is emitted
as the bonus token and the step ends (`walk_draft`).  So a draft child x is
accepted with probability p(x) (the optimal acceptance of the speculative
sampling rule for a point-mass draft), and on rejection the emitted token
is distributed as the residual, p without the children, renormalised
(`branch_probabilities`).  Each emitted token is distributed exactly as p,
whatever the draft, and with the same exponentials the emitted tokens are
*identical* to non-speculative decoding: speculation changes how many
tokens a forward pass yields, never which.

Seeds.  `position_noise` derives the exponentials of output position k from
a counter-based generator keyed by ``(seed, choice, k)`` alone, so a seeded
request draws the same numbers with speculation on or off, whatever the
drafts.  Why a race and not inverse-CDF sampling with one uniform per
position: the logits of a position differ in their last bits between a
one-token forward pass and a pass over a whole draft (about 3e-5 on
SmolLM2), and a CDF over 49,152 tokens in id order accumulates that noise
past the width of its many tiny intervals, so about one token in a hundred
came out differently.  The race only changes its winner when the two best
``p / E`` are within that noise of each other, as rare as a greedy near-tie.

Tiny temperatures follow vLLM (``vllm/sampling_params.py``): below
`SAMPLING_EPS` (1e-5) decoding is greedy, and a temperature in
``[SAMPLING_EPS, MIN_TEMPERATURE)`` is raised to `MIN_TEMPERATURE` (1e-2),
so ``logits / temperature`` never overflows into NaN probabilities.

`SamplingParams` holds every supported parameter; the per-position logits
processing (penalties, ``logit_bias``, ``allowed_token_ids``) is in
`agentspec.engine._logits`, the filtering that follows it (temperature,
``min_p``, ``top_k``, ``top_p``) in `filtered_probs`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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
    "filtered_probs",
    "position_noise",
    "race_pick",
    "target_probs",
    "walk_draft",
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


def _finite(value: float, name: str, ok: bool, what: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
        raise InvalidArgumentError(f"{name} must be {what}", str(value))


@dataclass(frozen=True)
class SamplingParams:
    """Target-side sampling parameters (vLLM semantics).

    Attributes:
        temperature: 0 (below `SAMPLING_EPS`) for greedy decoding.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens (ties at the k-th logit kept);
            0 or -1: off.
        min_p: drop tokens less likely than ``min_p`` times the most likely
            one (after temperature); 0: off.
        repetition_penalty: > 0; the logit of every token in the prompt or
            the output so far is divided by it when positive, multiplied
            when not; 1: off.
        frequency_penalty, presence_penalty: in [-2, 2]; subtracted from a
            token's logit per occurrence in the output so far / once if it
            occurs there (OpenAI semantics; the prompt does not count).
        logit_bias: ``(token id, bias)`` pairs added to the logits first.
        allowed_token_ids: when set, every other token is masked out.

    Order (as vLLM's sampler): allowed_token_ids, logit_bias, the three
    penalties, then temperature, min_p, top_k, top_p.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        """Validate every field (ranges as vLLM and OpenAI)."""
        _finite(self.temperature, "temperature", self.temperature >= 0, "finite and >= 0")
        _finite(self.top_p, "top_p", 0 < self.top_p <= 1, "in (0, 1]")
        if type(self.top_k) is not int or self.top_k < -1:
            raise InvalidArgumentError("top_k must be -1, 0 (off) or >= 1", str(self.top_k))
        _finite(self.min_p, "min_p", 0 <= self.min_p <= 1, "in [0, 1]")
        _finite(
            self.repetition_penalty,
            "repetition_penalty",
            self.repetition_penalty > 0,
            "finite and > 0",
        )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _finite(value, name, -2 <= value <= 2, "in [-2, 2]")
        for tok, bias in self.logit_bias:
            if type(tok) is not int or tok < 0:
                raise InvalidArgumentError("logit_bias token ids must be ints >= 0", str(tok))
            _finite(bias, "logit_bias", -100 <= bias <= 100, "in [-100, 100]")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidArgumentError("allowed_token_ids must not be empty")
            if any(type(t) is not int or t < 0 for t in self.allowed_token_ids):
                raise InvalidArgumentError("allowed_token_ids must be ints >= 0")

    @property
    def greedy(self) -> bool:
        """Whether this is greedy decoding (temperature below `SAMPLING_EPS`, e.g. 0)."""
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the context (any penalty is on)."""
        return (
            self.repetition_penalty != 1
            or self.frequency_penalty != 0
            or self.presence_penalty != 0
        )

    @property
    def modifies_logits(self) -> bool:
        """Whether the raw logits are changed before temperature (so greedy needs them too)."""
        return self.penalized or bool(self.logit_bias) or self.allowed_token_ids is not None


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities from (processed) ``logits``: temperature, then min_p, top_k, top_p.

    Works on the last axis of any shape.  Greedy params give the one-hot of
    the argmax (the first one on ties).  Returns float64 rows summing to 1.
    A row must have at least one finite logit.
    """
    x = np.asarray(logits, dtype=np.float64)
    temperature = effective_temperature(params.temperature)
    if temperature == 0:
        out = np.zeros_like(x)
        np.put_along_axis(out, x.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return out
    z = x / temperature
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    if params.min_p > 0:
        p = np.where(p >= params.min_p * p.max(axis=-1, keepdims=True), p, 0.0)
    k = params.top_k
    if 0 < k < p.shape[-1]:
        # the k-th largest logit; ties with it are kept (as vLLM's top-k mask)
        kth = -np.partition(-z, k - 1, axis=-1)[..., k - 1 : k]
        p = np.where(z >= kth, p, 0.0)
    if params.min_p > 0 or 0 < k < p.shape[-1]:
        p /= p.sum(axis=-1, keepdims=True)
    if params.top_p < 1:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < params.top_p  # the first token always has 0 before it
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    out_p: np.ndarray = p
    return out_p


def target_probs(logits: np.ndarray, temperature: float = 1.0, top_p: float = 1.0) -> np.ndarray:
    """Softmax of ``logits / temperature`` over the last axis, restricted to the top-p nucleus.

    Temperature 0 (or below `SAMPLING_EPS`) gives the one-hot of the argmax;
    one below `MIN_TEMPERATURE` is raised to it (see `effective_temperature`).
    The nucleus is the smallest set of most likely tokens whose mass reaches
    ``top_p`` (never empty).  Returns float64 rows summing to 1.  (The
    two-parameter case of `filtered_probs`.)
    """
    return filtered_probs(logits, SamplingParams(temperature, top_p))


def position_noise(seed: int, choice: int, position: int, vocab: int) -> np.ndarray:
    """``vocab`` standard exponentials for output ``position`` of ``choice`` under ``seed``.

    A counter-based draw keyed by the three numbers alone:
    ``-log(1 - U)`` for ``U = Generator(Philox(SeedSequence([seed, choice,
    position]))).random(vocab)``; entry t belongs to token id t.  It depends
    on nothing else (not on drafts, steps or earlier draws).  All three
    keys must be >= 0.
    """
    gen = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, choice, position])))
    noise: np.ndarray = -np.log1p(-gen.random(vocab))
    return noise


def race_pick(p: np.ndarray, noise: np.ndarray) -> int:
    """The token ``argmax_t p[t] / noise[t]`` among those with ``p[t] > 0`` (first on ties).

    With ``noise`` i.i.d. standard exponentials the result is distributed as
    ``p / p.sum()`` (an exponential race; the Gumbel-max trick).  A token of
    probability 0 is never returned.
    """
    row = np.asarray(p, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where(row > 0, row / noise, -1.0)
    return int(score.argmax())


def branch_probabilities(p: np.ndarray, candidates: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The outcome probabilities of verifying a node with children ``candidates`` against ``p``.

    Returns ``(branch, residual)``: ``branch[i]`` (i < k) is the probability
    that candidate i is the one accepted, ``branch[k]`` the probability that
    all k are rejected, and ``residual`` the (normalised) distribution the
    output token then follows.  With `walk_draft`'s rule (accept the child
    that carries the token the race picks) a candidate is accepted with probability
    p(x) (a repeated token only the first time), and the residual is p
    without the candidates.  By construction
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


def walk_draft(
    token_ids: Sequence[int],
    parents: Sequence[int],
    pick: Callable[[int, int, list[int]], int],
) -> tuple[list[int], int]:
    """Walk a draft tree from the root, following the child that carries the picked token.

    ``pick(row, depth, accepted)`` returns the token the target emits at
    ``row`` (0: after the context, ``1 + i``: after draft node i), the
    output position ``depth`` tokens after the step's first one, given the
    ``accepted`` draft tokens before it.  Returns ``(path, token)``: the
    accepted nodes from the root down and the token emitted after the last
    of them (no child carries it).
    """
    children: list[list[int]] = [[] for _ in range(len(token_ids) + 1)]
    for i, par in enumerate(parents):
        children[par + 1].append(i)
    path: list[int] = []
    accepted: list[int] = []
    node = -1
    while True:
        token = pick(node + 1, len(path), accepted)
        nxt = next((k for k in children[node + 1] if token_ids[k] == token), None)
        if nxt is None:
            return path, token
        path.append(nxt)
        accepted.append(token)
        node = nxt


def accept_sampling(
    probs: np.ndarray,
    token_ids: Sequence[int],
    parents: Sequence[int],
    rng: np.random.Generator | Callable[[int], np.ndarray],
) -> tuple[list[int], int]:
    """Walk a draft tree with the speculative sampling rule (an exponential race per position).

    Args:
        probs: ``(1 + n, V)`` target distributions: row 0 after the context,
            row ``1 + i`` after draft node i (see `filtered_probs`).
        token_ids, parents: the draft (parents[i] = -1 or an earlier node).
        rng: the noise: a callable ``depth -> (V,) exponentials`` of the
            step's ``depth``-th output position (e.g. from `position_noise`),
            or a generator drawing fresh ones per position.

    Returns:
        ``(path, token)``: the accepted draft nodes from the root down, and the
        token sampled after the last of them.  The emitted tokens are
        ``[token_ids[i] for i in path] + [token]``: the tokens `race_pick`
        emits without a draft with the same noise.
    """
    n = len(token_ids)
    if len(parents) != n or probs.shape[0] != n + 1:
        raise InvalidArgumentError(
            "probs needs one row per draft node plus one", f"{probs.shape[0]} rows, {n} nodes"
        )
    vocab = int(probs.shape[1])
    if callable(rng):
        noise = rng
    else:
        gen = rng

        def noise(_depth: int) -> np.ndarray:
            return gen.standard_exponential(vocab)

    return walk_draft(
        token_ids, parents, lambda row, depth, _acc: race_pick(probs[row], noise(depth))
    )
