"""A tenant's fleet config: the tree depth and per-shard token budget every replica uses.

Replicas only agree on a shard's sequences if they build it the same way,
so the depth (native shard bytes carry it) and the token budget (it decides
evictions) are the tenant's, not each process's: they live in the tenant's
``meta`` hash in Redis.  The first process to reach a tenant writes its own
`FleetConfig` there (``HSETNX``, so the first writer wins); every later
process, whatever it was configured with, adopts what Redis holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from agentspec._core.draft import check_max_depth
from agentspec._fleet.functions import fcall
from agentspec._fleet.names import FleetKeys
from agentspec._util.args import as_int
from agentspec.exceptions import InvalidArgumentError

__all__ = ["MAX_SHARDS", "FleetConfig", "tenant_config"]

#: Highest ``max_shards`` a tenant may set.
MAX_SHARDS = 1 << 20
_DEFAULT_SHARDS = 1024


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """What a tenant's shards are built with.

    Attributes:
        max_depth: depth of every shard tree.
        max_shard_tokens: token budget of each shard (oldest sequences are
            evicted beyond it, in stream order); None: unbounded.
        max_shards: most shards of the tenant; beyond it a writer evicts the
            shards written longest ago, by eviction entries in the stream, so
            every replica drops the same shards at the same position.
    """

    max_depth: int = 64
    max_shard_tokens: int | None = 1 << 20
    max_shards: int = _DEFAULT_SHARDS

    def __post_init__(self) -> None:
        """Validate the fields."""
        check_max_depth(self.max_depth)
        if self.max_shard_tokens is not None:
            budget = as_int(self.max_shard_tokens, "max_shard_tokens", expected="an int or None")
            if budget < 1:
                raise InvalidArgumentError(f"max_shard_tokens must be >= 1, not {budget}")
        shards = as_int(self.max_shards, "max_shards")
        if not 1 <= shards <= MAX_SHARDS:
            raise InvalidArgumentError(f"max_shards must be in 1..{MAX_SHARDS}, not {shards}")

    def encode(self) -> dict[str, str]:
        """The ``meta`` fields of this config (``depth``, ``budget``, ``shards``)."""
        budget = "none" if self.max_shard_tokens is None else str(self.max_shard_tokens)
        return {"depth": str(self.max_depth), "budget": budget, "shards": str(self.max_shards)}

    @classmethod
    def decode(
        cls, depth: bytes | None, budget: bytes | None, shards: bytes | None = None
    ) -> FleetConfig:
        """The config stored in ``meta`` (no ``shards`` field: the default cap).

        Raises:
            InvalidArgumentError: missing or malformed fields.
        """
        if depth is None or budget is None:
            raise InvalidArgumentError("the tenant's fleet config is incomplete")
        try:
            d = int(depth)
            b = None if budget == b"none" else int(budget)
            n = _DEFAULT_SHARDS if shards is None else int(shards)
        except ValueError:
            raise InvalidArgumentError("the tenant's fleet config is malformed") from None
        return cls(d, b, n)


def tenant_config(client: redis.Redis, keys: FleetKeys, default: FleetConfig) -> FleetConfig:
    """The tenant's config in Redis, writing ``default`` there first if it has none.

    Reads first, so a read-only user gets the stored config; it only writes
    when Redis has none (then ``redis.exceptions.NoPermissionError`` for a
    read-only user).
    """
    depth, budget, shards = client.hmget(keys.meta, ["depth", "budget", "shards"])
    if isinstance(depth, bytes) and isinstance(budget, bytes) and isinstance(shards, bytes):
        return FleetConfig.decode(depth, budget, shards)
    enc = default.encode()
    stored = fcall(client, "init_config", [keys.meta], [enc["depth"], enc["budget"], enc["shards"]])
    return FleetConfig.decode(*stored)
