"""Eviction by tokens and by bytes in `agentspec._core.speculator.Speculator`.

Every shard's tokens are counted (a stage shard below ``cold_tokens`` is
cold); with a byte budget its live bytes are metered too.  A shard over
``max_shard_tokens`` drops its oldest closed sequences; a speculator over
``max_bytes`` (or a shared `LearnedBudget` over its total) drops the oldest
closed sequence of any shard, by arrival stamp.
"""

from __future__ import annotations

from typing import Any

from agentspec._core._spec_state import _Shard, _SpeculatorState
from agentspec._util.log import get_logger

_log = get_logger()


class _ByteBudget(_SpeculatorState):
    """Counts tokens and live bytes per shard and evicts the oldest beyond the budgets."""

    def _learn(self, shard: _Shard, seq: int, tokens: Any, n: int, stamp: int) -> None:
        """Add one closed sequence to a shard, then evict its oldest beyond the token budget."""
        shard.tree.add(seq, tokens)
        shard.order.append((seq, n, stamp))
        self._resize(shard, n)
        self._evict(shard)
        self._meter(shard)

    def _evict(self, shard: _Shard) -> None:
        """Remove a shard's oldest closed sequences while it is over the token budget.

        The newest closed sequence always stays, and open ones are never
        removed (their requests still append to them).
        """
        if self._max_tokens is None:
            return
        while shard.tokens > self._max_tokens and len(shard.order) > 1:
            old, size, _ = shard.order.popleft()
            shard.tree.remove(old)
            self._resize(shard, -size)
            self.evicted_sequences += 1
            self.evicted_bytes += max(0, -self._meter(shard))

    def _stamp(self) -> int:
        """The next arrival stamp (the shared budget's, when there is one)."""
        if self._budget is not None:
            return self._budget.stamp()
        self._clock += 1
        return self._clock

    def _meter(self, shard: _Shard) -> int:
        """Refresh a shard's live bytes (when metered); returns their change."""
        if not self._metered:
            return 0
        new = shard.tree._live_bytes()
        delta = new - shard.bytes
        if delta:
            shard.bytes = new
            self._bytes += delta
            if self._budget is not None:
                self._budget.bytes += delta
        return delta

    def _unmeter(self, shard: _Shard) -> None:
        """Stop counting a shard that is no longer held."""
        if shard.bytes:
            self._bytes -= shard.bytes
            if self._budget is not None:
                self._budget.bytes -= shard.bytes
            shard.bytes = 0

    def _oldest_stamp(self) -> int | None:
        """Arrival stamp of the oldest closed sequence of any shard (None: none)."""
        oldest: int | None = None
        for shard in self._all_shards():
            if shard.order:
                stamp = shard.order[0][2]
                if oldest is None or stamp < oldest:
                    oldest = stamp
        return oldest

    def _evict_oldest(self) -> bool:
        """Evict the oldest closed sequence of any shard (False: none, or its tree is busy)."""
        victim: _Shard | None = None
        for shard in self._all_shards():
            if shard.order and (victim is None or shard.order[0][2] < victim.order[0][2]):
                victim = shard
        if victim is None:
            return False
        seq, n, _ = victim.order[0]
        try:
            victim.tree.remove(seq)
        except RuntimeError as e:  # a reader holds the tree: the next change tries again
            _log.warning("agentspec.speculator.eviction_postponed", error=str(e))
            return False
        victim.order.popleft()
        self._resize(victim, -n)
        self.evicted_sequences += 1
        self.evicted_bytes += max(0, -self._meter(victim))
        return True

    def _enforce(self) -> None:
        """Evict while over the byte budget, then while the shared budget is over its total."""
        limit = self._max_bytes
        if limit is not None:
            while self._bytes > limit and self._evict_oldest():
                pass
        if self._budget is not None:
            self._budget.enforce()

    def _resize(self, shard: _Shard, delta: int) -> None:
        """Change a shard's token count, invalidating cached trees when it turns warm or cold."""
        was_warm = shard.tokens >= self._cold_tokens
        shard.tokens += delta
        if (shard.tokens >= self._cold_tokens) != was_warm:
            self._version += 1
