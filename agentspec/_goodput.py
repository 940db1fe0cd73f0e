"""Goodput control: how many draft tokens each request of a step should verify.

A verification step costs time that grows with the tokens it verifies; a
draft token pays off only when its chance of being accepted is worth that
time.  Two parts, both plain Python, both cheap enough to run every step:

`StepCostModel` learns a step's wall time online from the engine's own
steps, as a linear function of the batch size ``b`` (requests in the step)
and the tokens verified ``n`` (``b`` plus every draft token)::

    seconds ~= c0 + c1 * b + c2 * n

fitted by recursive least squares with exponential forgetting (``decay``
per observation, so it follows load changes), coefficients clipped at zero
when predicting.  No constant is tuned for one machine: until it has seen
``min_samples`` steps it reports itself as not ready, and callers draft as
they would without it.

`allocate` chooses each request's draft length for one step to maximise
expected tokens produced per second of step time.  Each request ``r``
offers its draft tokens with path probabilities ``p[r][0] >= p[r][1] >=
...`` (the probability that the token and its whole prefix are accepted;
calibrated, see `agentspec._calibration`).  A step with draft lengths
``L_r`` produces ``b + sum_r sum_{i<L_r} p[r][i]`` tokens in expectation
(each request emits one token of its own, plus its accepted draft) and
takes ``cost(b, b + sum_r L_r)``.  Adding a token of path probability p to
a step with ``N`` expected tokens and time ``t`` helps iff ``p * t > N *
dt`` (dt: the marginal cost of one more token), so the greedy rule takes
the batch's tokens in descending p and stops at the first that does not
help; with path probabilities decreasing along each draft this is the
optimum for a linear cost.  Free verification (``dt = 0``) keeps every
offered token; a very expensive token keeps none.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

__all__ = ["StepCostModel", "allocate"]


class StepCostModel:
    """Online fit of step time against batch size and verified tokens.

    Args:
        decay: forgetting factor per observation (0 < decay <= 1).
        min_samples: observations before `ready` turns True.
        prior: initial inverse-covariance scale (small: the data decide fast).
    """

    def __init__(self, decay: float = 0.995, min_samples: int = 16, prior: float = 1e-6) -> None:
        """Create an empty model (see the class docstring)."""
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], not {decay}")
        if min_samples < 3:
            raise ValueError(f"min_samples must be >= 3, not {min_samples}")
        self.decay = decay
        self.min_samples = min_samples
        self.samples = 0
        self._theta = [0.0, 0.0, 0.0]
        # P = (X^T X)^-1, started large (weak prior at zero)
        self._p = [[1.0 / prior if i == j else 0.0 for j in range(3)] for i in range(3)]

    @property
    def ready(self) -> bool:
        """Whether enough steps were seen to trust the model."""
        return self.samples >= self.min_samples

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """``(c0, c1, c2)``: seconds per step, per request, per verified token (clipped >= 0)."""
        c0, c1, c2 = self._theta
        return max(c0, 0.0), max(c1, 0.0), max(c2, 0.0)

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """Record one step: ``batch`` requests verified ``tokens`` tokens in ``seconds``.

        Non-finite or negative times and inconsistent counts are ignored.
        """
        if not (math.isfinite(seconds) and seconds >= 0 and 0 < batch <= tokens):
            return
        x = (1.0, float(batch), float(tokens))
        p, lam = self._p, self.decay
        px = [sum(p[i][j] * x[j] for j in range(3)) for i in range(3)]
        denom = lam + sum(x[i] * px[i] for i in range(3))
        gain = [v / denom for v in px]
        err = seconds - sum(self._theta[i] * x[i] for i in range(3))
        self._theta = [self._theta[i] + gain[i] * err for i in range(3)]
        self._p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(3)] for i in range(3)]
        self.samples += 1

    def predict(self, batch: int, tokens: int) -> float:
        """Predicted seconds of a step."""
        c0, c1, c2 = self.coefficients
        return c0 + c1 * batch + c2 * tokens

    def token_cost(self) -> float:
        """Marginal seconds of verifying one more token."""
        return self.coefficients[2]


def allocate(
    path_probs: Sequence[Sequence[float]],
    model: StepCostModel,
    caps: Sequence[int] | None = None,
) -> list[int]:
    """Draft lengths, one per request, maximising expected tokens per second.

    Args:
        path_probs: per request, the path probabilities of its offered draft
            tokens in draft order (non-increasing along the draft).
        model: the step-cost model; when not `StepCostModel.ready` every
            offered token is kept (up to ``caps``).
        caps: per request, most tokens it may draft (e.g. ``k``, or what is
            left before ``max_tokens``); default: all offered.

    Returns:
        ``L_r`` per request, ``0 <= L_r <= min(len(path_probs[r]), caps[r])``.
    """
    b = len(path_probs)
    limits = [
        len(p) if caps is None else max(0, min(len(p), int(caps[r])))
        for r, p in enumerate(path_probs)
    ]
    if not model.ready or b == 0:
        return limits
    dt = model.token_cost()
    if dt <= 0.0:
        return limits
    out = [0] * b
    expected = float(b)
    tokens = b
    seconds = model.predict(b, tokens)
    # max-heap of (next token's path probability, request)
    heap = [(-path_probs[r][0], r) for r in range(b) if limits[r] > 0]
    heapq.heapify(heap)
    while heap:
        neg_p, r = heapq.heappop(heap)
        p = -neg_p
        if p <= 0.0 or p * seconds <= expected * dt:
            break
        out[r] += 1
        expected += p
        tokens += 1
        seconds += dt
        if out[r] < limits[r]:
            heapq.heappush(heap, (-path_probs[r][out[r]], r))
    return out
