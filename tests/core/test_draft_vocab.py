"""`DraftParams.vocab_size`: drafted token ids stay inside the model's vocabulary.

A token >= vocab_size ends its branch (in C, while the draft grows): a chain
stops before it, a tree draft leaves it and its subtree out, and the other
tokens keep their probabilities.  test_properties.py cross-checks every mode
against the reference with random bounds; these are the worked examples.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from agentspec import BatchDrafter, Cursor, DraftParams, Speculator, SuffixTree, draft_batch
from agentspec.exceptions import InvalidArgumentError

# after [1, 2]: 3 (1.0), then 50 (2/3) -> 6, or 4 (1/3) -> 7
SEQS = [[1, 2, 3, 50, 6], [1, 2, 3, 50, 6], [1, 2, 3, 4, 7]]


@pytest.fixture
def tree() -> SuffixTree:
    t = SuffixTree(16)
    for i, s in enumerate(SEQS):
        t.add(i, s)
    return t


def test_default_is_unbounded(tree: SuffixTree) -> None:
    assert DraftParams().vocab_size is None
    assert tree.draft([1, 2], alpha=4.0).token_ids == [3, 50, 6]


def test_chain_stops_before_the_first_out_of_vocabulary_token(tree: SuffixTree) -> None:
    d = tree.draft([1, 2], alpha=4.0, vocab_size=50)
    assert d.token_ids == [3]  # stops: the less likely 4 is not taken instead
    assert d.probs == [1.0]
    assert d.score == 1.0
    assert tree.draft([1, 2], alpha=4.0, vocab_size=51).token_ids == [3, 50, 6]
    assert tree.draft([1, 2], alpha=4.0, vocab_size=3).token_ids == []
    assert tree.draft([1, 2], alpha=4.0, vocab_size=3).source == "none"


def test_tree_draft_leaves_out_the_branch(tree: SuffixTree) -> None:
    full = tree.draft([1, 2], alpha=4.0, tree=True, min_token_prob=0.0)
    assert sorted(full.token_ids) == [3, 4, 6, 7, 50]
    d = tree.draft([1, 2], alpha=4.0, tree=True, min_token_prob=0.0, vocab_size=50)
    assert d.token_ids == [3, 4, 7]
    assert d.parents == [-1, 0, 1]
    assert d.probs == pytest.approx([1.0, 1 / 3, 1 / 3])  # unchanged probabilities
    d = tree.draft([1, 2], alpha=4.0, tree=True, min_token_prob=0.0, vocab_size=7)
    assert d.token_ids == [3, 4]


def test_cursor_local_tree_and_merge_honour_it(tree: SuffixTree) -> None:
    prompt = [9, 1, 2, 3, 50, 6, 8, 1, 2]  # the request's own text has 50 after 1,2,3 too
    for merge in (False, True):
        cur = Cursor(16, prompt=prompt)
        d = cur.draft(tree, alpha=4.0, merge=merge, vocab_size=50)
        assert d.token_ids == [3]
        d = cur.draft(tree, alpha=4.0, merge=merge, tree=True, vocab_size=50)
        assert all(t < 50 for t in d.token_ids)
        assert 3 in d.token_ids
        cur.close()


def test_batch_drafter_and_draft_batch(tree: SuffixTree) -> None:
    params = DraftParams(alpha=4.0, vocab_size=50)
    curs = [Cursor(16, prompt=[1, 2]) for _ in range(3)]
    drafter = BatchDrafter(params, max_batch=4, threads=2)
    drafts = drafter.draft([(c, tree, None) for c in curs])
    assert [d.token_ids for d in drafts] == [[3]] * 3
    drafts = draft_batch([(c, [tree], [9]) for c in curs], DraftParams(alpha=4.0, vocab_size=4))
    assert all(d.token_ids == [] or max(d.token_ids) < 4 for d in drafts)
    unbounded = BatchDrafter(DraftParams(alpha=4.0), max_batch=4)
    assert unbounded.draft([(Cursor(16, prompt=[1, 2]), tree, None)])[0].token_ids == [3, 50, 6]


def test_speculator_honours_it() -> None:
    spec = Speculator(16, params=DraftParams(alpha=4.0, vocab_size=50))
    for s in SEQS:
        spec.add_response(s, stage="s")
    spec.start_request("r", [9, 1, 2], stage="s")
    assert spec.draft("r").token_ids == [3]
    assert spec.draft("r", vocab_size=None).token_ids[:2] == [3, 50]
    spec.start_request("q", [8, 1, 2], stage="s")
    assert [d.token_ids for d in spec.draft_batch(["r", "q"])] == [[3], [3]]
    spec.close()


def test_validation() -> None:
    for bad in (0, -1, 2**31 + 1):
        with pytest.raises(InvalidArgumentError, match="vocab_size"):
            DraftParams(vocab_size=bad)
    for bad in (True, np.True_, 5.0, "5"):
        with pytest.raises(TypeError, match="vocab_size must be an int or None"):
            DraftParams(vocab_size=bad)  # type: ignore[arg-type]
    p = DraftParams(vocab_size=np.int64(49152))
    assert p.vocab_size == 49152
    assert type(p.vocab_size) is int
    assert p == DraftParams(vocab_size=49152)
    assert hash(p) == hash(DraftParams(vocab_size=49152))
    assert DraftParams(vocab_size=2**31).vocab_size == 2**31


def test_pickle_and_copy_keep_it(tree: SuffixTree) -> None:
    p = DraftParams(alpha=4.0, vocab_size=50)
    tree.draft([1, 2], p)  # caches the C struct
    for q in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p)):
        assert q == p
        assert tree.draft([1, 2], q).token_ids == [3]
