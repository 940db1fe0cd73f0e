"""ASGI middleware copying ``X-AgentSpec-*`` request headers into ``vllm_xargs``.

Some agent frameworks can add HTTP headers to their OpenAI calls
(``default_headers``) but cannot change the JSON body.  vLLM only hands the
body's ``vllm_xargs`` to the workers (as ``SamplingParams.extra_args``), so
this middleware moves the tags there::

    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware agentspec_vllm.middleware.AgentSpecHeaderMiddleware

For ``POST`` to the JSON generation routes (`TAGGED_PATHS`:
``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/messages``, ``/v1/chat/completions/batch``, ``/invocations``; and
``/inference/v1/generate``, whose ``sampling_params.extra_args`` plays the part
of ``vllm_xargs``) with a JSON body, the headers ``X-AgentSpec-Session``,
``X-AgentSpec-Stage`` and ``X-AgentSpec-Pipeline`` (percent-decoded, see
`agentspec.protocol.decode_header_value`) become ``vllm_xargs`` entries
``agentspec_session``, ``agentspec_stage`` and ``agentspec_pipeline``.  Values
already in the body win.  A header value that is not a valid tag (1..128
characters, no control characters) gets a 400 answer.

Tenants: when ``$AGENTSPEC_TENANT_KEYS`` names a JSON file mapping API keys
to tenant names (``{"sk-team-a": "team-a"}``, read by
`agentspec.protocol.load_tenant_keys`, the loader ``agentspec serve --engine
embedded --tenant-keys`` uses too), the tenant of every such request is taken
from its ``Authorization: Bearer`` key and overrides any ``agentspec_tenant``
in the body (a client cannot pick another tenant's shards); a key that is not
in the map gets the ``"default"`` tenant, as in the LiteLLM hook.  This
middleware does not authenticate: vLLM's ``--api-key`` (it takes several
keys) decides who gets in.  With a map, a request the middleware cannot
rewrite is refused, never forwarded: a body over ``max_body_bytes`` gets 413,
a body that is not a JSON object (whatever its ``Content-Type``), or whose
``vllm_xargs`` (``sampling_params`` / ``extra_args``) is not an object, gets
400, and ``POST /v1/audio/transcriptions`` / ``translations`` (form bodies
that may carry ``vllm_xargs``) get 400.  The body forwarded is the
middleware's own re-encoding of the parsed JSON, so the server parses exactly
what was checked.

Without a map everything else passes through untouched, byte for byte: other
paths and methods, requests without the headers, non-JSON bodies, bodies that
do not parse as a JSON object or whose ``vllm_xargs`` is not an object (vLLM
then answers as it would have), bodies over ``max_body_bytes``.  Only the
request side is wrapped, so streamed answers (SSE) are not affected.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from agentspec.exceptions import InvalidArgumentError
from agentspec.integration import get_logger
from agentspec.protocol import (
    DEFAULT_TENANT,
    TAG_HEADERS,
    TAG_NAMES,
    TAG_XARGS,
    TENANT_KEYS_ENV,
    XARG_TENANT,
    XARGS_FIELD,
    bearer_token,
    check_tag,
    check_tenant_keys,
    decode_header_value,
    load_tenant_keys,
    tenant_keys_from_env,
    tenant_of,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "FORM_PATHS",
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

#: Request paths whose JSON bodies get the tags (in their top-level ``vllm_xargs``).
TAGGED_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/chat/completions/batch",
        "/invocations",
    }
)
#: Paths whose tags go into ``sampling_params.extra_args`` (token-in/token-out generate).
_SAMPLING_PATHS = frozenset({"/inference/v1/generate"})
#: Form-body (multipart) routes that can carry ``vllm_xargs``: refused with a tenant map.
FORM_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
#: Bodies larger than this are passed through unchanged, or refused (413) with a
#: tenant map (64 MiB).
DEFAULT_MAX_BODY_BYTES = 64 << 20

#: ``(lower-case header name, vllm_xargs key, tag name)``.
_HEADER_KEYS = tuple(
    (TAG_HEADERS[name].lower().encode(), TAG_XARGS[name], name) for name in TAG_NAMES
)
_TENANT_KEY = XARG_TENANT
#: Headers describing the original body, dropped when the body is rewritten.
_BODY_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"content-encoding"})

_log = get_logger()


class _RefusedError(Exception):
    """A request answered with an error instead of being forwarded."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class AgentSpecHeaderMiddleware:
    """Pure ASGI middleware: ``X-AgentSpec-*`` headers into the body's ``vllm_xargs``.

    Args:
        app: the wrapped ASGI application (vLLM's FastAPI app).
        tenant_keys: API key -> tenant map; default: read from the file named
            by ``$AGENTSPEC_TENANT_KEYS`` when set, else no tenant handling.
        max_body_bytes: larger bodies are passed through unchanged (without a
            tenant map) or refused with 413 (with one).

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
        self.app = app
        self.tenant_keys: dict[str, str] | None = (
            tenant_keys_from_env() if tenant_keys is None else check_tenant_keys(tenant_keys)
        )
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Handle one ASGI connection."""
        path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))
        path = path.rstrip("/") or "/"
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        if path in FORM_PATHS and self.tenant_keys is not None:
            await _error(
                send,
                400,
                f"{path} is not available on this server: its tenants come from the API "
                "key, and form bodies are not checked",
            )
            return
        container = (
            (XARGS_FIELD,)
            if path in TAGGED_PATHS
            else ("sampling_params", "extra_args")
            if path in _SAMPLING_PATHS
            else None
        )
        if container is None:
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers") or ())
        tags = self._header_tags(headers)
        if isinstance(tags, str):  # an invalid header value
            await _error(send, 400, tags)
            return
        if self.tenant_keys is None:
            await self._tags_only(scope, receive, send, headers, tags, container)
            return
        tenant = self._tenant(headers)
        messages, body, complete = await _read_body(receive, self.max_body_bytes)
        if not complete:
            if messages[-1].get("type") == "http.request":  # over the limit
                await _error(
                    send,
                    413,
                    f"request body over {self.max_body_bytes} bytes",
                    "RequestEntityTooLargeError",
                )
            return  # the client went away: nothing to answer
        try:
            new_body = _merge(body, tags, tenant, container, strict=True)
        except _RefusedError as r:
            await _error(send, r.status, r.message)
            return
        if new_body is None:  # pragma: no cover - strict merges re-encode every body
            await _error(send, 400, "the request body cannot be checked")
            return
        await self._forward(scope, receive, send, headers, new_body)

    async def _tags_only(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        tags: dict[str, str],
        container: tuple[str, ...],
    ) -> None:
        """No tenant map: add the header tags when possible, else pass through unchanged."""
        if not tags or not _is_json(headers):
            await self.app(scope, receive, send)
            return
        messages, body, complete = await _read_body(receive, self.max_body_bytes)
        new_body = _merge(body, tags, None, container, strict=False) if complete else None
        if new_body is None:
            await self.app(scope, _replay(messages, receive), send)
            return
        await self._forward(scope, receive, send, headers, new_body)

    async def _forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        """Call the app with ``body`` in place of the request's own."""
        new_headers = [(k, v) for k, v in headers if k.lower() not in _BODY_HEADERS]
        new_headers.append((b"content-length", str(len(body)).encode()))
        new_scope = dict(scope)
        new_scope["headers"] = new_headers
        first: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
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

    def _tenant(self, headers: list[tuple[bytes, bytes]]) -> str:
        """The tenant of the request's API key (the first ``Authorization`` header, as
        Starlette and vLLM's own key check read it); ``"default"`` for unknown keys."""
        assert self.tenant_keys is not None
        auth = next((v for k, v in headers if k.lower() == b"authorization"), None)
        token = bearer_token(None if auth is None else auth.decode("latin-1"))
        return tenant_of(self.tenant_keys, token) or DEFAULT_TENANT


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


def _merge(
    body: bytes,
    tags: Mapping[str, str],
    tenant: str | None,
    container: tuple[str, ...],
    *,
    strict: bool,
) -> bytes | None:
    """The body with the tags (and tenant) merged into its ``vllm_xargs``.

    ``container`` is the path of the xargs object in the body.  Not strict:
    None to pass the body unchanged (unusable or nothing to add).  Strict (a
    tenant map): the body is always re-encoded, and one that cannot be
    rewritten raises `_RefusedError`.
    """
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        if strict:
            raise _RefusedError(
                400, f"the request body is not valid JSON: {str(e)[:200]}"
            ) from None
        return None
    if not isinstance(obj, dict):
        if strict:
            raise _RefusedError(400, "the request body must be a JSON object")
        return None
    parent = obj
    for name in container[:-1]:
        inner = parent.get(name)
        if not isinstance(inner, dict):
            if strict:
                raise _RefusedError(400, f"'{name}' must be an object")
            return None
        parent = inner
    last = container[-1]
    xargs = parent.get(last)
    if xargs is None:
        xargs = {}
    elif not isinstance(xargs, dict):
        if strict:
            raise _RefusedError(400, f"'{'.'.join(container)}' must be an object")
        return None
    merged = {**tags, **xargs}
    if tenant is not None:
        if merged.get(_TENANT_KEY, tenant) != tenant:
            _log.info(
                "agentspec.middleware.tenant_overridden", asked=str(merged[_TENANT_KEY])[:128]
            )
        merged[_TENANT_KEY] = tenant
    if merged == xargs and not strict:
        return None
    parent[last] = merged
    try:
        return _encode(obj)
    except RecursionError:  # nested about as deep as the parser allows
        if strict:
            raise _RefusedError(400, "the request body is nested too deeply") from None
        return None


def _encode(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON (ASCII with escapes when it holds a lone surrogate)."""
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":")).encode("ascii")


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive callable returning ``messages`` first, then the original's."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


async def _error(send: Send, status: int, message: str, type_: str = "BadRequestError") -> None:
    """Answer ``status`` with an OpenAI-style JSON error (vLLM's ``ErrorResponse`` shape)."""
    body = json.dumps(
        {"error": {"message": message, "type": type_, "param": None, "code": status}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
