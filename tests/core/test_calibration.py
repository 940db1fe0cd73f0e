"""`agentspec._core.calibration`: conditional probabilities and the online acceptance correction."""

from __future__ import annotations

import random

import pytest

from agentspec._core.calibration import (
    AcceptanceCalibrator,
    conditional_probs,
    depth_class,
    draft_depths,
)


def test_conditional_probs_divide_by_the_parent_path():
    # chain: 0.8, 0.8*0.5, 0.8*0.5*1.0
    assert conditional_probs([0.8, 0.4, 0.4], [-1, 0, 1]) == pytest.approx([0.8, 0.5, 1.0])
    # tree: two children of the context, one grandchild under the second
    assert conditional_probs([0.6, 0.4, 0.1], [-1, -1, 1]) == pytest.approx([0.6, 0.4, 0.25])
    assert conditional_probs([0.0, 0.0], [-1, 0]) == [0.0, 0.0]  # no division by zero


def test_an_unseen_bucket_keeps_the_estimate_and_a_new_group_starts_from_the_others():
    cal = AcceptanceCalibrator()
    assert cal.correct("g", 0.73) == 0.73
    for _ in range(200):
        cal.observe("g", [0.95], 0)  # first tokens at 0.95, all rejected
    assert cal.correct("g", 0.33) == pytest.approx(0.33)  # another bucket
    assert cal.correct("g", 0.95) < 0.05
    # a group never seen shrinks towards what every group saw at that depth and bucket
    assert cal.correct("other", 0.95) < 0.05
    assert cal.correct("other", 0.95, depth=1) == pytest.approx(0.95)  # another depth


def test_depth_classes():
    assert [depth_class(d) for d in range(10)] == [0, 1, 2, 2, 3, 3, 3, 3, 4, 4]
    assert depth_class(500) == 4
    assert draft_depths([-1, 0, 1, -1, 3]) == [0, 1, 2, 0, 1]


def test_deep_tokens_are_corrected_apart_from_first_ones():
    """First and second tokens at 0.95 are accepted 90% of the time, third and fourth 50%."""
    rng = random.Random(3)
    cal = AcceptanceCalibrator()
    for _ in range(4000):
        kept = 0
        for rate in (0.9, 0.9, 0.5, 0.5):
            if rng.random() >= rate:
                break
            kept += 1
        cal.observe("g", [0.95] * 4, kept)
    assert cal.correct("g", 0.95) == pytest.approx(0.9, abs=0.03)
    assert cal.correct("g", 0.95, depth=3) == pytest.approx(0.5, abs=0.05)
    assert cal.correct_all("g", [0.95] * 4) == pytest.approx(
        [cal.correct("g", 0.95, d) for d in range(4)]
    )
    # a tree: the depths are given
    assert cal.correct_all("g", [0.95, 0.95], [0, 3]) == pytest.approx(
        [cal.correct("g", 0.95), cal.correct("g", 0.95, 3)]
    )
    with pytest.raises(ValueError, match="one entry per token"):
        cal.correct_all("g", [0.95, 0.95], [0])


def test_only_verified_tokens_are_observations():
    cal = AcceptanceCalibrator(buckets=10)
    cal.observe("g", [0.95, 0.95, 0.15, 0.15], 1)  # token 0 kept, token 1 rejected
    rows = {round(b.low, 1): b for b in cal.table("g")}
    assert (rows[0.9].verified, rows[0.9].accepted) == (2, 1)
    assert rows[0.1].verified == 0  # after the rejection nothing was verified


def test_the_correction_converges_on_noisy_synthetic_outcomes():
    """Estimates of 0.9 that are accepted 60% of the time are corrected to about 0.6."""
    rng = random.Random(7)
    cal = AcceptanceCalibrator(prior=8.0)
    for _ in range(3000):
        p = 0.9 + 0.09 * rng.random()
        kept = 0
        for _ in range(4):  # a chain of 4 such tokens
            if rng.random() < 0.6:
                kept += 1
            else:
                break
        cal.observe(("sql", "stage"), [p] * 4, kept)
    assert cal.correct(("sql", "stage"), 0.95) == pytest.approx(0.6, abs=0.03)
    # A group that is right keeps its estimates.
    for _ in range(3000):
        cal.observe("ok", [0.35], 1 if rng.random() < 0.35 else 0)
    assert cal.correct("ok", 0.35) == pytest.approx(0.35, abs=0.03)


def test_counts_are_halved_at_the_horizon_so_drift_is_followed():
    cal = AcceptanceCalibrator(prior=4.0, horizon=200.0)
    for _ in range(1000):
        cal.observe("g", [0.85], 1)
    assert cal.correct("g", 0.85) > 0.95
    for _ in range(1000):
        cal.observe("g", [0.85], 0)
    assert cal.correct("g", 0.85) < 0.05
    assert max(b.verified for b in cal.table("g")) <= 200


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="buckets"):
        AcceptanceCalibrator(buckets=0)
    with pytest.raises(ValueError, match="prior"):
        AcceptanceCalibrator(prior=0)


def test_correct_all_equals_correct_everywhere_and_honours_a_subclass_rule():
    rng = random.Random(11)
    cal = AcceptanceCalibrator(prior=4.0, horizon=64.0)
    for _ in range(3000):
        group = rng.choice("abc")
        depths = [rng.randrange(12) for _ in range(4)]
        outcomes = [(rng.random(), rng.random() < 0.6) for _ in range(4)]
        cal.observe_outcomes(group, outcomes, depths)
    for group in "abcz":  # "z" was never observed: the pooled level alone
        probs = [rng.random() for _ in range(50)] + [0.0, 1.0]
        depths = [rng.randrange(-1, 20) for _ in probs]
        assert cal.correct_all(group, probs, depths) == [
            cal.correct(group, p, d) for p, d in zip(probs, depths, strict=True)
        ]
        assert cal.correct_all(group, probs) == [
            cal.correct(group, p, i) for i, p in enumerate(probs)
        ]

    class Halved(AcceptanceCalibrator):
        def correct(self, group, p, depth=0):
            return 0.5 * p

    assert Halved().correct_all("g", [0.8, 0.4], [0, 3]) == [0.4, 0.2]


def test_depth_errors_are_estimate_minus_observed_per_depth_class() -> None:
    cal = AcceptanceCalibrator()
    assert cal.depth_errors() == {}
    for _ in range(10):  # depth 0 estimated 0.9, always accepted; depth 1 at 0.5, never
        cal.observe_outcomes("g", [(0.9, True), (0.5, False)])
    errors = cal.depth_errors()
    assert set(errors) == {"0", "1"}
    assert errors["0"] == pytest.approx(0.9 - 1.0)
    assert errors["1"] == pytest.approx(0.5 - 0.0)
    cal.observe_outcomes("h", [(0.4, True)] * 9, depths=[0, 1, 2, 3, 4, 7, 8, 20, 64])
    assert set(cal.depth_errors()) == {"0", "1", "2-3", "4-7", "8+"}
