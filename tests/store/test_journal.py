"""The journal format: framing, CRC, torn tails versus damage in the middle."""

from __future__ import annotations

import array
import os
import stat
import struct
import zlib
from pathlib import Path

import pytest

from agentspec._core.tokens import int32_le
from agentspec._store.journal import (
    ADD,
    REMOVE,
    JournalWriter,
    StoreCorruptError,
    encode_add,
    encode_remove,
    parse_journal,
    read_journal,
)
from agentspec.exceptions import AgentSpecError


def toks(*values: int) -> bytes:
    return int32_le(array.array("i", values).tobytes())


def sample() -> list[bytes]:
    return [
        encode_add(1, toks(5, 6, 7)),
        encode_add(2, toks(2**31 - 1)),
        encode_remove(1),
        encode_add(-3, toks(0, 1)),
    ]


def test_round_trip():
    recs = sample()
    parsed = parse_journal(b"".join(recs))
    assert [(r.kind, r.seq_id, r.token_list()) for r in parsed.records] == [
        (ADD, 1, [5, 6, 7]),
        (ADD, 2, [2**31 - 1]),
        (REMOVE, 1, []),
        (ADD, -3, [0, 1]),
    ]
    assert parsed.good_size == parsed.file_size == sum(map(len, recs))
    assert not parsed.torn
    assert [r.end for r in parsed.records] == [
        sum(map(len, recs[: i + 1])) for i in range(len(recs))
    ]


def test_framing_fields():
    rec = encode_remove(7)
    magic, kind, length, crc = struct.unpack_from("<IBII", rec)
    assert kind == REMOVE
    assert length == 8
    assert rec[13:] == struct.pack("<q", 7)
    assert crc == zlib.crc32(rec[13:], zlib.crc32(struct.pack("<BI", kind, length)))
    assert struct.pack("<I", magic) == b"ASJL"


def test_empty_add_refused():
    with pytest.raises(ValueError, match="non-empty"):
        encode_add(1, b"")
    with pytest.raises(ValueError, match="int32"):
        encode_add(1, b"\x01\x02\x03")


def test_every_cut_of_the_last_record_is_a_torn_tail():
    recs = sample()
    head = b"".join(recs[:-1])
    last = recs[-1]
    for cut in range(len(last)):
        parsed = parse_journal(head + last[:cut])
        assert len(parsed.records) == 3
        assert parsed.good_size == len(head)
        assert parsed.torn == (cut > 0)


@pytest.mark.parametrize("tail", [b"\x00" * 100, b"\xff" * 7, b"ASJL"])
def test_garbage_tail_is_torn(tail):
    data = b"".join(sample())
    parsed = parse_journal(data + tail)
    assert len(parsed.records) == 4
    assert parsed.good_size == len(data)
    assert parsed.torn


def test_bad_crc_in_last_record_is_torn():
    recs = sample()
    last = bytearray(recs[-1])
    last[-1] ^= 0x40
    parsed = parse_journal(b"".join(recs[:-1]) + bytes(last))
    assert len(parsed.records) == 3
    assert parsed.torn


@pytest.mark.parametrize("offset", [0, 4, 6, 13, 20])
def test_damage_in_the_middle_is_corruption(offset):
    recs = sample()
    second = bytearray(recs[1])
    second[offset] ^= 0x01
    data = recs[0] + bytes(second) + b"".join(recs[2:])
    with pytest.raises(StoreCorruptError, match="offset") as info:
        parse_journal(data, "j")
    assert isinstance(info.value, AgentSpecError)
    assert isinstance(info.value, ValueError)


def test_writer_appends_tracks_and_resets(tmp_path):
    path = tmp_path / "journal.log"
    w = JournalWriter(path, size=0, crc=0, count=0, fsync=True)
    try:
        recs = sample()
        w.append(recs[0], 1)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        w.append(b"".join(recs[1:]), 3, sync=False)
        w.sync()
        data = path.read_bytes()
        assert data == b"".join(recs)
        assert (w.size, w.crc, w.count) == (len(data), zlib.crc32(data), 4)
        assert len(read_journal(path).records) == 4
        w.reset()
        assert path.read_bytes() == b""
        assert (w.size, w.crc, w.count) == (0, 0, 0)
        w.append(encode_remove(9), 1)
        assert [r.seq_id for r in read_journal(path).records] == [9]
    finally:
        w.close()
        w.close()
    with pytest.raises(OSError, match="closed"):
        w.append(encode_remove(1), 1)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_failed_append_counts_nothing_and_blocks_later_appends():
    w = JournalWriter(Path("/dev/full"), size=0, crc=0, count=0, fsync=False)
    try:
        with pytest.raises(OSError, match="No space"):
            w.append(encode_remove(1), 1)
        assert (w.size, w.crc, w.count) == (0, 0, 0)
        # /dev/full cannot be truncated back: the writer refuses to go on.
        with pytest.raises(OSError, match="failed earlier"):
            w.append(encode_remove(2), 1)
    finally:
        w.close()


def test_missing_file_is_empty(tmp_path):
    parsed = read_journal(tmp_path / "nope.log")
    assert parsed.records == []
    assert parsed.good_size == 0
