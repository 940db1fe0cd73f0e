"""Stage shards: `agentspec.Speculator`."""

from __future__ import annotations

import pytest

from agentspec import DraftParams, Speculator
from agentspec.exceptions import InvalidArgumentError

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
    from agentspec._speculator import MAX_EXTRA_TREES

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
