"""Fixtures of the tests on real vLLM: one engine with the agentspec proposer per session."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The main suite's helpers (`prereq`: the rule for a missing prerequisite, `redis_server`)
# are imported from its folder; appended, so this folder's own modules come first.
sys.path.append(str(Path(__file__).resolve().parents[3] / "tests"))

from prereq import missing
from vllm_engines import VLLM_MISSING, make_llm, model_path, shutdown

pytest_plugins = ["prereq"]


@pytest.fixture(scope="session")
def default_model() -> str:
    """Folder of SmolLM2-135M-Instruct (skips the vLLM tests when vllm is missing)."""
    if VLLM_MISSING:
        missing("vllm is not importable (create .venv-vllm with scripts/setup-vllm)")
    return model_path()


@pytest.fixture(scope="session")
def spec_llm(default_model: str) -> Iterator[Any]:
    """An engine drafting with `AgentSpecProposer` (K=8) and the worker extension."""
    llm = make_llm(default_model, speculative=True)
    try:
        yield llm
    finally:
        shutdown(llm)
