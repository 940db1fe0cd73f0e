"""AgentSpecHook in-process: the vllm_xargs merge, learning, and errors contained and counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from litellm.types.utils import ModelResponse, ModelResponseStream

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


def test_merge_drops_agentspec_values_the_server_would_refuse() -> None:
    bad: dict[str, Any] = {
        "agentspec_stage": "",
        "agentspec_pipeline": "x" * 10_000,
        "agentspec_session": "a\x00b",
        "agentspec_tenant": {"an": "object"},
        "agentspec_request_id": "r" * 300,
    }
    out = merge_xargs({"vllm_xargs": {**bad, "agentspec_speculate": True, "own": ""}}, {})
    assert out["vllm_xargs"] == {"agentspec_speculate": True, "own": ""}  # other keys: as sent
    good = {"agentspec_stage": "S", "agentspec_request_id": "a\x00b"}
    assert merge_xargs({"vllm_xargs": good}, {})["vllm_xargs"] == good
    # a resolved tag replaces the client's bad one
    assert merge_xargs({"vllm_xargs": bad}, {"agentspec_stage": "main"})["vllm_xargs"] == {
        "agentspec_stage": "main"
    }


def test_a_bad_request_id_is_counted_without_a_fleet() -> None:
    hook = AgentSpecHook({"push": []})
    try:
        data = request("S")
        data["vllm_xargs"] = {"agentspec_request_id": "r" * 300}
        data = asyncio.run(hook.async_pre_call_hook(KEY, None, data, "acompletion"))
        assert "request_id" not in data["metadata"]["agentspec"]  # no fleet: none of its own
        assert hook.counters.snapshot()["tag_problems"] == 1
    finally:
        hook.close()


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


# --- how a stream ends: learned only when complete, otherwise counted ------------------


def stream_chunk(index: int = 0, finish: str | None = None, **delta: Any) -> ModelResponseStream:
    choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
    if delta.get("content"):
        choice["token_ids"] = [ord(c) for c in delta["content"]]
    return ModelResponseStream(id="s1", model="m", choices=[choice])


def full_stream() -> list[ModelResponseStream]:
    return [
        stream_chunk(role="assistant", content=""),
        stream_chunk(content="ab"),
        stream_chunk(content="cd"),
        stream_chunk(content="e"),
        stream_chunk(finish="stop"),
    ]


class Upstream:
    """An upstream stream: yields ``chunks``, then raises ``error`` or waits on ``hang``."""

    def __init__(
        self,
        chunks: list[ModelResponseStream],
        error: BaseException | None = None,
        hang: asyncio.Event | None = None,
    ) -> None:
        self.chunks = chunks
        self.error = error
        self.hang = hang
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[ModelResponseStream]:
        for c in self.chunks:
            self.sent += 1
            yield c
        if self.hang is not None:
            await self.hang.wait()
        if self.error is not None:
            raise self.error


def stream_hook(tmp_path: Path) -> tuple[AgentSpecHook, dict[str, Any]]:
    hook = AgentSpecHook({"store": str(tmp_path / "s"), "push": [], "lead_tokens": 0})
    data = asyncio.run(hook.async_pre_call_hook(KEY, None, request("S"), "acompletion"))
    return hook, data


def ended(hook: AgentSpecHook) -> dict[str, int]:
    assert hook.flush(10)
    counters = hook.counters.snapshot()
    return {k: counters.get(k, 0) for k in ("learned", "unfinished_streams", "errors")}


def test_a_stream_read_to_its_end_is_learned(tmp_path: Path) -> None:
    hook, data = stream_hook(tmp_path)
    try:

        async def drain() -> list[Any]:
            gen = hook.async_post_call_streaming_iterator_hook(KEY, Upstream(full_stream()), data)
            return [c async for c in gen]

        assert len(asyncio.run(drain())) == 5
        assert ended(hook) == {"learned": 1, "unfinished_streams": 0, "errors": 0}
    finally:
        hook.close()
    with ShardStore(tmp_path / "s") as store:
        tree = store.tree(("default", None, "S"))
        assert tree is not None
        assert [list(tree.sequence(i)) for i in tree.sequence_ids()] == [[97, 98, 99, 100, 101]]


def test_a_stream_the_client_drops_is_counted_not_learned(tmp_path: Path) -> None:
    hook, data = stream_hook(tmp_path)
    try:
        upstream = Upstream(full_stream())

        async def drop_after_three() -> None:
            gen = hook.async_post_call_streaming_iterator_hook(KEY, upstream, data)
            for _ in range(3):
                await gen.__anext__()
            await gen.aclose()  # the client went away: GeneratorExit at the hook's yield

        asyncio.run(drop_after_three())
        assert upstream.sent == 3
        assert ended(hook) == {"learned": 0, "unfinished_streams": 1, "errors": 0}
    finally:
        hook.close()
    with ShardStore(tmp_path / "s") as store:
        assert store.tree(("default", None, "S")) is None


def test_a_stream_dropped_after_its_finish_reason_is_complete(tmp_path: Path) -> None:
    hook, data = stream_hook(tmp_path)
    try:
        usage = ModelResponseStream(id="s1", model="m", choices=[])

        async def drop_before_usage() -> None:
            upstream = Upstream([*full_stream(), usage])
            gen = hook.async_post_call_streaming_iterator_hook(KEY, upstream, data)
            for _ in range(5):
                await gen.__anext__()
            await gen.aclose()

        asyncio.run(drop_before_usage())
        assert ended(hook) == {"learned": 1, "unfinished_streams": 0, "errors": 0}
    finally:
        hook.close()


def test_an_upstream_error_mid_stream_is_counted_and_reaches_the_client(tmp_path: Path) -> None:
    hook, data = stream_hook(tmp_path)
    try:

        async def drain() -> list[Any]:
            upstream = Upstream(full_stream()[:3], error=RuntimeError("upstream broke"))
            gen = hook.async_post_call_streaming_iterator_hook(KEY, upstream, data)
            got = []
            try:
                async for c in gen:
                    got.append(c)
            except RuntimeError:
                return got
            raise AssertionError("the upstream error was swallowed")

        assert len(asyncio.run(drain())) == 3
        assert ended(hook) == {"learned": 0, "unfinished_streams": 1, "errors": 0}
    finally:
        hook.close()


def test_a_cancelled_stream_is_counted(tmp_path: Path) -> None:
    hook, data = stream_hook(tmp_path)
    try:

        async def cancel_while_waiting() -> None:
            hang = asyncio.Event()
            upstream = Upstream(full_stream()[:2], hang=hang)
            gen = hook.async_post_call_streaming_iterator_hook(KEY, upstream, data)

            async def consume() -> None:
                async for _ in gen:
                    pass

            task = asyncio.ensure_future(consume())
            while upstream.sent < 2:
                await asyncio.sleep(0)
            await asyncio.sleep(0.01)  # the hook now awaits the upstream's next chunk
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return
            raise AssertionError("the task was not cancelled")

        asyncio.run(cancel_while_waiting())
        assert ended(hook) == {"learned": 0, "unfinished_streams": 1, "errors": 0}
    finally:
        hook.close()


def test_a_stream_is_finished_only_when_every_choice_is(tmp_path: Path) -> None:
    hook, data = stream_hook(tmp_path)
    try:
        data["n"] = 2

        async def drain(chunks: list[ModelResponseStream]) -> None:
            gen = hook.async_post_call_streaming_iterator_hook(KEY, Upstream(chunks), data)
            async for _ in gen:
                pass

        one_left = [stream_chunk(0, content="ab"), stream_chunk(1, content="xy")]
        asyncio.run(drain([*one_left, stream_chunk(0, finish="stop")]))
        assert ended(hook) == {"learned": 0, "unfinished_streams": 1, "errors": 0}
        never_seen = [stream_chunk(0, content="ab"), stream_chunk(0, finish="stop")]
        asyncio.run(drain(never_seen))  # choice 1 of n=2 never came
        assert ended(hook) == {"learned": 0, "unfinished_streams": 2, "errors": 0}
        both = [*one_left, stream_chunk(1, finish="length"), stream_chunk(0, finish="stop")]
        asyncio.run(drain(both))
        assert ended(hook) == {"learned": 2, "unfinished_streams": 2, "errors": 0}
    finally:
        hook.close()
