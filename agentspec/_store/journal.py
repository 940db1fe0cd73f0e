"""The append-only journal of a shard: record framing, a writer and a reader.

Every change of a persisted shard is appended to its ``journal.log`` before
`ShardStore.learn` returns.  A record is::

    magic u32 | kind u8 | len u32 | crc32 u32 | payload (len bytes)

little-endian, the CRC-32 covering ``kind``, ``len`` and the payload.  Kinds:

- ``ADD``: seq id (i64, as 8 bytes) then the tokens as int32 (at least one);
- ``REMOVE``: seq id (i64);
- ``ADD_ID``: an ``ADD`` that also carries the request identity the fleet
  publishes it under: seq id (i64), identity length (u16), the identity
  (UTF-8, 1..1024 bytes), then the tokens as int32 (at least one);
- ``PUBLISHED``: the shard's published watermark (i64): every sequence of
  the shard up to that id is durably in the fleet log, or will never be
  published (see `agentspec._store.outbox`).  Written without fsync: losing
  one only means republishing, which the fleet ids make harmless.

A store without a fleet writes only ``ADD`` and ``REMOVE``, so its files
stay readable by versions that predate the other two kinds.

Records are written with one ``write`` each (a failed write is cut off
again), so after a crash only the *tail* can be incomplete: a partial or
bad-CRC record followed by nothing valid was never acknowledged and is
truncated on recovery.  A bad record followed by a valid one is corruption
(`StoreCorruptError`): the file was damaged after it was written.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from agentspec.exceptions import StoreCorruptError

__all__ = [
    "ADD",
    "ADD_ID",
    "PUBLISHED",
    "REMOVE",
    "JournalRecord",
    "JournalWriter",
    "ParsedJournal",
    "StoreCorruptError",
    "encode_add",
    "encode_add_id",
    "encode_published",
    "encode_remove",
    "parse_journal",
    "read_journal",
]

MAGIC = 0x4C4A5341  # b"ASJL" little-endian
ADD = 1
REMOVE = 2
ADD_ID = 3
PUBLISHED = 4

_HEADER = struct.Struct("<IBII")  # magic, kind, len, crc32
_KIND_LEN = struct.Struct("<BI")
_SEQ = struct.Struct("<q")
_SEQ_ID = struct.Struct("<qH")  # seq id, identity length
#: Longest identity a record holds, in UTF-8 bytes.
MAX_IDENTITY_BYTES = 1024
_MAGIC_BYTES = struct.pack("<I", MAGIC)
#: Largest payload a record may declare (a longer one is treated as damage).
MAX_PAYLOAD = 1 << 30


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """One decoded record.

    Attributes:
        kind: `ADD`, `REMOVE`, `ADD_ID` or `PUBLISHED`.
        seq_id: the sequence id (the watermark of a PUBLISHED record).
        tokens: the int32 tokens of an ADD / ADD_ID (raw little-endian bytes), else b"".
        end: offset just past this record in the file.
        identity: the request identity of an ADD_ID, else None.
    """

    kind: int
    seq_id: int
    tokens: bytes
    end: int
    identity: str | None = None

    def token_list(self) -> list[int]:
        """The tokens of an ADD record as ints."""
        return list(struct.unpack(f"<{len(self.tokens) // 4}i", self.tokens))


def _frame(kind: int, payload: bytes) -> bytes:
    """Frame a payload: header with magic, kind, length and CRC, then the payload."""
    crc = zlib.crc32(payload, zlib.crc32(_KIND_LEN.pack(kind, len(payload))))
    return _HEADER.pack(MAGIC, kind, len(payload), crc) + payload


def encode_add(seq_id: int, tokens_le: bytes) -> bytes:
    """An ADD record for ``seq_id`` with little-endian int32 token bytes."""
    if not tokens_le or len(tokens_le) % 4:
        raise ValueError("an ADD record needs a non-empty whole number of int32 tokens")
    return _frame(ADD, _SEQ.pack(seq_id) + tokens_le)


def encode_add_id(seq_id: int, identity: str, tokens_le: bytes) -> bytes:
    """An ADD_ID record: ``seq_id`` learned under request ``identity``."""
    ident = identity.encode("utf-8")
    if not 1 <= len(ident) <= MAX_IDENTITY_BYTES:
        raise ValueError(f"an identity needs 1..{MAX_IDENTITY_BYTES} UTF-8 bytes")
    if not tokens_le or len(tokens_le) % 4:
        raise ValueError("an ADD_ID record needs a non-empty whole number of int32 tokens")
    return _frame(ADD_ID, _SEQ_ID.pack(seq_id, len(ident)) + ident + tokens_le)


def encode_remove(seq_id: int) -> bytes:
    """A REMOVE record for ``seq_id``."""
    return _frame(REMOVE, _SEQ.pack(seq_id))


def encode_published(watermark: int) -> bytes:
    """A PUBLISHED record: every sequence up to ``watermark`` is settled in the fleet."""
    return _frame(PUBLISHED, _SEQ.pack(watermark))


def _decode_at(data: bytes, off: int) -> JournalRecord | None:
    """The record starting at ``off``, or None when it is incomplete or invalid."""
    if len(data) - off < _HEADER.size:
        return None
    magic, kind, length, crc = _HEADER.unpack_from(data, off)
    if magic != MAGIC or length > MAX_PAYLOAD:
        return None
    if kind == ADD:
        if length < _SEQ.size + 4 or (length - _SEQ.size) % 4:
            return None
    elif kind == ADD_ID:
        if length < _SEQ_ID.size + 1 + 4:
            return None
    elif kind not in (REMOVE, PUBLISHED) or length != _SEQ.size:
        return None
    start = off + _HEADER.size
    end = start + length
    if end > len(data):
        return None
    payload = data[start:end]
    if zlib.crc32(payload, zlib.crc32(_KIND_LEN.pack(kind, length))) != crc:
        return None
    if kind == ADD_ID:
        return _decode_add_id(payload, end)
    (seq_id,) = _SEQ.unpack_from(payload)
    return JournalRecord(kind, seq_id, payload[_SEQ.size :], end)


def _decode_add_id(payload: bytes, end: int) -> JournalRecord | None:
    """An ADD_ID record from its (CRC-checked) payload, or None when malformed."""
    seq_id, n = _SEQ_ID.unpack_from(payload)
    tokens = payload[_SEQ_ID.size + n :]
    if not 1 <= n <= MAX_IDENTITY_BYTES or not tokens or len(tokens) % 4:
        return None
    try:
        identity = payload[_SEQ_ID.size : _SEQ_ID.size + n].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return JournalRecord(ADD_ID, seq_id, tokens, end, identity)


def _valid_record_after(data: bytes, off: int) -> int | None:
    """Offset of a valid record starting after ``off``, or None."""
    pos = data.find(_MAGIC_BYTES, off + 1)
    while pos >= 0:
        if _decode_at(data, pos) is not None:
            return pos
        pos = data.find(_MAGIC_BYTES, pos + 1)
    return None


@dataclass(frozen=True, slots=True)
class ParsedJournal:
    """The valid records of a journal and where its valid part ends.

    Attributes:
        records: the records, in file order.
        good_size: bytes of valid records; anything after was a torn tail.
        file_size: size of the bytes parsed.
    """

    records: list[JournalRecord]
    good_size: int
    file_size: int

    @property
    def torn(self) -> bool:
        """Whether a torn tail follows the valid records."""
        return self.good_size < self.file_size


def parse_journal(data: bytes, name: str = "journal") -> ParsedJournal:
    """Decode journal bytes.

    Raises:
        StoreCorruptError: an invalid record is followed by a valid one.
    """
    records: list[JournalRecord] = []
    off = 0
    while off < len(data):
        rec = _decode_at(data, off)
        if rec is None:
            later = _valid_record_after(data, off)
            if later is not None:
                raise StoreCorruptError(
                    f"{name}: damaged record at offset {off} followed by a valid record "
                    f"at offset {later}"
                )
            break
        records.append(rec)
        off = rec.end
    return ParsedJournal(records, off, len(data))


def read_journal(path: Path) -> ParsedJournal:
    """Read and decode a journal file (a missing file is an empty journal).

    Raises:
        StoreCorruptError: damage in the middle of the file.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = b""
    return parse_journal(data, str(path))


class JournalWriter:
    """Appends records to a journal file opened with O_APPEND (mode 0600).

    The writer tracks the file's size, the CRC-32 of its whole content and
    its record count; a failed append is cut off again so the file never
    holds a partial record in its middle.  Not thread-safe: the store
    serialises calls.
    """

    def __init__(self, path: Path, *, size: int, crc: int, count: int, fsync: bool) -> None:
        """A writer for ``path``; ``size``/``crc``/``count`` describe its valid content.

        The file is opened (created if missing) at the first write, so an
        error to open it surfaces from `append` or `reset`.
        """
        self.path = path
        self.size = size
        self.crc = crc
        self.count = count
        self._fsync = fsync
        self._broken: OSError | None = None
        self._closed = False
        self._fd: int | None = None

    def _live_fd(self) -> int:
        """The open descriptor (opened on first use), refusing a closed or broken writer."""
        if self._closed:
            raise OSError(f"journal {self.path} is closed")
        if self._broken is not None:
            raise OSError(f"journal {self.path} failed earlier: {self._broken}")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return self._fd

    def append(self, records: bytes, n_records: int, *, sync: bool = True) -> None:
        """Append encoded records with one write; fsync if enabled and ``sync``.

        On failure the file is truncated back to its previous size and the
        error is raised: nothing of the records counts as written.
        """
        fd = self._live_fd()
        try:
            view = memoryview(records)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if sync and self._fsync:
                os.fdatasync(fd)
        except OSError:
            try:
                os.ftruncate(fd, self.size)
            except OSError as e:  # cannot restore a clean tail: refuse further appends
                self._broken = e
            raise
        self.size += len(records)
        self.crc = zlib.crc32(records, self.crc)
        self.count += n_records

    def sync(self) -> None:
        """fsync the file (when fsync is enabled and it was written)."""
        if self._fsync and self._fd is not None:
            os.fdatasync(self._live_fd())

    def reset(self) -> None:
        """Empty the journal (after its content went into a durable snapshot)."""
        fd = self._live_fd()
        os.ftruncate(fd, 0)
        if self._fsync:
            os.fsync(fd)
        self.size = 0
        self.crc = 0
        self.count = 0

    def close(self) -> None:
        """Close the file (closing twice is allowed)."""
        self._closed = True
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
