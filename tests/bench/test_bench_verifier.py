"""Tests of the simulated greedy verifier (agentspec.bench.verifier)."""

from __future__ import annotations

import random

import pytest

from agentspec.bench.verifier import accept_linear, accept_tree, advance


def test_linear_accepts_longest_matching_prefix():
    """A linear draft is accepted up to its first token that differs from the truth."""
    resp = [1, 2, 3, 4, 5]
    assert accept_linear([3, 4, 9], resp, 2) == 2
    assert accept_linear([3, 4, 5], resp, 2) == 3
    assert accept_linear([7, 3, 4], resp, 2) == 0
    assert accept_linear([], resp, 0) == 0


def test_linear_never_accepts_past_the_end():
    """Draft tokens beyond the end of the response are not accepted."""
    assert accept_linear([4, 5, 6, 7], [1, 2, 3, 4, 5], 3) == 2
    assert accept_linear([1], [1], 1) == 0


def test_linear_rejects_bad_position():
    """A position outside the response is an error."""
    with pytest.raises(ValueError, match="outside"):
        accept_linear([1], [1, 2], 3)
    with pytest.raises(ValueError, match="outside"):
        accept_linear([1], [1, 2], -1)


def test_tree_takes_the_deepest_matching_path():
    """The accepted length is the depth of the deepest node whose whole path matches."""
    # root children: 7 (node 0), 1 (node 1); node 1 -> 2 (node 2) and 9 (node 3); 2 -> 3 (node 4)
    tokens = [7, 1, 9, 2, 3]
    parents = [-1, -1, 1, 1, 3]
    assert accept_tree(tokens, parents, [1, 2, 3, 4], 0) == 3
    assert accept_tree(tokens, parents, [1, 2, 8], 0) == 2
    assert accept_tree(tokens, parents, [5, 1, 2], 1) == 2
    assert accept_tree(tokens, parents, [8], 0) == 0


def test_tree_ignores_nodes_under_a_mismatch():
    """A node whose own token matches does not count when an ancestor did not."""
    tokens = [5, 2]
    parents = [-1, 0]
    assert accept_tree(tokens, parents, [1, 2], 0) == 0


def test_tree_is_capped_at_the_end_of_the_response():
    """Tree paths longer than what is left of the response count only up to its end."""
    assert accept_tree([1, 2, 3], [-1, 0, 1], [0, 1, 2], 1) == 2


def test_tree_rejects_malformed_drafts():
    """Parents must precede their children and the two lists must have the same length."""
    with pytest.raises(ValueError, match="parent"):
        accept_tree([1, 2], [-1, 1], [1, 2], 0)
    with pytest.raises(ValueError, match="parent"):
        accept_tree([1, 2], [-1, -2], [1, 2], 0)
    with pytest.raises(ValueError, match="parents"):
        accept_tree([1, 2], [-1], [1, 2], 0)
    with pytest.raises(ValueError, match="outside"):
        accept_tree([1], [-1], [1], 2)


def _brute_tree(tokens, parents, resp, pos):
    best = 0
    for i in range(len(tokens)):
        path = []
        j = i
        while j != -1:
            path.append(tokens[j])
            j = parents[j]
        path.reverse()
        if len(path) <= len(resp) - pos and path == resp[pos : pos + len(path)]:
            best = max(best, len(path))
    return best


def test_tree_matches_path_enumeration_on_random_trees():
    """On random trees the result equals the longest matching root-to-node path."""
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randint(0, 12)
        tokens = [rng.randint(0, 2) for _ in range(n)]
        parents = [rng.randint(-1, i - 1) for i in range(n)]
        resp = [rng.randint(0, 2) for _ in range(rng.randint(1, 8))]
        pos = rng.randint(0, len(resp))
        assert accept_tree(tokens, parents, resp, pos) == _brute_tree(tokens, parents, resp, pos)


def test_linear_draft_as_a_chain_tree_agrees():
    """A chain (parents i-1) verified as a tree gives the linear result."""
    rng = random.Random(3)
    for _ in range(300):
        draft = [rng.randint(0, 2) for _ in range(rng.randint(0, 6))]
        resp = [rng.randint(0, 2) for _ in range(rng.randint(1, 8))]
        pos = rng.randint(0, len(resp))
        chain = list(range(-1, len(draft) - 1))
        assert accept_tree(draft, chain, resp, pos) == accept_linear(draft, resp, pos)


def test_advance_adds_a_bonus_token_unless_the_response_is_done():
    """A step adds accepted + 1 tokens, or just the accepted ones at the end."""
    assert advance(0, 5) == 1
    assert advance(3, 5) == 4
    assert advance(5, 5) == 5
    with pytest.raises(ValueError, match="outside"):
        advance(6, 5)
    with pytest.raises(ValueError, match="outside"):
        advance(-1, 5)
