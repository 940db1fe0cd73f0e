"""Redis key names of the fleet: every key of a tenant shares one prefix.

A tenant's keys all start with ``agentspec:{<tenant>}:``, so one Redis ACL
user per tenant can be limited to them (`tenant_acl_pattern`), and in Redis
Cluster the braces make the tenant a hash tag: all of its keys live in one
slot, which the Lua scripts that touch several of them at once need.

A tenant name that is not plain ``[A-Za-z0-9_.-]`` is written as ``%`` plus
the hex of its UTF-8 bytes, so no name can carry a glob character (``*?[]\\``)
into an ACL pattern, nor a brace into the hash tag; a plain name never
contains ``%``, so the two forms cannot collide.

Keys of tenant T (``P`` = ``agentspec:{T}:``):

- ``P log``: the stream of learned sequences (see `_fleet_entry`);
- ``P meta``: hash, the tenant's fleet config (``depth``, ``budget``) and the
  compaction marks ``round`` and ``trimmed`` (see `_fleet_scripts`);
- ``P shards``: hash, shard name -> stream id its snapshot covers;
- ``P snap:<name>``: hash, one shard's snapshot (``data``, ``covered``,
  ``key``, ``gone``);
- ``P compacting``: the short lease of the one compactor at work;
- ``P sub:<id>``: one subscriber's heartbeat (JSON, expires unless renewed;
  see `_fleet_heartbeat`).

`tenant_acl_rules` gives the ``ACL SETUSER`` rules of a tenant's user: all of
its keys, or, for a read-only replica, reading them and writing only its
heartbeat keys.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from agentspec._core.shardkey import ShardKey, check_tenant, key_json

__all__ = [
    "FleetKeys",
    "encode_tenant",
    "shard_name",
    "tenant_acl_pattern",
    "tenant_acl_rules",
]

ROOT = "agentspec"
_PLAIN = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


def encode_tenant(tenant: str) -> str:
    """The tenant as it appears in key names (plain, or ``%`` + hex of UTF-8)."""
    name = check_tenant(tenant)
    if _PLAIN.fullmatch(name):
        return name
    return "%" + name.encode("utf-8").hex()


def tenant_prefix(tenant: str) -> str:
    """``agentspec:{<tenant>}:``: the start of every key of the tenant."""
    return f"{ROOT}:{{{encode_tenant(tenant)}}}:"


def tenant_acl_pattern(tenant: str) -> str:
    """The ACL key pattern of a tenant's keys: ``~agentspec:{<tenant>}:*``."""
    return f"~{tenant_prefix(tenant)}*"


def tenant_acl_rules(tenant: str, *, read_only: bool = False) -> list[str]:
    """``ACL SETUSER`` rules for a user of ``tenant`` (after ``on``, ``>password``).

    Read-write: every key of the tenant, every command but ``@dangerous``
    ones.  Read-only (a replica that only subscribes): reads of the tenant's
    keys (scripts through ``EVALSHA_RO``) and writes to its heartbeat keys
    only; it never compacts or publishes.
    """
    prefix = tenant_prefix(tenant)
    keys = [f"%R~{prefix}*", f"%RW~{prefix}sub:*"] if read_only else [f"~{prefix}*"]
    return ["resetkeys", *keys, "resetchannels", "+@all", "-@dangerous"]


def shard_name(key: ShardKey) -> str:
    """A shard's name in key names: 32 hex digits of the SHA-256 of its key JSON."""
    return hashlib.sha256(key_json(key)).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class FleetKeys:
    """The Redis keys of one tenant."""

    tenant: str
    prefix: str
    log: str
    meta: str
    index: str
    lock: str

    @classmethod
    def of(cls, tenant: str) -> FleetKeys:
        """The keys of ``tenant`` (validated)."""
        p = tenant_prefix(tenant)  # validates the name (NFC, length, characters)
        return cls(tenant, p, p + "log", p + "meta", p + "shards", p + "compacting")

    def snap(self, name: str) -> str:
        """The snapshot hash of the shard called ``name`` (see `shard_name`)."""
        return f"{self.prefix}snap:{name}"

    def heartbeat(self, subscriber_id: str) -> str:
        """The heartbeat key of the subscriber ``subscriber_id``."""
        return f"{self.prefix}sub:{subscriber_id}"

    @property
    def heartbeats(self) -> str:
        """The ``SCAN MATCH`` pattern of every heartbeat key of the tenant."""
        return f"{self.prefix}sub:*"
