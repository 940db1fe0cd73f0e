"""Tests of `agentspec bench replay` (agentspec.bench.replay) and the oracle.

The CLI tests need the real traces and the Qwen3 tokenizer under ../shared
(skipped without them). No timing is asserted, only structure and the
invariants every replay must satisfy (the oracle bounds every copy-based
method; MAT >= 1; acceptance <= 1).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from prereq import require_module, require_shared, requires_shared, shared

from agentspec.__main__ import main
from agentspec.bench.oracle import Oracle, longest_seen_prefix
from agentspec.bench.replay import METHODS, ReplayConfig, load_trace, run, shard_bin
from agentspec.traces import Message, TraceRecord, write_traces

REPO = Path(__file__).resolve().parents[2]
SHARED = shared()
SPIDER = SHARED / "traces" / "spider-sql.dev.jsonl.gz"
SWE = SHARED / "traces" / "swe-gemini3pro.dev.jsonl.gz"
TOKENIZER = SHARED / "tokenizers" / "qwen3" / "tokenizer.json"

needs_data = requires_shared(SPIDER, TOKENIZER)


def _occurs(x: list[int], seqs: list[list[int]]) -> bool:
    n = len(x)
    return any(s[i : i + n] == x for s in seqs for i in range(len(s) - n + 1))


# --------------------------------------------------------------------------
# oracle


def test_longest_seen_prefix_matches_linear_scan():
    """Galloping + bisection finds the same length as trying every prefix."""
    rng = random.Random(1)
    for _ in range(300):
        seen = [[rng.randrange(3) for _ in range(rng.randint(0, 20))] for _ in range(3)]
        cont = [rng.randrange(3) for _ in range(rng.randint(0, 12))]
        calls = []

        def count(x, calls=calls, seen=seen):
            calls.append(len(x))
            return int(_occurs(list(x), seen))

        expect = max(n for n in range(len(cont) + 1) if n == 0 or _occurs(cont[:n], seen))
        assert longest_seen_prefix(count, cont) == expect
        assert all(1 <= c <= len(cont) for c in calls)


def test_oracle_drafts_longest_prefix_of_seen_data():
    """The oracle's draft is the longest prefix of the truth in prompt, output or old responses."""
    rng = random.Random(2)
    oracle = Oracle(max_spec_tokens=6)
    old: list[list[int]] = []
    for _ in range(25):
        prompt = [rng.randrange(4) for _ in range(rng.randint(0, 15))]
        resp = [rng.randrange(4) for _ in range(rng.randint(1, 15))]
        oracle.start(np.asarray(prompt, dtype=np.int32), resp)
        pos = 0
        while pos < len(resp):
            d = oracle.draft(pos)
            data = [*old, prompt + resp[:pos]]
            cont = resp[pos : pos + 6]
            expect = max(n for n in range(len(cont) + 1) if n == 0 or _occurs(cont[:n], data))
            assert d == cont[:expect]
            step = min(len(d) + 1, len(resp) - pos)
            oracle.extend(resp[pos : pos + step])
            pos += step
        oracle.finish()
        old.append(resp)
    oracle.close()


@pytest.mark.parametrize("kind", [np.int32, np.int64, np.uint16], ids=repr)
def test_oracle_max_spec_tokens_accepts_numpy_integers(kind):
    """max_spec_tokens may be a numpy integer (kept as a plain int); bool and floats are refused."""
    oracle = Oracle(kind(4))
    assert oracle.k == 4
    assert type(oracle.k) is int
    oracle.close()
    for bad, name in ((True, "bool"), (4.0, "float")):
        with pytest.raises(TypeError, match=f"^max_spec_tokens must be an int, not {name}$"):
            Oracle(bad)


def test_oracle_reuses_a_prompt_that_extends_the_last_context():
    """The next turn's prompt (previous context + more) gives the same drafts as a fresh index."""
    a, b = Oracle(4), Oracle(4)
    a.start(np.asarray([1, 2, 3], dtype=np.int32), [4, 5])
    a.extend([4, 5])
    a.finish()
    b.add_response([4, 5])
    prompt = np.asarray([1, 2, 3, 4, 5, 9, 1, 2], dtype=np.int32)
    a.start(prompt, [3, 4, 5, 9, 7])
    b.start(prompt, [3, 4, 5, 9, 7])
    assert a.draft(0) == b.draft(0) == [3, 4, 5, 9]


def test_shard_bins():
    """Shard sizes fall into 0, 1, 2-3, 4-7, ... buckets."""
    assert [shard_bin(n) for n in (0, 1, 2, 3, 4, 7, 8, 1000)] == [
        (0, 0),
        (1, 1),
        (2, 3),
        (2, 3),
        (4, 7),
        (4, 7),
        (8, 15),
        (512, 1023),
    ]
    with pytest.raises(ValueError, match=">= 0"):
        shard_bin(-1)


def test_config_rejects_bad_values():
    """Out-of-range replay parameters raise."""
    with pytest.raises(ValueError, match="depth"):
        ReplayConfig(depth=1)
    with pytest.raises(ValueError, match="spec tokens"):
        ReplayConfig(max_spec_tokens=0)
    with pytest.raises(ValueError, match="alpha"):
        ReplayConfig(alpha=float("nan"))
    with pytest.raises(ValueError, match="min prob"):
        ReplayConfig(min_prob=1.5)


# --------------------------------------------------------------------------
# with the real tokenizer


def _check_invariants(file_res: dict) -> None:
    methods = file_res["methods"]
    oracle = methods["oracle"]
    for name, m in methods.items():
        assert m["requests"] == file_res["counts"]["requests"], name
        assert m["response_tokens"] == file_res["counts"]["response_tokens"], name
        assert m["mat"] >= 1.0, name
        assert m["mat"] <= oracle["mat"] + 1e-12, name
        assert m["mat_vs_oracle"] == pytest.approx(m["mat"] / oracle["mat"])
        if m["acceptance_rate"] is not None:
            assert 0.0 <= m["acceptance_rate"] <= 1.0, name
        for stage, s in m["per_stage"].items():
            assert s["mat"] <= oracle["per_stage"][stage]["mat"] + 1e-12, (name, stage)
            assert s["mat"] >= 1.0
        assert sum(s["requests"] for s in m["per_stage"].values()) == m["requests"]
        assert sum(b["requests"] for b in m["by_shard_size"]) == m["requests"]
        obins = {b["shard_responses_lo"]: b for b in oracle["by_shard_size"]}
        for b in m["by_shard_size"]:
            assert b["mat"] <= obins[b["shard_responses_lo"]]["mat"] + 1e-12, (name, b)
    assert oracle["acceptance_rate"] in (None, 1.0)


@needs_data
def test_cli_smoke_on_spider(tmp_path, capsys):
    """A 30-session spider replay of every method: table, JSON and plots, all invariants hold."""
    require_module("tokenizers")
    out = tmp_path / "r.json"
    plots = tmp_path / "plots"
    rc = main(
        [
            "bench",
            "replay",
            str(SPIDER),
            "--max-sessions",
            "30",
            "--json",
            str(out),
            "--plots",
            str(plots),
            "--quiet",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["config"] == {
        "depth": 64,
        "max_spec_tokens": 32,
        "alpha": 1.0,
        "min_prob": 0.1,
        "conf_min_prob": 0.25,
    }
    assert set(res["methods"]) | set(res["skipped"]) == set(METHODS)
    (f,) = res["files"]
    assert f["counts"]["sessions"] == 30
    assert f["counts"]["requests"] == 90
    assert f["stages"] == ["sql-dailsql", "sql-c3", "sql-dinsql"]
    assert set(f["methods"]) == set(res["methods"])
    for name in res["methods"]:
        assert name in text
        m = f["methods"][name]
        for key in ("draft_p50_us", "draft_p99_us", "update_us_per_token", "drafted_per_step"):
            assert m[key] is not None
            assert m[key] >= 0
        assert set(m["per_stage"]) == set(f["stages"])
    _check_invariants(f)
    if "stage-shards" in f["methods"]:
        assert f["methods"]["stage-shards"]["peak_tree_bytes"] > 0
        assert set(f["methods"]["stage-shards"]["per_stage"]["sql-c3"]) >= {"tree_bytes"}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert sorted(p.name for p in plots.iterdir()) == [
        "spider-sql.dev-mat-per-stage.png",
        "spider-sql.dev-vs-shard-size.png",
    ]


@needs_data
@pytest.mark.parametrize("trace", [SPIDER, SWE], ids=["spider", "swe"])
def test_prompts_equal_whole_chatml_tokenization(trace):
    """Per-session cached prompt ids equal `agentspec.chat.chatml_prompt_ids` of each request."""
    require_module("jinja2")
    from agentspec.bench.replay import load_tokenizer
    from agentspec.chat import chatml_prompt_ids
    from agentspec.traces import read_traces

    require_shared(trace)
    tok = load_tokenizer(TOKENIZER)
    data = load_trace(trace, tok, max_sessions=2)
    reqs = [r for rec in read_traces(trace, max_sessions=2) for r in rec.requests()]
    assert len(reqs) == len(data.requests)
    for got, want in zip(data.requests, reqs, strict=True):
        assert got.prompt().tolist() == chatml_prompt_ids(tok, want.prompt)
        assert got.prompt_tokens == len(got.prompt())
        assert got.response.tolist() == tok.encode(want.response, add_special_tokens=False).ids
        assert got.stage == want.stage


def _synthetic(path: Path) -> None:
    rng = random.Random(4)
    words = ["alpha", "beta", "gamma", "delta", "select", "from", "where", "join"]
    recs = []
    for i in range(12):
        answer = " ".join(rng.choice(words) for _ in range(30))
        recs.append(
            TraceRecord(
                "wl",
                f"s{i}",
                "plan",
                (
                    Message("user", f"task {i}: " + " ".join(rng.choice(words) for _ in range(10))),
                    Message("assistant", answer),
                    Message("user", "again"),
                    Message("assistant", answer + " done", stage="act"),
                ),
            )
        )
    write_traces(path, recs)


@needs_data
def test_warmup_from_the_same_file_lets_the_oracle_copy_everything(tmp_path):
    """With every response seen beforehand the oracle needs exactly ceil(n / (k + 1)) steps each."""
    from agentspec.bench.replay import load_tokenizer

    trace = tmp_path / "t.jsonl"
    _synthetic(trace)
    tok = load_tokenizer(TOKENIZER)
    cfg = ReplayConfig(max_spec_tokens=8)
    cold = run([trace], cfg=cfg, methods=["ngram-3-5", "stage-shards"], tokenizer=tok)
    warm = run([trace], cfg=cfg, methods=["ngram-3-5"], tokenizer=tok, warmup_from=trace)
    (fc,), (fw,) = cold["files"], warm["files"]
    assert warm["warmup"]["requests"] == 24
    data = load_trace(trace, tok)
    expect = sum(-(-len(r.response) // 9) for r in data.requests)
    assert fw["methods"]["oracle"]["steps"] == expect
    assert fw["methods"]["oracle"]["mat"] >= fc["methods"]["oracle"]["mat"]
    assert set(fc["methods"]["oracle"]["per_stage"]) == {"plan", "act"}
    _check_invariants(fc)
    _check_invariants(fw)
    # the "act" answer repeats the "plan" answer of the same session, which is in its prompt
    act = fc["methods"]["oracle"]["per_stage"]["act"]
    assert act["mat"] > 5


@needs_data
def test_cli_errors(tmp_path, capsys):
    """Unknown methods, bad session counts and missing files exit with status 1 and a message."""
    assert main(["bench", "replay", str(SPIDER), "--methods", "nope", "--quiet"]) == 1
    assert "unknown method" in capsys.readouterr().err
    assert main(["bench", "replay", str(SPIDER), "--max-sessions", "0", "--quiet"]) == 1
    assert "--max-sessions" in capsys.readouterr().err
    assert main(["bench", "replay", str(tmp_path / "missing.jsonl.gz")]) == 1
    assert "not found" in capsys.readouterr().err
    assert main(["bench"]) == 2
