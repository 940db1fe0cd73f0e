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
  never counts a sequence twice.

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
reads it (see `SuffixTree`); a delta therefore waits up to ``busy_timeout``
seconds for readers to finish, then answers 503 (the pusher retries).
Readers may likewise see RuntimeError while a delta is being applied.

`serve_intake` runs an intake behind the stdlib `ThreadingHTTPServer`
(tests, benchmarks, a standalone sidecar).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import stat
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from agentspec._core import lowlevel
from agentspec._core.budget import (
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_MAX_TENANT_SHARD_BYTES,
    MIN_TOKEN_BYTES,
    format_bytes,
    live_bytes,
    min_tree_bytes,
    parse_byte_size,
    shard_token_count,
)
from agentspec._core.draft import check_max_depth
from agentspec._core.tree import SuffixTree
from agentspec._push.wire import (
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
from agentspec._util.args import as_int
from agentspec._util.log import get_logger
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

#: ``listen()`` backlog of `IntakeHTTPServer` (socketserver's default, 5, drops
#: bursts of connections: clients then wait for SYN retransmits, or time out).
LISTEN_BACKLOG = 1024

#: Largest ``vocab_size``: token ids are int32 values >= 0.
_VOCAB_MAX = 2**31

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

#: Seconds an over-budget delta's undo waits for the tree's readers.
_UNDO_TIMEOUT = 30.0

Listener = Callable[[ShardKey, SuffixTree | None], None]


class _Usage:
    """What one tenant holds in an intake (guarded by the intake's lock)."""

    __slots__ = ("bytes", "refused", "reserved", "shards")

    def __init__(self) -> None:
        self.bytes = 0  # live bytes of its shards
        self.reserved = 0  # lower bounds of its snapshots being built
        self.shards = 0
        self.refused = 0  # pushes refused for lack of room (507)


class _DeltaPlan:
    """What a delta would change in a tree, read before applying it (to undo it)."""

    __slots__ = ("added", "new_tokens", "removed")

    def __init__(self) -> None:
        self.added: list[int] = []  # ids the delta adds (absent before, or removed first)
        self.new_tokens = 0  # tokens of those sequences
        self.removed: dict[int, list[int]] = {}  # present ids it removes -> their tokens


class _RefusedError(Exception):
    """A request refused with an error answer (internal control flow)."""

    def __init__(self, response: WireResponse) -> None:
        super().__init__(response.status)
        self.response = response


class _KeyLocks:
    """One lock per shard key, made on first use and dropped when no thread needs it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()  # guards _locks only; never held while waiting
        self._locks: dict[ShardKey, list[Any]] = {}  # key -> [lock, threads using it]

    @contextlib.contextmanager
    def hold(self, key: ShardKey) -> Iterator[None]:
        """Hold the lock of ``key`` for the ``with`` block."""
        with self._guard:
            entry = self._locks.get(key)
            if entry is None:
                entry = self._locks[key] = [threading.Lock(), 0]
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._guard:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._locks[key]

    def __len__(self) -> int:
        """Keys with a lock in use (for tests)."""
        with self._guard:
            return len(self._locks)


class ShardIntake:
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
        busy_timeout: seconds a delta waits for a tree's readers (then 503).
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

    @property
    def budgeted(self) -> bool:
        """Whether pushes are checked against a memory budget."""
        return self.max_bytes is not None or self.max_tenant_bytes is not None

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

    def held_bytes(self, tenant: str | None = None) -> int:
        """Live bytes of the shards held (of one tenant, or of all)."""
        with self._lock:
            if tenant is None:
                return self._total
            usage = self._usage.get(tenant)
            return 0 if usage is None else usage.bytes

    def budget(self) -> dict[str, Any]:
        """The ``"budget"`` object of ``GET /v1/agentspec/shards`` (JSON-ready).

        ``bytes``: live bytes held; ``refused``: pushes refused with 507;
        ``too_large``: requests refused with 413; per tenant the bytes, shard
        count and 507 refusals.
        """
        with self._lock:
            tenants = {
                tenant: {"bytes": u.bytes, "shards": u.shards, "refused": u.refused}
                for tenant, u in sorted(self._usage.items())
            }
            return {
                "max_bytes": self.max_bytes,
                "max_tenant_bytes": self.max_tenant_bytes,
                "max_body_bytes": self.max_body_bytes,
                "bytes": self._total,
                "refused": self.refused,
                "too_large": self.too_large,
                "tenants": tenants,
            }

    def add_stats(self, name: str, fn: Callable[[], Any]) -> None:
        """Add ``name: fn()`` to the ``GET /v1/agentspec/shards`` answer (e.g. the
        learned shards' memory, from the engine holding them).  Exceptions are
        logged and the entry left out."""
        self._extra_stats[name] = fn

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
        method = method.upper()
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

    def _check_shard(self, data: bytes | bytearray | memoryview) -> None:
        """Refuse shard bytes before anything is built from them.

        The header alone (O(1)) decides a malformed header (400) and a depth
        mismatch (409); with a ``vocab_size``, one pass over the validated
        bytes finds their largest token id (422 when outside the vocabulary).
        Building a tree costs about tokens x depth, so a shard that will be
        refused never costs more than reading it.
        """
        self._check_header(data)
        self._check_vocab(data)

    def _check_header(self, data: bytes | bytearray | memoryview) -> tuple[int, int, int]:
        """``(kind, n_sequences, n_removals)`` from the header (400, 409 raise)."""
        try:
            kind, depth, n_seq, n_rem = lowlevel.shard_peek(data)
        except ShardFormatError as e:
            raise _RefusedError(self._format_error(e)) from None
        if depth != self.max_depth:
            raise _RefusedError(
                self._error(
                    409,
                    f"shard max_depth {depth} differs from the worker's {self.max_depth}",
                    ErrorType.DEPTH_MISMATCH,
                )
            )
        return kind, n_seq, n_rem

    def _check_vocab(self, data: bytes | bytearray | memoryview) -> None:
        """With a ``vocab_size``: 422 for shard bytes holding an id outside it."""
        vocab = self._vocab_size
        if vocab is not None:
            try:
                top = lowlevel.shard_max_token(data)
            except ShardFormatError as e:
                raise _RefusedError(self._format_error(e)) from None
            if top >= vocab:
                raise _RefusedError(
                    self._error(
                        422,
                        f"shard holds token id {top}, outside the worker's vocabulary "
                        f"of {vocab} tokens (ids 0..{vocab - 1}); was it learned with "
                        "another tokenizer?",
                        ErrorType.OUT_OF_VOCABULARY,
                    )
                )

    def _build(self, data: bytes | bytearray | memoryview) -> SuffixTree:
        """A new tree from snapshot bytes, checked first (no lock held)."""
        self._check_shard(data)
        return self._build_checked(data)

    def _build_checked(self, data: bytes | bytearray | memoryview) -> SuffixTree:
        """A new tree from snapshot bytes whose header was checked."""
        try:
            tree = SuffixTree.from_bytes(data)
        except ShardFormatError as e:
            raise _RefusedError(self._format_error(e)) from None
        if tree.max_depth != self.max_depth:  # the header said otherwise: cannot happen
            tree.close()
            raise _RefusedError(self._error(409, "shard depth mismatch", ErrorType.DEPTH_MISMATCH))
        return tree

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
        deadline = time.monotonic() + self.busy_timeout
        with self._key_locks.hold(key):
            tree = self._trees.get(key)
            fresh = tree is None
            if tree is None:
                tree = SuffixTree(self.max_depth)
            plan = None
            if self.budgeted:
                plan = _delta_plan(tree, body, n_seq, n_rem)
                self._check_delta_floor(key, tree, plan, fresh)
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

    # --- budget -----------------------------------------------------------

    def _usage_of(self, tenant: str) -> _Usage:
        """A tenant's usage entry, made on first use (under ``_lock``)."""
        usage = self._usage.get(tenant)
        if usage is None:
            usage = self._usage[tenant] = _Usage()
        return usage

    def _release(self, tenant: str, floor: int) -> None:
        """Release a build's reservation (under ``_lock``)."""
        self._usage_of(tenant).reserved -= floor
        self._reserved -= floor
        self._forget_idle(tenant)

    def _forget_idle(self, tenant: str) -> None:
        """Drop a tenant's entry once it holds and reserves nothing and was never refused."""
        usage = self._usage.get(tenant)
        if usage is not None and not (
            usage.bytes or usage.reserved or usage.shards or usage.refused
        ):
            del self._usage[tenant]

    def _account(self, key: ShardKey, size: int | None) -> None:
        """Record that ``key`` now holds ``size`` live bytes (None: dropped); under ``_lock``."""
        old = self._held.pop(key, None)
        usage = self._usage_of(key[0])
        if old is not None:
            usage.bytes -= old
            usage.shards -= 1
            self._total -= old
        if size is not None:
            self._held[key] = size
            usage.bytes += size
            usage.shards += 1
            self._total += size
        self._forget_idle(key[0])

    def _check_room(self, key: ShardKey, size: int, *, estimate: bool) -> None:
        """507 unless ``key`` may hold ``size`` live bytes instead of what it holds now.

        Under ``_lock``.  An ``estimate`` (a lower bound, before a build) also
        counts the lower bounds reserved by builds in flight; the exact check
        counts what is held only.
        """
        old = self._held.get(key, 0)
        usage = self._usage.get(key[0])
        tenant_now = 0 if usage is None else usage.bytes + (usage.reserved if estimate else 0)
        total_now = self._total + (self._reserved if estimate else 0)
        tenant_limit, total_limit = self.max_tenant_bytes, self.max_bytes
        what = "at least " if estimate else ""
        if tenant_limit is not None and tenant_now - old + size > tenant_limit:
            self._refuse(
                key,
                f"tenant {key[0][:100]!r} would hold {what}{format_bytes(tenant_now - old + size)} "
                f"of pushed shards, over its budget of {format_bytes(tenant_limit)} "
                f"(max_tenant_shard_bytes; it holds {format_bytes(tenant_now)} now): delete "
                "some of its shards, push smaller ones or raise the budget",
            )
        if total_limit is not None and total_now - old + size > total_limit:
            self._refuse(
                key,
                f"the worker would hold {what}{format_bytes(total_now - old + size)} of pushed "
                f"shards, over its total budget of {format_bytes(total_limit)} "
                f"(max_shard_bytes; it holds {format_bytes(total_now)} now): delete shards, "
                "push smaller ones or raise the budget",
            )

    def _refuse(self, key: ShardKey, message: str) -> None:
        """Count a refusal for lack of room and raise its 507 (under ``_lock``)."""
        self.refused += 1
        self._usage_of(key[0]).refused += 1
        _log.warning("agentspec.intake.over_budget", key=key, error=message)
        raise _RefusedError(self._error(507, message, ErrorType.INSUFFICIENT_STORAGE))

    def _check_delta_floor(
        self, key: ShardKey, tree: SuffixTree, plan: _DeltaPlan, fresh: bool
    ) -> None:
        """507 before applying a delta that removes nothing and cannot fit.

        Its new sequences add at least 4 bytes per token (a fresh tree:
        `min_tree_bytes`); a delta that removes sequences may free room, so
        only its exact size after applying decides.
        """
        if plan.removed:
            return
        if fresh:
            floor = min_tree_bytes(len(plan.added), plan.new_tokens)
        else:
            if not plan.added:
                return  # a retried delta: nothing new
            floor = live_bytes(tree.stats()) + MIN_TOKEN_BYTES * plan.new_tokens
        with self._lock:
            self._check_room(key, floor, estimate=True)

    def _fit_delta(self, key: ShardKey, tree: SuffixTree, plan: _DeltaPlan, fresh: bool) -> None:
        """After applying a delta: 507 and undo it when the shard no longer fits.

        Under the key's lock.  A fresh tree is simply dropped.  Otherwise the
        delta's added sequences are removed and its removed ones added back
        (waiting for readers); when the undone tree takes more than before
        (removed sequences' tokens stay referenced by nodes until they are
        relabelled), it is replaced by a compact rebuild of the same
        sequences.  Should the undo fail, the shard is dropped rather than
        kept over the budget.
        """
        size = live_bytes(tree.stats())
        try:
            with self._lock:
                self._check_room(key, size, estimate=False)
        except _RefusedError:
            if fresh:
                tree.close()
                raise
            if not self._undo_delta(tree, plan):
                _log.error("agentspec.intake.undo_failed", key=key)
                with self._lock:
                    self._trees.pop(key, None)
                    self._infos.pop(key, None)
                    self._account(key, None)
                self._notify(key, None)
                raise
            size = live_bytes(tree.stats())
            with self._lock:
                before = self._held.get(key, 0)
            if size > before:
                # Sequences removed by the undo leave their tokens referenced by
                # nodes (retained_tokens): a rebuild from the sequences is compact.
                rebuilt = SuffixTree.from_bytes(tree.to_bytes())
                info = _shard_info(key, rebuilt)
                with self._lock:
                    self._trees[key] = rebuilt
                    self._infos[key] = info
                    self._account(key, live_bytes(rebuilt.stats()))
                self._notify(key, rebuilt)
            else:
                info = _shard_info(key, tree)
                with self._lock:
                    self._infos[key] = info
                    self._account(key, size)
            raise

    def _undo_delta(self, tree: SuffixTree, plan: _DeltaPlan) -> bool:
        """Take a just-applied delta back out of ``tree`` (False: readers kept it busy)."""
        deadline = time.monotonic() + max(self.busy_timeout, _UNDO_TIMEOUT)
        steps = [functools.partial(_remove_if_present, tree, sid) for sid in plan.added]
        steps += [functools.partial(tree.add, sid, tokens) for sid, tokens in plan.removed.items()]
        return all(_retry(step, deadline) for step in steps)

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

    def _read_shm_file(self, raw: str, shm: Path) -> bytearray:
        """The bytes of a snapshot file strictly under ``shm`` (refusals raise).

        Symlinks are resolved first and the result must lie under ``shm``
        (403 otherwise).  The file is then opened relative to ``shm`` one
        component at a time with O_NOFOLLOW, so a path changed into a symlink
        after the check fails instead of leading elsewhere; O_NONBLOCK keeps
        a FIFO from blocking the handler.  Only a regular file (checked on the
        opened descriptor) of at most ``max_body_bytes`` is read (400, 413).
        """
        try:
            os.fsencode(raw)
            resolved = Path(raw).resolve()
        except (OSError, RuntimeError, ValueError):  # not encodable, a symlink loop
            raise _RefusedError(
                self._error(400, "cannot resolve the snapshot file path", ErrorType.INVALID_REQUEST)
            ) from None
        if not resolved.is_relative_to(shm) or resolved == shm:
            raise _RefusedError(
                self._error(
                    403, f"path is outside the allowed directory {shm}", ErrorType.FORBIDDEN
                )
            )
        parts = resolved.relative_to(shm).parts
        try:
            fd = _open_beneath(shm, parts)
        except OSError as e:
            raise _RefusedError(
                self._error(
                    400,
                    f"cannot open snapshot file: {e.strerror or 'error'}",
                    ErrorType.INVALID_REQUEST,
                )
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _RefusedError(
                    self._error(
                        400, "snapshot file is not a regular file", ErrorType.INVALID_REQUEST
                    )
                )
            size = st.st_size
            if size > self.max_body_bytes:
                raise _RefusedError(
                    self._error(
                        413,
                        f"snapshot file of {size} bytes exceeds the limit of {self.max_body_bytes}",
                        ErrorType.PAYLOAD_TOO_LARGE,
                    )
                )
            data = bytearray(size)
            try:
                got = _read_into(fd, data)
            except OSError as e:
                raise _RefusedError(
                    self._error(
                        400,
                        f"cannot read snapshot file: {e.strerror or 'error'}",
                        ErrorType.INVALID_REQUEST,
                    )
                ) from None
            if got != size:
                raise _RefusedError(
                    self._error(
                        400, "snapshot file changed while being read", ErrorType.INVALID_REQUEST
                    )
                )
            return data
        finally:
            os.close(fd)

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


def _open_beneath(base: Path, parts: tuple[str, ...]) -> int:
    """Open ``base/parts...`` for reading without following any symlink below ``base``.

    Directories are opened with O_DIRECTORY | O_NOFOLLOW one at a time, the
    file with O_NOFOLLOW | O_NONBLOCK (a FIFO opens at once instead of
    waiting for a writer; reading a regular file is unaffected).
    """
    dirfd = os.open(base, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dirfd)
            os.close(dirfd)
            dirfd = nxt
        return os.open(
            parts[-1],
            os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_NOCTTY | _O_CLOEXEC,
            dir_fd=dirfd,
        )
    finally:
        os.close(dirfd)


def _read_into(fd: int, buf: bytearray) -> int:
    """Fill ``buf`` from ``fd``; the number of bytes read (short at end of file)."""
    view = memoryview(buf)
    got = 0
    try:
        while got < len(buf):
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
    finally:
        view.release()
    return got


def _remove_if_present(tree: SuffixTree, seq_id: int) -> None:
    """Remove a sequence unless it is absent."""
    if seq_id in tree:
        tree.remove(seq_id)


def _retry(step: Callable[[], object], deadline: float) -> bool:
    """Run a tree modification, retrying while readers hold the tree (False: deadline)."""
    while True:
        try:
            step()
            return True
        except RuntimeError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)


def _delta_plan(
    tree: SuffixTree, data: bytes | bytearray | memoryview, n_seq: int, n_rem: int
) -> _DeltaPlan:
    """What applying delta bytes (header already peeked) would change in ``tree``.

    Reads the removal ids and each sequence record's id and length (bounds
    checked: a malformed payload gives a partial plan, and the load refuses
    it anyway).  O(removals + sequences), not O(tokens).
    """
    plan = _DeltaPlan()
    view = memoryview(data).cast("B")
    try:
        off = lowlevel.SHARD_HEADER_BYTES
        removing: set[int] = set()
        if n_rem:
            removing.update(struct.unpack_from(f"<{n_rem}q", view, off))
            off += 8 * n_rem
        for sid in removing:
            if sid in tree:
                plan.removed[sid] = tree.sequence(sid)
        seen: set[int] = set()
        end = len(view)
        for _ in range(n_seq):
            if off + 12 > end:
                break
            sid, n = struct.unpack_from("<qI", view, off)
            off += 12 + 4 * n
            if sid in seen:
                continue  # a repeat is skipped on apply
            seen.add(sid)
            if sid in plan.removed or sid not in tree:
                plan.added.append(sid)
                plan.new_tokens += n
    finally:
        view.release()
    return plan


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
    #: ``listen()`` backlog: a burst of pushers (or clients) is queued by the
    #: kernel instead of dropped (socketserver's default is 5).
    request_queue_size = LISTEN_BACKLOG

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
        _log.debug("agentspec.intake.http", line=format % args)

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
