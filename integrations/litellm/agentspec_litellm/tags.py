"""Which tenant, session, stage and pipeline a proxied request belongs to.

`resolve_tags` reads a LiteLLM proxy request (the ``data`` dict of
``async_pre_call_hook``) and the caller's `UserAPIKeyAuth`.  For session,
stage and pipeline the first source that has a value wins:

1. the body's ``vllm_xargs`` (``agentspec_session`` / ``_stage`` /
   ``_pipeline``, as `agentspec.AgentSpecClient` sends them);
2. the ``X-AgentSpec-Session`` / ``-Stage`` / ``-Pipeline`` headers
   (percent-decoded, see `agentspec.protocol.decode_header_value`);
3. the body ``metadata`` keys ``agentspec_session`` / ``_stage`` / ``_pipeline``;
4. for the session only: LiteLLM's session id (the ``x-litellm-session-id``
   header, which OpenHands sets to the conversation id);
5. the config's ``default_stage`` / ``default_pipeline`` for the model group.

The tenant comes from the client (``vllm_xargs`` then ``metadata``
``agentspec_tenant``, else ``"default"``) only with ``tenant_from: client``.
Any other ``tenant_from`` takes it from the authenticated key alone (team,
key alias, user id, or the ``tenant_keys`` map) and ignores what the client
claims, so a client cannot write into another tenant's shards; a key the
map does not know gets ``"default"``.  A ``tenant_keys`` entry holds the raw
key (or its ``sha256:`` hex): LiteLLM shows the hook a virtual key hashed,
and the master key as an alias, and both are matched.

A value that is not a valid tag is dropped and reported in ``problems``,
never raised: the request goes on without it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentspec.exceptions import InvalidArgumentError
from agentspec.protocol import (
    DEFAULT_TENANT,
    TAG_HEADERS,
    XARG_PREFIX,
    XARG_TENANT,
    XARGS_FIELD,
    check_tag,
    decode_header_value,
    tag_xargs,
)
from agentspec_litellm.config import HookConfig, hash_key

__all__ = [
    "MASTER_KEY_ALIAS",
    "XARG_PREFIX",
    "RequestTags",
    "client_xargs",
    "request_headers",
    "resolve_tags",
]

_HEADERS = {name: header.lower() for name, header in TAG_HEADERS.items()}
_HEX64 = re.compile(r"[0-9a-f]{64}")
#: What LiteLLM's auth shows hooks instead of the proxy's master key
#: (``litellm.constants.LITELLM_PROXY_MASTER_KEY_ALIAS``).
MASTER_KEY_ALIAS = "litellm_proxy_master_key"


@dataclass(frozen=True)
class RequestTags:
    """The resolved tags of one request (None: not tagged)."""

    tenant: str
    session: str | None
    stage: str | None
    pipeline: str | None

    def xargs(self) -> dict[str, str]:
        """The tags as ``vllm_xargs`` entries (untagged ones left out)."""
        return tag_xargs(
            self.tenant, session=self.session, stage=self.stage, pipeline=self.pipeline
        )

    def as_dict(self) -> dict[str, str | None]:
        """Plain dict form (stashed in the request metadata)."""
        return {
            "tenant": self.tenant,
            "session": self.session,
            "stage": self.stage,
            "pipeline": self.pipeline,
        }


def request_headers(data: Mapping[str, Any]) -> dict[str, str]:
    """The client's request headers, lower-cased, as LiteLLM recorded them."""
    for holder in (data.get("proxy_server_request"), data.get("metadata")):
        if isinstance(holder, Mapping):
            headers = holder.get("headers")
            if isinstance(headers, Mapping):
                return {str(k).lower(): str(v) for k, v in headers.items()}
    return {}


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def client_xargs(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """The client's ``vllm_xargs`` (top level, else in its ``extra_body``; none: empty)."""
    return _mapping(data.get(XARGS_FIELD)) or _mapping(
        _mapping(data.get("extra_body")).get(XARGS_FIELD)
    )


def resolve_tags(
    data: Mapping[str, Any], user_key: Any, config: HookConfig
) -> tuple[RequestTags, list[str]]:
    """The request's tags and the problems met (invalid values that were dropped)."""
    problems: list[str] = []
    xargs = client_xargs(data)
    metadata = _mapping(data.get("metadata"))
    headers = request_headers(data)
    model = data.get("model") if isinstance(data.get("model"), str) else None

    def valid(value: object, name: str, source: str) -> str | None:
        if value is None:
            return None
        try:
            return check_tag(value, name)
        except InvalidArgumentError as exc:
            problems.append(f"{source}: {exc}")
            return None

    def tag(name: str) -> str | None:
        key = f"{XARG_PREFIX}{name}"
        found = valid(xargs.get(key), name, f"{XARGS_FIELD}.{key}")
        if found is None and _HEADERS[name] in headers:
            raw = decode_header_value(headers[_HEADERS[name]])
            found = valid(raw, name, f"header {_HEADERS[name]}")
        if found is None:
            found = valid(metadata.get(key), name, f"metadata.{key}")
        return found

    session = tag("session")
    if session is None:
        lite = data.get("litellm_session_id") or metadata.get("session_id")
        session = valid(lite, "session", "x-litellm-session-id")
    stage = tag("stage") or config.default_for(config.default_stage, model)
    pipeline = tag("pipeline") or config.default_for(config.default_pipeline, model)
    tenant = _tenant(xargs, metadata, user_key, config, valid)
    return RequestTags(tenant, session, stage, pipeline), problems


def _tenant(
    xargs: Mapping[str, Any],
    metadata: Mapping[str, Any],
    user_key: Any,
    config: HookConfig,
    valid: Any,
) -> str:
    """The tenant: from the client only when the config trusts it, else from the key."""
    key = XARG_TENANT
    if config.tenant_from == "client":
        found = valid(xargs.get(key), "tenant", f"{XARGS_FIELD}.{key}") or valid(
            metadata.get(key), "tenant", f"metadata.{key}"
        )
        return found or DEFAULT_TENANT
    if config.tenant_from == "key":
        for digest in _key_digests(user_key):
            if digest in config.tenant_keys:
                return config.tenant_keys[digest]
        return DEFAULT_TENANT
    attr = {"team": "team_id", "key_alias": "key_alias", "user": "user_id"}[config.tenant_from]
    value = getattr(user_key, attr, None)
    return valid(value, "tenant", f"key {attr}") or DEFAULT_TENANT


def _key_digests(user_key: Any) -> list[str]:
    """SHA-256 hex candidates for the caller's key.

    LiteLLM shows a hook a virtual key as its SHA-256 hex (``hash_token``),
    and the master key as `MASTER_KEY_ALIAS`: that alias stands for the
    proxy's master key (for a proxy admin only).
    """
    out = []
    for attr in ("token", "api_key"):
        value = getattr(user_key, attr, None)
        if not isinstance(value, str) or not value:
            continue
        if value == MASTER_KEY_ALIAS:
            role = getattr(user_key, "user_role", None)
            master = _master_key() if getattr(role, "value", role) == "proxy_admin" else None
            if master is not None:
                out.append(hash_key(master))
        else:
            out.append(value if _HEX64.fullmatch(value) else hash_key(value))
    return out


def _master_key() -> str | None:
    """The running proxy's master key (None: no proxy, or none set)."""
    from litellm.proxy import proxy_server

    key = getattr(proxy_server, "master_key", None)
    return key if isinstance(key, str) and key else None
