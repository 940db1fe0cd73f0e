"""A small OpenAI-compatible HTTP server for tests and benchmarks (stdlib only).

`OpenAIServer` serves ``POST /v1/chat/completions``, ``/v1/completions`` and
``/v1/responses`` on 127.0.0.1 (a random port), streamed (SSE) or not, and
records every request (path, headers, JSON body) in `requests`.

By default replies are deterministic: the reply text of a call is `reply_text`
of the prompt (its last user text) and the choice index, and its "token ids"
are the text's code points (`token_ids`).  Like vLLM, a chat / completions
request with ``"return_token_ids": true`` gets ``token_ids`` in every choice
(streamed: each chunk's ids) and ``prompt_token_ids``.

A test that needs other answers passes a reply hook,
``OpenAIServer(reply=fn)``: ``fn(request)`` gets the `RecordedRequest` (already
recorded) on the handler thread, so it may block, e.g. on a barrier, and
returns a `Reply` (status, text, finish reason, token ids, usage, extra
top-level fields such as the engine's ``agentspec`` counters) or None for the
default reply.  One server serves every test's scripted answers: the answer is
built into the wire format by the same code either way.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["OpenAIServer", "RecordedRequest", "Reply", "ReplyHook", "reply_text", "token_ids"]

_PIECE = 4  # characters per streamed chunk
_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def reply_text(prompt: str, choice: int = 0) -> str:
    """The reply the server gives to ``prompt`` for choice ``choice``."""
    return f"answer to [{prompt}] choice {choice}: SELECT name FROM users WHERE id = {choice};"


def token_ids(text: str) -> list[int]:
    """The server's "token ids" of ``text``: its code points."""
    return [ord(c) for c in text]


@dataclass(frozen=True)
class RecordedRequest:
    """One request the server received; header names are lower case."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass(frozen=True)
class Reply:
    """A hook's answer to one request.

    A status other than 200 answers ``{"error": {"message": text, ...}}``
    (never streamed).  Otherwise every choice the request asks for (``n``)
    gets ``text`` and ``finish_reason``; ``token_ids`` defaults to the text's
    code points and ``prompt_token_ids`` to the prompt's (both sent only when
    the request asks for token ids); ``usage`` defaults to their lengths; the
    ``extra`` fields are added to the top level of the response (streamed:
    of the final chunk, the one with the last finish reason, as the engine does).
    """

    text: str = ""
    status: int = 200
    finish_reason: str = "stop"
    token_ids: Sequence[int] | None = None
    prompt_token_ids: Sequence[int] | None = None
    usage: Mapping[str, int] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Refuse a status no HTTP client would read."""
        if not 200 <= self.status <= 599:
            raise ValueError(f"Reply status must be 200..599, got {self.status}")


ReplyHook = Callable[[RecordedRequest], "Reply | None"]


@dataclass(frozen=True)
class _Choice:
    text: str
    finish_reason: str
    ids: list[int]


@dataclass(frozen=True)
class _Answer:
    """What to send, whatever the wire format: the choices and the top-level extras."""

    choices: list[_Choice]
    prompt_ids: list[int]
    usage: dict[str, int]
    extra: dict[str, Any]


def _default_answer(prompt: str, n: int) -> _Answer:
    choices = [_Choice(t, "stop", token_ids(t)) for t in (reply_text(prompt, i) for i in range(n))]
    usage = {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": 1}
    return _Answer(choices, token_ids(prompt), usage, {})


def _hook_answer(reply: Reply, prompt: str, n: int) -> _Answer:
    ids = list(token_ids(reply.text) if reply.token_ids is None else reply.token_ids)
    prompt_ids = list(
        token_ids(prompt) if reply.prompt_token_ids is None else reply.prompt_token_ids
    )
    usage = (
        dict(reply.usage)
        if reply.usage is not None
        else {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt_ids) + len(ids),
        }
    )
    choices = [_Choice(reply.text, reply.finish_reason, ids) for _ in range(n)]
    return _Answer(choices, prompt_ids, usage, dict(reply.extra))


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _prompt_of(path: str, body: dict[str, Any]) -> str:
    """The last user text of a request (the whole prompt for completions)."""
    if path.endswith("/chat/completions"):
        users = [m for m in body.get("messages", []) if m.get("role") == "user"]
        return _text_of(users[-1].get("content")) if users else ""
    if path.endswith("/completions"):
        prompt = body.get("prompt", "")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    items = body.get("input", "")
    if isinstance(items, str):
        return items
    users = [i for i in items if isinstance(i, dict) and i.get("role") == "user"]
    return _text_of(users[-1].get("content")) if users else ""


def _pieces(text: str) -> list[str]:
    return [text[i : i + _PIECE] for i in range(0, len(text), _PIECE)]


def _piece_ids(ids: list[int], pieces: int) -> list[list[int]]:
    """``ids`` split over ``pieces`` chunks, ``_PIECE`` a chunk, the rest on the last one.

    For code-point ids each chunk gets exactly its text's ids; other ids still
    concatenate back to ``ids``.
    """
    if pieces == 0:
        return []
    out = [ids[k * _PIECE : (k + 1) * _PIECE] for k in range(pieces - 1)]
    out.append(ids[(pieces - 1) * _PIECE :])
    return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # no 40 ms delayed-ACK stalls between header and body
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the per-request log lines."""

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            body = None
        owner = self.server.owner
        request = RecordedRequest(
            "POST", self.path, {k.lower(): v for k, v in self.headers.items()}, body
        )
        owner._record(request)
        path = self.path.split("?", 1)[0]
        if not isinstance(body, dict):
            self._json(400, {"error": {"message": "body must be a JSON object", "type": "bad"}})
            return
        if path not in _ROUTES:
            self._json(404, {"error": {"message": f"no route {path}", "type": "not_found"}})
            return
        prompt = _prompt_of(path, body)
        n = 1 if path == "/v1/responses" else body.get("n") or 1
        reply = owner._reply(request) if owner._reply is not None else None
        if reply is not None and reply.status != 200:
            kind = "server_error" if reply.status >= 500 else "invalid_request_error"
            self._json(reply.status, {"error": {"message": reply.text, "type": kind}})
            return
        answer = _default_answer(prompt, n) if reply is None else _hook_answer(reply, prompt, n)
        if path == "/v1/responses":
            if body.get("stream"):
                self._responses_stream(body, answer)
            else:
                self._json(200, _response_obj(body, answer.choices[0].text, answer.extra))
            return
        chat = path == "/v1/chat/completions"
        ids = bool(body.get("return_token_ids"))
        if body.get("stream"):
            self._chat_stream(body, answer, ids, chat)
            return
        choices = []
        for i, c in enumerate(answer.choices):
            if chat:
                ch: dict[str, Any] = {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason,
                    "logprobs": None,
                }
            else:
                ch = {
                    "index": i,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": None,
                }
            if ids:
                ch["token_ids"] = c.ids
            choices.append(ch)
        obj: dict[str, Any] = {
            "id": "cmpl-test",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", "test"),
            "choices": choices,
            "usage": answer.usage,
        }
        if ids:
            obj["prompt_token_ids"] = answer.prompt_ids
        self._json(200, {**obj, **answer.extra})

    # -- answers

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _sse_start(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _sse(self, obj: Any, event: str | None = None) -> None:
        head = f"event: {event}\n" if event else ""
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.wfile.write(f"{head}data: {data}\n\n".encode())
        self.wfile.flush()

    def _chat_stream(self, body: dict[str, Any], answer: _Answer, ids: bool, chat: bool) -> None:
        self._sse_start()
        base = {
            "id": "cmpl-test",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", "test"),
        }
        for i, c in enumerate(answer.choices):
            pieces = _pieces(c.text)
            for k, (piece, piece_ids) in enumerate(
                zip(pieces, _piece_ids(c.ids, len(pieces)), strict=True)
            ):
                if chat:
                    delta: dict[str, Any] = {"content": piece}
                    if k == 0:
                        delta["role"] = "assistant"
                    ch: dict[str, Any] = {"index": i, "delta": delta, "finish_reason": None}
                else:
                    ch = {"index": i, "text": piece, "finish_reason": None}
                if ids:
                    ch["token_ids"] = piece_ids
                chunk = {**base, "choices": [ch]}
                if ids and k == 0 and i == 0:
                    chunk["prompt_token_ids"] = answer.prompt_ids
                self._sse(chunk)
            end: dict[str, Any] = (
                {"index": i, "delta": {}, "finish_reason": c.finish_reason}
                if chat
                else {"index": i, "text": "", "finish_reason": c.finish_reason}
            )
            if ids and not pieces and c.ids:  # no text chunk carried them
                end["token_ids"] = c.ids
            last = answer.extra if i == len(answer.choices) - 1 else {}
            self._sse({**base, "choices": [end], **last})  # extras: on the final chunk
        if (body.get("stream_options") or {}).get("include_usage"):
            self._sse({**base, "choices": [], "usage": answer.usage})
        self._sse("[DONE]")

    def _responses_stream(self, body: dict[str, Any], answer: _Answer) -> None:
        self._sse_start()
        text = answer.choices[0].text
        partial = _response_obj(body, "", {})
        partial["status"] = "in_progress"
        partial["output"] = []
        events: list[dict[str, Any]] = [{"type": "response.created", "response": partial}]
        for piece in _pieces(text):
            events.append(
                {
                    "type": "response.output_text.delta",
                    "item_id": "msg-test",
                    "output_index": 0,
                    "content_index": 0,
                    "delta": piece,
                    "logprobs": [],
                }
            )
        done = _response_obj(body, text, answer.extra)
        events.append({"type": "response.completed", "response": done})
        for seq, ev in enumerate(events):
            ev["sequence_number"] = seq
            self._sse(ev, event=ev["type"])


def _response_obj(body: dict[str, Any], text: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A Responses API response object with one output message (and ``extra`` fields)."""
    return {
        "id": "resp-test",
        "object": "response",
        "created_at": int(time.time()),
        "model": body.get("model", "test"),
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": "msg-test",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "temperature": 1.0,
        "top_p": 1.0,
        **extra,
    }


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: OpenAIServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that closed its stream early is no error; anything else is printed."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class OpenAIServer:
    """The test server; ``with OpenAIServer() as srv: OpenAI(base_url=srv.base_url, ...)``."""

    def __init__(self, *, reply: ReplyHook | None = None) -> None:
        """Bind to a random port on 127.0.0.1 (serving starts with `start`).

        ``reply``, when given, is asked for every well-formed request's answer
        (see `Reply`); it returns None for the default deterministic reply.
        """
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self._reply = reply
        self._lock = threading.Lock()
        self._requests: list[RecordedRequest] = []
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1``."""
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    @property
    def requests(self) -> list[RecordedRequest]:
        """The requests received so far, in arrival order (a copy)."""
        with self._lock:
            return list(self._requests)

    def clear(self) -> None:
        """Forget the recorded requests."""
        with self._lock:
            self._requests.clear()

    def _record(self, req: RecordedRequest) -> None:
        with self._lock:
            self._requests.append(req)

    def start(self) -> OpenAIServer:
        """Serve on a daemon thread."""
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(10)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> OpenAIServer:
        """Start and return the server."""
        return self.start()

    def __exit__(self, *exc: object) -> None:
        """Stop the server."""
        self.stop()
