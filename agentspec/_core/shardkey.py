"""Shard keys: ``(tenant, pipeline, stage)``, their validation and on-disk names."""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Sequence

from agentspec.exceptions import InvalidArgumentError

__all__ = [
    "DEFAULT_TENANT",
    "ShardKey",
    "check_key",
    "check_tag",
    "check_tenant",
    "is_shard_dir_name",
    "key_dir_name",
    "key_json",
    "make_key",
]

#: A shard key: ``(tenant, pipeline, stage)``; None pipeline / stage mean "untagged".
ShardKey = tuple[str, str | None, str | None]

#: The tenant of untenanted traffic.
DEFAULT_TENANT = "default"

#: Longest key component, in characters.
MAX_COMPONENT = 128

# Hex names longer than this would exceed file-name limits (255 bytes); such
# keys are named by the SHA-256 of their JSON instead ("h" + 64 hex digits).
_MAX_HEX_NAME = 200
_NAME_RE = re.compile(rf"(?:[0-9a-f]{{2}}){{1,{_MAX_HEX_NAME // 2}}}|h[0-9a-f]{{64}}")


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


def key_json(key: ShardKey) -> bytes:
    """The canonical UTF-8 JSON of a key: ``[tenant, pipeline, stage]``."""
    return json.dumps(list(key), ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def key_dir_name(key: ShardKey) -> str:
    """The directory name of a shard: hex of its key JSON (hashed when too long)."""
    raw = key_json(key)
    name = raw.hex()
    if len(name) <= _MAX_HEX_NAME:
        return name
    return "h" + hashlib.sha256(raw).hexdigest()


def is_shard_dir_name(name: str) -> bool:
    """Whether ``name`` has the form of a shard directory name."""
    return _NAME_RE.fullmatch(name) is not None
