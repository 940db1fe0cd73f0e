"""The rule for a missing prerequisite (tests/prereq.py): a skip outside CI, a failure under it.

Each case runs a small test file in a child pytest with the environment it
names (``CI``, ``AGENTSPEC_REQUIRE_SHARED``) and reads the outcomes from its
JUnit XML report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CASES = """
import pytest
from prereq import (
    missing, require, require_module, require_shared, requires, requires_shared, shared,
)

ABSENT = shared("no-such-folder", "tokenizer.json")


def test_require_missing():
    require(False, "the frobnicator is not installed")


def test_require_present():
    require(True, "never shown")


@requires(False, "redis-server is not installed")
def test_requires_missing():
    pass


@requires(True, "never shown")
def test_requires_present():
    pass


def test_missing():
    missing("the model download failed")


def test_module_missing():
    require_module("agentspec_no_such_module_xyz")


def test_module_present():
    assert require_module("json").dumps(1) == "1"


def test_shared_missing():
    require_shared(ABSENT)


@requires_shared(ABSENT)
def test_shared_mark_missing():
    pass


@pytest.fixture
def needs_frobnicator():
    require(False, "the frobnicator is not installed")


def test_fixture_missing(needs_frobnicator):
    pass
"""


def outcomes(tmp_path: Path, **env: str) -> dict[str, tuple[str, str]]:
    """Run CASES with ``env`` (``CI`` unset unless given): test name -> (outcome, message)."""
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["prereq"]\n')
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    child = {k: v for k, v in os.environ.items() if k not in ("CI", "AGENTSPEC_REQUIRE_SHARED")}
    child.update(env, PYTHONPATH=str(TESTS))
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=tmp_path,
        env=child,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.is_file(), proc.stdout + proc.stderr
    found: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kids = [k for k in case if k.tag in ("skipped", "failure", "error")]
        kind = kids[0].tag if kids else "passed"
        found[case.get("name", "")] = (kind, kids[0].get("message", "") if kids else "")
    return found


MISSING = ("require_missing", "requires_missing", "missing", "module_missing", "fixture_missing")
SHARED = ("shared_missing", "shared_mark_missing")
PRESENT = ("require_present", "requires_present", "module_present")


def test_outside_ci_a_missing_prerequisite_skips_with_its_reason(tmp_path: Path) -> None:
    got = outcomes(tmp_path)
    for name in MISSING + SHARED:
        assert got[f"test_{name}"][0] == "skipped", (name, got)
    for name in PRESENT:
        assert got[f"test_{name}"][0] == "passed", (name, got)
    assert "the frobnicator is not installed" in got["test_require_missing"][1]
    assert "redis-server is not installed" in got["test_requires_missing"][1]
    assert "no-such-folder" in got["test_shared_missing"][1]


@pytest.mark.parametrize("ci", ["1", "true"])
def test_under_ci_a_missing_prerequisite_fails_with_its_reason(tmp_path: Path, ci: str) -> None:
    got = outcomes(tmp_path, CI=ci)
    for name in MISSING:
        assert got[f"test_{name}"][0] in ("failure", "error"), (name, got)
    for name in PRESENT:
        assert got[f"test_{name}"][0] == "passed", (name, got)
    assert "missing prerequisite under CI" in got["test_requires_missing"][1]
    assert "redis-server is not installed" in got["test_requires_missing"][1]
    assert "the frobnicator is not installed" in got["test_fixture_missing"][1]
    # the development data is required only where .ci/run found it beside the checkout
    for name in SHARED:
        assert got[f"test_{name}"][0] == "skipped", (name, got)


def test_under_ci_with_the_shared_data_required_its_absence_fails(tmp_path: Path) -> None:
    got = outcomes(tmp_path, CI="1", AGENTSPEC_REQUIRE_SHARED="1")
    for name in SHARED:
        kind, message = got[f"test_{name}"]
        assert kind in ("failure", "error"), (name, got)
        assert "no-such-folder" in message


def test_an_empty_ci_variable_is_not_ci(tmp_path: Path) -> None:
    got = outcomes(tmp_path, CI="", AGENTSPEC_REQUIRE_SHARED="1")
    for name in MISSING + SHARED:
        assert got[f"test_{name}"][0] == "skipped", (name, got)


def test_ci_run_exports_ci_and_requires_the_shared_data_it_finds() -> None:
    """.ci/run sets the variables the rule reads, before it runs anything."""
    text = (TESTS.parent / ".ci" / "run").read_text()
    assert "\nexport CI=1\n" in text
    assert "if [[ -d ../shared/data ]]; then\n    export AGENTSPEC_REQUIRE_SHARED=1\n" in text
    assert text.index("export CI=1") < text.index("exec bash scripts/test")
