"""``GET /metrics`` of the embedded engine's server, on the real SmolLM2-135M model.

The per-stage counters scraped from the server equal the sums of the
responses' own ``agentspec`` counters; the route takes the shard routes'
keys; metrics can be turned off; each engine has a registry of its own.
"""

from __future__ import annotations

import http.client
import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentspec import metrics as m
from agentspec.protocol import DEFAULT_TENANT

MODEL = "smollm2-135m"
MAX_NEW = 16
KEY = "sk-metrics"
ADMIN = "sk-admin"
PROMPTS = {
    "count": "Count from 1 to 10, separated by commas.",
    "json": "Give me a JSON object with keys name and age for a person called Ann who is 30.",
}

Samples = dict[str, list[tuple[dict[str, str], float]]]


def _http(srv: Any, method: str, path: str, key: str | None, body: Any = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        if (resp.getheader("Content-Type") or "").startswith("application/json"):
            return resp.status, json.loads(raw)
        assert resp.getheader("Content-Type") == m.CONTENT_TYPE
        return resp.status, raw
    finally:
        conn.close()


def _chat(srv: Any, key: str | None, stage: str, pipeline: str = "demo") -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[stage]}],
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "vllm_xargs": {"agentspec_stage": stage, "agentspec_pipeline": pipeline},
    }
    status, obj = _http(srv, "POST", "/v1/chat/completions", key, body)
    assert status == 200, obj
    return obj  # type: ignore[no-any-return]


def _scrape(srv: Any, key: str | None) -> Samples:
    status, raw = _http(srv, "GET", "/metrics", key)
    assert status == 200, raw
    out: Samples = defaultdict(list)
    for family in text_string_to_metric_families(raw.decode()):
        for sample in family.samples:
            out[sample.name].append((sample.labels, sample.value))
    return out


def _value(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for got, v in samples.get(name, []) if labels.items() <= got.items())


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Any]) -> Any:
    from agentspec.engine import EngineOptions

    return start_server(EngineOptions(default_max_tokens=MAX_NEW, metrics=True), api_key=KEY)


def test_per_stage_counters_equal_the_responses_own(server: Any) -> None:
    from agentspec import ShardPusher, ShardStore

    responses: dict[str, list[dict[str, Any]]] = {stage: [] for stage in PROMPTS}
    for _ in range(3):  # the repeats draft from what the first one learned
        for stage in PROMPTS:
            responses[stage].append(_chat(server, KEY, stage))
    # a pushed shard, for the push and shard families
    store = ShardStore()
    pusher = ShardPusher(store, [server.url], api_key=KEY)
    try:
        store.learn((DEFAULT_TENANT, "demo", "pushed"), list(range(100, 140)))
        assert pusher.flush(30)
    finally:
        pusher.close()
        store.close()

    got = _scrape(server, KEY)
    total_steps = 0
    for stage, answers in responses.items():
        key = {"tenant": DEFAULT_TENANT, "pipeline": "demo", "stage": stage}
        usage = [a["agentspec"] for a in answers]
        steps = sum(u["steps"] for u in usage)
        accepted = sum(u["accepted"] for u in usage)
        total_steps += steps
        assert _value(got, m.REQUESTS_TOTAL, **key) == len(answers)
        assert _value(got, m.VERIFY_STEPS_TOTAL, **key) == steps
        assert _value(got, m.DRAFT_TOKENS_TOTAL, **key) == sum(u["drafted"] for u in usage)
        assert _value(got, m.ACCEPTED_TOKENS_TOTAL, **key) == accepted
        assert _value(got, m.ACCEPTED_TOKENS_PER_POSITION_TOTAL, **key) == accepted
        drafts = _value(got, m.DRAFTS_TOTAL, **key)
        assert 0 < drafts <= steps
        assert _value(got, m.TOKENS_PER_STEP + "_count", stage=stage) == steps
        assert _value(got, m.TOKENS_PER_STEP + "_sum", stage=stage) == sum(
            a["usage"]["completion_tokens"] for a in answers
        )
    # the repeated prompts drafted from the learned shards (a cold stage shard's
    # pipeline tree stands in for it), and were accepted
    learned = sum(_value(got, m.DRAFTS_TOTAL, source=s) for s in ("stage", "pipeline"))
    assert learned > 0
    assert {s["source"] for s, _ in got[m.DRAFTS_TOTAL]} <= set(m.DRAFT_SOURCES)
    assert _value(got, m.ACCEPTED_TOKENS_TOTAL) > 0
    assert _value(got, m.ACCEPTED_TOKENS_PER_POSITION_TOTAL, position="0") > 0
    assert _value(got, m.STEP_SECONDS + "_count") == total_steps
    # the goodput controller, the shards, the pushes
    assert _value(got, m.GOODPUT_OFFERED_TOKENS_TOTAL) >= _value(got, m.GOODPUT_KEPT_TOKENS_TOTAL)
    assert {s["term"] for s, _ in got[m.STEP_COST_COEFFICIENT_SECONDS]} == {
        "per_step",
        "per_request",
        "per_token",
    }
    assert _value(got, m.SHARDS, kind="learned") == len(PROMPTS)
    assert _value(got, m.SHARD_TOKENS, kind="learned", stage="count") > 0
    assert _value(got, m.SHARD_BYTES, kind="learned", stage="count") > 0
    assert _value(got, m.SHARDS, kind="pushed") == 1
    assert _value(got, m.SHARD_TOKENS, kind="pushed", stage="pushed") == 40
    assert _value(got, m.PUSHES_TOTAL, result="accepted") >= 1
    assert _value(got, m.PUSHES_TOTAL, result="refused") == 0
    assert _value(got, m.SHARD_BUDGET_BYTES, kind="pushed") == server.intake.max_bytes


def test_metrics_take_the_api_key(server: Any) -> None:
    assert _http(server, "GET", "/metrics", None)[0] == 401
    assert _http(server, "GET", "/metrics", "sk-wrong")[0] == 401
    assert _http(server, "POST", "/metrics", KEY, {})[0] == 405


def test_with_tenant_keys_only_the_admin_key_reads_metrics(start_server: Any) -> None:
    from agentspec.engine import EngineOptions

    keys = {"sk-a": "team-a"}
    opts = EngineOptions(default_max_tokens=4, metrics=True)
    srv = start_server(opts, api_key=KEY, tenant_keys=keys, admin_key=ADMIN)
    assert _http(srv, "GET", "/metrics", ADMIN)[0] == 200
    assert _http(srv, "GET", "/metrics", "sk-a")[0] == 403  # a tenant sees no other tenant
    assert _http(srv, "GET", "/metrics", KEY)[0] == 403
    assert _http(srv, "GET", "/metrics", None)[0] == 401
    closed = start_server(opts, tenant_keys=keys)  # no admin key: closed, as the shard routes
    assert _http(closed, "GET", "/metrics", "sk-a")[0] == 403


def test_each_engine_has_its_own_registry(server: Any, start_server: Any) -> None:
    from agentspec.engine import EngineOptions

    other = start_server(EngineOptions(default_max_tokens=4, metrics=True))
    assert other.engine.metrics.registry is not server.engine.metrics.registry
    _chat(other, None, "count", pipeline="elsewhere")
    assert _value(_scrape(other, None), m.REQUESTS_TOTAL, pipeline="elsewhere") == 1
    assert _value(_scrape(server, KEY), m.REQUESTS_TOTAL, pipeline="elsewhere") == 0


def test_metrics_off(start_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentspec.engine import EngineOptions

    srv = start_server(EngineOptions(default_max_tokens=4, metrics=False))
    assert srv.engine.metrics is None
    _chat(srv, None, "count")
    status, obj = _http(srv, "GET", "/metrics", None)
    assert status == 404, obj
    monkeypatch.setenv(m.ENV_METRICS, "0")
    assert EngineOptions().metrics is False
    monkeypatch.setenv(m.ENV_METRICS, "1")
    assert EngineOptions().metrics is True
