"""Smoke tests of ``benchmarks/bench_fleet.py``, run as a script against a real redis-server.

The script starts its own ``redis-server`` (``benchmarks/_redis.py``) and real
subscriber processes; these tests run it at a tiny size and check the JSON
it writes: the structure, and values that follow from what happened (every
subscriber applied every sequence, lags positive and ordered, byte counts
positive), never timings against a threshold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prereq import require_module, requires_shared, shared
from redis_server import requires_redis_server

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "bench_fleet.py"
SPIDER = shared("traces", "spider-sql.dev.jsonl.gz")
QWEN3 = shared("tokenizers", "qwen3", "tokenizer.json")

pytestmark = [requires_redis_server, requires_shared(SPIDER, QWEN3)]


def _run(tmp_path: Path, *args: str, timeout: float) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| metric" in proc.stdout  # the table was printed
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_lag_and_memory_phases(tmp_path: Path) -> None:
    """Phases c and d: 300 sequences at 300/s to 3 subscriber processes."""
    report = _run(tmp_path, "--phases", "c,d", "--rate", "300", "--seconds", "1", timeout=240)
    assert report["phases"] == ["c", "d"]
    assert "ab" not in report
    load = report["load"]
    n = load["sequences"]
    assert n == 300
    assert load["subscribers"] == 3
    assert load["refused"] == 0
    assert load["flushed"] is True
    assert load["publisher"]["published"] == n
    # every subscriber process applied every sequence, once, nothing malformed
    assert load["all_applied"] is True
    assert load["missing"] == 0
    for sub in load["subscriber_stats"]:
        assert sub["loads"] >= 1
        if sub["loads"] == 1:  # no reload from snapshots: every entry applied from the stream
            assert sub["applied"] == n
        assert sub["duplicates"] == 0
        assert sub["malformed"] == 0
    assert load["achieved_rate"] > 0
    lag = load["lag_ms"]
    assert 0 < lag["p50"] <= lag["p99"] <= lag["max"]
    # published -> applied everywhere includes the XADD acknowledgement
    assert lag["p50"] >= load["ack_ms"]["p50"] > 0
    for per in load["per_subscriber_lag_ms"]:
        assert 0 < per["p50"] <= per["max"] <= lag["max"]
    assert load["p99_ok"] == (lag["p99"] <= load["target_p99_ms"])

    mem = load["memory"]
    assert mem["cached_sequences"] == n
    assert mem["cached_tokens"] > n  # each sequence: 8 lead tokens plus a response
    assert mem["tenant_keys"] >= 2  # meta and log (snapshots once a subscriber compacts)
    assert mem["tenant_bytes"] == mem["stream_bytes"] + mem["snapshots_bytes"] + mem["other_bytes"]
    assert mem["stream_bytes"] > 0
    assert mem["stream_entries"] <= n
    assert mem["redis_bytes_per_token"] == pytest.approx(mem["tenant_bytes"] / mem["cached_tokens"])
    assert mem["subscriber_tree_bytes_per_token"] > 0
    assert mem["subscriber_both_trees_bytes_per_token"] == pytest.approx(
        2 * mem["subscriber_tree_bytes_per_token"]
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_restart_phase(tmp_path: Path) -> None:
    """Phase b alone: a two-question fleet run, one replica SIGKILLed and restarted."""
    require_module("torch")
    require_module("openai")
    from agentspec.models import ensure_default_model

    ensure_default_model()  # fetched once here (as the engine tests do), not by three replicas
    report = _run(tmp_path, "--phases", "b", "--questions", "2", "--agents", "1", timeout=840)
    ab = report["ab"]
    assert "isolated" not in ab
    fleet = ab["fleet"]
    assert fleet["summary"]["failed"] == 0
    assert fleet["summary"]["calls"] >= 2 * 5  # Classify, Extract, Enrich, SQL1, Combine
    kr = fleet["kill_restart"]
    first, control = kr["restarted_first_request"], kr["control_empty_isolated"]
    assert first["status"] == control["status"] == 200
    assert kr["same_tokens"] is True  # speculation is lossless
    assert first["completion_tokens"] == kr["probe"]["completion_tokens"] > 0
    assert kr["restarted_fleet_after_first_request"]["sequences"] > 0
    assert kr["pass"] == (first["accepted"] > max(0, control["accepted"]))


def test_throughput_phase(tmp_path: Path) -> None:
    """Phase e: 400 sequences at 200/s over 10 tenants x 10 stages, 3 follower processes."""
    report = _run(
        tmp_path,
        *("--phases", "e", "--e-rate", "200", "--e-seconds", "2", "--tenants", "10"),
        *("--compact-every", "8"),  # rounds during the run: each tenant gets 40 entries
        timeout=120,
    )
    assert report["phases"] == ["e"]
    assert "load" not in report
    tp = report["throughput"]
    n = tp["sequences"]
    assert n == 400
    assert (tp["tenants"], tp["stages"], tp["shards"]) == (10, 10, 100)
    assert tp["subscribers"] == 3
    assert tp["publishers"] == 2
    assert tp["refused"] == 0
    assert tp["flushed"] is True
    assert tp["published"] == n
    # every follower process holds every sequence of every tenant, nothing malformed
    assert tp["all_applied"] is True
    assert tp["missing"] == 0
    for sub in tp["per_subscriber"]:
        assert sub["reached"] is True
        assert sub["sequences"] == n
        assert sub["malformed"] == 0
        assert sub["duplicates"] == 0
        assert sub["loads"] >= 10  # one per tenant at least
        if sub["loads"] == 10:  # no reload from snapshots: every entry applied from the stream
            assert sub["applied"] == n
        # one FleetFollower: one thread of its own and one Redis connection per process
        assert sub["end"]["python_threads"] == 2  # the main thread and the follower's
        assert sub["end"]["redis_connections"] == 1
        assert sub["end"]["rss"] > 0
        assert sub["tree_bytes"] > 0
        assert sub["cpu_s"] > 0
    assert tp["offered_rate"] > 0
    assert tp["achieved_rate"] > 0
    lag = tp["lag_ms"]
    assert 0 < lag["p50"] <= lag["p99"] <= lag["max"]
    assert lag["p50"] >= tp["ack_ms"]["p50"] > 0
    assert tp["p99_ok"] == (lag["p99"] <= tp["target_p99_ms"])
    assert sum(s["sequences"] for s in tp["lag_ms_per_second"]) == n

    cpu = tp["cpu"]
    us = cpu["us_per_sequence"]
    assert us["publishers"] > 0
    assert us["followers"] > 0
    assert us["redis"] > 0
    assert us["per_follower"] == pytest.approx(us["followers"] / 3)
    assert cpu["capacity_seq_per_s"] == pytest.approx(
        cpu["cores"] * 1e6 / (us["publishers"] + us["followers"] + us["redis"])
    )

    comp = tp["compaction"]
    assert comp["rounds"] >= 10  # every tenant compacted during the run
    assert 0 < comp["median_s"] <= comp["p90_s"]
    assert sum(b["rounds"] for b in comp["by_written"]) == comp["rounds"]
    assert all(0 <= b["written"] <= 10 for b in comp["by_written"])  # at most a tenant's shards

    mem = tp["memory"]
    assert mem["cached_tokens"] > n  # each sequence: 8 lead tokens plus a response
    assert mem["tenant_bytes"] == mem["stream_bytes"] + mem["snapshots_bytes"] + mem["other_bytes"]
    assert mem["snapshots_bytes"] > 0  # compaction wrote snapshots
    assert mem["redis_bytes_per_token"] == pytest.approx(mem["tenant_bytes"] / mem["cached_tokens"])
