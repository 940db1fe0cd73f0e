"""Acceptance calibration: how often a draft token with estimated probability p is accepted.

A draft token's probability comes from the tree's counts: the share of the
continuations below its parent that continue with it (`Draft.probs` holds
the product along the path, so the token's own, *conditional* probability
is ``probs[i] / probs[parent]``).  Counts are a biased estimate of what a
verifier accepts: few observations make them extreme (1 of 1 is p = 1),
and a stage whose outputs drift from its history makes them optimistic.

`AcceptanceCalibrator` learns the correction online, per group (e.g. a
pipeline stage and the tree the draft came from): it keeps, per bucket of
the estimated probability, how many tokens were verified and how many
accepted, and corrects an estimate to the bucket's observed rate shrunk
towards the estimate itself with ``prior`` pseudo-observations::

    corrected(p) = (accepted_b + prior * p) / (verified_b + prior)

so an unseen bucket returns p unchanged, and a well-observed one returns
what was observed.  Only tokens whose whole prefix was accepted are
observations (after the first rejection nothing is verified).  Counts are
halved once a bucket holds ``horizon`` observations, so the correction
follows drift.

`conditional_probs` converts a draft's path probabilities.  Everything here
is plain Python on small lists: it runs once per draft, beside drafting.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["AcceptanceCalibrator", "BucketStats", "conditional_probs"]


def conditional_probs(probs: Sequence[float], parents: Sequence[int]) -> list[float]:
    """Each draft token's probability given its parent was accepted.

    ``probs`` are path probabilities (`Draft.probs`); ``parents[i]`` is the
    index of token i's parent (-1: the context).  Values are clipped to [0, 1].
    """
    out: list[float] = []
    for i, p in enumerate(probs):
        j = parents[i]
        base = 1.0 if j < 0 else probs[j]
        c = p / base if base > 0 else 0.0
        out.append(min(1.0, max(0.0, c)))
    return out


@dataclass(frozen=True, slots=True)
class BucketStats:
    """One probability bucket of one group.

    Attributes:
        low, high: the bucket's range of estimated probabilities.
        verified: tokens observed (after any halving).
        accepted: of those, accepted.
        mean_estimate: the mean estimated probability of the tokens observed.
    """

    low: float
    high: float
    verified: float
    accepted: float
    mean_estimate: float


class AcceptanceCalibrator:
    """Online per-group correction of draft-token acceptance estimates.

    Args:
        buckets: equal-width buckets over [0, 1].
        prior: pseudo-observations at the estimate itself (shrinkage).
        horizon: a bucket's counts are halved once they reach this.
    """

    def __init__(self, buckets: int = 10, prior: float = 8.0, horizon: float = 4096.0) -> None:
        """Create an empty calibrator (see the class docstring)."""
        if buckets < 1:
            raise ValueError(f"buckets must be >= 1, not {buckets}")
        if prior <= 0 or horizon <= prior:
            raise ValueError("need prior > 0 and horizon > prior")
        self.buckets = buckets
        self.prior = prior
        self.horizon = horizon
        # group -> per bucket [verified, accepted, sum of estimates]
        self._counts: dict[Hashable, list[list[float]]] = {}

    def _bucket(self, p: float) -> int:
        return min(self.buckets - 1, max(0, int(p * self.buckets)))

    def correct(self, group: Hashable, p: float) -> float:
        """The corrected acceptance probability of a token estimated at ``p``."""
        rows = self._counts.get(group)
        if rows is None:
            return p
        n, a, _ = rows[self._bucket(p)]
        return (a + self.prior * p) / (n + self.prior)

    def correct_all(self, group: Hashable, probs: Sequence[float]) -> list[float]:
        """`correct` for each of ``probs``."""
        return [self.correct(group, p) for p in probs]

    def observe(self, group: Hashable, probs: Sequence[float], accepted: int) -> None:
        """Record a verified chain draft: conditional ``probs``, ``accepted`` tokens kept.

        Tokens ``0..accepted-1`` count as accepted, token ``accepted`` (if
        drafted) as rejected; later tokens were never verified on their own.
        """
        n = max(0, accepted)
        self.observe_outcomes(group, [(p, i < n) for i, p in enumerate(probs[: n + 1])])

    def observe_outcomes(self, group: Hashable, outcomes: Sequence[tuple[float, bool]]) -> None:
        """Record verified draft tokens: per token its conditional probability and
        whether it was accepted (for a tree, each child of an accepted node)."""
        if not outcomes:
            return
        rows = self._counts.get(group)
        if rows is None:
            rows = self._counts[group] = [[0.0, 0.0, 0.0] for _ in range(self.buckets)]
        for p, ok in outcomes:
            row = rows[self._bucket(p)]
            if row[0] >= self.horizon:
                row[0] *= 0.5
                row[1] *= 0.5
                row[2] *= 0.5
            row[0] += 1.0
            row[1] += 1.0 if ok else 0.0
            row[2] += p

    def groups(self) -> list[Hashable]:
        """The groups observed so far."""
        return list(self._counts)

    def table(self, group: Hashable) -> list[BucketStats]:
        """The buckets of ``group`` (empty ones included)."""
        rows = self._counts.get(group) or [[0.0, 0.0, 0.0] for _ in range(self.buckets)]
        w = 1.0 / self.buckets
        return [
            BucketStats(i * w, (i + 1) * w, n, a, s / n if n else (i + 0.5) * w)
            for i, (n, a, s) in enumerate(rows)
        ]
