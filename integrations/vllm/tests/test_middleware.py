"""AgentSpecHeaderMiddleware against a tiny ASGI echo app (no vLLM needed)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from pathlib import Path

import pytest

try:
    import agentspec_vllm  # noqa: F401
except ImportError:  # not installed (e.g. the main venv): use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentspec_vllm.middleware import (
    DEFAULT_MAX_BODY_BYTES,
    TENANT_KEYS_ENV,
    AgentSpecHeaderMiddleware,
    load_tenant_keys,
)

from agentspec.exceptions import InvalidArgumentError
from agentspec.protocol import load_tenant_keys as agentspec_load_tenant_keys


class EchoApp:
    """Reads the whole body and answers it back in ``chunks`` pieces (a streamed answer)."""

    def __init__(self, chunks=1):
        self.chunks = chunks
        self.calls = []
        self.after_body = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            self.calls.append((scope, None))
            return
        body = b""
        while True:
            msg = await receive()
            assert msg["type"] == "http.request"
            body += msg.get("body", b"")
            if not msg.get("more_body", False):
                break
        self.after_body = await receive()  # what the app sees next (a disconnect)
        self.calls.append((scope, body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        step = max(1, len(body) // self.chunks)
        parts = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
        for i, part in enumerate(parts):
            await send(
                {"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1}
            )


def run(mw, *, path="/v1/chat/completions", method="POST", headers=(), body=b"", pieces=1):
    """Drive one request through ``mw``; returns (sent messages, scope seen by the app, body)."""
    step = max(1, -(-len(body) // pieces))
    incoming = [
        {"type": "http.request", "body": body[i : i + step], "more_body": i + step < len(body)}
        for i in range(0, len(body), step)
    ] or [{"type": "http.request", "body": b"", "more_body": False}]
    incoming.append({"type": "http.disconnect"})
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(msg):
        sent.append(msg)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in headers],
    }
    asyncio.run(mw(scope, receive, send))
    app = mw.app
    seen_scope, seen_body = app.calls[-1] if app.calls else (None, None)
    return sent, seen_scope, seen_body


def response_body(sent):
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


JSON = ("content-type", "application/json")


def test_headers_become_vllm_xargs():
    mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys=None)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = [
        JSON,
        ("X-AgentSpec-Stage", "SQL"),
        ("X-AgentSpec-Session", "s1"),
        ("X-AgentSpec-Pipeline", "text2sql"),
        ("content-length", str(len(body))),
    ]
    _sent, scope, seen = run(mw, headers=headers, body=body)
    obj = json.loads(seen)
    assert obj["messages"] == [{"role": "user", "content": "hi"}]
    assert obj["vllm_xargs"] == {
        "agentspec_stage": "SQL",
        "agentspec_session": "s1",
        "agentspec_pipeline": "text2sql",
    }
    lengths = [v for k, v in scope["headers"] if k == b"content-length"]
    assert lengths == [str(len(seen)).encode()]
    assert mw.app.after_body == {"type": "http.disconnect"}


def test_body_values_win_and_other_xargs_kept():
    mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys=None)
    body = json.dumps({"prompt": "x", "vllm_xargs": {"agentspec_stage": "body", "k": 1}}).encode()
    headers = [JSON, ("X-AgentSpec-Stage", "header"), ("X-AgentSpec-Session", "s")]
    _, _, seen = run(mw, path="/v1/completions", headers=headers, body=body)
    assert json.loads(seen)["vllm_xargs"] == {
        "agentspec_stage": "body",
        "k": 1,
        "agentspec_session": "s",
    }


def test_percent_encoded_values_are_decoded():
    mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys=None)
    body = b'{"input": "x"}'
    headers = [JSON, ("X-AgentSpec-Stage", "pr%C3%BCfen%20SQL")]
    _, _, seen = run(mw, path="/v1/responses", headers=headers, body=body)
    assert json.loads(seen)["vllm_xargs"] == {"agentspec_stage": "prüfen SQL"}


def test_body_in_many_chunks():
    mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys=None)
    body = json.dumps({"prompt": "a" * 5000}).encode()
    _, _, seen = run(mw, headers=[JSON, ("X-AgentSpec-Stage", "S")], body=body, pieces=7)
    obj = json.loads(seen)
    assert obj["prompt"] == "a" * 5000
    assert obj["vllm_xargs"] == {"agentspec_stage": "S"}


@pytest.mark.parametrize("value", ["%0Abad", "", "x" * 129, "a%00b"])
def test_invalid_header_value_gets_400(value):
    app = EchoApp()
    mw = AgentSpecHeaderMiddleware(app, tenant_keys=None)
    sent, _, _ = run(mw, headers=[JSON, ("X-AgentSpec-Stage", value)], body=b"{}")
    assert sent[0]["status"] == 400
    err = json.loads(response_body(sent))["error"]
    assert "x-agentspec-stage" in err["message"].lower()
    assert app.calls == []


@pytest.mark.parametrize(
    ("path", "method", "headers", "body"),
    [
        ("/v1/models", "POST", [JSON, ("X-AgentSpec-Stage", "S")], b'{"a": 1}'),
        ("/v1/chat/completions", "GET", [JSON, ("X-AgentSpec-Stage", "S")], b""),
        ("/v1/chat/completions", "POST", [JSON], b'{"a": 1}'),
        ("/v1/chat/completions", "POST", [("X-AgentSpec-Stage", "S")], b'{"a": 1}'),
        (
            "/v1/chat/completions",
            "POST",
            [("content-type", "text/plain"), ("X-AgentSpec-Stage", "S")],
            b'{"a": 1}',
        ),
        ("/v1/chat/completions", "POST", [JSON, ("X-AgentSpec-Stage", "S")], b'{"a": '),
        ("/v1/chat/completions", "POST", [JSON, ("X-AgentSpec-Stage", "S")], b"[1, 2]"),
        (
            "/v1/chat/completions",
            "POST",
            [JSON, ("X-AgentSpec-Stage", "S")],
            b'{"vllm_xargs": "not a dict"}',
        ),
        (
            "/v1/chat/completions",
            "POST",
            [JSON, ("X-AgentSpec-Stage", "S")],
            b'{"vllm_xargs": {"agentspec_stage": "S"}}',
        ),
    ],
)
def test_passes_through_unchanged(path, method, headers, body):
    mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys=None)
    sent, scope, seen = run(mw, path=path, method=method, headers=headers, body=body, pieces=2)
    assert seen == body
    assert response_body(sent) == body
    assert scope["headers"] == [(k.lower().encode(), v.encode()) for k, v in headers]


def test_oversized_body_passes_through_in_its_chunks():
    mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys=None, max_body_bytes=100)
    body = json.dumps({"prompt": "z" * 500}).encode()
    _, _, seen = run(mw, headers=[JSON, ("X-AgentSpec-Stage", "S")], body=body, pieces=9)
    assert seen == body
    assert mw.app.after_body == {"type": "http.disconnect"}


def test_streamed_answer_passes_through():
    app = EchoApp(chunks=5)
    mw = AgentSpecHeaderMiddleware(app, tenant_keys=None)
    body = json.dumps({"prompt": "p" * 200, "stream": True}).encode()
    sent, _, seen = run(mw, headers=[JSON, ("X-AgentSpec-Stage", "S")], body=body)
    chunks = [m for m in sent if m["type"] == "http.response.body"]
    assert len(chunks) >= 5
    assert [m["more_body"] for m in chunks] == [True] * (len(chunks) - 1) + [False]
    assert response_body(sent) == seen


def test_lifespan_scope_passes_through():
    app = EchoApp()
    mw = AgentSpecHeaderMiddleware(app, tenant_keys=None)

    async def receive():
        return {"type": "lifespan.startup"}

    async def send(msg):
        raise AssertionError("nothing is sent")

    asyncio.run(mw({"type": "lifespan"}, receive, send))
    assert app.calls[0][0] == {"type": "lifespan"}


def test_tenant_from_api_key_overrides_body():
    keys = {"sk-a": "team-a"}
    mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys=keys)
    body = b'{"prompt": "x", "vllm_xargs": {"agentspec_tenant": "team-b"}}'
    auth = ("Authorization", "Bearer sk-a")
    _, _, seen = run(mw, headers=[JSON, auth], body=body)
    assert json.loads(seen)["vllm_xargs"] == {"agentspec_tenant": "team-a"}
    _, _, seen = run(mw, headers=[JSON, ("Authorization", "Bearer other")], body=body)
    assert json.loads(seen)["vllm_xargs"] == {"agentspec_tenant": "default"}
    _, _, seen = run(mw, headers=[JSON, auth, ("X-AgentSpec-Stage", "S")], body=b'{"p": 1}')
    assert json.loads(seen)["vllm_xargs"] == {"agentspec_stage": "S", "agentspec_tenant": "team-a"}


def test_tenant_map_from_environment(tmp_path, monkeypatch):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-z": "zeta"}))
    monkeypatch.setenv(TENANT_KEYS_ENV, str(path))
    mw = AgentSpecHeaderMiddleware(EchoApp())
    assert mw.tenant_keys == {"sk-z": "zeta"}
    _, _, seen = run(mw, headers=[JSON, ("authorization", "bearer sk-z")], body=b"{}")
    assert json.loads(seen)["vllm_xargs"] == {"agentspec_tenant": "zeta"}


def test_no_tenant_map_without_environment(monkeypatch):
    monkeypatch.delenv(TENANT_KEYS_ENV, raising=False)
    assert AgentSpecHeaderMiddleware(EchoApp()).tenant_keys is None


@pytest.mark.parametrize(
    "content", ["not json", "[1]", '{"k": 3}', '{"": "t"}', '{"k": "bad\\u0001"}']
)
def test_bad_tenant_map_is_refused(tmp_path, content):
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(InvalidArgumentError):
        load_tenant_keys(path)


def test_missing_tenant_map_file_is_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="tenant key map"):
        load_tenant_keys(tmp_path / "absent.json")


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError):
        AgentSpecHeaderMiddleware(EchoApp(), max_body_bytes=0)
    with pytest.raises(InvalidArgumentError):
        AgentSpecHeaderMiddleware(EchoApp(), tenant_keys={"k": ""})


# --- tenant map: a body the middleware cannot check is refused, never forwarded ---------
# Regression tests of an outside review: with a tenant map, a client whose key
# maps to team-a reached team-b's shards by padding its JSON body past
# max_body_bytes (passed through unchanged, so its own agentspec_tenant stood).

KEYS = {"sk-a": "team-a", "sk-b": "team-b"}
AUTH_A = ("Authorization", "Bearer sk-a")
ASK_B = {"vllm_xargs": {"agentspec_tenant": "team-b"}}


def _error(sent, status):
    assert sent[0]["type"] == "http.response.start"
    assert sent[0]["status"] == status
    assert (b"content-type", b"application/json") in sent[0]["headers"]
    err = json.loads(response_body(sent))["error"]
    assert err["code"] == status
    assert err["message"]
    assert {"type", "param"} <= set(err)
    return err


def test_padded_body_over_the_default_limit_is_refused_with_413():
    app = EchoApp()
    mw = AgentSpecHeaderMiddleware(app, tenant_keys=KEYS)
    pad = "x" * (DEFAULT_MAX_BODY_BYTES + 1)
    body = json.dumps({"prompt": "p", "pad": pad, **ASK_B}).encode()
    sent, _, _ = run(mw, headers=[JSON, AUTH_A], body=body, pieces=65)
    assert "over" in _error(sent, 413)["message"]
    assert app.calls == []


@pytest.mark.parametrize("pieces", [1, 9])
def test_body_over_max_body_bytes_is_refused_with_a_tenant_map(pieces):
    app = EchoApp()
    mw = AgentSpecHeaderMiddleware(app, tenant_keys=KEYS, max_body_bytes=100)
    body = json.dumps({"prompt": "z" * 500, **ASK_B}).encode()
    sent, _, _ = run(mw, headers=[JSON, AUTH_A], body=body, pieces=pieces)
    _error(sent, 413)
    assert app.calls == []


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b'{"prompt": ', "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'"team-b"', "JSON object"),
        (b'{"prompt": "x", "vllm_xargs": "agentspec_tenant=team-b"}', "vllm_xargs"),
        (b'{"prompt": "x", "vllm_xargs": ["team-b"]}', "vllm_xargs"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    ],
)
@pytest.mark.parametrize("ctype", ["application/json", "text/plain", None])
def test_uncheckable_bodies_get_400_with_a_tenant_map(body, words, ctype):
    app = EchoApp()
    mw = AgentSpecHeaderMiddleware(app, tenant_keys=KEYS)
    headers = [AUTH_A] + ([] if ctype is None else [("content-type", ctype)])
    sent, _, _ = run(mw, headers=headers, body=body, pieces=3)
    assert words in _error(sent, 400)["message"]
    assert app.calls == []


@pytest.mark.parametrize("ctype", ["text/plain", None, "application/x-www-form-urlencoded"])
def test_json_under_any_content_type_gets_the_key_tenant(ctype):
    # Without a Content-Type FastAPI still parses the body as JSON: it used to
    # pass through unchanged, with the client's own agentspec_tenant.
    mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys=KEYS)
    headers = [AUTH_A] + ([] if ctype is None else [("content-type", ctype)])
    body = json.dumps({"prompt": "x", **ASK_B}).encode()
    _, _, seen = run(mw, headers=headers, body=body)
    assert json.loads(seen)["vllm_xargs"] == {"agentspec_tenant": "team-a"}


def test_forwarded_body_is_the_checked_one():
    # Duplicate keys: the last one wins in Python's parser; the forwarded body
    # is re-encoded, so no other parser can read a different tenant from it.
    mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys=KEYS)
    body = (
        b'{"prompt": "x", "vllm_xargs": {"agentspec_tenant": "team-b"},'
        b' "vllm_xargs": {"agentspec_tenant": "team-a"}}'
    )
    sent, scope, seen = run(mw, headers=[JSON, AUTH_A, ("Transfer-Encoding", "chunked")], body=body)
    assert seen == b'{"prompt":"x","vllm_xargs":{"agentspec_tenant":"team-a"}}'
    assert seen.count(b"vllm_xargs") == 1
    names = [k for k, _ in scope["headers"]]
    assert b"transfer-encoding" not in names
    assert names.count(b"content-length") == 1
    assert response_body(sent) == seen


def test_lone_surrogates_are_forwarded_escaped():
    for keys in (KEYS, None):
        mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys=keys)
        body = b'{"prompt": "a\\ud800b"}'
        _, _, seen = run(mw, headers=[JSON, AUTH_A, ("X-AgentSpec-Stage", "S")], body=body)
        obj = json.loads(seen)
        assert obj["prompt"] == "a\ud800b"
        assert obj["vllm_xargs"]["agentspec_stage"] == "S"


def test_disconnect_mid_body_forwards_nothing():
    app = EchoApp()
    mw = AgentSpecHeaderMiddleware(app, tenant_keys=KEYS)
    incoming = [
        {"type": "http.request", "body": b'{"prompt": ', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(msg):
        sent.append(msg)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer sk-a")],
    }
    asyncio.run(mw(scope, receive, send))
    assert sent == []
    assert app.calls == []


@pytest.mark.parametrize(
    "path",
    [
        "/v1/messages",
        "/invocations",
        "/v1/chat/completions/batch",
        "/v1/responses",
        "/v1/chat/completions/",
    ],
)
def test_every_json_generation_route_gets_the_key_tenant(path):
    mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys=KEYS)
    body = json.dumps({"messages": [], **ASK_B}).encode()
    _, _, seen = run(mw, path=path, headers=[JSON, AUTH_A], body=body)
    assert json.loads(seen)["vllm_xargs"] == {"agentspec_tenant": "team-a"}


def test_token_generate_route_gets_the_key_tenant_in_extra_args():
    mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys=KEYS)
    path = "/inference/v1/generate"
    body = {"token_ids": [1, 2], "sampling_params": {"extra_args": {"agentspec_tenant": "team-b"}}}
    _, _, seen = run(mw, path=path, headers=[JSON, AUTH_A], body=json.dumps(body).encode())
    assert json.loads(seen)["sampling_params"]["extra_args"] == {"agentspec_tenant": "team-a"}
    body2 = {"token_ids": [1], "sampling_params": {"max_tokens": 3}}
    _, _, seen = run(mw, path=path, headers=[JSON, AUTH_A], body=json.dumps(body2).encode())
    assert json.loads(seen)["sampling_params"] == {
        "max_tokens": 3,
        "extra_args": {"agentspec_tenant": "team-a"},
    }
    sent, _, _ = run(mw, path=path, headers=[JSON, AUTH_A], body=b'{"token_ids": [1]}')
    assert "sampling_params" in _error(sent, 400)["message"]


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations"])
def test_form_routes_are_refused_with_a_tenant_map(path):
    app = EchoApp()
    form = [("content-type", "multipart/form-data; boundary=b"), AUTH_A]
    sent, _, _ = run(AgentSpecHeaderMiddleware(app, tenant_keys=KEYS), path=path, headers=form)
    _error(sent, 400)
    assert app.calls == []
    _, _, seen = run(AgentSpecHeaderMiddleware(app, tenant_keys=None), path=path, body=b"f")
    assert seen == b"f"


def test_hashed_keys_in_the_map():
    digest = hashlib.sha256(b"sk-hidden").hexdigest()
    mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys={f"sha256:{digest}": "team-h"})
    auth = ("Authorization", "Bearer sk-hidden")
    _, _, seen = run(mw, headers=[JSON, auth], body=b"{}")
    assert json.loads(seen)["vllm_xargs"] == {"agentspec_tenant": "team-h"}
    # The digest written in the file is not itself a key.
    _, _, seen = run(mw, headers=[JSON, ("Authorization", f"Bearer sha256:{digest}")], body=b"{}")
    assert json.loads(seen)["vllm_xargs"] == {"agentspec_tenant": "default"}


def test_first_authorization_header_decides():
    mw = AgentSpecHeaderMiddleware(EchoApp(), tenant_keys=KEYS)
    headers = [JSON, ("Authorization", "Bearer sk-a"), ("Authorization", "Bearer sk-b")]
    _, _, seen = run(mw, headers=headers, body=b"{}")
    assert json.loads(seen)["vllm_xargs"] == {"agentspec_tenant": "team-a"}


def test_the_loader_is_agentspecs():
    assert load_tenant_keys is agentspec_load_tenant_keys
    assert TENANT_KEYS_ENV == "AGENTSPEC_TENANT_KEYS"
