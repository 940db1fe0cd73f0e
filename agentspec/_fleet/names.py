"""Redis key names of the fleet: every key of a tenant shares one prefix.

A tenant's keys all start with ``agentspec:{<tenant>}:``, so one Redis ACL
user per tenant can be limited to them (`tenant_acl_pattern`), and in Redis
Cluster the braces make the tenant a hash tag: all of its keys live in one
slot, which the library functions that touch several of them at once need.

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
- ``P compacting``: hash, the short lease of the one compactor at work;
- ``P sub:records``: hash, subscriber id -> its heartbeat (JSON), and
  ``P sub:expiry``: sorted set, subscriber id -> when it expires (see
  `_fleet_heartbeat`).

`tenant_acl_rules` gives the least-privilege ``ACL SETUSER`` rules of a
tenant's user: the fleet's functions and the commands it sends, on its own
keys; for a read-only replica, reads and its heartbeat only.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from agentspec._core.shardkey import ShardKey, check_tenant, key_json

__all__ = [
    "FleetKeys",
    "encode_tenant",
    "is_shard_name",
    "shard_name",
    "tenant_acl_pattern",
    "tenant_acl_rules",
]

ROOT = "agentspec"
_PLAIN = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_SHARD_NAME = re.compile(rb"[0-9a-f]{32}")


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


#: Commands every fleet client sends besides the library's functions.
_BASE_COMMANDS = ("ping", "select", "multi", "exec", "discard", "xread")


#: What a Redis Cluster client sends besides: ``CLUSTER SLOTS`` (which node
#: serves which slot, on connecting and after a redirection or failover) and
#: ``ASKING`` (following an ``ASK`` redirection while a slot migrates).
_CLUSTER_COMMANDS = ("cluster|slots", "asking")


def tenant_acl_rules(tenant: str, *, read_only: bool = False, cluster: bool = False) -> list[str]:
    """``ACL SETUSER`` rules for a user of ``tenant`` (after ``on``, ``>password``).

    Least privilege: ``-@all``, then exactly the commands the fleet sends,
    on the tenant's keys only.  Writes and atomic reads go through the
    fleet's function library (`_fleet_scripts`), each function allowed by
    name (``+fcall|<function>``); the data commands the functions run
    (Redis checks a function's commands against the caller's ACL too) and
    key-checked reads (``HGETALL``, ``XREAD`` ...) are allowed on the
    tenant's keys.  Nothing that lists keys (``SCAN``, ``KEYS``), watches
    others (``CLIENT TRACKING``), runs code (``EVAL``, ``FUNCTION LOAD``) or
    writes strings (``SET``) is allowed.

    Read-only (a replica that only subscribes): reads of the tenant's keys,
    the read-only functions, and the ``beat`` function, writing only its
    two heartbeat keys; it never compacts, publishes or writes the config.

    ``cluster``: for a Redis Cluster, also ``CLUSTER SLOTS`` and ``ASKING``
    (the client's topology discovery and redirections; they touch no key).
    Create the user on every node, masters and replicas: ACLs are per node.
    """
    from agentspec._fleet.scripts import (
        LIBRARY_NAME,
        READ_COMMANDS,
        READ_FUNCTIONS,
        WRITE_COMMANDS,
        WRITE_FUNCTIONS,
    )

    def fn(kind: str, names: tuple[str, ...]) -> list[str]:
        return [f"+{kind}|{LIBRARY_NAME}_{n}" for n in names]

    keys = FleetKeys.of(tenant)
    reads = fn("fcall_ro", READ_FUNCTIONS)
    if read_only:
        key_rules = [f"%R~{keys.prefix}*", f"%RW~{keys.beats}", f"%RW~{keys.beat_expiry}"]
        writes = fn("fcall", ("beat",))
        client = ["+client|getname"]
    else:
        key_rules = [f"~{keys.prefix}*"]
        writes = fn("fcall", WRITE_FUNCTIONS)
        client = ["+client|getname", "+client|setname"]
    base = (*_BASE_COMMANDS, *_CLUSTER_COMMANDS) if cluster else _BASE_COMMANDS
    commands = [f"+{c}" for c in (*base, *READ_COMMANDS, *WRITE_COMMANDS)]
    return ["resetkeys", *key_rules, "resetchannels", "-@all", *commands, *client, *reads, *writes]


def shard_name(key: ShardKey) -> str:
    """A shard's name in key names: 32 hex digits of the SHA-256 of its key JSON."""
    return hashlib.sha256(key_json(key)).hexdigest()[:32]


def is_shard_name(raw: bytes) -> bool:
    """Whether ``raw`` (as Redis returns it) has the form of a `shard_name`."""
    return _SHARD_NAME.fullmatch(raw) is not None


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

    @property
    def beats(self) -> str:
        """The heartbeat hash: subscriber id -> its record (JSON)."""
        return f"{self.prefix}sub:records"

    @property
    def beat_expiry(self) -> str:
        """The heartbeats' expiry times: sorted set, subscriber id -> Unix ms."""
        return f"{self.prefix}sub:expiry"
