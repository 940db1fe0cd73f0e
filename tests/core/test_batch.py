"""BatchDrafter and draft_batch: append-then-draft for many cursors in one call.

The global tree holds G = [1, 2, 3, 9, 1, 2, 3, 7] (depth 8).  Expected drafts
are the hand-derived ones of tests/core/test_tree.py and tests/core/test_draft.py:
after [5, 1, 2] the global draft is [3, 7] (1.0, 0.5); a cursor whose own
context is [1, 2, 3, 9, 1, 2] drafts [3, 9] from its local tree.
"""

from __future__ import annotations

import numpy as np
import pytest

from agentspec import BatchDrafter, Cursor, Draft, DraftParams, SuffixTree, draft_batch
from agentspec._core import lowlevel
from agentspec._core.batch import BatchItem
from agentspec.exceptions import (
    CapacityError,
    InvalidArgumentError,
    InvalidTokenError,
    TreeClosedError,
)

G = [1, 2, 3, 9, 1, 2, 3, 7]
P_LOCAL = [1, 2, 3, 9, 1, 2]
DEPTH = 8

GLOBAL_DRAFT = Draft([3, 7], [-1, 0], [1.0, 0.5], 1.5, 2, "global")
LOCAL_DRAFT = Draft([3, 9], [-1, 0], [1.0, 1.0], 2.0, 2, "local")
EMPTY_DRAFT = Draft([], [], [], 0.0, 0, "none")


@pytest.fixture
def gtree() -> SuffixTree:
    """The global tree holding G."""
    t = SuffixTree(DEPTH)
    t.add(1, G)
    return t


def three_items(gtree: SuffixTree) -> list[BatchItem]:
    """Cursors that draft GLOBAL_DRAFT, LOCAL_DRAFT and EMPTY_DRAFT after their appends."""
    return [
        (Cursor(DEPTH, prompt=[5]), gtree, [1, 2]),
        (Cursor(DEPTH, prompt=[1, 2, 3, 9]), None, np.array([1, 2], dtype=np.int32)),
        (Cursor(DEPTH, local_tree=False), gtree, None),
    ]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_batch_appends_then_drafts(gtree: SuffixTree, threads: int) -> None:
    """Each item gets its tokens appended and its own draft, for any thread count."""
    items = three_items(gtree)
    drafter = BatchDrafter(max_batch=4, threads=threads)
    assert drafter.draft(items) == [GLOBAL_DRAFT, LOCAL_DRAFT, EMPTY_DRAFT]
    assert [len(c) for c, _, _ in items] == [3, 6, 0]


def test_one_shot_function_agrees(gtree: SuffixTree) -> None:
    """draft_batch() gives the same drafts as a BatchDrafter."""
    assert draft_batch(three_items(gtree), threads=2) == [GLOBAL_DRAFT, LOCAL_DRAFT, EMPTY_DRAFT]
    assert draft_batch([]) == []


def test_batch_matches_cursor_by_cursor_over_steps(gtree: SuffixTree) -> None:
    """Over several decode steps a reused drafter equals extend + draft on twin cursors."""
    params = DraftParams(max_spec_tokens=4, tree=True, offset=1.0)
    steps = [[1], [2], [3, 9], [1, 2], [3], [7, 1]]
    batch_cursors = [Cursor(DEPTH, prompt=[5]), Cursor(DEPTH, prompt=[2, 3])]
    twins = [Cursor(DEPTH, prompt=[5]), Cursor(DEPTH, prompt=[2, 3])]
    drafter = BatchDrafter(params, max_batch=2)
    for step in steps:
        got = drafter.draft([(c, gtree, step) for c in batch_cursors])
        want = []
        for twin in twins:
            twin.extend(step)
            want.append(twin.draft(gtree, params))
        assert got == want
    assert any(len(d) > 1 for d in got)


def test_empty_token_lists_append_nothing(gtree: SuffixTree) -> None:
    """Items whose new tokens are empty (list or array) just draft."""
    cursors = [Cursor(DEPTH, prompt=[5, 1, 2]), Cursor(DEPTH, prompt=P_LOCAL)]
    drafts = draft_batch([(cursors[0], gtree, []), (cursors[1], None, np.array([], np.int32))])
    assert drafts == [GLOBAL_DRAFT, LOCAL_DRAFT]
    assert [len(c) for c in cursors] == [3, 6]


def test_params_bound_the_drafts(gtree: SuffixTree) -> None:
    """A drafter with max_spec_tokens=1 returns one-token drafts."""
    drafter = BatchDrafter(DraftParams(max_spec_tokens=1), max_batch=1)
    assert drafter.params.max_spec_tokens == 1
    (d,) = drafter.draft([(Cursor(DEPTH, prompt=[5, 1, 2]), gtree, None)])
    assert (d.token_ids, d.probs) == ([3], [1.0])


def test_empty_batch_and_capacity(gtree: SuffixTree) -> None:
    """An empty batch returns []; more than max_batch items raise CapacityError."""
    drafter = BatchDrafter(max_batch=2)
    assert drafter.draft([]) == []
    items = three_items(gtree)
    with pytest.raises(CapacityError):
        drafter.draft(items)
    assert [len(c) for c, _, _ in items] == [1, 4, 0]


def test_duplicate_cursor_is_refused(gtree: SuffixTree) -> None:
    """The same cursor twice raises InvalidArgumentError before any append."""
    cur = Cursor(DEPTH, prompt=[5])
    with pytest.raises(InvalidArgumentError):
        draft_batch([(cur, gtree, [1]), (cur, gtree, [2])])
    assert len(cur) == 1


def test_bad_list_tokens_change_nothing(gtree: SuffixTree) -> None:
    """A bad token list in a later item raises before earlier items are appended."""
    items = three_items(gtree)
    items[2] = (items[2][0], gtree, [4, -1])
    with pytest.raises(InvalidTokenError):
        draft_batch(items)
    assert [len(c) for c, _, _ in items] == [1, 4, 0]


def test_negative_token_names_the_item(gtree: SuffixTree) -> None:
    """A negative id (list or int32 array) is refused up front, naming item and value."""
    for bad in (np.array([1, -7], dtype=np.int32), [1, -7]):
        items = three_items(gtree)
        items[1] = (items[1][0], gtree, bad)
        with pytest.raises(InvalidTokenError) as info:
            draft_batch(items)
        assert "batch item 1" in str(info.value)
        assert "index 1: value -7" in str(info.value)
        assert [len(c) for c, _, _ in items] == [1, 4, 0]


def test_closed_cursor_or_tree(gtree: SuffixTree) -> None:
    """A closed cursor or tree raises TreeClosedError and no item is appended."""
    items = three_items(gtree)
    items[1][0].close()
    with pytest.raises(TreeClosedError):
        draft_batch(items)
    assert len(items[0][0]) == 1
    fresh = three_items(gtree)
    gtree.close()
    with pytest.raises(TreeClosedError):
        draft_batch(fresh)
    assert [len(c) for c, _, _ in fresh] == [1, 4, 0]


def test_items_must_be_triples(gtree: SuffixTree) -> None:
    """Items that are not (Cursor, tree-or-None, tokens-or-None) raise TypeError."""
    cur = Cursor(DEPTH)
    for bad in ([(cur, gtree)], [(gtree, gtree, None)], [(cur, "tree", None)], [cur]):
        with pytest.raises(TypeError):
            draft_batch(bad)  # type: ignore[arg-type]


def test_constructor_validation() -> None:
    """max_batch and threads must be positive ints."""
    for kwargs in ({"max_batch": 0}, {"threads": 0}, {"threads": -2}):
        with pytest.raises(InvalidArgumentError):
            BatchDrafter(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BatchDrafter(max_batch=2.5)  # type: ignore[arg-type]
    drafter = BatchDrafter(max_batch=3, threads=2)
    assert (drafter.max_batch, drafter.threads) == (3, 2)
    assert repr(drafter) == "<BatchDrafter max_batch=3 threads=2 max_spec_tokens=32>"


def test_items_draft_from_several_trees_like_draft_multi() -> None:
    """An item with a list of trees drafts as one ``as_draft_multi`` call with that list."""
    rng = np.random.default_rng(7)
    trees = []
    for _ in range(3):
        tree = SuffixTree(16)
        for i in range(6):
            tree.add(i, rng.integers(0, 5, 40).tolist())
        trees.append(tree)
    prompts = [rng.integers(0, 5, 20).tolist() for _ in range(8)]
    cursors = [Cursor(16, prompt=p) for p in prompts]
    twins = [Cursor(16, prompt=p) for p in prompts]
    handles = lowlevel.new_tree_array(lowlevel.MAX_GLOBALS)
    sets: list[list[SuffixTree]] = [[], [trees[0]], trees[:2], [trees[2], trees[0], trees[1]]]
    drafter = BatchDrafter(DraftParams(max_spec_tokens=8), max_batch=8)
    for _ in range(20):
        new = [rng.integers(0, 5, int(rng.integers(0, 3))).tolist() for _ in cursors]
        pairs = enumerate(zip(cursors, new, strict=True))
        items = [(c, sets[i % 4], toks) for i, (c, toks) in pairs]
        got = drafter.draft_indexed(items)
        for i, (twin, toks) in enumerate(zip(twins, new, strict=True)):
            twin.extend(toks)
            want = twin._draft_multi(sets[i % 4], DraftParams(max_spec_tokens=8), handles)
            assert got[i] == want


def test_caps_bound_each_item(gtree: SuffixTree) -> None:
    """A cap limits one item's draft; 0 drafts nothing but still appends."""
    a = Cursor(DEPTH)
    b = Cursor(DEPTH)
    drafter = BatchDrafter(DraftParams(max_spec_tokens=4))
    got = drafter.draft([(a, gtree, [5, 1, 2]), (b, gtree, [5, 1, 2])], caps=[1, 0])
    assert got[0].token_ids == [3]
    assert got[1] == EMPTY_DRAFT
    assert len(b) == 3
    big = drafter.draft([(a, gtree, None)], caps=[1000])  # clamped to max_spec_tokens
    assert big[0] == GLOBAL_DRAFT


def test_bad_caps_and_tree_lists_change_nothing(gtree: SuffixTree) -> None:
    """Wrong caps or tree lists raise before any token is appended."""
    c = Cursor(DEPTH)
    drafter = BatchDrafter(DraftParams(max_spec_tokens=4))
    with pytest.raises(InvalidArgumentError, match="one entry per item"):
        drafter.draft([(c, gtree, [1, 2])], caps=[1, 2])
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        drafter.draft([(c, gtree, [1, 2])], caps=[-1])
    with pytest.raises(TypeError, match="caps"):
        drafter.draft([(c, gtree, [1, 2])], caps=[1.5])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="at most 4"):
        drafter.draft([(c, [gtree] * 5, [1, 2])])
    with pytest.raises(TypeError, match="SuffixTree"):
        drafter.draft([(c, [gtree, "tree"], [1, 2])])  # type: ignore[list-item]
    assert len(c) == 0
    assert drafter.draft([(c, gtree, [1, 2])], caps=[np.int64(2)])[0].token_ids == [3, 7]


# --- integral argument types -------------------------------------------------------

INTEGRAL = (np.int32, np.int64, np.uint16, np.uint32, np.int16)


@pytest.mark.parametrize("kind", INTEGRAL, ids=lambda k: k.__name__)
def test_integer_arguments_accept_numpy_integers(gtree: SuffixTree, kind: type) -> None:
    """max_batch, threads and caps accept numpy integers (caps also as an array)."""
    drafter = BatchDrafter(DraftParams(max_spec_tokens=4), max_batch=kind(3), threads=kind(2))
    assert (drafter.max_batch, drafter.threads) == (3, 2)
    assert type(drafter.max_batch) is int
    assert type(drafter.threads) is int
    items: list[BatchItem] = [
        (Cursor(DEPTH, prompt=[5]), gtree, [kind(1), kind(2)]),
        (Cursor(DEPTH, prompt=[5]), gtree, np.array([1, 2], dtype=np.int32)),
    ]
    caps = np.array([1, 0], dtype=kind)
    drafts = drafter.draft(items, caps)
    assert [d.token_ids for d in drafts] == [[3], []]
    again = draft_batch([(c, gtree, None) for c, _, _ in items], threads=kind(1))
    assert [d.token_ids for d in again] == [[3, 7], [3, 7]]  # tie 9/7: the smaller id


@pytest.mark.parametrize("value", [True, np.True_, 2.0, "2"], ids=repr)
def test_integer_arguments_refuse_bool_and_non_integers(gtree: SuffixTree, value: object) -> None:
    """bool and non-integers raise TypeError naming the argument; nothing is appended."""
    name = "bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__
    for kw in ("max_batch", "threads"):
        with pytest.raises(TypeError, match=f"^{kw} must be an int, not {name}$"):
            BatchDrafter(**{kw: value})  # type: ignore[arg-type]
    cursor = Cursor(DEPTH, prompt=[5])
    with pytest.raises(TypeError, match=rf"^caps\[1\] must be an int, not {name}$"):
        BatchDrafter().draft([(cursor, gtree, [1]), (Cursor(DEPTH), None, None)], [1, value])
    assert len(cursor) == 1
