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
before skipping the entry; no other exception escapes, whatever the bytes.

Parsing is bounded before any parser runs: the key field is at most
`MAX_KEY_BYTES` and must have the shape of a flat JSON array (one ``[``
outside strings, no ``{``), so no crafted key can make the JSON decoder
recurse; the identity is at most `MAX_IDENTITY_BYTES`.  A removal list in
the shard bytes is ignored: replicas evict on their own, in stream order
(see `_fleet_shard`).
"""

from __future__ import annotations

import array
import json
from collections.abc import Mapping
from dataclasses import dataclass

from agentspec._core.shardkey import ShardKey, check_key, key_json
from agentspec._core.tree import SuffixTree
from agentspec._fleet.ids import MAX_IDENTITY, check_identity, fleet_seq_id
from agentspec.exceptions import AgentSpecError

__all__ = [
    "EVICTION",
    "FORMAT",
    "MAX_ENTRY_BYTES",
    "MAX_IDENTITY_BYTES",
    "MAX_KEY_BYTES",
    "BadEntryError",
    "FleetEntry",
    "decode_entry",
    "decode_eviction",
    "eviction_fields",
    "parse_key_json",
]

#: The entry format version (field ``v``).
FORMAT = b"1"

#: The ``v`` of an eviction entry (fields ``v``, ``k``): every replica drops shard ``k``.
EVICTION = b"x"

#: Default bound on an entry's size (all field names and values), in bytes.
MAX_ENTRY_BYTES = 4 << 20

#: Largest key field: three components of at most 128 characters (4 bytes
#: each in UTF-8, 6 when JSON escapes them) plus the brackets and separators.
MAX_KEY_BYTES = 3 * 128 * 6 + 64

#: Largest identity field (`MAX_IDENTITY` characters of UTF-8).
MAX_IDENTITY_BYTES = 4 * MAX_IDENTITY


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


def _flat_array(raw: bytes) -> bool:
    """Whether ``raw`` opens one JSON array and nests nothing (brackets inside strings aside)."""
    if not raw.startswith(b"["):
        return False
    depth = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > 1:
                return False
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return True


def parse_key_json(raw: bytes) -> ShardKey:
    """A shard key from its JSON (an entry's ``k``, a snapshot's ``key``), bounded.

    Raises:
        ValueError: over `MAX_KEY_BYTES`, not a flat JSON array, not UTF-8,
            or not a valid key (`InvalidArgumentError` is a ValueError).
    """
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError("key JSON too long")
    if not _flat_array(raw):
        raise ValueError("key JSON is not a flat array")
    return check_key(json.loads(raw.decode("utf-8")))


def eviction_fields(key: ShardKey) -> dict[bytes, bytes]:
    """The stream fields of an eviction entry of ``key``."""
    return {b"v": EVICTION, b"k": key_json(key)}


def decode_eviction(fields: Mapping[bytes, bytes], tenant: str) -> ShardKey:
    """The shard key of an eviction entry of ``tenant``'s stream.

    Raises:
        BadEntryError: not a valid eviction entry of this tenant.
    """
    if set(fields) != {b"v", b"k"} or fields[b"v"] != EVICTION:
        raise BadEntryError("not an eviction entry")
    try:
        key = parse_key_json(fields[b"k"])
    except ValueError as e:
        raise BadEntryError("bad key") from e
    if key[0] != tenant:
        raise BadEntryError("key of another tenant")
    return key


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
    if len(raw_ident) > MAX_IDENTITY_BYTES:
        raise BadEntryError("identity too long")
    try:
        key = parse_key_json(raw_key)
        identity = check_identity(raw_ident.decode("utf-8"))
    except ValueError as e:  # InvalidArgumentError, JSONDecodeError, UnicodeDecodeError
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
    except BadEntryError:
        raise
    except (AgentSpecError, ValueError, TypeError) as e:  # ShardFormatError family, ...
        raise BadEntryError(f"shard bytes refused: {type(e).__name__}") from e
    entry = FleetEntry.make(key, identity, tokens)
    if entry.seq_id != ids[0]:
        raise BadEntryError("sequence id is not the fleet id")
    if not tokens:
        raise BadEntryError("empty sequence")
    return entry
