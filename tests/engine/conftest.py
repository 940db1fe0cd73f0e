"""Fixtures of the engine tests: the real model, and servers over it.

`model_tok` loads the default model once per test module; `start_server`
starts `EngineServer`\\ s over it and stops them (and closes their engines)
when the module's tests are done.  A module's own ``server`` fixture is one
line: ``return start_server(EngineOptions(default_max_tokens=32))``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prereq import missing, require_module


def load_default_model() -> tuple[Any, Any]:
    """A fresh load of the default model (SmolLM2-135M) and its tokenizer.

    Without torch, transformers or the model's download: a skip, a failure under CI
    (tests/prereq.py).  One torch thread: the test machines' cores are shared, and
    OpenMP oversubscription makes every step slower.
    """
    torch = require_module("torch")
    require_module("transformers")
    from agentspec.models import ModelDownloadError, ensure_default_model, load_model

    torch.set_num_threads(1)
    try:
        path = ensure_default_model()
    except ModelDownloadError as exc:
        missing(f"cannot download the default model here: {exc}")
    return load_model(path)


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    """The default model and its tokenizer, loaded once per test module (an engine
    started over it packs it for the CPU in place: `agentspec.engine.optimize_for_cpu`)."""
    return load_default_model()


@pytest.fixture(scope="session")
def load_model_copy() -> Callable[[], tuple[Any, Any]]:
    """``load()``: a fresh copy of the default model and its tokenizer, for tests that
    compare the model as loaded with one changed in place."""
    return load_default_model


@pytest.fixture(scope="module")
def start_server(model_tok: tuple[Any, Any]) -> Iterator[Callable[..., Any]]:
    """``start(options=None, **create_kwargs)``: a started `EngineServer` over `model_tok`.

    Every server it started is stopped, and its engine closed, after the module.
    """
    from agentspec.engine import EngineOptions, EngineServer

    started: list[EngineServer] = []

    def start(options: EngineOptions | None = None, **kwargs: Any) -> EngineServer:
        srv = EngineServer.create(*model_tok, options, **kwargs)
        started.append(srv)
        srv.start()
        return srv

    try:
        yield start
    finally:
        for srv in reversed(started):
            srv.stop()
            srv.engine.close()
