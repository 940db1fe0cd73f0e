"""`FleetPublisher`: appends finished sequences to their tenants' fleet streams.

`publish` validates and hashes on the caller's thread (microseconds, no
I/O) and hands the entry to a bounded queue; a background thread sends
queued entries with pipelined ``XADD``s, so Redis being slow or down never
blocks the caller.  The thread learns each tenant's depth from Redis once
(`_fleet_config`) and encodes entries there; each ``XADD`` runs in a
library function (``xadd``) that first checks that the tenant's depth is
still the one the entry was encoded for (a Redis restart that lost its
data may have re-made the config), so no entry of another depth ever
reaches the stream.

The outbox contract (what `ShardStore`'s journal, or any durable outbox,
relies on; see `agentspec._store.fleet_outbox`):

- `publish` returns `PublishStatus.QUEUED`: the publisher owns the entry
  and retries it until Redis acknowledges it, or until `close`, which
  returns every entry not yet settled.  FULL or CLOSED: nothing was taken;
  the caller keeps the sequence and may offer it again later.
- ``on_published`` is called once per acknowledgement (on the publisher
  thread, with the stream id); ``on_durable`` once the entry is known to be
  durable: at once when ``durable_after`` is 0, else after the durability
  window (`agentspec._fleet.window`) verified it, resending it first if
  Redis lost it (then ``on_published`` comes again).  Only then may the
  outbox forget it.
- Resending is always safe: the fleet id depends only on (key, identity,
  tokens), so an entry published twice (a crash between ``XADD`` and the
  outbox's note, or the client and the worker both publishing one
  response) is learned once, at its first position in the stream.
- Redis refusing an entry for good (no permission for the tenant's keys,
  over the size limit) drops it with a count, a log line and
  ``on_rejected`` (``rejected``).  A refusal for now (`is_transient`: a
  replica's READONLY right after a failover, NOREPLICAS, LOADING, BUSY,
  OOM, a lost connection ...) drops nothing: the entries stay queued and
  are sent again with backoff (``failures``), whether the refusal came
  from the config read, the ``XADD`` script or the connection.
  ``last_error`` holds the last failure or rejection (redacted) until a
  send succeeds again.
"""

from __future__ import annotations

import array
import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from time import monotonic
from types import TracebackType
from typing import Any

import redis

from agentspec._core.shardkey import check_key
from agentspec._core.tokens import TokenArray, as_int32_buffer
from agentspec._core.tree import SuffixTree
from agentspec._fleet.config import FleetConfig, tenant_config
from agentspec._fleet.connection import (
    CLUSTER_SCHEME,
    SENTINEL_SCHEME,
    Redactor,
    is_transient,
    open_client,
    parse_cluster_url,
    parse_sentinel_url,
    retry_until_stopped,
)
from agentspec._fleet.entry import MAX_ENTRY_BYTES, FleetEntry, entry_size
from agentspec._fleet.functions import fcall, is_missing, load_library
from agentspec._fleet.ids import check_identity
from agentspec._fleet.names import FleetKeys
from agentspec._fleet.stats import PublisherStats
from agentspec._fleet.window import Acked, DurableWindow, verify
from agentspec._util.log import get_logger
from agentspec.exceptions import InvalidArgumentError

__all__ = ["FleetPublisher", "PublishStatus", "Published"]

_log = get_logger()

_CONFIG_CHANGED = "AGENTSPEC_CONFIG"


class _RetryLaterError(Exception):
    """Some entries of the batch must be sent again."""


class PublishStatus(Enum):
    """What `FleetPublisher.publish` did with an entry."""

    QUEUED = "queued"  #: taken; sent in the background
    FULL = "full"  #: refused: the queue holds ``max_pending`` entries
    CLOSED = "closed"  #: refused: the publisher is closed


@dataclass(frozen=True, slots=True)
class Published:
    """An entry Redis acknowledged, and its stream id."""

    entry: FleetEntry
    stream_id: str


class FleetPublisher:
    """Publishes learned sequences to the fleet (see the module docstring).

    Args:
        url: Redis URL; its password never appears in logs, errors or reprs.
        config: the config to write for a tenant Redis has none for yet.
        max_pending: most entries queued or in flight; `publish` beyond it
            returns FULL at once.
        batch: most entries per pipelined send.
        max_entry_bytes: larger sequences are refused by `publish`.
        on_published: called with each acknowledged entry (publisher thread).
        max_backoff: longest wait between attempts to reach Redis, seconds.
        durable_after: seconds after its acknowledgement at which an entry is
            verified and, when still in the stream, durable (`_fleet_window`;
            about 3 suits ``appendfsync everysec``); 0: durable at once.
        on_durable: called with entries known to be durable (publisher thread).
        on_rejected: called with an entry Redis refused for good.
    """

    def __init__(
        self,
        url: str,
        *,
        config: FleetConfig | None = None,
        max_pending: int = 10_000,
        batch: int = 128,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        on_published: Callable[[Published], None] | None = None,
        max_backoff: float = 2.0,
        durable_after: float = 0.0,
        on_durable: Callable[[list[FleetEntry]], None] | None = None,
        on_rejected: Callable[[FleetEntry], None] | None = None,
    ) -> None:
        """Create the publisher and start its thread."""
        if not (math.isfinite(durable_after) and durable_after >= 0):
            raise InvalidArgumentError("durable_after must be >= 0 seconds", f"{durable_after}")
        if isinstance(url, str) and url.lower().startswith(SENTINEL_SCHEME + ":"):
            parse_sentinel_url(url)  # a malformed one fails here, not forever in the thread
        if isinstance(url, str) and url.lower().startswith(CLUSTER_SCHEME + ":"):
            parse_cluster_url(url)  # likewise
        self._url = url
        self._redactor = Redactor(url)
        self._config = config if config is not None else FleetConfig()
        self._max_pending = max_pending
        self._batch = batch
        self._max_entry_bytes = max_entry_bytes
        self._on_published = on_published
        self._on_durable = on_durable
        self._on_rejected = on_rejected
        self._max_backoff = max_backoff
        self._window = DurableWindow(float(durable_after))
        self._queue: deque[FleetEntry] = deque()
        self._inflight: list[FleetEntry] = []
        self._cond = threading.Condition()
        self._closed = False
        self._stop = threading.Event()
        self._client: redis.Redis | None = None
        self._configs: dict[str, FleetConfig] = {}  # per tenant, as Redis holds it
        self._n = dict.fromkeys(
            ("published", "refused_full", "rejected", "failures", "durable", "lost"), 0
        )
        self._connected = False
        self._last_error: str | None = None
        self._error_is_failure = False  # last_error came from a failure, not a rejection
        self.last_id: str | None = None  #: stream id of the last acknowledged entry
        self._thread = threading.Thread(target=self._run, name="agentspec-fleet-pub", daemon=True)
        self._thread.start()

    # --- caller side ----------------------------------------------------------

    def publish(self, key: object, tokens: TokenArray, identity: str) -> PublishStatus:
        """Queue a finished sequence of shard ``key`` for the fleet; never waits on Redis.

        ``identity`` names the request the sequence answers (e.g. its request
        id), the same on every side that may publish it.

        Raises:
            InvalidArgumentError: bad key or identity, empty or oversized tokens.
            TypeError, InvalidTokenError: bad tokens.
        """
        k = check_key(key)
        ident = check_identity(identity)
        _, n, keep = as_int32_buffer(tokens)
        if n == 0:
            raise InvalidArgumentError("cannot publish an empty sequence")
        if 4 * n + 1024 > self._max_entry_bytes:
            raise InvalidArgumentError("sequence too large for a fleet entry", f"{n} tokens")
        copy = array.array("i")
        copy.frombytes(memoryview(keep).cast("B"))
        return self.offer(FleetEntry.make(k, ident, copy))

    def publish_shard(
        self, key: object, data: bytes, identity: str, *, max_depth: int | None = None
    ) -> PublishStatus:
        """`publish` the one sequence of native shard bytes (e.g. a store's delta).

        The sequence gets its fleet id; the id inside ``data`` is not used.
        ``max_depth`` is the depth of the tree that made ``data`` (default:
        this publisher's config depth).

        Raises:
            ShardFormatError (or a subclass): bad bytes or another depth.
            InvalidArgumentError: not exactly one sequence, or as `publish`.
        """
        with SuffixTree(self._config.max_depth if max_depth is None else max_depth) as scratch:
            scratch.load(data)
            ids = scratch.sequence_ids()
            if len(ids) != 1:
                raise InvalidArgumentError("shard bytes must hold one sequence", f"{len(ids)}")
            tokens = scratch.sequence(ids[0])
        return self.publish(key, tokens, identity)

    def offer(self, entry: FleetEntry) -> PublishStatus:
        """Queue an entry made with `FleetEntry.make` (as `publish`, minus the copying).

        Raises:
            InvalidArgumentError: an empty or oversized sequence.
        """
        n = len(entry.tokens)
        if n == 0 or 4 * n + 1024 > self._max_entry_bytes:
            raise InvalidArgumentError("sequence empty or too large for a fleet entry", f"{n}")
        with self._cond:
            if self._closed:
                return PublishStatus.CLOSED
            if self._pending() >= self._max_pending:
                self._n["refused_full"] += 1
                return PublishStatus.FULL
            self._queue.append(entry)
            self._cond.notify_all()
        return PublishStatus.QUEUED

    def _pending(self) -> int:
        return len(self._queue) + len(self._inflight) + len(self._window)

    def flush(self, timeout: float, *, durable: bool = False) -> bool:
        """Wait until every queued entry was acknowledged (``durable``: and verified)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queue and not self._inflight and not (durable and self._window),
                timeout,
            )

    def stats(self) -> PublisherStats:
        """Counters and state."""
        with self._cond:
            n = self._n
            return PublisherStats(
                connected=self._connected,
                pending=self._pending(),
                published=n["published"],
                refused_full=n["refused_full"],
                rejected=n["rejected"],
                failures=n["failures"],
                last_error=self._last_error,
                unconfirmed=len(self._window),
                durable=n["durable"],
                lost=n["lost"],
            )

    def close(self, timeout: float = 5.0) -> list[FleetEntry]:
        """Refuse new entries, send what is queued for up to ``timeout`` seconds, stop.

        Returns the entries not settled: not acknowledged, or acknowledged
        and not yet verified durable (for the outbox to keep).
        """
        with self._cond:
            self._closed = True
        self.flush(timeout)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            left = self._inflight + list(self._queue) + self._window.drain()
            self._inflight, self._queue = [], deque()
            return left

    def __enter__(self) -> FleetPublisher:
        """Use in a ``with`` block; closed on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the publisher."""
        self.close()

    def __repr__(self) -> str:
        """Redacted URL and pending count."""
        return f"<FleetPublisher url={self._redactor.url!r} pending={self.stats().pending}>"

    # --- the thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stop.is_set() or self._queue):
                    wait = self._window.until_due(monotonic())
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._stop.is_set():
                    break
                take = min(self._batch, len(self._queue))
                self._inflight = [self._queue.popleft() for _ in range(take)]
            work = self._send if self._inflight else self._confirm
            if retry_until_stopped(work, self._stop, self._on_error, maximum=self._max_backoff):
                with self._cond:
                    self._cond.notify_all()
        if self._client is not None:
            self._client.close()

    def _on_error(self, exc: BaseException) -> None:
        text = self._redactor.error(exc)
        with self._cond:
            self._n["failures"] += 1
            self._connected = False
            self._last_error = text
            self._error_is_failure = True
        if self._client is not None:
            self._client.close()
            self._client = None
        _log.warning(
            "agentspec fleet: publisher cannot write to redis now; retrying",
            url=self._redactor.url,
            error=text,
        )

    def _succeeded(self, *, sent: bool) -> None:
        """A round trip worked: connected; a send (or a check after a failure) clears last_error."""
        with self._cond:
            self._connected = True
            if sent or self._error_is_failure:
                self._last_error = None
                self._error_is_failure = False

    def _send(self) -> bool:
        """Send the in-flight batch; raises (to be retried) while some entries remain.

        Acknowledged and rejected entries leave the batch as they are known,
        so a retry resends only the others; an entry refused for now
        (`is_transient`) stays, and the first such error is raised.
        """
        client = self._connect()
        with self._cond:
            rejected_before = self._n["rejected"]
        sent: list[FleetEntry] = []
        pipe = client.pipeline(transaction=False)
        checks = self._window.start(pipe, client)  # no CLIENT commands on a cluster
        for entry in list(self._inflight):
            try:
                config = self._tenant_config(client, entry.key[0])
            except (redis.ResponseError, InvalidArgumentError) as e:
                if is_transient(e):
                    raise
                self._reject(entry, self._redactor.error(e))  # e.g. no permission
                continue
            fields = entry.fields(config.max_depth)
            if entry_size(fields) > self._max_entry_bytes:
                self._reject(entry, "over max_entry_bytes")
                continue
            keys = FleetKeys.of(entry.key[0])
            enc = config.encode()
            args: list[str | bytes] = [enc["depth"], enc["budget"]]
            for name, value in fields.items():
                args += (name, value)
            fcall(pipe, "xadd", [keys.meta, keys.log], args)
            sent.append(entry)
        replies = pipe.execute(raise_on_error=False)
        results = replies[checks:]
        conn_name: Any = replies[0] if checks else None
        if isinstance(conn_name, Exception) and is_transient(conn_name):
            raise conn_name
        for r in results:
            if is_missing(r):  # a restarted Redis forgot the library
                load_library(client)
                raise _RetryLaterError("the function library was loaded")
        acked_at = monotonic()
        with self._cond:
            reconnected = self._window.reconnected(client, conn_name)
        transient: Exception | None = None
        acked = 0
        for entry, r in zip(sent, results, strict=True):
            if isinstance(r, Exception) and is_transient(r):
                transient = transient or r  # the entry stays in flight
            elif isinstance(r, redis.ResponseError) and _CONFIG_CHANGED in str(r):
                self._configs.pop(entry.key[0], None)  # Redis lost and re-made the config
            elif isinstance(r, Exception):
                self._reject(entry, self._redactor.error(r))
            else:
                self._acknowledged(entry, bytes(r).decode(), acked_at)
                acked += 1
        if transient is not None:
            raise transient
        with self._cond:
            clean = acked > 0 and self._n["rejected"] == rejected_before
        self._succeeded(sent=clean)
        self._check_window(client, everything=reconnected)
        with self._cond:
            if self._inflight:
                raise _RetryLaterError("the tenant config changed; entries are re-encoded")
        return True

    def _connect(self) -> redis.Redis:
        if self._client is None:
            self._client = open_client(self._url)
        return self._client

    def _confirm(self) -> bool:
        """Verify the window's due entries (all of them after a reconnect)."""
        client = self._connect()
        pipe = client.pipeline(transaction=False)
        name: Any = None
        if self._window.start(pipe, client):
            name = pipe.execute(raise_on_error=False)[0]
        if isinstance(name, Exception) and is_transient(name):
            raise name
        with self._cond:
            reconnected = self._window.reconnected(client, name)
        self._check_window(client, everything=reconnected)
        self._succeeded(sent=False)
        return True

    def _check_window(self, client: redis.Redis, *, everything: bool) -> None:
        """Settle what the window can: durable entries out, lost ones queued again."""
        now = monotonic()
        with self._cond:
            checked = self._window.candidates(now, everything)
        if not checked:
            return
        present = verify(client, checked)
        with self._cond:
            durable, lost = self._window.resolve(checked, present, now)
            self._queue.extendleft(reversed(lost))
            self._n["durable"] += len(durable)
            self._n["lost"] += len(lost)
            self._cond.notify_all()
        if lost:
            _log.warning("agentspec fleet: redis lost acknowledged entries; resending", n=len(lost))
        self._settled(durable)

    def _settled(self, entries: list[FleetEntry]) -> None:
        if entries and self._on_durable is not None:
            try:
                self._on_durable(entries)
            except Exception as e:
                _log.warning("agentspec fleet: on_durable failed", error=repr(e)[:300])

    def _acknowledged(self, entry: FleetEntry, stream_id: str, at: float) -> None:
        window = self._window.after > 0
        with self._cond:
            self._inflight.remove(entry)
            self._n["published"] += 1
            self.last_id = stream_id
            if window:
                self._window.add(Acked(entry, stream_id, at))
            else:
                self._n["durable"] += 1
        if self._on_published is not None:
            try:
                self._on_published(Published(entry, stream_id))
            except Exception as e:
                _log.warning("agentspec fleet: on_published failed", error=repr(e)[:300])
        if not window:
            self._settled([entry])

    def _tenant_config(self, client: redis.Redis, tenant: str) -> FleetConfig:
        config = self._configs.get(tenant)
        if config is None:
            config = tenant_config(client, FleetKeys.of(tenant), self._config)
            self._configs[tenant] = config
        return config

    def _reject(self, entry: FleetEntry, why: str) -> None:
        with self._cond:
            self._inflight.remove(entry)
            self._n["rejected"] += 1
            self._last_error = self._redactor.scrub(f"rejected: {why}")[:500]
            self._error_is_failure = False
        _log.warning("agentspec fleet: entry rejected", tenant=entry.key[0], reason=why)
        if self._on_rejected is not None:
            try:
                self._on_rejected(entry)
            except Exception as e:
                _log.warning("agentspec fleet: on_rejected failed", error=repr(e)[:300])
