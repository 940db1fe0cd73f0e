"""`ShardStore`: learned shards in memory, optionally persisted to a directory.

A shard is one `SuffixTree` per key ``(tenant, pipeline, stage)``.  The
client learns finished responses into it; the pusher reads snapshots and
deltas from it.  With a path, every change is journaled before it is
acknowledged and snapshots are written atomically (`agentspec._store.files`
describes the layout and the recovery rules).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Literal

from agentspec._core import lowlevel
from agentspec._core.draft import check_max_depth
from agentspec._core.shardkey import ShardKey, check_key
from agentspec._core.tokens import TokenArray, as_int32_buffer, int32_le
from agentspec._core.tree import SuffixTree
from agentspec._fleet.ids import check_identity
from agentspec._store.files import (
    drop_shard_dir,
    make_dir,
)
from agentspec._store.importer import imported_shard
from agentspec._store.journal import (
    ADD,
    StoreCorruptError,
    encode_add,
    encode_add_id,
)
from agentspec._store.load import open_shards, read_shards
from agentspec._store.lock import DirLock, StoreLockedError
from agentspec._store.outbox_source import StoreOutboxSource
from agentspec._store.shard import Shard, ShardStats, oldest_shard
from agentspec._util import live_metrics
from agentspec._util.args import as_int
from agentspec._util.log import get_logger
from agentspec.exceptions import (
    CapacityError,
    InvalidArgumentError,
    ShardNotFoundError,
    StoreReadOnlyError,
    TreeClosedError,
)
from agentspec.metrics import (
    FLEET_PUBLISHED_TOTAL,
    SHARD_BUDGET_BYTES,
    SHARD_BYTES,
    SHARD_EVICTIONS_TOTAL,
    SHARD_TOKENS,
    SHARDS,
    key_labels,
)

__all__ = [
    "ShardKey",
    "ShardNotFoundError",
    "ShardStats",
    "ShardStore",
    "StoreCorruptError",
    "StoreLockedError",
    "StoreReadOnlyError",
    "check_key",
]

if TYPE_CHECKING:
    from agentspec._store.fleet_outbox import FleetOptions, FleetOutbox

_log = get_logger()

Listener = Callable[[ShardKey, int], None]


#: The environment variable a `ShardStore` reads its Redis URL from by default.
REDIS_URL_ENV = "AGENTSPEC_REDIS_URL"


def fleet_options(redis: object) -> FleetOptions | None:
    """The store's ``redis=`` argument as options (None: no fleet).

    None reads ``AGENTSPEC_REDIS_URL``, else the file named by
    ``AGENTSPEC_REDIS_URL_FILE`` (both unset or empty: no fleet); False means
    no fleet whatever the environment says.

    Raises:
        InvalidArgumentError: anything else than a URL, `FleetOptions`, None or False,
            or the ``redis`` package is missing (``pip install agentspec[fleet]``), or
            the environment names an unusable URL file.
    """
    if redis is False:
        return None
    if redis is None:
        from agentspec._util.secrets_source import resolve

        resolved = resolve()  # the URL, or its file; RedisUrlError for a bad one
        if resolved is None:
            return None
        redis = resolved.url
    try:
        from agentspec._store.fleet_outbox import FleetOptions
    except ImportError as e:
        raise InvalidArgumentError(
            "ShardStore(redis=...) needs the redis package: pip install 'agentspec[fleet]'",
            str(e),
        ) from None
    if isinstance(redis, str):
        return FleetOptions(redis)
    if isinstance(redis, FleetOptions):
        return redis
    raise InvalidArgumentError(
        "redis must be a Redis URL, FleetOptions, None or False", f"got {type(redis).__name__}"
    )


def start_outbox(
    options: FleetOptions, lock: threading.Lock, shards: dict[ShardKey, Shard]
) -> tuple[FleetOutbox, StoreOutboxSource]:
    """The outbox thread of a store, already told about the pending sequences of its files."""
    from agentspec._store.fleet_outbox import FleetOutbox

    source = StoreOutboxSource(lock, shards)
    with lock:
        source.wake_all()
    return FleetOutbox(options, source), source


class ShardStore:
    """Shards (one `SuffixTree` per ``(tenant, pipeline, stage)`` key), persisted when asked.

    With ``path`` None the store lives in memory only.  With a path, the
    store recovers the directory's shards (last snapshot + journal tail),
    takes the directory lock (``<path>/LOCK``, `StoreLockedError` when
    another store holds it for ``lock_timeout`` seconds) and journals every
    change before acknowledging it: an id returned by `learn` survives
    SIGKILL (and, with ``fsync``, power loss).  Corrupt shard directories
    are moved to ``<path>/corrupt/`` and listed in `quarantined`; the rest
    loads.  Files are created 0600, directories 0700.

    Budget: with ``max_bytes``, after each change the store evicts its
    oldest sequences (store-wide, by arrival) while the shards' live bytes
    (allocator bytes less free node slots, which trees reuse first) exceed
    it; evictions are journaled.  A sequence larger than the whole budget
    is evicted at once.  Across a reopen, the arrival order between
    shards is exact for compacted sequences; journal tails are ordered
    shard by shard.

    Versions come from one store-wide counter, so a shard's version grows
    with every change and a dropped-then-recreated shard never repeats
    one.  `delta_since` answers from a bounded per-shard change log
    (`change_log_limit` entries; empty after a reopen).

    Thread-safe: one lock guards every method.  `tree` hands out the live
    tree for reading; reading it while another thread learns into the
    same shard raises RuntimeError in one of them (see `SuffixTree`).

    Fleet: with ``redis`` (a Redis URL or `FleetOptions`; by default the
    ``AGENTSPEC_REDIS_URL`` environment variable, ``False`` to turn it off)
    every sequence `learn` acknowledges is also published to its tenant's
    fleet stream under its request identity, off the caller's path.  The
    journal is the outbox: what Redis has not durably taken is republished
    after a reconnect, a Redis restart, or when the store opens again
    (docs/fleet.md, "The store as outbox").  Only sequences learned while a
    fleet is configured are published.

    Read-only: with ``readonly=True`` the store reads an existing directory
    as it is now, without its lock, so it opens while another process
    writes it (``agentspec shards stats`` next to a running proxy): each
    shard is its snapshot plus the complete, checksummed records of its
    journal.  It never writes, truncates or quarantines anything; damaged
    shards are skipped and listed in `quarantined`; it does not follow later
    changes (open it again for those).  `learn`, `import_shard`, `drop` and
    `compact` raise `StoreReadOnlyError`; there is no fleet.
    """

    #: Changes kept per shard for `delta_since`.
    change_log_limit: ClassVar[int] = 4096

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        max_bytes: int | None = None,
        max_depth: int = 64,
        fsync: bool = True,
        snapshot_every: int = 4096,
        lock_timeout: float = 0.0,
        redis: str | FleetOptions | Literal[False] | None = None,
        readonly: bool = False,
    ) -> None:
        """Open (or create) a store; see the class doc.

        Raises:
            StoreLockedError: another store holds the directory.
            InvalidArgumentError, TypeError: a bad parameter (or ``redis``
                without the redis package installed; ``readonly`` without a
                path, or with ``redis``).
            FileNotFoundError: ``readonly`` and no store at ``path``.
            OSError: the directory cannot be created or read.
        """
        self._readonly = bool(readonly)
        if self._readonly and path is None:
            raise InvalidArgumentError("a read-only ShardStore needs a path")
        if self._readonly and redis not in (None, False):
            raise InvalidArgumentError("a read-only ShardStore publishes nothing: drop redis=")
        fleet = None if self._readonly else fleet_options(redis)
        self._max_bytes = (
            None
            if max_bytes is None
            else as_int(max_bytes, "max_bytes", 0, expected="an int or None")
        )
        self._max_depth = check_max_depth(max_depth)
        self._snapshot_every = as_int(snapshot_every, "snapshot_every", 1)
        if isinstance(lock_timeout, bool) or not isinstance(lock_timeout, (int, float)):
            raise TypeError(f"lock_timeout must be a number, not {type(lock_timeout).__name__}")
        if not (math.isfinite(lock_timeout) and lock_timeout >= 0):
            raise InvalidArgumentError("lock_timeout must be >= 0 seconds", f"got {lock_timeout}")
        self._fsync = bool(fsync)
        self._lock = threading.Lock()
        self._shards: dict[ShardKey, Shard] = {}
        self._listeners: list[Listener] = []
        self._clock = 0
        self._live_total = 0
        self._evicted_total = 0  # sequences evicted by the budget since opening
        self._closed = False
        #: Corrupt shard directories found at open, as moved to ``<path>/corrupt/``.
        self.quarantined: list[Path] = []
        self._root: Path | None = None
        self._dirlock: DirLock | None = None
        if path is not None:
            self._root = Path(os.fspath(path)).expanduser()
            self._open_dir(float(lock_timeout))
        self._outbox: FleetOutbox | None = None
        self._source: StoreOutboxSource | None = None
        if fleet is not None:
            try:
                self._outbox, self._source = start_outbox(fleet, self._lock, self._shards)
            except BaseException:
                self.close()
                raise
        self._metrics_outbox = self._outbox  # kept after close, for the last metrics read
        live_metrics.track(self, _metric_samples)

    # --- opening ------------------------------------------------------------------

    def _open_dir(self, lock_timeout: float) -> None:
        """Lock the directory, recover its shards, enforce the budget, repair files."""
        root = self._root
        assert root is not None
        if self._readonly:  # no lock, no repair: see the class doc
            self._shards, self._clock, self.quarantined = read_shards(root)
            self._live_total = sum(s.live_bytes for s in self._shards.values())
            return
        if not root.is_dir():
            root.parent.mkdir(parents=True, exist_ok=True)
            make_dir(root)
        self._dirlock = DirLock(root / "LOCK", lock_timeout)
        try:
            self._shards, self._clock, self.quarantined = open_shards(root, self._fsync)
            self._live_total = sum(s.live_bytes for s in self._shards.values())
            self._evict([])
            for shard in self._shards.values():
                if shard.dirty or (shard.journal and shard.journal.count >= self._snapshot_every):
                    shard.compact(self._fsync)
        except BaseException:
            for shard in self._shards.values():
                if shard.journal is not None:
                    shard.journal.close()
            self._shards.clear()
            self._dirlock.release()
            raise

    # --- helpers ------------------------------------------------------------------

    def _check_open(self) -> None:
        """Refuse use after `close`."""
        if self._closed:
            raise TreeClosedError("the shard store is closed")

    def _check_writable(self) -> None:
        """Refuse a change of a read-only store."""
        if self._readonly:
            raise StoreReadOnlyError(
                f"shard store {self._root} is open read-only; open it without readonly=True "
                "(which waits for or refuses another writer) to change it"
            )

    def _get(self, key: object) -> Shard:
        """The shard of a key (validated), or ShardNotFoundError."""
        k = check_key(key)
        self._check_open()
        shard = self._shards.get(k)
        if shard is None:
            raise ShardNotFoundError("no shard with this key", repr(k))
        return shard

    def _tick(self) -> int:
        """Advance the store-wide version counter."""
        self._clock += 1
        return self._clock

    def _notify(self, notes: list[tuple[ShardKey, int]]) -> None:
        """Call the listeners (outside the lock) with the last version per key."""
        if not notes or not self._listeners:
            return
        last = dict(notes)
        for fn in list(self._listeners):
            for key, version in last.items():
                try:
                    fn(key, version)
                except Exception as e:  # a listener must not break learning
                    _log.error("agentspec shard store: listener failed", error=repr(e))

    def _evict(self, notes: list[tuple[ShardKey, int]]) -> list[Shard]:
        """Evict the oldest sequences while over budget; return the shards touched."""
        touched: list[Shard] = []
        if self._max_bytes is None:
            return touched
        while self._live_total > self._max_bytes:
            victim = oldest_shard(self._shards.values())
            if victim is None:
                break
            try:
                self._live_total += victim.evict_oldest(self._clock + 1, self.change_log_limit)
            except RuntimeError as e:  # a reader holds the tree: try again next time
                _log.warning("agentspec shard store: eviction postponed", error=str(e))
                break
            self._clock += 1
            self._evicted_total += 1
            notes.append((victim.key, victim.version))
            if victim not in touched:
                touched.append(victim)
        for s in touched:
            if s.journal is not None:
                try:
                    s.journal.sync()
                except OSError as e:
                    _log.error("agentspec shard store: cannot sync a journal", error=str(e))
        return touched

    def _maybe_compact(self, shards: list[Shard]) -> None:
        """Auto-compact shards whose journal reached ``snapshot_every`` records."""
        for shard in shards:
            if shard.journal is not None and shard.journal.count >= self._snapshot_every:
                try:
                    shard.compact(self._fsync)
                except OSError as e:  # the journal still holds everything
                    _log.error(
                        "agentspec shard store: compaction failed",
                        path=str(shard.directory),
                        error=str(e),
                    )

    # --- learning -----------------------------------------------------------------

    def learn(self, key: ShardKey, tokens: TokenArray, *, identity: str | None = None) -> int:
        """Add one finished response to a shard; return its sequence id.

        Ids are per shard, increasing from 1.  With a path, the journal
        record is written (and fsynced when ``fsync``) before this returns.
        Then the byte budget is enforced (possibly evicting this sequence
        when it alone exceeds the budget).

        With a fleet, the sequence is then published under ``identity``: the
        request identity every side that may publish this response uses
        (the client uses the call's ``agentspec_request_id``, as the vLLM
        worker does; see docs/fleet.md); None: a random one (nothing else
        will publish it).
        Without a fleet ``identity`` is checked and not used.

        Raises:
            InvalidArgumentError: a bad key or identity, or an empty token list.
            TypeError, InvalidTokenError: bad tokens (nothing changes).
            OSError: the journal could not be written (nothing changes).
        """
        self._check_writable()
        k = check_key(key)
        ident = None if identity is None else check_identity(identity)
        _, n, buf = as_int32_buffer(tokens)
        if n == 0:
            raise InvalidArgumentError("cannot learn an empty token list")
        payload = int32_le(buf.tobytes())
        source = self._source
        if source is not None and ident is None:
            ident = uuid.uuid4().hex
        with self._lock:
            self._check_open()
            shard = self._shards.get(k)
            created = shard is None
            if shard is None:
                # versions before its creation are not its own: delta_since refuses them
                shard = Shard(k, SuffixTree(self._max_depth), version=self._clock)
            sid = shard.next_seq
            if sid > lowlevel.INT64_MAX:
                raise CapacityError("sequence ids of this shard are exhausted", repr(k))
            shard.tree.add(sid, buf)
            version = self._clock + 1
            if source is not None:
                assert ident is not None
                shard.outbox.add(sid, ident)
            if created:  # its new directory's snapshot holds the sequence
                shard.next_seq, shard.order[sid] = sid + 1, version
                shard.note(version, ADD, sid, self.change_log_limit)
                if self._root is not None:
                    shard.write_dir(self._root / "shards", self._fsync)
                self._shards[k] = shard
                shard.refresh_bytes()
                self._live_total += shard.live_bytes
            else:
                if shard.journal is not None:
                    record = (
                        encode_add(sid, payload)
                        if source is None or ident is None
                        else encode_add_id(sid, ident, payload)
                    )
                    try:
                        shard.journal.append(record, 1)
                    except BaseException:
                        shard.tree.remove(sid)
                        shard.outbox.drop(sid)
                        raise
                shard.next_seq, shard.order[sid] = sid + 1, version
                shard.note(version, ADD, sid, self.change_log_limit)
                self._live_total += shard.refresh_bytes()
            self._clock = version
            notes = [(k, version)]
            touched = self._evict(notes)
            self._maybe_compact([shard, *touched])
            if source is not None:
                source.wake(k)
        self._notify(notes)
        if self._outbox is not None:
            self._outbox.kick()
        return sid

    # --- reading ------------------------------------------------------------------

    @property
    def path(self) -> Path | None:
        """The store's directory (None in memory-only mode)."""
        return self._root

    @property
    def readonly(self) -> bool:
        """True for a store opened with ``readonly=True``."""
        return self._readonly

    def tree(self, key: ShardKey) -> SuffixTree | None:
        """The live tree of a shard (None when absent); callers only read it."""
        k = check_key(key)
        with self._lock:
            self._check_open()
            shard = self._shards.get(k)
            return None if shard is None else shard.tree

    def keys(self, tenant: str | None = None) -> list[ShardKey]:
        """Keys of all shards, or of one tenant's, in creation order."""
        with self._lock:
            self._check_open()
            return [k for k in self._shards if tenant is None or k[0] == tenant]

    def stats(self, key: ShardKey) -> ShardStats:
        """Size and version of a shard.

        Raises:
            ShardNotFoundError: no such shard.
        """
        with self._lock:
            return self._get(key).stats()

    def version(self, key: ShardKey) -> int:
        """The shard's version; it grows with every add and remove.

        Raises:
            ShardNotFoundError: no such shard.
        """
        with self._lock:
            return self._get(key).version

    def snapshot(self, key: ShardKey) -> tuple[bytes, int]:
        """Native snapshot bytes of a shard and the version they show.

        Raises:
            ShardNotFoundError: no such shard.
        """
        with self._lock:
            shard = self._get(key)
            return shard.tree.to_bytes(), shard.version

    def delta_since(self, key: ShardKey, version: int) -> tuple[bytes, int] | None:
        """Native delta bytes from ``version`` to now, and the current version.

        Applied (`SuffixTree.load`) to a tree holding the shard as of
        ``version``, the delta gives the shard as it is now.  None when that
        history is no longer kept (or ``version`` is not one of this shard's
        past): send a snapshot instead.

        Raises:
            ShardNotFoundError: no such shard.
        """
        v = as_int(version, "version", 0)
        with self._lock:
            shard = self._get(key)
            data = shard.delta_since(v)
            return None if data is None else (data, shard.version)

    # --- whole shards -------------------------------------------------------------

    def import_shard(
        self, key: ShardKey, data: bytes | bytearray | memoryview, *, replace: bool = False
    ) -> int:
        """Import native shard bytes (snapshot or delta); return the shard's new version.

        With ``replace`` (or for a new key) the shard becomes exactly the
        bytes' sequences; otherwise they are merged in (a delta's removals
        applied, ids already present kept).  The new state is written as a
        fresh shard directory swapped in atomically.  The shard's depth comes
        from the bytes when replacing or creating.

        Raises:
            ShardFormatError (or a subclass, e.g. DepthMismatchError when
            merging a different depth): bad bytes; nothing changes.
        """
        self._check_writable()
        k = check_key(key)
        raw = bytes(data)
        with self._lock:
            self._check_open()
            old = self._shards.get(k)
            shard = imported_shard(
                k,
                raw,
                old,
                replace=replace,
                version=self._clock + 1,
                log_limit=self.change_log_limit,
            )
            version = self._tick()
            if self._root is not None:
                shard.write_dir(self._root / "shards", self._fsync, old)
            if old is not None:
                self._live_total -= old.live_bytes
            self._shards[k] = shard
            self._live_total += shard.live_bytes
            notes = [(k, version)]
            touched = self._evict(notes)
            self._maybe_compact(touched)
            version = shard.version
            if self._source is not None and shard.outbox.unsent:
                self._source.wake(k)
        self._notify(notes)
        if self._outbox is not None:
            self._outbox.kick()
        return version

    def drop(self, key: ShardKey) -> None:
        """Delete a shard (its directory too).

        Raises:
            ShardNotFoundError: no such shard.
        """
        self._check_writable()
        with self._lock:
            shard = self._get(key)
            if shard.directory is not None:
                drop_shard_dir(shard.directory, self._fsync)
            if shard.journal is not None:
                shard.journal.close()
            del self._shards[shard.key]
            self._live_total -= shard.live_bytes
            notes = [(shard.key, self._tick())]
        self._notify(notes)

    def compact(self) -> None:
        """Snapshot every shard with journaled changes (fsync + atomic rename), reset journals.

        A no-op in memory-only mode.
        """
        self._check_writable()
        with self._lock:
            self._check_open()
            for shard in self._shards.values():
                if shard.journal is not None and (shard.journal.count or shard.dirty):
                    shard.compact(self._fsync)

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(key, new_version)`` after each change (outside the store lock).

        Exceptions from ``fn`` are logged and ignored.
        """
        if not callable(fn):
            raise TypeError("a listener must be callable")
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Listener) -> None:
        """Stop calling ``fn`` (a listener never added is ignored)."""
        with self._lock, contextlib.suppress(ValueError):
            self._listeners.remove(fn)

    # --- the fleet ------------------------------------------------------------------

    @property
    def fleet(self) -> FleetOutbox | None:
        """The outbox publishing to the fleet (None without ``redis``).

        ``store.fleet.stats()`` counts what is pending and settled;
        ``store.fleet.flush(timeout)`` waits until Redis durably holds every
        sequence learned so far.
        """
        return self._outbox

    # --- closing ------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True after `close`."""
        return self._closed

    def close(self) -> None:
        """Close journals and release the directory lock (closing twice is allowed).

        Trees handed out by `tree` stay readable.  With a fleet, queued
        entries get ``close_timeout`` seconds to reach Redis; whatever is not
        settled is republished when the store opens again.
        """
        outbox, self._outbox = getattr(self, "_outbox", None), None
        if outbox is not None:
            outbox.close()  # before the journals close: it settles into them
        live_metrics.retire(self)  # its counters stay counted
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for shard in self._shards.values():
                if shard.journal is not None:
                    shard.journal.close()
            self._shards.clear()
            if self._dirlock is not None:
                self._dirlock.release()

    def __enter__(self) -> ShardStore:
        """Use the store in a ``with`` block; it is closed on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the store."""
        self.close()

    def __repr__(self) -> str:
        """Short description: where, and how many shards."""
        where = "memory" if self._root is None else str(self._root)
        if self._readonly:
            where += " read-only"
        state = "closed" if self._closed else f"shards={len(self._shards)}"
        return f"<ShardStore {where} {state}>"


def _metric_samples(store: ShardStore) -> Iterator[live_metrics.Sample]:
    """The store's shard rows (kind ``learned``) and its publisher's, for `live_metrics`."""
    with store._lock:
        if store._closed:
            return
        stats = [(shard.stats(), shard.live_bytes) for shard in store._shards.values()]
        evicted = store._evicted_total
        budget = store._max_bytes
    yield (SHARDS, ("learned",), len(stats))
    for st, live_bytes in stats:
        labels = ("learned", *key_labels(*st.key))
        yield (SHARD_TOKENS, labels, st.tokens)
        yield (SHARD_BYTES, labels, live_bytes)  # what the budget counts
    yield (SHARD_EVICTIONS_TOTAL, ("learned",), evicted)
    if budget is not None:
        yield (SHARD_BUDGET_BYTES, (), budget)
    outbox = store._metrics_outbox
    if outbox is not None:
        yield (FLEET_PUBLISHED_TOTAL, (), outbox.stats().publisher.published)
