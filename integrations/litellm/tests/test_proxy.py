"""A real LiteLLM proxy with the agentspec hook in front of a real engine (SmolLM2-135M).

What reaches the engine is read from the recording `Forwarder`; what was
learned from the hook's stats file; what was pushed from the engine's own
shard list.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import CUSTOM_AUTH, proxy_config
from harness import Forwarder, Process, read_json, start_proxy, wait_for

MESSAGES = [{"role": "user", "content": "Name three colors, comma separated."}]


_clients: list[openai.OpenAI] = []


def client(proxy: Process, key: str = "sk-team-a") -> openai.OpenAI:
    """An openai client of the proxy, closed after the test (no socket left to the GC)."""
    c = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=key, max_retries=0, timeout=180)
    _clients.append(c)
    return c


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _clients:
        _clients.pop().close()


def shard(stats: dict[str, Any] | None, tenant: str, stage: str) -> dict[str, Any] | None:
    for s in (stats or {}).get("shards", ()):
        if s["key"] == [tenant, None, stage]:
            return dict(s)
    return None


def wait_shard(proxy_dir: Path, tenant: str, stage: str, sequences: int) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        s = shard(read_json(proxy_dir / "stats.json"), tenant, stage)
        return s if s is not None and s["sequences"] >= sequences else None

    found: dict[str, Any] = wait_for(ready, 60, f"shard ({tenant}, {stage}) with {sequences}")
    return found


def last_upstream(forwarder: Forwarder, before: int) -> dict[str, Any]:
    bodies = forwarder.completions()
    assert len(bodies) == before + 1, f"expected one upstream call, got {len(bodies) - before}"
    return bodies[-1]


def test_tags_reach_upstream_and_deployment_extra_body_is_kept(
    proxy: Process, forwarder: Forwarder
) -> None:
    before = len(forwarder.completions())
    resp = client(proxy).chat.completions.create(
        model="smol",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
        extra_headers={
            "X-AgentSpec-Stage": "SQL",
            "X-AgentSpec-Session": "sess-1",
            "X-AgentSpec-Pipeline": "t2s",
        },
        extra_body={"vllm_xargs": {"agentspec_speculate": True}},
    )
    assert resp.choices[0].message.content
    body = last_upstream(forwarder, before)
    assert body["seed"] == 1234  # the deployment's extra_body survived
    assert body["vllm_xargs"] == {
        "deployment_marker": "d1",  # the deployment's vllm_xargs survived
        "agentspec_speculate": True,  # the client's own vllm_xargs survived
        "agentspec_tenant": "team-a",
        "agentspec_session": "sess-1",
        "agentspec_stage": "SQL",
        "agentspec_pipeline": "t2s",
    }
    assert body["return_token_ids"] is True  # asked by the hook ...
    dumped = resp.model_dump()  # ... and removed from the client's answer
    assert dumped.get("prompt_token_ids") is None
    assert "token_ids" not in json.dumps(dumped["choices"])


def test_streamed_and_non_streamed_outputs_are_learned_and_pushed(
    proxy: Process, proxy_dir: Path, engine: Process
) -> None:
    c = client(proxy)
    expected_tokens = 0
    for topic in ("colors", "fruits"):
        resp = c.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": f"Name three {topic}."}],
            max_tokens=12,
            temperature=0,
            extra_headers={"X-AgentSpec-Stage": "Learn-NS"},
        )
        assert resp.usage is not None
        expected_tokens += min(8, resp.usage.prompt_tokens) + resp.usage.completion_tokens
    learned = wait_shard(proxy_dir, "team-a", "Learn-NS", 2)
    assert learned["sequences"] == 2
    assert learned["tokens"] == expected_tokens  # prompt lead + every generated token

    stream = c.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Name three animals."}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-AgentSpec-Stage": "Learn-S"},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    assert text
    assert usage is not None
    learned = wait_shard(proxy_dir, "team-a", "Learn-S", 1)
    assert learned["sequences"] == 1
    assert learned["tokens"] == usage.completion_tokens  # streams carry no prompt ids

    def pushed() -> dict[str, Any] | None:
        with urllib.request.urlopen(f"{engine.url}/v1/agentspec/shards", timeout=10) as r:
            shards = json.load(r)["shards"]
        for s in shards:
            if (s["tenant"], s["stage"]) == ("team-a", "Learn-NS") and s["sequences"] == 2:
                return dict(s)
        return None

    worker = wait_for(pushed, 60, "the Learn-NS shard on the engine")
    assert worker["tokens"] == expected_tokens


def test_a_stream_the_client_drops_is_counted_not_learned(proxy: Process, proxy_dir: Path) -> None:
    def unfinished() -> int:
        counters = (read_json(proxy_dir / "stats.json") or {}).get("counters", {})
        return int(counters.get("unfinished_streams", 0))

    before = unfinished()
    stream = client(proxy).chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Count from 1 to 500, separated by commas."}],
        max_tokens=256,
        temperature=0,
        stream=True,
        extra_headers={"X-AgentSpec-Stage": "Dropped"},
    )
    got = 0
    for chunk in stream:
        assert not (chunk.choices and chunk.choices[0].finish_reason), "finished too soon"
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 3:
            break
    stream.close()  # the client goes away mid-stream: its connection is closed
    wait_for(lambda: unfinished() > before, 60, "the dropped stream to be counted")
    assert unfinished() == before + 1
    assert shard(read_json(proxy_dir / "stats.json"), "team-a", "Dropped") is None


def test_text_completions_are_tagged_and_learned(
    proxy: Process, proxy_dir: Path, forwarder: Forwarder
) -> None:
    before = len(forwarder.completions())
    resp = client(proxy).completions.create(
        model="smol",
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        extra_headers={"X-AgentSpec-Stage": "Text"},
    )
    assert resp.choices[0].text
    assert last_upstream(forwarder, before)["vllm_xargs"]["agentspec_stage"] == "Text"
    assert resp.usage is not None
    learned = wait_shard(proxy_dir, "team-a", "Text", 1)
    lead = min(8, resp.usage.prompt_tokens)
    assert learned["tokens"] == lead + resp.usage.completion_tokens


def test_client_asking_for_token_ids_keeps_them(proxy: Process) -> None:
    resp = client(proxy).chat.completions.create(
        model="smol",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    dumped = resp.model_dump()
    ids = dumped["choices"][0]["provider_specific_fields"]["token_ids"]
    assert resp.usage is not None
    assert len(ids) == resp.usage.completion_tokens
    assert len(dumped["prompt_token_ids"]) == resp.usage.prompt_tokens


def test_a_key_cannot_write_into_another_tenants_shard(
    proxy: Process, proxy_dir: Path, forwarder: Forwarder
) -> None:
    before = len(forwarder.completions())
    client(proxy, key="sk-team-b").chat.completions.create(
        model="smol",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_headers={"X-AgentSpec-Stage": "Spoof"},
        extra_body={
            "vllm_xargs": {"agentspec_tenant": "team-a"},
            "metadata": {"agentspec_tenant": "team-a"},
        },
    )
    assert last_upstream(forwarder, before)["vllm_xargs"]["agentspec_tenant"] == "team-b"
    wait_shard(proxy_dir, "team-b", "Spoof", 1)
    assert shard(read_json(proxy_dir / "stats.json"), "team-a", "Spoof") is None


def test_untagged_call_gets_the_default_stage_and_litellm_session(
    proxy: Process, forwarder: Forwarder
) -> None:
    before = len(forwarder.completions())
    client(proxy).chat.completions.create(
        model="smol",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        extra_headers={"x-litellm-session-id": "conv-abcdef12"},
    )
    xargs = last_upstream(forwarder, before)["vllm_xargs"]
    assert xargs["agentspec_stage"] == "main"  # default_stage of the model group
    assert xargs["agentspec_session"] == "conv-abcdef12"


def test_a_bad_tag_is_dropped_and_counted_not_fatal(
    proxy: Process, proxy_dir: Path, forwarder: Forwarder
) -> None:
    before = len(forwarder.completions())
    resp = client(proxy).chat.completions.create(
        model="smol",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        extra_headers={"X-AgentSpec-Stage": "x" * 200},
    )
    assert resp.choices[0].message.content is not None
    assert last_upstream(forwarder, before)["vllm_xargs"]["agentspec_stage"] == "main"
    wait_for(
        lambda: (read_json(proxy_dir / "stats.json") or {}).get("counters", {}).get("tag_problems"),
        30,
        "the tag problem to be counted",
    )


#: Bad values a client may put in its own vllm_xargs (the tag, and a bad request identity).
BAD_XARGS = {
    "empty": ("", ""),
    "10 kB": ("x" * 10_000, "r" * 10_000),
    "control characters": ("a\x00b\nc", "r" * 300),  # an identity may hold controls
    "object": ({"an": "object"}, {"an": "object"}),
}


@pytest.mark.parametrize("bad", list(BAD_XARGS.values()), ids=list(BAD_XARGS))
def test_a_bad_tag_in_the_clients_vllm_xargs_is_dropped_not_sent(
    proxy: Process, proxy_dir: Path, forwarder: Forwarder, bad: tuple[Any, Any]
) -> None:
    def problems() -> int:
        counters = (read_json(proxy_dir / "stats.json") or {}).get("counters", {})
        return int(counters.get("tag_problems", 0))

    tag, identity = bad
    counted = problems()
    before = len(forwarder.completions())
    resp = client(proxy).chat.completions.create(
        model="smol",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        extra_body={
            "vllm_xargs": {
                "agentspec_stage": tag,
                "agentspec_session": tag,
                "agentspec_pipeline": tag,
                "agentspec_request_id": identity,
                "agentspec_speculate": True,
            }
        },
    )
    assert resp.choices[0].message.content is not None
    assert last_upstream(forwarder, before)["vllm_xargs"] == {
        "deployment_marker": "d1",
        "agentspec_speculate": True,
        "agentspec_tenant": "team-a",
        "agentspec_stage": "main",  # the default stage of the model group
    }
    wait_for(lambda: problems() >= counted + 4, 30, "the four problems to be counted")


def test_a_failing_store_does_not_fail_requests(
    tmp_path: Path, forwarder: Forwarder, served_model: str
) -> None:
    not_a_dir = tmp_path / "store"
    not_a_dir.write_text("a file where the store directory should be")
    hook = {"store": str(not_a_dir), "stats_file": str(tmp_path / "stats.json")}
    with start_proxy(
        tmp_path / "p",
        proxy_config(forwarder.url, served_model),
        hook,
        **{"custom_auth.py": CUSTOM_AUTH},
    ) as proxy:
        c = client(proxy)
        resp = c.chat.completions.create(
            model="smol",
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
        )
        assert resp.choices[0].message.content
        chunks = list(
            c.chat.completions.create(
                model="smol",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=6,
                temperature=0,
                stream=True,
            )
        )
        assert any(ch.choices and ch.choices[0].delta.content for ch in chunks)

        def counted() -> dict[str, int] | None:
            counters = (read_json(tmp_path / "stats.json") or {}).get("counters", {})
            return counters if counters.get("not_stored", 0) >= 2 else None

        counters = wait_for(counted, 30, "both answers to be counted")
        assert counters["errors.store_open"] == 1
        assert counters["requests"] == 2
    assert not_a_dir.read_text().startswith("a file")  # untouched


@pytest.mark.parametrize("bad", ["not json", '{"model": "smol"}'])
def test_the_proxy_still_answers_bad_client_input(proxy: Process, bad: str) -> None:
    req = urllib.request.Request(
        f"{proxy.url}/v1/chat/completions",
        data=bad.encode(),
        headers={"Authorization": "Bearer sk-team-a", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    info.value.close()
    assert 400 <= info.value.code < 500
