"""Trace recording for the client: calls grouped into sessions, written as trace records.

`request_messages` turns a call's prompt (chat messages, a completions
prompt, a Responses ``input``) into `agentspec.traces.Message`s;
`TraceSessions` appends each finished call to its session's conversation and
writes conversations with `agentspec.traces.TraceWriter`, so that the file can
be replayed (``agentspec bench replay``).  Used from the client recorder's
worker thread.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentspec._client.outputs import Api, join_texts, tool_calls_text
from agentspec._client.tags import Tags
from agentspec.traces import Message, TraceRecord, TraceWriter, read_traces

__all__ = ["TraceSessions", "request_messages"]


# --- request messages for traces ---------------------------------------------------------

_ROLE = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "user",
    "function": "user",
}


def _content_text(content: object) -> str:
    """Text of a message content: a str, or the text parts of a content-part list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""


def _message(role: object, content: str) -> Message | None:
    """A trace message, or None for an unknown role or an empty assistant message."""
    mapped = _ROLE.get(role) if isinstance(role, str) else None
    if mapped is None or (mapped == "assistant" and not content):
        return None
    return Message(mapped, content)


def request_messages(api: Api, request: Mapping[str, Any], choice: int = 0) -> list[Message]:
    """The prompt of a call as trace messages (system / user / assistant).

    Chat messages keep their text (content parts joined, tool calls as JSON,
    ``developer`` as system, ``tool`` results as user); a completions prompt
    is one user message; a Responses call gives its ``instructions`` as system
    and its ``input`` items as messages.
    """
    out: list[Message] = []
    if api == "chat":
        for m in request.get("messages") or ():
            if not isinstance(m, Mapping):
                continue
            text = join_texts(_content_text(m.get("content")), tool_calls_text(m.get("tool_calls")))
            chat_msg = _message(m.get("role"), text)
            if chat_msg is not None:
                out.append(chat_msg)
    elif api == "completions":
        prompt = request.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts):
            n = request.get("n") or 1
            k = choice // n if isinstance(n, int) and n > 0 else 0
            out.append(Message("user", prompts[min(k, len(prompts) - 1)]))
    else:
        instructions = request.get("instructions")
        if isinstance(instructions, str) and instructions:
            out.append(Message("system", instructions))
        items = request.get("input")
        if isinstance(items, str):
            out.append(Message("user", items))
        for item in items if isinstance(items, list) else ():
            if not isinstance(item, Mapping):
                continue
            kind = item.get("type")
            msg: Message | None = None
            if kind in (None, "message"):
                msg = _message(item.get("role"), _content_text(item.get("content")))
            elif kind == "function_call":
                msg = _message(
                    "assistant",
                    json.dumps(
                        {"name": item.get("name") or "", "arguments": item.get("arguments") or ""},
                        ensure_ascii=False,
                    ),
                )
            elif kind == "function_call_output":
                output = item.get("output")
                msg = _message("tool", output if isinstance(output, str) else "")
            if msg is not None:
                out.append(msg)
    return out


# --- trace sessions --------------------------------------------------------------------


@dataclass
class _Conversation:
    """A session's conversation being accumulated before it is written."""

    stage: str
    pipeline: str | None
    tenant: str
    model: object
    messages: list[Message] = field(default_factory=list)


class TraceSessions:
    """Calls grouped into conversations and written as `TraceRecord`s.

    A call whose prompt extends its session's conversation so far (earlier
    prompt + response) is appended to it; any other call starts a new
    conversation and the previous one is written.  Conversations are written
    when their session scope ends, at `flush_all`, when more than
    ``max_open`` are open (the oldest first), and for calls without a
    session at once.  A session written more than once gets ids
    ``<session>#2``, ``#3``...; ids already in an existing file are skipped
    too.  Only the first choice of a call is recorded.  Used from the
    recorder's worker thread only.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_open: int = 1024) -> None:
        """Open (append to) the trace file at ``path``."""
        p = Path(path)
        self._used: set[str] = set()
        if p.is_file() and p.stat().st_size > 0:
            self._used.update(rec.session for rec in read_traces(p))
        self._writer = TraceWriter(p)
        self._open: OrderedDict[str, _Conversation] = OrderedDict()
        self._max_open = max_open
        self.records = 0

    def add(
        self,
        tags: Tags,
        tenant: str,
        api: Api,
        request: Mapping[str, Any],
        model: object,
        response: str,
    ) -> None:
        """Record one finished call (its first choice's text ``response``, its ``model``)."""
        if not response:
            return
        prompt = request_messages(api, request)
        stage = tags.stage
        reply = Message("assistant", response, stage)
        if tags.session is None:
            conv = _Conversation(
                stage or "untagged", tags.pipeline, tenant, model, [*prompt, reply]
            )
            self._write(f"call-{uuid.uuid4().hex[:16]}", conv)
            return
        conv_or_none = self._open.get(tags.session)
        if conv_or_none is not None and _extends(conv_or_none.messages, prompt):
            conv_or_none.messages.extend(prompt[len(conv_or_none.messages) :])
            conv_or_none.messages.append(reply)
            self._open.move_to_end(tags.session)
            return
        if conv_or_none is not None:
            self._write(tags.session, self._open.pop(tags.session))
        self._open[tags.session] = _Conversation(
            stage or "untagged", tags.pipeline, tenant, model, [*prompt, reply]
        )
        while len(self._open) > self._max_open:
            sid, conv = self._open.popitem(last=False)
            self._write(sid, conv)

    def end(self, session_id: str) -> None:
        """Write the session's open conversation, if any."""
        conv = self._open.pop(session_id, None)
        if conv is not None:
            self._write(session_id, conv)

    def flush_all(self) -> None:
        """Write every open conversation."""
        while self._open:
            sid, conv = self._open.popitem(last=False)
            self._write(sid, conv)

    def close(self) -> None:
        """Write what is open and close the file."""
        try:
            self.flush_all()
        finally:
            self._writer.close()

    def _write(self, session_id: str, conv: _Conversation) -> None:
        rid, k = session_id, 1
        while rid in self._used:
            k += 1
            rid = f"{session_id}#{k}"
        self._used.add(rid)
        msgs = tuple(
            Message(m.role, m.content, None if m.stage == conv.stage else m.stage)
            if m.role == "assistant"
            else m
            for m in conv.messages
        )
        meta: dict[str, Any] = {"session_id": session_id, "tenant": conv.tenant}
        if conv.pipeline is not None:
            meta["pipeline"] = conv.pipeline
        if isinstance(conv.model, str):
            meta["model"] = conv.model
        self._writer.write(
            TraceRecord(conv.pipeline or "agentspec-client", rid, conv.stage, msgs, meta)
        )
        self.records += 1


def _extends(conversation: list[Message], prompt: list[Message]) -> bool:
    """True if ``prompt`` starts with ``conversation`` (stages of replies ignored)."""
    if len(prompt) < len(conversation):
        return False
    return all(
        a.role == b.role and a.content == b.content
        for a, b in zip(conversation, prompt[: len(conversation)], strict=True)
    )
