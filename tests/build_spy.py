"""`BuildSpy`: counts the native calls that validate, build or load shard bytes.

The intake tests use it to show that a refusal came before any work on the
body (a wrong depth, a budget the header already rules out), without timing.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentspec._core import lowlevel


class BuildSpy:
    """Counts every native call that validates, builds or loads shard bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in ("tree_from_bytes", "tree_load", "shard_max_token", "tree_create"):
            real = getattr(lowlevel, name)

            def spy(*args: Any, _real: Any = real, _name: str = name) -> Any:
                self.calls.append(_name)
                return _real(*args)

            monkeypatch.setattr(lowlevel, name, spy)
