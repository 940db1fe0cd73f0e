"""Fixtures: one embedded engine, a recording forwarder in front of it, one LiteLLM proxy.

The engine runs under ``$AGENTSPEC_ENGINE_PYTHON`` (scripts/test-litellm sets
it to the main environment's Python, which has ``agentspec[local]``).  The
proxy authenticates with a ``custom_auth`` function mapping two API keys to
two teams, and the hook takes the tenant from the team.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# The main suite's helpers (`redis_server`: a real redis-server per test) are imported
# from its folder, not copied; appended, so this folder's own modules come first.
sys.path.append(str(Path(__file__).resolve().parents[3] / "tests"))

from harness import ENGINE_PYTHON_ENV, Forwarder, Process, start_engine, start_proxy
from prereq import missing

pytest_plugins = ["prereq"]

KEYS = {"sk-team-a": "team-a", "sk-team-b": "team-b"}
#: The proxy's admin key (LiteLLM refuses to start without a strong one).
MASTER_KEY = "sk-" + hashlib.sha256(b"agentspec-litellm-tests").hexdigest()

CUSTOM_AUTH = f"""
from litellm.proxy._types import UserAPIKeyAuth

TEAMS = {KEYS!r}


async def user_api_key_auth(request, api_key):
    key = api_key.removeprefix("Bearer ").strip()
    if key not in TEAMS:
        raise Exception("unknown API key")
    return UserAPIKeyAuth(api_key=key, team_id=TEAMS[key])
"""

#: Fields of the deployment's extra_body that must survive the hook's merge.
DEPLOYMENT_EXTRA_BODY = {"seed": 1234, "vllm_xargs": {"deployment_marker": "d1"}}


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """The embedded engine (SmolLM2-135M), shared by every test."""
    if not os.environ.get(ENGINE_PYTHON_ENV):
        missing(
            f"${ENGINE_PYTHON_ENV} is not set: it must name a Python with agentspec[local] "
            "(scripts/test-litellm sets it)"
        )
    with start_engine(tmp_path_factory.mktemp("engine")) as server:
        yield server


@pytest.fixture(scope="session")
def served_model(engine: Process) -> str:
    """The name the engine serves its model under."""
    with urllib.request.urlopen(f"{engine.url}/v1/models", timeout=10) as resp:
        return str(json.load(resp)["data"][0]["id"])


@pytest.fixture(scope="session")
def forwarder(engine: Process) -> Iterator[Forwarder]:
    """Records what reaches the engine."""
    fwd = Forwarder(engine.url)
    try:
        yield fwd
    finally:
        fwd.close()


def proxy_config(upstream: str, served_model: str) -> dict[str, Any]:
    """A proxy config with one deployment ``smol`` on ``upstream`` and the hook."""
    return {
        "model_list": [
            {
                "model_name": "smol",
                "litellm_params": {
                    "model": f"hosted_vllm/{served_model}",
                    "api_base": f"{upstream}/v1",
                    "api_key": "none",
                    "extra_body": DEPLOYMENT_EXTRA_BODY,
                },
            }
        ],
        # prometheus: LiteLLM serves the default registry on /metrics (the hook's metrics too)
        "litellm_settings": {
            "callbacks": ["agentspec_litellm.proxy_handler_instance", "prometheus"]
        },
        "general_settings": {
            "custom_auth": "custom_auth.user_api_key_auth",
            "master_key": MASTER_KEY,
        },
    }


@pytest.fixture(scope="session")
def proxy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Working directory of the main proxy (store, stats file, logs)."""
    return tmp_path_factory.mktemp("proxy")


@pytest.fixture(scope="session")
def proxy(proxy_dir: Path, forwarder: Forwarder, served_model: str) -> Iterator[Process]:
    """The main proxy: store + push to the engine, tenant from the team of the key."""
    hook = {
        "store": str(proxy_dir / "store"),
        "stats_file": str(proxy_dir / "stats.json"),
        "tenant_from": "team",
        "default_stage": {"smol": "main"},
        "push": "auto",
    }
    with start_proxy(
        proxy_dir,
        proxy_config(forwarder.url, served_model),
        hook,
        **{"custom_auth.py": CUSTOM_AUTH},
    ) as server:
        yield server
