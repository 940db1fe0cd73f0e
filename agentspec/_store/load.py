"""Recovery of a `ShardStore` directory: every shard from its snapshot and journal tail.

The rules are in `agentspec._store.files`: the journal is replayed
idempotently on top of the snapshot, skipping the records the snapshot's
bookkeeping says it already covers; damaged shards are quarantined.

`read_shards` is the read-only variant, safe while a writer holds the
directory: it changes no file (a torn journal tail is ignored, not cut),
replays only complete, checksummed records, and reads each shard's files
again when a compaction replaced its bookkeeping meanwhile.
"""

from __future__ import annotations

import array
import os
import re
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from agentspec._core.shardkey import ShardKey, is_shard_dir_name, key_dir_name
from agentspec._core.tree import SuffixTree
from agentspec._store.files import (
    JOURNAL,
    META,
    SNAPSHOT,
    SnapshotMeta,
    make_dir,
    quarantine,
    recover_shards_dir,
    write_new_file,
)
from agentspec._store.journal import (
    ADD,
    ADD_ID,
    PUBLISHED,
    REMOVE,
    JournalRecord,
    JournalWriter,
    StoreCorruptError,
    parse_journal,
)
from agentspec._store.outbox import ShardOutbox
from agentspec._store.shard import Shard
from agentspec._util.log import get_logger
from agentspec.exceptions import AgentSpecError, ShardFormatError

__all__ = ["LoadedShard", "load_shard_dir", "open_shards", "read_shards"]

_log = get_logger()


@dataclass
class LoadedShard:
    """A shard recovered from its directory.

    Attributes:
        key, tree, next_seq, evicted: the shard's state.
        version: the version of its bookkeeping, before the replayed records.
        order: seq_id -> stamp, oldest first; stamp 0 marks sequences whose
            stamp the store assigns (journal tail, reconciled ones).
        replayed: journal records applied on top of the snapshot.
        journal_size, journal_crc, journal_count: the valid journal content.
        needs_compaction: the files were repaired or are out of step.
        published: the fleet watermark (bookkeeping and PUBLISHED records).
        pending: identities of the sequences learned with a fleet (bookkeeping
            and ADD_ID records); those above the watermark and still in the
            tree are the outbox.
    """

    key: ShardKey
    tree: SuffixTree
    next_seq: int
    version: int
    evicted: int
    order: dict[int, int] = field(default_factory=dict)
    replayed: int = 0
    journal_size: int = 0
    journal_crc: int = 0
    journal_count: int = 0
    needs_compaction: bool = False
    published: int = 0
    pending: dict[int, str] = field(default_factory=dict)


def _read(path: Path) -> bytes:
    """A file's bytes; a missing file is corruption of the shard."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise StoreCorruptError(f"{path}: missing") from None


def load_shard_dir(d: Path, fsync: bool) -> LoadedShard:
    """Recover one shard directory: snapshot + bookkeeping + journal tail.

    A torn journal tail is truncated (and the file fsynced).

    Raises:
        StoreCorruptError: unreadable bookkeeping or snapshot, a damaged
        journal record before valid ones, or a journal record the tree refuses.
    """
    meta = SnapshotMeta.from_json(_read(d / META), str(d / META))
    if key_dir_name(meta.key) != d.name:
        raise StoreCorruptError(f"{d}: the directory name does not match the key {meta.key!r}")
    snap = _read(d / SNAPSHOT)
    try:
        tree = SuffixTree.from_bytes(snap)
    except ShardFormatError as e:
        raise StoreCorruptError(f"{d / SNAPSHOT}: unreadable snapshot: {e}") from None
    try:
        return _recover(d, meta, snap, tree, fsync)
    except BaseException:
        tree.close()
        raise


def _recover(
    d: Path,
    meta: SnapshotMeta,
    snap: bytes,
    tree: SuffixTree,
    fsync: bool,
    journal: bytes | None = None,
) -> LoadedShard:
    """Replay the journal of ``d`` onto ``tree`` (see the module doc).

    With ``journal`` (the journal's bytes, read by `read_shards`) nothing is
    written: a missing journal is not created, a torn tail is not cut.
    """
    if tree.max_depth != meta.max_depth:
        raise StoreCorruptError(f"{d}: snapshot depth differs from its bookkeeping")
    matches = zlib.crc32(snap) == meta.snapshot_crc32 and len(snap) == meta.snapshot_bytes
    jpath = d / JOURNAL
    readonly = journal is not None
    if journal is not None:
        data = journal
    else:
        try:
            data = jpath.read_bytes()
        except FileNotFoundError:
            data = b""
            write_new_file(jpath, b"", fsync)
    parsed = parse_journal(data, str(jpath))
    if parsed.torn and not readonly:
        _log.warning(
            "agentspec shard store: truncating torn journal tail",
            path=str(jpath),
            valid_bytes=parsed.good_size,
            file_bytes=parsed.file_size,
        )
        os.truncate(jpath, parsed.good_size)
        if fsync:
            fd = os.open(jpath, os.O_WRONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    skip = 0
    covered = meta.journal_bytes
    if (
        matches
        and covered <= parsed.good_size
        and zlib.crc32(data[:covered]) == meta.journal_crc32
        and (covered == 0 or any(r.end == covered for r in parsed.records))
    ):
        skip = covered
    shard = LoadedShard(
        key=meta.key,
        tree=tree,
        next_seq=meta.next_seq,
        version=meta.version,
        evicted=meta.evicted,
        order=dict(meta.order),
        journal_size=parsed.good_size,
        journal_crc=zlib.crc32(data[: parsed.good_size]),
        journal_count=len(parsed.records),
        needs_compaction=parsed.torn or not matches or skip > 0,
        published=meta.published,
        pending=dict(meta.outbox),
    )
    for rec in parsed.records:
        if rec.end > skip:
            _apply(shard, rec, str(jpath))
    ids = tree.sequence_ids()
    present = set(ids)
    shard.pending = {
        sid: ident
        for sid, ident in shard.pending.items()
        if sid > shard.published and sid in present
    }
    order = {sid: stamp for sid, stamp in shard.order.items() if sid in present}
    for sid in ids:
        order.setdefault(sid, 0)
    shard.order = order
    if ids:
        shard.next_seq = max(shard.next_seq, max(ids) + 1)
    return shard


def _apply(shard: LoadedShard, rec: JournalRecord, where: str) -> None:
    """Apply one journal record idempotently to a loaded shard."""
    tree, kind, seq_id, tokens = shard.tree, rec.kind, rec.seq_id, rec.tokens
    if kind == PUBLISHED:
        shard.published = max(shard.published, seq_id)
        return  # not a change of the tree
    if kind == ADD_ID and rec.identity is not None:
        shard.pending[seq_id] = rec.identity
    if kind in (ADD, ADD_ID):
        if seq_id not in tree:
            arr = array.array("i")
            arr.frombytes(tokens)
            if sys.byteorder != "little":
                arr.byteswap()
            try:
                tree.add(seq_id, arr)
            except AgentSpecError as e:
                raise StoreCorruptError(f"{where}: record of sequence {seq_id}: {e}") from None
        shard.order.setdefault(seq_id, 0)
        shard.next_seq = max(shard.next_seq, seq_id + 1)
    elif kind == REMOVE:
        if seq_id in tree:
            tree.remove(seq_id)
        if shard.order.pop(seq_id, None) is not None:
            shard.evicted += 1
    shard.replayed += 1


def open_shards(root: Path, fsync: bool) -> tuple[dict[ShardKey, Shard], int, list[Path]]:
    """Recover every shard under ``<root>/shards`` (quarantining damaged ones).

    Returns the shards, the store-wide version counter to continue from,
    and the quarantined directories.  Sequences from journal tails get
    stamps after every snapshotted one, shard by shard.
    """
    shards_dir = root / "shards"
    make_dir(shards_dir)
    loaded: list[tuple[Path, LoadedShard]] = []
    quarantined: list[Path] = []
    for d in recover_shards_dir(shards_dir):
        try:
            loaded.append((d, load_shard_dir(d, fsync)))
        except StoreCorruptError as e:
            quarantined.append(quarantine(d, root / "corrupt", str(e)))
    shards, clock = _assemble(loaded, fsync, writable=True)
    return shards, clock, quarantined


def _assemble(
    loaded: list[tuple[Path, LoadedShard]], fsync: bool, *, writable: bool
) -> tuple[dict[ShardKey, Shard], int]:
    """The shards of recovered directories (with journal writers when ``writable``)."""
    shards: dict[ShardKey, Shard] = {}
    try:
        clock = max((max([ls.version, *ls.order.values()]) for _, ls in loaded), default=0)
        for d, ls in loaded:
            for sid, stamp in ls.order.items():
                if stamp == 0:
                    clock += 1
                    ls.order[sid] = clock
            version = ls.version
            if ls.replayed:
                clock += 1
                version = clock
            journal = None
            if writable:
                journal = JournalWriter(
                    d / JOURNAL,
                    size=ls.journal_size,
                    crc=ls.journal_crc,
                    count=ls.journal_count,
                    fsync=fsync,
                )
            shard = Shard(
                ls.key,
                ls.tree,
                next_seq=ls.next_seq,
                version=version,
                evicted=ls.evicted,
                order=ls.order,
                directory=d,
                journal=journal,
                outbox=ShardOutbox(ls.published, ls.pending.items()),
            )
            shard.dirty = ls.needs_compaction
            shards[ls.key] = shard
    except BaseException:
        for shard in shards.values():
            if shard.journal is not None:
                shard.journal.close()
        raise
    return shards, clock


# --- read-only ---------------------------------------------------------------

#: How often `read_shards` reads a shard's files again when a writer changed them meanwhile.
_READ_ATTEMPTS = 100

_REPLACED_RE = re.compile(r"(?P<base>[0-9a-fh]+)\.replaced-[0-9a-f]{8}")


def read_shards(root: Path) -> tuple[dict[ShardKey, Shard], int, list[Path]]:
    """Every shard under ``<root>/shards`` as of now, changing nothing on disk.

    Safe while a writer holds the directory: each shard is its snapshot plus
    the complete, checksummed records of its journal (a torn tail, which the
    writer has not acknowledged, is ignored).  A shard whose bookkeeping a
    compaction replaced while its files were read is read again; a shard
    whose directory is being replaced is read from the old one.  Damaged
    shards are skipped, logged and returned (they are not moved).

    Raises:
        FileNotFoundError: ``root`` holds no ``shards`` directory.
    """
    shards_dir = root / "shards"
    if not shards_dir.is_dir():
        raise FileNotFoundError(f"no shard store at {root}")
    loaded: list[tuple[Path, LoadedShard]] = []
    damaged: list[Path] = []
    for d in _shard_dirs(shards_dir):
        try:
            ls = _read_shard_dir(d)
        except StoreCorruptError as e:
            _log.warning(
                "agentspec shard store: skipping a damaged shard", path=str(d), error=str(e)
            )
            damaged.append(d)
            continue
        if ls is not None:
            loaded.append((d, ls))
    shards, clock = _assemble(loaded, False, writable=False)
    return shards, clock, damaged


def _shard_dirs(shards_dir: Path) -> list[Path]:
    """The shard directories, and the old one of a shard whose replacement is in flight."""
    names = {p.name for p in shards_dir.iterdir()}
    dirs = [shards_dir / n for n in sorted(names) if is_shard_dir_name(n)]
    for n in sorted(names):
        m = _REPLACED_RE.fullmatch(n)
        if m is not None and is_shard_dir_name(m["base"]) and m["base"] not in names:
            names.add(m["base"])
            dirs.append(shards_dir / n)
    return [d for d in dirs if d.is_dir()]


def _read_files(d: Path) -> tuple[bytes, bytes, bytes]:
    """``snapshot.json``, ``snapshot.ashd`` and the journal, read while no compaction ran.

    Raises:
        FileNotFoundError: the directory (or a file) is gone.
        StoreCorruptError: its bookkeeping kept changing while it was read.
    """
    for _ in range(_READ_ATTEMPTS):
        before = os.stat(d / META).st_ino
        meta = (d / META).read_bytes()
        snap = (d / SNAPSHOT).read_bytes()
        try:
            journal = (d / JOURNAL).read_bytes()
        except FileNotFoundError:
            journal = b""
        # A compaction renames new bookkeeping in before it empties the journal:
        # the same file after the journal was read means the three belong together.
        if os.stat(d / META).st_ino == before and (d / META).read_bytes() == meta:
            return meta, snap, journal
        time.sleep(0.001)
    raise StoreCorruptError(f"{d}: its files kept changing while they were read")


def _read_shard_dir(d: Path) -> LoadedShard | None:
    """One shard read without changing anything (None: it was dropped meanwhile)."""
    for _ in range(_READ_ATTEMPTS):
        try:
            meta_bytes, snap, journal = _read_files(d)
            break
        except FileNotFoundError:
            base = d.with_name(_REPLACED_RE.sub(r"\g<base>", d.name))
            if base != d and base.exists():
                d = base  # the replacement arrived and the old directory went
            elif not d.exists() and not any(d.parent.glob(f"{d.name}.replaced-*")):
                return None  # dropped
            time.sleep(0.001)  # between the two renames of a replacement
    else:
        return None
    meta = SnapshotMeta.from_json(meta_bytes, str(d / META))
    if key_dir_name(meta.key) != _REPLACED_RE.sub(r"\g<base>", d.name):
        raise StoreCorruptError(f"{d}: the directory name does not match the key {meta.key!r}")
    try:
        tree = SuffixTree.from_bytes(snap)
    except ShardFormatError as e:
        raise StoreCorruptError(f"{d / SNAPSHOT}: unreadable snapshot: {e}") from None
    try:
        return _recover(d, meta, snap, tree, False, journal)
    except BaseException:
        tree.close()
        raise
