"""API key -> tenant maps: one loader for every server that takes the tenant from the key.

The vLLM header middleware (``agentspec_vllm.middleware``) and the embedded
engine's server (``agentspec serve --engine embedded --tenant-keys FILE``)
read the same file: a JSON object mapping API keys to tenant names::

    {"sk-team-a": "team-a", "sha256:9f86d08...": "team-b"}

A key may be written in the clear or as ``sha256:<64 hex digits>`` (the
SHA-256 of the key, as the LiteLLM hook's ``tenant_keys`` accepts it), so the
file need not hold the secrets themselves; a clear key cannot itself start
with ``sha256:``.  `tenant_of` looks a bearer token
up in such a map; the caller decides what an unknown key gets.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from agentspec._core.shardkey import check_tag
from agentspec.exceptions import InvalidArgumentError

__all__ = [
    "ADMIN_KEY_ENV",
    "TENANT_KEYS_ENV",
    "bearer_token",
    "check_tenant_keys",
    "load_tenant_keys",
    "tenant_keys_from_env",
    "tenant_of",
]

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
