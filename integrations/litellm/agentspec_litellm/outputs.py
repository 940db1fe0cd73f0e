"""Pulling the generated tokens (or text) out of LiteLLM responses and stream chunks.

LiteLLM keeps vLLM's ``return_token_ids`` fields, in its own places: a
non-streamed chat answer has ``choices[i].provider_specific_fields.token_ids``
and a top-level ``prompt_token_ids``; a stream chunk has
``choices[i].token_ids`` (and the first chunk ``prompt_token_ids``).  Text
(content plus tool calls as JSON) is kept for the tokenizer fallback.

`StreamAccumulator` collects a stream chunk by chunk; `response_outputs`
reads a whole answer.  Both accept LiteLLM model objects or plain dicts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentspec.integration import join_texts, tool_calls_text

__all__ = ["Outputs", "StreamAccumulator", "as_dict", "response_outputs", "strip_token_ids"]


@dataclass(frozen=True)
class Outputs:
    """One finished answer: per choice, its token ids (None: not returned) and text."""

    prompt_ids: list[int] | None
    token_ids: list[list[int] | None]
    texts: list[str]


def as_dict(obj: Any) -> Mapping[str, Any]:
    """A LiteLLM response / chunk (pydantic-like) or a dict as a plain mapping."""
    if isinstance(obj, Mapping):
        return obj
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        out = dump()
        if isinstance(out, Mapping):
            return out
    raise TypeError(f"cannot read a response of type {type(obj).__name__}")


def _ids(value: object) -> list[int] | None:
    if isinstance(value, list) and all(type(v) is int for v in value):
        return value
    return None


def _ids_field(obj: Mapping[str, Any], name: str) -> list[int] | None:
    """``obj[name]``, or LiteLLM's ``obj.provider_specific_fields[name]``, if a list of ints."""
    ids = _ids(obj.get(name))
    if ids is None:
        extra = obj.get("provider_specific_fields")
        if isinstance(extra, Mapping):
            ids = _ids(extra.get(name))
    return ids


def _choice_ids(choice: Mapping[str, Any]) -> list[int] | None:
    return _ids_field(choice, "token_ids")


def response_outputs(response: Any) -> Outputs:
    """The outputs of a non-streamed chat or text completion."""
    resp = as_dict(response)
    ids: list[list[int] | None] = []
    texts: list[str] = []
    for ch in sorted(resp.get("choices") or (), key=lambda c: c.get("index") or 0):
        ids.append(_choice_ids(ch))
        msg = ch.get("message")
        if isinstance(msg, Mapping):
            content = msg.get("content")
            texts.append(
                join_texts(
                    content if isinstance(content, str) else "",
                    tool_calls_text(msg.get("tool_calls")),
                )
            )
        else:
            text = ch.get("text")
            texts.append(text if isinstance(text, str) else "")
    return Outputs(_prompt_ids(resp), ids, texts)


def _prompt_ids(obj: Mapping[str, Any]) -> list[int] | None:
    return _ids_field(obj, "prompt_token_ids")


class StreamAccumulator:
    """Collects the chunks of one streamed answer; `outputs` once it `finished`.

    Args:
        choices: how many choices the request asked for (its ``n``); the
            answer is finished once each of them -- and every other choice
            index seen -- reported a finish reason.
    """

    def __init__(self, choices: int = 1) -> None:
        """An empty accumulator."""
        self.prompt_ids: list[int] | None = None
        self._choices = max(1, choices)
        self._ids: dict[int, list[int]] = {}
        self._missing_ids: set[int] = set()
        self._texts: dict[int, list[str]] = {}
        self._calls: dict[int, dict[int, list[str]]] = {}
        self._done: set[int] = set()

    @property
    def finished(self) -> bool:
        """Whether every choice reported its finish reason (the answer is complete)."""
        expected = set(range(self._choices)) | self._texts.keys()
        return expected <= self._done

    def add(self, chunk: Any) -> None:
        """Take one chunk into account."""
        obj = as_dict(chunk)
        if self.prompt_ids is None:
            self.prompt_ids = _prompt_ids(obj)
        for ch in obj.get("choices") or ():
            idx = ch.get("index") or 0
            buf = self._texts.setdefault(idx, [])
            ids = _choice_ids(ch)
            if ids is not None:
                self._ids.setdefault(idx, []).extend(ids)
            elif _has_output(ch):
                self._missing_ids.add(idx)  # a chunk with output but no ids
            if ch.get("finish_reason"):
                self._done.add(idx)
            delta = ch.get("delta")
            if isinstance(delta, Mapping):
                if isinstance(delta.get("content"), str):
                    buf.append(delta["content"])
                for tc in delta.get("tool_calls") or ():
                    tc = as_dict(tc)
                    fn = tc.get("function") or {}
                    fn = as_dict(fn)
                    acc = self._calls.setdefault(idx, {}).setdefault(tc.get("index") or 0, ["", ""])
                    acc[0] += fn.get("name") or ""
                    acc[1] += fn.get("arguments") or ""
            elif isinstance(ch.get("text"), str):
                buf.append(ch["text"])

    def outputs(self) -> Outputs:
        """What was collected, one entry per choice index."""
        ids: list[list[int] | None] = []
        texts: list[str] = []
        for idx in sorted(self._texts):
            got = self._ids.get(idx)
            ids.append(got if got and idx not in self._missing_ids else None)
            calls = "\n".join(
                json.dumps({"name": n, "arguments": a}, ensure_ascii=False)
                for _, (n, a) in sorted(self._calls.get(idx, {}).items())
            )
            texts.append(join_texts("".join(self._texts[idx]), calls))
        return Outputs(self.prompt_ids, ids, texts)


def _has_output(choice: Mapping[str, Any]) -> bool:
    """Whether a stream chunk's choice carries generated text or tool calls."""
    delta = choice.get("delta")
    if isinstance(delta, Mapping) and (delta.get("content") or delta.get("tool_calls")):
        return True
    return bool(choice.get("text"))


def strip_token_ids(response: Any) -> None:
    """Remove the token-id fields from a non-streamed answer, in place."""
    for ch in getattr(response, "choices", None) or ():
        extra = getattr(ch, "provider_specific_fields", None)
        if isinstance(extra, dict):
            extra.pop("token_ids", None)
            if not extra:
                ch.provider_specific_fields = None
        if hasattr(ch, "token_ids"):
            ch.token_ids = None
    if getattr(response, "prompt_token_ids", None) is not None:
        response.prompt_token_ids = None
