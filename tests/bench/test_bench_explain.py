"""`agentspec bench explain`: each class produced on purpose, and a real trace slice.

The synthetic traces use hand-picked token ids (no tokenizer): a warm-up that
both sides learn first, then one replayed request whose every oracle win is
listed exactly, with the reason it lands in its class (depth 64, at most 32
draft tokens, alpha 1, min prob 0.1; responses are learned behind the last 8
prompt tokens, the "lead").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from prereq import require_module, requires_shared, shared

from agentspec.__main__ import main
from agentspec.bench.explain import CLASSES, explain_trace
from agentspec.bench.replay import ReplayConfig, Request, TraceData

SHARED = shared()
SPIDER = SHARED / "traces" / "spider-sql.dev.jsonl.gz"
TOKENIZER = SHARED / "tokenizers" / "qwen3" / "tokenizer.json"

CFG = ReplayConfig()
LEAD = list(range(1000, 1007))  # 7 tokens every prompt below ends with
P = [900, 901, 902, 903, 999, *LEAD]  # a prompt; its lead is [999, *LEAD]

Turn = tuple[Sequence[int], Sequence[int]] | tuple[Sequence[int], Sequence[int], str]


def _requests(turns: Sequence[Turn]) -> tuple[Request, ...]:
    out = []
    empty = np.zeros(0, dtype=np.int32)
    for i, turn in enumerate(turns):
        prompt, response = turn[0], turn[1]
        workload = turn[2] if len(turn) == 3 else "w"
        ctx = np.asarray(prompt, dtype=np.int32)
        resp = np.asarray(response, dtype=np.int32)
        out.append(Request(i, i, workload, "s", ctx, len(ctx), empty, resp))
    return tuple(out)


def _run(warm: Sequence[Turn], test: Sequence[Turn]) -> dict:
    reqs = _requests(test)
    trace = TraceData(Path("synthetic"), "synthetic", "w", len(reqs), reqs, 0.0)
    # the hand-made cases follow the count-only drafter's budgets (alpha * m)
    return explain_trace(trace, CFG, warmup=_requests(warm), keep_steps=True, method="stage-shards")


def _recoverable(res: dict, cls: str) -> dict[str, int]:
    (c,) = [c for c in res["classes"] if c["class"] == cls]
    return {d["detail"]: d["recoverable_tokens"] for d in c["details"]}


def _explain(warm: Sequence[Turn], test: Sequence[Turn]) -> list[tuple[int, int, int, str, str]]:
    res = _run(warm, test)
    wins = res["wins_list"]
    # the summary partitions the wins: steps and tokens lost add up per class and detail
    assert res["wins"] == len(wins) == sum(c["steps"] for c in res["classes"])
    assert res["lost_tokens"] == sum(w["oracle"] - w["accepted"] for w in wins)
    for c in res["classes"]:
        assert c["steps"] == sum(d["steps"] for d in c["details"])
        assert c["lost_tokens"] == sum(d["lost_tokens"] for d in c["details"])
    assert [c["class"] for c in res["classes"]] == list(CLASSES)
    return [(w["pos"], w["accepted"], w["oracle"], w["cls"], w["detail"]) for w in wins]


def test_stopped_early_budget():
    # The shard holds lead + 1..10; a match of the 8-token lead drafts at most
    # 8 tokens (alpha 1), all right; the oracle has all 10.  After 9 tokens
    # the last one is drafted and accepted: no further win.
    resp = list(range(1, 11))
    assert _explain([(P, resp)], [(P, resp)]) == [
        (0, 8, 10, "stopped-early", "budget, more was right")
    ]
    # drafting 32 from the same match gets all 10: 2 more
    assert _recoverable(_run([(P, resp)], [(P, resp)]), "stopped-early") == {
        "budget, more was right": 2
    }


def test_stopped_early_min_prob():
    # 11 responses share "1 2" then branch 11 ways: the third token's path
    # probability is 1/11 < 0.1, so the draft stops after "1 2".
    warm = [(P, [1, 2, 100 + i, 200 + i]) for i in range(11)]
    assert _explain(warm, [(P, [1, 2, 100, 200])]) == [(0, 2, 4, "stopped-early", "min-prob")]


def test_stopped_early_branch_end():
    # The shard's copy ends after "1 2 3"; the prompt holds "1 .. 6" but after
    # another token (50), so only the shard drafts at first.  Then "1 2 3 4"
    # matches in the prompt and the rest is drafted from there.
    prompt = [50, 1, 2, 3, 4, 5, 6, 51, 52, 53, *P]
    assert _explain([(P, [1, 2, 3])], [(prompt, [1, 2, 3, 4, 5, 6])]) == [
        (0, 3, 6, "stopped-early", "branch-end")
    ]


def test_other_branch():
    # After the lead "1 2 3 4" was seen twice, "1 2 7 8" once: the drafter takes
    # the majority branch and misses at token 3; the truth continues the same
    # 8-token match in the stage shard.
    warm = [(P, [1, 2, 3, 4]), (P, [1, 2, 3, 4]), (P, [1, 2, 7, 8])]
    assert _explain(warm, [(P, [1, 2, 7, 8])]) == [(0, 2, 4, "other-branch", "stage -> stage")]


def test_match_too_short():
    # Prompts end with A or B then LEAD.  After LEAD (7 tokens) 8 tokens follow
    # twice (B's response, probability 2/3 each: score 4.67); after A LEAD the
    # 3-token truth follows once (score 3).  The shorter match wins and is
    # wrong; drafting from the 8-token match alone gets all 3.
    pa, pb = [900, 901, 910, *LEAD], [900, 901, 911, *LEAD]
    wrong = list(range(40, 48))
    warm = [(pa, [30, 31, 32]), (pb, wrong), (pb, wrong)]
    assert _explain(warm, [(pa, [30, 31, 32])]) == [(0, 0, 3, "match-too-short", "stage -> stage")]
    assert _recoverable(_run(warm, [(pa, [30, 31, 32])]), "match-too-short") == {
        "stage -> stage": 3
    }


def test_match_too_long():
    # After A LEAD a wrong 8-token response follows once (score 8: it wins);
    # the truth follows only the shorter suffix LEAD (5 times of 6).
    pa, pb = [900, 901, 910, *LEAD], [900, 901, 911, *LEAD]
    warm = [(pa, list(range(40, 48)))] + [(pb, [30, 31, 32])] * 5
    assert _explain(warm, [(pa, [30, 31, 32])]) == [(0, 0, 3, "match-too-long", "stage -> stage")]


def test_prompt_only():
    # No shard yet; "1 2 3" is in the prompt after 50, not after the context's
    # last token: nothing is drafted, the oracle copies 3.  Then "1" matches in
    # the prompt with a budget of one token: a budget stop.
    prompt = [50, 1, 2, 3, 51, *P]
    assert _explain([], [(prompt, [1, 2, 3])]) == [
        (0, 0, 3, "prompt-only", "local"),
        (1, 1, 2, "stopped-early", "budget, more was right"),
    ]


def test_unanchored():
    # The shard holds "9 1 2 3" after another lead: the copy is there, after
    # no suffix of this context.
    other = [800, 801, 802, 803, 804, 805, 806, 807]
    assert _explain([(other, [9, 1, 2, 3])], [(P, [1, 2, 3])]) == [
        (0, 0, 3, "unanchored", "in stage"),
        (1, 1, 2, "stopped-early", "budget, more was right"),
    ]


def test_nowhere():
    # Another pipeline's response is seen by the oracle, but the drafter's
    # trees are this pipeline's: every step is a win that no tree holds.
    assert _explain([(P, [1, 2, 3], "other")], [(P, [1, 2, 3])]) == [
        (0, 0, 3, "nowhere", "-"),
        (1, 0, 2, "nowhere", "-"),
        (2, 0, 1, "nowhere", "-"),
    ]


def test_no_win_when_the_drafter_matches_the_oracle():
    resp = list(range(1, 8))  # 7 tokens: the 8-token lead's budget covers them
    assert _explain([(P, resp)], [(P, resp)]) == []


needs_shared = requires_shared(SPIDER, TOKENIZER)


@needs_shared
def test_real_slice_cli_json_and_replay_agree(tmp_path, capsys):
    require_module("tokenizers")
    out = tmp_path / "x.json"
    argv = ["bench", "explain", str(SPIDER), "--max-sessions", "40", "--quiet"]
    assert main([*argv, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "oracle wins" in table
    assert "other-branch" in table
    res = json.loads(out.read_text())
    (t,) = res["traces"]
    assert t["requests"] == 120
    assert t["sessions"] == 40
    assert 0 < t["wins"] <= t["steps"]
    assert t["wins"] == sum(c["steps"] for c in t["classes"])
    assert t["lost_tokens"] == sum(c["lost_tokens"] for c in t["classes"])
    # the oracle never accepts less than we do, so the losses are the whole gap
    assert t["oracle_accepted_at_our_steps"] - t["accepted"] == t["lost_tokens"] > 0
    per_stage = t["per_stage"]
    assert set(per_stage) == {"sql-dailsql", "sql-c3", "sql-dinsql"}
    assert sum(st["steps"] for st in per_stage.values()) == t["steps"]
    for c in t["classes"]:
        assert sum(st["classes"][c["class"]]["steps"] for st in per_stage.values()) == c["steps"]
        assert (
            sum(st["classes"][c["class"]]["lost_tokens"] for st in per_stage.values())
            == c["lost_tokens"]
        )
    by = {c["class"]: c for c in t["classes"]}
    assert by["nowhere"]["steps"] == 0  # one pipeline per file: the oracle's data is ours
    assert res["method"] == "confidence"
    # The drafters are exactly `bench replay`'s confidence and stage-shards methods.
    old = tmp_path / "old.json"
    argv_old = ["bench", "explain", str(SPIDER), "--max-sessions", "40", "--quiet"]
    assert main([*argv_old, "--method", "stage-shards", "--json", str(old)]) == 0
    assert "(stage-shards)" in capsys.readouterr().out
    (t_old,) = json.loads(old.read_text())["traces"]
    rep = tmp_path / "r.json"
    argv = ["bench", "replay", str(SPIDER), "--max-sessions", "40", "--quiet"]
    assert main([*argv, "--methods", "confidence,stage-shards", "--json", str(rep)]) == 0
    capsys.readouterr()
    methods = json.loads(rep.read_text())["files"][0]["methods"]
    for name, got in (("confidence", t), ("stage-shards", t_old)):
        m = methods[name]
        assert (m["steps"], m["mat"]) == (got["steps"], pytest.approx(got["mat"]))


def test_cli_refuses_missing_trace(tmp_path, capsys):
    assert main(["bench", "explain", str(tmp_path / "missing.jsonl")]) == 1
    assert "not found" in capsys.readouterr().err
