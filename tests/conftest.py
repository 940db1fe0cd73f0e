"""pytest configuration shared by all tests: the `slow` marker, the real model fixture."""

from __future__ import annotations

from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Register the `slow` marker (also declared in pyproject.toml) for any rootdir."""
    config.addinivalue_line(
        "markers",
        "slow: long-running test (real traces, large property runs); deselect with -m 'not slow'",
    )


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    """The default model (SmolLM2-135M) and its tokenizer, loaded once per test module.

    Skips without torch or transformers.  One torch thread: the test machines'
    cores are shared, and OpenMP oversubscription makes every step slower.
    """
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from agentspec.models import ensure_default_model, load_model

    torch.set_num_threads(1)
    return load_model(ensure_default_model())
