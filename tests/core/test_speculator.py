"""Stage shards: `agentspec.Speculator`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec import DraftParams, Speculator, SuffixTree
from agentspec.exceptions import InvalidArgumentError, TreeClosedError

SQL = [11, 12, 13, 14, 15, 16]
JSON = [21, 22, 23, 24, 25, 26]
PARAMS = DraftParams(max_spec_tokens=8, alpha=4.0)


def run(spec: Speculator, rid: object, prompt: list[int], response: list[int], stage: str) -> None:
    """One request: start, emit the response token by token, finish (learning it)."""
    spec.start_request(rid, prompt, stage=stage, pipeline="p")
    spec.extend(rid, response)
    spec.finish(rid)


def test_responses_learn_into_stage_and_pipeline_trees() -> None:
    """A finished response joins its stage shard and its pipeline tree."""
    with Speculator(16, cold_tokens=0) as spec:
        run(spec, "a", [1, 2], SQL, "SQL")
        run(spec, "b", [1, 2], JSON, "Extract")
        sql, ext = spec.shard("SQL", "p"), spec.shard("Extract", "p")
        pipe = spec.pipeline_tree("p")
        assert sql is not None
        assert ext is not None
        assert pipe is not None
        assert sql.count(SQL[:3]) == 1
        assert sql.count(JSON[:3]) == 0
        assert ext.count(JSON[:3]) == 1
        assert ext.count(SQL[:3]) == 0
        assert pipe.count(SQL[:3]) == 1
        assert pipe.count(JSON[:3]) == 1
        assert set(spec.shards()) == {("p", "SQL"), ("p", "Extract")}
        assert spec.active_requests == frozenset()


def test_stage_shard_wins_ties_over_pipeline_tree() -> None:
    """With equal evidence the stage's own shard drafts; other stages are unaffected."""
    with Speculator(16, local_tree=False, cold_tokens=0, params=PARAMS) as spec:
        run(spec, "a", [0], [1, 2, 3, 4], "SQL")
        run(spec, "b", [0], [1, 2, 7, 8], "Extract")
        spec.start_request("q", [9, 1, 2], stage="SQL", pipeline="p")
        draft, role = spec.draft_source("q")
        assert draft.token_ids[0] == 3
        assert role == "stage"
        assert draft.probs[0] == pytest.approx(1.0)
        spec.finish("q", learn=False)
        spec.start_request("r", [9, 1, 2], stage="Extract", pipeline="p")
        draft, role = spec.draft_source("r")
        assert draft.token_ids[:2] == [7, 8]
        assert role == "stage"
        spec.finish("r", learn=False)


def test_cold_stage_falls_back_to_pipeline_tree() -> None:
    """A stage shard below cold_tokens is skipped while the pipeline tree serves."""
    with Speculator(16, local_tree=False, cold_tokens=100, params=PARAMS) as spec:
        run(spec, "a", [0], [1, 2, 3, 4], "SQL")
        run(spec, "b", [0], [1, 2, 3, 5], "Extract")
        spec.start_request("q", [1, 2], stage="SQL", pipeline="p")
        draft, role = spec.draft_source("q")
        assert role == "pipeline"
        assert draft.token_ids[0] == 3


def test_single_stage_pipeline_keeps_one_tree() -> None:
    """One stage: no duplicate pipeline tree; a new stage falls back to the old stage's shard."""
    with Speculator(16, local_tree=False, cold_tokens=100, params=PARAMS) as spec:
        run(spec, "a", [0], [1, 2, 3, 4], "SQL")
        assert spec.pipeline_tree("p") is None
        spec.start_request("q", [1, 2], stage="SQL", pipeline="p")
        draft, role = spec.draft_source("q")
        assert role == "stage"  # cold, but nothing else to fall back to
        assert draft.token_ids[0] == 3
        spec.start_request("r", [1, 2], stage="Extract", pipeline="p")
        draft, role = spec.draft_source("r")
        assert role == "pipeline"  # the only shard of the pipeline serves the new stage
        assert draft.token_ids[0] == 3
        spec.extend("r", [3, 5])
        spec.finish("r")
        pipe = spec.pipeline_tree("p")
        assert pipe is not None  # made on the second stage, holding both stages
        assert len(pipe) == 2
        assert pipe.count([3]) == 2


def test_one_tree_for_all_stages() -> None:
    """stage_shards=False keeps a single tree per pipeline."""
    with Speculator(16, stage_shards=False, local_tree=False, params=PARAMS) as spec:
        run(spec, "a", [0], [1, 2, 3, 4], "SQL")
        assert spec.shard("SQL", "p") is None
        spec.start_request("q", [1, 2], stage="Other", pipeline="p")
        assert spec.draft("q").token_ids[:2] == [3, 4]


def test_finish_without_learning_and_errors() -> None:
    """learn=False leaves the shards alone; unknown or duplicate ids raise."""
    with Speculator(16) as spec:
        spec.start_request("a", [1, 2, 3], stage="S")
        with pytest.raises(InvalidArgumentError):
            spec.start_request("a", [1])
        spec.extend("a", [4, 5])
        spec.finish("a", learn=False)
        assert spec.shards() == {}
        with pytest.raises(InvalidArgumentError):
            spec.draft("a")
        with pytest.raises(InvalidArgumentError):
            spec.finish("a")


def test_token_budget_evicts_oldest() -> None:
    """max_shard_tokens evicts the oldest responses of each tree first."""
    with Speculator(16, max_shard_tokens=10) as spec:
        for i in range(5):
            spec.add_response([100 + i] * 4, stage="S")
        tree = spec.shard("S")
        assert tree is not None
        assert tree.stats().tokens <= 10
        assert tree.count([104]) == 4
        assert tree.count([100]) == 0


def test_per_request_tree_drafts_from_own_prompt() -> None:
    """Copy-heavy stages draft from their own prompt before any shard exists."""
    with Speculator(16, params=PARAMS) as spec:
        spec.start_request("a", [5, 6, 7, 8, 1, 5, 6])
        draft, role = spec.draft_source("a")
        assert role == "local"
        assert draft.token_ids[:2] == [7, 8]


def test_response_is_learned_behind_the_prompt_lead() -> None:
    """`finish` and `add_response(prompt=)` prepend the prompt's last `lead_tokens` tokens."""
    with Speculator(16, lead_tokens=3) as spec:
        run(spec, "a", [1, 2, 3, 4, 5], SQL, "SQL")
        spec.add_response(JSON, stage="SQL", pipeline="p", prompt=[9])
        spec.add_response(JSON, stage="SQL", pipeline="p")
        tree = spec.shard("SQL", "p")
        assert tree is not None
        assert [tree.sequence(i) for i in tree.sequence_ids()] == [
            [3, 4, 5, *SQL],
            [9, *JSON],
            JSON,
        ]
    with Speculator(16, lead_tokens=0) as spec:
        run(spec, "a", [1, 2, 3], SQL, "SQL")
        tree = spec.shard("SQL", "p")
        assert tree is not None
        assert tree.sequence(tree.sequence_ids()[0]) == SQL


def test_first_draft_comes_from_how_responses_start() -> None:
    """Before generating anything, a request drafts the opening its stage's responses share."""
    lead = [7, 8]  # e.g. "<|im_start|>assistant\n"
    for lead_tokens, expected in ((2, SQL[:4]), (0, [])):
        with Speculator(16, lead_tokens=lead_tokens, local_tree=False, params=PARAMS) as spec:
            for i in range(3):
                run(spec, i, [100 + i, *lead], SQL, "SQL")
            spec.start_request("new", [200, *lead], stage="SQL", pipeline="p")
            assert list(spec.draft("new").token_ids[:4]) == expected


def test_lead_tokens_is_checked() -> None:
    """`lead_tokens` must be in [0, max_depth]."""
    with pytest.raises(InvalidArgumentError, match="lead_tokens"):
        Speculator(16, lead_tokens=17)
    with pytest.raises(InvalidArgumentError, match="lead_tokens"):
        Speculator(16, lead_tokens=-1)


def test_extra_trees_are_drafted_from_after_own_shards() -> None:
    """`extra_trees` (e.g. pushed shards) join the draft; `draft_source` says "extra"."""
    from agentspec import SuffixTree
    from agentspec._core.speculator import MAX_EXTRA_TREES

    with (
        Speculator(16, lead_tokens=0, local_tree=False, params=PARAMS) as spec,
        SuffixTree(16) as pushed,
    ):
        pushed.add(1, SQL)
        spec.start_request("r", [5, *SQL[:2]], stage="SQL", pipeline="p")
        assert list(spec.draft("r").token_ids) == []  # nothing learned locally
        draft, source = spec.draft_source("r", extra_trees=[pushed])
        assert list(draft.token_ids) == SQL[2:]
        assert source == "extra"
        assert list(spec.draft("r", extra_trees=[pushed, pushed]).token_ids) == SQL[2:]
        with pytest.raises(InvalidArgumentError, match="extra trees"):
            spec.draft("r", extra_trees=[pushed] * (MAX_EXTRA_TREES + 1))
        with pytest.raises(TypeError, match="SuffixTree"):
            spec.draft("r", extra_trees=[object()])  # type: ignore[list-item]


def test_draft_batch_equals_draft_per_request() -> None:
    """`draft_batch_source` gives, per request, what `draft_source` gives, in one call."""
    import random

    from agentspec import SuffixTree

    rnd = random.Random(3)
    with Speculator(32, params=DraftParams(max_spec_tokens=8), cold_tokens=0, live=True) as spec:
        for i in range(30):
            response = [rnd.randrange(6) for _ in range(40)]
            spec.add_response(response, stage=f"s{i % 3}", pipeline="p", prompt=[1, 2, 3])
        pushed = SuffixTree(32)
        pushed.add(0, [rnd.randrange(6) for _ in range(200)])
        ids = list(range(12))
        for i in ids:
            prompt = [rnd.randrange(6) for _ in range(30)]
            spec.start_request(i, prompt, stage=f"s{i % 4}", pipeline="p" if i % 5 else None)
        sources = set()
        for _ in range(30):
            for i in ids:
                spec.extend(i, [rnd.randrange(6) for _ in range(rnd.randrange(3))])
            caps = [rnd.randrange(10) for _ in ids]
            extra = [[pushed] if i % 2 else [] for i in ids]
            got = spec.draft_batch_source(ids, caps=caps, extra_trees=extra)
            assert [d for d, _ in got] == spec.draft_batch(ids, caps=caps, extra_trees=extra)
            for i, (draft, source) in zip(ids, got, strict=True):
                sources.add(source)
                if caps[i] == 0:
                    assert draft.token_ids == []
                    continue
                params = DraftParams(max_spec_tokens=min(8, caps[i]))
                assert (draft, source) == spec.draft_source(i, params, extra_trees=extra[i])
        assert {"stage", "pipeline", "extra", "local"} <= sources
        pushed.close()


def test_draft_while_a_shard_is_written_raises_and_leaves_no_reader() -> None:
    """A shard busy in another writer makes `draft` raise, with every reader undone."""
    with Speculator(16, cold_tokens=0) as spec:
        run(spec, 1, [1, 2], SQL, "SQL")
        run(spec, 2, [1, 2], JSON, "JSON")
        spec.start_request("r", [5, *SQL[:2]], stage="SQL", pipeline="p")
        before = spec.draft("r", PARAMS)
        pipe = spec.pipeline_tree("p")
        stage = spec.shard("SQL", "p")
        assert pipe is not None
        assert stage is not None
        for busy in (stage, pipe):  # the first tree drafted from, then the second
            busy._write_begin()
            try:
                with pytest.raises(RuntimeError, match="concurrent modification"):
                    spec.draft("r", PARAMS)
            finally:
                busy._wlock.release()
            assert not stage._readers
            assert not pipe._readers
        assert spec.draft("r", PARAMS) == before


def test_draft_with_a_closed_extra_tree_raises_and_leaves_no_reader() -> None:
    """A closed tree among ``extra_trees`` raises TreeClosedError; the trees before it
    are left with no reader registered."""
    with Speculator(16, cold_tokens=0) as spec:
        run(spec, 1, [1, 2], SQL, "SQL")
        spec.start_request("r", [5, *SQL[:2]], stage="SQL", pipeline="p")
        before = spec.draft("r", PARAMS)
        closed = SuffixTree(16)
        closed.close()
        with pytest.raises(TreeClosedError):
            spec.draft("r", PARAMS, extra_trees=[closed])
        shards = list(spec.shards().values())
        assert shards
        for tree in shards:
            assert not tree._readers
        assert spec.draft("r", PARAMS) == before


def test_draft_batch_refuses_bad_requests() -> None:
    """Unknown or repeated ids and mismatched extra trees raise; an empty batch is empty."""
    with Speculator(16) as spec:
        spec.start_request("a", [1, 2, 3])
        assert spec.draft_batch([]) == []
        with pytest.raises(InvalidArgumentError, match="twice"):
            spec.draft_batch(["a", "a"])
        with pytest.raises(InvalidArgumentError, match="not active"):
            spec.draft_batch(["a", "b"])
        with pytest.raises(InvalidArgumentError, match="one entry per request"):
            spec.draft_batch(["a"], extra_trees=[[], []])
        with pytest.raises(InvalidArgumentError, match="one entry per item"):
            spec.draft_batch(["a"], caps=[1, 2])
        assert spec.draft_batch(["a"], caps=[0])[0].token_ids == []


# --- live learning --------------------------------------------------------------------


def _contents(spec: Speculator) -> dict[object, list[list[int]]]:
    """Every shard's closed sequences (oldest first) and open ones, by shard."""
    out: dict[object, list[list[int]]] = {}
    for name, shards in (("stage", spec._stages), ("pipeline", spec._pipelines)):
        for key, shard in shards.items():
            closed = [shard.tree.sequence(seq) for seq, *_ in shard.order]
            opened = sorted(shard.tree.sequence(seq) for seq in shard.live)
            assert shard.tokens == shard.tree.stats().tokens
            assert shard.tree.stats().open_sequences == len(shard.live)
            out[(name, key)] = [*closed, [-1], *opened]
    return out


def test_live_requests_draft_from_each_others_partial_outputs() -> None:
    """With live=True an unfinished response already serves its stage and pipeline."""
    with Speculator(16, live=True, local_tree=False, cold_tokens=0, params=PARAMS) as spec:
        assert spec.live
        run(spec, "old", [0], [40, 41], "Other")  # the pipeline has two stages
        spec.start_request("a", [0], stage="SQL", pipeline="p")
        spec.extend("a", SQL[:2])
        spec.extend("a", SQL[2:])  # "a" is still generating
        spec.start_request("b", [9, *SQL[:2]], stage="SQL", pipeline="p")
        draft, role = spec.draft_source("b")
        assert (draft.token_ids, role) == (SQL[2:], "stage")
        spec.start_request("c", [9, *SQL[:2]], stage="Other", pipeline="p")
        draft, role = spec.draft_source("c")
        assert (draft.token_ids, role) == (SQL[2:], "pipeline")
        tree = spec.shard("SQL", "p")
        assert tree is not None
        assert tree.stats().open_sequences == 1
        spec.finish("a")
        assert tree.stats().open_sequences == 0
        assert [tree.sequence(i) for i in tree.sequence_ids()] == [[0, *SQL]]
        spec.finish("b", learn=False)
        spec.finish("c", learn=False)


def test_live_learning_off_learns_only_at_finish() -> None:
    """The default (live=False) keeps in-flight responses out of the shards."""
    with Speculator(16, local_tree=False, cold_tokens=0, params=PARAMS) as spec:
        assert not spec.live
        run(spec, "old", [0], [1, 2], "SQL")
        spec.start_request("a", [0], stage="SQL", pipeline="p")
        spec.extend("a", SQL)
        spec.start_request("b", SQL[:2], stage="SQL", pipeline="p")
        assert spec.draft("b").token_ids == []
        spec.finish("a")
        assert spec.draft("b").token_ids == SQL[2:]


def test_live_finish_without_learning_removes_the_response() -> None:
    """learn=False takes the open sequence out of every shard again."""
    with Speculator(16, live=True, max_shard_tokens=100) as spec:
        run(spec, "old", [0], [1, 2], "Other")
        before = _contents(spec)
        spec.start_request("a", [1, 2, 3], stage="S", pipeline="p")
        spec.extend("a", [4, 5])
        spec.extend("a", [6])
        tree = spec.shard("S", "p")
        assert tree is not None
        assert tree.count([4, 5, 6]) == 1
        spec.finish("a", learn=False)
        assert _contents(spec) == before  # its stage shard and the pipeline tree are gone
        assert spec.shard("S", "p") is None
        assert spec.pipeline_tree("p") is None


def test_live_open_sequences_are_never_evicted() -> None:
    """The budget evicts closed responses only; a long open one survives intact."""
    with Speculator(16, live=True, lead_tokens=0, max_shard_tokens=6) as spec:
        run(spec, "old1", [0], [50, 51, 52], "S")
        run(spec, "old2", [0], [60, 61, 62], "S")
        spec.start_request("a", [0], stage="S", pipeline="p")
        spec.extend("a", [70, 71])
        spec.start_request("b", [0], stage="S", pipeline="p")
        spec.extend("b", list(range(80, 90)))
        tree = spec.shard("S", "p")
        assert tree is not None
        assert tree.stats().tokens == 18  # over budget while generating: nothing is evicted
        run(spec, "new", [0], [90], "S")  # a sequence joins: the closed ones go, oldest first
        assert [tree.count([t]) for t in (50, 60, 70, 80, 90)] == [0, 0, 1, 1, 1]
        spec.finish("a")  # closed after "new": "new" is the oldest closed one now
        assert [tree.count([t]) for t in (70, 80, 90)] == [1, 1, 0]
        spec.finish("b")
        assert [tree.sequence(i) for i in tree.sequence_ids()] == [list(range(80, 90))]


def test_live_open_sequence_moves_into_a_new_pipeline_tree() -> None:
    """A pipeline tree made while a request generates keeps its sequence open there."""
    with Speculator(16, live=True, lead_tokens=0, local_tree=False, cold_tokens=0) as spec:
        spec.start_request("a", [0], stage="SQL", pipeline="p")
        spec.extend("a", SQL[:3])
        assert spec.pipeline_tree("p") is None
        run(spec, "b", [0], JSON, "Extract")  # the second stage makes the pipeline tree
        pipe = spec.pipeline_tree("p")
        assert pipe is not None
        assert pipe.stats().open_sequences == 1
        spec.extend("a", SQL[3:])
        spec.finish("a")
        assert sorted(pipe.sequence(i) for i in pipe.sequence_ids()) == [SQL, JSON]
        assert pipe.stats().open_sequences == 0


def test_live_own_open_sequence_adds_no_evidence_at_the_match() -> None:
    """A request's own occurrence ends its context: it never dilutes a draft's probabilities."""
    with Speculator(16, live=True, lead_tokens=0, local_tree=False, cold_tokens=0) as spec:
        for i in range(3):
            run(spec, i, [0], [1, 2, 3, 4], "S")
        run(spec, "odd", [0], [1, 2, 9, 9], "S")
        spec.start_request("r", [0], stage="S", pipeline="p")
        spec.extend("r", [1, 2])  # the shard now also holds "1 2" with nothing after it
        draft = spec.draft("r", PARAMS)
        assert draft.token_ids[:2] == [3, 4]
        assert draft.probs[0] == pytest.approx(0.75)  # 3 of the 4 continuations, not 3 of 5


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["A", "B", "C"]),
            st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=4), max_size=4),
            st.booleans(),
            st.lists(st.integers(1, 6), max_size=4),
        ),
        max_size=12,
    ),
    st.sampled_from([None, 0, 8, 20]),
    st.sampled_from([0, 5]),
    st.sampled_from([0, 2]),
)
def test_live_sequential_requests_match_learning_at_finish(
    requests: list[tuple[str, list[list[int]], bool, list[int]]],
    budget: int | None,
    cold: int,
    lead: int,
) -> None:
    """One request at a time, live and finish-time learning leave the same shards.

    Each request's first draft (made before it generates) agrees too, and so
    do the trees every request drafts from (the cached list is never stale).
    """
    kwargs: dict[str, Any] = {"max_shard_tokens": budget, "cold_tokens": cold}
    kwargs.update(lead_tokens=lead, params=PARAMS)
    with Speculator(16, **kwargs) as late, Speculator(16, live=True, **kwargs) as live:
        for n, (stage, chunks, learn, prompt) in enumerate(requests):
            for spec in (late, live):
                spec.start_request(n, prompt, stage=stage, pipeline="p")
            assert live.draft(n) == late.draft(n)
            for chunk in chunks:
                for spec in (late, live):
                    spec.extend(n, chunk)
                req = live._requests[n]
                assert live._request_trees(req) == live._trees_for(req.key)
            for spec in (late, live):
                spec.finish(n, learn=learn)
            assert _contents(live) == _contents(late)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(["A", "B"]), st.integers(0, 3)),
        max_size=40,
    ),
    st.sampled_from([None, 10]),
)
def test_live_interleaved_requests_keep_shards_consistent(
    steps: list[tuple[int, str, int]], budget: int | None
) -> None:
    """Concurrent requests, started, extended and finished in any order.

    The shards' counters match their trees, every open sequence is exactly
    its request's lead + response, and cached draft trees are never stale.
    """
    with Speculator(16, live=True, max_shard_tokens=budget, cold_tokens=6, lead_tokens=2) as spec:
        responses: dict[int, list[int]] = {}
        for rid, stage, action in steps:
            if rid not in responses:
                spec.start_request(rid, [7, 8, rid], stage=stage, pipeline="p")
                responses[rid] = []
            elif action == 0:
                spec.finish(rid, learn=rid % 2 == 0)
                del responses[rid]
            else:
                spec.extend(rid, [rid + 1] * action)
                responses[rid] += [rid + 1] * action
            _contents(spec)
            for r, response in responses.items():
                req = spec._requests[r]
                assert spec._request_trees(req) == spec._trees_for(req.key)
                if req.seq is None:
                    continue
                for shard in spec._shards_for(req.key, create=False):
                    assert shard.tree.sequence(req.seq) == [8, r, *response]


# --- integral argument types -------------------------------------------------------

INTEGRAL = (np.int32, np.int64, np.uint16, np.uint32, np.int16)


@pytest.mark.parametrize("kind", INTEGRAL, ids=lambda k: k.__name__)
def test_integer_arguments_accept_numpy_integers(kind: type) -> None:
    """Constructor integers, caps and token lists accept numpy integers."""
    with Speculator(
        kind(16), cold_tokens=kind(0), max_shard_tokens=kind(100), lead_tokens=kind(2)
    ) as spec:
        assert spec._max_depth == 16
        assert type(spec._max_depth) is int
        assert type(spec._cold_tokens) is int
        assert type(spec._lead_tokens) is int
        assert type(spec._max_tokens) is int
        spec.start_request("a", [kind(1), kind(2)], stage="SQL", pipeline="p")
        spec.extend("a", [kind(t) for t in SQL])
        spec.finish("a")
        spec.start_request("b", np.array([1, 2, 11, 12], dtype=np.int32), stage="SQL", pipeline="p")
        spec.start_request("c", [1, 2], stage="SQL", pipeline="p")
        drafts = spec.draft_batch(["b", "c"], PARAMS, caps=np.array([2, 8], dtype=kind))
        assert [d.token_ids for d in drafts] == [SQL[2:4], SQL]


@pytest.mark.parametrize("value", [True, np.True_, 2.0, "2"], ids=repr)
def test_integer_arguments_refuse_bool_and_non_integers(value: object) -> None:
    """bool and non-integers raise TypeError naming the argument."""
    name = "bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__
    with pytest.raises(TypeError, match=f"^max_depth must be an int, not {name}$"):
        Speculator(value)  # type: ignore[arg-type]
    for kw in ("cold_tokens", "lead_tokens"):
        with pytest.raises(TypeError, match=f"^{kw} must be an int, not {name}$"):
            Speculator(16, **{kw: value})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=f"^max_shard_tokens must be an int or None, not {name}$"):
        Speculator(16, max_shard_tokens=value)  # type: ignore[arg-type]
    with Speculator(16) as spec:
        spec.start_request("a", [1, 2, 3])
        spec.start_request("b", [1, 2, 3])
        with pytest.raises(TypeError, match=rf"^caps\[0\] must be an int, not {name}$"):
            spec.draft_batch(["a", "b"], caps=[value, 1])  # type: ignore[list-item]


def test_draft_source_names_the_extra_tree_and_shard_sizes_are_per_key() -> None:
    """With extra_names a draft from an extra tree is named by it; shard_sizes per key."""
    with Speculator(16, local_tree=False, cold_tokens=0, params=PARAMS) as spec:
        run(spec, "a", [0], [1, 2, 3, 4], "SQL")
        pushed, fleet = SuffixTree(16), SuffixTree(16)
        pushed.add(1, [5, 6, 40, 41, 42])
        fleet.add(1, [7, 8, 50, 51, 52])
        try:
            for context, name in (([5, 6], "pushed"), ([7, 8], "fleet")):
                spec.start_request("q", context, stage="SQL", pipeline="p")
                draft, role = spec.draft_source(
                    "q", extra_trees=(pushed, fleet), extra_names=("pushed", "fleet")
                )
                assert role == name
                assert len(draft) > 0
                _, plain = spec.draft_source("q", extra_trees=(pushed, fleet))
                assert plain == "extra"
                spec.finish("q", learn=False)
        finally:
            pushed.close()
            fleet.close()
        sizes = spec.shard_sizes()
        assert set(sizes) == {("p", "SQL")}
        assert sizes["p", "SQL"][0] == 5  # the prompt's lead token and the response
