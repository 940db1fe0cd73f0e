"""A real LiteLLM proxy as a user runs it: stock auth (only ``master_key``), the hook's
warnings in the proxy's own log, and a wrong settings file stopping its start."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import MASTER_KEY, proxy_config
from harness import Forwarder, Process, failed_proxy_start, start_proxy, wait_for

from agentspec_litellm.proxy_log import LITELLM_PROXY_LOGGER, forward_to_litellm


def stock_config(upstream: str, served_model: str) -> dict[str, Any]:
    """The proxy config of the docs: a master key, no custom_auth."""
    config = proxy_config(upstream, served_model)
    config["general_settings"] = {"master_key": MASTER_KEY}
    return config


@pytest.fixture(scope="module")
def stock_proxy(
    tmp_path_factory: pytest.TempPathFactory, forwarder: Forwarder, served_model: str
) -> Iterator[Process]:
    """Tenants from the key: the master key maps to ``admins``."""
    hook = {
        "tenant_from": "key",
        "tenant_keys": {MASTER_KEY: "admins", "sk-some-virtual-key": "acme"},
        "push": [],
    }
    workdir = tmp_path_factory.mktemp("stock")
    with start_proxy(workdir, stock_config(forwarder.url, served_model), hook) as server:
        yield server


def test_the_master_key_maps_to_its_tenant(stock_proxy: Process, forwarder: Forwarder) -> None:
    before = len(forwarder.completions())
    with openai.OpenAI(
        base_url=f"{stock_proxy.url}/v1", api_key=MASTER_KEY, max_retries=0, timeout=180
    ) as client:
        resp = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=4,
            temperature=0,
            extra_headers={"X-AgentSpec-Stage": "Admin"},
            extra_body={"vllm_xargs": {"agentspec_tenant": "acme"}},  # not trusted
        )
    assert resp.choices[0].message.content is not None
    bodies = forwarder.completions()
    assert len(bodies) == before + 1
    assert bodies[-1]["vllm_xargs"]["agentspec_tenant"] == "admins"
    assert bodies[-1]["vllm_xargs"]["agentspec_stage"] == "Admin"


def test_the_hooks_warnings_reach_the_proxy_log(stock_proxy: Process) -> None:
    stage = "stage-with-a-typo-" + "x" * 200
    with openai.OpenAI(
        base_url=f"{stock_proxy.url}/v1", api_key=MASTER_KEY, max_retries=0, timeout=180
    ) as client:
        client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=2,
            temperature=0,
            extra_headers={"X-AgentSpec-Stage": stage},
        )

    def warned() -> str | None:
        lines = stock_proxy.log.read_text(errors="replace").splitlines()
        found = [line for line in lines if "agentspec_litellm_bad_tag" in line]
        return found[0] if found else None

    line = wait_for(warned, 30, "the hook's warning in the proxy's log")
    assert "WARNING" in line
    assert "header x-agentspec-stage: stage must have 1..128 characters" in line


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ("stor: /var/lib/agentspec/shards\n", "unknown agentspec LiteLLM config keys: stor"),
        ("lead_tokens: many\n", "lead_tokens must be an int >= 0, got 'many'"),
    ],
    ids=["unknown key", "wrong type"],
)
def test_a_wrong_settings_file_stops_the_proxys_start(
    tmp_path: Path, forwarder: Forwarder, served_model: str, settings: str, named: str
) -> None:
    config = stock_config(forwarder.url, served_model)
    rc, output = failed_proxy_start(tmp_path, config, settings, timeout=180)
    assert rc != 0
    assert f"{tmp_path / 'agentspec.yaml'}: {named}" in output


def test_forwarding_writes_the_events_fields_into_litellms_log() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep, target, ours = (
        Keep(),
        logging.getLogger(LITELLM_PROXY_LOGGER),
        logging.getLogger("agentspec"),
    )
    saved = list(ours.handlers)
    target.addHandler(keep)
    try:
        forward_to_litellm()
        forward_to_litellm()  # once is enough
        ours.warning("agentspec_litellm_error", extra={"where": "config", "error": "X"})
    finally:
        target.removeHandler(keep)
        ours.handlers[:] = saved
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.WARNING, "agentspec_litellm_error where='config' error='X'")
    ]
