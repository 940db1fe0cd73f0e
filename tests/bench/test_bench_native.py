"""Tests of the replay benchmark (benchmarks/bench_native.py) and its trace helpers.

They need the real traces and tokenizer under ../shared (skipped without them)
and the bench extras (tokenizers, psutil).  No timing is asserted: only the
report structure, the tokenization and the sanity of acceptance numbers.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from prereq import require_module, require_shared, requires_shared

require_module("tokenizers")
require_module("psutil")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # benchmarks/ is not a package on the default test path
    sys.path.insert(0, str(REPO))

from benchmarks._traces import (  # noqa: E402
    DEFAULT_TOKENIZER,
    DEFAULT_TRACE_DIR,
    load_tokenizer,
    load_traces,
    read_records,
)

SPIDER = DEFAULT_TRACE_DIR / "spider-sql.dev.jsonl.gz"
SWE = DEFAULT_TRACE_DIR / "swe-gemini3pro.dev.jsonl.gz"

pytestmark = requires_shared(SPIDER, DEFAULT_TOKENIZER)


def _chatml(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


@pytest.mark.parametrize("trace", [SPIDER, SWE], ids=["spider", "swe"])
def test_prompts_equal_whole_chatml_tokenization(trace: Path) -> None:
    """Per-message ids concatenated equal tokenizing the whole rendered ChatML prompt."""
    require_shared(trace)
    tok = load_tokenizer()
    ts = load_traces(trace, tok, max_sessions=2)
    with gzip.open(trace, "rt", encoding="utf-8") as fh:
        records = [json.loads(next(fh)) for _ in range(2)]
    checked = 0
    for sess, rec in zip(ts.sessions, records, strict=True):
        assert sess.session == rec["session"]
        for req in sess.requests():
            text = _chatml(rec["messages"][: req.turn]) + "<|im_start|>assistant\n"
            assert req.prompt.tolist() == tok.encode(text, add_special_tokens=False).ids
            content = rec["messages"][req.turn]["content"]
            want = [
                *tok.encode(content, add_special_tokens=False).ids,
                tok.token_to_id("<|im_end|>"),
            ]
            assert req.response.tolist() == want
            checked += 1
    assert checked == ts.counts()["requests"]


def test_read_records_rejects_bad_limits_and_files(tmp_path: Path) -> None:
    """A non-positive session limit and a file without records raise ValueError."""
    with pytest.raises(ValueError, match="max_sessions"):
        read_records(SPIDER, 0)
    empty = tmp_path / "empty.jsonl.gz"
    with gzip.open(empty, "wt") as fh:
        fh.write("\n")
    with pytest.raises(ValueError, match="no records"):
        read_records(empty)


def test_cli_rejects_missing_trace_file(tmp_path: Path) -> None:
    """The CLI exits with an argparse error (rc 2) for a trace path that does not exist."""
    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_native.py"), str(tmp_path / "nope.gz")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 2
    assert "trace file not found" in res.stderr


@pytest.mark.slow
def test_smoke_run_report_structure_and_acceptance(tmp_path: Path) -> None:
    """20 spider-sql sessions: every backend reports consistent, sane metrics and targets."""
    out = tmp_path / "bench.json"
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "bench_native.py"),
            str(SPIDER),
            "--max-sessions",
            "20",
            "--backends",
            "arctic,agentspec,agentspec-cursor,agentspec-confident,agentspec-raw",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    assert doc["config"] == {"depth": 64, "max_spec_tokens": 32, "alpha": 1.0, "min_prob": 0.1}
    assert {"agentspec", "agentspec-cursor", "agentspec-confident", "agentspec-raw"} <= set(
        doc["backends"]
    )
    (f,) = doc["files"]
    counts = f["counts"]
    assert counts["sessions"] == 20
    assert counts["requests"] == 60  # three candidate queries per spider question
    for name in doc["backends"]:
        r = f["backends"][name]
        assert r["requests"] == counts["requests"]
        assert r["response_tokens"] == counts["response_tokens"]
        assert r["prompt_tokens"] == counts["prompt_tokens"]
        # every response token is appended exactly once, so MAT * steps == tokens
        assert r["mat"] * r["steps"] == pytest.approx(counts["response_tokens"])
        assert 1.0 <= r["mat"] <= 33.0
        assert 0.0 <= r["acceptance_rate"] <= 1.0
        assert r["accepted_per_step"] <= r["drafted_per_step"] <= 32
        assert r["mat"] - 1.0 <= r["accepted_per_step"] <= r["mat"]
        assert r["accepted_per_step"] > 0.3  # spider's candidates repeat the schema and each other
        assert r["draft_p50_us"] > 0
        assert r["draft_p99_us"] >= r["draft_p50_us"]
        assert r["ingest_us_per_prompt_token"] > 0
        assert r["update_us_per_token"] > 0
        assert r["cached_tokens"] == counts["response_tokens"]
        assert r["alloc_bytes_per_cached_token"] > 0
        assert r["rss"]["cached_tokens"] == counts["response_tokens"]
        assert r["acceptance_deterministic"] is True
    # the raw diagnostic drives the same engine with the same tokens as the cursor path
    cur, raw = f["backends"]["agentspec-cursor"], f["backends"]["agentspec-raw"]
    for key in ("steps", "mat", "drafted_per_step", "acceptance_rate", "cached_tokens"):
        assert raw[key] == cur[key], key
    # the confident backend is the cursor path with other params: same tokens, its own drafts
    conf = f["backends"]["agentspec-confident"]
    assert conf["cached_tokens"] == cur["cached_tokens"]
    assert conf["drafted_per_step"] != cur["drafted_per_step"]
    targets = f["targets"]
    assert targets
    assert all(isinstance(t["pass"], bool) for t in targets)
    assert {t["backend"] for t in targets} == {
        "agentspec",
        "agentspec-cursor",
        "agentspec-confident",
    }
    assert f"### {f['name']}" in res.stdout
    assert "| metric |" in res.stdout
