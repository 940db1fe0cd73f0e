"""OpenTelemetry spans of AgentSpecClient / AsyncAgentSpecClient (the SDK's in-memory exporter).

Every call goes over real HTTP to tests/openai_server.py; the spans are read
back from an `InMemorySpanExporter` on the process's SDK tracer provider.
The last tests run the client in a subprocess where ``opentelemetry`` cannot
be imported (a ``sys.meta_path`` blocker), and one where no provider is set.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import openai
import pytest
from openai_server import OpenAIServer, Reply, reply_text

from agentspec._client import otel
from agentspec._client.client import AgentSpecClient, AsyncAgentSpecClient
from agentspec._store.store import ShardStore

trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COUNTERS = {"steps": 5, "drafted": 12, "accepted": 9, "speculate": True}
RESP_USAGE = {
    "input_tokens": 11,
    "output_tokens": 22,
    "total_tokens": 33,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens_details": {"reasoning_tokens": 0},
}


def _reply(request):
    """Stage "E" fails (400); stage "A" answers with the engine's counters; else default."""
    tag = (request.body.get("vllm_xargs") or {}).get("agentspec_stage")
    if tag == "E":
        return Reply("bad model", status=400)
    if tag == "A":
        extra = {"agentspec": COUNTERS}
        if request.path.endswith("/responses"):
            extra["usage"] = RESP_USAGE
        return Reply("SELECT 1;", usage={"prompt_tokens": 7, "completion_tokens": 3}, extra=extra)
    return None


@pytest.fixture(scope="module")
def server():
    with OpenAIServer(reply=_reply) as srv:
        yield srv


@pytest.fixture(scope="module")
def provider_exporter():
    """One in-memory exporter on the process's SDK provider (set here if none is)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, sdk_trace.TracerProvider):
        provider = sdk_trace.TracerProvider()
        trace.set_tracer_provider(provider)
    assert isinstance(trace.get_tracer_provider(), sdk_trace.TracerProvider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture
def spans(provider_exporter):
    provider_exporter.clear()
    yield provider_exporter
    provider_exporter.clear()


@pytest.fixture
def store():
    s = ShardStore()
    try:
        yield s
    finally:
        s.close()


def client_for(server, store, **kw):
    return AgentSpecClient(
        base_url=server.base_url,
        api_key="test",
        max_retries=0,
        timeout=10,
        store=store,
        lead_tokens=0,
        tenant="acme",
        **kw,
    )


def async_client_for(server, store, **kw):
    return AsyncAgentSpecClient(
        base_url=server.base_url,
        api_key="test",
        max_retries=0,
        timeout=10,
        store=store,
        lead_tokens=0,
        tenant="acme",
        **kw,
    )


def chat_args(prompt="q", **kw):
    return {"model": "m", "messages": [{"role": "user", "content": prompt}], **kw}


def only_span(exporter):
    finished = exporter.get_finished_spans()
    assert len(finished) == 1, [s.name for s in finished]
    return finished[0]


def check_common(span, server, *, operation="chat"):
    port = int(server.base_url.split(":")[2].split("/")[0])
    assert span.name == f"{operation} m"
    assert span.kind is SpanKind.CLIENT
    a = span.attributes
    assert a["gen_ai.operation.name"] == operation
    assert a["gen_ai.provider.name"] == "openai"
    assert a["gen_ai.system"] == "openai"
    assert a["gen_ai.request.model"] == "m"
    assert a["agentspec.tenant"] == "acme"
    assert (a["server.address"], a["server.port"]) == ("127.0.0.1", port)
    assert span.end_time is not None
    assert span.end_time >= span.start_time


def check_engine_reply(span):
    a = span.attributes
    assert a["gen_ai.response.model"] == "m"
    assert a["gen_ai.usage.input_tokens"] == 7
    assert a["gen_ai.usage.output_tokens"] == 3
    assert a["agentspec.accepted_tokens"] == 9
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("stop",)
    assert span.status.status_code is StatusCode.UNSET


def test_sync_chat_span_has_genai_and_agentspec_attributes(server, store, spans):
    with client_for(server, store) as client:
        with client.session("conv-1", pipeline="text2sql"):
            out = client.chat.completions.create(**chat_args(), stage="A")
        assert out.choices[0].message.content == "SELECT 1;"
        span = only_span(spans)
    check_common(span, server)
    check_engine_reply(span)
    a = span.attributes
    assert (a["agentspec.session"], a["agentspec.pipeline"], a["agentspec.stage"]) == (
        "conv-1",
        "text2sql",
        "A",
    )
    assert a["gen_ai.conversation.id"] == "conv-1"
    assert a["gen_ai.response.id"] == "cmpl-test"


def test_untagged_call_without_counters_sets_only_what_it_knows(server, store, spans):
    with client_for(server, store) as client:
        client.chat.completions.create(**chat_args("plain"))
        span = only_span(spans)
    check_common(span, server)
    a = span.attributes
    for absent in ("agentspec.session", "agentspec.stage", "agentspec.pipeline"):
        assert absent not in a
    assert "agentspec.accepted_tokens" not in a  # the server sent no agentspec counters
    assert a["gen_ai.usage.input_tokens"] == len("plain")


def test_sync_stream_span_ends_when_the_stream_ends(server, store, spans):
    with client_for(server, store) as client:
        stream = client.chat.completions.create(
            **chat_args(), stage="A", stream=True, stream_options={"include_usage": True}
        )
        first = next(iter(stream))
        assert first.choices[0].delta.content
        assert spans.get_finished_spans() == ()  # still streaming
        rest = list(stream)
        assert rest
        span = only_span(spans)
    check_common(span, server)
    check_engine_reply(span)
    assert span.attributes["agentspec.stage"] == "A"


def test_stream_closed_early_ends_its_span_without_error(server, store, spans):
    with client_for(server, store) as client:
        stream = client.chat.completions.create(**chat_args(), stream=True)
        next(iter(stream))
        assert spans.get_finished_spans() == ()
        stream.close()
        span = only_span(spans)
        with client.chat.completions.create(**chat_args(), stream=True):
            pass  # never read: the with block's close ends it
        spans.clear()
        assert client.flush(10)
        assert client.stats().submitted == 0  # incomplete outputs are still not learned
    check_common(span, server)
    assert span.status.status_code is StatusCode.UNSET
    assert span.attributes["gen_ai.response.model"] == "m"


def test_stream_never_read_nor_closed_ends_its_span_when_collected(server, store, spans):
    with client_for(server, store) as client:
        stream = client.chat.completions.create(**chat_args(), stream=True)
        assert spans.get_finished_spans() == ()
        del stream
        gc.collect()
        span = only_span(spans)
    check_common(span, server)


def test_async_stream_closed_early_ends_its_span(server, store, spans):
    async def main():
        async with async_client_for(server, store) as client:
            stream = await client.chat.completions.create(**chat_args(), stream=True)
            await stream.__anext__()
            assert spans.get_finished_spans() == ()
            await stream.close()
            return only_span(spans)

    span = asyncio.run(main())
    check_common(span, server)
    assert span.status.status_code is StatusCode.UNSET


def test_error_is_recorded_and_the_span_fails(server, store, spans):
    with client_for(server, store) as client:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**chat_args(), stage="E")
        span = only_span(spans)
    check_common(span, server)
    assert span.status.status_code is StatusCode.ERROR
    assert "BadRequestError" in span.status.description
    assert span.attributes["error.type"] == "BadRequestError"
    assert span.attributes["http.response.status_code"] == 400
    assert span.attributes["agentspec.stage"] == "E"
    events = [e for e in span.events if e.name == "exception"]
    assert len(events) == 1
    assert events[0].attributes["exception.type"].endswith("BadRequestError")


def test_completions_and_responses_and_raw(server, store, spans):
    with client_for(server, store) as client:
        client.completions.create(model="m", prompt="p", stage="A")
        (comp,) = spans.get_finished_spans()
        spans.clear()
        client.responses.create(model="m", input="p", stage="A")
        (resp,) = spans.get_finished_spans()
        spans.clear()
        raw = client.chat.completions.with_raw_response.create(**chat_args(), stage="A")
        assert raw.parse().choices[0].message.content == "SELECT 1;"
        (rawspan,) = spans.get_finished_spans()
        spans.clear()
        events = list(client.responses.create(model="m", input="p", stage="A", stream=True))
        assert events[-1].type == "response.completed"
        (rstream,) = spans.get_finished_spans()
    check_common(comp, server, operation="text_completion")
    check_engine_reply(comp)
    for span in (resp, rstream):
        check_common(span, server)
        a = span.attributes
        assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (11, 22)
        assert a["agentspec.accepted_tokens"] == 9
        assert tuple(a["gen_ai.response.finish_reasons"]) == ("completed",)
    check_common(rawspan, server)
    check_engine_reply(rawspan)


def test_async_calls_plain_stream_and_error(server, store, spans):
    async def main():
        async with async_client_for(server, store) as client:
            await client.chat.completions.create(**chat_args(), stage="A", session="s1")
            stream = await client.chat.completions.create(
                **chat_args(), stage="A", stream=True, stream_options={"include_usage": True}
            )
            assert len(spans.get_finished_spans()) == 1
            texts = [c.choices[0].delta.content async for c in stream if c.choices]
            assert "".join(t or "" for t in texts) == "SELECT 1;"
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(**chat_args(), stage="E")
            raw = await client.chat.completions.with_raw_response.create(**chat_args(), stage="A")
            assert raw.parse().choices[0].message.content == "SELECT 1;"
            return spans.get_finished_spans()

    plain, streamed, failed, raw = asyncio.run(main())
    check_common(raw, server)
    check_engine_reply(raw)
    for span in (plain, streamed):
        check_common(span, server)
        check_engine_reply(span)
    assert plain.attributes["agentspec.session"] == "s1"
    assert "agentspec.session" not in streamed.attributes
    check_common(failed, server)
    assert failed.status.status_code is StatusCode.ERROR


def test_spans_parent_under_the_callers_span(server, store, spans):
    tracer = trace.get_tracer("test")
    with client_for(server, store) as client, tracer.start_as_current_span("agent-step") as outer:
        client.chat.completions.create(**chat_args())
    finished = {s.name: s for s in spans.get_finished_spans()}
    assert set(finished) == {"agent-step", "chat m"}
    call = finished["chat m"]
    assert call.parent is not None
    assert call.parent.span_id == outer.get_span_context().span_id
    assert call.context.trace_id == outer.get_span_context().trace_id


# --- without OpenTelemetry --------------------------------------------------------------

_CHILD = """
import importlib.abc, json, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"blocked: {name}")
        return None

if sys.argv[2] == "absent":
    sys.meta_path.insert(0, Block())

from agentspec._client import otel
from agentspec._client.client import AgentSpecClient

with AgentSpecClient(base_url=sys.argv[1], api_key="t", max_retries=0, timeout=10,
                     lead_tokens=0, return_token_ids=True) as client:
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "q"}], stage="S")
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "q"}], stage="S", stream=True))
    assert client.flush(10)
    learned = client.stats().learned
print(json.dumps({
    "enabled": otel.ENABLED,
    "loaded": sorted(m for m in sys.modules if m.startswith("opentelemetry")),
    "text": out.choices[0].message.content,
    "chunks": len(chunks),
    "learned": learned,
}))
"""


@pytest.mark.parametrize("mode", ["absent", "no-provider"])
def test_client_works_without_opentelemetry_or_a_provider(server, mode):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop("OTEL_PYTHON_TRACER_PROVIDER", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHILD), server.base_url, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["text"] == reply_text("q")
    assert got["chunks"] > 1
    assert got["learned"] == 2
    if mode == "absent":
        assert got["enabled"] is False
        assert got["loaded"] == []
    else:
        assert got["enabled"] is True
        assert "opentelemetry.trace" in got["loaded"]


def test_no_recording_provider_means_no_span_object(server):
    """With a non-recording tracer the client keeps no span (one check per call)."""
    from agentspec._client.tags import Tags

    class Off:
        def start_span(self, *args, **kwargs):
            return trace.NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)

    saved = otel._TRACER
    otel._TRACER = Off()
    try:
        assert otel.start_span("chat", "m", Tags(), "t", ("h", 1)) is None
    finally:
        otel._TRACER = saved
