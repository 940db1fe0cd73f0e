"""The hook's Prometheus metrics on a real LiteLLM proxy's ``/metrics``.

The session's proxy runs with ``callbacks: [agentspec_litellm.proxy_handler_instance,
prometheus]``: LiteLLM then serves ``prometheus_client``'s default registry on
``/metrics``, where the hook registered its collector.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from harness import Process, read_json, wait_for
from prometheus_client.parser import text_string_to_metric_families

STAGE = ("team-b", "mp", "Metrics-A")


def scrape(proxy: Process) -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float], set[str]]:
    # LiteLLM authenticates /metrics like its other routes unless
    # `require_auth_for_metrics_endpoint: false`.
    req = urllib.request.Request(
        f"{proxy.url}/metrics", headers={"Authorization": "Bearer sk-team-b"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    samples = {}
    families = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, families


def key_series(name: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    tenant, pipeline, stage = STAGE
    return (name, (("pipeline", pipeline), ("stage", stage), ("tenant", tenant)))


def learned(proxy_dir: Path) -> int:
    for s in (read_json(proxy_dir / "stats.json") or {}).get("shards", ()):
        if s["key"] == list(STAGE):
            return int(s["sequences"])
    return 0


def test_hook_metrics_on_the_proxys_metrics(proxy: Process, proxy_dir: Path) -> None:
    calls = 2
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-team-b", max_retries=0) as c:
        for i in range(calls):
            resp = c.chat.completions.create(
                model="smol",
                messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                max_tokens=8,
                temperature=0,
                extra_headers={"X-AgentSpec-Stage": STAGE[2], "X-AgentSpec-Pipeline": STAGE[1]},
            )
            assert resp.choices[0].message.content
    wait_for(lambda: learned(proxy_dir) >= calls, 60, "the answers learned")

    def caught_up() -> Any:
        samples, families = scrape(proxy)
        done = samples.get(key_series("agentspec_litellm_learned_sequences_total")) == calls
        return (samples, families) if done else None

    samples, families = wait_for(caught_up, 60, "learned sequences on /metrics")
    assert samples[key_series("agentspec_litellm_calls_total")] == calls
    assert samples[("agentspec_litellm_learn_queue_depth", ())] == 0
    for name in (
        "agentspec_litellm_push_backlog",
        "agentspec_litellm_push_failures_total",
        "agentspec_litellm_publish_backlog",
        "agentspec_litellm_learn_dropped_total",
    ):
        assert (name, ()) in samples, name
    # LiteLLM's own metrics are in the same scrape: this is the proxy's /metrics.
    assert any(f.startswith("litellm_") for f in families), sorted(families)[:20]
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{proxy.url}/metrics", timeout=30)
    assert refused.value.code == 401
    refused.value.close()
