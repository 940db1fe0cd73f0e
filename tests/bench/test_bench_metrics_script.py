"""Smoke test of ``benchmarks/bench_metrics.py --micro-only``: it runs and prints its numbers.

Timings are printed, never checked against a threshold (the benchmark's ratio is the
number that matters, measured in one run beside its baseline).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "bench_metrics.py"


def test_micro_only_prints_the_metrics_work_per_step() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--micro-only"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    line = re.search(
        r"metrics work alone: ([\d.]+) us per verification step; one scrape \(render\) "
        r"([\d.]+) ms; a draft ([\d.]+) us, with its source named ([\d.]+) us",
        proc.stdout,
    )
    assert line is not None, proc.stdout
    assert all(float(x) > 0 for x in line.groups())
