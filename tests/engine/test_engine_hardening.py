"""The embedded engine's server under hostile input, on the real SmolLM2-135M model.

Regression tests of an outside review of ``agentspec serve``:

- a pushed shard holding token ids the model does not have is refused by the
  engine's intake (422: it knows the model's vocabulary); one taken anyway
  (an intake without the bound) never breaks a request: such a token ends its
  branch of the draft;
- an over-long prompt is refused (400) before it is tokenized;
- malformed requests (tiny temperatures, JSON nested 100,000 deep, huge
  numbers, lone surrogates, ...) get a 4xx with an OpenAI-style error body,
  an internal error a generic 500 (details only in the log), never a 500 for
  bad input -- checked by a hypothesis fuzz of request bodies;
- the listen backlog holds a burst of 128 connections, and the server answers
  128 simultaneous connections plus 32 streaming clients without an error.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prereq import require_module

torch = require_module("torch")
require_module("transformers")

from http_burst import get_round, handshakes_done, open_burst  # noqa: E402

from agentspec import ShardPusher, ShardStore, SuffixTree  # noqa: E402
from agentspec._push.wire import (  # noqa: E402
    SHARD_CONTENT_TYPE,
    SNAPSHOT_PATH,
    encode_key_query,
    parse_error,
)
from agentspec.engine import (  # noqa: E402
    MIN_TEMPERATURE,
    SAMPLING_EPS,
    DraftTree,
    EngineOptions,
    EngineServer,
    SamplingParams,
    as_draft_tree,
    effective_temperature,
    prune_draft_tree,
    target_probs,
)
from agentspec.engine._chat import max_token_bytes  # noqa: E402
from agentspec.engine._server import MAX_REQUEST_BYTES  # noqa: E402
from agentspec.exceptions import InvalidTokenError  # noqa: E402

MODEL = "smollm2-135m"
VOCAB = 49152  # SmolLM2's vocabulary
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "Write a SQL query that selects all rows from a table named users."


@pytest.fixture(scope="module")
def server(start_server: Callable[..., EngineServer]) -> EngineServer:
    return start_server(EngineOptions(default_max_tokens=4))


def _post(
    port: int, path: str, body: Any, timeout: float = 120
) -> tuple[int, bytes, dict[str, str]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def _error(status: int, raw: bytes) -> dict[str, Any]:
    """The error object of a 4xx/5xx answer (checked to be OpenAI-shaped)."""
    err = json.loads(raw)["error"]
    assert isinstance(err["message"], str)
    assert err["message"]
    assert isinstance(err["type"], str)
    assert "param" in err
    assert "code" in err
    return err  # type: ignore[no-any-return]


def _chat_body(
    content: str = PROMPT, stage: str = "hardening", speculate: bool = True, **more: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
        "return_token_ids": True,
        "vllm_xargs": {"agentspec_stage": stage, "agentspec_speculate": speculate},
    }
    body.update(more)
    return body


def _ids(raw: bytes) -> list[int]:
    return json.loads(raw)["choices"][0]["token_ids"]  # type: ignore[no-any-return]


@contextlib.contextmanager
def _without_vocab_bound(server: EngineServer) -> Iterator[None]:
    """Pushes taken as by an intake that does not know the vocabulary (it refuses them)."""
    vocab = server.intake.vocab_size
    assert vocab == VOCAB
    server.intake.vocab_size = None
    try:
        yield
    finally:
        server.intake.vocab_size = vocab


def _push_refused(server: EngineServer, key: tuple[str, str, str], *seqs: list[int]) -> None:
    """The engine's intake refuses these sequences (422, out of vocabulary)."""
    with SuffixTree(server.engine.options.max_depth) as tree:
        for i, seq in enumerate(seqs):
            tree.add(i + 1, seq)
        data = tree.to_bytes()
    query = encode_key_query(key)
    r = server.intake.handle(
        "PUT", SNAPSHOT_PATH, query, {"Content-Type": SHARD_CONTENT_TYPE}, data
    )
    assert r.status == 422
    assert parse_error(r.body)[0] == "out_of_vocabulary"


def _push(server: EngineServer, key: tuple[str, str, str], *seqs: list[int]) -> None:
    store = ShardStore()
    pusher = ShardPusher(store, [server.url])
    try:
        for seq in seqs:
            store.learn(key, seq)
        assert pusher.flush(30)
    finally:
        pusher.close()
        store.close()


# --- 1. out-of-vocabulary drafts ----------------------------------------------------


def test_prune_draft_tree_keeps_the_valid_prefix_and_drops_subtrees() -> None:
    # a chain ends at its first bad token
    assert prune_draft_tree([5, 6, VOCAB, 7], VOCAB) == as_draft_tree([5, 6])
    assert prune_draft_tree([60000, 1, 2], VOCAB) == as_draft_tree(None)
    assert prune_draft_tree([1, 2, 3], VOCAB) == as_draft_tree([1, 2, 3])
    # a tree drops the bad node and its subtree, keeps its siblings (re-indexed)
    tree = ([1, 60000, 3, 4, 5, 2**31 - 1, 6], [-1, 0, 1, 0, -1, 4, 5])
    assert prune_draft_tree(tree, VOCAB) == as_draft_tree(([1, 4, 5], [-1, 0, -1]))
    assert prune_draft_tree(DraftTree((9, 70000, 8), (-1, 0, -1)), VOCAB) == DraftTree(
        (9, 8), (-1, -1)
    )
    assert len(prune_draft_tree(None, VOCAB)) == 0
    # the verifier's own validation stays strict
    with pytest.raises(InvalidTokenError):
        as_draft_tree([1, 60000], VOCAB)
    with pytest.raises(InvalidTokenError):
        as_draft_tree(DraftTree((1, -3), (-1, 0)), VOCAB)


def test_one_call_makes_the_engine_step_tree() -> None:
    """max_depth cuts in the same pass as pruning / checking, as .trimmed() after it did."""
    tree = ([1, 60000, 3, 4, 5, 2**31 - 1, 6, 7], [-1, 0, 1, 0, -1, 4, 5, 3])
    for depth in (0, 1, 2, 3, None):
        pruned = prune_draft_tree(tree, VOCAB)
        want = pruned if depth is None else pruned.trimmed(depth)
        assert prune_draft_tree(tree, VOCAB, max_depth=depth) == want
        chain = as_draft_tree([5, 6, 7], VOCAB)
        assert as_draft_tree([5, 6, 7], VOCAB, max_depth=depth) == (
            chain if depth is None else chain.trimmed(depth)
        )
    # a checked tree passes the verifier's check as it is; a smaller vocabulary still refuses it
    checked = prune_draft_tree(tree, VOCAB, max_depth=2)
    assert as_draft_tree(checked, VOCAB) is checked
    with pytest.raises(InvalidTokenError):
        as_draft_tree(checked, 5)
    with pytest.raises(InvalidTokenError):  # strict: a bad token deeper than max_depth raises
        as_draft_tree([1, 2, 60000], VOCAB, max_depth=1)


@pytest.mark.parametrize("where", ["middle", "first"])
def test_pushed_shard_with_out_of_vocab_ids_keeps_serving(server: EngineServer, where: str) -> None:
    status, raw, _ = _post(server.port, CHAT, _chat_body(stage="oov-ref", speculate=False))
    assert status == 200, raw[:300]
    assert json.loads(raw)["agentspec"]["speculate"] is False
    ref = json.loads(raw)
    prompt, out = ref["prompt_token_ids"], ref["choices"][0]["token_ids"]
    assert len(out) == 12
    key = ("default", f"oov-pipe-{where}", "oov-stage")
    cut = 4 if where == "middle" else 0
    bad = prompt[-8:] + out[:cut] + [60000, VOCAB] + out[cut:]
    _push_refused(server, key, bad)
    with _without_vocab_bound(server):
        _push(server, key, bad)
    for stream in (False, True):
        body = _chat_body(stage="oov-stage")
        body["vllm_xargs"]["agentspec_pipeline"] = key[1]
        body["stream"] = stream
        status, raw, _ = _post(server.port, CHAT, body)
        assert status == 200, raw[:300]
        if stream:
            events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e[6:7] == "{"]
            assert not any("error" in e for e in events)
            ids = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
            assert ids == out
        else:
            assert _ids(raw) == out  # the greedy output, whatever the drafts
            if where == "middle":  # the valid prefix of the draft was kept
                assert json.loads(raw)["agentspec"]["accepted"] >= cut


def test_tree_drafts_drop_out_of_vocab_branches(model_tok: tuple[Any, Any]) -> None:
    opts = EngineOptions(tree_drafts=True, default_max_tokens=12)
    with EngineServer.create(*model_tok, opts) as srv:
        try:
            status, raw, _ = _post(srv.port, CHAT, _chat_body(stage="t-ref", speculate=False))
            assert status == 200, raw[:300]
            ref = json.loads(raw)
            prompt, out = ref["prompt_token_ids"], ref["choices"][0]["token_ids"]
            key = ("default", "oov-tree", "t-stage")
            # two branches after the prompt: one through bad ids, one right
            branches = ([*prompt[-8:], 61000, out[0], 62000], prompt[-8:] + out)
            _push_refused(srv, key, *branches)
            with _without_vocab_bound(srv):
                _push(srv, key, *branches)
            body = _chat_body(stage="t-stage")
            body["vllm_xargs"]["agentspec_pipeline"] = key[1]
            status, raw, _ = _post(srv.port, CHAT, body)
            assert status == 200, raw[:300]
            assert _ids(raw) == out
            assert json.loads(raw)["agentspec"]["accepted"] > 0
        finally:
            srv.engine.close()


# --- 2. prompt length bounded before tokenizing --------------------------------------


class _SpyTokenizer:
    """Forwards to a tokenizer, recording the size of every text it tokenizes."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.calls: list[int] = []

    def __call__(self, text: str, *a: Any, **kw: Any) -> Any:
        self.calls.append(len(text))
        return self._tok(text, *a, **kw)

    def apply_chat_template(self, messages: list[dict[str, str]], *a: Any, **kw: Any) -> Any:
        self.calls.append(sum(len(m["content"]) for m in messages))
        return self._tok.apply_chat_template(messages, *a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def test_huge_prompts_are_refused_before_tokenizing(
    server: EngineServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.engine
    limit = engine.max_prompt_bytes
    assert limit == engine.max_model_len * (max_token_bytes(engine.tokenizer) + 1)
    spy = _SpyTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", spy)
    huge = "hello " * (15_000_000 // 6)  # 15 MB: 44 s of tokenizing before the fix
    assert len(huge) + 100 < MAX_REQUEST_BYTES
    multibyte = "\u00e9" * (limit // 2 + 1)  # under the bound in characters, over in bytes
    cases = [
        (COMPLETIONS, {"model": MODEL, "prompt": huge, "max_tokens": 1}),
        (COMPLETIONS, {"model": MODEL, "prompt": [huge], "max_tokens": 1}),
        (COMPLETIONS, {"model": MODEL, "prompt": multibyte, "max_tokens": 1}),
        (CHAT, _chat_body(huge)),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": huge}]}]}),
        (CHAT, {"messages": [{"role": "user", "content": "x" * (limit // 3)}] * 4}),
    ]
    for path, body in cases:
        status, raw, _ = _post(server.port, path, body)
        assert status == 400, raw[:300]
        err = _error(status, raw)
        assert "maximum context length" in err["message"]
        assert "refused without tokenizing" in err["message"]
        assert err["param"] == ("messages" if path == CHAT else "prompt")
    # many messages, each taking a token at least
    status, raw, _ = _post(
        server.port, CHAT, {"messages": [{"role": "user"}] * (engine.max_model_len + 1)}
    )
    assert status == 400
    assert "maximum context length" in _error(status, raw)["message"]
    # a token list over the context is refused for its length, its ids unchecked
    status, raw, _ = _post(server.port, COMPLETIONS, {"prompt": [10**6] * 9000})
    assert status == 400
    assert "maximum context length" in _error(status, raw)["message"]
    assert spy.calls == []  # nothing was tokenized
    # under the bound the prompt is tokenized, then refused by its token count
    status, raw, _ = _post(server.port, COMPLETIONS, {"prompt": "hello " * 10_000})
    assert status == 400
    assert "10001 tokens" in _error(status, raw)["message"]
    assert spy.calls == [60_000]


# --- 3. malformed requests: 4xx, never 500 -------------------------------------------


def test_tiny_temperatures_are_greedy_or_clamped() -> None:
    assert SAMPLING_EPS == 1e-5
    assert MIN_TEMPERATURE == 1e-2
    assert effective_temperature(0.0) == 0.0
    assert effective_temperature(5e-324) == 0.0
    assert effective_temperature(9.9e-6) == 0.0
    assert effective_temperature(1e-5) == MIN_TEMPERATURE
    assert effective_temperature(0.5) == 0.5
    assert SamplingParams(5e-324).greedy
    assert not SamplingParams(1e-4).greedy
    logits = np.array([[30.0, 29.5, -4.0, 12.0]])
    np.testing.assert_array_equal(target_probs(logits, 5e-324), [[1, 0, 0, 0]])
    for t in (1e-5, 1e-4, 1e-3):
        p = target_probs(logits, t)
        assert np.isfinite(p).all()
        np.testing.assert_allclose(p, target_probs(logits, MIN_TEMPERATURE))
        assert p.sum() == pytest.approx(1.0)


def test_malformed_requests_get_4xx_with_an_error_body(server: EngineServer) -> None:
    port = server.port
    status, raw, _ = _post(port, COMPLETIONS, {"prompt": "Hi", "max_tokens": 3, "temperature": 0})
    assert status == 200
    greedy = json.loads(raw)["choices"][0]["text"]
    for temperature in (5e-324, 1e-300, 9e-6):  # below SAMPLING_EPS: greedy
        body = {"prompt": "Hi", "max_tokens": 3, "temperature": temperature}
        status, raw, _ = _post(port, COMPLETIONS, body)
        assert status == 200, raw[:300]
        assert json.loads(raw)["choices"][0]["text"] == greedy
    status, raw, _ = _post(
        port, COMPLETIONS, {"prompt": "Hi", "max_tokens": 3, "temperature": 1e-4}
    )
    assert status == 200, raw[:300]
    deep = b"[" * 100_000 + b"]" * 100_000
    bad: list[tuple[str, bytes]] = [
        (COMPLETIONS, deep),
        (COMPLETIONS, b'{"prompt": ' + deep + b"}"),
        (CHAT, b'{"messages": ' + b"{" * 50_000 + b"}" * 50_000 + b"}"),
        (COMPLETIONS, b'{"prompt": "Hi", "temperature": NaN}'),
        (COMPLETIONS, b'{"prompt": "Hi", "temperature": Infinity}'),
        (COMPLETIONS, b'{"prompt": "Hi", "temperature": 1' + b"0" * 400 + b"}"),
        (COMPLETIONS, b'{"prompt": "Hi", "top_p": -1' + b"0" * 400 + b"}"),
        (COMPLETIONS, b'{"prompt": "Hi", "max_tokens": 1' + b"0" * 5000 + b"}"),
        (COMPLETIONS, b'{"prompt": "Hi", "max_tokens": 1e999}'),
        (COMPLETIONS, b'{"prompt": "Hi\\ud800"}'),
        (COMPLETIONS, b'{"prompt": ["\\udfff"]}'),
        (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        (CHAT, b'{"messages": [{"role": ["user"], "content": "hi"}]}'),
        (CHAT, b'{"messages": [{"role": {"a": 1}, "content": "hi"}]}'),
        (COMPLETIONS, b'{"prompt": "Hi", "vllm_xargs": {"agentspec_stage": "\\ud800"}}'),
        (COMPLETIONS, b'{"prompt": "Hi", "n": ' + b"[" * 900 + b"]" * 900 + b"}"),
        (COMPLETIONS, b"\xff\xfe{}"),
        (COMPLETIONS, b""),
    ]
    for path, body in bad:
        status, raw, headers = _post(port, path, body)
        assert 400 <= status < 500, (body[:80], status, raw[:300])
        assert headers["content-type"] == "application/json"
        _error(status, raw)


def test_internal_errors_are_generic_500s(
    server: EngineServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any, **__: Any) -> Iterator[Any]:
        raise RuntimeError("secret internal detail")
        yield  # a generator, as Engine.generate returns

    monkeypatch.setattr(server.engine, "generate", broken)
    status, raw, _ = _post(server.port, COMPLETIONS, {"prompt": "Hi", "max_tokens": 1})
    assert status == 500
    err = _error(status, raw)
    assert err["type"] == "server_error"
    assert "secret" not in raw.decode()
    body = {"prompt": "Hi", "max_tokens": 1, "stream": True}
    status, raw, _ = _post(server.port, COMPLETIONS, body)
    assert status == 200  # the stream had started: the error comes in-band
    events = [e[6:] for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert "secret" not in raw.decode()


# --- 4. fuzzing request bodies ---------------------------------------------------------

_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 2**31, 2**63, -(2**63) - 1, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 5e-324, 1e-6, 1e-4, 0.5, 2.0, 2.5, 1e308]),
    st.text(max_size=12),
    st.sampled_from(["", MODEL, "user", "assistant", "text", "none", "\ud800", "yes"]),
)
_JSON = st.recursive(
    _LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
_PART = st.fixed_dictionaries(
    {"text": st.text(max_size=12) | _JSON}, optional={"type": st.sampled_from(["text", "image"])}
)
_MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "bot"])
        | _JSON,
        "content": st.text(max_size=30) | st.lists(_PART, max_size=2) | _JSON,
        "name": st.text(max_size=5),
        "tool_calls": _JSON,
    },
)
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([MODEL, "no-such-model", ""]),
    "max_tokens": st.integers(-1, 3),
    "max_completion_tokens": st.integers(-1, 3),
    "temperature": st.floats(0, 2) | st.sampled_from([0, 5e-324, 1e-6, 1e-4, 2.5, -1]),
    "top_p": st.floats(0, 1) | st.sampled_from([0, 1, 1.5]),
    "stream": st.booleans(),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "seed": st.integers(-(2**70), 2**70),
    "n": st.sampled_from([1, 2]),
    "best_of": st.sampled_from([1, 2]),
    "logprobs": st.sampled_from([False, True, 1]),
    "top_logprobs": st.sampled_from([0, 2]),
    "echo": st.booleans(),
    "suffix": st.text(max_size=3),
    "tools": st.lists(_JSON, max_size=1),
    "tool_choice": st.sampled_from(["none", "auto"]),
    "return_token_ids": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": _JSON}),
    "vllm_xargs": st.fixed_dictionaries(
        {},
        optional={
            "agentspec_stage": st.text(max_size=6) | _JSON,
            "agentspec_pipeline": st.text(max_size=6),
            "agentspec_tenant": st.sampled_from(["default", "t2", ""]),
            "agentspec_speculate": st.sampled_from([True, False, "yes", "off", 0, 2, "maybe"]),
        },
    ),
    "prompt": st.text(max_size=30)
    | st.lists(st.integers(-3, VOCAB + 3), max_size=8)
    | st.lists(st.text(max_size=6) | st.lists(st.integers(0, 100), max_size=3), max_size=2),
    "messages": st.lists(_MESSAGE, max_size=3),
}


@st.composite
def _request(draw: st.DrawFn) -> tuple[str, bytes]:
    """A request path and body: mostly a valid body with some fields changed, or junk."""
    path = draw(st.sampled_from([CHAT, COMPLETIONS]))
    shape = draw(st.sampled_from(["mutated", "mutated", "mutated", "random", "junk"]))
    if shape == "junk":
        depth = draw(st.integers(1, 200_000))
        body = draw(
            st.sampled_from(
                [b"[" * depth + b"]" * depth, b'{"prompt": ' + b"[" * depth, b"\xc3\x28", b"nul"]
            )
            | st.binary(max_size=40)
            | _JSON.map(lambda v: json.dumps(v).encode())
        )
        return path, body
    if shape == "random":
        obj: dict[str, Any] = draw(st.dictionaries(st.sampled_from(sorted(_FIELDS)), _JSON))
    else:
        temperature = draw(st.sampled_from([0, 0, 0.7, 1e-6, 1e-310, 5e-324]))
        obj = {"model": MODEL, "max_tokens": 2, "temperature": temperature}
        if path == CHAT:
            obj["messages"] = [{"role": "user", "content": "Say hi."}]
        else:
            obj["prompt"] = "Say hi."
        names = draw(st.lists(st.sampled_from(sorted(_FIELDS)), max_size=3, unique=True))
        for name in names:
            obj[name] = draw(_FIELDS[name] | _JSON)
    obj.update(draw(st.dictionaries(st.text(max_size=8), _JSON, max_size=2)))  # unknown fields
    for name in ("max_tokens", "max_completion_tokens"):  # keep valid requests short
        if type(obj.get(name)) is int and obj[name] > 3:
            obj[name] = 3
    return path, json.dumps(obj).encode()


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(req=_request())
def test_fuzzed_request_bodies_never_get_a_5xx(
    server: EngineServer, req: tuple[str, bytes]
) -> None:
    path, body = req
    status, raw, headers = _post(server.port, path, body)
    event(f"status {status}")
    assert status < 500, (body[:200], raw[:300])
    if status >= 400:
        _error(status, raw)
        return
    assert status == 200
    if headers["content-type"] == "text/event-stream":
        events = [e for e in raw.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        for e in events[:-1]:
            assert "error" not in json.loads(e[6:]), e
    else:
        assert json.loads(raw)["choices"]


# --- 5. connection bursts ---------------------------------------------------------------


def test_listen_backlog_holds_a_burst_of_128_connections(model_tok: tuple[Any, Any]) -> None:
    srv = EngineServer.create(*model_tok)  # bound and listening, not accepting yet
    try:
        assert srv._httpd.request_queue_size >= 128
        socks = open_burst(srv.port, 128)
        # with the old backlog of 5 all but 6 stayed in SYN_SENT
        assert handshakes_done(socks)
        srv.start()
        assert get_round(socks, "/health", time.monotonic() + 60) == []
    finally:
        srv.stop()
        srv.engine.close()


def _stream_chat(port: int, i: int, rounds: int, errors: list[str]) -> None:
    for r in range(rounds):
        body = _chat_body(f"Say the number {i}.", stage=f"load-{i % 4}", max_tokens=3)
        body["stream"] = True
        try:
            status, raw, _ = _post(port, CHAT, body, timeout=120)
        except OSError as exc:
            errors.append(f"client {i} round {r}: {exc!r}")
            continue
        text = raw.decode(errors="replace")
        if status != 200 or not text.endswith("data: [DONE]\n\n") or '"error"' in text:
            errors.append(f"client {i} round {r}: {status} {text[-200:]!r}")


@pytest.mark.slow
def test_128_connections_and_32_streams_without_errors(server: EngineServer) -> None:
    errors: list[str] = []
    clients = [
        threading.Thread(target=_stream_chat, args=(server.port, i, 2, errors), daemon=True)
        for i in range(32)
    ]
    for t in clients:
        t.start()
    rounds = 0
    stop = time.monotonic() + 30
    health_errors: list[str] = []
    # bursts of 128 simultaneous /health connections while the streams run
    while rounds == 0 or (any(t.is_alive() for t in clients) and time.monotonic() < stop):
        health_errors += get_round(open_burst(server.port, 128), "/health", time.monotonic() + 60)
        rounds += 1
    for t in clients:
        t.join(300)
    assert not any(t.is_alive() for t in clients)
    assert health_errors == []
    assert errors == []
    assert rounds >= 1
