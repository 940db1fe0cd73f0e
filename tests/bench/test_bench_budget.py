"""Tests of `agentspec bench budget` (agentspec.bench.budget).

The envelope arithmetic is checked on hand-made points; the sweep itself on
real traces with the Qwen3 tokenizer under ../shared (skipped without them).
No timing is asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prereq import requires_shared, shared

from agentspec.__main__ import main
from agentspec.bench.budget import (
    Point,
    budget_for,
    compare,
    envelope,
    mat_at,
    render_tables,
    run,
)

REPO = Path(__file__).resolve().parents[2]
SHARED = shared()
SPIDER = SHARED / "traces" / "spider-sql.dev.jsonl.gz"
TOKENIZER = SHARED / "tokenizers" / "qwen3" / "tokenizer.json"

needs_data = requires_shared(SPIDER, TOKENIZER)


def test_envelope_keeps_the_best_mat_at_each_budget_or_below():
    pts = [(4.0, 2.5), (2.0, 2.0), (3.0, 1.9), (6.0, 2.4), (8.0, 3.0), (2.0, 2.1)]
    assert envelope(pts) == [(2.0, 2.1), (4.0, 2.5), (8.0, 3.0)]
    assert envelope([]) == []
    with pytest.raises(ValueError, match="finite"):
        envelope([(1.0, float("nan"))])


def test_mat_at_interpolates_inside_and_refuses_outside():
    env = [(2.0, 2.0), (4.0, 3.0), (8.0, 3.4)]
    assert mat_at(env, 2.0) == 2.0
    assert mat_at(env, 3.0) == pytest.approx(2.5)
    assert mat_at(env, 6.0) == pytest.approx(3.2)
    assert mat_at(env, 8.0) == 3.4
    assert mat_at(env, 1.99) is None
    assert mat_at(env, 8.01) is None
    assert mat_at([], 1.0) is None


def test_budget_for_is_the_inverse_of_mat_at():
    env = [(2.0, 2.0), (4.0, 3.0), (8.0, 3.4)]
    assert budget_for(env, 1.5) == 2.0  # the first point already reaches it
    assert budget_for(env, 2.5) == pytest.approx(3.0)
    assert budget_for(env, 3.2) == pytest.approx(6.0)
    assert budget_for(env, 3.41) is None
    for y in (2.2, 2.9, 3.3):
        x = budget_for(env, y)
        assert x is not None
        assert mat_at(env, x) == pytest.approx(y)


def test_compare_reads_each_method_at_the_baselines_budgets():
    pts = [
        Point("base", 0.5, 0.1, 100, 2.0, 2.0, 0.5),
        Point("base", 1.0, 0.1, 80, 2.5, 4.0, 0.4),
        Point("ours", 0.5, 0.1, 90, 2.2, 3.0, 0.5),
        Point("ours", 1.0, 0.1, 70, 2.9, 5.0, 0.4),
    ]
    rows = compare(pts, "base", 1.10)
    assert [(r["method"], r["drafted_per_step"]) for r in rows] == [("ours", 2.0), ("ours", 4.0)]
    low, high = rows
    assert low["mat"] is None  # ours never drafted that little
    assert low["ratio"] is None
    assert low["budget_for_target"] == 3.0  # 2.2 >= 1.1 * 2.0 at its first point
    assert high["baseline_mat"] == 2.5
    assert high["mat"] == pytest.approx(2.55)
    assert high["ratio"] == pytest.approx(2.55 / 2.5)
    assert high["budget_for_target"] == pytest.approx(3.0 + 2.0 * (2.75 - 2.2) / 0.7)
    assert compare(pts, "missing", 1.1) == []


@needs_data
def test_a_sweep_point_equals_the_replay_of_the_same_config():
    """The budget sweep replays exactly what ``bench replay`` does for its config."""
    from agentspec.bench.replay import ReplayConfig, load_tokenizer
    from agentspec.bench.replay import run as replay_run

    tok = load_tokenizer(TOKENIZER)
    res = run(
        [SPIDER],
        methods=["stage-shards"],
        baseline="ngram-3-5",
        alphas=[0.5, 1.0],
        min_probs=[0.1, 0.3],
        tokenizer=tok,
        max_sessions=12,
    )
    (f,) = res["files"]
    assert [(p["method"], p["alpha"], p["min_prob"]) for p in f["points"]] == [
        (m, a, mp) for m in ("stage-shards", "ngram-3-5") for a in (0.5, 1.0) for mp in (0.1, 0.3)
    ]
    ref = replay_run(
        [SPIDER],
        cfg=ReplayConfig(alpha=0.5, min_prob=0.3),
        methods=["stage-shards"],
        tokenizer=tok,
        max_sessions=12,
    )["files"][0]["methods"]["stage-shards"]
    (p,) = [
        p
        for p in f["points"]
        if p["method"] == "stage-shards" and p["alpha"] == 0.5 and p["min_prob"] == 0.3
    ]
    assert p["steps"] == ref["steps"]
    assert p["mat"] == ref["mat"]
    assert p["drafted_per_step"] == ref["drafted_per_step"]
    # one comparison row per baseline point; a smaller budget per token drafts less
    assert len(f["comparison"]) == 4
    by = {(p["alpha"], p["min_prob"]): p for p in f["points"] if p["method"] == "stage-shards"}
    assert by[(0.5, 0.1)]["drafted_per_step"] < by[(1.0, 0.1)]["drafted_per_step"]


@needs_data
def test_cli_smoke(tmp_path, capsys):
    """Table, JSON and plot of a small sweep."""
    out = tmp_path / "b.json"
    plots = tmp_path / "plots"
    argv = ["bench", "budget", str(SPIDER), "--max-sessions", "10", "--methods", "stage-shards"]
    argv += ["--baseline", "ngram-5-5", "--alphas", "0.5,2", "--json", str(out)]
    rc = main([*argv, "--plots", str(plots), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "at ngram-5-5's drafted tokens per step" in text
    res = json.loads(out.read_text())
    assert res["baseline"] == "ngram-5-5"
    assert res["target"] == 1.10
    (f,) = res["files"]
    assert len(f["points"]) == 4
    assert all(p["mat"] >= 1.0 for p in f["points"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert [p.name for p in plots.iterdir()] == ["spider-sql.dev-budget.png"]


@needs_data
def test_cli_errors(tmp_path, capsys):
    """Bad grids, methods and files exit with status 1 and say why."""
    base = ["bench", "budget", str(SPIDER), "--max-sessions", "2", "--quiet"]
    assert main([*base, "--alphas", "1,x"]) == 1
    assert "--alphas" in capsys.readouterr().err
    assert main([*base, "--alphas", "1,1"]) == 1
    assert "repeats" in capsys.readouterr().err
    assert main([*base, "--min-probs", "2"]) == 1
    assert "min prob" in capsys.readouterr().err
    assert main([*base, "--methods", "oracle"]) == 1
    assert "oracle" in capsys.readouterr().err
    assert main([*base, "--baseline", "nope"]) == 1
    assert "nope" in capsys.readouterr().err
    assert main([*base, "--target", "0"]) == 1
    assert "target" in capsys.readouterr().err
    assert main(["bench", "budget", str(tmp_path / "missing.jsonl.gz")]) == 1
    assert "not found" in capsys.readouterr().err


@needs_data
def test_the_confidence_method_sweeps_its_cut_and_the_oracle_runs_once():
    """The confidence method's points sweep --conf-min-probs (alpha fixed), each equal to
    ``bench replay`` with that cut; a higher cut drafts less; the oracle's MAT is reported."""
    from agentspec.bench.replay import ReplayConfig, load_tokenizer
    from agentspec.bench.replay import run as replay_run

    tok = load_tokenizer(TOKENIZER)
    res = run(
        [SPIDER],
        methods=["confidence"],
        baseline="stage-shards",
        alphas=[1.0],
        conf_min_probs=[0.15, 0.5],
        tokenizer=tok,
        max_sessions=12,
    )
    (f,) = res["files"]
    conf = [p for p in f["points"] if p["method"] == "confidence"]
    assert [(p["alpha"], p["min_prob"]) for p in conf] == [(32.0, 0.15), (32.0, 0.5)]
    assert conf[0]["drafted_per_step"] > conf[1]["drafted_per_step"]
    ref = replay_run(
        [SPIDER],
        cfg=ReplayConfig(conf_min_prob=0.5),
        methods=["confidence"],
        tokenizer=tok,
        max_sessions=12,
    )["files"][0]
    assert conf[1]["mat"] == ref["methods"]["confidence"]["mat"]
    assert f["oracle_mat"] == ref["methods"]["oracle"]["mat"] > 1.0
    assert "/oracle" in render_tables(res)
    no = run(
        [SPIDER],
        methods=["confidence"],
        baseline="stage-shards",
        alphas=[1.0],
        conf_min_probs=[0.5],
        oracle=False,
        tokenizer=tok,
        max_sessions=3,
    )
    assert no["files"][0]["oracle_mat"] is None
