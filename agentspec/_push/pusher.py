"""`ShardPusher`: keeps workers' shards in step with a `ShardStore`, in the background.

One daemon thread serves every endpoint.  For each (endpoint, shard key) it
remembers the store version the worker last acknowledged and, when the
store changes, sends ``store.delta_since(acked)``; a snapshot goes instead
on first contact, when the delta history is gone, and when the worker's
``instance`` changed (it restarted: every shard is sent again).  A dropped
shard is deleted on the workers.  See `agentspec._push.wire` for the protocol.

Nothing is ever lost by a failed push: the store holds the data, a key
stays dirty until a worker acknowledged it, and every request is idempotent
(snapshots replace, deltas skip ids already present, deletes of absent
shards succeed), so retrying after a dropped answer never counts a
sequence twice.

HTTP client: the stdlib `http.client`, one keep-alive connection per
endpoint.  The pusher is a single thread sending a few requests at a time,
so it needs no pool or async client; the stdlib keeps the package free of a
dependency on httpx / httpx2 (which openai 2.x and 3.x pin differently) and
gives full control over timeouts and connection reuse.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

import tenacity
from tenacity.wait import wait_base

from agentspec._push.wire import (
    DELTA_PATH,
    INSTANCE_HEADER,
    JSON_CONTENT_TYPE,
    SHARD_CONTENT_TYPE,
    SHARDS_PATH,
    SNAPSHOT_FILE_PATH,
    SNAPSHOT_PATH,
    ErrorType,
    ShardKey,
    bearer_headers,
    encode_key_query,
    parse_error,
    parse_retry_after,
    write_shm_file,
)
from agentspec._util.args import as_int
from agentspec._util.log import get_logger
from agentspec.exceptions import TRANSIENT_STATUSES as TRANSIENT_STATUSES
from agentspec.exceptions import InvalidArgumentError, PushError

if TYPE_CHECKING:
    from agentspec._store.store import ShardStore

__all__ = [
    "EndpointStatus",
    "PushError",
    "ShardPusher",
    "default_retrying",
    "is_transient",
    "wait_retry_after",
]

_log = get_logger()

#: After the retries of a push are exhausted, the endpoint rests this long
#: (doubling per consecutive failure, up to the max) before the next try.
_BACKOFF_MIN = 0.2
_BACKOFF_MAX = 30.0
#: Longest wait of the thread when nothing happens (a safety net).
_IDLE_WAIT = 5.0
_USER_AGENT = "agentspec-pusher"


def is_transient(exc: BaseException) -> bool:
    """Whether a push failure is worth retrying (the default retry predicate)."""
    return isinstance(exc, PushError) and exc.transient


class wait_retry_after(wait_base):  # noqa: N801 (tenacity's naming)
    """A tenacity wait honouring the worker's ``Retry-After`` / ``retry-after-ms``.

    Waits what the last failed answer asked for (at most 60 s, see
    `agentspec._push.wire.parse_retry_after`), else what ``fallback`` says.
    """

    def __init__(self, fallback: wait_base | None = None) -> None:
        """Wrap ``fallback`` (default: exponential backoff with jitter, 50 ms .. 5 s)."""
        self.fallback = fallback or tenacity.wait_exponential_jitter(
            multiplier=0.05, max=5.0, jitter=0.05
        )

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        """Seconds to wait before the next attempt."""
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None and outcome.failed else None
        if isinstance(exc, PushError) and exc.retry_after is not None:
            return exc.retry_after
        return float(self.fallback(retry_state))


def default_retrying() -> tenacity.Retrying:
    """The default policy: transient failures only, up to 6 attempts within 120 s."""
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        wait=wait_retry_after(),
        stop=tenacity.stop_after_attempt(6) | tenacity.stop_after_delay(120.0),
        reraise=True,
    )


@dataclass(frozen=True, slots=True)
class EndpointStatus:
    """What `ShardPusher.status` reports for one endpoint.

    Attributes:
        endpoint: the endpoint URL.
        connected: the last request reached the worker.
        instance: the worker's instance id, once known.
        acked: the store version the worker acknowledged, per key.
        pending: keys the worker does not have at the store's version yet.
        errors: failed pushes (after retries), non-transient rejections included.
        last_error: the message of the last failure.
        snapshots / deltas / deletes: requests acknowledged, per kind.
        retries: attempts repeated after a transient failure.
        bytes_sent: shard bytes acknowledged.
    """

    endpoint: str
    connected: bool
    instance: str | None
    acked: Mapping[ShardKey, int]
    pending: tuple[ShardKey, ...]
    errors: int
    last_error: str | None
    snapshots: int
    deltas: int
    deletes: int
    retries: int
    bytes_sent: int


@dataclass
class _Endpoint:
    """Mutable per-endpoint state (written by the pusher thread under the lock)."""

    url: str
    scheme: str
    host: str
    port: int | None
    prefix: str
    conn: http.client.HTTPConnection | None = None
    instance: str | None = None
    acked: dict[ShardKey, int] = field(default_factory=dict)
    dirty: set[ShardKey] = field(default_factory=set)
    connected: bool = False
    errors: int = 0
    last_error: str | None = None
    failures: int = 0
    retry_at: float = 0.0
    shm_ok: bool = True
    snapshots: int = 0
    deltas: int = 0
    deletes: int = 0
    retries: int = 0
    bytes_sent: int = 0


@dataclass(frozen=True, slots=True)
class _Answer:
    """A 200 answer."""

    status: int
    headers: dict[str, str]
    body: bytes

    def instance(self) -> str | None:
        """The worker's instance id (header, else JSON body)."""
        inst = self.headers.get(INSTANCE_HEADER.lower())
        if inst:
            return inst
        try:
            obj = json.loads(self.body)
        except ValueError:
            return None
        v = obj.get("instance") if isinstance(obj, dict) else None
        return v if isinstance(v, str) else None


class _ClosedError(Exception):
    """The pusher is closing (ends a retry wait)."""


_ALL = object()  # queue item: scan every key
_WAKE = object()  # queue item: just wake up


def _shutdown(conn: http.client.HTTPConnection | None) -> None:
    """Shut a connection's socket down: a thread blocked on it wakes with an error."""
    sock = None if conn is None else conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _key_order(key: ShardKey) -> tuple[str, str, str]:
    """A sort key for shard keys (None sorts first)."""
    return (
        key[0],
        "" if key[1] is None else "\x01" + key[1],
        "" if key[2] is None else "\x01" + key[2],
    )


def _parse_endpoint(url: str) -> _Endpoint:
    """Split an endpoint URL; a trailing ``/v1`` (an OpenAI base URL) is dropped."""
    if not isinstance(url, str):
        raise InvalidArgumentError("endpoints must be URL strings", type(url).__name__)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgumentError("endpoint must be an http(s) URL with a host", url[:200])
    if parts.query or parts.fragment:
        raise InvalidArgumentError("endpoint URL must not have a query or fragment", url[:200])
    try:
        port = parts.port
    except ValueError:
        raise InvalidArgumentError("endpoint URL has a bad port", url[:200]) from None
    prefix = parts.path.rstrip("/")
    if prefix.endswith("/v1"):
        prefix = prefix[:-3]
    return _Endpoint(url=url, scheme=parts.scheme, host=parts.hostname, port=port, prefix=prefix)


class ShardPusher:
    """Pushes a `ShardStore`'s shards to workers (`ShardIntake`) from a daemon thread.

    Args:
        store: the store to mirror; the pusher registers a listener on it.
        endpoints: worker base URLs (``http://host:port``; a trailing ``/v1``
            is accepted).
        api_key: sent as ``Authorization: Bearer <api_key>``.
        queue_size: bound of the change queue; when full, keys are marked
            dirty instead (nothing is lost, `notify` never blocks).
        retrying: tenacity policy for one request (default `default_retrying`:
            transient failures only, honouring ``Retry-After``).  Its sleep is
            replaced so that `close` interrupts waits.
        shm_dir: directory shared with the workers (e.g. ``/dev/shm``):
            snapshots of ``shm_threshold`` bytes or more are written there and
            announced with ``snapshot-file`` instead of uploaded (a worker
            that refuses falls back to uploads).
        shm_threshold: smallest snapshot sent through ``shm_dir``.
        timeout: socket timeout of one request, in seconds.

    Use `flush` to wait until the workers caught up, `status` to inspect,
    `close` (or a ``with`` block) to stop the thread.
    """

    def __init__(
        self,
        store: ShardStore,
        endpoints: Sequence[str],
        *,
        api_key: str | None = None,
        queue_size: int = 1024,
        retrying: tenacity.Retrying | None = None,
        shm_dir: str | os.PathLike[str] | None = None,
        shm_threshold: int = 1 << 20,
        timeout: float = 30.0,
    ) -> None:
        """Start pushing (see the class docstring for the arguments)."""
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        eps = [_parse_endpoint(u) for u in endpoints]
        if not eps:
            raise InvalidArgumentError("at least one endpoint is needed")
        if len({e.url for e in eps}) != len(eps):
            raise InvalidArgumentError("endpoints must be distinct")
        queue_size = as_int(queue_size, "queue_size", 1)
        shm_threshold = as_int(shm_threshold, "shm_threshold", 0)
        if not timeout > 0:
            raise InvalidArgumentError("timeout must be > 0")
        self._store = store
        self._endpoints = eps
        self._headers = {"User-Agent": _USER_AGENT, **bearer_headers(api_key)}
        self._retrying = (retrying or default_retrying()).copy(sleep=self._sleep)
        self._shm_dir = None if shm_dir is None else Path(shm_dir)
        self._shm_threshold = shm_threshold
        self._timeout = float(timeout)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._overflow: set[ShardKey] = set()
        self._overflow_all = False
        self._overflow_lock = threading.Lock()
        self._lock = threading.Lock()  # endpoint state read by status() / flush()
        self._progress = threading.Condition()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentspec-pusher", daemon=True)
        store.add_listener(self._on_store_change)
        self._notify_item(_ALL)
        self._thread.start()

    # --- public -----------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """The endpoint URLs."""
        return [e.url for e in self._endpoints]

    def notify(self, key: ShardKey | None = None) -> None:
        """Tell the pusher a shard changed (None: check every shard).  Never blocks."""
        self._notify_item(_ALL if key is None else key)

    def status(self) -> dict[str, EndpointStatus]:
        """Per endpoint: connection, instance, acked versions, pending keys, errors."""
        versions = self._store_versions()
        out = {}
        with self._lock:
            for ep in self._endpoints:
                pending = set(ep.dirty)
                pending.update(k for k, v in versions.items() if ep.acked.get(k) != v)
                pending.update(k for k in ep.acked if k not in versions)
                out[ep.url] = EndpointStatus(
                    endpoint=ep.url,
                    connected=ep.connected,
                    instance=ep.instance,
                    acked=dict(ep.acked),
                    pending=tuple(sorted(pending, key=_key_order)),
                    errors=ep.errors,
                    last_error=ep.last_error,
                    snapshots=ep.snapshots,
                    deltas=ep.deltas,
                    deletes=ep.deletes,
                    retries=ep.retries,
                    bytes_sent=ep.bytes_sent,
                )
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every endpoint acknowledged the store's current versions.

        Endpoints resting after failures are tried again at once, and every
        known worker is asked for its instance first, so a worker that
        restarted since its last acknowledgement is resynced before this
        returns True.  Returns False when ``timeout`` seconds passed first
        (or the pusher is closed).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for ep in self._endpoints:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            # a restarted worker is not in sync; a hung one costs at most the time left
            self._probe(ep, own_connection=True, timeout=left)
        with self._lock:
            for ep in self._endpoints:
                ep.retry_at = 0.0
        self._notify_item(_ALL)
        while True:
            if self._in_sync():
                return True
            if self._closed.is_set():
                return False
            wait = 0.05
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                wait = min(wait, remaining)
            with self._progress:
                self._progress.wait(wait)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (pending changes stay in the store; `flush` first to send them).

        A request in flight is cut short (its socket is shut down), so a
        worker that never answers does not hold `close` for the request timeout.
        """
        self._closed.set()
        self._store.remove_listener(self._on_store_change)
        self._wake()
        for ep in self._endpoints:
            _shutdown(ep.conn)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        for ep in self._endpoints:
            self._drop_connection(ep)

    @property
    def closed(self) -> bool:
        """True after `close`."""
        return self._closed.is_set()

    def __enter__(self) -> ShardPusher:
        """Use in a ``with`` block; closed on exit."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the pusher."""
        self.close()

    # --- queue ------------------------------------------------------------

    def _on_store_change(self, key: ShardKey, version: int) -> None:
        """Store listener: must not raise."""
        try:
            self._notify_item(key)
        except Exception:  # pragma: no cover - defensive: listeners must not raise
            _log.exception("agentspec.push.notify_failed")

    def _notify_item(self, item: object) -> None:
        """Enqueue without blocking; on a full queue mark the key dirty instead."""
        if self._closed.is_set():
            return
        try:
            self._queue.put_nowait(item)
            return
        except queue.Full:
            pass
        with self._overflow_lock:
            if item is _ALL:
                self._overflow_all = True
            elif item is not _WAKE:
                self._overflow.add(cast(ShardKey, item))
        self._wake()

    def _wake(self) -> None:
        """Wake the thread (a full queue wakes it anyway)."""
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_WAKE)

    def _collect(self, first: object) -> tuple[set[ShardKey], bool]:
        """Drain the queue and the overflow: (changed keys, scan everything)."""
        keys: set[ShardKey] = set()
        scan = False
        item = first
        while True:
            if item is _ALL:
                scan = True
            elif item is not _WAKE and item is not None:
                keys.add(cast(ShardKey, item))
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        with self._overflow_lock:
            keys |= self._overflow
            scan = scan or self._overflow_all
            self._overflow = set()
            self._overflow_all = False
        return keys, scan

    # --- the thread -------------------------------------------------------

    def _run(self) -> None:
        """Thread body: wait for changes, sync dirty keys, repeat until closed."""
        while not self._closed.is_set():
            try:
                item: object = self._queue.get(timeout=self._next_wait())
            except queue.Empty:
                item = _ALL  # idle: look for restarted workers and missed changes
            if self._closed.is_set():
                break
            try:
                self._round(item)
            except _ClosedError:
                break
            except Exception:  # a bug or a broken store: keep the thread alive
                _log.exception("agentspec.push.round_failed")
                self._closed.wait(_BACKOFF_MIN)
            with self._progress:
                self._progress.notify_all()
        with self._progress:
            self._progress.notify_all()

    def _next_wait(self) -> float:
        """Seconds until an endpoint with dirty keys may be tried again."""
        now = time.monotonic()
        wait = _IDLE_WAIT
        with self._lock:
            for ep in self._endpoints:
                if ep.dirty:
                    wait = min(wait, max(ep.retry_at - now, 0.0))
        return wait

    def _round(self, first: object) -> None:
        """Mark what changed dirty, then sync every endpoint that may be tried."""
        keys, scan = self._collect(first)
        if scan:
            for ep in self._endpoints:
                self._probe(ep)
            keys |= set(self._store.keys())
        with self._lock:
            for ep in self._endpoints:
                ep.dirty |= keys
                if scan:
                    ep.dirty |= set(ep.acked)  # dropped shards: delete them
        now = time.monotonic()
        for ep in self._endpoints:
            if ep.dirty and ep.retry_at <= now:
                self._sync_endpoint(ep)

    def _sync_endpoint(self, ep: _Endpoint) -> None:
        """Push every dirty key of one endpoint; stop at the first transient failure."""
        with self._lock:
            todo = sorted(ep.dirty, key=_key_order)
        for key in todo:
            if self._closed.is_set():
                raise _ClosedError
            try:
                self._sync_key(ep, key)
            except PushError as e:
                self._record_error(ep, key, e)
                if e.transient:
                    return
                with self._lock:
                    ep.dirty.discard(key)  # until the next change of this key
                continue
            except (_ClosedError, KeyboardInterrupt):
                raise
            except Exception as e:  # the store failed; try again after a rest
                _log.exception("agentspec.push.store_failed", endpoint=ep.url, key=key)
                with self._lock:
                    ep.errors += 1
                    ep.last_error = f"{type(e).__name__}: {e}"
                    ep.retry_at = time.monotonic() + _BACKOFF_MAX
                return
            with self._lock:
                ep.dirty.discard(key)
                ep.failures = 0
                ep.connected = True

    def _record_error(self, ep: _Endpoint, key: ShardKey, e: PushError) -> None:
        """Count a failed push; a transient one makes the endpoint rest."""
        with self._lock:
            ep.errors += 1
            ep.last_error = str(e)
            if e.transient:
                ep.connected = e.status is not None
                ep.failures += 1
                delay = min(_BACKOFF_MIN * 2 ** (ep.failures - 1), _BACKOFF_MAX)
                ep.retry_at = time.monotonic() + delay * random.uniform(0.75, 1.25)
            else:
                ep.connected = True
        if e.transient:
            _log.warning("agentspec.push.unreachable", endpoint=ep.url, key=key, error=str(e))
        else:
            _log.warning(
                "agentspec.push.rejected",
                endpoint=ep.url,
                key=key,
                status=e.status,
                error_type=e.error_type,
                error=str(e),
            )

    def _sync_key(self, ep: _Endpoint, key: ShardKey) -> None:
        """Bring one key of one endpoint to the store's current version."""
        store = self._store
        if store.tree(key) is None:
            with self._lock:
                known = key in ep.acked
            if known:
                self._request(ep, "DELETE", SHARDS_PATH, key, None, None)
                with self._lock:
                    ep.acked.pop(key, None)
                    ep.deletes += 1
            return
        with self._lock:
            acked = ep.acked.get(key)
            instance = ep.instance
        if acked is not None and instance is not None:
            if acked == store.version(key):
                return
            delta = store.delta_since(key, acked)
            if delta is not None:
                data, version = delta
                try:
                    answer = self._request(
                        ep,
                        "POST",
                        DELTA_PATH,
                        key,
                        data,
                        SHARD_CONTENT_TYPE,
                        {INSTANCE_HEADER: instance},
                    )
                except PushError as e:
                    if e.error_type != ErrorType.INSTANCE_MISMATCH:
                        raise
                    self._worker_restarted(ep, e.instance)
                else:
                    self._acknowledge(ep, key, version, answer, len(data), snapshot=False)
                    return
        data, version = store.snapshot(key)
        answer = self._send_snapshot(ep, key, data)
        self._acknowledge(ep, key, version, answer, len(data), snapshot=True)

    def _send_snapshot(self, ep: _Endpoint, key: ShardKey, data: bytes) -> _Answer:
        """PUT a snapshot, or hand it over as a file in the shm dir."""
        if self._shm_dir is not None and ep.shm_ok and len(data) >= self._shm_threshold:
            path = write_shm_file(self._shm_dir, data)
            try:
                body = json.dumps({"path": str(path)}).encode()
                return self._request(ep, "POST", SNAPSHOT_FILE_PATH, key, body, JSON_CONTENT_TYPE)
            except PushError as e:
                if e.status is None or e.transient or e.status == 401:
                    raise
                _log.info(
                    "agentspec.push.shm_refused", endpoint=ep.url, status=e.status, error=str(e)
                )
                ep.shm_ok = False
            finally:
                with contextlib.suppress(OSError):
                    path.unlink()
        return self._request(ep, "PUT", SNAPSHOT_PATH, key, data, SHARD_CONTENT_TYPE)

    def _acknowledge(
        self,
        ep: _Endpoint,
        key: ShardKey,
        version: int,
        answer: _Answer,
        nbytes: int,
        *,
        snapshot: bool,
    ) -> None:
        """Record a worker's acknowledgement of ``version`` of ``key``."""
        instance = answer.instance()
        with self._lock:
            known = ep.instance
        if instance is not None and known is not None and instance != known:
            self._worker_restarted(ep, instance)
            if not snapshot:  # not expected (deltas name their instance): resend in full
                self._sync_key(ep, key)
                return
        with self._lock:
            if instance is not None:
                ep.instance = instance
            ep.acked[key] = version
            ep.bytes_sent += nbytes
            if snapshot:
                ep.snapshots += 1
            else:
                ep.deltas += 1

    def _probe(
        self, ep: _Endpoint, *, own_connection: bool = False, timeout: float | None = None
    ) -> None:
        """Ask a known worker for its instance (one try); a new one means it restarted.

        Without this, a worker that restarted while the store did not change
        would stay empty until the next change (and `flush` would wrongly
        report it in sync).  The pusher thread probes on its endpoint
        connection; `flush` (another thread) with ``own_connection``, and
        then ``timeout`` (seconds, at most the request timeout) bounds it.
        """
        with self._lock:
            known = ep.instance
            resting = ep.retry_at > time.monotonic()
        if known is None or (resting and not own_connection):
            return
        url = f"{ep.prefix}{SHARDS_PATH}"
        try:
            if own_connection:
                answer = self._send_once(ep, url, timeout)
            else:
                answer = self._send(ep, "GET", url, None, self._headers)
        except PushError:
            return  # unreachable now: the next push finds out and backs off
        instance = answer.instance()
        if instance is not None and instance != known:
            self._worker_restarted(ep, instance)

    def _worker_restarted(self, ep: _Endpoint, instance: str | None) -> None:
        """Forget what a restarted worker had: every shard is sent again, as a snapshot."""
        keys = set(self._store.keys())
        with self._lock:
            _log.info(
                "agentspec.push.worker_restarted", endpoint=ep.url, old=ep.instance, new=instance
            )
            ep.instance = instance
            ep.acked.clear()
            ep.dirty |= keys

    # --- HTTP -------------------------------------------------------------

    def _request(
        self,
        ep: _Endpoint,
        method: str,
        path: str,
        key: ShardKey,
        body: bytes | None,
        content_type: str | None,
        extra: Mapping[str, str] | None = None,
    ) -> _Answer:
        """One request with the retry policy; returns the 200 answer or raises PushError."""
        url = f"{ep.prefix}{path}?{encode_key_query(key)}"
        headers = dict(self._headers)
        if content_type is not None:
            headers["Content-Type"] = content_type
        if extra:
            headers.update(extra)
        attempts = 0

        def attempt() -> _Answer:
            nonlocal attempts
            attempts += 1
            if attempts > 1:
                with self._lock:
                    ep.retries += 1
            return self._send(ep, method, url, body, headers)

        try:
            return self._retrying.copy()(attempt)
        except tenacity.RetryError as e:  # a policy without reraise=True
            exc = e.last_attempt.exception()
            if isinstance(exc, PushError):
                raise exc from None
            raise

    def _send(
        self,
        ep: _Endpoint,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str],
    ) -> _Answer:
        """One HTTP exchange on the endpoint's keep-alive connection."""
        if self._closed.is_set():
            raise _ClosedError
        try:
            conn = ep.conn
            if conn is None:
                cls = (
                    http.client.HTTPSConnection
                    if ep.scheme == "https"
                    else http.client.HTTPConnection
                )
                conn = ep.conn = cls(ep.host, ep.port, timeout=self._timeout)
            conn.request(method, url, body=body, headers=dict(headers))
            resp = conn.getresponse()
            data = resp.read()
            rheaders = {k.lower(): v for k, v in resp.getheaders()}
            status = resp.status
        except (OSError, http.client.HTTPException) as e:
            self._drop_connection(ep)
            raise PushError(f"{method} {ep.url}: {type(e).__name__}: {e}") from e
        if status == 200:
            return _Answer(status, rheaders, data)
        error_type, message = parse_error(data)
        if rheaders.get("connection", "").lower() == "close":
            self._drop_connection(ep)
        raise PushError(
            f"{method} {ep.url}{url.partition('?')[0]}: HTTP {status}: {message}",
            status=status,
            error_type=error_type,
            retry_after=parse_retry_after(rheaders),
            instance=rheaders.get(INSTANCE_HEADER.lower()),
        )

    def _send_once(self, ep: _Endpoint, url: str, timeout: float | None = None) -> _Answer:
        """A GET on a connection of its own (for callers other than the pusher thread)."""
        cls = http.client.HTTPSConnection if ep.scheme == "https" else http.client.HTTPConnection
        limit = self._timeout if timeout is None else max(0.01, min(timeout, self._timeout))
        conn = cls(ep.host, ep.port, timeout=limit)
        try:
            conn.request("GET", url, headers=dict(self._headers))
            resp = conn.getresponse()
            data = resp.read()
            headers = {k.lower(): v for k, v in resp.getheaders()}
        except (OSError, http.client.HTTPException) as e:
            raise PushError(f"GET {ep.url}: {type(e).__name__}: {e}") from e
        finally:
            conn.close()
        if resp.status != 200:
            raise PushError(f"GET {ep.url}: HTTP {resp.status}", status=resp.status)
        return _Answer(resp.status, headers, data)

    def _drop_connection(self, ep: _Endpoint) -> None:
        """Close an endpoint's connection (the next request reconnects)."""
        conn, ep.conn = ep.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _sleep(self, seconds: float) -> None:
        """The retry policy's sleep: interrupted by `close`."""
        if self._closed.wait(seconds):
            raise _ClosedError

    # --- sync state -------------------------------------------------------

    def _store_versions(self) -> dict[ShardKey, int]:
        """The store's current version of every key."""
        out = {}
        keys = self._store.keys()
        for key in keys:
            with contextlib.suppress(KeyError):
                out[key] = self._store.version(key)
        return out

    def _in_sync(self) -> bool:
        """Whether every endpoint acknowledged every key at its current version."""
        versions = self._store_versions()
        with self._lock:
            for ep in self._endpoints:
                if ep.acked.keys() != versions.keys():
                    return False
                if any(ep.acked[k] != v for k, v in versions.items()):
                    return False
        return True
