"""Conversation traces: agentspec's own trace format (JSON Lines, optionally gzip).

A trace file holds one JSON object per line, one line per session
(conversation), in replay order::

    {"workload": "<name>", "session": "<stable id>", "stage": "<default stage>",
     "messages": [{"role": "system"|"user"|"assistant", "content": "<text>",
                   "stage": "<optional>"}, ...],
     "meta": {...}}

Every assistant message is one LLM request: its prompt is all earlier messages
of the record, its response the message's content, and its stage the message's
own ``stage`` or else the record's.  Text is kept exactly (no trimming), and an
empty assistant message, a record without one or a repeated session id in a
file are errors, as is anything else off the schema; the reader never skips a
line silently.

- `read_traces` streams the records of a file (gzip or plain);
- `iter_requests` / `TraceRecord.requests` turn records into `TraceRequest`s;
- `write_traces` writes a whole file, `TraceWriter` appends records one at a
  time (thread-safe, each record flushed and, for ``.gz``, a complete gzip
  member), which suits recording live traffic.

Lines are written as ``json.dumps(record, ensure_ascii=False)`` with the keys
in schema order, so reading a file and writing it back reproduces it byte for
byte (after decompression).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol, TypeAlias

from agentspec._util.args import as_int
from agentspec.exceptions import InvalidArgumentError, TraceFormatError

__all__ = [
    "ROLES",
    "Message",
    "TraceFormatError",
    "TraceRecord",
    "TraceRequest",
    "TraceWriter",
    "iter_requests",
    "read_traces",
    "write_traces",
]

#: The message roles of the format.
ROLES: frozenset[str] = frozenset({"system", "user", "assistant"})

_RECORD_KEYS = ("workload", "session", "stage", "messages", "meta")
_MESSAGE_KEYS = frozenset({"role", "content", "stage"})
_GZIP_MAGIC = b"\x1f\x8b"

StrPath: TypeAlias = "str | os.PathLike[str]"


class _ByteSink(Protocol):
    """Anything with ``write(bytes)`` (a binary file, a ``GzipFile``)."""

    def write(self, data: bytes, /) -> int:
        """Write ``data``."""
        ...


@dataclass(frozen=True)
class Message:
    """One message of a conversation; ``stage`` overrides the record's stage."""

    role: str
    content: str
    stage: str | None = None

    def __post_init__(self) -> None:
        """Check the role and the field types."""
        if not isinstance(self.role, str) or self.role not in ROLES:
            raise TraceFormatError(f"role {self.role!r} is not one of {sorted(ROLES)}")
        if not isinstance(self.content, str):
            raise TraceFormatError(f"content must be a string, got {type(self.content).__name__}")
        if self.stage is not None and not isinstance(self.stage, str):
            raise TraceFormatError(
                f"stage must be a string when present, got {type(self.stage).__name__}"
            )

    def to_json(self) -> dict[str, str]:
        """The message as a JSON object (``stage`` only when set), keys in format order."""
        out = {"role": self.role, "content": self.content}
        if self.stage is not None:
            out["stage"] = self.stage
        return out


@dataclass(frozen=True)
class TraceRequest:
    """One LLM request of a trace: the prompt messages and the true response text.

    ``turn`` is the index of the assistant message in its record, so ``prompt``
    is ``record.messages[:turn]``.
    """

    workload: str
    session: str
    turn: int
    stage: str
    prompt: tuple[Message, ...]
    response: str


@dataclass(frozen=True)
class TraceRecord:
    """One session of a trace file.

    ``messages`` may be given as any sequence of `Message` and is stored as a
    tuple; at least one message must be a non-empty assistant message.
    ``meta`` is a small JSON object (string keys), kept with its key order;
    it takes part in ``==`` but not in ``hash()``.
    """

    workload: str
    session: str
    stage: str
    messages: tuple[Message, ...]
    meta: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        """Check field types and the assistant-message rules."""
        for name in ("workload", "session", "stage"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TraceFormatError(f"{name} must be a string, got {type(value).__name__}")
        given: object = self.messages
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise TraceFormatError(
                f"messages must be a sequence of Message, got {type(given).__name__}"
            )
        msgs = tuple(given)
        for i, m in enumerate(msgs):
            if not isinstance(m, Message):
                raise TraceFormatError(f"messages[{i}] is a {type(m).__name__}, not a Message")
            if m.role == "assistant" and not m.content:
                raise TraceFormatError(f"messages[{i}] is an empty assistant message")
        if not any(m.role == "assistant" for m in msgs):
            raise TraceFormatError("record has no assistant message")
        object.__setattr__(self, "messages", msgs)
        if not isinstance(self.meta, dict):
            raise TraceFormatError(f"meta must be a dict, got {type(self.meta).__name__}")
        for key in self.meta:
            if not isinstance(key, str):
                raise TraceFormatError(f"meta keys must be strings, got {key!r}")

    def requests(self) -> Iterator[TraceRequest]:
        """Yield one `TraceRequest` per assistant message, in order."""
        for i, m in enumerate(self.messages):
            if m.role == "assistant":
                stage = m.stage if m.stage is not None else self.stage
                yield TraceRequest(
                    self.workload, self.session, i, stage, self.messages[:i], m.content
                )

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object with keys in format order."""
        return {
            "workload": self.workload,
            "session": self.session,
            "stage": self.stage,
            "messages": [m.to_json() for m in self.messages],
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, obj: object) -> TraceRecord:
        """Build a record from a parsed JSON object, checking it against the format.

        Raises `TraceFormatError` naming the offending key or message.
        """
        if not isinstance(obj, dict):
            raise TraceFormatError(f"a record must be a JSON object, got {_json_type(obj)}")
        missing = [k for k in _RECORD_KEYS if k not in obj]
        if missing:
            raise TraceFormatError(f"record is missing key(s) {missing}")
        extra = sorted(k for k in obj if k not in _RECORD_KEYS)
        if extra:
            raise TraceFormatError(f"record has unknown key(s) {extra}")
        raw_msgs = obj["messages"]
        if not isinstance(raw_msgs, list):
            raise TraceFormatError(f"messages must be a JSON array, got {_json_type(raw_msgs)}")
        msgs: list[Message] = []
        for i, raw in enumerate(raw_msgs):
            if not isinstance(raw, dict):
                raise TraceFormatError(
                    f"messages[{i}] must be a JSON object, got {_json_type(raw)}"
                )
            bad = sorted(k for k in raw if k not in _MESSAGE_KEYS)
            if bad:
                raise TraceFormatError(f"messages[{i}] has unknown key(s) {bad}")
            for key in ("role", "content"):
                if key not in raw:
                    raise TraceFormatError(f"messages[{i}] is missing key {key!r}")
            try:
                msgs.append(Message(raw["role"], raw["content"], raw.get("stage")))
            except TraceFormatError as exc:
                raise TraceFormatError(f"messages[{i}]: {exc}") from None
        meta = obj["meta"]
        if not isinstance(meta, dict):
            raise TraceFormatError(f"meta must be a JSON object, got {_json_type(meta)}")
        return cls(obj["workload"], obj["session"], obj["stage"], tuple(msgs), meta)


def _json_type(value: object) -> str:
    """Name a parsed JSON value's type the way the format talks about it."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    for typ, name in names.items():
        if type(value) is typ:
            return name
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def _pairs_no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` that rejects a key given twice in one JSON object."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise TraceFormatError(f"duplicate key {key!r} in a JSON object")
        out[key] = value
    return out


def _is_gzip(path: Path) -> bool:
    """True if the file starts with the gzip magic bytes or is named ``*.gz``."""
    with open(path, "rb") as fh:
        head = fh.read(2)
    return head == _GZIP_MAGIC or (path.suffix == ".gz" and head != b"")


def read_traces(path: StrPath, *, max_sessions: int | None = None) -> Iterator[TraceRecord]:
    """Yield the records of a trace file in file order.

    The file is read as gzip if it starts with the gzip magic bytes or its name
    ends in ``.gz`` (concatenated gzip members, as `TraceWriter` appends them,
    are fine), else as plain UTF-8 text.  ``max_sessions`` stops after that many
    records (None: all).  Any malformed line -- bad JSON or UTF-8, an empty
    line, a record off the schema, a session id seen earlier in the file, a
    truncated gzip stream -- raises `TraceFormatError` whose message starts
    with ``file:line:`` when iteration reaches it (the records before it are
    delivered); nothing is skipped.  A missing file raises `FileNotFoundError`
    at once.
    """
    if max_sessions is not None:
        try:
            max_sessions = as_int(max_sessions, "max_sessions", 1)
        except (TypeError, InvalidArgumentError):  # this function's documented error
            raise InvalidArgumentError(
                f"max_sessions must be None or an int >= 1, got {max_sessions!r}"
            ) from None
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace file not found: {p}")
    return _read(p, max_sessions)


def _read(p: Path, max_sessions: int | None) -> Iterator[TraceRecord]:
    """The generator behind `read_traces` (arguments already checked)."""
    name = str(p)
    gz = _is_gzip(p)
    seen: dict[str, int] = {}
    lineno = 0
    raw: IO[bytes]
    with open(p, "rb") as raw:
        lines: Iterator[bytes] = iter(gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw)
        while max_sessions is None or len(seen) < max_sessions:
            try:
                line = next(lines)
            except StopIteration:
                return
            except (OSError, EOFError, zlib.error) as exc:
                if not gz:
                    raise
                raise TraceFormatError(
                    f"cannot decompress ({exc})", path=name, line=lineno + 1
                ) from None
            lineno += 1
            rec = _parse_line(line, name, lineno)
            first = seen.get(rec.session)
            if first is not None:
                raise TraceFormatError(
                    f"session {rec.session!r} was already used on line {first}",
                    path=name,
                    line=lineno,
                )
            seen[rec.session] = lineno
            yield rec


def _parse_line(line: bytes, name: str, lineno: int) -> TraceRecord:
    """Decode, parse and check one line of a trace file."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"invalid UTF-8 ({exc})", path=name, line=lineno) from None
    if not text.strip():
        raise TraceFormatError(
            "empty line (a trace file holds one JSON record per line)", path=name, line=lineno
        )
    try:
        obj = json.loads(text, object_pairs_hook=_pairs_no_duplicates)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"invalid JSON ({exc})", path=name, line=lineno) from None
    except TraceFormatError as exc:
        raise TraceFormatError(str(exc), path=name, line=lineno) from None
    try:
        return TraceRecord.from_json(obj)
    except TraceFormatError as exc:
        sess = obj.get("session") if isinstance(obj, dict) else None
        prefix = f"session {sess!r}: " if isinstance(sess, str) else ""
        raise TraceFormatError(f"{prefix}{exc}", path=name, line=lineno) from None


def iter_requests(records: Iterable[TraceRecord]) -> Iterator[TraceRequest]:
    """Yield the requests of ``records`` in replay order (record by record)."""
    for rec in records:
        yield from rec.requests()


def _encode_record(record: TraceRecord) -> bytes:
    """One JSON line (UTF-8, newline-terminated) for ``record``.

    Text is written unescaped (``ensure_ascii=False``); a string holding a lone
    surrogate, which UTF-8 cannot carry, falls back to ``\\uXXXX`` escapes.
    """
    if not isinstance(record, TraceRecord):
        raise TypeError(f"expected a TraceRecord, got {type(record).__name__}")
    obj = record.to_json()
    try:
        text = json.dumps(obj, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(f"session {record.session!r}: meta is not JSON ({exc})") from None
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(obj, ensure_ascii=True) + "\n").encode("ascii")


def write_traces(path: StrPath, records: Iterable[TraceRecord]) -> int:
    """Write ``records`` as a new trace file (replacing any), gzip if ``path`` ends in ``.gz``.

    The file is written next to its destination and renamed into place, so a
    failure never leaves a partial file at ``path``.  Session ids must be
    unique (`TraceFormatError` otherwise).  Returns the number of records.
    """
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as raw:
            if p.suffix == ".gz":
                with gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz:
                    n = _write_all(gz, records)
            else:
                n = _write_all(raw, records)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return n


def _write_all(out: _ByteSink, records: Iterable[TraceRecord]) -> int:
    """Write every record to ``out``, checking that session ids are unique."""
    seen: set[str] = set()
    for rec in records:
        data = _encode_record(rec)
        if rec.session in seen:
            raise TraceFormatError(f"session {rec.session!r} is written twice")
        seen.add(rec.session)
        out.write(data)
    return len(seen)


class TraceWriter:
    """Append trace records to a file, one flushed record at a time.

    ``with TraceWriter("traffic.jsonl.gz") as w: w.write(record)``.  The file
    is opened for appending (created if missing).  Each `write` is one
    ``write()`` of a whole line -- for a ``.gz`` path, a complete gzip member
    holding that line -- followed by a flush (and ``os.fsync`` when
    ``fsync=True``), so a crash loses at most the record being written and the
    file stays readable by `read_traces`.  `write` is thread-safe; a session id
    this writer has already written raises `TraceFormatError` (ids already in
    the file before it was opened are not checked).
    """

    def __init__(self, path: StrPath, *, fsync: bool = False) -> None:
        """Open ``path`` for appending; gzip members if it ends in ``.gz``."""
        self.path = Path(path)
        self._gzip = self.path.suffix == ".gz"
        self._fsync = bool(fsync)
        self._lock = threading.Lock()
        self._sessions: set[str] = set()
        self._fh: IO[bytes] | None = open(self.path, "ab")  # noqa: SIM115 (closed by close())
        self.records_written = 0

    def write(self, record: TraceRecord) -> None:
        """Append one record and flush it to the OS."""
        data = _encode_record(record)
        if self._gzip:
            data = gzip.compress(data, mtime=0)
        with self._lock:
            if self._fh is None:
                raise ValueError(f"TraceWriter for {self.path} is closed")
            if record.session in self._sessions:
                raise TraceFormatError(f"session {record.session!r} was already written")
            self._fh.write(data)
            self._fh.flush()
            if self._fsync:
                os.fsync(self._fh.fileno())
            self._sessions.add(record.session)
            self.records_written += 1

    @property
    def closed(self) -> bool:
        """True after `close`."""
        return self._fh is None

    def close(self) -> None:
        """Close the file; further writes raise `ValueError`.  Idempotent."""
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def __enter__(self) -> TraceWriter:
        """Return the writer itself."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the file."""
        self.close()

    def __repr__(self) -> str:
        """``TraceWriter('path', records_written=N)``."""
        state = " closed" if self.closed else ""
        return f"TraceWriter({str(self.path)!r}, records_written={self.records_written}{state})"
