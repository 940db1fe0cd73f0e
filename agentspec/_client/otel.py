"""OpenTelemetry spans of the client's model calls (optional extra ``otel``).

With ``opentelemetry-api`` importable, every ``chat.completions`` /
``completions`` / ``responses`` call of `AgentSpecClient` and
`AsyncAgentSpecClient` gets one CLIENT span from the tracer provider the
application configured (none configured: the API's no-op spans, nothing
recorded).  The span follows the OpenTelemetry GenAI semantic conventions:

- name ``"{gen_ai.operation.name} {gen_ai.request.model}"`` (``chat gpt-4o``);
- ``gen_ai.operation.name`` (``chat``; ``text_completion`` for ``completions``),
  ``gen_ai.provider.name`` and ``gen_ai.system`` (``openai``),
  ``gen_ai.request.model``, ``gen_ai.response.model``, ``gen_ai.response.id``,
  ``gen_ai.response.finish_reasons``, ``gen_ai.usage.input_tokens``,
  ``gen_ai.usage.output_tokens``, ``gen_ai.conversation.id`` (the session),
  ``server.address`` / ``server.port``;
- on failure: the exception recorded as an event, status ERROR, ``error.type``;

plus agentspec's ``agentspec.tenant``, ``agentspec.session``,
``agentspec.pipeline``, ``agentspec.stage`` (tags that are set) and
``agentspec.accepted_tokens`` (the draft tokens the server accepted, where the
response carries agentspec's counters, as the embedded engine's do).

A streamed call's span ends when its stream ends (read to its end, closed,
failed or dropped).  Without OpenTelemetry the import fails once, here, and
each call costs one ``is None`` check.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agentspec._client.outputs import Api
from agentspec._client.tags import Tags

if TYPE_CHECKING:
    from opentelemetry.trace import Span

try:
    from opentelemetry import trace as _trace
    from opentelemetry.trace import SpanKind, StatusCode
except ImportError:  # the optional dependency is absent: no spans
    _trace = None  # type: ignore[assignment]

__all__ = [
    "ENABLED",
    "CallSpan",
    "end_error",
    "end_result",
    "end_stream",
    "end_when_dropped",
    "start_span",
    "use",
]

#: Whether ``opentelemetry-api`` is importable (checked once, at import).
ENABLED = _trace is not None

_PROVIDER = "openai"
_OPERATION: dict[Api, str] = {"chat": "chat", "completions": "text_completion", "responses": "chat"}
_TRACER: Any = None if _trace is None else _trace.get_tracer("agentspec.client")


class CallSpan:
    """A call's span and whether it has been ended (a stream may end it from two places)."""

    __slots__ = ("__weakref__", "ended", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.ended = False

    def end(self) -> None:
        """End the span once."""
        if not self.ended:
            self.ended = True
            self.span.end()


def start_span(
    api: Api, model: object, tags: Tags, tenant: str, server: tuple[str | None, int | None]
) -> CallSpan | None:
    """A started span for one call, or None without OpenTelemetry or a recording provider."""
    if _TRACER is None:
        return None
    operation = _OPERATION[api]
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": _PROVIDER,
        "gen_ai.system": _PROVIDER,
        "agentspec.tenant": tenant,
    }
    name = operation
    if isinstance(model, str):
        attrs["gen_ai.request.model"] = model
        name = f"{operation} {model}"
    if tags.session is not None:
        attrs["agentspec.session"] = tags.session
        attrs["gen_ai.conversation.id"] = tags.session
    if tags.pipeline is not None:
        attrs["agentspec.pipeline"] = tags.pipeline
    if tags.stage is not None:
        attrs["agentspec.stage"] = tags.stage
    host, port = server
    if host:
        attrs["server.address"] = host
        if port is not None:
            attrs["server.port"] = port
    span = _TRACER.start_span(name, kind=SpanKind.CLIENT, attributes=attrs)
    if not span.is_recording():
        return None
    return CallSpan(span)


def use(span: CallSpan) -> Any:
    """A context manager making ``span`` the current span (for spans of the HTTP layer)."""
    assert _trace is not None
    return _trace.use_span(span.span, end_on_exit=False)


def end_error(span: CallSpan, exc: BaseException) -> None:
    """Record ``exc`` on the span, mark it failed and end it."""
    if span.ended:
        return
    s = span.span
    s.record_exception(exc)
    s.set_attribute("error.type", type(exc).__qualname__)
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        s.set_attribute("http.response.status_code", status)
    s.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200])
    span.end()


def _get(obj: object, name: str) -> Any:
    """Field ``name`` of a mapping or a (pydantic) response object; None when absent."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _usage(api: Api, usage: object) -> tuple[int | None, int | None]:
    """(input tokens, output tokens) of a response's ``usage``."""
    if usage is None:
        return None, None
    if api == "responses":
        return _int(_get(usage, "input_tokens")), _int(_get(usage, "output_tokens"))
    return _int(_get(usage, "prompt_tokens")), _int(_get(usage, "completion_tokens"))


def _int(value: object) -> int | None:
    return value if type(value) is int else None


def _accepted(counters: object) -> int | None:
    """The accepted draft tokens of a response's ``agentspec`` counters, when present."""
    return _int(_get(counters, "accepted"))


def _set_response(
    span: Any,
    model: object,
    rid: object,
    reasons: Sequence[str],
    tokens: tuple[int | None, int | None],
    accepted: int | None,
) -> None:
    if isinstance(model, str):
        span.set_attribute("gen_ai.response.model", model)
    if isinstance(rid, str):
        span.set_attribute("gen_ai.response.id", rid)
    if reasons:
        span.set_attribute("gen_ai.response.finish_reasons", list(reasons))
    if tokens[0] is not None:
        span.set_attribute("gen_ai.usage.input_tokens", tokens[0])
    if tokens[1] is not None:
        span.set_attribute("gen_ai.usage.output_tokens", tokens[1])
    if accepted is not None:
        span.set_attribute("agentspec.accepted_tokens", accepted)


def _reasons(choices: object) -> list[str]:
    out: list[str] = []
    for ch in choices if isinstance(choices, list) else ():
        reason = _get(ch, "finish_reason")
        if isinstance(reason, str):
            out.append(reason)
    return out


def end_result(span: CallSpan, api: Api, result: Any, raw: bool) -> None:
    """Set the response attributes of a non-streamed call and end the span."""
    if span.ended:
        return
    if raw:
        result = result.parse()  # cached by openai: the caller's parse() gets this object
    if api == "responses":
        reasons: list[str] = []
        status = _get(result, "status")
        if isinstance(status, str):
            reasons.append(status)
    else:
        reasons = _reasons(_get(result, "choices"))
    _set_response(
        span.span,
        _get(result, "model"),
        _get(result, "id"),
        reasons,
        _usage(api, _get(result, "usage")),
        _accepted(_get(result, "agentspec")),
    )
    span.end()


def end_stream(span: CallSpan, api: Api, items: list[Any], error: BaseException | None) -> None:
    """End a streamed call's span from the items read (all, or up to ``error`` or a close)."""
    if span.ended:
        return
    if api == "responses":
        for event in reversed(items):
            if _get(event, "type") in ("response.completed", "response.incomplete"):
                end_result(span, api, _get(event, "response"), False)
                return
        model = rid = usage = counters = None
        reasons: list[str] = []
    else:
        model = rid = usage = counters = None
        reasons = []
        for chunk in items:
            model = model or _get(chunk, "model")
            rid = rid or _get(chunk, "id")
            usage = _get(chunk, "usage") or usage
            counters = _get(chunk, "agentspec") or counters
            reasons.extend(_reasons(_get(chunk, "choices")))
    _set_response(span.span, model, rid, reasons, _usage(api, usage), _accepted(counters))
    if error is not None:
        end_error(span, error)
    else:
        span.end()


def end_when_dropped(stream: object, span: CallSpan) -> None:
    """End ``span`` when ``stream`` is garbage collected before it was read at all."""
    weakref.finalize(stream, CallSpan.end, span)
