"""The shipped alerting rules, unit-tested by Prometheus's own ``promtool``.

``promtool check rules`` accepts docs/prometheus/agentspec-alerts.yml, and
``promtool test rules`` runs tests/ops/agentspec_alerts_test.yml: synthetic
series on which each alert fires (with its labels and annotations) after its
``for`` period, and healthy ones on which it stays quiet.  (The rules also
load and evaluate in a live Prometheus in test_prometheus_engine.py.)
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import ops_pipeline
import pytest
from prometheus_server import PROMTOOL, requires_prometheus

pytestmark = requires_prometheus

TESTS = Path(__file__).resolve().parent / "agentspec_alerts_test.yml"


def _promtool(*args: str) -> str:
    assert PROMTOOL is not None, "promtool is not installed (it comes with prometheus)"
    done = subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_promtool_accepts_the_rules() -> None:
    assert "SUCCESS: 3 rules found" in _promtool("check", "rules", str(ops_pipeline.ALERTS))


def test_each_alert_fires_on_its_series_and_only_there() -> None:
    out = _promtool("test", "rules", str(TESTS))
    assert "SUCCESS" in out


def test_the_unit_tests_cover_every_alert() -> None:
    text = TESTS.read_text()
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if "alertname:" in line]
    rules = ops_pipeline.ALERTS.read_text()
    shipped = {line.split(":", 1)[1].strip() for line in rules.splitlines() if "- alert:" in line}
    assert shipped == set(names)
    assert len(shipped) == 3


@pytest.mark.parametrize("broken", ["> 30", "for: 15m"])
def test_a_changed_rule_fails_the_unit_tests(tmp_path: Path, broken: str) -> None:
    # the unit tests can fail: drop a threshold or a `for` period and they do
    rules = ops_pipeline.ALERTS.read_text()
    assert broken in rules
    changed = rules.replace(broken, "> 0" if broken.startswith(">") else "for: 1m")
    (tmp_path / "rules.yml").write_text(changed)
    test = TESTS.read_text().replace("../../docs/prometheus/agentspec-alerts.yml", "rules.yml")
    (tmp_path / "t.yml").write_text(test)
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "test", "rules", str(tmp_path / "t.yml")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0, done.stdout
    assert "FAILED" in done.stdout + done.stderr
