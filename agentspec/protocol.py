"""The request-tag protocol: every name the client, the servers and the integrations share.

A model call is tagged so that its output is learned into the right shard and
the serving side drafts from the matching one.  Everything both ends must
spell alike lives here, once:

- **Shard keys.**  `ShardKey` is ``(tenant, pipeline, stage)``: the one key of
  a shard in the store, on the push wire, in the fleet and in the engines
  (``agentspec.ShardKey`` is this alias).  A `Speculator` holds one tenant's
  shards, so it names them by the rest, a `StageKey` ``(pipeline, stage)``.
  A None pipeline or stage means "untagged"; untenanted traffic belongs to
  `DEFAULT_TENANT`.
- **Names.**  A tag or key component is a str of 1..128 characters without
  control, format, private-use or line/paragraph separator characters and
  encodable as UTF-8 (`check_tag`); a tenant is also in Unicode NFC
  (`check_tenant`).  A request identity has 1..256 characters
  (`check_identity`).
- **Over HTTP.**  The tags travel in the body's ``vllm_xargs`` object
  (`XARGS_FIELD`; keys `XARG_TENANT`, `XARG_SESSION`, `XARG_STAGE`,
  `XARG_PIPELINE`, plus `XARG_SPECULATE` and `XARG_REQUEST_ID`; see
  `tag_xargs`) and in the ``X-AgentSpec-*`` headers (`HEADER_SESSION`,
  `HEADER_STAGE`, `HEADER_PIPELINE`).  A header value that is not plain
  printable ASCII (or holds ``%``) is sent percent-encoded (UTF-8)
  (`encode_header_value`), so a receiver always applies `decode_header_value`.
  The push wire's instance header is `HEADER_INSTANCE`.
- **Tenant key maps.**  A server that takes the tenant from the caller's API
  key reads a JSON object mapping keys to tenants, a key in the clear or as
  ``sha256:<64 hex digits>``::

      {"sk-team-a": "team-a", "sha256:9f86d08...": "team-b"}

  (`load_tenant_keys`, `tenant_keys_from_env`; `tenant_of` looks a bearer
  token up; the caller decides what an unknown key gets).  The vLLM header
  middleware and ``agentspec serve --engine embedded --tenant-keys FILE``
  read the same file.

This module imports nothing of agentspec but `agentspec.exceptions`, so every
layer and every integration may use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import quote, unquote

from agentspec.exceptions import InvalidArgumentError

__all__ = [
    "ADMIN_KEY_ENV",
    "DEFAULT_TENANT",
    "HEADER_INSTANCE",
    "HEADER_PIPELINE",
    "HEADER_SESSION",
    "HEADER_STAGE",
    "MAX_COMPONENT",
    "MAX_IDENTITY",
    "MAX_TAG_LENGTH",
    "TAG_HEADERS",
    "TAG_NAMES",
    "TAG_XARGS",
    "TENANT_KEYS_ENV",
    "XARGS_FIELD",
    "XARG_PIPELINE",
    "XARG_PREFIX",
    "XARG_REQUEST_ID",
    "XARG_SESSION",
    "XARG_SPECULATE",
    "XARG_STAGE",
    "XARG_TENANT",
    "ShardKey",
    "StageKey",
    "bearer_token",
    "check_component",
    "check_identity",
    "check_key",
    "check_tag",
    "check_tenant",
    "check_tenant_keys",
    "decode_header_value",
    "encode_header_value",
    "load_tenant_keys",
    "make_key",
    "tag_xargs",
    "tenant_keys_from_env",
    "tenant_of",
]

# --- shard keys and names ------------------------------------------------------

#: A shard key: ``(tenant, pipeline, stage)``; None pipeline / stage mean "untagged".
ShardKey = tuple[str, str | None, str | None]

#: A shard key without its tenant: ``(pipeline, stage)``, how one tenant's
#: `Speculator` names its shards.
StageKey = tuple[str | None, str | None]

#: The tenant of untenanted traffic.
DEFAULT_TENANT = "default"

#: Longest key component, in characters.
MAX_COMPONENT = 128

#: Longest allowed tag, in characters.
MAX_TAG_LENGTH = MAX_COMPONENT

#: Longest request identity, in characters.
MAX_IDENTITY = 256

#: Unicode categories a name may not hold: controls (Cc), invisible format
#: characters such as zero-width spaces and bidi overrides (Cf), private use
#: (Co), and line and paragraph separators (Zl, Zp).
_REFUSED = frozenset({"Cc", "Cf", "Co", "Zl", "Zp"})


def check_component(value: object, label: str, *, optional: bool = False) -> str | None:
    """Validate one name (a key component or a tag): 1..128 characters, none of them a
    control, format, private-use or line/paragraph separator character, encodable as
    UTF-8 (no lone surrogate).

    ``label`` names it in the error (``"shard key stage"``, ``"session"``).
    """
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise InvalidArgumentError(
            f"{label} must be a str{' or None' if optional else ''}",
            f"got {type(value).__name__}",
        )
    if not 1 <= len(value) <= MAX_COMPONENT:
        raise InvalidArgumentError(
            f"{label} must have 1..{MAX_COMPONENT} characters", f"got {len(value)}"
        )
    for i, ch in enumerate(value):
        if unicodedata.category(ch) in _REFUSED:
            raise InvalidArgumentError(
                f"{label} contains a control, format or separator character",
                f"{ord(ch):#x} at index {i}",
            )
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: no UTF-8 (file names, JSON, wire)
            raise InvalidArgumentError(
                f"{label} is not encodable as UTF-8 (a lone surrogate)",
                f"{ord(value[e.start]):#x} at index {e.start}",
            ) from None
    return value


def check_tag(value: object, name: str) -> str:
    """Return ``value`` if it is a valid tag, else raise `InvalidArgumentError`.

    ``name`` names the tag in the message (``"stage"``, ``"session"``, ...).
    """
    checked = check_component(value, name)
    assert checked is not None
    return checked


def check_tenant(value: object, label: str = "tenant") -> str:
    """Validate a tenant name: as `check_component`, and in Unicode NFC.

    A tenant written in two Unicode forms (``é`` composed and decomposed)
    would be two tenants with two sets of shards and Redis keys, so a name
    that is not already NFC is refused rather than silently split.
    """
    name = check_component(value, label)
    assert name is not None
    if not name.isascii() and unicodedata.normalize("NFC", name) != name:
        raise InvalidArgumentError(
            f"{label} is not in Unicode NFC form",
            "normalise it (unicodedata.normalize('NFC', name))",
        )
    return name


def check_key(key: object) -> ShardKey:
    """Validate a shard key and return it as a tuple.

    Raises:
        InvalidArgumentError: not a 3-item sequence of (str, str | None,
        str | None), an empty or over-long component, a control character, a
        component that is not encodable as UTF-8 (a lone surrogate), or a
        tenant that is not in Unicode NFC form.
    """
    if isinstance(key, (str, bytes)) or not isinstance(key, Sequence) or len(key) != 3:
        raise InvalidArgumentError(
            "a shard key is a (tenant, pipeline, stage) tuple", f"got {key!r:.80}"
        )
    return (
        check_tenant(key[0], "shard key tenant"),
        check_component(key[1], "shard key pipeline", optional=True),
        check_component(key[2], "shard key stage", optional=True),
    )


def make_key(
    tenant: str | None = None, pipeline: str | None = None, stage: str | None = None
) -> ShardKey:
    """A validated key; a None tenant is `DEFAULT_TENANT`."""
    return check_key((DEFAULT_TENANT if tenant is None else tenant, pipeline, stage))


def check_identity(identity: object) -> str:
    """Validate a request identity: a str of 1..256 characters, encodable as UTF-8."""
    if not isinstance(identity, str):
        raise InvalidArgumentError("identity must be a str", f"got {type(identity).__name__}")
    if not 1 <= len(identity) <= MAX_IDENTITY:
        raise InvalidArgumentError(
            f"identity must have 1..{MAX_IDENTITY} characters", f"got {len(identity)}"
        )
    try:
        identity.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError("identity is not encodable as UTF-8") from None
    return identity


# --- vllm_xargs and headers ----------------------------------------------------

#: The request-body object carrying the tags (vLLM passes it to its workers as
#: ``SamplingParams.extra_args``).
XARGS_FIELD = "vllm_xargs"
#: Prefix of every agentspec key in ``vllm_xargs`` (and in LiteLLM body ``metadata``).
XARG_PREFIX = "agentspec_"
#: ``vllm_xargs`` key of the tenant.
XARG_TENANT = XARG_PREFIX + "tenant"
#: ``vllm_xargs`` key of the session.
XARG_SESSION = XARG_PREFIX + "session"
#: ``vllm_xargs`` key of the stage.
XARG_STAGE = XARG_PREFIX + "stage"
#: ``vllm_xargs`` key of the pipeline.
XARG_PIPELINE = XARG_PREFIX + "pipeline"
#: ``vllm_xargs`` key turning speculation on or off for one request.
XARG_SPECULATE = XARG_PREFIX + "speculate"
#: ``vllm_xargs`` key naming the request to the fleet (the identity its response
#: is published under; both sides publishing one response use the same one).
XARG_REQUEST_ID = XARG_PREFIX + "request_id"

#: Request header carrying the session id.
HEADER_SESSION = "X-AgentSpec-Session"
#: Request header carrying the stage.
HEADER_STAGE = "X-AgentSpec-Stage"
#: Request header carrying the pipeline.
HEADER_PIPELINE = "X-AgentSpec-Pipeline"
#: Push-wire header naming a worker process's instance (see ``agentspec.integration``).
HEADER_INSTANCE = "X-AgentSpec-Instance"

#: The tags a request carries besides its tenant, in wire order.
TAG_NAMES = ("session", "stage", "pipeline")
#: Tag name -> its ``vllm_xargs`` key.
TAG_XARGS: Mapping[str, str] = {
    "session": XARG_SESSION,
    "stage": XARG_STAGE,
    "pipeline": XARG_PIPELINE,
}
#: Tag name -> its request header.
TAG_HEADERS: Mapping[str, str] = {
    "session": HEADER_SESSION,
    "stage": HEADER_STAGE,
    "pipeline": HEADER_PIPELINE,
}

# Sent as is: printable ASCII without "%", not starting or ending with a space.
_HEADER_SAFE = re.compile(r"[!-$&-~](?:[ !-$&-~]*[!-$&-~])?")
_QUOTE_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


def encode_header_value(value: str) -> str:
    """A tag as an HTTP header value: unchanged if plain ASCII, else percent-encoded."""
    if _HEADER_SAFE.fullmatch(value):
        return value
    return quote(value, safe=_QUOTE_SAFE)


def decode_header_value(value: str) -> str:
    """Inverse of `encode_header_value` (``urllib.parse.unquote``)."""
    return unquote(value)


def tag_xargs(
    tenant: str,
    *,
    session: str | None = None,
    stage: str | None = None,
    pipeline: str | None = None,
    request_id: str | None = None,
) -> dict[str, str]:
    """The ``vllm_xargs`` entries of a tagged request (None values left out).

    Order: tenant, request id, session, stage, pipeline.
    """
    out = {XARG_TENANT: tenant}
    if request_id is not None:
        out[XARG_REQUEST_ID] = request_id
    for name, value in (("session", session), ("stage", stage), ("pipeline", pipeline)):
        if value is not None:
            out[TAG_XARGS[name]] = value
    return out


# --- API key -> tenant maps ----------------------------------------------------

#: Environment variable naming the JSON file that maps API keys to tenants.
TENANT_KEYS_ENV = "AGENTSPEC_TENANT_KEYS"
#: Environment variable holding the embedded server's shard-admin key.
ADMIN_KEY_ENV = "AGENTSPEC_ADMIN_KEY"

_HASH_PREFIX = "sha256:"
_HEX = frozenset("0123456789abcdef")


def check_tenant_keys(keys: Mapping[str, str], where: str = "tenant key map") -> dict[str, str]:
    """Validate an API key -> tenant map; returns a copy.

    Raises:
        InvalidArgumentError: an empty or non-string key, a ``sha256:`` key
            that is not 64 lower-case hex digits, or an invalid tenant name.
    """
    out: dict[str, str] = {}
    for key, tenant in keys.items():
        if not isinstance(key, str) or not key or not isinstance(tenant, str):
            raise InvalidArgumentError(
                f"{where}: every entry must map a non-empty key to a tenant name"
            )
        if key.startswith(_HASH_PREFIX):
            digest = key[len(_HASH_PREFIX) :]
            if len(digest) != 64 or not set(digest) <= _HEX:
                raise InvalidArgumentError(
                    f"{where}: {key[:14]!r}... is not sha256: and 64 lower-case hex digits"
                )
        try:
            out[key] = check_tag(tenant, "tenant")
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"{where}: {e}") from None
    return out


def load_tenant_keys(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read a JSON object mapping API keys to tenant names.

    Raises:
        InvalidArgumentError: the file cannot be read, is not a JSON object of
            non-empty strings, or names an invalid tenant.
    """
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise InvalidArgumentError(f"cannot read the tenant key map {path}", str(e)) from None
    if not isinstance(obj, dict):
        raise InvalidArgumentError(f"tenant key map {path} is not a JSON object")
    return check_tenant_keys(obj, f"tenant key map {path}")


def tenant_keys_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The map of the file named by ``$AGENTSPEC_TENANT_KEYS`` (None when unset or empty)."""
    path = (os.environ if environ is None else environ).get(TENANT_KEYS_ENV)
    return load_tenant_keys(path) if path else None


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value (None: none)."""
    if authorization is None:
        return None
    scheme, _, rest = authorization.strip().partition(" ")
    token = rest.strip()
    return token if scheme.lower() == "bearer" and token else None


def tenant_of(keys: Mapping[str, str], token: str | None) -> str | None:
    """The tenant of a bearer token in ``keys`` (clear or ``sha256:`` entry); None: unknown."""
    if not token:
        return None
    # A token spelled like a hashed entry must not match that entry itself
    # (the file's digest would then be a key): clear entries never start
    # with "sha256:" (`check_tenant_keys`), so such a token is only hashed.
    tenant = None if token.startswith(_HASH_PREFIX) else keys.get(token)
    if tenant is None:
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
        tenant = keys.get(_HASH_PREFIX + digest)
    return tenant
