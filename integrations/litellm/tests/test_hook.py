"""AgentSpecHook in-process: the vllm_xargs merge, learning, and errors contained and counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from litellm.types.utils import ModelResponse

from agentspec import ShardStore
from agentspec_litellm import AgentSpecHook
from agentspec_litellm.hook import merge_xargs

KEY = SimpleNamespace(token=None, api_key=None, team_id=None, key_alias=None, user_id=None)


def test_merge_keeps_deployment_and_client_fields_and_mutates_nothing() -> None:
    deployment = {"seed": 1, "vllm_xargs": {"dep": 1, "agentspec_stage": "old"}}
    kwargs = {"extra_body": deployment, "vllm_xargs": {"client": 2}, "model": "m"}
    out = merge_xargs(kwargs, {"agentspec_stage": "SQL", "agentspec_tenant": "t"})
    expected = {"dep": 1, "client": 2, "agentspec_stage": "SQL", "agentspec_tenant": "t"}
    assert out["extra_body"] == {"seed": 1, "vllm_xargs": expected}
    assert out["vllm_xargs"] == expected
    assert out["model"] == "m"
    assert deployment == {"seed": 1, "vllm_xargs": {"dep": 1, "agentspec_stage": "old"}}
    assert kwargs["vllm_xargs"] == {"client": 2}
    assert merge_xargs({}, {"agentspec_tenant": "t"})["extra_body"] == {
        "vllm_xargs": {"agentspec_tenant": "t"}
    }


def request(stage: str) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "proxy_server_request": {"headers": {"x-agentspec-stage": stage}},
    }


def answer(ids: list[int]) -> ModelResponse:
    return ModelResponse(
        choices=[
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "x"},
                "provider_specific_fields": {"token_ids": ids},
            }
        ],
        prompt_token_ids=list(range(100, 120)),
    )


def test_learns_behind_the_prompt_lead_and_strips_ids(tmp_path: Path) -> None:
    hook = AgentSpecHook({"store": str(tmp_path / "s"), "push": [], "lead_tokens": 4})
    try:
        data = asyncio.run(hook.async_pre_call_hook(KEY, None, request("SQL"), "acompletion"))
        assert data["return_token_ids"] is True
        deployment = asyncio.run(hook.async_pre_call_deployment_hook(dict(data), None))
        assert deployment is not None
        assert deployment["vllm_xargs"] == {"agentspec_tenant": "default", "agentspec_stage": "SQL"}
        resp = answer([7, 8, 9])
        asyncio.run(hook.async_post_call_success_hook(data, KEY, resp))
        assert resp.model_dump().get("prompt_token_ids") is None
        assert hook.flush(10)
    finally:
        hook.close()
    with ShardStore(tmp_path / "s") as store:
        tree = store.tree(("default", None, "SQL"))
        assert tree is not None
        assert [list(tree.sequence(i)) for i in tree.sequence_ids()] == [
            [116, 117, 118, 119, 7, 8, 9]
        ]
    assert hook.counters.snapshot()["learned"] == 1


def test_hook_errors_never_reach_the_request(tmp_path: Path) -> None:
    hook = AgentSpecHook({"store": str(tmp_path / "s"), "push": []})
    try:
        weird = {"model": 3, "metadata": "not a dict", "proxy_server_request": 7}
        out = asyncio.run(hook.async_pre_call_hook(KEY, None, weird, "acompletion"))
        assert out is weird
        data = asyncio.run(hook.async_pre_call_hook(KEY, None, request("S"), "acompletion"))
        asyncio.run(hook.async_post_call_success_hook(data, KEY, object()))  # unreadable answer

        async def chunks() -> AsyncIterator[Any]:
            for c in (object(), "also not a chunk", 3):
                yield c

        async def drain() -> list[Any]:
            gen = hook.async_post_call_streaming_iterator_hook(KEY, chunks(), data)
            return [c async for c in gen]

        got = asyncio.run(drain())
        assert got[1:] == ["also not a chunk", 3]  # every chunk passed on unchanged
        counters = hook.counters.snapshot()
        assert counters["errors.post_call"] == 1
        assert counters["errors.stream"] == 1
    finally:
        hook.close()


def test_other_call_types_are_left_alone() -> None:
    hook = AgentSpecHook({"push": []})
    data = {"model": "m", "input": "x"}
    assert asyncio.run(hook.async_pre_call_hook(KEY, None, data, "aembedding")) == {
        "model": "m",
        "input": "x",
    }
    assert hook.counters.snapshot() == {}


def test_a_bad_config_leaves_a_tagging_hook(tmp_path: Path) -> None:
    hook = AgentSpecHook({"store": str(tmp_path / "s"), "tenant_from": "nope"})
    try:
        data = asyncio.run(hook.async_pre_call_hook(KEY, None, request("S"), "acompletion"))
        assert data["metadata"]["agentspec"]["stage"] == "S"
        assert hook.counters.snapshot()["errors.config"] == 1
        assert not (tmp_path / "s").exists()  # the defaults: no store
    finally:
        hook.close()
