"""Tests of `agentspec bench fleet` (agentspec.bench.fleet).

The simulation tests build tokenized traces directly (no tokenizer needed);
the CLI tests need the real Spider trace and the Qwen3 tokenizer under
../shared (skipped without them).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from prereq import requires_shared, shared

from agentspec.__main__ import main
from agentspec.bench.fleet import (
    assign,
    lag_ticks,
    parse_lags,
    parse_max_sessions,
    parse_replicas,
    parse_routings,
    run,
    shuffle_sessions,
    simulate,
)
from agentspec.bench.replay import (
    ReplayConfig,
    Request,
    TraceData,
    load_trace,
    make_method,
    replay,
    summarize_run,
)

REPO = Path(__file__).resolve().parents[2]
SHARED = shared()
SPIDER = SHARED / "traces" / "spider-sql.dev.jsonl.gz"
TOKENIZER = SHARED / "tokenizers" / "qwen3" / "tokenizer.json"

needs_data = requires_shared(SPIDER, TOKENIZER)

CFG = ReplayConfig()


def _synthetic(sessions: int = 64, turns: int = 2, seed: int = 0) -> TraceData:
    """A repetitive tokenized trace: every response is one of 3 templates with one
    token changed; prompts are fresh random tokens (so only learning helps the
    first turn); two stages."""
    rng = np.random.default_rng(seed)
    gen = np.array([1, 2, 3], dtype=np.int32)
    templates = [rng.integers(1000, 2000, 80).astype(np.int32) for _ in range(3)]
    reqs: list[Request] = []
    for s in range(sessions):
        parts: list[np.ndarray] = []
        pending = []
        running = 0
        for t in range(turns):
            user = rng.integers(10_000, 50_000, 40).astype(np.int32)
            parts.append(user)
            running += len(user)
            resp = templates[(s + t) % 3].copy()
            resp[rng.integers(0, len(resp))] = rng.integers(5000, 6000)
            pending.append((running, "plan" if t == 0 else "act", resp))
            parts.append(resp)
            running += len(resp)
        context = np.concatenate(parts)
        for plen, stage, resp in pending:
            reqs.append(Request(len(reqs), s, "syn", stage, context, plen, gen, resp))
    return TraceData(Path("syn.jsonl"), "syn", "syn", sessions, tuple(reqs), 0.0)


def _replay_mat(trace: TraceData) -> tuple[float, int]:
    method = make_method("stage-shards", CFG)
    try:
        s = summarize_run(replay(method, trace))
    finally:
        method.close()
    return s["mat"], s["steps"]


# --------------------------------------------------------------------------
# routing and parsing


def test_assign_round_robin_and_session_affinity():
    """Round-robin deals requests; session affinity keeps each session on one replica."""
    trace = _synthetic(sessions=10, turns=3)
    assert assign(trace, 4, "round-robin") == [i % 4 for i in range(30)]
    placed = assign(trace, 4, "session")
    for r in trace.requests:
        assert placed[r.index] == r.session % 4
    assert assign(trace, 1, "session") == [0] * 30
    with pytest.raises(ValueError, match="unknown routing"):
        assign(trace, 2, "random")


def test_parsers():
    """Comma lists are checked, deduplicated, and sorted where order is meaningless."""
    assert parse_replicas("16, 1,2,2") == [1, 2, 16]
    assert parse_routings("session,round-robin,session") == ["session", "round-robin"]
    assert parse_lags("0,50,12.5") == [0.0, 50.0, 12.5]
    for bad in ("0", "x", "", "1,,2", "2000", "-1"):
        with pytest.raises(ValueError, match="--replicas"):
            parse_replicas(bad)
    with pytest.raises(ValueError, match="unknown routing nope"):
        parse_routings("round-robin,nope")
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(ValueError, match="--lag-ms"):
            parse_lags(bad)
    limit = parse_max_sessions("swe-gemini3pro=60,100")
    assert limit(Path("x/swe-gemini3pro.dev.jsonl.gz")) == 60
    assert limit(Path("x/spider-sql.dev.jsonl.gz")) == 100
    assert parse_max_sessions(None)(Path("a.jsonl")) is None
    for bad in ("0", "a=0", "=3", "a=b"):
        with pytest.raises(ValueError, match="--max-sessions"):
            parse_max_sessions(bad)
    assert [lag_ticks(v, 20.0) for v in (0, 1, 20, 21, 40, 50)] == [0, 1, 1, 2, 2, 3]


def test_shuffle_sessions_keeps_sessions_whole():
    """Shuffling permutes sessions, renumbers requests, keeps each session's order."""
    trace = _synthetic(sessions=12, turns=2)
    sh = shuffle_sessions(trace, 3)
    assert [r.index for r in sh.requests] == list(range(24))
    assert [r.session for r in sh.requests] != [r.session for r in trace.requests]
    for a, b in zip(sh.requests[::2], sh.requests[1::2], strict=True):
        assert a.session == b.session
        assert (a.stage, b.stage) == ("plan", "act")


# --------------------------------------------------------------------------
# simulation invariants


def test_one_replica_equals_replay():
    """One replica, isolated or fleet at any lag, is the `bench replay` stage-shards run."""
    trace = _synthetic()
    mat, steps = _replay_mat(trace)
    for fleet, lag in ((False, 0), (True, 0), (True, 7)):
        res = simulate(trace, CFG, [0] * len(trace.requests), fleet=fleet, lag=lag)
        assert (res.mat, res.steps) == (mat, steps)
        assert res.sim_ticks == steps  # one replica: one step per tick, never idle
        assert res.unseen_at_start == 0


@needs_data
def test_one_replica_equals_replay_on_spider():
    """The same on a real trace slice (three stages, a pipeline tree)."""
    from agentspec.bench.replay import load_tokenizer

    trace = load_trace(SPIDER, load_tokenizer(TOKENIZER), 40)
    mat, steps = _replay_mat(trace)
    for fleet in (False, True):
        res = simulate(trace, CFG, [0] * len(trace.requests), fleet=fleet, lag=3)
        assert (res.mat, res.steps) == (mat, steps)


def test_fleet_at_lag_zero_is_close_to_one_replica():
    """At lag 0 a fleet differs from one replica only by ordering: a request cannot
    draft from the requests in flight beside it. On this trace that is the first
    wave, n requests that start with nothing learned (one replica has one such
    request per template), so the fleet needs at most (n - 1) cold responses'
    worth of extra steps (80 each, no draft at all) and its MAT stays close."""
    trace = _synthetic(sessions=240, turns=1)
    mat1, steps1 = _replay_mat(trace)
    for n in (2, 4, 8):
        for routing in ("round-robin", "session"):
            res = simulate(trace, CFG, assign(trace, n, routing), fleet=True, lag=0)
            assert res.mat is not None
            assert 0 <= res.steps - steps1 <= (n - 1) * 80, (n, routing)
            if n <= 4:
                assert res.mat / mat1 > 0.97, (n, routing, res.mat, mat1)


def test_isolated_is_lower_and_fleet_recovers():
    """On a repetitive trace isolated trees lose MAT as replicas grow; fleet sync
    recovers most of it; a lag longer than the run is isolated mode exactly."""
    trace = _synthetic()
    mat1, _ = _replay_mat(trace)
    prev = mat1
    for n in (2, 4, 8):
        placed = assign(trace, n, "round-robin")
        iso = simulate(trace, CFG, placed, fleet=False)
        fleet0 = simulate(trace, CFG, placed, fleet=True, lag=0)
        lagged = simulate(trace, CFG, placed, fleet=True, lag=40)
        never = simulate(trace, CFG, placed, fleet=True, lag=10**9)
        assert iso.mat is not None
        assert fleet0.mat is not None
        assert lagged.mat is not None
        assert iso.mat < prev
        assert iso.mat < 0.97 * mat1
        assert fleet0.mat > iso.mat
        assert iso.mat <= lagged.mat <= fleet0.mat
        assert (never.steps, never.unseen_at_start) == (iso.steps, iso.unseen_at_start)
        assert iso.unseen_at_start > fleet0.unseen_at_start == 0
        prev = iso.mat


def test_run_records_and_dedup(monkeypatch):
    """`run` gives one record per (trace, replicas, routing, mode, lag), simulating
    identical configurations once (one replica; equal placements)."""
    trace = _synthetic(sessions=16, turns=1)  # one request per session: routings agree
    monkeypatch.setattr("agentspec.bench.fleet.load_trace", lambda p, tok, n=None: trace)
    res = run(
        [Path("syn.jsonl")],
        cfg=CFG,
        tokenizer=None,
        replicas=[2, 4],
        routings=["round-robin", "session"],
        lags_ms=[0.0, 50.0],
    )
    recs = res["records"]
    assert len(recs) == 3 * 2 * 3  # replicas 1,2,4 x routings x (isolated, fleet 0, fleet 50)
    # 1 replica: 1 run; 2 and 4: one placement x (isolated, lag 0, lag 3 steps)
    assert res["simulations"] == 1 + 2 * 3
    ones = [r for r in recs if r["replicas"] == 1]
    assert {r["mat"] for r in ones} == {res["traces"][0]["mat_one_replica"]}
    assert all(r["mat_ratio"] == 1.0 for r in ones)
    for r in recs:
        same = [
            q["mat"]
            for q in recs
            if (q["replicas"], q["mode"], q["lag_ms"]) == (r["replicas"], r["mode"], r["lag_ms"])
        ]
        assert len(set(same)) == 1  # both routings place every request alike here


# --------------------------------------------------------------------------
# command line


@needs_data
def test_cli_json_schema_and_baseline(tmp_path, capsys):
    """The JSON holds one record per (trace, replicas, routing, mode, lag) with the
    documented keys; the one-replica MAT is `bench replay`'s stage-shards MAT."""
    out = tmp_path / "fleet.json"
    rc = main(
        [
            "bench",
            "fleet",
            str(SPIDER),
            "--max-sessions",
            "spider-sql=30",
            "--replicas",
            "2,1",
            "--routing",
            "round-robin,session",
            "--lag-ms",
            "0,50",
            "--jobs",
            "2",
            "--quiet",
            "--json",
            str(out),
            "--plots",
            str(tmp_path / "plots"),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "fleet 50 ms" in table
    assert "isolated" in table
    assert "round-robin" in table
    data = json.loads(out.read_text())
    recs = data["records"]
    assert len(recs) == 2 * 2 * 3
    want = {"trace", "replicas", "routing", "mode", "lag_ms", "mat", "mat_ratio"}
    for r in recs:
        assert want <= set(r)
        assert r["trace"] == "spider-sql.dev"
        assert r["mode"] in ("isolated", "fleet")
        assert r["routing"] in ("round-robin", "session")
        assert (r["lag_ms"] is None) == (r["mode"] == "isolated")
        assert isinstance(r["mat"], float)
        assert r["mat"] >= 1
    keys = {(r["replicas"], r["routing"], r["mode"], r["lag_ms"]) for r in recs}
    assert len(keys) == len(recs)
    assert data["traces"][0]["counts"]["sessions"] == 30
    assert (tmp_path / "plots" / "spider-sql.dev-fleet.png").is_file()

    rp = tmp_path / "replay.json"
    args = ["bench", "replay", str(SPIDER), "--max-sessions", "30", "--methods", "stage-shards"]
    assert main([*args, "--quiet", "--json", str(rp)]) == 0
    capsys.readouterr()
    replay_mat = json.loads(rp.read_text())["files"][0]["methods"]["stage-shards"]["mat"]
    for r in recs:
        if r["replicas"] == 1:
            assert r["mat"] == replay_mat


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--replicas", "0,2", "--replicas: 0 is outside"),
        ("--replicas", "two", "--replicas: 'two' is not an integer"),
        ("--replicas", "", "--replicas must be a comma-separated list"),
        ("--routing", "random", "unknown routing random"),
        ("--lag-ms", "-5", "--lag-ms"),
        ("--max-sessions", "0", "--max-sessions must be >= 1"),
        ("--jobs", "0", "--jobs must be >= 1"),
        ("--step-ms", "0", "--step-ms must be > 0"),
    ],
)
def test_cli_errors(tmp_path, capsys, flag, value, message):
    """Bad options exit with status 1 and a clear message, before any work."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    assert main(["bench", "fleet", str(trace), flag, value, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "agentspec: error:" in err
    assert message in err


def test_cli_missing_trace(tmp_path, capsys):
    """A missing trace file exits with status 1."""
    assert main(["bench", "fleet", str(tmp_path / "nope.jsonl.gz"), "--quiet"]) == 1
    assert "not found" in capsys.readouterr().err
