"""The state `agentspec._core.speculator.Speculator` is made of: its shards, its requests.

`_Shard` is one global tree and what it holds (closed sequences oldest
first, open ones, token and byte counts); `_Request` one active request;
`_SpeculatorState` declares the attributes every part of the speculator
shares.
"""

from __future__ import annotations

import array
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from agentspec._core.batch import BatchDrafter
from agentspec._core.budget import LearnedBudget
from agentspec._core.cursor import Cursor
from agentspec._core.draft import Draft, DraftParams
from agentspec._core.goodput import GoodputController
from agentspec._core.tokens import TokenArray, as_int32_buffer
from agentspec._core.tree import SuffixTree
from agentspec.exceptions import InvalidArgumentError
from agentspec.protocol import StageKey


def _int32_array(tokens: TokenArray) -> array.array[int]:
    """A checked ``array('i')`` copy of a token array."""
    _, _, keep = as_int32_buffer(tokens)
    out = array.array("i")
    out.frombytes(memoryview(keep).cast("B"))
    return out


@dataclass
class _Shard:
    """A global tree and what it holds.

    ``order`` lists its closed sequences oldest first as (id, length,
    arrival stamp), the only ones eviction removes; ``live`` maps each open
    (in-flight) sequence to its length so far; ``tokens`` counts both;
    ``bytes`` is the tree's live bytes after its last change (kept only
    when the speculator has a byte budget).
    """

    tree: SuffixTree
    order: deque[tuple[int, int, int]] = field(default_factory=deque)
    live: dict[int, int] = field(default_factory=dict)
    tokens: int = 0
    bytes: int = 0


@dataclass
class _Request:
    """One active request."""

    cursor: Cursor
    key: StageKey
    response: array.array[int] = field(default_factory=lambda: array.array("i"))
    lead: array.array[int] | None = None  # the prompt's last tokens, learned before `response`
    trees: list[SuffixTree] = field(default_factory=list)  # cached `_trees_for(key)`
    version: int = -1  # the Speculator's shard version `trees` was computed at
    seq: int | None = None  # id of its open sequence in its shards (live learning)
    last: Draft | None = None  # its last controlled draft, until `extend` reports on it


class _SpeculatorState:
    """What the parts of `Speculator` share: its state (set by its ``__init__``)."""

    _max_depth: int
    _params: DraftParams
    _stage_shards: bool
    _pipeline_tree: bool
    _local_tree: bool
    _cold_tokens: int
    _max_tokens: int | None
    _max_bytes: int | None
    _budget: LearnedBudget | None
    _metered: bool
    _bytes: int
    _clock: int
    evicted_sequences: int
    evicted_bytes: int
    _lead_tokens: int
    _live: bool
    _stages: dict[StageKey, _Shard]
    _pipelines: dict[str | None, _Shard]
    _requests: dict[Hashable, _Request]
    _next_seq: int
    _version: int
    _handles: Any
    _batchers: dict[DraftParams, BatchDrafter]
    _last_batcher: tuple[DraftParams, BatchDrafter] | None
    _goodput: GoodputController | None

    def _request(self, req_id: Hashable) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise InvalidArgumentError(f"request {req_id!r} is not active")
        return req

    def _all_shards(self) -> Iterator[_Shard]:
        yield from self._stages.values()
        yield from self._pipelines.values()
