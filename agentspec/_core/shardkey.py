"""Shard keys on disk: the canonical JSON of a ``(tenant, pipeline, stage)`` key and
the directory name derived from it.

The key itself, its validation and `DEFAULT_TENANT` are defined in
`agentspec.protocol` and re-exported here for the store, push and fleet layers.
"""

from __future__ import annotations

import hashlib
import json
import re

from agentspec.protocol import (
    DEFAULT_TENANT,
    MAX_COMPONENT,
    ShardKey,
    check_component,
    check_key,
    check_tag,
    check_tenant,
    make_key,
)

__all__ = [
    "DEFAULT_TENANT",
    "MAX_COMPONENT",
    "ShardKey",
    "check_component",
    "check_key",
    "check_tag",
    "check_tenant",
    "is_shard_dir_name",
    "key_dir_name",
    "key_json",
    "make_key",
]

# Hex names longer than this would exceed file-name limits (255 bytes); such
# keys are named by the SHA-256 of their JSON instead ("h" + 64 hex digits).
_MAX_HEX_NAME = 200
_NAME_RE = re.compile(rf"(?:[0-9a-f]{{2}}){{1,{_MAX_HEX_NAME // 2}}}|h[0-9a-f]{{64}}")


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
