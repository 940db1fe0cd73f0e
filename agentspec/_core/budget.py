"""Memory budgets of the shards a serving worker holds.

A worker holds two kinds of shards, each under its own budget, per tenant
and in total:

* pushed shards (`agentspec.ShardIntake`): a push that would take a tenant
  or the whole intake over its budget is refused (HTTP 507) and changes
  nothing;
* learned shards (`agentspec.Speculator`, one per tenant in the embedded
  engine and the vLLM proposer): over budget, the oldest learned sequences
  are evicted, first in first out, as ``max_shard_tokens`` does per shard.

Budgets count a tree's *live bytes*: the bytes it holds from the allocator
(`TreeStats.bytes`, the native library's exact accounting) less its free
node slots (`TreeStats.free_bytes`), which the tree reuses before it
allocates again.  Removing a sequence frees its node slots at once but gives
them back to the allocator only when the tree compacts (once half its slots
are free), so live bytes are what removal and eviction can bring down; a
tree's allocator bytes exceed them by at most the slots freed since its
peak.  A freshly built snapshot has (almost) no free slots.

A snapshot can be refused before it is built: its header gives its sequence
and token counts, and a tree never takes fewer than `min_tree_bytes` bytes
for them (4 bytes per token, 64 per sequence, 256 per tree -- measured
trees take 4.0 to 4.3 bytes per token on fully repetitive text and 55 to 75
on ordinary text, 90 to 160 bytes per sequence).  A shard refused by that
bound could never fit; one that passes it is built and then checked
exactly, and dropped when it does not fit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from agentspec._core import lowlevel
from agentspec._util.args import as_int
from agentspec.exceptions import InvalidArgumentError

if TYPE_CHECKING:
    from agentspec._core.tree import TreeStats

__all__ = [
    "DEFAULT_MAX_LEARNED_BYTES",
    "DEFAULT_MAX_SHARD_BYTES",
    "DEFAULT_MAX_TENANT_LEARNED_BYTES",
    "DEFAULT_MAX_TENANT_SHARD_BYTES",
    "LearnedBudget",
    "format_bytes",
    "live_bytes",
    "min_tree_bytes",
    "parse_byte_size",
    "shard_token_count",
]

#: Default total budget of a worker's pushed shards: 1 GiB.
DEFAULT_MAX_SHARD_BYTES = 1 << 30
#: Default budget of one tenant's pushed shards: 256 MiB.
DEFAULT_MAX_TENANT_SHARD_BYTES = 256 << 20
#: Default total budget of a worker's learned shards: 1 GiB.
DEFAULT_MAX_LEARNED_BYTES = 1 << 30
#: Default budget of one tenant's learned shards: 256 MiB.
DEFAULT_MAX_TENANT_LEARNED_BYTES = 256 << 20

#: Lower bounds of what a tree takes (see the module docstring).
MIN_TOKEN_BYTES = 4
MIN_SEQUENCE_BYTES = 64
MIN_TREE_BYTES = 256

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
_NONE = {"", "none", "off", "unlimited"}


def live_bytes(stats: TreeStats) -> int:
    """A tree's live bytes: allocator bytes less free node slots."""
    return max(0, stats.bytes - stats.free_bytes)


def shard_token_count(length: int, n_sequences: int, n_removals: int) -> int:
    """Tokens in shard bytes of ``length`` whose header counts are known (`shard_peek`).

    The payload is ``n_removals`` 8-byte ids, then per sequence a 12-byte
    record header and 4 bytes per token; whatever the header does not
    account for is tokens (a malformed payload gives a meaningless count,
    which the load then refuses).
    """
    rest = length - lowlevel.SHARD_HEADER_BYTES - 8 * n_removals - 12 * n_sequences
    return max(0, rest) // 4


def min_tree_bytes(n_sequences: int, n_tokens: int) -> int:
    """Fewest live bytes a tree holding these sequences and tokens takes."""
    return MIN_TREE_BYTES + MIN_SEQUENCE_BYTES * n_sequences + MIN_TOKEN_BYTES * n_tokens


def format_bytes(n: int) -> str:
    """``n`` for a message: ``"256 MiB"``, ``"1.5 GiB"``, ``"900 bytes"``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            text = f"{value:.1f}".removesuffix(".0")
            return f"{text} {unit}"
    return f"{n} bytes"


def parse_byte_size(value: object, name: str = "size") -> int | None:
    """A byte count from an int or a string such as ``"256MiB"``, ``"1G"``, ``"4096"``.

    Units are binary (``K``/``KB``/``KiB`` = 1024, ``M`` = 1024², ``G``, ``T``);
    ``"none"``, ``"off"``, ``"unlimited"``, ``""`` and None give None (no
    budget).

    Raises:
        InvalidArgumentError: not a size, or negative.
        TypeError: neither an int, a string nor None.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _NONE:
            return None
        m = _SIZE.fullmatch(text)
        if m is None or m.group(2) not in _UNITS:
            raise InvalidArgumentError(
                f"{name} must be a byte count such as 1073741824, 512MiB or 1GiB, or none",
                f"got {value[:40]!r}",
            )
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    return as_int(value, name, 0, expected="an int, a size string or None")


class BudgetMember(Protocol):
    """What a `LearnedBudget` asks of its members (`agentspec.Speculator`)."""

    def _oldest_stamp(self) -> int | None:
        """The arrival stamp of the member's oldest learned sequence (None: none)."""

    def _evict_oldest(self) -> bool:
        """Evict that sequence; False when nothing could be evicted."""


class LearnedBudget:
    """A total byte budget shared by several `Speculator` objects (one per tenant).

    Each Speculator given this budget keeps it informed of its live bytes;
    when their sum exceeds ``max_bytes`` the oldest learned sequence among
    all members is evicted, first in first out across tenants, until the
    sum fits again.  Arrival stamps come from this object, so "oldest" is
    comparable across members.

    Not thread-safe: use every member from one thread (or under one lock),
    as the embedded engine and the vLLM proposer do.
    """

    def __init__(self, max_bytes: int | None = DEFAULT_MAX_LEARNED_BYTES) -> None:
        """A budget of ``max_bytes`` live bytes (None: no total budget)."""
        self.max_bytes: int | None = parse_byte_size(max_bytes, "max_bytes")
        self.bytes = 0
        self._clock = 0
        self._members: list[BudgetMember] = []

    def join(self, spec: BudgetMember) -> None:
        """Count ``spec`` (called by `Speculator` itself)."""
        self._members.append(spec)

    def leave(self, spec: BudgetMember) -> None:
        """Stop counting ``spec`` (its bytes are no longer held)."""
        if spec in self._members:
            self._members.remove(spec)

    def stamp(self) -> int:
        """The next arrival stamp."""
        self._clock += 1
        return self._clock

    def members(self) -> Iterator[BudgetMember]:
        """The speculators sharing this budget."""
        return iter(list(self._members))

    def enforce(self) -> None:
        """Evict the oldest learned sequences (any member) while over the total."""
        limit = self.max_bytes
        if limit is None:
            return
        while self.bytes > limit:
            victim: BudgetMember | None = None
            oldest = 0
            for spec in self._members:
                stamp = spec._oldest_stamp()
                if stamp is not None and (victim is None or stamp < oldest):
                    victim, oldest = spec, stamp
            if victim is None or not victim._evict_oldest():
                return
