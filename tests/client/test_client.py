"""Tests of AgentSpecClient / AsyncAgentSpecClient against a local OpenAI-compatible server.

Every surface (chat.completions, completions, responses; sync and async;
streamed or not; with_raw_response, with_options, with_streaming_response)
is called over real HTTP (tests/openai_server.py).  Checked: the tags in the
body and headers, merging with the caller's extra_body / extra_headers, the
learned sequences in a real ShardStore (server token ids, and the tokenizer
fallback) and the trace file.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import numpy as np
import openai
import pytest
import structlog
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from openai_server import OpenAIServer, reply_text, token_ids
from prereq import require_module, require_shared, shared

import agentspec._client.tags as tags_mod
from agentspec._client.client import AgentSpecClient, AsyncAgentSpecClient, ClientOptions
from agentspec._client.trace import request_messages
from agentspec._push.intake import ShardIntake, serve_intake
from agentspec._store.store import ShardStore
from agentspec.exceptions import InvalidArgumentError
from agentspec.traces import Message, read_traces

TOKENIZER_DIR = shared("tokenizers", "qwen3")

APIS = ("chat", "completions", "responses")
RESULT_TYPE = {"chat": ChatCompletion, "completions": Completion, "responses": Response}


@pytest.fixture(scope="module")
def server():
    with OpenAIServer() as srv:
        yield srv


@pytest.fixture
def store():
    s = ShardStore()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def qwen():
    tokenizers = require_module("tokenizers")
    require_shared(TOKENIZER_DIR / "tokenizer.json")
    return tokenizers.Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


def make_client(server, store, **kw):
    kw.setdefault("lead_tokens", 0)  # outputs alone; test_prompt_lead_* cover the lead
    return AgentSpecClient(
        base_url=server.base_url, api_key="test", max_retries=0, timeout=10, store=store, **kw
    )


def make_async_client(server, store, **kw):
    kw.setdefault("lead_tokens", 0)
    return AsyncAgentSpecClient(
        base_url=server.base_url, api_key="test", max_retries=0, timeout=10, store=store, **kw
    )


def call_args(api, prompt, **kw):
    """Keyword arguments of one call of ``api`` with the user text ``prompt``."""
    if api == "chat":
        return {"model": "m", "messages": [{"role": "user", "content": prompt}], **kw}
    if api == "completions":
        return {"model": "m", "prompt": prompt, **kw}
    return {"model": "m", "input": prompt, **kw}


def resource(client, api):
    return client.chat.completions if api == "chat" else getattr(client, api)


def learned(store, key):
    """The sequences learned under ``key``, in learn order."""
    tree = store.tree(key)
    if tree is None:
        return []
    return [tree.sequence(i) for i in sorted(tree.sequence_ids())]


def last_request(server):
    return server.requests[-1]


def agentspec_headers(req):
    return {k: v for k, v in req.headers.items() if k.startswith("x-agentspec-")}


def drain(result, api, stream):
    """Read a result fully; return the reply text of choice 0."""
    if not stream:
        if api == "chat":
            return result.choices[0].message.content
        if api == "completions":
            return result.choices[0].text
        return result.output_text
    parts = []
    for item in result:
        parts.append(text_of_item(item, api))
    return "".join(parts)


async def adrain(result, api, stream):
    if not stream:
        return drain(result, api, stream)
    parts = []
    async for item in result:
        parts.append(text_of_item(item, api))
    return "".join(parts)


def text_of_item(item, api):
    if api == "responses":
        return item.delta if item.type == "response.output_text.delta" else ""
    if not item.choices or item.choices[0].index != 0:
        return ""
    if api == "chat":
        return item.choices[0].delta.content or ""
    return item.choices[0].text


# --- tags ------------------------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
def test_tags_from_scopes_travel_in_body_and_headers(server, store, api):
    with make_client(server, store) as client:
        with client.session("s-1", pipeline="text2sql"), tags_mod.stage("SQL"):
            resource(client, api).create(**call_args(api, "q"))
        req = last_request(server)
        assert req.body["vllm_xargs"] == {
            "agentspec_tenant": "default",
            "agentspec_session": "s-1",
            "agentspec_stage": "SQL",
            "agentspec_pipeline": "text2sql",
        }
        assert agentspec_headers(req) == {
            "x-agentspec-session": "s-1",
            "x-agentspec-stage": "SQL",
            "x-agentspec-pipeline": "text2sql",
        }


def test_per_call_keywords_override_scopes_and_are_stripped(server, store):
    with make_client(server, store, tenant="acme") as client:
        with client.session("s-outer", pipeline="p-outer"), tags_mod.stage("outer"):
            client.chat.completions.create(
                **call_args("chat", "q"), stage="inner", session="s-inner", pipeline="p-inner"
            )
        body = last_request(server).body
        for key in ("stage", "session", "pipeline"):
            assert key not in body
        assert body["vllm_xargs"] == {
            "agentspec_tenant": "acme",
            "agentspec_session": "s-inner",
            "agentspec_stage": "inner",
            "agentspec_pipeline": "p-inner",
        }
        assert agentspec_headers(last_request(server))["x-agentspec-stage"] == "inner"


def test_untagged_call_sends_only_the_tenant(server, store):
    with make_client(server, store) as client:
        client.chat.completions.create(**call_args("chat", "q"))
    req = last_request(server)
    assert req.body["vllm_xargs"] == {"agentspec_tenant": "default"}
    assert agentspec_headers(req) == {}


def test_caller_extra_body_and_vllm_xargs_are_kept(server, store):
    extra = {"top_k": 5, "vllm_xargs": {"mine": "1", "agentspec_stage": "caller"}}
    before = {"top_k": 5, "vllm_xargs": {"mine": "1", "agentspec_stage": "caller"}}
    with make_client(server, store) as client:
        client.completions.create(**call_args("completions", "q"), stage="S", extra_body=extra)
    body = last_request(server).body
    assert body["top_k"] == 5
    assert body["vllm_xargs"] == {
        "agentspec_tenant": "default",
        "agentspec_stage": "caller",
        "mine": "1",
    }
    assert extra == before  # the caller's dicts are not changed


def test_caller_extra_headers_are_kept_and_win(server, store):
    given = {"X-Custom": "yes", "x-agentspec-stage": "mine"}
    with make_client(server, store) as client:
        client.chat.completions.create(
            **call_args("chat", "q"), session="s", stage="S", extra_headers=given
        )
    req = last_request(server)
    assert req.headers["x-custom"] == "yes"
    assert agentspec_headers(req) == {"x-agentspec-session": "s", "x-agentspec-stage": "mine"}
    assert given == {"X-Custom": "yes", "x-agentspec-stage": "mine"}


def test_non_ascii_tags_are_percent_encoded_in_headers_only(server, store):
    with make_client(server, store) as client:
        client.chat.completions.create(**call_args("chat", "q"), stage="étape 1")
    req = last_request(server)
    assert req.body["vllm_xargs"]["agentspec_stage"] == "étape 1"
    assert req.headers["x-agentspec-stage"] == "%C3%A9tape%201"
    assert tags_mod.decode_header_value(req.headers["x-agentspec-stage"]) == "étape 1"


def test_tags_in_body_false_sends_headers_only(server, store):
    with make_client(server, store, tags_in_body=False) as client:
        client.chat.completions.create(**call_args("chat", "q"), stage="S")
    req = last_request(server)
    assert "vllm_xargs" not in req.body
    assert agentspec_headers(req) == {"x-agentspec-stage": "S"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": ""}, "stage"),
        ({"session": "a\nb"}, "session"),
        ({"pipeline": 7}, "pipeline"),
        ({"extra_body": ["not", "a", "dict"]}, "extra_body"),
        ({"extra_body": {"vllm_xargs": "x"}}, "vllm_xargs"),
    ],
)
def test_bad_tags_or_bodies_fail_before_any_request(server, store, kwargs, match):
    with make_client(server, store) as client:
        server.clear()
        with pytest.raises(InvalidArgumentError, match=match):
            client.chat.completions.create(**call_args("chat", "q"), **kwargs)
        assert server.requests == []


def test_bad_client_arguments(server, store):
    with pytest.raises(InvalidArgumentError, match="tenant"):
        make_client(server, store, tenant="")
    with pytest.raises(InvalidArgumentError, match="queue_size"):
        make_client(server, store, queue_size=0)
    with pytest.raises(InvalidArgumentError, match="tokenizer file not found"):
        make_client(server, store, tokenizer="/nonexistent/tokenizer.json")
    with pytest.raises(InvalidArgumentError, match="tokenizer must be"):
        make_client(server, store, tokenizer=42)
    inner = openai.OpenAI(base_url=server.base_url, api_key="k")
    try:
        with pytest.raises(InvalidArgumentError, match="not both"):
            AgentSpecClient(client=inner, api_key="k", store=store)
    finally:
        inner.close()
    ainner = openai.AsyncOpenAI(base_url=server.base_url, api_key="k")
    with pytest.raises(TypeError, match=r"wraps an openai\.OpenAI"):
        AgentSpecClient(client=ainner, store=store)
    asyncio.run(ainner.close())


# --- learning, every surface ------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_sync_learns_server_token_ids_of_every_choice(server, store, api, stream):
    with make_client(server, store, return_token_ids=True) as client:
        result = resource(client, api).create(
            **call_args(api, f"{api}-{stream}", n=2), stream=stream, stage="S", pipeline="P"
        )
        if stream:
            assert type(result) is openai.Stream
        else:
            assert isinstance(result, RESULT_TYPE[api])
        assert drain(result, api, stream) == reply_text(f"{api}-{stream}", 0)
        assert last_request(server).body["return_token_ids"] is True
        assert client.flush(10)
        assert learned(store, ("default", "P", "S")) == [
            token_ids(reply_text(f"{api}-{stream}", 0)),
            token_ids(reply_text(f"{api}-{stream}", 1)),
        ]
        assert client.stats().learned == 2


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_async_learns_server_token_ids_of_every_choice(server, store, api, stream):
    async def main():
        async with make_async_client(server, store, return_token_ids=True) as client:
            result = await resource(client, api).create(
                **call_args(api, "a", n=2), stream=stream, stage="S"
            )
            if stream:
                assert type(result) is openai.AsyncStream
            else:
                assert isinstance(result, RESULT_TYPE[api])
            assert await adrain(result, api, stream) == reply_text("a", 0)
            assert await client.flush(10)

    asyncio.run(main())
    assert learned(store, ("default", None, "S")) == [
        token_ids(reply_text("a", 0)),
        token_ids(reply_text("a", 1)),
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", APIS)
def test_sync_tokenizer_fallback(server, store, qwen, api, stream):
    with make_client(server, store, tokenizer=TOKENIZER_DIR) as client:
        result = resource(client, api).create(**call_args(api, "t"), stream=stream, stage="S")
        drain(result, api, stream)
        assert "return_token_ids" not in last_request(server).body
        assert client.flush(10)
    expected = qwen.encode(reply_text("t"), add_special_tokens=False).ids
    assert learned(store, ("default", None, "S")) == [expected]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", APIS)
def test_async_tokenizer_fallback(server, store, qwen, api, stream):
    async def main():
        client = make_async_client(server, store, tokenizer=qwen)
        try:
            result = await resource(client, api).create(
                **call_args(api, "t"), stream=stream, stage="S"
            )
            await adrain(result, api, stream)
            assert await client.flush(10)
        finally:
            await client.close()

    asyncio.run(main())
    expected = qwen.encode(reply_text("t"), add_special_tokens=False).ids
    assert learned(store, ("default", None, "S")) == [expected]


def test_callable_tokenizer_and_usage_chunk(server, store):
    with make_client(server, store, tokenizer=token_ids) as client:
        stream = client.chat.completions.create(
            **call_args("chat", "u"), stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert chunks[-1].choices == []
        assert chunks[-1].usage is not None
        assert client.flush(10)
    assert learned(store, ("default", None, None)) == [token_ids(reply_text("u"))]


def agentspec_logs(caplog):
    """The records of the "agentspec" logger as dicts: event, log_level and the bound fields."""
    return [
        {**r.__dict__, "event": r.getMessage(), "log_level": r.levelname.lower()}
        for r in caplog.records
        if r.name == "agentspec"
    ]


def test_without_token_ids_or_tokenizer_nothing_is_learned(server, store, caplog):
    with (
        caplog.at_level(logging.DEBUG, logger="agentspec"),
        make_client(server, store) as client,
    ):
        client.chat.completions.create(**call_args("chat", "q"), stage="S")
        client.chat.completions.create(**call_args("chat", "q"), stage="S")
        assert client.flush(10)
        stats = client.stats()
    assert (stats.submitted, stats.learned, stats.unlearned) == (2, 0, 2)
    assert store.tree(("default", None, "S")) is None
    logs = agentspec_logs(caplog)
    assert [e["event"] for e in logs] == ["agentspec_no_token_ids"]  # warned once


def test_stream_closed_early_is_not_learned(server, store):
    with make_client(server, store, return_token_ids=True) as client:
        stream = client.chat.completions.create(**call_args("chat", "q"), stream=True)
        next(iter(stream))
        stream.close()
        complete = client.chat.completions.create(**call_args("chat", "r"), stream=True)
        list(complete)
        assert client.flush(10)
        assert client.stats().submitted == 1
    assert learned(store, ("default", None, None)) == [token_ids(reply_text("r"))]


# --- with_raw_response, with_options, with_streaming_response, forwarding ---------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("level", ["resource", "client"])
@pytest.mark.parametrize("api", APIS)
def test_with_raw_response(server, store, qwen, api, stream, level):
    with make_client(server, store, tokenizer=qwen) as client:
        if level == "resource":
            target = resource(client, api).with_raw_response
        else:
            target = resource(client.with_raw_response, api)
        raw = target.create(**call_args(api, "raw"), stream=stream, stage="R")
        assert isinstance(raw.http_response.status_code, int)
        assert agentspec_headers(last_request(server)) == {"x-agentspec-stage": "R"}
        parsed = raw.parse()
        if stream:
            assert type(parsed) is openai.Stream
        else:
            assert isinstance(parsed, RESULT_TYPE[api])
        assert drain(parsed, api, stream) == reply_text("raw")
        assert client.flush(10)
    expected = qwen.encode(reply_text("raw"), add_special_tokens=False).ids
    assert learned(store, ("default", None, "R")) == [expected]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_async_with_raw_response(server, store, stream):
    async def main():
        async with make_async_client(server, store, return_token_ids=True) as client:
            raw = await client.chat.completions.with_raw_response.create(
                **call_args("chat", "ar"), stream=stream, stage="R"
            )
            parsed = raw.parse()
            assert type(parsed) is (openai.AsyncStream if stream else ChatCompletion)
            await adrain(parsed, "chat", stream)
            assert await client.flush(10)

    asyncio.run(main())
    assert learned(store, ("default", None, "R")) == [token_ids(reply_text("ar"))]


def test_with_options_rewraps_and_shares_store_and_tags(server, store):
    with make_client(server, store, return_token_ids=True, tenant="t1") as client:
        copy = client.with_options(timeout=3.5, default_headers={"X-Extra": "1"})
        assert type(copy) is AgentSpecClient
        assert copy.timeout == 3.5
        assert copy.store is client.store
        assert client.copy(max_retries=1).max_retries == 1
        with client.session("s", pipeline="p"):
            copy.chat.completions.create(**call_args("chat", "w"), stage="W")
        req = last_request(server)
        assert req.headers["x-extra"] == "1"
        assert req.body["vllm_xargs"]["agentspec_tenant"] == "t1"
        assert agentspec_headers(req) == {
            "x-agentspec-session": "s",
            "x-agentspec-stage": "W",
            "x-agentspec-pipeline": "p",
        }
        assert client.flush(10)
    assert learned(store, ("t1", "p", "W")) == [token_ids(reply_text("w"))]


def test_async_with_options(server, store):
    async def main():
        async with make_async_client(server, store, return_token_ids=True) as client:
            copy = client.with_options(timeout=2.0)
            assert type(copy) is AsyncAgentSpecClient
            async with client.session("as"):
                await copy.completions.create(**call_args("completions", "x"), stage="A")
            assert await client.flush(10)
        return last_request(server)

    req = asyncio.run(main())
    assert agentspec_headers(req) == {"x-agentspec-session": "as", "x-agentspec-stage": "A"}
    assert learned(store, ("default", None, "A")) == [token_ids(reply_text("x"))]


def test_with_streaming_response_is_tagged(server, store):
    with make_client(server, store) as client:
        mgr = client.chat.completions.with_streaming_response.create(
            **call_args("chat", "s"), stage="St"
        )
        with mgr as resp:
            assert resp.parse().choices[0].message.content == reply_text("s")
        assert agentspec_headers(last_request(server)) == {"x-agentspec-stage": "St"}
        with client.with_streaming_response.responses.create(
            **call_args("responses", "s"), session="ss"
        ) as resp:
            assert resp.parse().output_text == reply_text("s")
        assert agentspec_headers(last_request(server)) == {"x-agentspec-session": "ss"}


def test_wrapping_an_existing_client_and_forwarding(server, store):
    inner = openai.OpenAI(base_url=server.base_url, api_key="secret-key", max_retries=0)
    client = AgentSpecClient(client=inner, store=store)
    try:
        assert client.openai_client is inner
        assert client.api_key == "secret-key"
        assert str(client.base_url) == server.base_url + "/"
        assert client.models is inner.models
        assert client.chat.completions.with_raw_response is not None
        assert client.chat.completions.create is not None
        assert client.completions._client is inner  # attributes of resources are forwarded
        assert "tenant='default'" in repr(client)
        with pytest.raises(AttributeError):
            _ = client.no_such_attribute
    finally:
        client.close()
    assert inner.is_closed()


def test_client_owns_a_default_store(server):
    client = AgentSpecClient(
        base_url=server.base_url, api_key="k", max_retries=0, return_token_ids=True
    )
    with client:
        client.chat.completions.create(**call_args("chat", "own"), stage="O")
        assert client.flush(10)
        # default lead_tokens=8: the prompt's last 8 ids (here all of them) come first
        assert learned(client.store, ("default", None, "O")) == [
            token_ids("own")[-8:] + token_ids(reply_text("own"))
        ]


def test_push_to_mirrors_learned_shards_to_a_worker(server, store):
    intake = ShardIntake()
    worker, thread = serve_intake(intake)
    try:
        with make_client(server, store, return_token_ids=True, push_to=worker.url) as client:
            client.chat.completions.create(**call_args("chat", "push"), stage="P")
            assert client.flush(30)
            tree = intake.tree(("default", None, "P"))
            assert tree is not None
            assert [tree.sequence(i) for i in sorted(tree.sequence_ids())] == [
                token_ids(reply_text("push"))
            ]
    finally:
        worker.stop(thread)


def test_close_pushes_what_was_learned_the_readme_example(server, tmp_path, monkeypatch, capsys):
    """The README's push_to example (no flush): close() leaves the worker current.

    Checked as a user would: ``agentspec shards status`` with the key from
    ``$AGENTSPEC_API_KEY`` (the one variable of every command) says in-sync.
    """
    from agentspec.__main__ import main

    monkeypatch.setenv("AGENTSPEC_API_KEY", "k")
    intake = ShardIntake(api_key="k")
    worker, thread = serve_intake(intake)
    path = tmp_path / "shards"
    store = ShardStore(path)
    try:
        client = AgentSpecClient(
            base_url=server.base_url,
            max_retries=0,
            store=store,
            return_token_ids=True,
            push_to=[worker.url],  # push_api_key: $AGENTSPEC_API_KEY
        )
        assert client.openai_client.api_key == "k"
        with client.session("task-42", pipeline="text2sql"):
            with tags_mod.stage("Extract"):
                client.chat.completions.create(**call_args("chat", "extract it"))
            client.chat.completions.create(**call_args("chat", "the sql"), stage="SQL")
            client.chat.completions.create(**call_args("chat", "more sql"), stage="SQL")
        assert client.close() is True  # no flush() before: close pushes
        keys = store.keys()
        assert len(keys) == 2
        for key in keys:
            tree, theirs = store.tree(key), intake.tree(key)
            assert tree is not None
            assert theirs is not None
            assert theirs.sequence_ids() == tree.sequence_ids()
        store.close()
        capsys.readouterr()
        assert main(["shards", "status", "--store", str(path), "--endpoint", worker.url]) == 0
        out = capsys.readouterr().out
        assert out.count("in-sync") == 2
        assert "behind" not in out
    finally:
        store.close()
        worker.stop(thread)


def test_close_gives_up_on_a_silent_worker_in_time_and_says_what_is_left(server, store, caplog):
    import socket
    import time

    silent = socket.socket()  # accepts connections (backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        client = make_client(server, store, return_token_ids=True, push_to=url)
        client.chat.completions.create(**call_args("chat", "stuck"), stage="Stuck")
        with caplog.at_level(logging.WARNING, logger="agentspec"):
            start = time.monotonic()
            assert client.close(timeout=1.0) is False
            took = time.monotonic() - start
        assert took < 6  # the push timeout plus the pusher's stop, not the 30 s request timeout
        (rec,) = [r for r in caplog.records if r.getMessage() == "agentspec.client.push_incomplete"]
        assert rec.levelno == logging.WARNING
        assert rec.timeout == 1.0  # type: ignore[attr-defined]
        assert rec.endpoints[url]["pending"] == ["default/-/Stuck"]  # type: ignore[attr-defined]
    finally:
        silent.close()
    assert learned(store, ("default", None, "Stuck"))  # learned locally; the store keeps it


# --- the recorder: never blocks, drops when full, logs without text ---------------------


def test_full_queue_drops_counts_and_logs(server, store, caplog):
    entered, release = threading.Event(), threading.Event()

    def slow_encoder(text):
        entered.set()
        assert release.wait(10)
        return token_ids(text)

    with caplog.at_level(logging.DEBUG, logger="agentspec"):
        client = make_client(server, store, tokenizer=slow_encoder, queue_size=1)
        try:
            client.chat.completions.create(**call_args("chat", "a"))  # taken by the worker
            assert entered.wait(10)
            client.chat.completions.create(**call_args("chat", "b"))  # queued
            client.chat.completions.create(**call_args("chat", "c"))  # dropped
            assert client.flush(0.05) is False
            stats = client.stats()
            assert (stats.submitted, stats.dropped, stats.pending) == (2, 1, 2)
            release.set()
            assert client.flush(10)
            assert client.stats().learned == 2
        finally:
            release.set()
            client.close()
    dropped = [e for e in agentspec_logs(caplog) if e["event"] == "agentspec_learn_dropped"]
    assert len(dropped) == 1
    assert dropped[0]["log_level"] == "warning"
    assert learned(store, ("default", None, None)) == [
        token_ids(reply_text("a")),
        token_ids(reply_text("b")),
    ]


def test_failures_are_counted_logged_without_text_with_tags_bound(server, store, caplog):
    seen_context = []

    def failing_encoder(text):
        seen_context.append(structlog.contextvars.get_contextvars())
        raise ValueError(f"cannot encode {text!r}")

    with (
        caplog.at_level(logging.DEBUG, logger="agentspec"),
        make_client(server, store, tokenizer=failing_encoder) as client,
    ):
        client.chat.completions.create(
            **call_args("chat", "private prompt"), session="s9", stage="S"
        )
        assert client.flush(10)
        assert client.stats().failed == 1
    assert seen_context[0]["session_id"] == "s9"
    assert seen_context[0]["stage"] == "S"
    assert structlog.contextvars.get_contextvars() == {}
    loud = [e for e in agentspec_logs(caplog) if e["log_level"] != "debug"]
    assert [e["event"] for e in loud] == ["agentspec_learn_failed"]
    assert loud[0]["error"] == "ValueError"
    assert "private prompt" not in repr(loud)


def test_close_learns_what_is_queued_and_later_results_are_dropped(server, store):
    client = make_client(server, store, return_token_ids=True)
    copy = client.with_options(timeout=5)
    client.chat.completions.create(**call_args("chat", "last"))
    client.close()  # no flush: close processes the queue first
    assert learned(store, ("default", None, None)) == [token_ids(reply_text("last"))]
    assert client.stats().pending == 0
    assert client.flush(1)
    client.close()  # idempotent
    assert copy.stats() == client.stats()  # copies share the recorder


# --- traces ---------------------------------------------------------------------------


def chat_turns(client, session_id, stage_names):
    """A conversation of len(stage_names) turns in one session; returns its messages."""
    messages = [{"role": "system", "content": "be brief"}]
    with client.session(session_id, pipeline="agent"):
        for i, stage_name in enumerate(stage_names):
            messages.append({"role": "user", "content": f"turn {i}"})
            with tags_mod.stage(stage_name):
                out = client.chat.completions.create(model="m", messages=messages)
            messages.append({"role": "assistant", "content": out.choices[0].message.content})
    return messages


def test_trace_file_round_trips(server, store, tmp_path):
    path = tmp_path / "traffic.jsonl"
    with make_client(server, store, return_token_ids=True, trace_path=path) as client:
        messages = chat_turns(client, "conv-1", ["plan", "SQL", "SQL"])
        assert client.flush(10)
        client.completions.create(model="m", prompt="solo", stage="C")  # no session
    records = list(read_traces(path))
    conv = records[0]
    assert conv.session == "conv-1"
    assert conv.workload == "agent"
    assert conv.stage == "plan"
    assert [(m.role, m.content) for m in conv.messages] == [
        (m["role"], m["content"]) for m in messages
    ]
    assert [m.stage for m in conv.messages if m.role == "assistant"] == [None, "SQL", "SQL"]
    assert [r.stage for r in conv.requests()] == ["plan", "SQL", "SQL"]
    assert conv.meta == {
        "session_id": "conv-1",
        "tenant": "default",
        "pipeline": "agent",
        "model": "m",
    }
    solo = records[1]
    assert solo.session.startswith("call-")
    assert solo.stage == "C"
    assert solo.messages == (Message("user", "solo"), Message("assistant", reply_text("solo")))
    assert len(records) == 2


def test_trace_sessions_split_and_reuse_ids_safely(server, store, tmp_path):
    path = tmp_path / "traffic.jsonl.gz"
    with make_client(server, store, trace_path=path) as client:
        chat_turns(client, "conv", ["A"])
        chat_turns(client, "conv", ["B"])  # same session id, a new scope: a second record
        with client.session("other"):
            client.chat.completions.create(**call_args("chat", "x"))
            client.chat.completions.create(**call_args("chat", "unrelated"))  # not an extension
    with make_client(server, store, trace_path=path) as client:  # appending to the same file
        chat_turns(client, "conv", ["C"])
    sessions = [r.session for r in read_traces(path)]
    assert sessions == ["conv", "conv#2", "other", "other#2", "conv#3"]


def test_async_trace(server, store, tmp_path):
    path = tmp_path / "a.jsonl"

    async def main():
        async with (
            make_async_client(server, store, trace_path=path) as client,
            client.session("as", pipeline="p"),
        ):
            stream = await client.responses.create(
                model="m", input="hello", instructions="sys", stream=True, stage="R"
            )
            async for _ in stream:
                pass

    asyncio.run(main())
    (rec,) = read_traces(path)
    assert rec.session == "as"
    assert rec.messages == (
        Message("system", "sys"),
        Message("user", "hello"),
        Message("assistant", reply_text("hello")),
    )


def test_request_messages_maps_roles_tools_and_parts():
    request = {
        "messages": [
            {"role": "developer", "content": "dev"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "1", "content": "42"},
            {"role": "assistant", "content": ""},
            {"role": "narrator", "content": "?"},
        ]
    }
    assert request_messages("chat", request) == [
        Message("system", "dev"),
        Message("user", "ab"),
        Message("assistant", '{"name": "f", "arguments": "{}"}'),
        Message("user", "42"),
    ]
    items = {
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "function_call", "name": "g", "arguments": "[]", "call_id": "c"},
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
        ]
    }
    assert request_messages("responses", items) == [
        Message("user", "q"),
        Message("assistant", '{"name": "g", "arguments": "[]"}'),
        Message("user", "ok"),
    ]
    assert request_messages("completions", {"prompt": ["p0", "p1"], "n": 2}, choice=3) == [
        Message("user", "p1")
    ]


@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_prompt_lead_is_learned_before_server_token_ids(server, store, api, stream):
    """With the server's prompt ids, the output is learned behind the prompt's last ids."""
    prompt = "a prompt long enough for a lead"
    with make_client(server, store, return_token_ids=True, lead_tokens=3) as client:
        result = resource(client, api).create(**call_args(api, prompt), stream=stream)
        if stream:
            list(result)
        assert client.flush(10)
    assert learned(store, ("default", None, None)) == [
        token_ids(prompt)[-3:] + token_ids(reply_text(prompt))
    ]


def test_prompt_lead_needs_server_ids(server, store):
    """Tokenizer-fallback outputs are learned alone (the prompt ids are unknown)."""
    with make_client(server, store, tokenizer=token_ids, lead_tokens=3) as client:
        client.chat.completions.create(**call_args("chat", "q"))
        assert client.flush(10)
    assert learned(store, ("default", None, None)) == [token_ids(reply_text("q"))]


@pytest.mark.parametrize("kind", [np.int32, np.int64, np.uint16], ids=repr)
def test_integer_arguments_accept_numpy_integers(server, store, kind):
    """queue_size and lead_tokens accept numpy integers, kept as plain ints."""
    prompt = "a prompt long enough for a lead"
    with make_client(
        server, store, return_token_ids=True, queue_size=kind(8), lead_tokens=kind(3)
    ) as client:
        recorder = client._core.recorder
        assert (recorder._max, recorder._lead_tokens) == (8, 3)
        assert type(recorder._max) is int
        assert type(recorder._lead_tokens) is int
        client.chat.completions.create(**call_args("chat", prompt))
        assert client.flush(10)
    assert learned(store, ("default", None, None)) == [
        token_ids(prompt)[-3:] + token_ids(reply_text(prompt))
    ]


@pytest.mark.parametrize("value", [True, np.True_, 8.0, "8"], ids=repr)
def test_integer_arguments_refuse_bool_and_non_integers(server, store, value):
    """bool and non-integers raise TypeError naming the argument."""
    name = "bool" if isinstance(value, (bool, np.bool_)) else type(value).__name__
    for kw in ("queue_size", "lead_tokens"):
        with pytest.raises(TypeError, match=f"^{kw} must be an int, not {name}$"):
            make_client(server, store, **{kw: value})


def test_lead_tokens_is_checked(server, store):
    with pytest.raises(InvalidArgumentError, match="lead_tokens"):
        make_client(server, store, lead_tokens=-1)


@pytest.mark.parametrize("cls", [AgentSpecClient, AsyncAgentSpecClient])
def test_client_keywords_are_the_client_options(cls: type) -> None:
    """Both twins take exactly ClientOptions' fields as keywords, with its defaults."""
    import dataclasses
    import inspect

    params = inspect.signature(cls.__init__).parameters
    fields = {f.name: f.default for f in dataclasses.fields(ClientOptions)}
    taken = {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert taken.pop("client") is None
    assert taken == fields
