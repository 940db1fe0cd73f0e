"""`agentspec bench calibration` on a slice of the spider trace: structure and invariants."""

from __future__ import annotations

import json

import pytest
from prereq import require_module, requires_shared, shared

from agentspec.__main__ import main

SHARED = shared()
SPIDER = SHARED / "traces" / "spider-sql.dev.jsonl.gz"
TOKENIZER = SHARED / "tokenizers" / "qwen3" / "tokenizer.json"

pytestmark = requires_shared(SPIDER, TOKENIZER)


def _ece(buckets: list[dict]) -> float:
    n = sum(b["tokens"] for b in buckets)
    return sum(b["tokens"] * abs(b["observed"] - b["predicted"]) for b in buckets) / n


def test_cli_report_json_and_plot(tmp_path, capsys):
    require_module("tokenizers")
    out = tmp_path / "c.json"
    plots = tmp_path / "plots"
    argv = ["bench", "calibration", str(SPIDER), "--max-sessions", "120", "--quiet"]
    assert main([*argv, "--json", str(out), "--plots", str(plots)]) == 0
    table = capsys.readouterr().out
    assert "ECE raw" in table
    assert "stage / source" in table
    res = json.loads(out.read_text())
    (t,) = res["traces"]
    for part in ("raw", "corrected"):
        s = t[part]
        assert s["tokens"] == sum(b["tokens"] for b in s["buckets"]) > 0
        assert s["ece"] == pytest.approx(_ece(s["buckets"]))
        for b in s["buckets"]:
            assert b["low"] <= b["predicted"] <= b["high"] + 1e-9
            assert 0.0 <= b["observed"] <= 1.0
    # Both score the same verified tokens; groups partition them.
    assert t["raw"]["tokens"] == t["corrected"]["tokens"]
    assert sum(g["raw"]["tokens"] for g in t["groups"]) == t["raw"]["tokens"]
    assert {g["source"] for g in t["groups"]} <= {"stage", "pipeline", "local", "extra"}
    # Tree counts are optimistic on this trace; the online correction removes most of it.
    assert t["raw"]["bias"] < 0
    assert t["corrected"]["ece"] < t["raw"]["ece"]
    png = plots / "spider-sql.dev-calibration.png"
    if png.exists():  # matplotlib installed
        assert png.stat().st_size > 1000


def test_cli_refuses_bad_options(tmp_path, capsys):
    assert main(["bench", "calibration", str(SPIDER), "--buckets", "0"]) == 1
    assert "--buckets" in capsys.readouterr().err
    assert main(["bench", "calibration", str(tmp_path / "missing.jsonl")]) == 1
