"""Byte accounting of `agentspec._push.intake.ShardIntake`: budgets per tenant and in total.

Live bytes of the trees (see `agentspec._core.budget`) are counted per key,
per tenant and in total, under the intake's lock.  A push that would take a
tenant or the intake over its budget is refused with 507 and changes
nothing; builds in flight reserve their lower bound; a delta that does not
fit once applied is undone (`_BudgetKeeper._fit_delta`).
"""

from __future__ import annotations

import functools
import struct
import time
from collections.abc import Callable
from typing import Any

from agentspec._core import lowlevel
from agentspec._core.budget import (
    MIN_TOKEN_BYTES,
    format_bytes,
    live_bytes,
    min_tree_bytes,
)
from agentspec._core.tree import SuffixTree
from agentspec._push._intake_base import _IntakeBase, _RefusedError, _shard_info, _Usage
from agentspec._push.wire import ErrorType, ShardKey
from agentspec._util.log import get_logger

_log = get_logger()

#: Seconds an over-budget delta's undo waits for the tree's readers.
_UNDO_TIMEOUT = 30.0


class _DeltaPlan:
    """What a delta would change in a tree, read before applying it (to undo it)."""

    __slots__ = ("added", "new_tokens", "removed")

    def __init__(self) -> None:
        self.added: list[int] = []  # ids the delta adds (absent before, or removed first)
        self.new_tokens = 0  # tokens of those sequences
        self.removed: dict[int, list[int]] = {}  # present ids it removes -> their tokens


class _BudgetKeeper(_IntakeBase):
    """Counts the live bytes every shard holds and refuses pushes that would not fit."""

    @property
    def budgeted(self) -> bool:
        """Whether pushes are checked against a memory budget."""
        return self.max_bytes is not None or self.max_tenant_bytes is not None

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
