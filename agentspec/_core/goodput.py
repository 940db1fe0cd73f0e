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
when predicting.  Real steps are not linear in ``n``: on a CPU a forward
pass over a few rows runs as matrix-vector products and one over more rows
as a matrix product, which can cost twice as much at once.  So each step
size up to `SHAPE_TOKENS` tokens also learns its own factor over the line
(the decayed mean of log(seconds / line), shrunk towards 1 while it has
seen few steps of that size), and predictions are the line times it where
it is above 1, never below a smaller step, nor below the step without
drafts plus the line's cost per further token (factors are measured at
different times, under different load).  No
constant is tuned for one machine: until it has seen ``min_samples`` steps
it reports itself as not ready, and callers draft as they would without it.

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
the batch's tokens in descending p and keeps the prefix of that order with
the highest expected tokens per second; with path probabilities decreasing
along each draft this is the optimum for a linear cost, and with the step
shape factors a draft that would cross into a dearer shape must pay for
the jump.  Free verification (``dt = 0``, no shape) keeps every offered
token; very expensive verification keeps none but the tokens that are
certain (p = 1 is always worth it under a linear cost: the step already
pays for the request's own token).

`GoodputController` puts the parts together for an engine: it corrects
each draft's probabilities (`AcceptanceCalibrator`, per group such as
(stage, source tree), then `GoodputController.stage_factor`, a fast
per-stage check of what the drafts really realise), allocates draft lengths
over the batch with the step-cost model, and trims the drafts (a tree draft keeps its most
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


#: Steps verifying up to this many tokens get a step-shape factor of their own
#: (`StepCostModel.shape_factor`); larger ones share the factor of this size.
SHAPE_TOKENS = 16
#: Forgetting per observation of a step shape, its prior weight (pseudo-steps at
#: factor 1), and the largest |log(seconds / line)| one step contributes.
_SHAPE_DECAY = 0.98
_SHAPE_PRIOR = 4.0
_MAX_LOG_RATIO = 2.0


#: Per stage, pseudo-tokens of evidence that drafts are accepted as calibrated
#: (`GoodputController.stage_factor`), and the weight old evidence keeps per draft
#: of the stage offered to `GoodputController.trim` (so a stage whose drafts were
#: cut to nothing is tried again once its evidence has faded).
_STAGE_PRIOR = 1.0
_STAGE_DECAY = 0.95
#: A stage cut to nothing drafts again once its factor is this many times the
#: factor it was cut at, or half way from there to 1 if that is less (so it is
#: not re-tried at once, on the next draft).
_STAGE_RETRY = 2.0


def _stage(group: Hashable) -> Hashable:
    """The stage of a calibration group: a tuple group's first element, else the group."""
    return group[0] if isinstance(group, tuple) and group else group


def _label(stage: Hashable) -> str:
    """A stage as a JSON key ("pipeline/stage" for a tuple)."""
    if isinstance(stage, tuple):
        return "/".join("-" if x is None else str(x) for x in stage)
    return str(stage)


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
        # step shape: min(tokens, SHAPE_TOKENS) -> [weight, weighted sum of log(seconds / line)]
        self._shape: dict[int, list[float]] = {}

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
            line = self._line(batch, tokens)
            if line > 0 and seconds > 0:
                shape = self._shape.setdefault(min(tokens, SHAPE_TOKENS), [0.0, 0.0])
                ratio = min(max(math.log(seconds / line), -_MAX_LOG_RATIO), _MAX_LOG_RATIO)
                shape[0] = shape[0] * _SHAPE_DECAY + 1.0
                shape[1] = shape[1] * _SHAPE_DECAY + ratio
        x = (1.0, float(batch), float(tokens))
        p, lam = self._p, self.decay
        px = [sum(p[i][j] * x[j] for j in range(3)) for i in range(3)]
        denom = lam + sum(x[i] * px[i] for i in range(3))
        gain = [v / denom for v in px]
        err = seconds - sum(self._theta[i] * x[i] for i in range(3))
        self._theta = [self._theta[i] + gain[i] * err for i in range(3)]
        self._p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(3)] for i in range(3)]
        self.samples += 1

    def _line(self, batch: int, tokens: int) -> float:
        c0, c1, c2 = self.coefficients
        return c0 + c1 * batch + c2 * tokens

    def shape_factor(self, tokens: int) -> float:
        """How much slower than the line a step verifying ``tokens`` tokens was
        observed to be (1.0 before any such step; shrunk towards 1.0 while few;
        `predict` uses it where it is above 1)."""
        shape = self._shape.get(min(tokens, SHAPE_TOKENS))
        if shape is None:
            return 1.0
        return math.exp(shape[1] / (shape[0] + _SHAPE_PRIOR))

    def _shaped(self, batch: int, tokens: int) -> float:
        return self._line(batch, tokens) * max(1.0, self.shape_factor(tokens))

    def predict(self, batch: int, tokens: int) -> float:
        """Predicted seconds of a step: the line times `shape_factor` where that is
        above 1, never less than a smaller step of the same batch, nor than the
        step without drafts plus the line's cost of each further token (a shape
        factor is measured at other times than another size's, under other load:
        it may raise a step's cost, never make a larger step look cheaper)."""
        if not self._shape:
            return self._line(batch, tokens)
        first = max(batch, 1)
        top = min(tokens, SHAPE_TOKENS)
        if first > top:
            return self._shaped(batch, tokens)
        dt = self.coefficients[2]
        base = seconds = self._shaped(batch, first)
        for n in range(first + 1, top + 1):
            seconds = max(self._shaped(batch, n), seconds, base + dt * (n - first))
        if tokens > top:
            seconds = max(self._shaped(batch, tokens), seconds, base + dt * (tokens - first))
        return seconds

    @property
    def has_shape(self) -> bool:
        """Whether any step shape was observed (`shape_factor` may differ from 1)."""
        return bool(self._shape)

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
    if dt <= 0.0 and not model.has_shape:
        return limits
    out = [0] * b
    rows = b + undrafted
    expected = float(rows)
    tokens = rows
    best = expected / max(model.predict(rows, tokens), 1e-12)
    taken: list[int] = []  # requests in the order their tokens were taken
    keep = 0  # how many of `taken` the best step so far keeps
    # max-heap of (next token's path probability, request)
    heap = [(-path_probs[r][0], r) for r in range(b) if limits[r] > 0]
    heapq.heapify(heap)
    while heap:
        neg_p, r = heapq.heappop(heap)
        p = -neg_p
        if p <= 0.0:
            break
        expected += p
        tokens += 1
        taken.append(r)
        rate = expected / max(model.predict(rows, tokens), 1e-12)
        if rate > best:
            best, keep = rate, len(taken)
        elif tokens >= SHAPE_TOKENS:
            break  # past the shaped sizes the cost is linear: the rate only falls from here
        out[r] += 1
        if out[r] < limits[r]:
            heapq.heappush(heap, (-path_probs[r][out[r]], r))
    out = [0] * b
    for r in taken[:keep]:
        out[r] += 1
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
        # stage -> [expected accepted tokens (calibrated), tokens saved (both decayed),
        # the factor to wait for after its drafts were cut to nothing (0: none)]
        self._stages: dict[Hashable, list[float]] = {}

    def note_batch(self, batch: int) -> None:
        """Tell the controller the batch of a step whose drafts bypass `trim` (the
        fixed policy), so acceptance is tallied under the right batch class."""
        self._batch_class = size_class(batch)

    def stage_factor(self, group: Hashable) -> float:
        """How much of what the calibrator expects the drafts of ``group``'s stage
        (a tuple group's first element, e.g. the pipeline stage) have recently
        realised: ``(accepted + prior) / (expected + prior)`` over its verified
        drafts, capped at 1.  `trim` scales the stage's path probabilities by it.

        The calibrator corrects per group, depth and probability bucket, so it
        needs many drafts; this ratio needs a few, and stops a stage whose drafts
        are never accepted (answers of a word or two that differ every time)
        from paying for their verification meanwhile.  Its evidence fades with
        each draft of the stage offered to `trim`; a stage cut to nothing drafts
        again once its factor has doubled, and is measured again.
        """
        row = self._stages.get(_stage(group))
        if row is None:
            return 1.0
        return min(1.0, (row[1] + _STAGE_PRIOR) / (row[0] + _STAGE_PRIOR))

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
        scaled: list[list[float]] = []
        limits = [len(d.token_ids) for d in drafts] if caps is None else list(caps)
        factors: list[float] = []
        for r, (d, g) in enumerate(zip(drafts, groups, strict=True)):
            path = self.corrected_path_probs(d, g)
            # descending probability; on ties the lower index (a parent) first
            order = [i for _, i in sorted((-p, i) for i, p in enumerate(path))]
            orders.append(order)
            offer = [path[i] for i in order]
            offers.append(offer)
            factor = self.stage_factor(g)
            factors.append(factor)
            scaled.append(offer if factor >= 1.0 else [p * factor for p in offer])
            row = self._stages.get(_stage(g)) if offer else None
            if row is not None:
                row[0] *= _STAGE_DECAY
                row[1] *= _STAGE_DECAY
                if factor < row[2]:  # cut before: wait until the factor has recovered
                    limits[r] = 0
                else:
                    row[2] = 0.0
        lengths = allocate(scaled, self.cost, limits, undrafted)
        for g, offer, factor, k in zip(groups, offers, factors, lengths, strict=True):
            row = self._stages.get(_stage(g))
            if row is not None and offer and not k and factor < 1.0 and not row[2]:
                row[2] = min(_STAGE_RETRY * factor, (1.0 + factor) / 2)
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
            self._tally(group, draft, len(ids), k, min(k, len(tokens) - 1))
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
        self._tally(group, draft, len(ids), k, min(k, len(tokens) - 1))
        self.calibrator.observe_outcomes(group, outcomes, depths)
        return k

    def _tally(
        self, group: Hashable, draft: Draft, verified: int, accepted: int, saved: int | None = None
    ) -> None:
        """Count a verified draft's expected (corrected: as `trim` predicted when it
        kept the draft, else before this outcome is learned) and accepted tokens
        under the batch class of the last step, and for its stage the tokens it
        ``saved`` (default: ``accepted``): an accepted token that ends the output
        (EOS, a stop string, the length limit) saves no step, since the step's
        own token after it is dropped."""
        tally = self._by_batch.setdefault(self._batch_class, [0, 0, 0.0, 0])
        tally[0] += 1
        tally[1] += verified
        hit = self._pending.pop(id(draft), None)
        if hit is not None and hit[0] is draft and verified == len(draft.token_ids):
            expected = hit[1]
        else:
            expected = sum(self.corrected_path_probs(draft, group)[:verified])
        tally[2] += expected
        tally[3] += accepted
        stage = self._stages.setdefault(_stage(group), [0.0, 0.0, 0.0])
        stage[0] += expected
        stage[1] += accepted if saved is None else max(0, saved)

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
            "acceptance_by_stage": {
                _label(stage): {
                    "expected": e,
                    "accepted": a,
                    "factor": min(1.0, (a + _STAGE_PRIOR) / (e + _STAGE_PRIOR)),
                }
                for stage, (e, a, _) in self._stages.items()
            },
            "calibration_groups": len(self.calibrator.groups()),
            "calibration_error": self.calibrator.depth_errors(),
        }
