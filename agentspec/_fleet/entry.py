"""Stream entries: one learned sequence each, encoded and validated.

An entry of a tenant's stream has four fields:

- ``v``: the format version, ``1``;
- ``k``: the shard key as canonical JSON (``[tenant, pipeline, stage]``);
- ``i``: the request identity (UTF-8) the publisher supplied;
- ``d``: native shard bytes (a delta made by `SuffixTree.delta_bytes`)
  holding exactly one sequence, whose id is
  ``fleet_seq_id(key, identity, tokens)``.

`decode_entry` accepts an entry only if every check passes: the size
limit, the version, a valid key of this stream's tenant, a valid identity,
shard bytes that the native loader accepts at the tenant's depth (it
verifies the checksum and every token before anything changes) holding one
sequence, and an id that matches the recomputed fleet id.  Anything else
raises `BadEntryError` with a short reason, which the subscriber counts
before skipping the entry.  A removal list in the shard bytes is ignored:
replicas evict on their own, in stream order (see `_fleet_shard`).
"""

from __future__ import annotations

import array
import json
from collections.abc import Mapping
from dataclasses import dataclass

from agentspec._core.shardkey import ShardKey, check_key, key_json
from agentspec._core.tree import SuffixTree
from agentspec._fleet.ids import check_identity, fleet_seq_id
from agentspec.exceptions import AgentSpecError

__all__ = ["FORMAT", "MAX_ENTRY_BYTES", "BadEntryError", "FleetEntry", "decode_entry"]

#: The entry format version (field ``v``).
FORMAT = b"1"

#: Default bound on an entry's size (all field names and values), in bytes.
MAX_ENTRY_BYTES = 4 << 20


class BadEntryError(ValueError):
    """A stream entry that is not a valid fleet entry; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        """Record the reason (short, with no entry content)."""
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class FleetEntry:
    """One learned sequence: shard key, request identity, fleet id and tokens (int32)."""

    key: ShardKey
    identity: str
    seq_id: int
    tokens: array.array[int]

    @classmethod
    def make(cls, key: ShardKey, identity: str, tokens: array.array[int]) -> FleetEntry:
        """An entry whose id is the fleet id of (key, identity, tokens)."""
        return cls(key, identity, fleet_seq_id(key, identity, memoryview(tokens)), tokens)

    def fields(self, depth: int) -> dict[bytes, bytes]:
        """The stream fields of this entry, its shard bytes made at ``depth``."""
        with SuffixTree(depth) as scratch:
            scratch.add(self.seq_id, self.tokens)
            data = scratch.delta_bytes([self.seq_id])
        return {b"v": FORMAT, b"k": key_json(self.key), b"i": self.identity.encode(), b"d": data}


def entry_size(fields: Mapping[bytes, bytes]) -> int:
    """Bytes of an entry's field names and values."""
    return sum(len(k) + len(v) for k, v in fields.items())


def decode_entry(
    fields: Mapping[bytes, bytes], tenant: str, depth: int, max_bytes: int = MAX_ENTRY_BYTES
) -> FleetEntry:
    """Validate a stream entry of ``tenant``'s stream and return it.

    Raises:
        BadEntryError: anything but a valid entry (see the module docstring).
    """
    if entry_size(fields) > max_bytes:
        raise BadEntryError("oversized")
    if fields.get(b"v") != FORMAT:
        raise BadEntryError("unknown format")
    raw_key, raw_ident, data = fields.get(b"k"), fields.get(b"i"), fields.get(b"d")
    if raw_key is None or raw_ident is None or data is None:
        raise BadEntryError("missing field")
    try:
        key = check_key(json.loads(raw_key.decode("utf-8")))
        identity = check_identity(raw_ident.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # InvalidArgumentError, JSONDecodeError
        raise BadEntryError("bad key or identity") from e
    if key[0] != tenant:
        raise BadEntryError("key of another tenant")
    try:
        with SuffixTree(depth) as scratch:
            scratch.load(data)
            ids = scratch.sequence_ids()
            if len(ids) != 1:
                raise BadEntryError(f"{len(ids)} sequences, not 1")
            tokens = array.array("i", scratch.sequence(ids[0]))
    except AgentSpecError as e:  # ShardFormatError family, DepthMismatchError, ...
        raise BadEntryError(f"shard bytes refused: {type(e).__name__}") from e
    entry = FleetEntry.make(key, identity, tokens)
    if entry.seq_id != ids[0]:
        raise BadEntryError("sequence id is not the fleet id")
    if not tokens:
        raise BadEntryError("empty sequence")
    return entry
