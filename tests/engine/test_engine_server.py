"""The embedded engine's OpenAI-compatible server on the real SmolLM2-135M model.

The server runs in-process on a random port.  Greedy outputs with
speculation on must equal those with speculation off token for token (both
endpoints, streamed or not, chain and tree drafts); a repeated prompt of a
stage must take fewer verification steps; shards pushed by a `ShardPusher`
and outputs learned by an `AgentSpecClient` must line up with the engine's
token ids; bad requests get 4xx answers and the server keeps serving.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from typing import Any

import pytest
from prereq import require_module

torch = require_module("torch")
require_module("transformers")
openai = require_module("openai")

from agentspec import AgentSpecClient, ShardPusher, ShardStore  # noqa: E402
from agentspec.engine import EngineOptions, EngineServer, TextDecoder  # noqa: E402

MAX_NEW = 20
CHAT_PROMPTS = [
    "Write a SQL query that selects all rows from a table named users.",
    "Give me a JSON object with keys name and age for a person called Ann who is 30.",
    "List three colors of the rainbow.",
]
TEXT_PROMPTS = ["def fibonacci(n):\n    ", "The three primary colors are"]
COUNT = "Count from 1 to 10, separated by commas."


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(EngineOptions(default_max_tokens=64))


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120) as c:
        yield c


def _xargs(stage: str, speculate: bool = True, **more: Any) -> dict[str, Any]:
    xargs = {"agentspec_stage": stage, "agentspec_speculate": speculate, **more}
    return {"vllm_xargs": xargs, "return_token_ids": True}


def _chat(
    client, text: str, stage: str, speculate: bool = True, pipeline: str | None = None, **kw: Any
) -> dict[str, Any]:
    kw.setdefault("max_tokens", MAX_NEW)
    more = {} if pipeline is None else {"agentspec_pipeline": pipeline}
    r = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": text}],
        temperature=0,
        extra_body=_xargs(stage, speculate, **more),
        **kw,
    )
    return r.model_dump()  # type: ignore[no-any-return]


def _complete(client, prompt: str, stage: str, speculate: bool = True) -> dict[str, Any]:
    r = client.completions.create(
        model="smollm2-135m",
        prompt=prompt,
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body=_xargs(stage, speculate),
    )
    return r.model_dump()  # type: ignore[no-any-return]


def _stream(client, kind: str, content: str, stage: str, **kw: Any) -> dict[str, Any]:
    """A streamed call's text, token ids, finish reason, agentspec field and usage."""
    common: dict[str, Any] = {
        "model": "smollm2-135m",
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": _xargs(stage),
    }
    common.setdefault("max_tokens", MAX_NEW)
    common.update(kw)
    if kind == "chat":
        chunks = client.chat.completions.create(
            messages=[{"role": "user", "content": content}], **common
        )
    else:
        chunks = client.completions.create(prompt=content, **common)
    out: dict[str, Any] = {"text": "", "ids": [], "finish": None, "agentspec": None}
    for ch in chunks:
        d = ch.model_dump()
        if d.get("prompt_token_ids") is not None:
            out["prompt_ids"] = d["prompt_token_ids"]
        if d.get("usage"):
            out["usage"] = d["usage"]
        if d.get("agentspec"):
            out["agentspec"] = d["agentspec"]
        for c in d["choices"]:
            piece = c["delta"]["content"] if kind == "chat" else c["text"]
            out["text"] += piece or ""
            out["ids"] += c.get("token_ids") or []
            out["finish"] = c["finish_reason"] or out["finish"]
    return out


def _raw(server, method: str, path: str, body: bytes | None = None, **headers: str):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        hdrs = {"Content-Type": "application/json", **headers}
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _text(d: dict[str, Any]) -> str:
    ch = d["choices"][0]
    return ch["message"]["content"] if "message" in ch else ch["text"]  # type: ignore[no-any-return]


# --- losslessness --------------------------------------------------------------


def test_greedy_chat_lossless_plain_and_streamed(client) -> None:
    for i, text in enumerate(CHAT_PROMPTS):
        stage = f"chat-{i}"
        off = _chat(client, text, stage, speculate=False)
        on = _chat(client, text, stage, speculate=True)
        streamed = _stream(client, "chat", text, stage)
        ref = off["choices"][0]["token_ids"]
        assert len(ref) == off["usage"]["completion_tokens"] > 0
        assert on["choices"][0]["token_ids"] == ref
        assert _text(on) == _text(off)
        assert streamed["ids"] == ref
        assert streamed["text"] == _text(off)
        counters = {k: off["agentspec"][k] for k in ("steps", "drafted", "accepted", "speculate")}
        assert counters == {"steps": len(ref), "drafted": 0, "accepted": 0, "speculate": False}
        seconds = off["agentspec"]["seconds"]
        assert set(seconds) == {"prefill", "draft", "verify", "engine"}
        assert seconds["draft"] == 0.0 < seconds["verify"]
        assert seconds["prefill"] + seconds["verify"] <= seconds["engine"]
        assert on["agentspec"]["speculate"] is True
        # The spec-off run was learned into the stage: the next runs draft from it.
        assert on["agentspec"]["accepted"] > 0
        # Every kept token is a step's bonus token or an accepted draft token; a
        # last step cut short by the length limit keeps drafts but no bonus.
        assert len(ref) <= on["agentspec"]["steps"] + on["agentspec"]["accepted"] <= len(ref) + 1
        assert streamed["agentspec"]["steps"] < len(ref)


def test_greedy_completions_lossless_plain_and_streamed(client) -> None:
    for i, prompt in enumerate(TEXT_PROMPTS):
        stage = f"text-{i}"
        off = _complete(client, prompt, stage, speculate=False)
        on = _complete(client, prompt, stage, speculate=True)
        streamed = _stream(client, "completions", prompt, stage)
        ref = off["choices"][0]["token_ids"]
        assert on["choices"][0]["token_ids"] == ref
        assert _text(on) == _text(off)
        assert streamed["ids"] == ref
        assert streamed["text"] == _text(off)
        assert on["agentspec"]["steps"] < off["agentspec"]["steps"] == len(ref)


def test_tree_drafts_lossless(model_tok) -> None:
    opts = EngineOptions(tree_drafts=True, default_max_tokens=MAX_NEW)
    with (
        EngineServer.create(*model_tok, opts) as srv,
        openai.OpenAI(base_url=srv.base_url, api_key="x", timeout=120) as c,
    ):
        assert srv.engine.draft_params.tree
        for i, text in enumerate(CHAT_PROMPTS[:2]):
            off = _chat(c, text, f"tree-{i}", speculate=False)
            on = _chat(c, text, f"tree-{i}")
            assert on["choices"][0]["token_ids"] == off["choices"][0]["token_ids"]
            assert on["agentspec"]["accepted"] > 0
        srv.engine.close()


def test_repeated_prompt_takes_fewer_steps(client) -> None:
    # A pipeline of its own: no other stage's outputs to draft from on the first run.
    first = _chat(client, CHAT_PROMPTS[0], "repeat-stage", pipeline="repeat-pipe")
    second = _chat(client, CHAT_PROMPTS[0], "repeat-stage", pipeline="repeat-pipe")
    ids = first["choices"][0]["token_ids"]
    assert second["choices"][0]["token_ids"] == ids
    assert second["agentspec"]["steps"] < first["agentspec"]["steps"]
    assert len(ids) / second["agentspec"]["steps"] > len(ids) / first["agentspec"]["steps"]


def test_seeded_sampling_is_reproducible(client) -> None:
    def sample(speculate: bool) -> list[int]:
        r = client.completions.create(
            model="smollm2-135m",
            prompt="Once upon a time",
            max_tokens=8,
            temperature=0.8,
            top_p=0.95,
            seed=1234,
            extra_body=_xargs("sampling", speculate),
        )
        d = r.model_dump()
        assert d["agentspec"]["speculate"] is speculate
        return d["choices"][0]["token_ids"]  # type: ignore[no-any-return]

    assert sample(False) == sample(False)
    assert 1 <= len(sample(True)) <= 8
    assert sample(True) == sample(False)  # the seed's noise is keyed by position only


# --- request options -------------------------------------------------------------


def test_stop_strings_and_max_tokens(client) -> None:
    full = _chat(client, COUNT, "count", max_tokens=40)
    assert _text(full).startswith("1, 2, 3, 4, 5")
    stopped = _chat(client, COUNT, "count", stop=[", 5", "never"], max_tokens=40)
    assert _text(stopped) == "1, 2, 3, 4"
    assert stopped["choices"][0]["finish_reason"] == "stop"
    ids = stopped["choices"][0]["token_ids"]
    assert full["choices"][0]["token_ids"][: len(ids)] == ids  # through the stop's last token
    # The "count" stage learned `full`: the stopped run's drafts run past the stop
    # string, and only the accepted tokens it kept are counted.
    assert stopped["agentspec"]["accepted"] > 0
    assert stopped["agentspec"]["accepted"] <= len(ids)
    streamed = _stream(client, "chat", COUNT, "count", stop=", 5", max_tokens=40)
    assert streamed["text"] == "1, 2, 3, 4"
    assert streamed["finish"] == "stop"

    short = _chat(client, COUNT, "count", max_tokens=5)
    assert short["usage"]["completion_tokens"] == 5
    assert short["choices"][0]["finish_reason"] == "length"
    assert short["choices"][0]["token_ids"] == full["choices"][0]["token_ids"][:5]
    r = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": COUNT}],
        max_completion_tokens=3,
        temperature=0,
    )
    assert r.usage.completion_tokens == 3


def test_stream_shape_usage_and_token_ids(server, model_tok) -> None:
    tok = model_tok[1]
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": COUNT}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    status, raw = _raw(server, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    expected_prompt = tok.apply_chat_template(
        [{"role": "user", "content": COUNT}], add_generation_prompt=True
    )["input_ids"]
    assert chunks[0]["prompt_token_ids"] == list(expected_prompt)
    final, usage = chunks[-2], chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert set(final["agentspec"]) == {
        "steps",
        "drafted",
        "accepted",
        "speculate",
        "cached_tokens",
        "seconds",
    }
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 12
    assert usage["usage"]["prompt_tokens"] == len(expected_prompt)
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert len(ids) == 12
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_text_decoder_holds_back_partial_stops(model_tok) -> None:
    tok = model_tok[1]
    ids = tok("abc STOP def")["input_ids"]
    dec = TextDecoder(tok, ["STOP"])
    pieces = [dec.push(t) for t in ids]
    assert "".join(pieces) == "abc "
    assert dec.stopped
    dec2 = TextDecoder(tok, ["STOPPER"])
    assert "".join(dec2.push(t) for t in ids) + dec2.flush() == "abc STOP def"


# --- shards -------------------------------------------------------------------------


def test_agentspec_client_learns_the_engine_ids(server) -> None:
    with AgentSpecClient(
        base_url=server.base_url, api_key="unused", return_token_ids=True, timeout=120
    ) as c:
        r = c.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": CHAT_PROMPTS[2]}],
            max_tokens=10,
            temperature=0,
            stage="client-stage",
            pipeline="client-pipe",
        )
        assert c.flush(30)
        d = r.model_dump()
        key = ("default", "client-pipe", "client-stage")
        tree = c.store.tree(key)
        assert tree is not None
        (seq,) = tree.sequence_ids()
        learned = d["prompt_token_ids"][-8:] + d["choices"][0]["token_ids"]
        assert tree.sequence(seq) == learned
    assert key in server.engine.learned_shards()  # the tags reached the engine too


def test_pushed_shard_is_listed_and_drafted_from(server, client) -> None:
    ref = _chat(client, CHAT_PROMPTS[1], "push-reference", speculate=False)
    prompt = ref["prompt_token_ids"]
    out = ref["choices"][0]["token_ids"]
    key = ("default", "pushed-pipe", "pushed-stage")
    store = ShardStore()
    pusher = ShardPusher(store, [server.url])
    try:
        store.learn(key, prompt[-8:] + out)
        assert pusher.flush(30)
    finally:
        pusher.close()
        store.close()
    status, raw = _raw(server, "GET", "/v1/agentspec/shards")
    assert status == 200
    listed = {(s["tenant"], s["pipeline"], s["stage"]): s for s in json.loads(raw)["shards"]}
    assert listed[key]["sequences"] == 1
    assert listed[key]["tokens"] == len(out) + 8
    # No engine shard exists for this pipeline: the drafts come from the pushed one.
    assert not any(k[1] == "pushed-pipe" for k in server.engine.learned_shards())
    r = _chat(client, CHAT_PROMPTS[1], "pushed-stage", pipeline="pushed-pipe")
    assert r["choices"][0]["token_ids"] == out
    assert r["agentspec"]["accepted"] >= len(out) // 2


def test_a_push_answers_while_a_generation_runs(server, client) -> None:
    key = ("default", "busy-pipe", "busy-stage")
    store = ShardStore()
    pusher = ShardPusher(store, [server.url])
    try:
        store.learn(key, list(range(1000, 1040)))
        assert pusher.flush(30)  # the generation below drafts from this shard every step
        stream = client.completions.create(
            model="smollm2-135m",
            prompt=TEXT_PROMPTS[0],
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={
                "ignore_eos": True,
                "vllm_xargs": {"agentspec_pipeline": "busy-pipe", "agentspec_stage": "busy-stage"},
            },
        )
        chunks = iter(stream)
        while not next(chunks).model_dump()["choices"][0]["text"]:
            pass  # the generation is running
        for i in range(3):  # deltas into the shard being drafted from
            store.learn(key, [2000 + i, 2001 + i, 7])
            assert pusher.flush(30)
        # ... answered while it still runs: it yields more tokens after them
        assert next(chunks).model_dump()["choices"][0]["finish_reason"] is None
        stream.close()
    finally:
        pusher.close()
        store.close()
    (listed,) = [s for s in server.intake.shards() if s.key == key]
    assert listed.sequences == 4


# --- errors, auth, disconnects ------------------------------------------------------


def test_api_errors_are_4xx_and_the_server_keeps_serving(server, client) -> None:
    status, raw = _raw(server, "POST", "/v1/chat/completions", b"{not json")
    assert status == 400
    assert "not valid JSON" in json.loads(raw)["error"]["message"]
    status, raw = _raw(server, "POST", "/v1/chat/completions", b'{"model": "smollm2-135m"}')
    assert status == 400
    assert "'messages'" in json.loads(raw)["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="smollm2-135m", prompt=[1] * 9000, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], n=2
        )
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    with pytest.raises(openai.BadRequestError, match="native tool calling is not supported"):
        client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], tools=tools
        )
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    with pytest.raises(openai.BadRequestError, match="tool calls in messages"):
        client.chat.completions.create(
            model="smollm2-135m",
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ],
        )
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], temperature=-1
        )
    status, _ = _raw(server, "GET", "/v1/nothing-here")
    assert status == 404
    ok = client.completions.create(model="smollm2-135m", prompt="Hello", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_api_key_is_required_on_v1_routes(model_tok) -> None:
    with EngineServer.create(*model_tok, api_key="secret") as srv:
        assert _raw(srv, "GET", "/v1/models")[0] == 401
        assert _raw(srv, "GET", "/v1/models", Authorization="Bearer wrong")[0] == 401
        assert _raw(srv, "GET", "/v1/agentspec/shards")[0] == 401
        status, raw = _raw(srv, "GET", "/v1/models", Authorization="Bearer secret")
        assert status == 200
        assert json.loads(raw)["data"][0]["id"] == "smollm2-135m"
        assert _raw(srv, "GET", "/v1/agentspec/shards", Authorization="Bearer secret")[0] == 200
        with openai.OpenAI(base_url=srv.base_url, api_key="secret", timeout=120) as c:
            r = c.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=1)
            assert r.usage.completion_tokens == 1
        with (
            openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0) as c,
            pytest.raises(openai.AuthenticationError),
        ):
            c.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=1)
        srv.engine.close()


def test_disconnect_stops_generation_and_queue_is_served(server, client) -> None:
    body = {
        "model": "smollm2-135m",
        "prompt": "1, 2, 3, 4, 5, 6, 7, 8,",  # goes on counting until max_tokens
        "max_tokens": 500,
        "temperature": 0,
        "stream": True,
        "vllm_xargs": {"agentspec_stage": "abandoned", "agentspec_speculate": False},
    }
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    try:
        data = json.dumps(body).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        sock.sendall(head.encode() + data)
        got = b""
        while b"data: " not in got:  # wait for the first event: generation has started
            piece = sock.recv(4096)
            assert piece, "the server closed the stream early"
            got += piece
    finally:
        sock.close()
    results: list[int] = []

    def call() -> None:
        r = client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2)
        results.append(r.usage.completion_tokens)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [2, 2]
    # A cancelled request is never learned: had it run to the end, its stage would exist.
    assert ("default", None, "abandoned") not in server.engine.learned_shards()


def test_goodput_control_learns_the_step_cost_and_never_changes_outputs(server, client):
    """The engine feeds its controller every verification step; a controller that finds
    tokens dear drafts less, and greedy outputs still equal speculation off."""
    from agentspec._core.calibration import AcceptanceCalibrator
    from agentspec._core.goodput import StepCostModel

    ctl = server.engine.goodput
    assert ctl.enabled
    before = ctl.cost.samples
    _chat(client, COUNT, "goodput")
    assert ctl.cost.samples > before  # one observation per verification step
    saved = ctl.cost
    dear = StepCostModel(min_samples=3)
    for b_tokens in (1, 2, 4, 8, 16, 32):
        dear.observe(1, b_tokens, 0.001 + 10.0 * b_tokens)  # a verified token costs 10 s
    dear.observe = lambda *_: None  # type: ignore[method-assign]  # held fixed for the test

    class Doubtful(AcceptanceCalibrator):
        def correct(self, group, p, depth=0):  # every draft token: one chance in five
            return 0.2 * p

    saved_cal = ctl.calibrator
    try:
        ctl.cost = dear
        ctl.calibrator = Doubtful()
        offered, kept = ctl.offered, ctl.kept
        for _ in range(2):
            on = _chat(client, COUNT, "goodput")
        off = _chat(client, COUNT, "goodput", speculate=False)
        assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
        assert ctl.offered > offered
        assert ctl.kept - kept < ctl.offered - offered  # doubtful tokens were cut
    finally:
        ctl.cost = saved
        ctl.calibrator = saved_cal
