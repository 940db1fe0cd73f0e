"""`agentspec._goodput`: the online step-cost fit and the batch draft-length allocation."""

from __future__ import annotations

import itertools
import random

import pytest

from agentspec._goodput import StepCostModel, allocate


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
