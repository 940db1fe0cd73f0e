"""Fixtures of the operations tests: the real model, and real Prometheus servers.

`model_tok` loads the default model once per module (as in tests/engine);
`start_prometheus` starts `PrometheusServer`\\ s (Debian's ``prometheus``
binary, see tests/prometheus_server.py) and stops them after the module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_server import PrometheusServer


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    """The default model (SmolLM2-135M) and its tokenizer; skips without torch or transformers."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from agentspec.models import ensure_default_model, load_model

    torch.set_num_threads(1)
    return load_model(ensure_default_model())


@pytest.fixture(scope="module")
def start_prometheus() -> Iterator[Callable[..., PrometheusServer]]:
    """``start(jobs, rule_files=())``: a started `PrometheusServer`, closed after the module."""
    started: list[PrometheusServer] = []

    def start(*args: Any, **kwargs: Any) -> PrometheusServer:
        srv = PrometheusServer(*args, **kwargs)
        started.append(srv)
        return srv.start()

    try:
        yield start
    finally:
        for srv in reversed(started):
            srv.close()
