"""DraftParams, Draft and Cursor on hand-checked examples.

Running example: a cursor whose context is P = [1, 2, 3, 9, 1, 2] in depth 8.
Its per-request ("local") tree holds P.  The suffix [1, 2] occurs twice in P,
but the second occurrence is the context itself and has no continuation, so
[1, 2] continues with 3 with probability 1/1, then [1, 2, 3] with 9 (1/1):
the draft is [3, 9] with probabilities [1.0, 1.0] (budget 2 for a 2-token match).
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest

from agentspec import Cursor, Draft, DraftParams, SuffixTree, TreeStats, confidence_table
from agentspec.exceptions import InvalidArgumentError, InvalidTokenError, TreeClosedError

P = [1, 2, 3, 9, 1, 2]
DEPTH = 8


# --- DraftParams -------------------------------------------------------------------


def test_params_defaults_match_the_contract() -> None:
    """DraftParams() has the documented defaults."""
    p = DraftParams()
    assert dataclasses.asdict(p) == {
        "max_spec_tokens": 32,
        "alpha": 1.0,
        "offset": 0.0,
        "min_token_prob": 0.1,
        "tree": False,
        "merge": False,
        "use_local": True,
        "use_global": True,
        "min_score": 0.0,
        "max_pattern": 0,
        "min_pattern": 0,
        "vocab_size": None,
        "conf": None,
    }


def test_confident_params_are_the_confidence_policy() -> None:
    """DraftParams.confident(): the default table, cut 0.25, no match-length budget;
    overrides replace any field."""
    p = DraftParams.confident()
    assert p.conf == confidence_table()
    assert len(p.conf) == 64
    assert (p.alpha, p.min_token_prob, p.max_spec_tokens) == (32.0, 0.25, 32)
    q = DraftParams.confident(max_spec_tokens=8, min_token_prob=0.5)
    assert (q.max_spec_tokens, q.min_token_prob, q.conf) == (8, 0.5, p.conf)
    assert pickle.loads(pickle.dumps(q)) == q


def test_confidence_table_grows_with_length_and_count() -> None:
    """Longer matches and more frequent strings are trusted more; all values in (0, 1)."""
    t = confidence_table()
    at = lambda lb, tb: t[lb * 8 + tb]  # noqa: E731
    assert all(0.0 < v < 1.0 for v in t)
    for lb in range(1, 7):
        for tb in range(1, 7):
            assert at(lb + 1, tb) > at(lb, tb)
            assert at(lb, tb + 1) > at(lb, tb)
    assert at(1, 1) == pytest.approx(1 - 1 / 1.5)  # scale 0.5 at L = T = 1
    flat = confidence_table(scale=1.0, length_exp=0.0, count_exp=0.0)
    assert set(flat) == {0.5}
    with pytest.raises(InvalidArgumentError):
        confidence_table(scale=-1.0)
    with pytest.raises(InvalidArgumentError):
        confidence_table(length_exp=float("nan"))


@pytest.mark.parametrize(
    "bad", [(0.5,) * 63, (0.5,) * 65, (0.5,) * 63 + (1.5,), (0.5,) * 63 + (float("nan"),)]
)
def test_params_refuse_a_bad_conf_table(bad: tuple[float, ...]) -> None:
    """A table of the wrong size or with a value outside [0, 1] is refused up front."""
    with pytest.raises(InvalidArgumentError):
        DraftParams(conf=bad)
    with pytest.raises(TypeError):
        DraftParams(conf=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        DraftParams(conf=("x",) * 64)  # type: ignore[arg-type]


def test_conf_table_weighs_every_token() -> None:
    """An all-ones table drafts exactly as counts alone; a flat 0.5 table halves each
    token's probability in turn, and the cut ends the draft where the product falls
    below it."""
    with Cursor(DEPTH) as c:
        c.extend(P)
        base = c.draft(params=DraftParams())
        ones = c.draft(params=DraftParams(conf=(1.0,) * 64))
        assert (ones.token_ids, ones.probs, ones.score) == (base.token_ids, base.probs, base.score)
        half = c.draft(params=DraftParams(conf=(0.5,) * 64, min_token_prob=0.0))
        assert half.token_ids == [3, 9]
        assert half.probs == pytest.approx([0.5, 0.25])
        cut = c.draft(params=DraftParams(conf=(0.5,) * 64, min_token_prob=0.3))
        assert cut.token_ids == [3]
        none = c.draft(params=DraftParams(conf=(0.0,) * 64, min_token_prob=0.0))
        assert none.token_ids == []


def test_params_are_frozen_and_hashable() -> None:
    """DraftParams cannot be mutated and equal instances hash equally."""
    p = DraftParams(max_spec_tokens=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_spec_tokens = 9  # type: ignore[misc]
    assert p == DraftParams(max_spec_tokens=8)
    assert hash(p) == hash(DraftParams(max_spec_tokens=8))
    assert dataclasses.replace(p, tree=True).tree is True


def test_params_survive_pickle_and_deepcopy_after_use() -> None:
    """A DraftParams that was used (C struct cached) still pickles and copies."""
    p = DraftParams(max_spec_tokens=2, tree=True)
    cur = Cursor(DEPTH, prompt=P)
    first = cur.draft(None, p)
    for clone in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p), copy.copy(p)):
        assert clone == p
        assert cur.draft(None, clone) == first


@pytest.mark.parametrize(
    "bad",
    [
        {"max_spec_tokens": 4.0},
        {"max_spec_tokens": True},
        {"alpha": "1"},
        {"min_token_prob": None},
        {"tree": 1},
        {"use_local": "yes"},
        {"max_pattern": 2.0},
    ],
)
def test_params_wrong_types(bad: dict[str, object]) -> None:
    """A field of the wrong type raises TypeError at construction."""
    with pytest.raises(TypeError):
        DraftParams(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "edge",
    [
        {"max_spec_tokens": 1},
        {"max_spec_tokens": 1024},
        {"min_token_prob": 0.0},
        {"min_token_prob": 1.0},
        {"alpha": 0.0, "offset": -3.5},
        {"alpha": 3},
    ],
)
def test_params_accept_edge_values(edge: dict[str, object]) -> None:
    """Values at the edges of the allowed ranges are accepted."""
    DraftParams(**edge)  # type: ignore[arg-type]


def test_params_out_of_range() -> None:
    """Out-of-range values raise InvalidArgumentError, a ValueError."""
    for bad in ({"max_spec_tokens": 1025}, {"min_token_prob": 1.5}, {"alpha": float("inf")}):
        with pytest.raises(InvalidArgumentError) as info:
            DraftParams(**bad)
        assert isinstance(info.value, ValueError)


# --- Draft -------------------------------------------------------------------------


def test_draft_is_a_frozen_record() -> None:
    """Draft holds its fields, has a length and is immutable."""
    d = Draft([5, 6], [-1, 0], [1.0, 0.5], 1.5, 3, "global")
    assert len(d) == 2
    assert d.token_ids == [5, 6]
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.score = 2.0  # type: ignore[misc]


# --- Cursor ------------------------------------------------------------------------


def test_cursor_drafts_from_its_own_context() -> None:
    """The local tree drafts [3, 9] at probability 1.0 each (not 0.5: no self-match)."""
    with Cursor(DEPTH, prompt=P) as cur:
        d = cur.draft()
    assert d == Draft([3, 9], [-1, 0], [1.0, 1.0], 2.0, 2, "local")


def test_cursor_extend_moves_the_match() -> None:
    """After extending with 3 the best match is [1, 2, 3] (length 3), drafting [9, 1, 2]."""
    cur = Cursor(DEPTH, prompt=P)
    cur.extend([3])
    assert len(cur) == 7
    d = cur.draft()
    assert (d.token_ids, d.probs, d.match_len, d.source) == ([9, 1, 2], [1.0] * 3, 3, "local")


def test_cursor_prompt_forms_agree() -> None:
    """A numpy prompt, a list prompt and prompt-by-extend draft the same."""
    a = Cursor(DEPTH, prompt=np.array(P, dtype=np.int32))
    b = Cursor(DEPTH, prompt=P)
    c = Cursor(DEPTH)
    c.extend(P[:2])
    c.extend(tuple(P[2:]))
    assert a.draft() == b.draft() == c.draft()
    assert len(a) == len(b) == len(c) == 6


def test_local_wins_ties_with_global() -> None:
    """Global [1, 2, 3, 7, 7] also scores 2.0 after [1, 2]; the local draft wins the tie."""
    g = SuffixTree(DEPTH)
    g.add(1, [1, 2, 3, 7, 7])
    cur = Cursor(DEPTH, prompt=P)
    assert cur.draft(g).token_ids == [3, 9]
    assert cur.draft(g).source == "local"
    only_global = cur.draft(g, use_local=False)
    assert (only_global.token_ids, only_global.source) == ([3, 7], "global")


def test_global_wins_with_a_longer_match() -> None:
    """Global [9, 1, 2, 3, 4, 5] matches [9, 1, 2] (3 tokens) where the local tree has nothing."""
    g = SuffixTree(DEPTH)
    g.add(1, [9, 1, 2, 3, 4, 5])
    cur = Cursor(DEPTH, prompt=[5, 9, 1, 2])
    d = cur.draft(g)
    assert d == Draft([3, 4, 5], [-1, 0, 1], [1.0, 1.0, 1.0], 3.0, 3, "global")
    assert cur.draft(g, use_global=False).token_ids == []


def test_cursor_tree_draft() -> None:
    """A tree draft from the cursor branches like the global tree does."""
    g = SuffixTree(DEPTH)
    g.add(1, [1, 2, 3, 9, 1, 2, 3, 7])
    cur = Cursor(DEPTH, local_tree=False, prompt=[5, 1, 2])
    d = cur.draft(g, DraftParams(tree=True, offset=1.0))
    # Budget floor(2 + 1) = 3: 3 (1.0), then 7 and 9 (0.5 each, 7 pushed first).
    assert (d.token_ids, d.parents, d.probs) == ([3, 7, 9], [-1, 0, 0], [1.0, 0.5, 0.5])


def test_cursor_without_local_tree() -> None:
    """local_tree=False: no local stats, and with no global tree nothing to draft."""
    cur = Cursor(DEPTH, local_tree=False, prompt=P)
    assert not cur.has_local_tree
    assert cur.local_stats() is None
    d = cur.draft()
    assert (d.token_ids, d.source, d.match_len) == ([], "none", 0)


def test_local_stats_describe_the_context() -> None:
    """The per-request tree holds one sequence with the whole context."""
    cur = Cursor(DEPTH, prompt=P)
    cur.extend([3, 4])
    stats = cur.local_stats()
    assert isinstance(stats, TreeStats)
    assert (stats.sequences, stats.tokens, stats.max_depth) == (1, 8, DEPTH)


def test_cursor_long_draft_regrows_buffers() -> None:
    """max_spec_tokens above the default 32 returns the full 60-token draft."""
    cur = Cursor(128, prompt=[*range(100, 160), 100, 101])
    d = cur.draft(max_spec_tokens=100, alpha=100.0)
    assert d.token_ids == [*range(102, 160), 100, 101]
    assert d.parents == list(range(-1, 59))
    assert d.score == 60.0
    assert d.match_len == 2


def test_params_reuse_gives_identical_drafts() -> None:
    """Drafting twice with one DraftParams instance (cached C struct) is stable."""
    params = DraftParams(max_spec_tokens=4, tree=True)
    cur = Cursor(DEPTH, prompt=P)
    assert cur.draft(None, params) == cur.draft(None, params)


def test_bad_prompt_raises() -> None:
    """A bad prompt raises from the constructor (negative ids, wrong dtype)."""
    with pytest.raises(InvalidTokenError):
        Cursor(DEPTH, prompt=[1, -2])
    with pytest.raises(InvalidTokenError):
        Cursor(DEPTH, prompt=np.array([1, -2], dtype=np.int32))
    with pytest.raises(TypeError):
        Cursor(DEPTH, prompt=np.array([1, 2], dtype=np.int16))


def test_extend_failure_keeps_context() -> None:
    """A rejected extend appends nothing."""
    cur = Cursor(DEPTH, prompt=P)
    with pytest.raises(InvalidTokenError):
        cur.extend([4, 2**31])
    assert len(cur) == 6
    assert cur.draft().token_ids == [3, 9]


def test_cursor_rejects_a_non_tree() -> None:
    """The global tree argument must be a SuffixTree or None."""
    cur = Cursor(DEPTH, prompt=P)
    with pytest.raises(TypeError):
        cur.draft([1, 2, 3])  # type: ignore[arg-type]


def test_cursor_close_and_context_manager() -> None:
    """close() is idempotent; afterwards extend/draft/len raise TreeClosedError."""
    with Cursor(DEPTH, prompt=P) as cur:
        assert repr(cur) == "<Cursor max_depth=8 len=6>"
    assert cur.closed
    cur.close()
    for call in (lambda: cur.extend([1]), lambda: cur.draft(), lambda: len(cur), cur.local_stats):
        with pytest.raises(TreeClosedError):
            call()
    assert repr(cur) == "<Cursor max_depth=8 closed>"


def test_cursor_depth_validation() -> None:
    """Cursor depth follows the tree rules: 2..1024."""
    assert Cursor().max_depth == 64
    with pytest.raises(InvalidArgumentError):
        Cursor(1)
    with pytest.raises(TypeError):
        Cursor(8.0)  # type: ignore[arg-type]


# --- integral argument types -------------------------------------------------------

INTEGRAL = (np.int32, np.int64, np.uint16, np.uint32, np.int16)


@pytest.mark.parametrize("kind", INTEGRAL, ids=lambda k: k.__name__)
def test_params_accept_numpy_integers(kind: type) -> None:
    """Integer fields accept numpy integers, stored as plain ints (same params, same hash)."""
    p = DraftParams(max_spec_tokens=kind(4), max_pattern=kind(6), min_pattern=kind(2))
    plain = DraftParams(max_spec_tokens=4, max_pattern=6, min_pattern=2)
    assert p == plain
    assert hash(p) == hash(plain)
    assert all(type(v) is int for v in (p.max_spec_tokens, p.max_pattern, p.min_pattern))
    cur = Cursor(DEPTH, prompt=P)
    assert cur.draft(None, p) == cur.draft(None, plain)
    assert cur.draft(None, max_spec_tokens=kind(1)).token_ids == [3]


@pytest.mark.parametrize("field", ["max_spec_tokens", "max_pattern", "min_pattern"])
@pytest.mark.parametrize("value", [True, False, np.True_, 2.0, "2"], ids=repr)
def test_params_integer_fields_refuse_bool_and_non_integers(field: str, value: object) -> None:
    """bool (an int subclass) and non-integers raise TypeError naming the field."""
    name = "bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__
    with pytest.raises(TypeError, match=f"^{field} must be an int, not {name}$"):
        DraftParams(**{field: value})  # type: ignore[arg-type]


def test_params_numpy_integer_bounds() -> None:
    """numpy integers are range-checked like ints."""
    with pytest.raises(InvalidArgumentError, match="max_spec_tokens"):
        DraftParams(max_spec_tokens=np.int32(0))
    with pytest.raises(InvalidArgumentError, match="max_spec_tokens"):
        DraftParams(max_spec_tokens=np.uint16(1025))
    with pytest.raises(InvalidArgumentError, match="min_pattern"):
        DraftParams(min_pattern=np.int64(-1))


@pytest.mark.parametrize("kind", INTEGRAL, ids=lambda k: k.__name__)
def test_cursor_accepts_numpy_integers(kind: type) -> None:
    """Cursor depth and token lists of numpy integers work; int32 arrays too."""
    cur = Cursor(kind(DEPTH), prompt=[kind(t) for t in P[:4]])
    assert cur.max_depth == DEPTH
    assert type(cur.max_depth) is int
    cur.extend([kind(t) for t in P[4:5]])
    cur.extend(np.array(P[5:], dtype=np.int32))
    assert len(cur) == len(P)
    assert cur.draft(None, alpha=4.0).token_ids == [3, 9, 1, 2]


@pytest.mark.parametrize("value", [True, np.True_, 8.0])
def test_cursor_depth_refuses_bool_and_floats(value: object) -> None:
    name = "bool" if isinstance(value, (bool, np.bool_)) else "float"
    with pytest.raises(TypeError, match=f"^max_depth must be an int, not {name}$"):
        Cursor(value)  # type: ignore[arg-type]
