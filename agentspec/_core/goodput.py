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
calibrated, see `agentspec._core.calibration`).  A step with draft lengths
``L_r`` produces ``b + sum_r sum_{i<L_r} p[r][i]`` tokens in expectation
(each request emits one token of its own, plus its accepted draft) and
takes ``cost(b, b + sum_r L_r)``.  Adding a token of path probability p to
a step with ``N`` expected tokens and time ``t`` helps iff ``p * t > N *
dt`` (dt: the marginal cost of one more token), so the greedy rule takes
the batch's tokens in descending p and stops at the first that does not
help; with path probabilities decreasing along each draft this is the
optimum for a linear cost.  Free verification (``dt = 0``) keeps every
offered token; very expensive verification keeps none but the tokens that
are certain (p = 1 is always worth it under a linear cost: the step already
pays for the request's own token).

`GoodputController` puts the parts together for an engine: it corrects
each draft's probabilities (`AcceptanceCalibrator`, per group such as
(stage, source tree)), allocates draft lengths over the batch with the
step-cost model, and trims the drafts (a tree draft keeps its most
probable nodes, every kept node's parent included).  The engine reports
back what each step verified (`GoodputController.observe_step`) and how
much of each draft was accepted (`GoodputController.observe_accepted` for a
chain, `GoodputController.observe_verified` for a chain or a tree).
Until the cost model is ready, drafts pass through unchanged, so a
controller never does worse than the fixed policy for lack of data.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Sequence
from typing import Any

from agentspec._core.calibration import AcceptanceCalibrator, conditional_probs, draft_depths
from agentspec._core.draft import Draft
from agentspec._util.args import as_int

__all__ = ["GoodputController", "StepCostModel", "allocate", "size_class", "trim_draft"]


#: Kept drafts whose expected accepted tokens wait for their verification report.
_MAX_PENDING = 4096


def size_class(n: int) -> int:
    """The size class of a count: 1 for 1, 2 for 2-3, 3 for 4-7, 4 for 8-15, ..."""
    return max(int(n), 1).bit_length()


def _class_label(k: int) -> str:
    """``size_class`` ``k`` as the range it covers ("1", "2-3", "4-7", ...)."""
    return "1" if k <= 1 else f"{1 << (k - 1)}-{(1 << k) - 1}"


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
        #: Observations ignored as pauses: slower than this many times the prediction.
        self.outlier_factor = 20.0
        self.outliers = 0
        self._theta = [0.0, 0.0, 0.0]
        # P = (X^T X)^-1, started large (weak prior at zero)
        self._p = [[1.0 / prior if i == j else 0.0 for j in range(3)] for i in range(3)]
        # size class of the verified tokens -> [steps, seconds, predicted seconds]
        self._by_size: dict[int, list[float]] = {}

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
        if self.ready and seconds > self.outlier_factor * max(self.predict(batch, tokens), 1e-9):
            self.outliers += 1  # a pause (idle engine, preemption), not a step
            return
        if self.ready:  # how well the fit predicted this step, before it learns from it
            tally = self._by_size.setdefault(size_class(tokens), [0, 0.0, 0.0])
            tally[0] += 1
            tally[1] += seconds
            tally[2] += self.predict(batch, tokens)
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

    def residuals(self) -> dict[str, dict[str, float]]:
        """Per size class of the verified tokens ("1", "2-3", "4-7", ...): the steps
        observed once the model was ready, their mean seconds and the mean the
        fit predicted for them just before seeing each.  A linear fit that is
        wrong for large steps shows here as actual above predicted."""
        return {
            _class_label(k): {
                "steps": int(n),
                "seconds": total / n,
                "predicted": predicted / n,
            }
            for k, (n, total, predicted) in sorted(self._by_size.items())
        }


def allocate(
    path_probs: Sequence[Sequence[float]],
    model: StepCostModel,
    caps: Sequence[int] | None = None,
    undrafted: int = 0,
) -> list[int]:
    """Draft lengths, one per request, maximising expected tokens per second.

    Args:
        path_probs: per request, the path probabilities of its offered draft
            tokens in draft order (non-increasing along the draft).
        model: the step-cost model; when not `StepCostModel.ready` every
            offered token is kept (up to ``caps``).
        caps: per request, most tokens it may draft (e.g. ``k``, or what is
            left before ``max_tokens``); default: all offered.
        undrafted: further requests in the step that offer no draft: rows
            at their length limit, and rows still computing their prompt.
            They count as rows with an empty offer: each makes (or, once its
            prompt is in, will make) one token per step, so the step an
            accepted token saves is a step of all of them, and a token's
            worth is weighed at that batch.  Without them, a step where a few
            requests decode while many more are prefilled looks like a small
            batch, where a draft token is cheap next to the step.

    Returns:
        ``L_r`` per request, ``0 <= L_r <= min(len(path_probs[r]), caps[r])``.

    Raises:
        TypeError: ``undrafted`` is not an integer.
        InvalidArgumentError: ``undrafted`` is negative.
    """
    undrafted = as_int(undrafted, "undrafted", 0)
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
    rows = b + undrafted
    expected = float(rows)
    seconds = model.predict(rows, rows)
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
        seconds += dt
        if out[r] < limits[r]:
            heapq.heappush(heap, (-path_probs[r][out[r]], r))
    return out


def trim_draft(draft: Draft, order: Sequence[int], keep: int) -> Draft:
    """``draft`` with only the nodes ``order[:keep]`` (parents before children), re-indexed."""
    if keep >= len(draft.token_ids):
        return draft
    kept = sorted(order[:keep])
    where = {old: new for new, old in enumerate(kept)}
    tokens = [draft.token_ids[i] for i in kept]
    parents = [where[draft.parents[i]] if draft.parents[i] >= 0 else -1 for i in kept]
    probs = [draft.probs[i] for i in kept]
    return Draft(tokens, parents, probs, float(sum(probs)), draft.match_len, draft.source)


class GoodputController:
    """Per-step draft lengths from calibrated probabilities and the measured step cost.

    Args:
        calibrator: the acceptance correction (default: a fresh one).
        cost: the step-cost model (default: a fresh one).
        enabled: False passes drafts through unchanged (the fixed policy),
            still learning from what is reported.

    Not thread-safe: one controller per engine loop.
    """

    def __init__(
        self,
        calibrator: AcceptanceCalibrator | None = None,
        cost: StepCostModel | None = None,
        *,
        enabled: bool = True,
    ) -> None:
        """Create a controller (see the class docstring)."""
        self.calibrator = calibrator if calibrator is not None else AcceptanceCalibrator()
        self.cost = cost if cost is not None else StepCostModel()
        self.enabled = enabled
        self.offered = 0  # draft tokens offered to `trim`
        self.kept = 0  # of those, kept
        # Acceptance as predicted and as observed, per size class of the batch
        # of the step that verified the drafts: [drafts, tokens, expected, accepted]
        self._by_batch: dict[int, list[float]] = {}
        self._batch_class = size_class(1)  # the batch of the last `trim`
        # id(kept draft) -> (that draft, its expected accepted tokens when kept)
        self._pending: dict[int, tuple[Draft, float]] = {}

    def note_batch(self, batch: int) -> None:
        """Tell the controller the batch of a step whose drafts bypass `trim` (the
        fixed policy), so acceptance is tallied under the right batch class."""
        self._batch_class = size_class(batch)

    @property
    def active(self) -> bool:
        """Whether `trim` cuts drafts now (enabled, and the cost model is ready)."""
        return self.enabled and self.cost.ready

    def corrected_path_probs(self, draft: Draft, group: Hashable) -> list[float]:
        """Each node's probability of being accepted with its whole path, corrected."""
        probs, parents = draft.probs, draft.parents
        # `conditional_probs` and `draft_depths` in one pass (this runs per drafted token)
        cond: list[float] = []
        depths: list[int] = []
        for i, j in enumerate(parents):
            if j < 0:
                c, depths_i = probs[i], 0
            else:
                base = probs[j]
                c, depths_i = (probs[i] / base if base > 0 else 0.0), depths[j] + 1
            cond.append(1.0 if c > 1.0 else (c if c > 0.0 else 0.0))
            depths.append(depths_i)
        path = self.calibrator.correct_all(group, cond, depths)
        for i, j in enumerate(parents):
            if j >= 0:
                path[i] *= path[j]
        return path

    def trim(
        self,
        drafts: Sequence[Draft],
        groups: Sequence[Hashable],
        caps: Sequence[int] | None = None,
        *,
        undrafted: int = 0,
    ) -> list[Draft]:
        """The drafts of one step, each cut to the length `allocate` gives it.

        ``groups``: per draft, its calibration group; ``caps``: per draft,
        the most tokens it may keep (e.g. what is left before
        ``max_tokens``); ``undrafted``: further requests in the step that
        offer no draft, such as prompts in prefill (see `allocate`).  A kept
        node's parent is always kept.
        """
        n = len(drafts)
        if len(groups) != n or (caps is not None and len(caps) != n):
            raise ValueError("drafts, groups and caps must have one entry per request")
        self._batch_class = size_class(n)
        offered = sum(len(d.token_ids) for d in drafts)
        self.offered += offered
        if not self.enabled or not self.cost.ready:
            out = list(drafts)
            if caps is not None:
                out = [
                    trim_draft(d, range(len(d.token_ids)), max(0, int(c)))
                    for d, c in zip(out, caps, strict=True)
                ]
            self.kept += sum(len(d.token_ids) for d in out)
            return out
        orders: list[list[int]] = []
        offers: list[list[float]] = []
        for d, g in zip(drafts, groups, strict=True):
            path = self.corrected_path_probs(d, g)
            # descending probability; on ties the lower index (a parent) first
            order = [i for _, i in sorted((-p, i) for i, p in enumerate(path))]
            orders.append(order)
            offers.append([path[i] for i in order])
        lengths = allocate(offers, self.cost, caps, undrafted)
        out = [trim_draft(d, o, k) for d, o, k in zip(drafts, orders, lengths, strict=True)]
        self.kept += sum(lengths)
        for d, offer, k in zip(out, offers, lengths, strict=True):
            if k:
                self._remember(d, expected=sum(offer[:k]))
        return out

    def _remember(self, draft: Draft, expected: float) -> None:
        """Keep a kept draft's expected accepted tokens for `_tally` (computed by
        `trim` anyway); the oldest entries go once `_MAX_PENDING` are held (drafts
        of requests that ended are never reported)."""
        pending = self._pending
        pending[id(draft)] = (draft, expected)
        if len(pending) > _MAX_PENDING:
            del pending[next(iter(pending))]

    def observe_accepted(self, group: Hashable, draft: Draft, accepted: int) -> None:
        """Report that the first ``accepted`` tokens of a verified chain ``draft`` were kept.

        Only the verified prefix is read (the accepted tokens and the first
        rejected one).  For a tree draft use `observe_verified` with the
        tokens the engine emitted; a prefix of another shape is ignored here.
        """
        n = min(max(0, accepted) + 1, len(draft.token_ids))
        parents = draft.parents[:n]
        if any(j != i - 1 for i, j in enumerate(parents)):
            return
        cond = conditional_probs(draft.probs[:n], parents)
        if cond:
            self._tally(group, draft, len(draft.token_ids), min(max(0, accepted), n))
            self.calibrator.observe(group, cond, min(max(0, accepted), n))

    def observe_verified(self, group: Hashable, draft: Draft, tokens: Sequence[int]) -> int:
        """Report a verified draft (chain or tree) and the tokens the engine emitted
        after it; returns how many draft tokens were accepted.

        The accepted path is followed from the context: at each accepted node
        every child was verified, the one equal to the next emitted token
        accepted and its siblings rejected (mutually exclusive outcomes, each
        scored against its own conditional probability).  The walk stops where
        the emitted tokens end (nothing is known past them).
        """
        ids, parents = draft.token_ids, draft.parents
        if not ids:
            return 0
        if all(j == i - 1 for i, j in enumerate(parents)):  # a chain: compare the prefix
            n = min(len(ids), len(tokens))
            k = 0
            while k < n and ids[k] == tokens[k]:
                k += 1
            verified = k + 1 if k < n else k  # a rejection only where a token was compared
            self._tally(group, draft, len(ids), k)
            cond = conditional_probs(draft.probs[:verified], parents[:verified])
            self.calibrator.observe_outcomes(group, [(c, i < k) for i, c in enumerate(cond)])
            return k
        cond = conditional_probs(draft.probs, parents)
        depth = draft_depths(parents)
        children: dict[int, list[int]] = {}
        for i, j in enumerate(parents):
            children.setdefault(j, []).append(i)
        outcomes: list[tuple[float, bool]] = []
        depths: list[int] = []
        node, k = -1, 0
        while k < len(tokens):
            kids = children.get(node)
            if not kids:
                break
            want = tokens[k]
            nxt = -1
            for c in kids:
                ok = nxt < 0 and ids[c] == want
                outcomes.append((cond[c], ok))
                depths.append(depth[c])
                if ok:
                    nxt = c
            if nxt < 0:
                break
            node, k = nxt, k + 1
        self._tally(group, draft, len(ids), k)
        self.calibrator.observe_outcomes(group, outcomes, depths)
        return k

    def _tally(self, group: Hashable, draft: Draft, verified: int, accepted: int) -> None:
        """Count a verified draft's expected (corrected: as `trim` predicted when it
        kept the draft, else before this outcome is learned) and accepted tokens
        under the batch class of the last step."""
        tally = self._by_batch.setdefault(self._batch_class, [0, 0, 0.0, 0])
        tally[0] += 1
        tally[1] += verified
        hit = self._pending.pop(id(draft), None)
        if hit is not None and hit[0] is draft and verified == len(draft.token_ids):
            tally[2] += hit[1]
        else:
            tally[2] += sum(self.corrected_path_probs(draft, group)[:verified])
        tally[3] += accepted

    def observe_step(self, batch: int, tokens: int, seconds: float) -> None:
        """Report a verification step: ``batch`` requests, ``tokens`` verified, its time."""
        self.cost.observe(batch, tokens, seconds)

    def stats(self) -> dict[str, Any]:
        """What the controller has learned and done so far (JSON-ready): whether it
        cuts now, the step-cost fit (seconds = c0 + c1 * batch + c2 * tokens) with
        its predictions against the observed step times per size class of the
        verified tokens (`StepCostModel.residuals`), the draft tokens offered to
        `trim` and kept, and per size class of the step's batch the verified
        drafts' expected accepted tokens (corrected probabilities) against the
        accepted ones; ``calibration_error``: per draft depth class, the calibrator's
        mean estimate minus the observed acceptance rate
        (`AcceptanceCalibrator.depth_errors`)."""
        cost = self.cost
        c0, c1, c2 = cost.coefficients
        return {
            "enabled": self.enabled,
            "active": self.active,
            "step_cost": {
                "ready": cost.ready,
                "samples": cost.samples,
                "pauses_ignored": cost.outliers,
                "seconds": {"per_step": c0, "per_request": c1, "per_token": c2},
                "by_tokens": cost.residuals(),
            },
            "offered": self.offered,
            "kept": self.kept,
            "acceptance_by_batch": {
                _class_label(k): {
                    "drafts": int(d),
                    "tokens": int(t),
                    "expected": e,
                    "accepted": int(a),
                }
                for k, (d, t, e, a) in sorted(self._by_batch.items())
            },
            "calibration_groups": len(self.calibrator.groups()),
            "calibration_error": self.calibrator.depth_errors(),
        }
