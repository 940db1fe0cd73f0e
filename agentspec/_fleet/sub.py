"""`FleetSubscriber`: one tenant's shards, kept in step with the fleet's Redis stream.

A background thread (never a decode path) does everything that touches
Redis: it loads the tenant's snapshots (`_fleet_load`), then tails the
stream with blocking ``XREAD`` from there, validating each entry
(`_fleet_entry`) and applying it to its shard (`_fleet_shard`) in stream
order, and compacts from time to time (`_fleet_compact`).  Callers read
the trees (`tree`, `trees`), `stats` and lag; they never wait on Redis.

Convergence: the state of a shard is a function of the stream prefix read,
so every subscriber at the same position holds the same sequences.  A
subscriber reloads the snapshots whenever its position is no longer
backed by the stream:

- the entry at its position is gone (checked by the library's ``read``
  function with every batch it fetches): the stream was trimmed past it, or a
  Redis restart lost it (so what it read may differ from what Redis kept;
  the check runs on whichever server answers, so a silent reconnect by
  the client cannot hide a restart).  The tenant config is read again too.

Failures are never fatal: a malformed entry is counted and skipped; Redis
down or refusing anything makes the thread keep its trees, record the
error (secrets removed) and reconnect with exponential backoff.

Read-only users (`tenant_acl_rules` with ``read_only``): the subscriber
only reads (its functions run as ``FCALL_RO``, the config is written only
when Redis has none); a refused compaction turns compaction off for it and
a refused heartbeat turns heartbeats off, each counted, never an error.
About once a second it writes a heartbeat (`_fleet_heartbeat`) with its
position and lag, which `agentspec fleet status` lists.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import redis

from agentspec._core.shardkey import ShardKey, check_key, key_json
from agentspec._core.tree import SuffixTree
from agentspec._fleet.compact import CompactionResult, compact
from agentspec._fleet.config import FleetConfig, tenant_config
from agentspec._fleet.connection import Redactor, open_client, retry_until_stopped
from agentspec._fleet.entry import (
    EVICTION,
    MAX_ENTRY_BYTES,
    BadEntryError,
    decode_entry,
    decode_eviction,
    eviction_fields,
)
from agentspec._fleet.functions import fcall
from agentspec._fleet.heartbeat import (
    Heartbeat,
    new_subscriber_id,
    remove_heartbeat,
    write_heartbeat,
)
from agentspec._fleet.ids import ZERO, StreamId, format_id, parse_id
from agentspec._fleet.load import load_snapshots
from agentspec._fleet.names import FleetKeys, shard_name
from agentspec._fleet.shard import FleetShard
from agentspec._fleet.stats import FleetShardStats, SubscriberStats
from agentspec._util import live_metrics
from agentspec._util.log import get_logger
from agentspec.exceptions import InvalidArgumentError
from agentspec.metrics import (
    FLEET_APPLIED_TOTAL,
    FLEET_COMPACTIONS_TOTAL,
    FLEET_LAG_SECONDS,
    FLEET_LAG_SECONDS_BUCKETS,
    FLEET_MALFORMED_TOTAL,
    FLEET_RECONNECTS_TOTAL,
    FLEET_SNAPSHOT_AGE_SECONDS,
    SHARD_EVICTIONS_TOTAL,
    SHARD_TOKENS,
    SHARDS,
    key_labels,
)

__all__ = ["FleetSubscriber"]

_log = get_logger()

#: The lag histogram's bucket bounds, seconds (`SubscriberStats.lag_counts`).
_LAG_BUCKETS = FLEET_LAG_SECONDS_BUCKETS
#: Seconds between reads of the tenant's ``round`` mark (for the snapshot age).
_ROUND_EVERY = 1.0


class FleetSubscriber:
    """Follows one tenant's fleet stream into per-shard `SuffixTree`s.

    Args:
        url: Redis URL (``redis://``, ``rediss://`` or ``unix://``); its
            password never appears in logs, errors or reprs.
        tenant: the tenant whose stream to follow.
        config: the tenant's config to write if Redis has none yet (the one
            in Redis always wins, see `_fleet_config`).
        block_ms: longest wait of one ``XREAD`` (also bounds how long
            `pause`, `compact` and `close` wait for the thread).
        batch: most entries read per ``XREAD``.
        compact_every: compact once the stream holds this many entries
            (0: never on its own; `compact` still works).
        max_entry_bytes: larger entries are counted as malformed (never fetched:
            Redis reports their size only).
        max_batch_bytes: most entry bytes one read fetches (at least one
            entry); with ``max_entry_bytes`` it bounds what a read holds.
        max_bytes: this replica's memory budget for the tenant's trees (None:
            none).  Beyond it the shards written longest ago are dropped here
            (counted as ``dropped_local``) and their entries skipped until the
            next reload; the tenant-wide shard cap (`FleetConfig.max_shards`)
            is what evicts shards on every replica alike.
        max_backoff: longest wait between reconnection attempts, seconds.
        name: shown by ``agentspec fleet status`` (default ``host:pid``).
        heartbeat_s: seconds between heartbeats (0: none; expire after
            ``max(10, 5 * heartbeat_s)`` seconds unless renewed).
        start: start the thread now (else call `start`).

    The trees are the subscriber's: read and draft from them, never change
    or close them.  After a reload a shard's tree is a new object, so look
    trees up (`tree`) per use rather than keeping them.
    """

    def __init__(
        self,
        url: str,
        tenant: str,
        *,
        config: FleetConfig | None = None,
        block_ms: int = 1000,
        batch: int = 256,
        compact_every: int = 1000,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        max_batch_bytes: int = 8 << 20,
        max_bytes: int | None = None,
        max_backoff: float = 2.0,
        name: str | None = None,
        heartbeat_s: float = 1.0,
        start: bool = True,
    ) -> None:
        """Create the subscriber (see the class docstring)."""
        self._keys = FleetKeys.of(tenant)
        self._url = url
        self._redactor = Redactor(url)
        self._default = config if config is not None else FleetConfig()
        self._block_ms = block_ms
        self._batch = batch
        self._compact_every = compact_every
        self._max_entry_bytes = max_entry_bytes
        self._max_batch_bytes = max_batch_bytes
        self._max_bytes = max_bytes
        self._bytes = 0  # both trees of every shard, as of their last sync
        self._local_drops: set[ShardKey] = set()  # dropped for the memory budget
        self._evicting: set[ShardKey] = set()  # eviction entries written, not yet read
        self._dropped: dict[str, StreamId] = {}  # evicted since the last round: name -> id
        self._repair = False  # the last load found damage: the next round cleans the index
        self._kicked = False  # resumed: read before waiting
        self._driven = False  # a FleetFollower's member: its own thread never starts
        self._max_backoff = max_backoff
        self._name = name
        self._heartbeat_s = heartbeat_s
        self._next_beat = 0.0
        #: This subscriber's id in heartbeats.
        self.id = new_subscriber_id()
        self._can_compact = True
        self._can_beat = heartbeat_s > 0
        self.config: FleetConfig | None = None  # the tenant's, once read from Redis
        self._shards: dict[ShardKey, FleetShard] = {}
        self._position: StreamId = ZERO
        self._head: StreamId = ZERO
        self._needs_load = True
        self._connected = False
        self._sessions = 0
        self._since_compact_try = 0
        self._n: dict[str, int] = dict.fromkeys(
            ("applied", "duplicates", "malformed", "covered_skips", "loads", "compactions"), 0
        )
        self._n["bad_snapshots"] = 0
        self._n["heartbeats"] = 0
        self._n["denied"] = 0
        self._n["bad_config"] = 0
        self._n["gaps"] = 0
        self._n["seeded"] = 0
        self._n["compaction_errors"] = 0
        self._n["evicted_shards"] = 0
        self._n["dropped_local"] = 0
        self._next_ms: int | None = None  # stream time of the oldest entry not yet applied
        # per applied entry, seconds from its stream id's time to its apply: counts per
        # bucket of _LAG_BUCKETS (+Inf last) and their sum
        self._lag_counts = [0] * (len(_LAG_BUCKETS) + 1)
        self._lag_sum = 0.0
        self._now = 0.0  # wall clock at the batch being applied
        self._round: StreamId | None = None  # newest snapshot round known (snapshot age)
        self._next_round = 0.0  # monotonic time of the next read of the round mark
        self._epoch: bytes | None = None  # the tenant's re-seed mark at the last load
        self._loads_in_a_row = 0
        self._last_error: str | None = None
        self._last_compaction: CompactionResult | None = None
        self._changed = threading.Condition(threading.RLock())
        self._stop = threading.Event()
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._paused = False
        self._compact_wanted = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"agentspec-fleet-sub-{self._keys.tenant[:32]}", daemon=True
        )
        live_metrics.track(self, _metric_samples)
        if start:
            self.start()

    # --- public surface -----------------------------------------------------

    @property
    def tenant(self) -> str:
        """The tenant followed."""
        return self._keys.tenant

    def start(self) -> None:
        """Start the background thread (once).

        Raises:
            InvalidArgumentError: a `FleetFollower` drives this subscriber.
        """
        if self._driven:
            raise InvalidArgumentError("a FleetFollower drives this subscriber; it has no thread")
        self._thread.start()

    def tree(self, key: object) -> SuffixTree | None:
        """The current tree of a shard key, or None."""
        shard = self._shards.get(check_key(key))
        return None if shard is None else shard.tree

    def trees(self) -> dict[ShardKey, SuffixTree]:
        """The current tree of every shard."""
        return {k: s.tree for k, s in list(self._shards.items())}

    def stats(self) -> SubscriberStats:
        """Counters, position, lag and per-shard stats (bookkeeping only; no tree is read)."""
        with self._changed:
            pos, head, n = self._position, self._head, self._n
            shards = {
                k: FleetShardStats(
                    k,
                    len(s.order),
                    s.tokens,
                    format_id(s.last_id),
                    format_id(s.through),
                    s.applied,
                    s.duplicates,
                    s.evicted,
                )
                for k, s in self._shards.items()
            }
            return SubscriberStats(
                tenant=self.tenant,
                connected=self._connected,
                position=format_id(pos),
                head=format_id(head),
                lag_ms=self._lag_ms(),
                reconnects=max(0, self._sessions - 1),
                last_error=self._last_error,
                shards=shards,
                applied=n["applied"],
                duplicates=n["duplicates"],
                malformed=n["malformed"],
                covered_skips=n["covered_skips"],
                loads=n["loads"],
                compactions=n["compactions"],
                bad_snapshots=n["bad_snapshots"],
                id=self.id,
                compacts=self._can_compact,
                heartbeats=n["heartbeats"],
                denied=n["denied"],
                bad_config=n["bad_config"],
                gaps=n["gaps"],
                seeded=n["seeded"],
                compaction_errors=n["compaction_errors"],
                evicted_shards=n["evicted_shards"],
                dropped_local=n["dropped_local"],
                bytes=self._bytes,
                lag_counts=tuple(self._lag_counts),
                lag_sum=self._lag_sum,
                snapshot_age_ms=self._snapshot_age_ms(),
            )

    def _lag_ms(self) -> int:
        """Wall-clock milliseconds since the oldest entry not yet applied was added (0: none)."""
        if self._next_ms is None:
            return 0
        return max(0, int(time.time() * 1000) - self._next_ms)

    def _snapshot_age_ms(self) -> int | None:
        """Wall-clock milliseconds since the stream time of the newest snapshot round known
        (None: none known)."""
        if self._round is None:
            return None
        return max(0, int(time.time() * 1000) - self._round[0])

    def _saw_round(self, position: StreamId) -> None:
        """Note a snapshot round covering ``position`` (loaded, written or read)."""
        if position != ZERO and (self._round is None or position > self._round):
            with self._changed:
                self._round = position

    def _read_round(self, client: redis.Redis) -> None:
        """Read the tenant's ``round`` mark (another replica's compactions), at most once
        every `_ROUND_EVERY` seconds."""
        now = time.monotonic()
        if now < self._next_round:
            return
        self._next_round = now + _ROUND_EVERY
        try:
            raw = client.hget(self._keys.meta, "round")
            if isinstance(raw, bytes):
                self._saw_round(parse_id(raw))
        except (redis.ResponseError, ValueError):
            pass  # damaged metadata: the next load counts it

    def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` holds (checked at every change); False on timeout."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    def wait_for(self, stream_id: str | bytes, timeout: float) -> bool:
        """Wait until the entry ``stream_id`` (e.g. from `FleetPublisher.flush`) was read."""
        target = parse_id(stream_id)
        return self.wait_until(lambda: self._position >= target and not self._needs_load, timeout)

    def compact(self, timeout: float = 30.0) -> CompactionResult | None:
        """Ask the thread for a compaction round now; its result, or None.

        None: no round within ``timeout`` (Redis down, or another compactor
        held the lease).
        """
        with self._changed:
            done = self._n["compactions"]
            self._last_compaction = None
            self._compact_wanted.set()
            ok = self._changed.wait_for(
                lambda: not self._compact_wanted.is_set() or self._stop.is_set(), timeout
            )
            return self._last_compaction if ok and self._n["compactions"] > done else None

    def pause(self, timeout: float = 30.0) -> bool:
        """Stop reading the stream until `resume`; True once the thread has stopped."""
        self._unpaused.clear()
        return self.wait_until(lambda: self._paused, timeout)

    def resume(self) -> None:
        """Read the stream again after `pause`."""
        self._kicked = True
        self._unpaused.set()

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread (it finishes its current ``XREAD``); the trees stay readable."""
        self._stop.set()
        self._unpaused.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        live_metrics.retire(self)

    def __enter__(self) -> FleetSubscriber:
        """Use in a ``with`` block; closed on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the subscriber."""
        self.close()

    def __repr__(self) -> str:
        """Tenant, redacted URL, position and shard count."""
        return (
            f"<FleetSubscriber tenant={self.tenant!r} url={self._redactor.url!r} "
            f"position={format_id(self._position)} shards={len(self._shards)}>"
        )

    # --- the thread ---------------------------------------------------------

    def _changed_now(self, **updates: Any) -> None:
        with self._changed:
            for name, value in updates.items():
                setattr(self, name, value)
            self._changed.notify_all()

    def _on_error(self, exc: BaseException) -> None:
        text = self._redactor.error(exc)
        self._changed_now(_last_error=text, _connected=False)
        _log.warning("agentspec fleet: subscriber error", url=self._redactor.url, error=text)

    def _run(self) -> None:
        retry_until_stopped(self._session, self._stop, self._on_error, maximum=self._max_backoff)
        self._changed_now(_connected=False)

    def _session(self) -> None:
        """Connect, then tail until stopped (errors propagate)."""
        client = open_client(self._url, socket_timeout=self._block_ms / 1000 + 10)
        try:
            client.ping()
            self._begin(client)
            idle = False
            while not self._stop.is_set():
                if self._held():
                    self._unpaused.wait()
                    continue
                if idle:
                    # Caught up: wait for an entry after our position.  Only its
                    # arrival matters (COUNT 1): the bounded read fetches it.
                    read_from = format_id(self._position)
                    client.xread({self._keys.log: read_from}, count=1, block=self._block_ms)
                idle = self._step(client)
        finally:
            self._end(client)
            client.close()

    # --- one tenant's steps (also driven by `FleetFollower` for many tenants) --

    def _begin(self, client: redis.Redis) -> None:
        """A new connection works: clear the last error, read the config, count it."""
        with self._changed:
            self._last_error = None  # recovered; a config problem below sets it again
        self._needs_load |= self._read_config(client)
        with self._changed:
            self._sessions += 1
            self._connected = True
            self._changed.notify_all()

    def _end(self, client: redis.Redis) -> None:
        """Closing: leave the heartbeat list now, not at expiry."""
        if self._stop.is_set() and self._can_beat:
            with contextlib.suppress(redis.RedisError):
                remove_heartbeat(client, self._keys, self.id)

    def _held(self) -> bool:
        """Whether `pause` holds the reader (noting the change for `pause` to see)."""
        if not self._unpaused.is_set():
            if not self._paused:
                self._changed_now(_paused=True)
            return True
        if self._paused:
            self._changed_now(_paused=False)
        return False

    def _wanted(self) -> bool:
        """Whether a load or a compaction waits, so the next step must not wait for entries."""
        return self._needs_load or self._kicked or self._compact_wanted.is_set()

    def _read_config(self, client: redis.Redis) -> bool:
        """Read the tenant's config (keeping ours alive if Redis lost it); True: it changed."""
        mine = self.config or self._default
        try:
            config = tenant_config(client, self._keys, mine)
        except redis.exceptions.NoPermissionError:
            # A read-only user before any writer: build with ours until one writes.
            self._denied("writing the tenant config")
            config = mine
        except (InvalidArgumentError, redis.ResponseError) as e:
            # Damaged: keep building with ours, say why; re-read at every load.
            self._bad_config(e)
            config = mine
        changed, self.config = config != self.config, config
        return changed

    def _bad_config(self, exc: BaseException) -> None:
        text = f"the tenant's fleet config in Redis is unusable ({self._redactor.error(exc)})"
        with self._changed:
            self._n["bad_config"] += 1
            self._last_error = text[:500]
        _log.warning("agentspec fleet: bad tenant config; keeping ours", tenant=self.tenant)

    def _denied(self, what: str) -> None:
        self._n["denied"] += 1
        _log.info("agentspec fleet: subscriber may not write", tenant=self.tenant, refused=what)

    def _beat(self, client: redis.Redis) -> None:
        """Write a heartbeat if one is due (turned off for good if refused)."""
        now = time.monotonic()
        if not self._can_beat or now < self._next_beat:
            return
        self._next_beat = now + self._heartbeat_s
        st = self.stats()
        beat = Heartbeat.now(
            self.id,
            self._name,
            position=st.position,
            head=st.head,
            lag_ms=st.lag_ms,
            applied=st.applied,
            malformed=st.malformed,
            loads=st.loads,
            reconnects=st.reconnects,
            compacts=st.compacts,
            depth=self.config.max_depth if self.config else 0,
            budget=self.config.max_shard_tokens if self.config else None,
        )
        try:
            write_heartbeat(client, self._keys, beat, int(max(10.0, 5 * self._heartbeat_s) * 1000))
        except redis.exceptions.NoPermissionError:
            self._can_beat = False
            self._denied("its heartbeat")
        else:
            self._n["heartbeats"] += 1

    def _step(self, client: redis.Redis) -> bool:
        """Load, compact and beat as due, then read one bounded batch and apply it.

        Returns True when caught up (no entry is left after the batch), so the
        caller may wait for the next one.
        """
        keys = self._keys
        self._kicked = False
        if self._needs_load:
            self._load(client)
        if self._compact_wanted.is_set():
            self._compact(client)
        self._beat(client)
        self._read_round(client)
        read_from = format_id(self._position)
        force = self._loads_in_a_row >= 3
        reply = fcall(
            client,
            "read",
            [keys.meta, keys.log, keys.index],
            [read_from, self._batch, self._max_entry_bytes, self._max_batch_bytes, int(force)],
        )
        backed, head, length, entries, nxt, depth, budget, indexed, epoch, cap = reply
        if self._config_moved(depth, budget, cap) or epoch != self._epoch:
            self._needs_load = True  # the tenant's config or its re-seed mark changed
            return False
        if not backed and not force:
            # Trimmed past, or lost by a Redis restart (perhaps behind a silent
            # reconnect): what we hold may differ from what the stream still has.
            if not int(indexed) and self._holds_sequences():
                self._seed(client)  # the tenant's data is gone: give Redis ours
            self._needs_load = True
            return False
        if not backed:
            with self._changed:
                self._n["gaps"] += 1
            _log.warning(
                "agentspec fleet: the stream does not back the snapshots; reading on",
                tenant=self.tenant,
                position=read_from,
            )
        self._loads_in_a_row = 0
        self._apply(entries)
        self._keep_within_limits(client)
        with self._changed:
            self._head = max(parse_id(head), self._position)
            self._next_ms = None if nxt is None else parse_id(nxt)[0]
            self._changed.notify_all()
        self._since_compact_try += len(entries)
        every = self._compact_every
        if (
            every
            and self._can_compact
            and int(length) >= every
            and self._since_compact_try >= max(1, every // 4)
        ):
            self._compact(client)
        return nxt is None

    def _config_moved(
        self, depth: bytes | None, budget: bytes | None, cap: bytes | None = None
    ) -> bool:
        """Whether Redis holds a usable config other than the one we build with."""
        if depth is None or budget is None:
            return False  # none yet (a read-only replica before any writer): keep ours
        try:
            stored = FleetConfig.decode(depth, budget, cap)
        except InvalidArgumentError as e:
            if self._n["bad_config"] == 0 or self._last_error is None:
                self._bad_config(e)
            return False
        return stored != self.config

    def _holds_sequences(self) -> bool:
        return any(s.order for s in self._shards.values())

    def _seed(self, client: redis.Redis) -> None:
        """Give Redis our shards after it lost the tenant's data (compare-and-set per shard).

        Each shard is put as a snapshot covering ``0-0`` (the state before any
        entry of the new stream) only where no snapshot exists, so when several
        replicas seed at once, one wins each shard; then a new ``epoch`` mark
        makes every subscriber (this one too) reload what Redis now holds.
        """
        assert self.config is not None
        keys = self._keys
        try:
            tenant_config(client, keys, self.config)
            for shard in list(self._shards.values()):
                if not shard.order:
                    continue
                name = shard_name(shard.key)
                data, gone = shard.snapshot()
                args: list[str | bytes] = [name, "0-0", "put", "0-0", data, key_json(shard.key)]
                args.append(gone)
                fcall(client, "put_snapshot", [keys.snap(name), keys.index], args)
            client.hset(keys.meta, "epoch", new_subscriber_id())
        except redis.exceptions.NoPermissionError:
            self._denied("re-seeding the tenant")  # a read-only user: a writer seeds
            return
        with self._changed:
            self._n["seeded"] += 1
        _log.warning(
            "agentspec fleet: the tenant's data was gone from Redis; re-seeded it from our shards",
            tenant=self.tenant,
            shards=len(self._shards),
        )

    def _load(self, client: redis.Redis) -> None:
        self._read_config(client)
        assert self.config is not None
        state = load_snapshots(client, self._keys, self.config.max_depth)
        with self._changed:
            self._shards = state.shards
            self._bytes = sum(s.nbytes for s in state.shards.values())
            self._local_drops.clear()
            self._evicting.clear()
            self._dropped.clear()
            self._repair = state.bad_snapshots > 0
            self._position = state.position
            self._epoch = state.epoch
            self._loads_in_a_row += 1
            self._needs_load = False
            self._n["loads"] += 1
            self._n["bad_snapshots"] += state.bad_snapshots
            self._changed.notify_all()
        self._saw_round(state.position)

    def _apply(self, entries: list[list[Any]]) -> None:
        """Apply a batch in stream order; an entry that fails in any way is counted and skipped."""
        touched: set[FleetShard] = set()
        self._now = time.time()
        for raw_id, fields in entries:
            eid = parse_id(raw_id)
            try:
                self._apply_one(eid, fields, touched)
            except Exception as e:  # never stop at an entry: skip it on every replica alike
                self._n["malformed"] += 1
                reason = e.reason if isinstance(e, BadEntryError) else f"{type(e).__name__}"
                _log.warning(
                    "agentspec fleet: malformed entry skipped", id=format_id(eid), reason=reason
                )
        for shard in touched:
            before = shard.nbytes
            shard.sync()
            if self._shards.get(shard.key) is shard:
                self._bytes += shard.nbytes - before
        if entries:
            self._changed_now(_position=parse_id(entries[-1][0]))

    def _apply_one(self, eid: StreamId, fields: object, touched: set[FleetShard]) -> None:
        config, n = self.config, self._n
        assert config is not None
        if isinstance(fields, int):  # only its size came back: over the entry limit
            raise BadEntryError("oversized")
        if not isinstance(fields, list) or len(fields) % 2:
            raise BadEntryError("not a field list")
        mapping = dict(zip(fields[::2], fields[1::2], strict=True))
        if mapping.get(b"v") == EVICTION:
            self._evict(decode_eviction(mapping, self.tenant), eid)
            return
        entry = decode_entry(mapping, self.tenant, config.max_depth, self._max_entry_bytes)
        if entry.key in self._local_drops:
            return  # dropped here for the memory budget, until the next reload
        shard = self._shards.get(entry.key)
        if shard is None:
            shard = FleetShard.empty(entry.key, config.max_depth)
            with self._changed:
                self._shards[entry.key] = shard
                self._bytes += shard.nbytes
        if eid <= shard.through:
            n["covered_skips"] += 1
        elif shard.apply(entry, eid, config.max_shard_tokens):
            n["applied"] += 1
            touched.add(shard)
            lag = max(0.0, self._now - eid[0] / 1000.0)
            self._lag_counts[bisect.bisect_left(_LAG_BUCKETS, lag)] += 1
            self._lag_sum += lag
        else:
            n["duplicates"] += 1

    def _evict(self, key: ShardKey, eid: StreamId) -> None:
        """Apply an eviction entry: drop the shard, unless its state is from after ``eid``."""
        self._evicting.discard(key)
        shard = self._shards.get(key)
        if shard is None or eid <= shard.through:
            return  # gone already, or loaded from a snapshot written after the eviction
        with self._changed:
            del self._shards[key]
            self._bytes -= shard.nbytes
        self._dropped[shard_name(key)] = eid
        self._n["evicted_shards"] += 1

    def _keep_within_limits(self, client: redis.Redis) -> None:
        """Ask for evictions beyond the tenant's shard cap; drop shards beyond our budget."""
        config = self.config
        assert config is not None
        excess = len(self._shards) - len(self._evicting) - config.max_shards
        if excess > 0 and self._can_compact:
            oldest = sorted(
                (s for k, s in self._shards.items() if k not in self._evicting),
                key=lambda s: (s.last_id, shard_name(s.key)),
            )[:excess]
            enc = config.encode()
            try:
                for shard in oldest:
                    args: list[str | bytes] = [enc["depth"], enc["budget"]]
                    for name, value in eviction_fields(shard.key).items():
                        args += (name, value)
                    fcall(client, "xadd", [self._keys.meta, self._keys.log], args)
                    self._evicting.add(shard.key)
            except redis.exceptions.NoPermissionError:
                self._can_compact = False  # a read-only user: writers evict
                self._denied("evicting shards")
            except redis.ResponseError as e:  # e.g. the config moved: the next read reloads
                _log.warning(
                    "agentspec fleet: eviction entry refused", error=self._redactor.error(e)
                )
        if self._max_bytes is not None and self._bytes > self._max_bytes:
            by_age = sorted(self._shards.values(), key=lambda s: (s.last_id, shard_name(s.key)))
            with self._changed:
                for shard in by_age[:-1]:  # the newest shard always stays
                    if self._bytes <= self._max_bytes:
                        break
                    del self._shards[shard.key]
                    self._bytes -= shard.nbytes
                    self._local_drops.add(shard.key)
                    self._n["dropped_local"] += 1
            _log.warning(
                "agentspec fleet: over the memory budget; dropped shards here",
                tenant=self.tenant,
                dropped=len(self._local_drops),
            )

    def _compact(self, client: redis.Redis) -> None:
        self._since_compact_try = 0
        result: CompactionResult | None = None
        if self._can_compact:
            try:
                result = compact(
                    client,
                    self._keys,
                    list(self._shards.values()),
                    self._position,
                    dropped=self._dropped,
                    repair=self._repair,
                )
                self._dropped = {}
                self._repair = False
            except redis.exceptions.NoPermissionError:
                self._can_compact = False  # a read-only user: writers compact
                self._denied("compaction")
            except redis.ResponseError as e:  # e.g. damaged marks: keep following the stream
                self._n["compaction_errors"] += 1
                _log.warning("agentspec fleet: compaction failed", error=self._redactor.error(e))
        if result is not None:
            self._saw_round(self._position)
        with self._changed:
            if result is not None:
                self._n["compactions"] += 1
                self._last_compaction = result
            self._compact_wanted.clear()
            self._changed.notify_all()


def _metric_samples(sub: FleetSubscriber) -> Iterator[live_metrics.Sample]:
    """The subscriber's fleet and shard rows for the default registry (`live_metrics`)."""
    st = sub.stats()
    yield (FLEET_APPLIED_TOTAL, (), st.applied)
    yield (FLEET_MALFORMED_TOTAL, (), st.malformed)
    yield (FLEET_RECONNECTS_TOTAL, (), st.reconnects)
    yield (FLEET_COMPACTIONS_TOTAL, (), st.compactions)
    yield (SHARDS, ("fleet",), len(st.shards))
    for key, shard in st.shards.items():
        yield (SHARD_TOKENS, ("fleet", *key_labels(*key)), shard.tokens)
    yield (SHARD_EVICTIONS_TOTAL, ("fleet",), sum(sh.evicted for sh in st.shards.values()))
    yield (FLEET_LAG_SECONDS, (), (st.lag_counts, st.lag_sum))
    if st.snapshot_age_ms is not None:  # one subscriber per tenant counts (the first)
        yield (FLEET_SNAPSHOT_AGE_SECONDS, (st.tenant,), st.snapshot_age_ms / 1000.0, "age")
