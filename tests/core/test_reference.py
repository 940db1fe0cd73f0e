"""Hand-worked examples that pin the pure-Python reference model itself.

Every expected value below was worked out on paper from the "Semantics" section
of docs/design-native.md, so the reference (and through it the engine) cannot
silently drift from the contract.
"""

from __future__ import annotations

import pytest
from reference import EMPTY, RefParams, RefTree, budget, build_children, reference_draft


def _tree(depth: int, *seqs: list[int]) -> RefTree:
    tree = RefTree(depth)
    for i, seq in enumerate(seqs):
        tree.add(i, seq)
    return tree


def test_counts_are_substring_occurrences_up_to_depth() -> None:
    """count() is the number of occurrences, and strings longer than D count 0."""
    tree = _tree(3, [1, 2, 1, 2, 3])
    assert tree.count([1, 2]) == 2
    assert tree.count([2]) == 2
    assert tree.count([1, 2, 1]) == 1
    assert tree.count([1, 2, 3]) == 1
    assert tree.count([1, 2, 1, 2]) == 0
    assert tree.count([3, 1]) == 0
    assert tree.count([]) == 0


def test_total_can_be_smaller_than_count() -> None:
    """An occurrence at the end of a sequence has no continuation."""
    tree = _tree(3, [1, 2, 1, 2, 3])
    children = build_children(tree.counts())
    assert tree.count([2, 3]) == 1
    assert sum(children.get((2, 3), {}).values()) == 0
    assert children[(1, 2)] == {1: 1, 3: 1}


def test_removal_removes_exactly_that_sequence() -> None:
    """Removing a sequence restores the counts of the others."""
    tree = _tree(4, [1, 2, 3], [2, 3, 4])
    assert tree.count([2, 3]) == 2
    tree.remove(0)
    assert tree.count([2, 3]) == 1
    assert tree.count([1]) == 0


def test_budget_formula() -> None:
    """B(p) = min(max_spec_tokens, floor(alpha*p + offset + 1e-6))."""
    assert budget(1, RefParams(alpha=0.5)) == 0
    assert budget(2, RefParams(alpha=0.5)) == 1
    assert budget(3, RefParams(alpha=1.0, offset=1.0)) == 4
    assert budget(10, RefParams(max_spec_tokens=4, alpha=2.0)) == 4


def test_linear_draft_equal_score_prefers_longer_match() -> None:
    """p=1 and p=2 both score 2/3; the longer pattern wins."""
    tree = _tree(8, [1, 2, 3], [1, 2, 3], [1, 2, 4])
    got = reference_draft([1, 2], RefParams(max_spec_tokens=8), tree)
    assert got.token_ids == [3]
    assert got.parents == [-1]
    assert got.probs == [2 / 3]
    assert got.score == 2 / 3
    assert got.match_len == 2
    assert got.source == "global"


def test_tree_draft_takes_siblings() -> None:
    """A tree draft with budget 2 takes both children of the match point."""
    tree = _tree(8, [1, 2, 3], [1, 2, 3], [1, 2, 4])
    got = reference_draft([1, 2], RefParams(max_spec_tokens=8, tree=True), tree)
    assert got.token_ids == [3, 4]
    assert got.parents == [-1, -1]
    assert got.probs == [2 / 3, 1 / 3]
    assert got.score == 1.0
    assert got.match_len == 2


def test_best_child_tie_goes_to_smallest_token() -> None:
    """Equal counts: the smaller token id is the best child."""
    tree = _tree(8, [5, 7], [5, 6])
    got = reference_draft([5], RefParams(), tree)
    assert got.token_ids == [6]
    assert got.probs == [0.5]


def test_tree_draft_equal_probability_pops_in_push_order() -> None:
    """Frontier entries of equal D come out in the order they were pushed."""
    tree = _tree(8, [0, 1, 2], [0, 2, 1])
    got = reference_draft([0], RefParams(max_spec_tokens=8, alpha=4.0, tree=True), tree)
    assert got.token_ids == [1, 2, 2, 1]
    assert got.parents == [-1, -1, 0, 1]
    assert got.probs == [0.5, 0.5, 0.5, 0.5]
    assert got.score == 2.0


def test_depth_limits_the_draft_path() -> None:
    """len(pattern) + len(path) <= D, so the shorter pattern drafts further."""
    tree = _tree(3, [1, 2, 3, 4])
    got = reference_draft([1, 2], RefParams(alpha=4.0), tree)
    assert got.token_ids == [3, 4]
    assert got.match_len == 1
    assert got.score == 2.0


def test_min_token_prob_stops_the_draft() -> None:
    """A first token with D below min_token_prob gives an empty draft."""
    tree = _tree(8, [1, 2], [1, 3], [1, 3])
    assert reference_draft([1], RefParams(min_token_prob=0.7), tree) == EMPTY
    got = reference_draft([1], RefParams(min_token_prob=0.6), tree)
    assert got.token_ids == [3]


def test_local_tree_wins_higher_score_and_ties() -> None:
    """The local draft wins when its score is higher or equal."""
    ctx = [1, 2, 9, 1, 2]
    local = _tree(8, ctx)
    got = reference_draft(ctx, RefParams(), _tree(8, [1, 2, 3]), local)
    assert (got.token_ids, got.score, got.match_len, got.source) == ([9, 1], 2.0, 2, "local")
    tie = reference_draft(ctx, RefParams(), _tree(8, [1, 2, 9, 1]), local)
    assert (tie.token_ids, tie.score, tie.source) == ([9, 1], 2.0, "local")
    no_local = reference_draft(ctx, RefParams(use_local=False), _tree(8, [1, 2, 3]), local)
    assert (no_local.token_ids, no_local.source) == ([3], "global")


def test_context_alone_is_not_a_candidate() -> None:
    """The context's own occurrence in the local tree has no continuation."""
    ctx = [4, 5, 6]
    assert reference_draft(ctx, RefParams(), None, _tree(8, ctx)) == EMPTY


def test_merge_adds_counts_of_both_trees() -> None:
    """Merged mode behaves like one tree holding both trees' sequences."""
    ctx = [1, 2, 4, 1, 2]
    got = reference_draft(ctx, RefParams(merge=True), _tree(8, [1, 2, 3]), _tree(8, ctx))
    assert got.token_ids == [3]
    assert got.probs == [0.5]
    assert got.match_len == 2
    assert got.source == "merged"


def test_min_score_empties_weak_drafts() -> None:
    """A final draft scoring below min_score is returned empty."""
    ctx = [1, 2, 9, 1, 2]
    assert reference_draft(ctx, RefParams(min_score=2.5), None, _tree(8, ctx)) == EMPTY
    assert reference_draft(ctx, RefParams(min_score=2.0), None, _tree(8, ctx)).score == 2.0


@pytest.mark.parametrize(
    ("min_pattern", "max_pattern", "match_len"), [(0, 0, 2), (0, 1, 1), (2, 0, 2)]
)
def test_pattern_bounds(min_pattern: int, max_pattern: int, match_len: int) -> None:
    """min_pattern/max_pattern restrict the candidate lengths."""
    tree = _tree(8, [1, 2, 3], [1, 2, 3], [1, 2, 4])
    params = RefParams(min_pattern=min_pattern, max_pattern=max_pattern)
    assert reference_draft([1, 2], params, tree).match_len == match_len
