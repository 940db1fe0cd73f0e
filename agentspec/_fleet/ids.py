"""Fleet-wide sequence ids and Redis stream ids.

A learned sequence gets the same id on every replica and from every
publisher: the first 63 bits of a BLAKE2b digest (personalised
``agentspec.seq.v1``) of the length-prefixed shard key JSON, the
length-prefixed request identity (UTF-8) and the tokens (int32
little-endian).  When the client side and the worker side both publish one
response under the same identity, both entries carry the same id, and the
second one is a duplicate that every replica skips at the same stream
position (see docs/fleet.md for why this is sound).

Stream ids (``<ms>-<seq>``) are handled as ``(ms, seq)`` tuples, which
compare in stream order.
"""

from __future__ import annotations

import hashlib
import struct

from agentspec._core.shardkey import ShardKey, key_json
from agentspec._core.tokens import int32_le
from agentspec.protocol import MAX_IDENTITY, check_identity

__all__ = [
    "MAX_IDENTITY",
    "ZERO",
    "StreamId",
    "check_identity",
    "fleet_seq_id",
    "format_id",
    "parse_id",
]

#: A stream id as ``(milliseconds, sequence)``.
StreamId = tuple[int, int]

#: The id before every entry (``0-0``).
ZERO: StreamId = (0, 0)

_PERSON = b"agentspec.seq.v1"
_LEN = struct.Struct("<I")


def fleet_seq_id(key: ShardKey, identity: str, tokens: memoryview | bytes) -> int:
    """The fleet id of a sequence: 63 bits of BLAKE2b over (key, identity, tokens).

    ``tokens`` is a native int32 buffer (e.g. an ``array('i')``'s bytes).
    """
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    k = key_json(key)
    ident = identity.encode("utf-8")
    h.update(_LEN.pack(len(k)))
    h.update(k)
    h.update(_LEN.pack(len(ident)))
    h.update(ident)
    h.update(int32_le(tokens))
    return int.from_bytes(h.digest(), "big") >> 1


def parse_id(raw: bytes | str) -> StreamId:
    """``b"1700000000000-3"`` -> ``(1700000000000, 3)``.

    Raises:
        ValueError: not a complete stream id.
    """
    text = raw.decode("ascii") if isinstance(raw, bytes) else raw
    ms, sep, seq = text.partition("-")
    if not sep or not ms.isdigit() or not seq.isdigit():
        raise ValueError(f"not a stream id: {text[:40]!r}")
    return int(ms), int(seq)


def format_id(sid: StreamId) -> str:
    """``(ms, seq)`` -> ``"ms-seq"``."""
    return f"{sid[0]}-{sid[1]}"
