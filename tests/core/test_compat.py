"""agentspec.compat: arctic-inference's SuffixDecodingCache API, with its defects fixed.

Hand-checked examples use depth 8 and the text [1, 2, 3, 9, 1, 2]: after it,
the request's own tree drafts [3, 9] at probability 1.0 each (arctic counts
the context's own occurrence and reports 0.5).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

from agentspec import Draft, SuffixTree
from agentspec.compat import SuffixDecodingCache, SuffixDecodingDraft
from agentspec.exceptions import InvalidTokenError

DEPTH = 8
P = [1, 2, 3, 9, 1, 2]

# arctic_inference.suffix_decoding.SuffixDecodingCache 0.3.0, as documented in
# ../shared/notes/arctic-reference.md section 2.1: (name, default) per parameter.
_EMPTY = inspect.Parameter.empty
ARCTIC_METHODS: dict[str, list[tuple[str, object]]] = {
    "__init__": [("max_tree_depth", 64), ("max_cached_requests", -1)],
    "start_request": [("req_id", _EMPTY), ("prompt_token_ids", _EMPTY)],
    "stop_request": [("req_id", _EMPTY)],
    "add_active_response": [("req_id", _EMPTY), ("token_ids", _EMPTY)],
    "evict_cached_response": [("req_id", _EMPTY)],
    "speculate": [
        ("req_id", _EMPTY),
        ("context", _EMPTY),
        ("max_spec_tokens", None),
        ("max_spec_factor", 1.0),
        ("max_spec_offset", 0.0),
        ("min_token_prob", 0.1),
        ("use_tree_spec", False),
    ],
}
ARCTIC_PROPERTIES = ["active_requests", "cached_requests", "max_tree_depth", "max_cached_requests"]


def finished(
    cache: SuffixDecodingCache, req_id: object, prompt: list[int], response: list[int]
) -> None:
    """Run a whole request through the cache: start, respond, stop."""
    cache.start_request(req_id, prompt)
    cache.add_active_response(req_id, response)
    cache.stop_request(req_id)


# --- API parity -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ARCTIC_METHODS))
def test_method_signatures_match_arctic(name: str) -> None:
    """Every arctic method exists with the same positional parameters and defaults."""
    params = list(inspect.signature(getattr(SuffixDecodingCache, name)).parameters.values())[1:]
    positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == ARCTIC_METHODS[name]
    extras = [p for p in params if p.kind is not p.POSITIONAL_OR_KEYWORD]
    assert all(p.kind is p.KEYWORD_ONLY and p.default is None for p in extras)


def test_properties_match_arctic() -> None:
    """arctic's four properties exist and report the constructor's values."""
    cache = SuffixDecodingCache(12, 5)
    for name in ARCTIC_PROPERTIES:
        assert isinstance(inspect.getattr_static(SuffixDecodingCache, name), property)
    assert (cache.max_tree_depth, cache.max_cached_requests) == (12, 5)
    assert list(cache.active_requests) == list(cache.cached_requests) == []


def test_draft_record_matches_arctic() -> None:
    """SuffixDecodingDraft has arctic's fields, defaults and from_native()."""
    empty = SuffixDecodingDraft()
    assert (empty.token_ids, empty.parents, empty.probs, empty.score, empty.match_len) == (
        [],
        [],
        [],
        0.0,
        0,
    )
    native = Draft([4, 5], [-1, 0], [1.0, 0.5], 1.5, 2, "local")
    assert SuffixDecodingDraft.from_native(native) == SuffixDecodingDraft(
        [4, 5], [-1, 0], [1.0, 0.5], 1.5, 2
    )


# --- speculate ----------------------------------------------------------------------


def test_speculate_from_own_context_is_not_deflated() -> None:
    """The request's own text drafts [3, 9] at 1.0 each (arctic: 0.5)."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("a", P)
    d = cache.speculate("a", P)
    assert d == SuffixDecodingDraft([3, 9], [-1, 0], [1.0, 1.0], 2.0, 2)


def test_default_max_spec_tokens_works() -> None:
    """max_spec_tokens=None drafts (arctic raises AttributeError) and equals max_tree_depth."""
    cache = SuffixDecodingCache(DEPTH)
    ctx = [10, 11, 12, 13, 14, 15, 16, 17, 18, 10]
    cache.start_request("a", ctx)
    d = cache.speculate("a", ctx, max_spec_factor=100.0)
    # The match [10] may grow to depth 8: seven tokens, each at probability 1.
    assert d.token_ids == [11, 12, 13, 14, 15, 16, 17]
    assert d == cache.speculate("a", ctx, max_spec_tokens=DEPTH, max_spec_factor=100.0)


def test_non_positive_max_spec_tokens_gives_empty_draft() -> None:
    """vLLM may pass 0 or a negative budget near max_model_len: the draft is empty."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("a", P)
    assert cache.speculate("a", P, max_spec_tokens=0) == SuffixDecodingDraft()
    assert cache.speculate("a", P, max_spec_tokens=-3) == SuffixDecodingDraft()
    assert cache.speculate("a", P, max_spec_tokens=1).token_ids == [3]


def test_context_of_length_one_drafts() -> None:
    """A one-token context drafts from the global tree (arctic never matches it)."""
    cache = SuffixDecodingCache(DEPTH)
    finished(cache, "old", [0], [4, 5])
    cache.start_request("new", [4])
    assert cache.speculate("new", [4]) == SuffixDecodingDraft([5], [-1], [1.0], 1.0, 1)


def test_foreign_context_is_drafted_as_given() -> None:
    """A context that is not the request's tail is matched as given: [5, 3] drafts 9."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("a", P)
    assert cache.speculate("a", [5, 3]).token_ids == [9]
    assert cache.speculate("a", [7, 1, 2]).token_ids == [3, 9]


def test_context_forms_agree() -> None:
    """list, tuple, int32 numpy and a short tail all give the same draft here."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("a", [7, 7, *P])
    expected = SuffixDecodingDraft([3, 9], [-1, 0], [1.0, 1.0], 2.0, 2)
    ctx = [7, 7, *P]
    for form in (ctx, tuple(ctx), np.array(ctx, dtype=np.int32), ctx[-3:], iter(ctx)):
        assert cache.speculate("a", form) == expected
    with pytest.raises(TypeError):
        cache.speculate("a", np.array(ctx, dtype=np.int64))


def test_tree_spec_branches() -> None:
    """use_tree_spec drafts the 7/9 branch of a cached response."""
    cache = SuffixDecodingCache(DEPTH)
    finished(cache, "old", [0], [1, 2, 3, 9, 1, 2, 3, 7])
    cache.start_request("new", [5, 1, 2])
    d = cache.speculate("new", [5, 1, 2], use_tree_spec=True, max_spec_offset=10.0)
    assert d.token_ids == [3, 7, 9, 1, 2, 3, 7]
    assert d.parents == [-1, 0, 0, 2, 3, 4, 5]
    assert d.score == 4.0


def test_min_token_prob_is_applied() -> None:
    """min_token_prob=0.6 drops the 0.5 branch of the cached response."""
    cache = SuffixDecodingCache(DEPTH)
    finished(cache, "old", [0], [1, 2, 3, 9, 1, 2, 3, 7])
    cache.start_request("new", [5, 1, 2])
    assert cache.speculate("new", [5, 1, 2]).token_ids == [3, 7]
    assert cache.speculate("new", [5, 1, 2], min_token_prob=0.6).token_ids == [3]


# --- request lifecycle ------------------------------------------------------------------


def test_in_flight_response_is_visible_to_others() -> None:
    """Tokens added to an active request can be drafted by another request at once."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("a", [0])
    cache.add_active_response("a", [1, 2, 3, 4])
    cache.start_request("b", [1, 2])
    assert cache.speculate("b", [1, 2]) == SuffixDecodingDraft([3, 4], [-1, 0], [1.0, 1.0], 2.0, 2)
    assert cache.global_tree.stats().open_sequences == 1


def test_incremental_responses_extend_the_context() -> None:
    """Each add_active_response moves the request's match; the draft follows it."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("a", P)
    cache.add_active_response("a", [3])
    ctx = [*P, 3]
    d = cache.speculate("a", ctx)
    assert (d.token_ids, d.match_len) == ([9, 1, 2], 3)
    cache.add_active_response("a", np.array([9], dtype=np.int32))
    d = cache.speculate("a", [*ctx, 9])
    assert (d.token_ids, d.match_len) == ([1, 2, 3, 9], 4)


def test_stop_request_keeps_the_response_cached() -> None:
    """stop_request() ends the request; its response stays in the (closed) global tree."""
    cache = SuffixDecodingCache(DEPTH)
    finished(cache, "a", [0], [1, 2, 3])
    assert list(cache.active_requests) == []
    assert list(cache.cached_requests) == ["a"]
    stats = cache.global_tree.stats()
    assert (stats.sequences, stats.open_sequences, stats.tokens) == (1, 0, 3)


def test_prompts_are_not_cached_globally() -> None:
    """Only responses enter the global tree, as in arctic."""
    cache = SuffixDecodingCache(DEPTH)
    finished(cache, "a", [7, 8, 9], [1, 2])
    assert cache.global_tree.count([8, 9]) == 0
    assert cache.global_tree.count([1, 2]) == 1


def test_fifo_eviction_by_request_count() -> None:
    """With max_cached_requests=2 the third request evicts the first one's response."""
    cache = SuffixDecodingCache(DEPTH, max_cached_requests=2)
    finished(cache, "a", [0], [1, 1, 1])
    finished(cache, "b", [0], [2, 2])
    finished(cache, "c", [0], [3])
    assert list(cache.cached_requests) == ["b", "c"]
    assert cache.global_tree.count([1]) == 0
    assert cache.global_tree.count([2, 2]) == 1


def test_zero_cached_requests_disables_the_global_tree() -> None:
    """max_cached_requests=0: nothing is cached and only the request's own text drafts."""
    cache = SuffixDecodingCache(DEPTH, max_cached_requests=0)
    finished(cache, "a", [0], [1, 2, 3, 4])
    cache.start_request("b", [1, 2])
    assert list(cache.cached_requests) == []
    assert cache.speculate("b", [1, 2]) == SuffixDecodingDraft()
    assert len(cache.global_tree) == 0


def test_reused_request_id_replaces_its_cached_response() -> None:
    """Starting a finished request id again evicts its old response."""
    cache = SuffixDecodingCache(DEPTH)
    finished(cache, "a", [0], [1, 2, 3])
    cache.start_request("a", [0])
    assert cache.global_tree.count([1, 2, 3]) == 0
    assert list(cache.cached_requests) == ["a"]
    cache.add_active_response("a", [4, 5])
    assert cache.global_tree.count([4, 5]) == 1


def test_evict_cached_response() -> None:
    """evict_cached_response() removes a response; an active request then stops feeding it."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("a", [0])
    cache.add_active_response("a", [1, 2])
    cache.evict_cached_response("a")
    assert list(cache.cached_requests) == []
    cache.add_active_response("a", [3])
    assert len(cache.global_tree) == 0
    assert list(cache.active_requests) == ["a"]
    with pytest.raises(ValueError, match="no cached response"):
        cache.evict_cached_response("a")


def test_hashable_request_ids() -> None:
    """Request ids may be any hashable: strings, ints, tuples."""
    cache = SuffixDecodingCache(DEPTH)
    for rid in ("x", 7, ("batch", 3)):
        finished(cache, rid, [0], [rid.__hash__() % 5 + 1])
    assert list(cache.cached_requests) == ["x", 7, ("batch", 3)]
    with pytest.raises(TypeError):
        cache.start_request(["unhashable"], [1])  # type: ignore[arg-type]


# --- errors and atomicity -----------------------------------------------------------------


def test_failed_start_request_registers_nothing() -> None:
    """A bad prompt (list or int32 array) leaves no active, cached or evicted state behind."""
    cache = SuffixDecodingCache(DEPTH)
    finished(cache, "a", [0], [1, 2, 3])
    for bad in ([1, -1], np.array([4, -4], dtype=np.int32)):
        with pytest.raises(InvalidTokenError):
            cache.start_request("a", bad)
        with pytest.raises(InvalidTokenError):
            cache.start_request("b", bad)
    assert list(cache.active_requests) == []
    assert list(cache.cached_requests) == ["a"]
    assert cache.global_tree.count([1, 2, 3]) == 1


def test_double_start_and_unknown_requests() -> None:
    """Active ids cannot start twice; unknown ids raise ValueError everywhere."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("a", [1])
    with pytest.raises(ValueError, match="already active"):
        cache.start_request("a", [1])
    for call in (
        lambda: cache.stop_request("zz"),
        lambda: cache.add_active_response("zz", [1]),
        lambda: cache.speculate("zz", [1]),
    ):
        with pytest.raises(ValueError, match="not active"):
            call()


def test_bad_response_tokens_change_nothing() -> None:
    """A rejected add_active_response leaves both trees as they were."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("a", P)
    cache.add_active_response("a", [5])
    bad_inputs: list[Any] = [[6, 2**31], np.array([6, -1], dtype=np.int32), [6, 1.5]]
    for bad in bad_inputs:
        with pytest.raises((InvalidTokenError, TypeError)):
            cache.add_active_response("a", bad)
    assert cache.global_tree.sequence(0) == [5]
    assert cache.speculate("a", [*P, 5]) == cache.speculate("a", [9, 1, 2, 5])


def test_constructor_validation() -> None:
    """Bad depths, request limits and budgets raise ValueError or TypeError."""
    for args, kwargs in (
        ((1,), {}),
        ((8, -2), {}),
        ((8, 2**31), {}),
        ((8,), {"max_cached_tokens": -1}),
        ((8,), {"max_cached_bytes": -5}),
    ):
        with pytest.raises(ValueError, match="must be"):
            SuffixDecodingCache(*args, **kwargs)
    with pytest.raises(TypeError):
        SuffixDecodingCache(8, 2.0)  # type: ignore[arg-type]
    assert SuffixDecodingCache(8, 2**31 - 1).max_cached_requests == 2**31 - 1


# --- budgets ---------------------------------------------------------------------------------


def test_token_budget_evicts_oldest_first() -> None:
    """max_cached_tokens=5: growing b past 5 tokens evicts a; b alone may exceed it."""
    cache = SuffixDecodingCache(DEPTH, max_cached_tokens=5)
    finished(cache, "a", [0], [1, 2, 3, 4])
    cache.start_request("b", [0])
    cache.add_active_response("b", [5])
    assert list(cache.cached_requests) == ["a", "b"]  # 5 tokens: within budget
    cache.add_active_response("b", [6])
    assert list(cache.cached_requests) == ["b"]
    assert cache.global_tree.stats().tokens == 2
    cache.add_active_response("b", [7, 8, 9, 10, 11])
    assert list(cache.cached_requests) == ["b"]  # never evicts the request being added
    assert cache.global_tree.stats().tokens == 7
    assert cache.max_cached_tokens == 5


def _run_two(cache: SuffixDecodingCache) -> int:
    """Cache response a, then stream response b; return the global bytes at b's last append."""
    finished(cache, "a", [0], [1, 2, 3, 4])
    cache.start_request("b", [0])
    cache.add_active_response("b", [5, 6, 7])
    return cache.global_tree.stats().bytes


def test_byte_budget_evicts_when_exceeded() -> None:
    """A byte budget one below the two-response size evicts a; exactly that size keeps both."""
    both = _run_two(SuffixDecodingCache(DEPTH))
    tight = SuffixDecodingCache(DEPTH, max_cached_bytes=both - 1)
    _run_two(tight)
    assert list(tight.cached_requests) == ["b"]
    assert tight.global_tree.count([1, 2]) == 0
    assert tight.global_tree.stats().bytes <= both - 1
    exact = SuffixDecodingCache(DEPTH, max_cached_bytes=both)
    _run_two(exact)
    assert list(exact.cached_requests) == ["a", "b"]
    assert exact.max_cached_bytes == both


def test_repr_and_global_tree_type() -> None:
    """repr() summarises the cache; global_tree is a SuffixTree of the cache's depth."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("a", [1])
    assert repr(cache) == "<SuffixDecodingCache max_tree_depth=8 active=1 cached=1>"
    assert isinstance(cache.global_tree, SuffixTree)
    assert cache.global_tree.max_depth == DEPTH


def test_staged_requests_use_stage_shards() -> None:
    """start_request(stage=...) drafts from that stage's shard, learned on stop."""
    from agentspec.compat import SuffixDecodingCache

    cache = SuffixDecodingCache(16)
    # long enough (> 256 tokens) for the stage shards to be warm
    cache.start_request("a", [1, 2], stage="SQL")
    cache.add_active_response("a", [5, 6, 7, 8, *range(1000, 1300)])
    cache.stop_request("a")
    cache.start_request("b", [1, 2], stage="Extract")
    cache.add_active_response("b", [5, 6, 9, 9, *range(2000, 2300)])
    cache.stop_request("b")
    assert "a" not in cache.cached_requests
    cache.start_request("q", [0, 5, 6], stage="SQL")
    draft = cache.speculate("q", [0, 5, 6], max_spec_tokens=8, max_spec_factor=4.0)
    assert draft.token_ids[:2] == [7, 8]
    cache.start_request("r", [0, 5, 6], stage="Extract")
    draft = cache.speculate("r", [0, 5, 6], max_spec_tokens=8, max_spec_factor=4.0)
    assert draft.token_ids[:2] == [9, 9]
    assert set(cache.active_requests) == {"q", "r"}


# numpy integer scalars (np.int32 above all: vLLM's input batch holds int32
# arrays, and its proposer computes max_spec_tokens from them).
INTEGRAL = (np.int32, np.int64, np.uint16, np.uint32, np.int16)


@pytest.mark.parametrize("kind", INTEGRAL, ids=lambda k: k.__name__)
def test_integer_arguments_accept_numpy_integers(kind: type) -> None:
    """Every integer argument accepts numpy integers, stored as plain ints."""
    cache = SuffixDecodingCache(
        kind(DEPTH), kind(4), max_cached_tokens=kind(1000), max_cached_bytes=kind(30000)
    )
    assert cache.max_tree_depth == DEPTH
    assert type(cache.max_tree_depth) is int
    assert cache.max_cached_requests == 4
    assert type(cache.max_cached_requests) is int
    assert type(cache.max_cached_tokens) is int
    assert type(cache.max_cached_bytes) is int
    cache.start_request("r", np.array(P, dtype=np.int32))
    context = np.array(P, dtype=np.int32)
    num_tokens = np.array([len(P)], dtype=np.int32)[0]
    # vLLM: min(num_speculative_tokens, max_model_len - num_tokens - 1)
    spec = min(24, kind(10) - num_tokens - 1) if kind is not np.uint16 else kind(3)
    draft = cache.speculate("r", context, max_spec_tokens=spec, max_spec_factor=4.0)
    assert draft.token_ids == [3, 9, 1]
    assert cache.speculate("r", context, max_spec_tokens=kind(1)).token_ids == [3]
    assert cache.speculate("r", context, max_spec_tokens=kind(0)) == SuffixDecodingDraft()


@pytest.mark.parametrize("value", [True, False, np.True_])
def test_integer_arguments_refuse_bool(value: object) -> None:
    """bool is an int subclass but never a count: TypeError naming the argument."""
    with pytest.raises(TypeError, match="max_tree_depth must be an int, not bool"):
        SuffixDecodingCache(value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_cached_requests must be an int, not bool"):
        SuffixDecodingCache(DEPTH, value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_cached_tokens must be an int or None, not bool"):
        SuffixDecodingCache(DEPTH, max_cached_tokens=value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_cached_bytes must be an int or None, not bool"):
        SuffixDecodingCache(DEPTH, max_cached_bytes=value)  # type: ignore[arg-type]
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("r", P)
    with pytest.raises(TypeError, match="max_spec_tokens must be an int or None, not bool"):
        cache.speculate("r", P, max_spec_tokens=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [4.0, np.float32(4), "4"])
def test_integer_arguments_refuse_non_integers(value: object) -> None:
    """Floats (even integral ones) and strings raise TypeError naming the argument."""
    name = type(value).__name__
    with pytest.raises(TypeError, match=f"max_tree_depth must be an int, not {name}"):
        SuffixDecodingCache(value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=f"max_cached_requests must be an int, not {name}"):
        SuffixDecodingCache(DEPTH, value)  # type: ignore[arg-type]
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("r", P)
    with pytest.raises(TypeError, match=f"max_spec_tokens must be an int or None, not {name}"):
        cache.speculate("r", P, max_spec_tokens=value)  # type: ignore[arg-type]


def test_numpy_integer_bounds_are_checked() -> None:
    """Range checks are those of plain ints."""
    with pytest.raises(ValueError, match="max_tree_depth"):
        SuffixDecodingCache(np.int32(1))
    with pytest.raises(ValueError, match="max_cached_requests"):
        SuffixDecodingCache(DEPTH, np.int64(-2))
    with pytest.raises(ValueError, match="max_cached_tokens"):
        SuffixDecodingCache(DEPTH, max_cached_tokens=np.int32(-1))
    assert SuffixDecodingCache(DEPTH, np.int32(-1)).max_cached_requests == -1


def test_token_ids_accept_numpy_integer_lists() -> None:
    """Lists of numpy integers work wherever token ids are taken (int32 arrays too)."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("r", [np.int64(t) for t in P[:3]])
    cache.add_active_response("r", [np.uint16(t) for t in P[3:]])
    cache.add_active_response("r", np.array([], dtype=np.int32))
    draft = cache.speculate("r", [np.int32(t) for t in P], max_spec_tokens=np.int32(2))
    assert draft.token_ids == [3, 9]


def test_float_arguments_accept_numpy_reals_and_name_the_argument() -> None:
    """max_spec_factor / max_spec_offset / min_token_prob: numpy reals work (as in
    arctic); bad values raise errors naming speculate's argument, not a DraftParams field."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("r", P)
    plain = cache.speculate("r", P, 4, 2.0, 0.0, 0.1)
    assert cache.speculate("r", P, 4, np.float32(2.0), np.float64(0.0), np.float32(0.1)) == plain
    assert cache.speculate("r", P, np.int64(4), np.int32(2), 0, 0.1) == plain
    for name, value, error, message in [
        ("max_spec_factor", -1.0, ValueError, "max_spec_factor must be >= 0"),
        ("max_spec_factor", float("nan"), ValueError, "max_spec_factor must be finite"),
        ("max_spec_offset", float("inf"), ValueError, "max_spec_offset must be finite"),
        ("min_token_prob", 1.5, ValueError, r"min_token_prob must be in \[0, 1\]"),
        ("max_spec_factor", True, TypeError, "max_spec_factor must be a real number, not bool"),
        ("max_spec_offset", "1", TypeError, "max_spec_offset must be a real number, not str"),
        ("min_token_prob", None, TypeError, "min_token_prob must be a real number, not NoneType"),
    ]:
        with pytest.raises(error, match=f"^{message}"):
            cache.speculate("r", P, 4, **{name: value})


# --- per-step fast paths (arguments seen before, numpy contexts, chain parents) ----


def test_fast_paths_keep_every_argument_check() -> None:
    """A call that reuses the last call's argument objects, or equal values of
    the exact builtin types, drafts as a fresh cache would; values that compare
    equal across types (1, 1.0, True) are still checked as their own type."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("r", P)
    k, factor = 2, 4.0
    first = cache.speculate("r", P, k, factor)
    assert cache.speculate("r", P, k, factor) == first  # the same objects
    assert cache.speculate("r", P, int("2"), float("4")) == first  # equal values
    with pytest.raises(TypeError, match="max_spec_tokens must be an int or None, not bool"):
        cache.speculate("r", P, True, factor)
    cache.speculate("r", P, 1, 1.0)
    with pytest.raises(TypeError, match="max_spec_tokens must be an int or None, not float"):
        cache.speculate("r", P, 1.0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_spec_factor must be a real number, not bool"):
        cache.speculate("r", P, 1, True)
    assert cache.speculate("r", P, 0, factor) == SuffixDecodingDraft()
    assert cache.speculate("r", P, k, factor) == first


def test_mutable_argument_is_checked_again() -> None:
    """A 0-d numpy array is a valid integer argument, but mutable: changing it
    in place between calls is seen (nothing is reused by identity)."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("r", P)
    spec = np.array(2, dtype=np.int64)
    assert cache.speculate("r", P, spec, 4.0).token_ids == [3, 9]
    spec[()] = 1
    assert cache.speculate("r", P, spec, 4.0).token_ids == [3]
    spec[()] = 0
    assert cache.speculate("r", P, spec, 4.0) == SuffixDecodingDraft()


def test_numpy_context_views() -> None:
    """Slices of a larger int32 array (what vLLM passes) draft like lists; a
    strided view, a 2-D array and a non-native byte order raise TypeError."""
    cache = SuffixDecodingCache(DEPTH)
    cache.start_request("r", P)
    batch = np.zeros((3, 16), dtype=np.int32)
    batch[1, 4 : 4 + len(P)] = P
    view = batch[1, 4 : 4 + len(P)]
    assert cache.speculate("r", view) == cache.speculate("r", P)
    wide = np.repeat(np.array(P, dtype=np.int32), 2)
    for bad, message in [
        (wide[::2], "C-contiguous"),
        (np.array([P], dtype=np.int32), "1-D"),
        (np.array(P, dtype=">i4"), "dtype int32"),
    ]:
        with pytest.raises(TypeError, match=message):
            cache.speculate("r", bad)


@pytest.mark.parametrize("tree", [False, True])
def test_parents_describe_the_draft(tree: bool) -> None:
    """Chain drafts have parents [-1, 0, 1, ...]; tree drafts report the tree's."""
    cache = SuffixDecodingCache(DEPTH)
    finished(cache, "old", [0], [1, 2, 3, 9, 1, 2, 3, 7])
    cache.start_request("new", [5, 1, 2])
    d = cache.speculate("new", [5, 1, 2], use_tree_spec=tree, max_spec_offset=10.0)
    if tree:
        assert d.parents == [-1, 0, 0, 2, 3, 4, 5]
    else:
        assert d.parents == list(range(-1, len(d.token_ids) - 1))
        assert len(d.token_ids) >= 2


def test_tail_and_foreign_contexts_agree_across_the_ring() -> None:
    """The incremental path (context = the request's own tail, its ring buffer
    wrapped many times) drafts what a from-scratch match of the same patterns
    drafts; a context that differs from the tail in one token is matched from
    scratch, never mistaken for the tail."""
    rng = np.random.default_rng(7)
    depth = 8
    cache = SuffixDecodingCache(depth)
    for r in range(4):  # cached responses with repeats to draft from
        finished(cache, r, [0], rng.integers(1, 6, 60).tolist())
    history = rng.integers(1, 6, 5).tolist()
    cache.start_request("x", history)
    for _ in range(80):
        new = rng.integers(1, 6, int(rng.integers(1, 4))).tolist()
        cache.add_active_response("x", new)
        history += new
        tail = np.array(history[-depth:], dtype=np.int32)
        scratch = [0, *history]  # longer than the request's text: not its tail
        assert cache.speculate("x", tail, 6, 2.0) == cache.speculate("x", scratch, 6, 2.0)
        i = int(rng.integers(1, depth))
        changed = history[:]
        changed[-i] = 6 + changed[-i]  # a token the request never had
        assert cache.speculate("x", changed[-depth:], 6, 2.0) == cache.speculate(
            "x", [0, *changed], 6, 2.0
        )
