"""ASGI middleware copying ``X-AgentSpec-*`` request headers into ``vllm_xargs``.

Some agent frameworks can add HTTP headers to their OpenAI calls
(``default_headers``) but cannot change the JSON body.  vLLM only hands the
body's ``vllm_xargs`` to the workers (as ``SamplingParams.extra_args``), so
this middleware moves the tags there::

    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware agentspec_vllm.middleware.AgentSpecHeaderMiddleware

For ``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``
with a JSON body, the headers ``X-AgentSpec-Session``, ``X-AgentSpec-Stage``
and ``X-AgentSpec-Pipeline`` (percent-decoded, see
`agentspec._tags.decode_header_value`) become ``vllm_xargs`` entries
``agentspec_session``, ``agentspec_stage`` and ``agentspec_pipeline``.  Values
already in the body win.  A header value that is not a valid tag (1..128
characters, no control characters) gets a 400 answer.

Tenants: when ``$AGENTSPEC_TENANT_KEYS`` names a JSON file mapping API keys
to tenant names (``{"sk-team-a": "team-a"}``), the tenant of every such
request is taken from its ``Authorization: Bearer`` key and overrides any
``agentspec_tenant`` in the body (a client cannot pick another tenant's
shards); a key that is not in the map gets the ``"default"`` tenant.

Everything else passes through untouched, byte for byte: other paths and
methods, requests without the headers, non-JSON bodies, bodies that do not
parse as a JSON object or whose ``vllm_xargs`` is not an object (vLLM then
answers as it would have), bodies over ``max_body_bytes``.  Only the request
side is wrapped, so streamed answers (SSE) are not affected.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from agentspec._log import get_logger
from agentspec._shardkey import DEFAULT_TENANT
from agentspec._tags import (
    HEADER_PIPELINE,
    HEADER_SESSION,
    HEADER_STAGE,
    check_tag,
    decode_header_value,
)
from agentspec.exceptions import InvalidArgumentError

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "TAGGED_PATHS",
    "TENANT_KEYS_ENV",
    "AgentSpecHeaderMiddleware",
    "load_tenant_keys",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Request paths whose JSON bodies get the tags.
TAGGED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
#: Environment variable naming the JSON file that maps API keys to tenants.
TENANT_KEYS_ENV = "AGENTSPEC_TENANT_KEYS"
#: Bodies larger than this are passed through unchanged (64 MiB).
DEFAULT_MAX_BODY_BYTES = 64 << 20

#: ``(lower-case header name, vllm_xargs key, tag name)``.
_HEADER_KEYS = (
    (HEADER_SESSION.lower().encode(), "agentspec_session", "session"),
    (HEADER_STAGE.lower().encode(), "agentspec_stage", "stage"),
    (HEADER_PIPELINE.lower().encode(), "agentspec_pipeline", "pipeline"),
)
_TENANT_KEY = "agentspec_tenant"

_log = get_logger()


def load_tenant_keys(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read a JSON object mapping API keys to tenant names.

    Raises:
        InvalidArgumentError: the file cannot be read, is not a JSON object of
            non-empty strings, or names an invalid tenant.
    """
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"cannot read the tenant key map {path}", str(e)) from None
    if not isinstance(obj, dict):
        raise InvalidArgumentError(f"tenant key map {path} is not a JSON object")
    out: dict[str, str] = {}
    for key, tenant in obj.items():
        if not key or not isinstance(tenant, str):
            raise InvalidArgumentError(
                f"tenant key map {path}: every entry must map a non-empty key to a tenant name"
            )
        out[key] = check_tag(tenant, "tenant")
    return out


class AgentSpecHeaderMiddleware:
    """Pure ASGI middleware: ``X-AgentSpec-*`` headers into the body's ``vllm_xargs``.

    Args:
        app: the wrapped ASGI application (vLLM's FastAPI app).
        tenant_keys: API key -> tenant map; default: read from the file named
            by ``$AGENTSPEC_TENANT_KEYS`` when set, else no tenant handling.
        max_body_bytes: larger bodies are passed through unchanged.

    vLLM builds it with ``app.add_middleware(cls)`` (no arguments), so in a
    server its configuration comes from the environment.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        tenant_keys: Mapping[str, str] | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        """Wrap ``app`` (see the class docstring for the arguments)."""
        if type(max_body_bytes) is not int or max_body_bytes < 1:
            raise InvalidArgumentError("max_body_bytes must be an int >= 1")
        if tenant_keys is None:
            env = os.environ.get(TENANT_KEYS_ENV)
            tenant_keys = load_tenant_keys(env) if env else None
        else:
            for tenant in tenant_keys.values():
                check_tag(tenant, "tenant")
        self.app = app
        self.tenant_keys: dict[str, str] | None = (
            dict(tenant_keys) if tenant_keys is not None else None
        )
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Handle one ASGI connection."""
        path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))
        if scope.get("type") != "http" or scope.get("method") != "POST" or path not in TAGGED_PATHS:
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers") or ())
        tags = self._header_tags(headers)
        tenant = self._tenant(headers)
        if (not tags and tenant is None) or not _is_json(headers):
            await self.app(scope, receive, send)
            return
        if isinstance(tags, str):  # an invalid header value
            await _bad_request(send, tags)
            return
        messages, body, complete = await _read_body(receive, self.max_body_bytes)
        new_body = _merge(body, tags, tenant) if complete else None
        if new_body is None:
            await self.app(scope, _replay(messages, receive), send)
            return
        new_headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        new_headers.append((b"content-length", str(len(new_body)).encode()))
        new_scope = dict(scope)
        new_scope["headers"] = new_headers
        first: list[Message] = [{"type": "http.request", "body": new_body, "more_body": False}]
        await self.app(new_scope, _replay(first, receive), send)

    def _header_tags(self, headers: list[tuple[bytes, bytes]]) -> dict[str, str] | str:
        """``{vllm_xargs key: tag}`` from the headers, or an error message."""
        found: dict[str, str] = {}
        for name, value in headers:
            lname = name.lower()
            for header, xkey, what in _HEADER_KEYS:
                if lname != header:
                    continue
                try:
                    found[xkey] = check_tag(decode_header_value(value.decode("latin-1")), what)
                except InvalidArgumentError as e:
                    return f"header {name.decode('latin-1')}: {e}"
        return found

    def _tenant(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """The tenant of the request's API key (None without a tenant map)."""
        if self.tenant_keys is None:
            return None
        token = None
        for name, value in headers:
            if name.lower() == b"authorization":
                scheme, _, rest = value.decode("latin-1").strip().partition(" ")
                if scheme.lower() == "bearer":
                    token = rest.strip()
        return str(self.tenant_keys.get(token or "", DEFAULT_TENANT))


def _is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the request declares a JSON body (``application/json`` or ``+json``)."""
    for name, value in headers:
        if name.lower() == b"content-type":
            base = value.split(b";")[0].strip().lower()
            return base == b"application/json" or base.endswith(b"+json")
    return False


async def _read_body(receive: Receive, limit: int) -> tuple[list[Message], bytes, bool]:
    """Read the request body: ``(messages received, body, whether it is complete)``.

    Stops early (incomplete) at a disconnect, a non-request message, or once
    more than ``limit`` bytes arrived; the messages are kept for replay.
    """
    messages: list[Message] = []
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message.get("type") != "http.request":
            return messages, b"", False
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return messages, b"", False
        if not message.get("more_body", False):
            return messages, b"".join(chunks), True


def _merge(body: bytes, tags: Mapping[str, str], tenant: str | None) -> bytes | None:
    """The body with the tags merged into ``vllm_xargs``; None to pass it unchanged."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    xargs = obj.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    elif not isinstance(xargs, dict):
        return None
    merged = {**tags, **xargs}
    if tenant is not None:
        if merged.get(_TENANT_KEY, tenant) != tenant:
            _log.info(
                "agentspec.middleware.tenant_overridden", asked=str(merged[_TENANT_KEY])[:128]
            )
        merged[_TENANT_KEY] = tenant
    if merged == xargs:
        return None
    obj["vllm_xargs"] = merged
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive callable returning ``messages`` first, then the original's."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


async def _bad_request(send: Send, message: str) -> None:
    """Answer 400 with an OpenAI-style JSON error."""
    body = json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
