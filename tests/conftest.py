"""pytest configuration shared by all tests: the `slow` marker, the prerequisite rule.

The rule for a missing prerequisite (skip outside CI, fail under it) is the
plugin `prereq` (tests/prereq.py).  The real model fixture (`model_tok`) is in
tests/engine/conftest.py, where it is used.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["prereq"]


def pytest_configure(config: pytest.Config) -> None:
    """Register the `slow` marker (also declared in pyproject.toml) for any rootdir."""
    config.addinivalue_line(
        "markers",
        "slow: long-running test (real traces, large property runs); deselect with -m 'not slow'",
    )
