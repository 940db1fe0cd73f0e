"""The on-disk layout of a `ShardStore` directory.

::

    <path>/LOCK                       exclusive fcntl.flock while a store is open
    <path>/shards/<name>/snapshot.json  bookkeeping (key, next seq id, version, order, ...)
    <path>/shards/<name>/snapshot.ashd  native snapshot of the shard's tree
    <path>/shards/<name>/journal.log    changes since the snapshot (`agentspec._store.journal`)
    <path>/corrupt/<name>.<timestamp>   quarantined shard directories

``<name>`` is `key_dir_name` of the key (hex of its UTF-8 JSON, or "h" and
the SHA-256 of that JSON when the hex would be too long for a file name;
``snapshot.json`` holds the key itself).  Files are created 0600 and
directories 0700.  A snapshot is written as temp files (``snapshot.json``
first), fsynced, and renamed in place: ``snapshot.ashd`` first (the commit
point of the content), then ``snapshot.json``, each rename followed by an
fsync of the directory; only then is the journal emptied.  Recovery
replays the journal idempotently, so every crash point gives the state of
the last acknowledged change:

- ``snapshot.json`` records the CRC of the snapshot it goes with and the
  size and CRC of the journal it covers; when the journal still starts
  with exactly those bytes (the crash came before it was emptied), they
  are skipped;
- when ``snapshot.ashd`` is newer than ``snapshot.json`` (crash between
  the two renames), the old bookkeeping plus the whole journal describe the
  new snapshot exactly.

Whole-directory changes go through renames of directories: a new shard
(whose snapshot holds its first sequence) is built as ``<name>.tmp-*`` and
renamed in; a replaced one is first moved to
``<name>.replaced-*`` (restored at open if the new one never arrived); a
dropped one is moved to ``<name>.dropped-*`` and deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentspec._core.shardkey import ShardKey, check_key, is_shard_dir_name, key_dir_name
from agentspec._store.journal import StoreCorruptError
from agentspec._util.log import get_logger
from agentspec.exceptions import InvalidArgumentError

__all__ = [
    "JOURNAL",
    "META",
    "SNAPSHOT",
    "SnapshotMeta",
    "create_shard_dir",
    "drop_shard_dir",
    "fsync_dir",
    "make_dir",
    "quarantine",
    "recover_shards_dir",
    "replace_shard_dir",
    "write_new_file",
    "write_snapshot",
]

SNAPSHOT = "snapshot.ashd"
META = "snapshot.json"
JOURNAL = "journal.log"
_FORMAT = 1

_log = get_logger()


# --- files and directories ---------------------------------------------------


def make_dir(path: Path) -> None:
    """Create a directory with mode 0700 (an existing one is left as it is)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not path.is_dir():
            raise
        return
    os.chmod(path, 0o700)


def fsync_dir(path: Path, enabled: bool = True) -> None:
    """fsync a directory, making the renames and creations in it durable."""
    if not enabled:
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: Path, data: bytes, fsync: bool) -> None:
    """Write a file (mode 0600, replacing any old one) and fsync it."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


# --- bookkeeping ---------------------------------------------------------------


@dataclass
class SnapshotMeta:
    """The content of ``snapshot.json``.

    Attributes:
        key: the shard key.
        max_depth: depth of the shard's tree.
        next_seq: the next sequence id `ShardStore.learn` hands out.
        version: the shard's version when the snapshot was taken.
        evicted: sequences evicted so far by the byte budget.
        order: ``(seq_id, stamp)`` of every sequence, oldest first.
        snapshot_crc32, snapshot_bytes: identify the ``snapshot.ashd`` it goes with.
        journal_bytes, journal_crc32: the journal content the snapshot covers.
        published: the fleet watermark: every sequence up to this id is settled
            (durably in the fleet log, or never to be published).
        outbox: ``(seq_id, identity)`` of the sequences above it still to be
            published (the journal's ADD_ID records hold those of its tail).
    """

    key: ShardKey
    max_depth: int
    next_seq: int
    version: int
    evicted: int
    order: list[tuple[int, int]]
    snapshot_crc32: int = 0
    snapshot_bytes: int = 0
    journal_bytes: int = 0
    journal_crc32: int = 0
    published: int = 0
    outbox: list[tuple[int, str]] = field(default_factory=list)

    def to_json(self) -> bytes:
        """The JSON file content."""
        doc = {
            "format": _FORMAT,
            "key": list(self.key),
            "max_depth": self.max_depth,
            "next_seq": self.next_seq,
            "version": self.version,
            "evicted": self.evicted,
            "snapshot_crc32": self.snapshot_crc32,
            "snapshot_bytes": self.snapshot_bytes,
            "journal_bytes": self.journal_bytes,
            "journal_crc32": self.journal_crc32,
            "order": [list(p) for p in self.order],
        }
        if self.published or self.outbox:  # absent for a store that never had a fleet
            doc["published"] = self.published
            doc["outbox"] = [list(p) for p in self.outbox]
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, where: str) -> SnapshotMeta:
        """Parse ``snapshot.json``.

        Raises:
            StoreCorruptError: not valid JSON of the expected shape.
        """
        try:
            doc = json.loads(data.decode("utf-8"))
            if doc["format"] != _FORMAT:
                raise ValueError(f"unknown format {doc['format']!r}")
            ints = {
                name: _int(doc[name])
                for name in (
                    "max_depth",
                    "next_seq",
                    "version",
                    "evicted",
                    "snapshot_crc32",
                    "snapshot_bytes",
                    "journal_bytes",
                    "journal_crc32",
                )
            }
            order = [(_int(p[0]), _int(p[1])) for p in doc["order"] if len(p) == 2]
            if len(order) != len(doc["order"]):
                raise ValueError("order entries must be [seq_id, stamp] pairs")
            key = check_key(tuple(doc["key"]))
            published = _int(doc.get("published", 0))
            outbox = [(_int(p[0]), _str(p[1])) for p in doc.get("outbox", ()) if len(p) == 2]
            if len(outbox) != len(doc.get("outbox", ())):
                raise ValueError("outbox entries must be [seq_id, identity] pairs")
        except (ValueError, KeyError, TypeError, IndexError, InvalidArgumentError) as e:
            raise StoreCorruptError(f"{where}: unreadable bookkeeping: {e}") from None
        return cls(key=key, order=order, published=published, outbox=outbox, **ints)


def _int(value: Any) -> int:
    """A JSON int (bools refused)."""
    if type(value) is not int:
        raise TypeError(f"expected an int, got {type(value).__name__}")
    return value


def _str(value: Any) -> str:
    """A non-empty JSON string."""
    if type(value) is not str or not value:
        raise TypeError(f"expected a non-empty str, got {type(value).__name__}")
    return value


# --- writing -------------------------------------------------------------------


def write_snapshot(
    d: Path, data: bytes, meta: SnapshotMeta, fsync: bool, journal_size: int, journal_crc: int
) -> None:
    """Write ``snapshot.json`` and ``snapshot.ashd`` atomically (see the module doc).

    The caller empties the journal afterwards.  ``meta`` gets the CRCs filled in.
    """
    meta.snapshot_crc32 = zlib.crc32(data)
    meta.snapshot_bytes = len(data)
    meta.journal_bytes = journal_size
    meta.journal_crc32 = journal_crc
    write_new_file(d / (META + ".tmp"), meta.to_json(), fsync)
    write_new_file(d / (SNAPSHOT + ".tmp"), data, fsync)
    os.replace(d / (SNAPSHOT + ".tmp"), d / SNAPSHOT)
    fsync_dir(d, fsync)
    os.replace(d / (META + ".tmp"), d / META)
    fsync_dir(d, fsync)


def _build_dir(shards: Path, data: bytes, meta: SnapshotMeta, fsync: bool) -> Path:
    """A complete shard directory under a temp name (empty journal)."""
    tmp = shards / f"{key_dir_name(meta.key)}.tmp-{secrets.token_hex(4)}"
    make_dir(tmp)
    try:
        meta.snapshot_crc32 = zlib.crc32(data)
        meta.snapshot_bytes = len(data)
        meta.journal_bytes = meta.journal_crc32 = 0
        write_new_file(tmp / META, meta.to_json(), fsync)
        write_new_file(tmp / SNAPSHOT, data, fsync)
        write_new_file(tmp / JOURNAL, b"", fsync)
        fsync_dir(tmp, fsync)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def create_shard_dir(shards: Path, data: bytes, meta: SnapshotMeta, fsync: bool) -> Path:
    """Create the directory of a new shard from snapshot bytes; returns its path.

    Raises only when the shard was not created.
    """
    final = shards / key_dir_name(meta.key)
    tmp = _build_dir(shards, data, meta, fsync)
    try:
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _after_commit(lambda: fsync_dir(shards, fsync), final)
    return final


def replace_shard_dir(shards: Path, data: bytes, meta: SnapshotMeta, fsync: bool) -> Path:
    """Replace a shard's directory by a new one holding ``data``.

    The rename of the new directory into place is the commit: this raises
    only when the old directory is still the shard.
    """
    final = shards / key_dir_name(meta.key)
    tmp = _build_dir(shards, data, meta, fsync)
    old = shards / f"{final.name}.replaced-{secrets.token_hex(4)}"
    try:
        os.rename(final, old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(old, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    def finish() -> None:
        fsync_dir(shards, fsync)
        shutil.rmtree(old)

    _after_commit(finish, final)
    return final


def drop_shard_dir(d: Path, fsync: bool) -> None:
    """Delete a shard's directory (the rename to ``*.dropped-*`` is the commit).

    Raises only when the shard was not dropped.
    """
    gone = d.with_name(f"{d.name}.dropped-{secrets.token_hex(4)}")
    os.rename(d, gone)

    def finish() -> None:
        fsync_dir(d.parent, fsync)
        shutil.rmtree(gone)

    _after_commit(finish, d)


def _after_commit(fn: Callable[[], None], path: Path) -> None:
    """Run clean-up after a committed change; failures are logged, not raised."""
    try:
        fn()
    except OSError as e:
        _log.error(
            "agentspec shard store: clean-up after a committed change failed",
            path=str(path),
            error=str(e),
        )


_OP_RE = re.compile(r"(?P<base>[0-9a-fh]+)\.(?P<op>tmp|replaced|dropped)-[0-9a-f]{8}")


def recover_shards_dir(shards: Path) -> list[Path]:
    """Finish or undo interrupted directory operations; return the shard directories."""
    entries = sorted(shards.iterdir())
    names = {p.name for p in entries}
    for p in entries:
        m = _OP_RE.fullmatch(p.name)
        if m is None or not is_shard_dir_name(m["base"]):
            continue
        base = m["base"]
        if m["op"] == "replaced" and base not in names:
            os.rename(p, shards / base)  # the replacement never arrived: undo
            names.add(base)
            _log.warning("agentspec shard store: restored a shard", path=str(shards / base))
        else:
            shutil.rmtree(p, ignore_errors=True)  # tmp, dropped, superseded replaced
    dirs = []
    for p in sorted(shards.iterdir()):
        if is_shard_dir_name(p.name) and p.is_dir():
            for leftover in (p / (META + ".tmp"), p / (SNAPSHOT + ".tmp")):
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
            dirs.append(p)
        elif _OP_RE.fullmatch(p.name) is None:
            _log.warning("agentspec shard store: ignoring unknown entry", path=str(p))
    return dirs


def quarantine(d: Path, corrupt_root: Path, reason: str) -> Path:
    """Move a damaged shard directory to ``<corrupt_root>/<name>.<timestamp>``."""
    make_dir(corrupt_root)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f".{time.time_ns() % 10**9:09d}"
    dest = corrupt_root / f"{d.name}.{stamp}"
    os.rename(d, dest)
    _log.error(
        "agentspec shard store: quarantined a corrupt shard",
        path=str(d),
        moved_to=str(dest),
        reason=reason,
    )
    return dest
