"""SuffixTree: sequences, counts, drafts, snapshots and deltas on hand-checked examples.

The running example is the sequence S = [1, 2, 3, 9, 1, 2, 3, 7] in a tree of
depth 8.  Its substring counts are easy to list by hand: [1, 2] and [1, 2, 3]
occur twice, [3, 9] and [3, 7] once, and [1, 2, 3] continues once with 9 and
once with 7, so a draft after "... 1, 2" is 3 (probability 2/2 = 1.0) followed
by a 50/50 branch between 7 and 9.
"""

from __future__ import annotations

import array
import re
from collections.abc import Callable

import numpy as np
import pytest

from agentspec import DraftParams, SuffixTree, TreeStats
from agentspec.exceptions import (
    DepthMismatchError,
    InvalidArgumentError,
    InvalidTokenError,
    SequenceClosedError,
    SequenceExistsError,
    SequenceNotFoundError,
    TreeClosedError,
)

S = [1, 2, 3, 9, 1, 2, 3, 7]
DEPTH = 8


@pytest.fixture
def tree() -> SuffixTree:
    """A depth-8 tree holding S as sequence 1."""
    t = SuffixTree(DEPTH)
    t.add(1, S)
    return t


# --- sequences and counts ---------------------------------------------------------


def test_default_depth_is_64() -> None:
    """SuffixTree() uses the documented default depth."""
    assert SuffixTree().max_depth == 64


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ([1], 2),
        ([3], 2),
        ([1, 2], 2),
        ([1, 2, 3], 2),
        ([3, 9], 1),
        ([3, 7], 1),
        ([7, 1], 0),
        ([2, 3, 9, 1, 2, 3, 7], 1),
        (S, 1),  # length 8 == max_depth is still indexed
        ([4], 0),
    ],
)
def test_counts_are_substring_occurrences(
    tree: SuffixTree, pattern: list[int], expected: int
) -> None:
    """count() is the number of occurrences of the string in the sequences."""
    assert tree.count(pattern) == expected


def test_count_beyond_depth_is_zero(tree: SuffixTree) -> None:
    """A string longer than max_depth is not indexed, even if it occurs."""
    tree.add(2, [*S, 5])
    assert tree.count([*S, 5]) == 0
    assert tree.count(S) == 2


def test_count_accepts_every_token_array_type(tree: SuffixTree) -> None:
    """Lists, tuples, int32 numpy arrays and array('i') give the same count."""
    forms = [[1, 2, 3], (1, 2, 3), np.array([1, 2, 3], dtype=np.int32), array.array("i", [1, 2, 3])]
    assert [tree.count(f) for f in forms] == [2, 2, 2, 2]


def test_counts_add_up_over_sequences(tree: SuffixTree) -> None:
    """A second sequence adds its own occurrences."""
    tree.add(2, [3, 9, 3, 9])
    assert tree.count([3, 9]) == 3
    assert tree.count([9, 3]) == 1
    assert len(tree) == 2


def test_sequence_ids_are_in_insertion_order() -> None:
    """sequence_ids() lists ids oldest first; membership and len follow."""
    t = SuffixTree(4)
    t.add(5, [1])
    t.append(-(2**63), [2])
    t.add(2**63 - 1, [])
    assert t.sequence_ids() == [5, -(2**63), 2**63 - 1]
    assert len(t) == 3
    assert 5 in t
    assert 6 not in t
    assert "5" not in t
    assert 2**64 not in t


def test_sequence_returns_its_tokens(tree: SuffixTree) -> None:
    """sequence() gives back exactly the tokens stored, including the largest id."""
    tree.add(7, [0, 2**31 - 1])
    assert tree.sequence(1) == S
    assert tree.sequence(7) == [0, 2**31 - 1]


def test_open_sequence_grows_then_closes() -> None:
    """append() creates an open sequence, extends it, and close_sequence() ends it."""
    t = SuffixTree(DEPTH)
    t.append(3, [4, 5])
    t.append(3, np.array([6], dtype=np.int32))
    assert t.sequence(3) == [4, 5, 6]
    assert t.count([4, 5, 6]) == 1
    assert t.stats().open_sequences == 1
    t.close_sequence(3)
    t.close_sequence(3)  # closing twice is fine
    assert t.stats().open_sequences == 0
    with pytest.raises(SequenceClosedError):
        t.append(3, [7])
    assert t.sequence(3) == [4, 5, 6]


def test_added_sequence_is_closed(tree: SuffixTree) -> None:
    """A sequence inserted with add() refuses appends."""
    with pytest.raises(SequenceClosedError):
        tree.append(1, [5])
    assert tree.count([7, 5]) == 0


def test_duplicate_add_changes_nothing(tree: SuffixTree) -> None:
    """add() with an existing id raises SequenceExistsError and leaves counts alone."""
    with pytest.raises(SequenceExistsError):
        tree.add(1, [1, 2])
    assert tree.count([1, 2]) == 2
    assert tree.sequence(1) == S


def test_remove_restores_counts(tree: SuffixTree) -> None:
    """remove() takes away exactly the removed sequence's occurrences."""
    tree.add(2, [1, 2, 5])
    assert tree.count([1, 2]) == 3
    tree.remove(1)
    assert tree.count([1, 2]) == 1
    assert tree.count([2, 5]) == 1
    assert tree.count([3]) == 0
    assert tree.sequence_ids() == [2]
    assert 1 not in tree


@pytest.mark.parametrize("method", ["remove", "close_sequence", "sequence"])
def test_unknown_sequence_id(tree: SuffixTree, method: str) -> None:
    """Operations on a missing id raise SequenceNotFoundError, a KeyError."""
    with pytest.raises(SequenceNotFoundError) as info:
        getattr(tree, method)(42)
    assert isinstance(info.value, KeyError)
    assert "42" in str(info.value)


@pytest.mark.parametrize(
    ("tokens", "error", "detail"),
    [
        ([4, -1], InvalidTokenError, "index 1: value -1"),
        (np.array([4, 5, -9], dtype=np.int32), InvalidTokenError, "index 2: value -9"),
        ([2**31], InvalidTokenError, "index 0: value 2147483648"),
        ([4, 1.0], TypeError, "float (index 1)"),
        (np.array([4], dtype=np.int64), TypeError, "dtype int32"),
        (np.zeros((2, 2), dtype=np.int32), TypeError, "1-D"),
        (np.arange(6, dtype=np.int32)[::2], TypeError, "C-contiguous"),
        ("123", TypeError, "not str"),
    ],
)
def test_bad_tokens_are_refused(
    tree: SuffixTree, tokens: object, error: type[Exception], detail: str
) -> None:
    """Every token-taking method refuses bad tokens with a precise message and no change."""
    calls: list[Callable[[], object]] = [
        lambda: tree.add(2, tokens),  # type: ignore[arg-type]
        lambda: tree.append(3, tokens),  # type: ignore[arg-type]
        lambda: tree.count(tokens),  # type: ignore[arg-type]
        lambda: tree.draft(tokens),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(error, match=re.escape(detail)):
            call()
    assert tree.sequence_ids() == [1]
    assert tree.stats().tokens == len(S)


def test_stats_reports_sizes() -> None:
    """stats() counts sequences, open sequences and tokens; an empty tree has only the root."""
    t = SuffixTree(5)
    empty = t.stats()
    assert (empty.sequences, empty.open_sequences, empty.tokens, empty.nodes) == (0, 0, 0, 1)
    assert empty.max_depth == 5
    t.add(1, [1, 2, 3])
    t.append(2, [4, 4])
    stats = t.stats()
    assert isinstance(stats, TreeStats)
    assert (stats.sequences, stats.open_sequences, stats.tokens) == (2, 1, 5)
    assert stats.nodes > 1
    assert stats.bytes > 0
    assert 0 <= stats.free_bytes <= stats.bytes


def test_check_passes_on_a_sound_tree(tree: SuffixTree) -> None:
    """check() returns quietly after adds, appends and removes."""
    tree.append(2, [1, 2, 3, 9])
    tree.remove(1)
    tree.check()


# --- drafting ----------------------------------------------------------------------


def test_linear_draft_follows_most_frequent_child(tree: SuffixTree) -> None:
    """After [5, 1, 2]: 3 at 1.0, then the 7/9 tie goes to the smaller id 7 at 0.5."""
    d = tree.draft([5, 1, 2])
    assert d.token_ids == [3, 7]
    assert d.parents == [-1, 0]
    assert d.probs == [1.0, 0.5]
    assert d.score == 1.5
    assert d.match_len == 2
    assert d.source == "global"
    assert len(d) == 2


def test_budget_grows_with_match_length(tree: SuffixTree) -> None:
    """alpha=1, offset=0 allows 2 tokens for a 2-token match; max_spec_tokens caps it."""
    assert tree.draft([5, 1, 2], max_spec_tokens=1).token_ids == [3]
    assert tree.draft([2], max_spec_tokens=8).token_ids == [3]  # p = 1: one token
    # A chain stops where the sequence ends: [1, 2, 3, 7] has no continuation.
    assert tree.draft([5, 1, 2], offset=10.0).token_ids == [3, 7]


def test_tree_draft_takes_both_branches(tree: SuffixTree) -> None:
    """A tree draft keeps 7 and 9 (0.5 each) and follows 9's chain to depth 8."""
    d = tree.draft([5, 1, 2], tree=True, offset=10.0)
    assert d.token_ids == [3, 7, 9, 1, 2, 3, 7]
    assert d.parents == [-1, 0, 0, 2, 3, 4, 5]
    assert d.probs == [1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert d.score == 4.0
    assert d.match_len == 2


def test_min_token_prob_cuts_the_branch(tree: SuffixTree) -> None:
    """With min_token_prob 0.6 the 0.5 continuation is dropped."""
    d = tree.draft([5, 1, 2], min_token_prob=0.6)
    assert (d.token_ids, d.score, d.match_len) == ([3], 1.0, 2)


def test_max_pattern_limits_the_match(tree: SuffixTree) -> None:
    """max_pattern=1 only tries the last token, whose budget is one token."""
    d = tree.draft([5, 1, 2], max_pattern=1)
    assert (d.token_ids, d.match_len) == ([3], 1)


def test_min_score_empties_weak_drafts(tree: SuffixTree) -> None:
    """A draft scoring 1.5 is dropped when min_score is 1.6 and kept at 1.5."""
    assert tree.draft([5, 1, 2], min_score=1.6).token_ids == []
    assert tree.draft([5, 1, 2], min_score=1.5).token_ids == [3, 7]


def test_no_match_gives_empty_draft(tree: SuffixTree) -> None:
    """A context whose suffixes never continue drafts nothing."""
    for context in ([], [4], [9, 1, 2, 3, 7], [5, 6]):
        d = tree.draft(context)
        assert (d.token_ids, d.parents, d.probs) == ([], [], [])
        assert (d.score, d.match_len, d.source) == (0.0, 0, "none")


def test_use_global_false_disables_the_tree(tree: SuffixTree) -> None:
    """SuffixTree.draft drafts from the tree as the global tree only."""
    assert tree.draft([5, 1, 2], use_global=False).token_ids == []


def test_params_object_and_overrides_agree(tree: SuffixTree) -> None:
    """Keyword overrides give the same draft as an explicit DraftParams."""
    params = DraftParams(tree=True, offset=10.0)
    assert tree.draft([5, 1, 2], params) == tree.draft([5, 1, 2], tree=True, offset=10.0)
    assert tree.draft([5, 1, 2], DraftParams(), tree=True, offset=10.0) == tree.draft(
        [5, 1, 2], params
    )


def test_long_drafts_regrow_the_buffers() -> None:
    """A 60-token draft (beyond the default 32-token buffers) comes back whole."""
    t = SuffixTree(128)
    t.add(1, [*range(100, 160), 100, 101])
    d = t.draft([100, 101], max_spec_tokens=100, alpha=100.0)
    assert d.token_ids == [*range(102, 160), 100, 101]
    assert d.probs == [1.0] * 60
    assert d.score == 60.0


# --- snapshots and deltas --------------------------------------------------------


def _fill(t: SuffixTree) -> None:
    t.add(1, S)
    t.add(-3, [2, 3, 9, 9])
    t.append(7, [1, 2, 3, 4])


def test_snapshot_round_trip() -> None:
    """from_bytes(to_bytes()) restores ids, tokens, counts and drafts; open sequences close."""
    src = SuffixTree(6)
    _fill(src)
    data = src.to_bytes()
    assert isinstance(data, bytes)
    copy = SuffixTree.from_bytes(data)
    assert copy.max_depth == 6
    assert copy.sequence_ids() == src.sequence_ids()
    for sid in src.sequence_ids():
        assert copy.sequence(sid) == src.sequence(sid)
    for pattern in ([1, 2], [2, 3], [3, 9], [9, 9], [1, 2, 3, 4], [2, 3, 9, 1, 2, 3]):
        assert copy.count(pattern) == src.count(pattern)
    for context in ([1, 2], [9], [5, 2, 3]):
        assert copy.draft(context, tree=True) == src.draft(context, tree=True)
    s, c = src.stats(), copy.stats()
    assert (c.sequences, c.tokens, c.open_sequences) == (s.sequences, s.tokens, 0)
    assert copy.to_bytes() == data  # the snapshot is deterministic


def test_snapshot_loads_into_an_empty_tree() -> None:
    """load() of a snapshot into an empty tree of the same depth equals from_bytes."""
    src = SuffixTree(6)
    _fill(src)
    dst = SuffixTree(6)
    dst.load(bytearray(src.to_bytes()))
    assert dst.sequence_ids() == src.sequence_ids()
    assert dst.count([1, 2, 3]) == 3


def test_delta_adds_and_removes_and_is_idempotent() -> None:
    """A delta of (add 7, remove 1) turns a copy of {1, -3} into {-3, 7}; twice is a no-op."""
    src = SuffixTree(6)
    _fill(src)
    dst = SuffixTree(6)
    dst.add(1, S)
    dst.add(-3, [2, 3, 9, 9])
    delta = src.delta_bytes([7], remove_ids=[1])
    dst.load(delta)
    after_once = (dst.sequence_ids(), dst.count([1, 2]), dst.count([2, 3]), dst.stats())
    assert sorted(after_once[0]) == [-3, 7]
    assert dst.sequence(7) == [1, 2, 3, 4]
    assert after_once[1:3] == (1, 2)
    dst.load(delta)
    assert (dst.sequence_ids(), dst.count([1, 2]), dst.count([2, 3]), dst.stats()) == after_once


def test_delta_of_missing_id_fails(tree: SuffixTree) -> None:
    """delta_bytes() refuses ids the tree does not hold."""
    with pytest.raises(SequenceNotFoundError):
        tree.delta_bytes([1, 99])


def test_delta_into_other_depth_fails(tree: SuffixTree) -> None:
    """A shard of depth 8 does not load into a depth-6 tree, which stays empty."""
    other = SuffixTree(6)
    with pytest.raises(DepthMismatchError):
        other.load(tree.delta_bytes([1]))
    assert len(other) == 0


def test_delta_ids_are_validated(tree: SuffixTree) -> None:
    """Ids outside int64 or of the wrong type are refused before any C call."""
    with pytest.raises(InvalidArgumentError):
        tree.delta_bytes([2**63])
    with pytest.raises(TypeError):
        tree.delta_bytes("1")  # type: ignore[arg-type]


# --- lifetime ----------------------------------------------------------------------


def test_close_and_use_after_close(tree: SuffixTree) -> None:
    """After close() every use raises TreeClosedError; closing again is fine."""
    states = [tree.closed]
    tree.close()
    tree.close()
    states.append(tree.closed)
    assert states == [False, True]
    calls: list[Callable[[], object]] = [
        lambda: tree.add(2, [1]),
        lambda: tree.append(2, [1]),
        lambda: tree.count([1]),
        lambda: tree.draft([1]),
        lambda: tree.to_bytes(),
        lambda: tree.sequence_ids(),
        lambda: len(tree),
        lambda: 1 in tree,
        lambda: tree.load(b""),
    ]
    for call in calls:
        with pytest.raises(TreeClosedError):
            call()
    assert "closed" in repr(tree)


def test_context_manager_closes() -> None:
    """A with block closes the tree, also when the block raises."""
    with SuffixTree(4) as t:
        t.add(1, [1, 2])
        assert t.count([1, 2]) == 1
    assert t.closed
    with pytest.raises(KeyError), SuffixTree(4) as t2:
        t2.remove(5)
    assert t2.closed


def test_repr_shows_depth_and_size(tree: SuffixTree) -> None:
    """repr() names the depth and the number of sequences."""
    assert repr(tree) == "<SuffixTree max_depth=8 sequences=1>"


# --- integral argument types -------------------------------------------------------

INTEGRAL = (np.int32, np.int64, np.uint16, np.uint32, np.int16)


@pytest.mark.parametrize("kind", INTEGRAL, ids=lambda k: k.__name__)
def test_integer_arguments_accept_numpy_integers(kind: type) -> None:
    """Depth and sequence ids accept numpy integers; ids come back as plain ints."""
    t = SuffixTree(kind(DEPTH))
    assert t.max_depth == DEPTH
    assert type(t.max_depth) is int
    t.add(kind(1), np.array(S, dtype=np.int32))
    t.append(kind(2), [kind(v) for v in S[:4]])
    t.close_sequence(kind(2))
    assert kind(1) in t
    assert kind(2) in t
    assert t.sequence(kind(1)) == S
    assert t.sequence(kind(2)) == S[:4]
    assert all(type(i) is int for i in t.sequence_ids())
    other = SuffixTree(DEPTH)
    other.load(t.delta_bytes(np.array([1], dtype=kind), [kind(7)]))
    assert other.sequence_ids() == [1]
    t.remove(kind(2))
    assert t.sequence_ids() == [1]


@pytest.mark.parametrize("value", [True, False, np.True_, 1.0, "1"], ids=repr)
def test_integer_arguments_refuse_bool_and_non_integers(tree: SuffixTree, value: object) -> None:
    """bool and non-integers raise TypeError naming the argument; nothing changes."""
    name = "bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__
    with pytest.raises(TypeError, match=f"^max_depth must be an int, not {name}$"):
        SuffixTree(value)  # type: ignore[arg-type]
    for call in (tree.add, tree.append):
        with pytest.raises(TypeError, match=f"^seq_id must be an int, not {name}$"):
            call(value, [1])  # type: ignore[arg-type]
    for one in (tree.remove, tree.close_sequence, tree.sequence):
        with pytest.raises(TypeError, match=f"^seq_id must be an int, not {name}$"):
            one(value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=rf"^add_ids\[1\] must be an int, not {name}$"):
        tree.delta_bytes([1, value])  # type: ignore[list-item]
    assert value not in tree
    assert tree.sequence_ids() == [1]
