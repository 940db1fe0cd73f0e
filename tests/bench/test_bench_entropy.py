"""Tests of the entropy predictor (agentspec.bench.entropy) and `agentspec bench entropy`."""

from __future__ import annotations

import json
import math
import random
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from prereq import require_module, requires_shared, shared

from agentspec.__main__ import main
from agentspec.bench.entropy import child_entropy

REPO = Path(__file__).resolve().parents[2]
SHARED = shared()
SPIDER = SHARED / "traces" / "spider-sql.dev.jsonl.gz"
TOKENIZER = SHARED / "tokenizers" / "qwen3" / "tokenizer.json"


def _brute(seqs, depth):
    children: dict[tuple[int, ...], Counter[int]] = defaultdict(Counter)
    for s in seqs:
        for i in range(len(s)):
            for length in range(1, depth):
                if i + length < len(s):
                    children[tuple(s[i : i + length])][s[i + length]] += 1
    num = top = 0.0
    weight = 0
    for cnt in children.values():
        t = sum(cnt.values())
        h = -sum(c / t * math.log2(c / t) for c in cnt.values())
        num += t * h
        top += max(cnt.values())
        weight += t
    return (num / weight if weight else None), (top / weight if weight else None), len(children)


def test_two_equally_likely_continuations_give_one_bit():
    """[1, 2] and [1, 3]: the node (1) has two children seen once each, so H = 1 bit."""
    r = child_entropy([[1, 2], [1, 3]], depth=2)
    assert r.entropy_bits == pytest.approx(1.0)
    assert r.top1_prob == pytest.approx(0.5)
    assert (r.nodes, r.weight, r.sequences, r.tokens) == (1, 2, 2, 4)


def test_repeated_text_has_zero_entropy():
    """A response repeated verbatim with distinct tokens is fully predictable."""
    r = child_entropy([list(range(50))] * 5, depth=8)
    assert r.entropy_bits == 0.0
    assert r.top1_prob == 1.0


def test_matches_brute_force_counts_on_random_sequences():
    """The vectorised computation equals explicit child counting with dicts."""
    rng = random.Random(5)
    for depth in (2, 3, 6):
        for _ in range(20):
            seqs = [
                [rng.randrange(rng.randint(1, 5)) for _ in range(rng.randint(0, 30))]
                for _ in range(rng.randint(1, 5))
            ]
            r = child_entropy(seqs, depth=depth)
            h, top, nodes = _brute(seqs, depth)
            if h is None:
                assert r.entropy_bits is None
                continue
            assert r.entropy_bits == pytest.approx(h, abs=1e-9)
            assert r.top1_prob == pytest.approx(top)
            assert r.nodes == nodes


def test_per_length_results_add_up():
    """The overall value is the weight-averaged per-length value."""
    rng = random.Random(9)
    seqs = [[rng.randrange(6) for _ in range(200)] for _ in range(3)]
    r = child_entropy(seqs, depth=5)
    assert len(r.by_length) == 4
    assert sum(w for _, _, w, _ in r.by_length) == r.weight
    avg = sum(h * w for h, _, w, _ in r.by_length if h is not None) / r.weight
    assert r.entropy_bits == pytest.approx(avg)


def test_bad_input():
    """Depth below 2 and negative tokens raise; no tokens gives no value."""
    with pytest.raises(ValueError, match="depth"):
        child_entropy([[1, 2]], depth=1)
    with pytest.raises(ValueError, match=">= 0"):
        child_entropy([[1, -2, 3]])
    assert child_entropy([[], []]).entropy_bits is None
    assert child_entropy([[4]]).entropy_bits is None


@requires_shared(SPIDER, TOKENIZER)
def test_cli_on_spider(tmp_path, capsys):
    """`agentspec bench entropy` reports every stage plus the whole file, in JSON and a table."""
    require_module("tokenizers")
    out = tmp_path / "e.json"
    rc = main(["bench", "entropy", str(SPIDER), "--max-sessions", "40", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    (f,) = res["files"]
    assert set(f["stages"]) == {"sql-dailsql", "sql-c3", "sql-dinsql"}
    for r in [*f["stages"].values(), f["all"]]:
        assert 0.0 <= r["entropy_bits"] <= math.log2(151_669)
        assert 0.0 < r["top1_prob"] <= 1.0
        assert len(r["by_length"]) == res["depth"] - 1
    assert sum(r["sequences"] for r in f["stages"].values()) == f["all"]["sequences"] == 120
    assert "sql-dinsql" in capsys.readouterr().out


def test_cli_missing_file(tmp_path, capsys):
    """A missing trace file is a clear error, exit status 1."""
    rc = main(["bench", "entropy", str(tmp_path / "nope.jsonl.gz")])
    assert rc == 1
    assert "not found" in capsys.readouterr().err
