"""`Speculator` with its goodput controller: fixed policy until the step cost is known,
then drafts cut to what pays; acceptance learned from `extend`."""

from __future__ import annotations

import random

import pytest

from agentspec import DraftParams, GoodputController, Speculator
from agentspec._core.goodput import StepCostModel

PARAMS = DraftParams(max_spec_tokens=16, min_token_prob=0.0)
ANSWER = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]


def _trained(goodput) -> Speculator:
    spec = Speculator(16, params=PARAMS, goodput=goodput)
    for i in range(6):  # the same answer six times: long, confident drafts
        spec.start_request(("warm", i), [1, 2, 3], stage="sql")
        spec.extend(("warm", i), ANSWER)
        spec.finish(("warm", i))
    return spec


def _cost(token_seconds: float) -> StepCostModel:
    m = StepCostModel(min_samples=3)
    rng = random.Random(1)
    for _ in range(50):
        b = rng.randint(1, 8)
        t = b + rng.randint(0, 4 * b)
        m.observe(b, t, 0.01 + 0.001 * b + token_seconds * t)
    return m


def _first_draft(spec: Speculator, rid: object = "r") -> list[int]:
    spec.start_request(rid, [1, 2, 3], stage="sql")
    return spec.draft(rid).token_ids


def test_without_step_timings_drafts_are_the_fixed_policys():
    fixed = _first_draft(_trained(False))
    assert fixed == ANSWER[: len(fixed)]
    assert len(fixed) >= 3
    spec = _trained(True)
    assert isinstance(spec.goodput, GoodputController)
    assert _first_draft(spec) == fixed
    assert spec.draft_batch(["r"])[0].token_ids == fixed


def test_free_verification_keeps_and_dear_verification_drops_the_draft():
    fixed = _first_draft(_trained(False))
    free = _trained(GoodputController(cost=_cost(0.0)))
    assert _first_draft(free) == fixed
    # Dear verification: a token that may be rejected is not worth its time ...
    dear = _trained(GoodputController(cost=_cost(5.0)))
    for i in range(6):  # another answer as often: the first token is a coin flip
        dear.start_request(("alt", i), [1, 2, 3], stage="sql")
        dear.extend(("alt", i), [60, 61, 62, 63])
        dear.finish(("alt", i))
    assert len(_first_draft(_trained(False))) > 0
    assert _first_draft(dear) == []
    # ... while a token certain to be accepted always is (it costs less than a step).
    assert _first_draft(_trained(GoodputController(cost=_cost(5.0)))) == fixed


def test_caps_and_max_spec_tokens_hold_with_the_controller():
    spec = _trained(GoodputController(cost=_cost(0.0)))
    spec.start_request("a", [1, 2, 3], stage="sql")
    spec.start_request("b", [1, 2, 3], stage="sql")
    a, b = spec.draft_batch(["a", "b"], caps=[3, 0])
    assert a.token_ids == ANSWER[:3]
    assert b.token_ids == []
    short = spec.draft("a", DraftParams(max_spec_tokens=4, min_token_prob=0.0))
    assert len(short.token_ids) <= 4


def test_extend_reports_the_accepted_prefix_per_group():
    ctl = GoodputController()
    spec = _trained(ctl)
    spec.start_request("r", [1, 2, 3], stage="sql")
    d = spec.draft("r")
    assert d.token_ids == ANSWER[:3]
    spec.extend("r", [*ANSWER[:2], 99])  # 2 accepted, then the model's own token
    (group,) = ctl.calibrator.groups()
    assert group == ((None, "sql"), d.source, min(d.match_len, 64).bit_length())
    seen = sum(b.verified for b in ctl.calibrator.table(group))
    accepted = sum(b.accepted for b in ctl.calibrator.table(group))
    assert (seen, accepted) == (3, 2)
    spec.extend("r", [7])  # no draft in between: nothing more is reported
    assert sum(b.verified for b in ctl.calibrator.table(group)) == 3


def test_a_miscalibrated_group_gets_shorter_drafts_once_the_cost_is_known():
    """Drafts of 'sql' are confident but always rejected after 1 token: the controller learns it."""
    ctl = GoodputController(cost=_cost(0.004))
    spec = _trained(ctl)
    for i in range(200):
        rid = ("probe", i)
        spec.start_request(rid, [1, 2, 3], stage="sql")
        spec.draft(rid)
        spec.extend(rid, [ANSWER[0], 77])
        spec.finish(rid, learn=False)
    assert 0 < len(_first_draft(spec)) < len(_first_draft(_trained(False)))
    assert ctl.kept < ctl.offered


def test_observe_step_and_bad_goodput_values():
    spec = Speculator(8)
    for _ in range(20):
        spec.observe_step(4, 20, 0.05)
    assert spec.goodput is not None
    assert spec.goodput.cost.samples == 20
    Speculator(8, goodput=False).observe_step(1, 1, 0.01)  # no controller: ignored
    with pytest.raises(TypeError, match="goodput"):
        Speculator(8, goodput="yes")  # type: ignore[arg-type]


def test_control_step_cuts_several_speculators_as_one_batch():
    """Tenants' speculators sharing one controller: their step is allocated as one
    batch (what `GoodputController.trim` gives for all the drafts together), and
    each speculator remembers its requests' cut drafts for `extend`."""
    # Per step 10 ms, per request 1 ms, per verified token 15 ms; first tokens at p = 2/3.
    # Alone, a request's draft pays (2/3 x 41 ms > 15 ms); in a step of three it
    # does not (2/3 x 73 ms < 3 x 15 ms): only a step-wide allocation cuts it.
    ctl = GoodputController(cost=_cost(0.015))
    specs = [_trained(ctl), _trained(ctl)]
    for i, spec in enumerate(specs):  # a second answer: doubtful first tokens
        for j in range(3):
            spec.start_request(("alt", j), [1, 2, 3], stage="sql")
            spec.extend(("alt", j), [60 + i, 61, 62])
            spec.finish(("alt", j))
    ids = [["a", "b"], ["c"]]
    raw: list[list] = []
    for spec, rids in zip(specs, ids, strict=True):
        for rid in rids:
            spec.start_request(rid, [1, 2, 3], stage="sql")
        rows = spec.draft_batch_source(rids, caps=[8] * len(rids), control=False)
        raw.append([d for d, _ in rows])
    # as the fixed policy drafts (alpha x match length), not cut
    assert all(d.token_ids == ANSWER[:3] for part in raw for d in part)
    from agentspec._core.speculator import _group

    groups = [
        _group(spec._request(rid), d)
        for spec, rids, part in zip(specs, ids, raw, strict=True)
        for rid, d in zip(rids, part, strict=True)
    ]
    whole = ctl.trim([d for part in raw for d in part], groups)
    cut = Speculator.control_step(list(zip(specs, ids, raw, strict=True)))
    assert [d.token_ids for part in cut for d in part] == [d.token_ids for d in whole]
    assert [d.token_ids for d in whole] == [[], [], []]
    assert ctl.trim(raw[1], groups[2:])[0].token_ids == ANSWER[:3]  # alone it would draft
    # beside two requests that offer no draft (in prefill), weighed at a batch of three
    beside = Speculator.control_step([(specs[1], ["c"], raw[1])], undrafted=2)
    assert [d.token_ids for d in beside[0]] == [[]]
    before = sum(b.verified for g in ctl.calibrator.groups() for b in ctl.calibrator.table(g))
    specs[1].extend("c", [ANSWER[0], 99])  # the cut draft is what gets reported
    after = sum(b.verified for g in ctl.calibrator.groups() for b in ctl.calibrator.table(g))
    assert after == before  # nothing was drafted for "c": nothing to report


def test_control_step_refuses_mixed_controllers_and_bad_shapes():
    a, b = _trained(GoodputController()), _trained(GoodputController())
    a.start_request("x", [1, 2, 3], stage="sql")
    b.start_request("y", [1, 2, 3], stage="sql")
    dx = a.draft_batch_source(["x"], control=False)[0][0]
    dy = b.draft_batch_source(["y"], control=False)[0][0]
    with pytest.raises(ValueError, match="sharing one GoodputController"):
        Speculator.control_step([(a, ["x"], [dx]), (b, ["y"], [dy])])
    with pytest.raises(ValueError, match="sharing one GoodputController"):
        Speculator.control_step([(_trained(False), ["x"], [dx])])
    with pytest.raises(ValueError, match="1 request ids but 2 drafts"):
        Speculator.control_step([(a, ["x"], [dx, dx])])
    with pytest.raises(ValueError, match="not active"):
        Speculator.control_step([(a, ["nope"], [dx])])
    with pytest.raises(ValueError, match="undrafted"):
        Speculator.control_step([(a, ["x"], [dx])], undrafted=-1)
    with pytest.raises(TypeError, match="undrafted"):
        Speculator.control_step([(a, ["x"], [dx])], undrafted=0.5)  # type: ignore[arg-type]
    assert Speculator.control_step([]) == []
    assert Speculator.control_step([(a, ["x"], [dx])]) == [[dx]]  # no step cost yet: as drafted
    assert dx.token_ids == ANSWER[:3]
    a.extend("x", [ANSWER[0], 99])  # the draft control_step returned is the one reported
    ctl = a.goodput
    assert ctl is not None
    tables = [ctl.calibrator.table(g) for g in ctl.calibrator.groups()]
    assert sum(b.verified for t in tables for b in t) == 2
    assert sum(b.accepted for t in tables for b in t) == 1


def test_controller_stats_report_the_fit_and_the_cut():
    ctl = GoodputController(cost=_cost(0.015))
    assert ctl.stats()["active"]
    before = ctl.stats()
    assert before["offered"] == before["kept"] == 0
    fit = before["step_cost"]
    assert fit["ready"]
    assert fit["samples"] == 50
    assert abs(fit["seconds"]["per_token"] - 0.015) < 1e-3
    assert abs(fit["seconds"]["per_step"] - 0.01) < 1e-3
    assert GoodputController(enabled=False).stats()["active"] is False
