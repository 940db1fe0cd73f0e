"""Shared state and answers of `agentspec._push.intake.ShardIntake`, and its per-key locks.

`_IntakeBase` declares what the intake's parts share (the trees, their list
entries, the budget counters, the locks) and builds its answers (JSON with
the instance id); `_RefusedError` carries an error answer out of any depth of
a request; `_Usage` is what one tenant holds; `_KeyLocks` serialises the
modifications of one shard key.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from agentspec._core.tree import SuffixTree
from agentspec._push.wire import (
    INSTANCE_HEADER,
    ErrorType,
    ShardKey,
    WireResponse,
    WorkerShard,
    error_response,
    json_response,
)
from agentspec._util.log import get_logger
from agentspec.exceptions import ShardFormatError

_log = get_logger()

Listener = Callable[[ShardKey, SuffixTree | None], None]


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


class _Usage:
    """What one tenant holds in an intake (guarded by the intake's lock)."""

    __slots__ = ("bytes", "refused", "reserved", "shards")

    def __init__(self) -> None:
        self.bytes = 0  # live bytes of its shards
        self.reserved = 0  # lower bounds of its snapshots being built
        self.shards = 0
        self.refused = 0  # pushes refused for lack of room (507)


class _IntakeBase:
    """What the parts of `ShardIntake` share: its state (set by its ``__init__``) and answers."""

    instance: str
    max_depth: int
    max_body_bytes: int
    max_bytes: int | None
    max_tenant_bytes: int | None
    shm_dir: Path | None
    busy_timeout: float
    refused: int
    too_large: int
    _vocab_size: int | None
    _trees: dict[ShardKey, SuffixTree]
    _infos: dict[ShardKey, WorkerShard]
    _lock: threading.Lock
    _key_locks: _KeyLocks
    _listeners: list[Listener]
    _held: dict[ShardKey, int]
    _usage: dict[str, _Usage]
    _total: int
    _reserved: int
    _extra_stats: dict[str, Callable[[], Any]]

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
