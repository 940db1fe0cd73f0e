"""Acceptance calibration: how often a draft token with estimated probability p is accepted.

A draft token's probability comes from the tree's counts: the share of the
continuations below its parent that continue with it (`Draft.probs` holds
the product along the path, so the token's own, *conditional* probability
is ``probs[i] / probs[parent]``).  Counts are a biased estimate of what a
verifier accepts: few observations make them extreme (1 of 1 is p = 1),
and a stage whose outputs drift from its history makes them optimistic.

`AcceptanceCalibrator` learns the correction online, per group (e.g. a
pipeline stage and the tree the draft came from) and per depth in the
draft (`depth_class`: the first token, the second, the 3rd-4th, the
5th-8th, the rest; a token far into a draft is accepted less often than
its counts say, more so than the first).  It keeps, per bucket of the
estimated probability, how many tokens were verified and how many
accepted, and corrects an estimate to the bucket's observed rate shrunk
towards what every group observed at that depth and bucket (``pooled``),
itself shrunk towards the estimate, with ``prior`` pseudo-observations at
each level::

    pooled(p)    = (accepted_all + prior * p) / (verified_all + prior)
    corrected(p) = (accepted_g + prior * pooled(p)) / (verified_g + prior)

so before any observation p is returned unchanged, a new group starts
from what the others taught (the raw counts are optimistic everywhere),
and a well-observed group gets what it observed.  Only tokens whose whole
prefix was accepted are observations (after the first rejection nothing
is verified).  Counts are halved once a bucket holds ``horizon``
observations, so the correction follows drift.

Replayed on spider-sql (300 sessions, k = 8, through `Speculator`), the
expected accepted tokens of a draft (the sum of its corrected path
probabilities) over the tokens actually accepted was 1.137 in the first
half and 1.094 in the second with one table per group; with the depth
classes and the pooled level it is 0.978 and 1.027 (docs/goodput.md has
every trace).

`conditional_probs` converts a draft's path probabilities and
`draft_depths` gives each node's depth.  Everything here is plain Python
on small lists: it runs once per draft, beside drafting.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = [
    "AcceptanceCalibrator",
    "BucketStats",
    "conditional_probs",
    "depth_class",
    "draft_depths",
]

#: Depth classes: 0, 1, 2-3, 4-7, 8 and deeper.
DEPTH_CLASSES = 5
#: Each depth class as the depths it covers.
_DEPTH_LABELS = ("0", "1", "2-3", "4-7", "8+")


def depth_class(depth: int) -> int:
    """The class of a node's depth in its draft (0: a child of the context)."""
    return min(max(depth, 0), 1 << (DEPTH_CLASSES - 2)).bit_length()


def draft_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth in a draft (0 for a child of the context), parents first."""
    out: list[int] = []
    for j in parents:
        out.append(0 if j < 0 else out[j] + 1)
    return out


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
        prior: pseudo-observations at each level of shrinkage.
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
        # group -> depth class -> bucket -> [verified, accepted, sum of estimates]
        self._counts: dict[Hashable, list[list[list[float]]]] = {}
        self._pooled = self._empty()

    def _empty(self) -> list[list[list[float]]]:
        return [[[0.0, 0.0, 0.0] for _ in range(self.buckets)] for _ in range(DEPTH_CLASSES)]

    def _bucket(self, p: float) -> int:
        return min(self.buckets - 1, max(0, int(p * self.buckets)))

    def correct(self, group: Hashable, p: float, depth: int = 0) -> float:
        """The corrected acceptance probability of a token estimated at ``p`` at
        ``depth`` in its draft (0: a child of the context)."""
        d, b, prior = depth_class(depth), self._bucket(p), self.prior
        n, a, _ = self._pooled[d][b]
        q = (a + prior * p) / (n + prior)
        rows = self._counts.get(group)
        if rows is None:
            return q
        n, a, _ = rows[d][b]
        return (a + prior * q) / (n + prior)

    def correct_all(
        self, group: Hashable, probs: Sequence[float], depths: Sequence[int] | None = None
    ) -> list[float]:
        """`correct` for each of ``probs`` (``depths`` default: a chain, 0, 1, 2, ...)."""
        if depths is None:
            depths = range(len(probs))
        elif len(depths) != len(probs):
            raise ValueError("probs and depths must have one entry per token")
        if type(self).correct is not AcceptanceCalibrator.correct:  # a subclass's own rule
            return [self.correct(group, p, d) for p, d in zip(probs, depths, strict=True)]
        # `correct` (`depth_class`, `_bucket`) inlined: this runs for every drafted
        # token of every step; a test checks both give the same numbers.
        pooled, rows, prior, top = self._pooled, self._counts.get(group), self.prior, self.buckets
        deepest = 1 << (DEPTH_CLASSES - 2)
        out: list[float] = []
        for p, depth in zip(probs, depths, strict=True):
            d = (depth if depth < deepest else deepest).bit_length() if depth > 0 else 0
            b = int(p * top)
            b = 0 if b < 0 else (top - 1 if b >= top else b)
            n, a, _ = pooled[d][b]
            q = (a + prior * p) / (n + prior)
            if rows is not None:
                n, a, _ = rows[d][b]
                q = (a + prior * q) / (n + prior)
            out.append(q)
        return out

    def observe(self, group: Hashable, probs: Sequence[float], accepted: int) -> None:
        """Record a verified chain draft: conditional ``probs``, ``accepted`` tokens kept.

        Tokens ``0..accepted-1`` count as accepted, token ``accepted`` (if
        drafted) as rejected; later tokens were never verified on their own.
        """
        n = max(0, accepted)
        self.observe_outcomes(group, [(p, i < n) for i, p in enumerate(probs[: n + 1])])

    def observe_outcomes(
        self,
        group: Hashable,
        outcomes: Sequence[tuple[float, bool]],
        depths: Sequence[int] | None = None,
    ) -> None:
        """Record verified draft tokens: per token its conditional probability and
        whether it was accepted (for a tree, each child of an accepted node), at
        ``depths`` (default: a chain, 0, 1, 2, ...)."""
        if not outcomes:
            return
        rows = self._counts.get(group)
        if rows is None:
            rows = self._counts[group] = self._empty()
        if depths is None:
            depths = range(len(outcomes))
        elif len(depths) != len(outcomes):
            raise ValueError("outcomes and depths must have one entry per token")
        # `depth_class` and `_bucket` inlined, as in `correct_all` (per verified token)
        pooled, top, horizon = self._pooled, self.buckets, self.horizon
        deepest = 1 << (DEPTH_CLASSES - 2)
        for (p, ok), depth in zip(outcomes, depths, strict=True):
            d = (depth if depth < deepest else deepest).bit_length() if depth > 0 else 0
            b = int(p * top)
            b = 0 if b < 0 else (top - 1 if b >= top else b)
            for row in (rows[d][b], pooled[d][b]):
                if row[0] >= horizon:
                    row[0] *= 0.5
                    row[1] *= 0.5
                    row[2] *= 0.5
                row[0] += 1.0
                if ok:
                    row[1] += 1.0
                row[2] += p

    def groups(self) -> list[Hashable]:
        """The groups observed so far."""
        return list(self._counts)

    def depth_errors(self) -> dict[str, float]:
        """Per depth class ("0", "1", "2-3", "4-7", "8+") with verified tokens, over
        every group: the mean estimated acceptance minus the observed acceptance
        rate (> 0: the estimates are too high)."""
        out: dict[str, float] = {}
        for d, buckets in enumerate(self._pooled):
            n = sum(row[0] for row in buckets)
            if n > 0:
                accepted = sum(row[1] for row in buckets)
                estimated = sum(row[2] for row in buckets)
                out[_DEPTH_LABELS[d]] = (estimated - accepted) / n
        return out

    def table(self, group: Hashable) -> list[BucketStats]:
        """The buckets of ``group`` over every depth (empty ones included)."""
        per_depth = self._counts.get(group) or self._empty()
        w = 1.0 / self.buckets
        out = []
        for i in range(self.buckets):
            n = sum(rows[i][0] for rows in per_depth)
            a = sum(rows[i][1] for rows in per_depth)
            s = sum(rows[i][2] for rows in per_depth)
            out.append(BucketStats(i * w, (i + 1) * w, n, a, s / n if n else (i + 0.5) * w))
        return out
