"""`agentspec._core.goodput`: the online step-cost fit and the batch draft-length allocation."""

from __future__ import annotations

import itertools
import random

import pytest

from agentspec._core.goodput import StepCostModel, allocate
from agentspec.exceptions import InvalidArgumentError


def _fitted(c0: float, c1: float, c2: float, *, noise: float = 0.0, n: int = 400) -> StepCostModel:
    rng = random.Random(3)
    m = StepCostModel()
    for _ in range(n):
        b = rng.randint(1, 64)
        t = b + rng.randint(0, 8 * b)
        m.observe(b, t, max(0.0, (c0 + c1 * b + c2 * t) * (1 + rng.gauss(0, noise))))
    return m


def test_the_fit_converges_on_noisy_synthetic_timings():
    m = _fitted(0.010, 0.0004, 0.0002, noise=0.05)
    c0, c1, c2 = m.coefficients
    assert c0 == pytest.approx(0.010, rel=0.25)
    assert c1 == pytest.approx(0.0004, rel=0.3)
    assert c2 == pytest.approx(0.0002, rel=0.15)
    assert m.predict(8, 40) == pytest.approx(0.010 + 8 * 0.0004 + 40 * 0.0002, rel=0.1)


def test_the_fit_follows_a_change_in_cost():
    m = _fitted(0.010, 0.0, 0.0002)
    rng = random.Random(5)
    for _ in range(2000):
        b = rng.randint(1, 32)
        t = b + rng.randint(0, 4 * b)
        m.observe(b, t, 0.010 + 0.002 * t)  # tokens got 10x dearer
    assert m.token_cost() == pytest.approx(0.002, rel=0.05)


def test_bad_observations_are_ignored_and_not_ready_at_first():
    m = StepCostModel(min_samples=3)
    for bad in ((1, 1, float("nan")), (1, 1, -1.0), (0, 3, 0.1), (4, 2, 0.1)):
        m.observe(*bad)
    assert m.samples == 0
    assert not m.ready
    with pytest.raises(ValueError, match="decay"):
        StepCostModel(decay=0)


def _goodput(probs, lengths, m):
    b = len(probs)
    expected = b + sum(sum(p[:n]) for p, n in zip(probs, lengths, strict=True))
    return expected / m.predict(b, b + sum(lengths))


def test_free_verification_drafts_what_the_fixed_policy_drafts():
    m = _fitted(0.01, 0.001, 0.0)
    probs = [[0.9, 0.5, 0.1], [0.3], [], [0.99] * 8]
    assert allocate(probs, m) == [3, 1, 0, 8]
    assert allocate(probs, m, caps=[2, 5, 1, 4]) == [2, 1, 0, 4]


def test_a_very_expensive_token_drafts_nothing():
    m = _fitted(0.001, 0.0, 10.0)
    assert allocate([[0.99, 0.98], [0.97]], m) == [0, 0]


def test_requests_without_a_draft_weigh_tokens_at_the_batch_they_make():
    # a step's fixed cost is dear next to a token: one request alone drafts freely
    m = _fitted(0.05, 0.0, 0.002)
    probs = [[0.9, 0.6, 0.3]]
    assert allocate(probs, m) == [3]
    # 15 more requests in the step computing their prompts: they decode in the
    # steps an accepted token saves, so a token is worth less of a step there
    assert allocate(probs, m, undrafted=15) == [2]
    assert allocate(probs, m, undrafted=15) == allocate(probs + [[]] * 15, m)[:1]
    with pytest.raises(InvalidArgumentError, match="undrafted"):
        allocate(probs, m, undrafted=-1)
    for bad in (1.5, True, None):
        with pytest.raises(TypeError, match="undrafted"):
            allocate(probs, m, undrafted=bad)  # type: ignore[arg-type]


def test_an_unready_model_keeps_every_offered_token_up_to_the_caps():
    m = StepCostModel()
    assert allocate([[0.1, 0.05], [0.2]], m, caps=[1, 3]) == [1, 1]


def test_greedy_is_optimal_against_brute_force_and_respects_caps():
    rng = random.Random(11)
    for trial in range(200):
        m = _fitted(rng.uniform(0.001, 0.05), rng.uniform(0, 0.002), rng.uniform(0.0001, 0.01))
        probs = []
        for _ in range(rng.randint(1, 3)):
            p, seq = 1.0, []
            for _ in range(rng.randint(0, 4)):
                p *= rng.uniform(0.3, 1.0)
                seq.append(p)
            probs.append(seq)
        caps = [rng.randint(0, 4) for _ in probs]
        got = allocate(probs, m, caps)
        assert all(0 <= g <= min(len(p), c) for g, p, c in zip(got, probs, caps, strict=True))
        best = max(
            _goodput(probs, list(ls), m)
            for ls in itertools.product(
                *(range(min(len(p), c) + 1) for p, c in zip(probs, caps, strict=True))
            )
        )
        assert _goodput(probs, got, m) == pytest.approx(best, rel=1e-9), trial


# --- acceptance reports: chains and trees -------------------------------------


def _verified(ctl, group):
    """(verified, accepted) per bucket lower edge, non-empty buckets only."""
    return {
        round(b.low, 1): (b.verified, b.accepted) for b in ctl.calibrator.table(group) if b.verified
    }


def test_a_tree_draft_reports_every_verified_child_along_the_accepted_path():
    from agentspec import Draft, GoodputController

    # context -> 3 (p .5) or 4 (p .25); 3 -> 7 (path .375, cond .75) or 9 (path .0625,
    # cond .125): binary fractions, so every bucket is exact
    tree = Draft([3, 4, 7, 9], [-1, -1, 0, 0], [0.5, 0.25, 0.375, 0.0625], 1.1875, 2, "global")
    ctl = GoodputController()
    # emitted 3 then 9: 3 accepted (4 rejected), then 9 accepted (7 rejected); 9 has no children
    assert ctl.observe_verified("g", tree, [3, 9, 5]) == 2
    assert _verified(ctl, "g") == {0.5: (1, 1), 0.2: (1, 0), 0.7: (1, 0), 0.1: (1, 1)}
    ctl = GoodputController()
    # emitted 5: both first-level children rejected, nothing below them verified
    assert ctl.observe_verified("g", tree, [5]) == 0
    assert _verified(ctl, "g") == {0.5: (1, 0), 0.2: (1, 0)}
    ctl = GoodputController()
    # emitted 3 and nothing after: 3's children were not verified yet
    assert ctl.observe_verified("g", tree, [3]) == 1
    assert _verified(ctl, "g") == {0.5: (1, 1), 0.2: (1, 0)}


def test_a_chain_report_equals_observe_accepted_and_stops_where_tokens_end():
    from agentspec import Draft, GoodputController

    # conditional probabilities .875, .5, .25, .5
    chain = Draft(
        [5, 6, 7, 8], [-1, 0, 1, 2], [0.875, 0.4375, 0.109375, 0.0546875], 1.5, 4, "local"
    )
    a, b = GoodputController(), GoodputController()
    assert a.observe_verified("g", chain, [5, 6, 1]) == 2
    b.observe_accepted("g", chain, 2)
    assert _verified(a, "g") == _verified(b, "g") == {0.8: (1, 1), 0.5: (1, 1), 0.2: (1, 0)}
    c = GoodputController()
    assert c.observe_verified("g", chain, [5, 6]) == 2  # the third token was never compared
    assert _verified(c, "g") == {0.8: (1, 1), 0.5: (1, 1)}
    assert c.observe_verified("g", Draft([], [], [], 0.0, 0, "none"), [1]) == 0


def test_speculator_tree_drafts_feed_the_calibrator():
    from agentspec import DraftParams, GoodputController, Speculator

    ctl = GoodputController()
    spec = Speculator(
        16,
        params=DraftParams(max_spec_tokens=8, tree=True, min_token_prob=0.0, alpha=4.0),
        goodput=ctl,
    )
    for i, answer in enumerate([[5, 6, 7], [5, 6, 7], [5, 9, 9]]):
        spec.start_request(i, [1, 2], stage="s")
        spec.extend(i, answer)
        spec.finish(i)
    spec.start_request("r", [1, 2], stage="s")
    d = spec.draft("r")
    assert any(j != i - 1 for i, j in enumerate(d.parents))  # a real tree
    spec.extend("r", [5, 9, 1])
    (group,) = ctl.calibrator.groups()
    rows = ctl.calibrator.table(group)
    assert sum(b.verified for b in rows) >= 3  # 5, then both of its children
    assert sum(b.accepted for b in rows) == 2  # 5 and 9


def test_residuals_compare_each_size_class_with_what_the_fit_predicted():
    def cost(b, t):
        return 0.03 + 0.0005 * b + 0.001 * t

    m = StepCostModel(min_samples=16)
    rng = random.Random(7)
    for _ in range(400):
        b = rng.randint(1, 20)
        t = b + rng.randint(0, 2 * b)
        m.observe(b, t, cost(b, t))
    res = m.residuals()
    assert sum(r["steps"] for r in res.values()) == 400 - 16  # counted once the fit is ready
    assert set(res) == {"2-3", "4-7", "8-15", "16-31", "32-63"} | ({"1"} & set(res))
    for r in res.values():  # a linear cost is predicted well at every size
        assert r["seconds"] == pytest.approx(r["predicted"], rel=0.05)
    m.observe(40, 100, 2 * cost(40, 100))  # a large step, twice as slow as the line says
    assert m.residuals()["64-127"] == {
        "steps": 1,
        "seconds": pytest.approx(2 * cost(40, 100)),
        "predicted": pytest.approx(cost(40, 100), rel=0.01),
    }
    assert StepCostModel().residuals() == {}


def test_stats_compare_expected_and_accepted_draft_tokens_per_batch_class():
    from agentspec import Draft, GoodputController

    chain = Draft([5, 6, 7], [-1, 0, 1], [0.5, 0.25, 0.125], 0.875, 3, "local")
    ctl = GoodputController()
    expected = []  # what each report expects, corrected with what was learned before it

    def report(tokens):
        expected.append(sum(ctl.corrected_path_probs(chain, "g")))
        return ctl.observe_verified("g", chain, tokens)

    ctl.trim([chain, chain, chain], ["g"] * 3)  # a step of three requests
    assert report([5, 6, 1]) == 2
    assert report([9]) == 0
    ctl.trim([chain], ["g"])  # then a step of one
    assert report([5, 6, 7, 2]) == 3
    assert expected[0] == pytest.approx(0.875)  # nothing learned yet: the tree's own
    assert expected[1] != pytest.approx(expected[0])
    by_batch = ctl.stats()["acceptance_by_batch"]
    assert by_batch == {
        "1": {"drafts": 1, "tokens": 3, "expected": pytest.approx(expected[2]), "accepted": 3},
        "2-3": {
            "drafts": 2,
            "tokens": 6,
            "expected": pytest.approx(expected[0] + expected[1]),
            "accepted": 2,
        },
    }


def test_a_kept_draft_is_tallied_with_what_trim_expected_of_it():
    """`trim` computes each kept draft's expectation anyway; the report uses that
    one, not one corrected with what the calibrator learned in between."""
    from agentspec import Draft, GoodputController

    ctl = GoodputController(cost=_fitted(0.05, 0.0, 1e-6))
    chain = Draft([5, 6, 7], [-1, 0, 1], [0.9, 0.81, 0.729], 2.439, 3, "local")
    (kept,) = ctl.trim([chain], ["g"])
    assert kept.token_ids == [5, 6, 7]
    predicted = sum(ctl.corrected_path_probs(kept, "g"))
    ctl.calibrator.observe("g", [0.9, 0.9, 0.9], 0)  # another draft's report comes first
    assert sum(ctl.corrected_path_probs(kept, "g")) != pytest.approx(predicted)
    assert ctl.observe_verified("g", kept, [5, 6, 7, 1]) == 3
    assert ctl.stats()["acceptance_by_batch"]["1"]["expected"] == pytest.approx(predicted)
    # a draft `trim` never saw is corrected when reported
    other = Draft([8], [-1], [0.5], 0.5, 1, "local")
    now = sum(ctl.corrected_path_probs(other, "g"))
    ctl.observe_verified("g", other, [8, 2])
    assert ctl.stats()["acceptance_by_batch"]["1"]["expected"] == pytest.approx(predicted + now)
