"""Tests of the vLLM n-gram proposer reimplementation (agentspec.bench.ngram).

The reference below is an independent, direct transcription of vLLM's
documented algorithm: KMP over the reversed context, longest n-gram in
[min_n, max_n], earliest occurrence, copy up to k following tokens.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from agentspec.bench.ngram import NgramProposer


def _kmp_reference(ctx: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    total = len(ctx)
    if total < min_n:
        return []
    rev = ctx[::-1]
    lps = [0] * max_n  # borders of the pattern rev[:max_n]
    longest = 0
    position = 0
    cur = 0  # length of the longest pattern prefix ending at rev[i]
    i = 1
    while i < total:
        if rev[cur] == rev[i]:
            cur += 1
            if cur >= longest:
                longest = cur
                position = i
            if i < max_n:
                lps[i] = cur
            if cur == max_n:
                cur = lps[max_n - 1]
            i += 1
        elif cur != 0:
            cur = lps[cur - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return ctx[start : start + min(k, total - start)]


def test_prefers_the_longest_ngram_and_its_earliest_occurrence():
    """The suffix [1, 2] occurs twice earlier; the earliest one's continuation is drafted."""
    p = NgramProposer(1, 3, 4)
    p.reset([1, 2, 7, 1, 2, 8, 0, 2, 1, 2])
    # suffix of length 3 [2, 1, 2] does not occur earlier; [1, 2] does, first at 0
    assert p.propose() == [7, 1, 2, 8]


def test_no_draft_without_a_match_in_range():
    """Below min_n there is no draft, even if a shorter suffix repeats."""
    p = NgramProposer(3, 5, 4)
    p.reset([1, 2, 9, 1, 2])
    assert p.propose() == []
    p.extend([9])
    assert p.propose() == [1, 2, 9]


def test_overlapping_occurrence_and_end_of_context():
    """An occurrence may overlap the suffix; the draft stops at the end of the context."""
    p = NgramProposer(2, 2, 10)
    p.reset([5, 5, 5, 5])
    assert p.propose() == [5, 5]


def test_short_contexts():
    """Contexts shorter than n + 1 give no draft."""
    p = NgramProposer(1, 1, 3)
    p.reset([])
    assert p.propose() == []
    p.extend([4])
    assert p.propose() == []
    p.extend([4])
    assert p.propose() == [4]


@pytest.mark.parametrize(("min_n", "max_n", "k"), [(5, 5, 32), (3, 5, 32), (1, 3, 4), (2, 6, 1)])
def test_matches_the_kmp_reference_on_random_contexts(min_n, max_n, k):
    """At every prefix of random low-entropy contexts the draft equals the KMP reference."""
    rng = random.Random(min_n * 100 + max_n * 10 + k)
    for _ in range(40):
        alphabet = rng.randint(1, 4)
        ctx = [rng.randrange(alphabet) for _ in range(rng.randint(0, 80))]
        split = rng.randint(0, len(ctx))
        p = NgramProposer(min_n, max_n, k)
        p.reset(ctx[:split])
        assert p.propose() == _kmp_reference(ctx[:split], min_n, max_n, k)
        t = split
        while t < len(ctx):
            step = rng.choice([1, 1, 2, 3, 70])  # > 64 tokens take the bulk path
            p.extend(ctx[t : t + step])
            t = min(t + step, len(ctx))
            assert p.propose() == _kmp_reference(ctx[:t], min_n, max_n, k)


def test_bulk_and_incremental_indexing_agree():
    """Indexing a long prompt at once equals appending it token by token."""
    rng = random.Random(11)
    ctx = [rng.randrange(3) for _ in range(400)]
    a = NgramProposer(3, 5, 8)
    a.reset(ctx)
    b = NgramProposer(3, 5, 8)
    b.reset([])
    for t in ctx:
        b.extend([t])
    assert a.propose() == b.propose() == _kmp_reference(ctx, 3, 5, 8)


def test_rejects_bad_arguments():
    """Bad n-gram bounds or k raise clear errors."""
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(0, 3, 4)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(4, 3, 4)
    with pytest.raises(ValueError, match="k must"):
        NgramProposer(1, 3, 0)
    with pytest.raises(TypeError, match="int"):
        NgramProposer(1.5, 3, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", [np.int32, np.int64, np.uint16], ids=repr)
def test_integer_arguments_accept_numpy_integers(kind):
    """min_n, max_n and k accept numpy integers, kept as plain ints."""
    p = NgramProposer(kind(1), kind(3), kind(4))
    assert (p.min_n, p.max_n, p.k) == (1, 3, 4)
    assert all(type(v) is int for v in (p.min_n, p.max_n, p.k))


@pytest.mark.parametrize("value", [True, np.True_, 2.0], ids=repr)
def test_integer_arguments_refuse_bool_and_non_integers(value):
    name = "bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__
    with pytest.raises(TypeError, match=f"^min_n must be an int, not {name}$"):
        NgramProposer(value, 3, 4)
    with pytest.raises(TypeError, match=f"^max_n must be an int, not {name}$"):
        NgramProposer(1, value, 4)
    with pytest.raises(TypeError, match=f"^k must be an int, not {name}$"):
        NgramProposer(1, 3, value)
