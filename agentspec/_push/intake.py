"""`ShardIntake`: the worker side of the shard push protocol, framework-neutral.

A worker (the vLLM endpoint plugin, the embedded engine, a standalone
sidecar, the test servers) holds one `ShardIntake` and routes every request
under ``/v1/agentspec/`` to `ShardIntake.handle`, which returns a
`WireResponse`.  The intake keeps one `SuffixTree` per shard key:

* a snapshot (``PUT .../snapshot`` or ``POST .../snapshot-file``) is loaded
  into a new tree outside any lock and swapped in atomically, so readers see
  either the old or the new shard, never a half-loaded one;
* a delta (``POST .../delta``) is applied in place with `SuffixTree.load`,
  which validates the bytes before changing anything (malformed bytes: 400,
  the shard is unchanged) and skips ids already present, so a retried delta
  never counts a sequence twice.  When readers are drafting from the tree
  right then, the delta goes into a copy of it that is swapped in
  atomically instead: a push never waits for generation.

Shard bytes are checked before any tree is built: the fixed header first
(`as_shard_peek`, O(1): a shard of another depth gets 409 whatever its
size, one that cannot fit the memory budget 507), then, when the intake
knows the model's ``vocab_size``, every token id (`as_shard_max_token`, one
pass over the bytes: a shard holding an id >= vocab_size gets 422 and
changes nothing).  Building costs about tokens x depth; these checks cost
at most one pass over bytes already in memory.

Memory budgets (``max_bytes`` in total, ``max_tenant_bytes`` per tenant;
live bytes of the trees, see `agentspec._core.budget`): a push that would take a
tenant or the intake over its budget is refused with 507 and changes
nothing.  A snapshot is refused from its header when even the fewest bytes
a tree of its sizes can take would not fit; otherwise it is built and its
exact size checked before it is swapped in (a refused tree is dropped at
once).  A delta is refused from its header the same way when it removes
nothing; otherwise it is applied, measured, and undone when it does not
fit.  Builds in flight reserve their lower bound, so concurrent pushes
cannot all pass the early check together.  ``GET .../shards`` reports the
bytes held and the refusals per tenant (``"budget"``).

Modifications of one shard are serialised by a lock of that key only (taken
for a delta's apply and a snapshot's swap, never while a snapshot is built),
so a large push to one key never delays pushes to other keys; a global lock
guards only the dictionaries.

Consumers (the proposer) read trees with `tree` and learn about changes
through `add_listener`.  A tree refuses a modification while another thread
reads it (see `SuffixTree`); a delta that meets readers is therefore
applied to a copy (above).  Readers may see RuntimeError while a delta is
being applied in place.

`serve_intake` runs an intake behind `agentspec._util.http_server`'s
threaded server (tests, benchmarks, a standalone sidecar);
`serve_shard_request` serves the shard routes from another server's handler.

The intake's jobs live in one module each: this one routes requests and
swaps trees; `_intake_checks` checks shard bytes before anything is built,
`_intake_budget` keeps the byte accounting, `_intake_files` reads snapshot
files from shared memory (O_NOFOLLOW), `_intake_base` holds the shared state
and answers.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from agentspec._core.budget import (
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_MAX_TENANT_SHARD_BYTES,
    format_bytes,
    live_bytes,
    min_tree_bytes,
    parse_byte_size,
    shard_token_count,
)
from agentspec._core.draft import check_max_depth
from agentspec._core.tree import SuffixTree
from agentspec._push._intake_base import Listener, _KeyLocks, _RefusedError, _shard_info, _Usage
from agentspec._push._intake_budget import _BudgetKeeper, _delta_plan
from agentspec._push._intake_checks import _ShardChecks
from agentspec._push._intake_files import _open_beneath as _open_beneath
from agentspec._push._intake_files import _SnapshotFiles
from agentspec._push.wire import (
    API_PREFIX,
    DEFAULT_MAX_BODY_BYTES,
    DELTA_PATH,
    INSTANCE_HEADER,
    SHARDS_PATH,
    SNAPSHOT_FILE_PATH,
    SNAPSHOT_PATH,
    ErrorType,
    ShardKey,
    WireResponse,
    WorkerShard,
    check_bearer,
    error_response,
    parse_content_length,
)
from agentspec._util.args import as_int
from agentspec._util.http_server import LISTEN_BACKLOG as LISTEN_BACKLOG
from agentspec._util.http_server import ThreadedHTTPServer, TrackedRequestHandler
from agentspec._util.log import get_logger
from agentspec.exceptions import (
    DepthMismatchError,
    InvalidArgumentError,
    ShardFormatError,
)

__all__ = [
    "IntakeHTTPServer",
    "IntakeRequestHandler",
    "ShardIntake",
    "send_wire_response",
    "serve_intake",
    "serve_shard_request",
]

_log = get_logger()

#: The routes that change a shard's content (counted by `ShardIntake.push_counts`).
_PUSH_PATHS = frozenset({SNAPSHOT_PATH, DELTA_PATH, SNAPSHOT_FILE_PATH})

#: Methods allowed per route.
_ROUTES: dict[str, tuple[str, ...]] = {
    SHARDS_PATH: ("GET", "DELETE"),
    SNAPSHOT_PATH: ("PUT",),
    DELTA_PATH: ("POST",),
    SNAPSHOT_FILE_PATH: ("POST",),
}

#: Bodies of refused requests up to this size are read (and dropped) before answering.
_DRAIN_LIMIT = 1 << 20

#: Largest ``vocab_size``: token ids are int32 values >= 0.
_VOCAB_MAX = 2**31


class ShardIntake(_ShardChecks, _BudgetKeeper, _SnapshotFiles):
    """Receives shards pushed by `ShardPusher` and holds the worker's trees.

    Args:
        api_key: when set, every request needs ``Authorization: Bearer <key>``.
        max_depth: depth of every tree; shards of another depth get 409
            (decided from the shard's header, before anything is built).
        max_body_bytes: largest request body accepted (413 above), and
            largest ``snapshot-file`` file.
        shm_dir: directory that ``snapshot-file`` paths must lie in (after
            resolving symlinks); only regular files are read.  None refuses
            every ``snapshot-file`` (403).
        busy_timeout: seconds undoing a delta over the budget waits for the
            tree's readers.
        vocab_size: the served model's vocabulary size, or None.  When set,
            a snapshot or delta holding a token id >= vocab_size is refused
            with 422 ``out_of_vocabulary`` and the shard is left unchanged.
        max_bytes: budget of all shards together, in live bytes (default
            1 GiB; None: none); a push that would exceed it gets 507.
        max_tenant_bytes: budget of one tenant's shards (default 256 MiB;
            None: none); a push that would exceed it gets 507.  Both accept
            sizes such as ``"512MiB"``.

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
        vocab_size: int | None = None,
        max_bytes: int | str | None = DEFAULT_MAX_SHARD_BYTES,
        max_tenant_bytes: int | str | None = DEFAULT_MAX_TENANT_SHARD_BYTES,
    ) -> None:
        """Create an empty intake (see the class docstring for the arguments)."""
        max_depth = check_max_depth(max_depth)
        max_body_bytes = as_int(max_body_bytes, "max_body_bytes", 1)
        self.max_bytes: int | None = parse_byte_size(max_bytes, "max_bytes")
        self.max_tenant_bytes: int | None = parse_byte_size(max_tenant_bytes, "max_tenant_bytes")
        self.instance: str = uuid.uuid4().hex
        self.max_depth = max_depth
        self.max_body_bytes = max_body_bytes
        self.shm_dir: Path | None = None if shm_dir is None else Path(shm_dir).resolve()
        self.busy_timeout = float(busy_timeout)
        self._vocab_size: int | None = None
        self.vocab_size = vocab_size
        self._api_key = api_key or None
        self._trees: dict[ShardKey, SuffixTree] = {}
        # Each shard's list entry, computed after its last change (under its key
        # lock, when no modification of it can run), so listing never reads a
        # tree that a delta is modifying.
        self._infos: dict[ShardKey, WorkerShard] = {}
        self._lock = threading.Lock()  # guards _trees, _infos and the budget (O(1) steps)
        self._key_locks = _KeyLocks()  # serialise the modifications of one key
        self._listeners: list[Listener] = []
        # Budget accounting (under _lock): live bytes per key and per tenant.
        self._held: dict[ShardKey, int] = {}
        self._usage: dict[str, _Usage] = {}
        self._total = 0
        self._reserved = 0
        self.refused = 0  # pushes refused for lack of room (507)
        self.too_large = 0  # requests refused for their size (413)
        self._extra_stats: dict[str, Callable[[], Any]] = {}
        self._pushes: dict[tuple[str, str], int] = {}  # (result, status) -> count

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary bound on token ids of pushed shards (None: no bound).

        May be set later (e.g. once the model is loaded); it applies to the
        requests that start checking after that.
        """
        return self._vocab_size

    @vocab_size.setter
    def vocab_size(self, value: int | None) -> None:
        self._vocab_size = (
            None
            if value is None
            else as_int(value, "vocab_size", 1, _VOCAB_MAX, expected="an int or None")
        )

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
            return list(self._infos.values())

    def add_stats(self, name: str, fn: Callable[[], Any]) -> None:
        """Add ``name: fn()`` to the ``GET /v1/agentspec/shards`` answer (e.g. the
        learned shards' memory, from the engine holding them).  Exceptions are
        logged and the entry left out."""
        self._extra_stats[name] = fn

    def push_counts(self) -> dict[tuple[str, str], int]:
        """Shard pushes answered so far (snapshot, delta and snapshot-file routes), by
        ``(result, status)``: result ``"accepted"`` (2xx) or ``"refused"``, status the
        answer's HTTP status as text."""
        with self._lock:
            return dict(self._pushes)

    def count_push(self, path: str, status: int) -> None:
        """Count one answer on ``path`` in `push_counts` (other routes are not pushes)."""
        if path not in _PUSH_PATHS:
            return
        key = ("accepted" if 200 <= status < 300 else "refused", str(status))
        with self._lock:
            self._pushes[key] = self._pushes.get(key, 0) + 1

    def _list_answer(self) -> WireResponse:
        """The ``GET /v1/agentspec/shards`` answer."""
        obj: dict[str, Any] = {
            "shards": [s.to_json() for s in self.shards()],
            "budget": self.budget(),
        }
        for name, fn in list(self._extra_stats.items()):
            try:
                obj[name] = fn()
            except Exception:
                _log.exception("agentspec.intake.stats_failed", stat=name)
        return self._ok(obj)

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
            with self._lock:
                self.too_large += 1
            return self._error(
                413,
                f"body of {content_length} bytes exceeds the limit of {self.max_body_bytes} "
                f"({format_bytes(self.max_body_bytes)}, max_body_bytes)",
                ErrorType.PAYLOAD_TOO_LARGE,
            )
        return None

    def handle(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> WireResponse:
        """Answer one request (never raises for bad input: errors become answers)."""
        answer = self._handle(method.upper(), path, query, headers, body)
        self.count_push(path, answer.status)
        return answer

    def _handle(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> WireResponse:
        early = self.precheck(method, path, headers, len(body))
        if early is not None:
            return early
        lower = {k.lower(): v for k, v in headers.items()}
        try:
            if path == SHARDS_PATH and method == "GET":
                return self._list_answer()
            key = self._key(query)
            if path == SHARDS_PATH:
                return self._delete(key)
            if path == SNAPSHOT_FILE_PATH:
                return self._snapshot_file(key, lower, body)
            self._check_content_type(lower)
            if path == SNAPSHOT_PATH:
                return self._snapshot(key, body)
            return self._delta(key, lower, body)
        except _RefusedError as r:
            return r.response
        except Exception:  # a bug: logged, answered without internal text
            _log.exception("agentspec.intake.internal_error", path=path[:200])
            return self._error(500, "internal error", ErrorType.INTERNAL)

    # --- routes -----------------------------------------------------------

    def _delete(self, key: ShardKey) -> WireResponse:
        """DELETE: drop a shard (200 whether or not it existed)."""
        with self._key_locks.hold(key), self._lock:
            tree = self._trees.pop(key, None)
            self._infos.pop(key, None)
            self._account(key, None)
        if tree is not None:
            self._notify(key, None)
        return self._ok({"deleted": tree is not None})

    def _snapshot(self, key: ShardKey, data: bytes | bytearray | memoryview) -> WireResponse:
        """PUT snapshot (and snapshot-file): check, build within the budget, swap in."""
        if not self.budgeted:
            return self._replace(key, self._build(data))
        _, n_seq, n_rem = self._check_header(data)
        floor = min_tree_bytes(n_seq, shard_token_count(len(data), n_seq, n_rem))
        tenant = key[0]
        with self._lock:
            self._check_room(key, floor, estimate=True)
            self._usage_of(tenant).reserved += floor
            self._reserved += floor
        tree: SuffixTree | None = None
        try:
            self._check_vocab(data)
            tree = self._build_checked(data)
            return self._replace(key, tree, floor)  # releases the reservation when it swaps
        except BaseException:
            with self._lock:
                self._release(tenant, floor)
            if tree is not None:
                tree.close()
            raise

    def _replace(self, key: ShardKey, tree: SuffixTree, floor: int | None = None) -> WireResponse:
        """Swap a freshly built tree in; the old one is left to its readers.

        With a budget (``floor``: the lower bound reserved before the build)
        the tree's exact live bytes must fit, else 507 (the caller drops the
        tree and releases the reservation); the swap releases it.
        """
        info = _shard_info(key, tree)  # nobody else holds the new tree yet
        size = live_bytes(tree.stats())
        with self._key_locks.hold(key), self._lock:
            if floor is not None:
                self._check_room(key, size, estimate=False)
                self._release(key[0], floor)
            self._trees[key] = tree
            self._infos[key] = info
            self._account(key, size)
        self._notify(key, tree)
        _log.debug("agentspec.intake.snapshot", key=key, sequences=info.sequences)
        return self._ok(info.to_json())

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
        _, n_seq, n_rem = self._check_header(body)
        self._check_vocab(body)
        with self._key_locks.hold(key):
            tree = self._trees.get(key)
            fresh = tree is None
            if tree is None:
                tree = SuffixTree(self.max_depth)
            plan = None
            if self.budgeted:
                plan = _delta_plan(tree, body, n_seq, n_rem)
                self._check_delta_floor(key, tree, plan, fresh)
            try:
                self._load_delta(tree, body)
            except RuntimeError:  # readers are drafting from it: apply to a copy, swap it in
                tree = SuffixTree.from_bytes(tree.to_bytes())  # reading beside readers is fine
                try:
                    self._load_delta(tree, body)
                except BaseException:
                    tree.close()
                    raise
                fresh = True  # nobody else holds the copy: over the budget, it is dropped
            if plan is not None:
                self._fit_delta(key, tree, plan, fresh)
            info = _shard_info(key, tree)
            with self._lock:
                if fresh:
                    self._trees[key] = tree
                self._infos[key] = info
                self._account(key, live_bytes(tree.stats()))
        self._notify(key, tree)
        return self._ok(info.to_json())

    def _load_delta(self, tree: SuffixTree, body: bytes) -> None:
        """`SuffixTree.load` a delta, its refusals as answers (RuntimeError: readers)."""
        try:
            tree.load(body)
        except DepthMismatchError as e:
            raise _RefusedError(self._error(409, str(e), ErrorType.DEPTH_MISMATCH)) from None
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
        return self._snapshot(key, self._read_shm_file(raw, self.shm_dir))


# --- stdlib HTTP adapter ----------------------------------------------------


class IntakeHTTPServer(ThreadedHTTPServer):
    """A `ThreadedHTTPServer` serving one `ShardIntake` (keep-alive, HTTP/1.1).

    `stop` closes the listening socket *and* every open connection, so a
    client holding a keep-alive connection sees the restart.
    """

    log_name = "agentspec.intake"

    def __init__(
        self,
        address: tuple[str, int],
        intake: ShardIntake,
        handler: type[IntakeRequestHandler] | None = None,
    ) -> None:
        """Bind to ``address`` (port 0: any free port) without serving yet."""
        self.intake = intake
        super().__init__(address, handler or IntakeRequestHandler)


class IntakeRequestHandler(TrackedRequestHandler, BaseHTTPRequestHandler):
    """Routes every request to the server's intake; subclass `dispatch` to intercept."""

    server: IntakeHTTPServer

    def dispatch(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> WireResponse | None:
        """Answer a request (None: send nothing; the connection is then closed)."""
        return self.server.intake.handle(method, path, query, headers, body)

    def _serve(self) -> None:
        """Read the request, dispatch it and write the answer."""
        serve_shard_request(self, self.server.intake, self.dispatch)

    def _send(self, response: WireResponse, close: bool) -> None:
        """Write one answer."""
        send_wire_response(self, response, close)

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
    vocab_size: int | None = None,
) -> tuple[IntakeHTTPServer, threading.Thread]:
    """Serve ``intake`` over HTTP on a daemon thread; returns ``(server, thread)``.

    Port 0 picks a free port (``server.port``).  Stop with
    ``server.stop(thread)``.  ``vocab_size``, when given, sets
    ``intake.vocab_size`` (shards holding ids outside the vocabulary get 422);
    None leaves the intake's own setting.  The listen backlog is
    `LISTEN_BACKLOG` (1024).
    """
    if vocab_size is not None:
        intake.vocab_size = vocab_size
    server = IntakeHTTPServer((host, as_int(port, "port")), intake, handler)
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.05},
        name=f"agentspec-intake-{server.port}",
        daemon=True,
    )
    thread.start()
    return server, thread


def serve_shard_request(
    handler: BaseHTTPRequestHandler,
    intake: ShardIntake,
    dispatch: Callable[[str, str, str, Mapping[str, str], bytes], WireResponse | None],
) -> None:
    """Serve the request ``handler`` has parsed: precheck, read the body, dispatch, answer.

    `IntakeRequestHandler` serves every request this way; a server mounting
    the shard routes beside its own (the engine's) calls it for them.
    ``dispatch`` answers the request (None: send nothing, close the connection).
    """
    path, _, query = handler.path.partition("?")
    headers = dict(handler.headers.items())
    try:
        length = parse_content_length(handler.headers.get("Content-Length"))
    except ValueError:
        send_wire_response(
            handler, error_response(400, "bad Content-Length", ErrorType.INVALID_REQUEST), True
        )
        return
    early = intake.precheck(handler.command, path, headers, length)
    if early is not None:
        intake.count_push(path, early.status)
        # A small body is read and dropped so that the client, still
        # sending it, gets the answer rather than a connection reset.
        unread = length is not None and length > 0
        if unread and length is not None and length <= _DRAIN_LIMIT:
            unread = len(handler.rfile.read(length)) != length
        send_wire_response(handler, early, close=unread)
        return
    if length is None and handler.command in ("PUT", "POST"):
        send_wire_response(
            handler,
            error_response(411, "Content-Length required", ErrorType.LENGTH_REQUIRED),
            True,
        )
        return
    body = handler.rfile.read(length) if length else b""
    if length and len(body) != length:
        handler.close_connection = True
        return
    response = dispatch(handler.command, path, query, headers, body)
    if response is None:
        handler.close_connection = True
        return
    send_wire_response(handler, response, close=False)


def send_wire_response(
    handler: BaseHTTPRequestHandler, response: WireResponse, close: bool
) -> None:
    """Write one `WireResponse` through ``handler`` (``close``: end the connection after it)."""
    handler.send_response(response.status)
    for k, v in response.headers.items():
        handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(response.body)))
    if close:
        handler.send_header("Connection", "close")
        handler.close_connection = True
    handler.end_headers()
    handler.wfile.write(response.body)
