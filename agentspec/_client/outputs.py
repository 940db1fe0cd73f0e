"""What a finished call produced: its outputs' token ids or text, and the tokenizer fallback.

`extract_outputs` pulls each choice's output out of a chat, completions or
responses result (a response model, a raw response, or the list of stream
chunks / events): the token ids when the server returned them (vLLM
``return_token_ids``: ``choices[i].token_ids``, summed over stream chunks),
else the text (tool calls as JSON).  `text_encoder` builds the ``text ->
token ids`` encoder used when a server returns no ids.  Used by the learning
worker (`agentspec._client.learn`) and the trace recorder
(`agentspec._client.trace`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from agentspec._util.log import get_logger
from agentspec.exceptions import InvalidArgumentError

__all__ = [
    "Api",
    "Encoder",
    "Output",
    "as_json",
    "extract_outputs",
    "extract_prompt_ids",
    "join_texts",
    "load_tokenizer",
    "text_encoder",
    "tool_calls_text",
]

#: The wrapped model-call APIs.
Api = Literal["chat", "completions", "responses"]

#: ``text -> token ids``, the tokenizer fallback.
Encoder = Callable[[str], Sequence[int]]

_log = get_logger()


# --- the tokenizer fallback -----------------------------------------------------------


def text_encoder(spec: object) -> Encoder | None:
    """Turn the client's ``tokenizer=`` argument into ``text -> ids``.

    Accepted: None (no fallback); a path to a ``tokenizer.json`` or to a
    directory holding one; a ``tokenizers.Tokenizer``; any callable taking a
    str and returning a sequence of ints.  A missing or unreadable file raises
    `InvalidArgumentError` at once.  Text is encoded without added special
    tokens, as the model produced it.
    """
    if spec is None:
        return None
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise InvalidArgumentError(f"tokenizer file not found: {path}")
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise InvalidArgumentError(
                f"tokenizer={str(spec)!r} needs the tokenizers package ({exc})"
            ) from exc
        try:
            spec = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise InvalidArgumentError(f"{path}: cannot load tokenizer ({exc})") from exc
    if type(spec).__name__ == "Tokenizer" and callable(getattr(spec, "encode", None)):
        tok: Any = spec

        def encode_text(text: str) -> Sequence[int]:
            ids: Sequence[int] = tok.encode(text, add_special_tokens=False).ids
            return ids

        return encode_text
    if callable(spec):
        return cast(Encoder, spec)
    raise InvalidArgumentError(
        "tokenizer must be None, a path to tokenizer.json, a tokenizers.Tokenizer or a "
        f"callable str -> list[int], got {type(spec).__name__}"
    )


#: The former name of `text_encoder` (it returns an encoder, not a tokenizer:
#: `agentspec.bench.replay.load_tokenizer` is the one that loads a tokenizer).
load_tokenizer = text_encoder


# --- pulling outputs out of responses ---------------------------------------------------


@dataclass(frozen=True)
class Output:
    """One choice of a finished response: its token ids (when returned) and text."""

    index: int
    token_ids: list[int] | None
    text: str


def as_json(obj: Any) -> Any:
    """A response object (openai model, raw response, dict) as plain JSON data."""
    if isinstance(obj, Mapping):
        return obj
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    http = getattr(obj, "http_response", None)
    if http is not None:  # a LegacyAPIResponse of a non-streamed call
        return json.loads(http.content)
    raise TypeError(f"cannot read a response of type {type(obj).__name__}")


def _token_list(value: object) -> list[int] | None:
    """``value`` as a list of ints, or None if it is not one."""
    if isinstance(value, list) and all(type(v) is int for v in value):
        return value
    return None


def tool_calls_text(calls: object) -> str:
    """Tool calls of a message as JSON text (name + arguments of each)."""
    if not isinstance(calls, list) or not calls:
        return ""
    parts = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping):
            parts.append(
                json.dumps(
                    {"name": fn.get("name") or "", "arguments": fn.get("arguments") or ""},
                    ensure_ascii=False,
                )
            )
    return "\n".join(parts)


def join_texts(*texts: str) -> str:
    """The non-empty ``texts`` joined by newlines."""
    return "\n".join(t for t in texts if t)


def _chat_outputs(resp: Mapping[str, Any]) -> list[Output]:
    out = []
    for i, ch in enumerate(resp.get("choices") or ()):
        msg = ch.get("message") or {}
        content = msg.get("content")
        text = join_texts(
            content if isinstance(content, str) else "", tool_calls_text(msg.get("tool_calls"))
        )
        out.append(Output(ch.get("index", i), _token_list(ch.get("token_ids")), text))
    return out


def _completion_outputs(resp: Mapping[str, Any]) -> list[Output]:
    out = []
    for i, ch in enumerate(resp.get("choices") or ()):
        text = ch.get("text")
        out.append(
            Output(
                ch.get("index", i),
                _token_list(ch.get("token_ids")),
                text if isinstance(text, str) else "",
            )
        )
    return out


def _response_text(resp: Mapping[str, Any]) -> str:
    """The output text of a Responses API response (messages and function calls)."""
    parts: list[str] = []
    for item in resp.get("output") or ():
        kind = item.get("type")
        if kind == "message":
            for c in item.get("content") or ():
                if c.get("type") == "output_text" and isinstance(c.get("text"), str):
                    parts.append(c["text"])
        elif kind == "function_call":
            parts.append(
                json.dumps(
                    {"name": item.get("name") or "", "arguments": item.get("arguments") or ""},
                    ensure_ascii=False,
                )
            )
    return join_texts(*parts)


def _stream_outputs(api: Api, chunks: Sequence[Any]) -> list[Output]:
    """Assemble per-choice outputs from the chunks of a chat / completions stream."""
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    has_ids: set[int] = set()
    calls: dict[int, dict[int, list[str]]] = {}
    for raw in chunks:
        chunk = as_json(raw)
        for ch in chunk.get("choices") or ():
            idx = ch.get("index", 0)
            buf = texts.setdefault(idx, [])
            tok = _token_list(ch.get("token_ids"))
            if tok is not None:
                has_ids.add(idx)
                ids.setdefault(idx, []).extend(tok)
            if api == "completions":
                if isinstance(ch.get("text"), str):
                    buf.append(ch["text"])
                continue
            delta = ch.get("delta") or {}
            if isinstance(delta.get("content"), str):
                buf.append(delta["content"])
            for tc in delta.get("tool_calls") or ():
                fn = tc.get("function") or {}
                acc = calls.setdefault(idx, {}).setdefault(tc.get("index", 0), ["", ""])
                acc[0] += fn.get("name") or ""
                acc[1] += fn.get("arguments") or ""
    out = []
    for idx in sorted(texts):
        tool_text = "\n".join(
            json.dumps({"name": n, "arguments": a}, ensure_ascii=False)
            for _, (n, a) in sorted(calls.get(idx, {}).items())
        )
        out.append(
            Output(
                idx,
                ids.get(idx, []) if idx in has_ids else None,
                join_texts("".join(texts[idx]), tool_text),
            )
        )
    return out


def extract_prompt_ids(result: Any, streamed: bool) -> list[int] | None:
    """The prompt's token ids when the server returned them (vLLM ``return_token_ids``).

    vLLM puts ``prompt_token_ids`` at the top of a chat completion (first
    chunk of a stream) and in each choice of a text completion.
    """
    for raw in result if streamed else (result,):
        try:
            obj = as_json(raw)
        except TypeError:
            return None
        ids = _token_list(obj.get("prompt_token_ids"))
        if ids is None:
            choices = obj.get("choices") or ()
            ids = _token_list(choices[0].get("prompt_token_ids")) if choices else None
        if ids is not None:
            return ids
    return None


def extract_outputs(api: Api, result: Any, streamed: bool) -> list[Output]:
    """The per-choice outputs of a finished call (``result``: response or chunk list)."""
    if streamed:
        if api == "responses":
            for raw in reversed(result):
                event = as_json(raw)
                if event.get("type") == "response.completed":
                    return [Output(0, None, _response_text(event.get("response") or {}))]
            return []
        return _stream_outputs(api, result)
    resp = as_json(result)
    if api == "chat":
        return _chat_outputs(resp)
    if api == "completions":
        return _completion_outputs(resp)
    return [Output(0, None, _response_text(resp))]
