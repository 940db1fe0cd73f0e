"""Online learning of `agentspec._core.speculator.Speculator`: responses into their shards.

A finished response is learned as one closed sequence behind its prompt's
last ``lead_tokens`` tokens; with live learning it grows as an open sequence
while it is generated.
"""

from __future__ import annotations

import array

from agentspec._core._spec_layout import _ShardLayout
from agentspec._core._spec_state import _int32_array, _Request
from agentspec._core.tokens import TokenArray, as_int32_buffer
from agentspec.protocol import StageKey


class _Learning(_ShardLayout):
    """Learns responses (closed, or open while generated) into the shards of their key."""

    def _grow(self, req: _Request, n: int) -> None:
        """Append a request's last ``n`` response tokens to its open sequence."""
        if req.seq is None:
            req.seq = self._next_seq
            self._next_seq += 1
        seq = req.seq
        for shard in self._shards_for(req.key, create=True):
            have = shard.live.get(seq)
            if have is None:  # its first tokens: lead and response so far
                chunk = req.response if req.lead is None else req.lead + req.response
                have = 0
            else:
                chunk = req.response[len(req.response) - n :]
            shard.tree.append(seq, chunk)
            shard.live[seq] = have + len(chunk)
            self._resize(shard, len(chunk))
            self._meter(shard)

    def _lead(self, prompt: TokenArray) -> array.array[int] | None:
        """The last ``lead_tokens`` tokens of a prompt (None when there are none)."""
        if self._lead_tokens == 0:
            return None
        lead = _int32_array(prompt)
        del lead[: max(0, len(lead) - self._lead_tokens)]
        return lead if len(lead) else None

    def _add(self, tokens: TokenArray, key: StageKey) -> None:
        """Learn one sequence into the shards of ``key``."""
        pipeline, stage = key
        _, n, keep = as_int32_buffer(tokens)
        seq = self._next_seq
        self._next_seq += 1
        self._version += 1
        stamp = self._stamp()
        for shard in self._shards_for((pipeline, stage), create=True):
            self._learn(shard, seq, keep, n, stamp)
        self._enforce()
