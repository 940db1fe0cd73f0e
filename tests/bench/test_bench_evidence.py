"""`agentspec bench evidence`: hand-derived cells, the fitter, and a real trace slice.

The synthetic traces use hand-picked token ids (no tokenizer): every prompt is
made of tokens no other request uses, so drafts come only from the responses
learned into the stage shard (depth 64, at most 32 draft tokens, alpha 32,
min prob 0).  Each response starts with token 1, which nothing drafts from
the first time; from then on the shard's continuations of ``[1]`` are the
earlier responses, so ``T`` is the number of requests before.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from prereq import requires_shared, shared

from agentspec import confidence_table
from agentspec.__main__ import main
from agentspec.bench.evidence import (
    COND_BUCKETS,
    conf_bin,
    evidence_trace,
    fit_confidence,
    log_loss,
    render_table,
)
from agentspec.bench.plots import pyplot
from agentspec.bench.replay import ReplayConfig, Request, TraceData

SHARED = shared()
SPIDER = SHARED / "traces" / "spider-sql.dev.jsonl.gz"
TOKENIZER = SHARED / "tokenizers" / "qwen3" / "tokenizer.json"

A = list(range(1, 11))  # 1, 2, ..., 10
B = [1, 50, 51, 52]


def _trace(responses: Sequence[Sequence[int]]) -> TraceData:
    empty = np.zeros(0, dtype=np.int32)
    reqs = []
    for i, resp in enumerate(responses):
        prompt = np.arange(1000 + 20 * i, 1010 + 20 * i, dtype=np.int32)  # unique per request
        reqs.append(
            Request(i, i, "w", "s", prompt, len(prompt), empty, np.asarray(resp, dtype=np.int32))
        )
    return TraceData(Path("synthetic"), "synthetic", "w", len(reqs), tuple(reqs), 0.0)


def _cells(res: dict) -> dict[tuple[str, int, int, str], tuple[int, int]]:
    return {
        (c["source"], c["l_bin"], c["t_bin"], c["cond_bucket"]): (c["tokens"], c["accepted"])
        for c in res["cells"]
    }


def test_conf_bin_matches_the_engine():
    assert [conf_bin(x) for x in (0, 1, 2, 3, 4, 7, 8, 63, 64, 127, 128, 10**6)] == [
        0, 1, 2, 2, 3, 3, 4, 6, 7, 7, 7, 7
    ]  # fmt: skip


def test_cells_certain_tokens():
    # Requests 0..3 answer A; request j drafts 2..10 from [1] (T = j, L = 1..9), all right.
    # Request 4 answers 1..5 then 77: its draft 2..10 (T = 4) is right up to 5; 6 (L = 5)
    # is the first wrong token, so 5 tokens are verified, 4 accepted.
    res = evidence_trace(_trace([A, A, A, A, [1, 2, 3, 4, 5, 77, 78]]), ReplayConfig())
    one = COND_BUCKETS[0][0]
    # L = 1 | 2-3 | 4-7 | 8-9 -> bins 1, 2, 3, 4 (1, 2, 4, 2 tokens); T = 1 | 2, 3 | 4
    assert _cells(res) == {
        ("stage", 1, 1, one): (1, 1),
        ("stage", 2, 1, one): (2, 2),
        ("stage", 3, 1, one): (4, 4),
        ("stage", 4, 1, one): (2, 2),
        ("stage", 1, 2, one): (2, 2),
        ("stage", 2, 2, one): (4, 4),
        ("stage", 3, 2, one): (8, 8),
        ("stage", 4, 2, one): (4, 4),
        ("stage", 1, 3, one): (1, 1),
        ("stage", 2, 3, one): (2, 2),
        ("stage", 3, 3, one): (2, 1),  # L = 4 accepted, L = 5 rejected
    }
    assert res["verified_tokens"] == 32
    assert res["accepted_tokens"] == 31
    # the acceptance table is those cells, rates exact
    table = {(c["l_bin"], c["t_bin"]): (c["tokens"], c["rate"]) for c in res["table"]}
    assert table[(3, 3)] == (2, 0.5)
    assert table[(3, 2)] == (8, 1.0)
    (bucket,) = [b for b in res["cond_buckets"] if b["tokens"]]
    assert bucket["bucket"] == one
    assert bucket["mean_cond"] == 1.0
    assert bucket["observed"] == 31 / 32
    assert res["sources"] == {"stage": {"tokens": 32, "accepted": 31, "rate": 31 / 32}}


def test_cells_conditional_probability_and_count():
    # B then A four times.  Request 1 drafts 50 from [1] (T 1), wrong.  Request 2: [1] goes
    # on with 2 once and 50 once (T 2, cond 1/2; the tie goes to the smaller id), then
    # [1, 2] with 3 once (T 1, cond 1) up to 10.  Request 3: cond 2/3 with T 3, then T 2.
    # Request 4: cond 3/4 with T 4, then T 3.  Every token after 1 is accepted.
    res = evidence_trace(_trace([B, A, A, A, A]), ReplayConfig())
    one, b75, b50 = (label for label, _ in COND_BUCKETS[:3])
    assert _cells(res) == {
        ("stage", 1, 1, one): (1, 0),
        ("stage", 2, 1, one): (2, 2),
        ("stage", 3, 1, one): (4, 4),
        ("stage", 4, 1, one): (2, 2),
        ("stage", 2, 2, one): (4, 4),
        ("stage", 3, 2, one): (8, 8),
        ("stage", 4, 2, one): (4, 4),
        ("stage", 1, 2, b50): (2, 2),
        ("stage", 1, 3, b75): (1, 1),
    }
    sums = {(c["l_bin"], c["t_bin"]): c["cond_sum"] for c in res["cells"]}
    assert sums[(1, 2)] == pytest.approx(1 / 2 + 2 / 3, rel=1e-6)
    assert sums[(1, 3)] == pytest.approx(3 / 4, rel=1e-6)
    buckets = {b["bucket"]: b for b in res["cond_buckets"]}
    assert buckets[b75]["tokens"] == 1
    assert buckets[b75]["observed"] == 1.0
    assert buckets[b50]["mean_cond"] == pytest.approx((1 / 2 + 2 / 3) / 2, rel=1e-6)
    # a bucket's prediction is cond * f(L, T) of the default table at its cells
    f = confidence_table()
    assert buckets[b75]["predicted_default"] == pytest.approx(0.75 * f[1 * 8 + 3], rel=1e-6)
    assert "synthetic" in render_table({"traces": [res], "pooled": None})


def test_local_tree_counts():
    # One request whose answer repeats itself.  After "1 2 3 4 9 1" the context's [1] goes on
    # once, with "2 3 4 9 1", in the request's own tree and in the live stage shard alike;
    # on equal scores the request's own (local) tree drafts.  2, 3, 4 (L = 1, 2, 3) are
    # right; 9 (L = 4) is where the response ends: rejected.
    res = evidence_trace(_trace([[1, 2, 3, 4, 9, 1, 2, 3, 4]]), ReplayConfig())
    one = COND_BUCKETS[0][0]
    assert _cells(res) == {
        ("local", 1, 1, one): (1, 1),
        ("local", 2, 1, one): (2, 2),
        ("local", 3, 1, one): (1, 0),
    }


def test_no_draft_tokens():
    # one response of new tokens: nothing is ever drafted, nothing fitted, the report still prints
    res = evidence_trace(_trace([[5, 6, 7]]), ReplayConfig())
    assert res["verified_tokens"] == 0
    assert res["cells"] == []
    assert res["fits"]["fitted"] is None
    assert res["fits"]["default"]["log_loss"] is None
    assert "0 verified draft tokens" in render_table({"traces": [res], "pooled": None})


def _model_cells(scale: float, le: float, ce: float, n: float = 1000.0) -> list:
    table = confidence_table(scale, le, ce)
    return [(lb, tb, n, n * table[lb * 8 + tb]) for lb in range(1, 8) for tb in range(1, 8)]


@pytest.mark.parametrize(
    "params", [(0.5, 1.0, 0.5), (0.8, 0.7, 0.4), (0.1, 1.6, 0.0), (2.0, 0.3, 1.2)]
)
def test_fit_recovers_the_model(params):
    fit = fit_confidence(_model_cells(*params))
    assert (fit.scale, fit.length_exp, fit.count_exp) == pytest.approx(params, rel=1e-3, abs=2e-4)
    assert fit.tokens == 49_000
    assert fit.log_loss == pytest.approx(log_loss(_model_cells(*params), *params), abs=1e-9)


def test_fit_from_sampled_counts():
    rng = np.random.default_rng(7)
    table = confidence_table(0.7, 0.8, 0.6)
    cells = [
        (lb, tb, 4000, int(rng.binomial(4000, table[lb * 8 + tb])))
        for lb in range(1, 8)
        for tb in range(1, 8)
    ]
    fit = fit_confidence(cells)
    assert fit.scale == pytest.approx(0.7, rel=0.1)
    assert fit.length_exp == pytest.approx(0.8, abs=0.05)
    assert fit.count_exp == pytest.approx(0.6, abs=0.05)
    # maximum likelihood: no nearby parameters do better on the same cells
    for d in (
        (0.05, 0, 0),
        (-0.05, 0, 0),
        (0, 0.03, 0),
        (0, -0.03, 0),
        (0, 0, 0.03),
        (0, 0, -0.03),
    ):
        other = (fit.scale * math.exp(d[0]), fit.length_exp + d[1], fit.count_exp + d[2])
        assert fit.log_loss < log_loss(cells, *other)


def _mid(b: int) -> float:
    """The middle of confidence bin b, as `confidence_table` evaluates the model."""
    return 1.0 if b <= 1 else 1.5 * 2 ** (b - 1) - 0.5


def test_fit_keeps_exponents_non_negative():
    # Acceptance falling with T (count exponent -0.4): the fit sits at count_exp 0 and
    # beats every point of a grid with count_exp >= 0.
    cells = []
    for lb in range(1, 8):
        for tb in range(1, 8):
            x = 0.6 * _mid(lb) * _mid(tb) ** -0.4
            cells.append((lb, tb, 500.0, 500.0 * x / (1 + x)))
    fit = fit_confidence(cells)
    assert fit.count_exp == 0.0
    assert fit.length_exp > 0
    for s in (0.1, 0.3, 0.6, 1.0):
        for le in (0.5, 1.0, 1.5):
            for ce in (0.0, 0.1, 0.5):
                assert fit.log_loss <= log_loss(cells, s, le, ce) + 1e-12


def test_fit_leaves_what_the_cells_cannot_tell_at_its_start():
    # every token in T bin 1: count_exp has no evidence and stays at its start value
    cells = [
        (lb, 1, 800.0, 800.0 * confidence_table(0.9, 0.6, 0.5)[lb * 8 + 1]) for lb in range(1, 8)
    ]
    fit = fit_confidence(cells, start=(0.5, 1.0, 0.25))
    assert fit.count_exp == pytest.approx(0.25, abs=1e-6)
    assert (fit.scale, fit.length_exp) == pytest.approx((0.9, 0.6), abs=2e-4)
    # every token accepted: the fit stays finite
    sure = fit_confidence([(2, 2, 100.0, 100.0), (3, 3, 50.0, 50.0)])
    assert all(math.isfinite(v) for v in (sure.scale, sure.length_exp, sure.count_exp))


@pytest.mark.parametrize(
    "cells",
    [[], [(1, 1, 0.0, 0.0)], [(1, 1, 10.0, 11.0)], [(8, 1, 10.0, 1.0)], [(1, -1, 10.0, 1.0)]],
)
def test_fit_rejects_bad_cells(cells):
    with pytest.raises(ValueError, match=r"cell|no tokens"):
        fit_confidence(cells)


@requires_shared(SPIDER, TOKENIZER)
def test_cli_spider_slice(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "evidence.json"
    argv = ["bench", "evidence", str(SPIDER), str(SPIDER), "--max-sessions", "30"]
    argv += ["--tokenizer", str(TOKENIZER), "--json", str(out), "--quiet"]
    argv += ["--plots", str(tmp_path / "plots")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    text = captured.out
    png = tmp_path / "plots" / "spider-sql.dev-evidence.png"
    if pyplot() is None:
        assert "plots skipped: matplotlib is not installed" in captured.err
    else:
        assert png.stat().st_size > 0
        assert (tmp_path / "plots" / "pooled-evidence.png").is_file()
    assert "spider-sql.dev" in text
    assert "fitted" in text
    assert "pooled over 2 traces" in text
    res = json.loads(out.read_text())
    t = res["traces"][0]
    assert t["verified_tokens"] > 500
    assert sum(c["tokens"] for c in t["cells"]) == t["verified_tokens"]
    assert sum(c["accepted"] for c in t["cells"]) == t["accepted_tokens"]
    ones = next(b for b in t["cond_buckets"] if b["bucket"] == "1")
    assert sum(c["tokens"] for c in t["table"]) == ones["tokens"] > 0
    fits = t["fits"]
    assert fits["fitted"]["length_exp"] >= 0
    assert fits["fitted"]["count_exp"] >= 0
    # the fit is the maximum likelihood: no worse than the defaults, no better than per-cell rates
    assert fits["per_cell_log_loss"] <= fits["fitted"]["log_loss"] <= fits["default"]["log_loss"]
    # the same trace twice, pooled: every count doubles, the fit is the same
    pooled = res["pooled"]
    assert pooled["verified_tokens"] == 2 * t["verified_tokens"]
    assert pooled["fits"]["fitted"]["scale"] == pytest.approx(fits["fitted"]["scale"], rel=1e-3)


def test_cli_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["bench", "evidence", str(tmp_path / "missing.jsonl")]) == 1
    assert "not found" in capsys.readouterr().err
