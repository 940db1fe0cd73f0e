"""`ShardIntake`: the worker side of the shard push protocol, framework-neutral.

A worker (the vLLM endpoint plugin, the embedded engine, a standalone
sidecar, the test servers) holds one `ShardIntake` and routes every request
under ``/v1/agentspec/`` to `ShardIntake.handle`, which returns a
`WireResponse`.  The intake keeps one `SuffixTree` per shard key:

* a snapshot (``PUT .../snapshot`` or ``POST .../snapshot-file``) is loaded
  into a new tree outside the lock and swapped in atomically under it, so
  readers see either the old or the new shard, never a half-loaded one;
* a delta (``POST .../delta``) is applied in place with `SuffixTree.load`,
  which validates the bytes before changing anything (malformed bytes: 400,
  the shard is unchanged) and skips ids already present, so a retried delta
  never counts a sequence twice.

Consumers (the proposer) read trees with `tree` and learn about changes
through `add_listener`.  A tree refuses a modification while another thread
reads it (see `SuffixTree`); a delta therefore waits up to ``busy_timeout``
seconds for readers to finish, then answers 503 (the pusher retries).
Readers may likewise see RuntimeError while a delta is being applied.

`serve_intake` runs an intake behind the stdlib `ThreadingHTTPServer`
(tests, benchmarks, a standalone sidecar).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from agentspec._args import as_int
from agentspec._draft import check_max_depth
from agentspec._log import get_logger
from agentspec._tree import SuffixTree
from agentspec._wire import (
    API_PREFIX,
    DEFAULT_MAX_BODY_BYTES,
    DELTA_PATH,
    INSTANCE_HEADER,
    SHARD_CONTENT_TYPE,
    SHARDS_PATH,
    SNAPSHOT_FILE_PATH,
    SNAPSHOT_PATH,
    ErrorType,
    ShardKey,
    WireResponse,
    WorkerShard,
    check_bearer,
    decode_key_query,
    error_response,
    json_response,
    parse_content_length,
)
from agentspec.exceptions import (
    DepthMismatchError,
    InvalidArgumentError,
    ShardFormatError,
)

__all__ = ["IntakeHTTPServer", "IntakeRequestHandler", "ShardIntake", "serve_intake"]

_log = get_logger()

#: Methods allowed per route.
_ROUTES: dict[str, tuple[str, ...]] = {
    SHARDS_PATH: ("GET", "DELETE"),
    SNAPSHOT_PATH: ("PUT",),
    DELTA_PATH: ("POST",),
    SNAPSHOT_FILE_PATH: ("POST",),
}

#: Bodies of refused requests up to this size are read (and dropped) before answering.
_DRAIN_LIMIT = 1 << 20

Listener = Callable[[ShardKey, SuffixTree | None], None]


class _RefusedError(Exception):
    """A request refused with an error answer (internal control flow)."""

    def __init__(self, response: WireResponse) -> None:
        super().__init__(response.status)
        self.response = response


class ShardIntake:
    """Receives shards pushed by `ShardPusher` and holds the worker's trees.

    Args:
        api_key: when set, every request needs ``Authorization: Bearer <key>``.
        max_depth: depth of every tree; shards of another depth get 409.
        max_body_bytes: largest request body accepted (413 above).
        shm_dir: directory that ``snapshot-file`` paths must lie in (after
            resolving symlinks); None refuses every ``snapshot-file`` (403).
        busy_timeout: seconds a delta waits for a tree's readers (then 503).

    Attributes:
        instance: a random id of this intake (uuid4 hex); a pusher that sees
            it change knows the worker restarted and resends snapshots.

    Thread-safe: requests may be handled from many threads at once.
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        max_depth: int = 64,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        shm_dir: str | os.PathLike[str] | None = None,
        busy_timeout: float = 1.0,
    ) -> None:
        """Create an empty intake (see the class docstring for the arguments)."""
        max_depth = check_max_depth(max_depth)
        max_body_bytes = as_int(max_body_bytes, "max_body_bytes", 1)
        self.instance: str = uuid.uuid4().hex
        self.max_depth = max_depth
        self.max_body_bytes = max_body_bytes
        self.shm_dir: Path | None = None if shm_dir is None else Path(shm_dir).resolve()
        self.busy_timeout = float(busy_timeout)
        self._api_key = api_key or None
        self._trees: dict[ShardKey, SuffixTree] = {}
        self._lock = threading.Lock()  # guards _trees and serialises modifications
        self._listeners: list[Listener] = []

    # --- consumers --------------------------------------------------------

    def tree(self, key: ShardKey) -> SuffixTree | None:
        """The live tree of a shard (read it only), or None."""
        return self._trees.get(key)

    def keys(self) -> list[ShardKey]:
        """Keys of every shard held."""
        with self._lock:
            return list(self._trees)

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(key, tree)`` after each change (tree None: the shard was dropped).

        Listeners run in the request's thread; exceptions are logged and ignored.
        """
        self._listeners.append(fn)

    def shards(self) -> list[WorkerShard]:
        """The shard list of ``GET /v1/agentspec/shards``."""
        with self._lock:
            items = list(self._trees.items())
        return [_shard_info(k, t) for k, t in items]

    # --- HTTP -------------------------------------------------------------

    def precheck(
        self, method: str, path: str, headers: Mapping[str, str], content_length: int | None
    ) -> WireResponse | None:
        """Checks that need no body: auth, route, method, body size.

        An HTTP adapter calls this before reading the body (so an oversized
        or unauthenticated request is refused unread); `handle` calls it too.
        Returns the error answer, or None when the request may proceed.
        """
        lower = {k.lower(): v for k, v in headers.items()}
        if not check_bearer(lower.get("authorization"), self._api_key):
            return self._error(
                401,
                "missing or invalid API key",
                ErrorType.AUTHENTICATION,
                {"WWW-Authenticate": "Bearer"},
            )
        allowed = _ROUTES.get(path)
        if allowed is None:
            where = "agentspec route" if path.startswith(API_PREFIX) else "route"
            return self._error(404, f"unknown {where} {path[:200]}", ErrorType.NOT_FOUND)
        if method not in allowed:
            return self._error(
                405,
                f"{method[:20]} not allowed on {path}",
                ErrorType.METHOD_NOT_ALLOWED,
                {"Allow": ", ".join(allowed)},
            )
        if content_length is not None and content_length > self.max_body_bytes:
            return self._error(
                413,
                f"body of {content_length} bytes exceeds the limit of {self.max_body_bytes}",
                ErrorType.PAYLOAD_TOO_LARGE,
            )
        return None

    def handle(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> WireResponse:
        """Answer one request (never raises for bad input: errors become answers)."""
        method = method.upper()
        early = self.precheck(method, path, headers, len(body))
        if early is not None:
            return early
        lower = {k.lower(): v for k, v in headers.items()}
        try:
            if path == SHARDS_PATH and method == "GET":
                return self._ok({"shards": [s.to_json() for s in self.shards()]})
            key = self._key(query)
            if path == SHARDS_PATH:
                return self._delete(key)
            if path == SNAPSHOT_FILE_PATH:
                return self._snapshot_file(key, lower, body)
            self._check_content_type(lower)
            if path == SNAPSHOT_PATH:
                return self._replace(key, self._build(body))
            return self._delta(key, lower, body)
        except _RefusedError as r:
            return r.response

    # --- routes -----------------------------------------------------------

    def _delete(self, key: ShardKey) -> WireResponse:
        """DELETE: drop a shard (200 whether or not it existed)."""
        with self._lock:
            tree = self._trees.pop(key, None)
        if tree is not None:
            self._notify(key, None)
        return self._ok({"deleted": tree is not None})

    def _build(self, data: bytes | memoryview) -> SuffixTree:
        """A new tree from snapshot bytes (no lock held)."""
        try:
            tree = SuffixTree.from_bytes(data)
        except ShardFormatError as e:
            raise _RefusedError(self._format_error(e)) from None
        if tree.max_depth != self.max_depth:
            depth = tree.max_depth
            tree.close()
            raise _RefusedError(
                self._error(
                    409,
                    f"shard max_depth {depth} differs from the worker's {self.max_depth}",
                    ErrorType.DEPTH_MISMATCH,
                )
            )
        return tree

    def _replace(self, key: ShardKey, tree: SuffixTree) -> WireResponse:
        """Swap a freshly built tree in; the old one is left to its readers."""
        with self._lock:
            self._trees[key] = tree
        self._notify(key, tree)
        _log.debug("agentspec.intake.snapshot", key=key, sequences=len(tree))
        return self._ok(_shard_info(key, tree).to_json())

    def _delta(self, key: ShardKey, headers: Mapping[str, str], body: bytes) -> WireResponse:
        """POST delta: apply in place (validated first, idempotent)."""
        expected = headers.get(INSTANCE_HEADER.lower())
        if expected is not None and expected != self.instance:
            raise _RefusedError(
                self._error(
                    409,
                    f"delta computed for instance {expected[:64]}, this worker is "
                    f"{self.instance}: send a snapshot",
                    ErrorType.INSTANCE_MISMATCH,
                )
            )
        deadline = time.monotonic() + self.busy_timeout
        with self._lock:
            tree = self._trees.get(key)
            fresh = tree is None
            if tree is None:
                tree = SuffixTree(self.max_depth)
            while True:
                try:
                    tree.load(body)
                    break
                except DepthMismatchError as e:
                    raise _RefusedError(
                        self._error(409, str(e), ErrorType.DEPTH_MISMATCH)
                    ) from None
                except ShardFormatError as e:
                    raise _RefusedError(self._format_error(e)) from None
                except InvalidArgumentError as e:  # snapshot bytes into a non-empty tree
                    raise _RefusedError(
                        self._error(
                            400,
                            f"not a delta for an existing shard ({e}); PUT snapshots instead",
                            ErrorType.SHARD_FORMAT,
                        )
                    ) from None
                except RuntimeError:  # readers are drafting from this tree right now
                    if time.monotonic() >= deadline:
                        raise _RefusedError(
                            self._error(
                                503,
                                "shard is busy with readers",
                                ErrorType.BUSY,
                                {"retry-after-ms": "20"},
                            )
                        ) from None
                    time.sleep(0.001)
            if fresh:
                self._trees[key] = tree
        self._notify(key, tree)
        return self._ok(_shard_info(key, tree).to_json())

    def _snapshot_file(
        self, key: ShardKey, headers: Mapping[str, str], body: bytes
    ) -> WireResponse:
        """POST snapshot-file: load a snapshot file from the shm dir."""
        ctype = headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise _RefusedError(
                self._error(415, "snapshot-file takes JSON", ErrorType.UNSUPPORTED_MEDIA_TYPE)
            )
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        raw = obj.get("path") if isinstance(obj, dict) else None
        if not isinstance(raw, str) or not raw or "\x00" in raw:
            raise _RefusedError(
                self._error(400, 'body must be JSON {"path": str}', ErrorType.INVALID_REQUEST)
            )
        if self.shm_dir is None:
            raise _RefusedError(
                self._error(403, "snapshot files are disabled on this worker", ErrorType.FORBIDDEN)
            )
        resolved = Path(raw).resolve()
        if not resolved.is_relative_to(self.shm_dir) or resolved == self.shm_dir:
            raise _RefusedError(
                self._error(
                    403,
                    f"path is outside the allowed directory {self.shm_dir}",
                    ErrorType.FORBIDDEN,
                )
            )
        try:
            fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                with os.fdopen(fd, "rb", closefd=False) as f:
                    data = f.read()
            finally:
                os.close(fd)
        except OSError as e:
            raise _RefusedError(
                self._error(
                    400, f"cannot read snapshot file: {e.strerror}", ErrorType.INVALID_REQUEST
                )
            ) from None
        return self._replace(key, self._build(data))

    # --- helpers ----------------------------------------------------------

    def _key(self, query: str) -> ShardKey:
        """The shard key of a query string (400 when invalid)."""
        try:
            return decode_key_query(query)
        except InvalidArgumentError as e:
            raise _RefusedError(self._error(400, str(e), ErrorType.INVALID_REQUEST)) from None

    def _check_content_type(self, headers: Mapping[str, str]) -> None:
        """Shard bytes must be sent as `SHARD_CONTENT_TYPE` (or untyped)."""
        ctype = headers.get("content-type")
        if ctype is None:
            return
        base = ctype.split(";")[0].strip().lower()
        if base not in (SHARD_CONTENT_TYPE, "application/octet-stream"):
            raise _RefusedError(
                self._error(
                    415,
                    f"shard bytes must be sent as {SHARD_CONTENT_TYPE}, not {base[:80]}",
                    ErrorType.UNSUPPORTED_MEDIA_TYPE,
                )
            )

    def _notify(self, key: ShardKey, tree: SuffixTree | None) -> None:
        """Run the listeners."""
        for fn in list(self._listeners):
            try:
                fn(key, tree)
            except Exception:
                _log.exception("agentspec.intake.listener_failed", key=key)

    def _ok(self, obj: dict[str, Any]) -> WireResponse:
        """200 JSON with the instance id."""
        return json_response(
            200, {"instance": self.instance, **obj}, {INSTANCE_HEADER: self.instance}
        )

    def _error(
        self, status: int, message: str, type_: str, headers: Mapping[str, str] | None = None
    ) -> WireResponse:
        """A JSON error carrying the instance header."""
        return error_response(
            status, message, type_, {INSTANCE_HEADER: self.instance, **(headers or {})}
        )

    def _format_error(self, e: ShardFormatError) -> WireResponse:
        """400 for malformed shard bytes."""
        return self._error(400, f"malformed shard bytes: {e}", ErrorType.SHARD_FORMAT)


def _shard_info(key: ShardKey, tree: SuffixTree) -> WorkerShard:
    """The list entry of one shard."""
    st = tree.stats()
    ids = tree.sequence_ids()
    return WorkerShard(key, st.sequences, st.tokens, st.bytes, max(ids, default=0))


# --- stdlib HTTP adapter ----------------------------------------------------


class IntakeHTTPServer(ThreadingHTTPServer):
    """A `ThreadingHTTPServer` serving one `ShardIntake` (keep-alive, HTTP/1.1).

    `stop` closes the listening socket *and* every open connection, so a
    client holding a keep-alive connection sees the restart.
    """

    daemon_threads = True
    block_on_close = False

    def __init__(
        self,
        address: tuple[str, int],
        intake: ShardIntake,
        handler: type[IntakeRequestHandler] | None = None,
    ) -> None:
        """Bind to ``address`` (port 0: any free port) without serving yet."""
        self.intake = intake
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, handler or IntakeRequestHandler)

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        """``http://host:port`` of this server."""
        host = self.server_address[0]
        if isinstance(host, bytes):
            host = host.decode()
        return f"http://{host}:{self.port}"

    def track(self, conn: socket.socket, add: bool) -> None:
        """Register (add) or forget an open connection."""
        with self._conns_lock:
            if add:
                self._conns.add(conn)
            else:
                self._conns.discard(conn)

    def drop_connections(self) -> None:
        """Shut every open connection down (their handler threads then end)."""
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Log a failed request (a client dropping its connection is routine)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            _log.debug(
                "agentspec.intake.connection_lost", client=str(client_address), error=str(exc)
            )
        else:
            _log.exception("agentspec.intake.request_failed", client=str(client_address))

    def stop(self, thread: threading.Thread | None = None, timeout: float = 5.0) -> None:
        """Stop serving, close every connection and the socket, join ``thread``."""
        self.shutdown()
        self.drop_connections()
        self.server_close()
        if thread is not None:
            thread.join(timeout)


class IntakeRequestHandler(BaseHTTPRequestHandler):
    """Routes every request to the server's intake; subclass `dispatch` to intercept."""

    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: without TCP_NODELAY, Nagle's
    # algorithm and the client's delayed ACK add ~40 ms to every answer.
    disable_nagle_algorithm = True
    server: IntakeHTTPServer
    #: Idle keep-alive connections are closed after this many seconds.
    timeout = 60.0

    def setup(self) -> None:
        """Register the connection with the server."""
        super().setup()
        self.server.track(self.connection, True)

    def finish(self) -> None:
        """Forget the connection."""
        self.server.track(self.connection, False)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        """Log through structlog at debug level instead of stderr."""
        _log.debug("agentspec.intake.http", message=format % args)

    def dispatch(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> WireResponse | None:
        """Answer a request (None: send nothing; the connection is then closed)."""
        return self.server.intake.handle(method, path, query, headers, body)

    def _serve(self) -> None:
        """Read the request, dispatch it and write the answer."""
        path, _, query = self.path.partition("?")
        headers = dict(self.headers.items())
        try:
            length = parse_content_length(self.headers.get("Content-Length"))
        except ValueError:
            self._send(error_response(400, "bad Content-Length", ErrorType.INVALID_REQUEST), True)
            return
        early = self.server.intake.precheck(self.command, path, headers, length)
        if early is not None:
            # A small body is read and dropped so that the client, still
            # sending it, gets the answer rather than a connection reset.
            unread = length is not None and length > 0
            if unread and length is not None and length <= _DRAIN_LIMIT:
                unread = len(self.rfile.read(length)) != length
            self._send(early, close=unread)
            return
        if length is None and self.command in ("PUT", "POST"):
            self._send(
                error_response(411, "Content-Length required", ErrorType.LENGTH_REQUIRED), True
            )
            return
        body = self.rfile.read(length) if length else b""
        if length and len(body) != length:
            self.close_connection = True
            return
        response = self.dispatch(self.command, path, query, headers, body)
        if response is None:
            self.close_connection = True
            return
        self._send(response, close=False)

    def _send(self, response: WireResponse, close: bool) -> None:
        """Write one answer."""
        self.send_response(response.status)
        for k, v in response.headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(response.body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(response.body)

    def do_GET(self) -> None:
        """Serve a GET request."""
        self._serve()

    def do_PUT(self) -> None:
        """Serve a PUT request."""
        self._serve()

    def do_POST(self) -> None:
        """Serve a POST request."""
        self._serve()

    def do_DELETE(self) -> None:
        """Serve a DELETE request."""
        self._serve()

    def do_PATCH(self) -> None:
        """Serve a PATCH request."""
        self._serve()


def serve_intake(
    intake: ShardIntake,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    handler: type[IntakeRequestHandler] | None = None,
) -> tuple[IntakeHTTPServer, threading.Thread]:
    """Serve ``intake`` over HTTP on a daemon thread; returns ``(server, thread)``.

    Port 0 picks a free port (``server.port``).  Stop with
    ``server.stop(thread)``.
    """
    server = IntakeHTTPServer((host, as_int(port, "port")), intake, handler)
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.05},
        name=f"agentspec-intake-{server.port}",
        daemon=True,
    )
    thread.start()
    return server, thread
