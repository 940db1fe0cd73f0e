"""Stage shards: one global tree per (pipeline, stage), learned online.

Agents run the same pipeline stages again and again (Classify, Extract, SQL,
Combine, ...), and each stage's outputs resemble earlier outputs of that
stage far more than outputs of other stages.  A `Speculator` keeps one
global tree ("shard") per (pipeline, stage) key plus, optionally, one
pipeline-wide tree over all stages of a pipeline, and a `Cursor` per active
request.  A request drafts from its own tree, its stage shard and its
pipeline tree at once (one native call; on equal scores the per-request
tree wins, then the stage shard), and its response is learned into both
shards when it finishes.

Each response is learned behind the last ``lead_tokens`` tokens of its
prompt (the generation prompt, e.g. ``<|im_start|>assistant\n``, and the end
of the last turn), so a shard also knows how its stage's responses start:
a request's first draft, made before it has generated anything, matches that
lead instead of nothing.

Live learning (``live=True``): a request's lead + response is appended to its
shards as an open sequence while it is generated (`extend`), closed by
`finish` (or removed, when the response is not to be learned), so requests in
flight at the same time (e.g. the candidate queries of one question) draft
from each other's partial outputs, as Arctic Inference's global tree does.  A
request also meets its own open sequence there, but that occurrence ends at
the request's context and so has no continuation: it adds no evidence at the
match point (drafts divide by the continuations' total, not by the match
count), only the request's own earlier repetitions, which its per-request
tree holds anyway.  Open sequences are never evicted: ``max_shard_tokens``
counts them, but evicts closed ones only, oldest first, when a sequence is
closed or added; so with one request at a time the shards end every `finish`
exactly as without live learning (a response not learned leaves no trace).

Byte budgets (``max_bytes``, and a `LearnedBudget` shared by the speculators
of several tenants): after a sequence is closed or added, the oldest closed
sequences of any of the speculator's shards (stage shards and pipeline trees
alike, by arrival) are evicted while its shards' live bytes (see
`agentspec._core.budget`) exceed ``max_bytes``; then, across every speculator of
the shared budget, while their sum exceeds its total.  Unlike the token
budget these may evict a shard's newest sequence too (a response larger than
the budget does not stay).  `memory` reports the bytes held and the
evictions.

Goodput control (``goodput``, on by default; see `agentspec._core.goodput`):
every draft is cut to the length that maximises expected tokens per
second of step time, from its calibrated acceptance probabilities
(learned from `extend`: the draft's accepted prefix, per (shard key,
draft source)) and a step-cost model the engine feeds with
`observe_step`.  Until the engine has reported enough steps, drafts pass
unchanged; ``goodput=False`` keeps the fixed policy.
"""

from __future__ import annotations

import array
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentspec._core import lowlevel
from agentspec._core.batch import BatchDrafter, _check_caps
from agentspec._core.budget import LearnedBudget, live_bytes, parse_byte_size
from agentspec._core.cursor import Cursor
from agentspec._core.draft import Draft, DraftParams, check_max_depth, resolve_params
from agentspec._core.goodput import GoodputController
from agentspec._core.tokens import TokenArray, as_int32_buffer
from agentspec._core.tree import SuffixTree
from agentspec._util.args import as_int
from agentspec._util.log import get_logger
from agentspec.exceptions import InvalidArgumentError
from agentspec.protocol import StageKey

__all__ = ["MAX_EXTRA_TREES", "Speculator", "StageKey"]

_log = get_logger()

#: Most ``extra_trees`` one draft accepts: a request drafts from its stage shard
#: and its pipeline tree, and the native call takes `lowlevel.MAX_GLOBALS` trees.
MAX_EXTRA_TREES: int = lowlevel.MAX_GLOBALS - 2


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


def _group(req: _Request, draft: Draft) -> tuple[StageKey, str, int]:
    """A draft's calibration group: its shard key, its tree, and its match length in
    powers of two (a long match is better evidence than a short one at equal counts)."""
    return req.key, draft.source, min(draft.match_len, 64).bit_length()


def _control(
    ctl: GoodputController,
    reqs: Sequence[_Request],
    drafts: list[Draft],
    caps: Sequence[int] | None,
    undrafted: int = 0,
) -> list[Draft]:
    """Cut drafts with the goodput controller; remember them for `extend`."""
    if caps is None and not ctl.active:  # the fixed policy, at the least cost
        ctl.note_batch(len(drafts))
        for r, d in zip(reqs, drafts, strict=True):
            r.last = d if d.token_ids else None
        return drafts
    groups = [_group(r, d) for r, d in zip(reqs, drafts, strict=True)]
    out = ctl.trim(drafts, groups, caps, undrafted=undrafted)
    for r, d in zip(reqs, out, strict=True):
        r.last = d if d.token_ids else None
    return out


class Speculator:
    """Drafting with stage shards, per-request trees and online learning.

    Args:
        max_depth: depth of every tree (and of the per-request cursors).
        params: default drafting parameters (`DraftParams.confident()`, the
            confidence policy, if None).
        stage_shards: keep one tree per (pipeline, stage).  False keeps one
            tree per pipeline only ("one tree for all stages").
        pipeline_tree: also keep a pipeline-wide tree over all of a
            pipeline's stages (made once a pipeline has two stages); it is
            the fallback while a stage shard is cold.
        local_tree: give each request a tree over its own prompt and output.
        cold_tokens: a stage shard with fewer tokens than this is not drafted
            from while a pipeline tree exists.
        max_shard_tokens: optional FIFO token budget per tree.
        max_bytes: optional byte budget of all this speculator's trees
            together (live bytes, see `agentspec._core.budget`): the oldest
            closed sequences of any tree are evicted while over it.
        budget: a total byte budget shared with other speculators (e.g. one
            per tenant); they must then all be used from one thread.
        lead_tokens: learn each response behind this many of its prompt's
            last tokens (0: the response alone).
        live: learn each response while it is generated, as an open
            sequence of its shards (see the module docstring), instead of
            when it finishes.
        goodput: True (a fresh `GoodputController`), a controller to use,
            or False (the fixed policy: drafts as the params give them).

    Not thread-safe: use one Speculator from one thread (or lock around it).
    """

    def __init__(
        self,
        max_depth: int = 64,
        *,
        params: DraftParams | None = None,
        stage_shards: bool = True,
        pipeline_tree: bool = True,
        local_tree: bool = True,
        cold_tokens: int = 256,
        max_shard_tokens: int | None = None,
        lead_tokens: int = 8,
        live: bool = False,
        max_bytes: int | None = None,
        budget: LearnedBudget | None = None,
        goodput: bool | GoodputController = True,
    ) -> None:
        """Create an empty speculator (see the class docstring for the arguments)."""
        max_depth = check_max_depth(max_depth)
        cold_tokens = as_int(cold_tokens, "cold_tokens")
        if cold_tokens < 0:
            raise InvalidArgumentError(f"cold_tokens must be >= 0, not {cold_tokens}")
        lead_tokens = as_int(lead_tokens, "lead_tokens")
        if not 0 <= lead_tokens <= max_depth:
            raise InvalidArgumentError(f"lead_tokens must be in [0, max_depth], not {lead_tokens}")
        if max_shard_tokens is not None:
            max_shard_tokens = as_int(
                max_shard_tokens, "max_shard_tokens", expected="an int or None"
            )
            if max_shard_tokens < 0:
                raise InvalidArgumentError(f"max_shard_tokens must be >= 0, not {max_shard_tokens}")
        if budget is not None and not isinstance(budget, LearnedBudget):
            raise TypeError(f"budget must be a LearnedBudget, not {type(budget).__name__}")
        self._max_depth = max_depth
        self._params = DraftParams.confident() if params is None else resolve_params(params, {})
        self._stage_shards = stage_shards
        self._pipeline_tree = pipeline_tree
        self._local_tree = local_tree
        self._cold_tokens = cold_tokens
        self._max_tokens = max_shard_tokens
        self._max_bytes = parse_byte_size(max_bytes, "max_bytes")
        self._budget = budget
        self._metered = self._max_bytes is not None or budget is not None
        self._bytes = 0  # live bytes of every shard (kept when metered)
        self._clock = 0  # arrival stamps, when no shared budget hands them out
        self.evicted_sequences = 0
        self.evicted_bytes = 0
        self._lead_tokens = lead_tokens
        self._live = live
        self._stages: dict[StageKey, _Shard] = {}
        self._pipelines: dict[str | None, _Shard] = {}
        self._requests: dict[Hashable, _Request] = {}
        self._next_seq = 0
        self._version = 0  # bumped whenever the trees a request drafts from may change
        self._handles = lowlevel.new_tree_array(lowlevel.MAX_GLOBALS)
        self._batchers: dict[DraftParams, BatchDrafter] = {}
        self._last_batcher: tuple[DraftParams, BatchDrafter] | None = None
        if isinstance(goodput, GoodputController):
            self._goodput: GoodputController | None = goodput
        elif goodput is True:
            self._goodput = GoodputController()
        elif goodput is False:
            self._goodput = None
        else:
            raise TypeError(f"goodput must be a bool or a GoodputController, not {goodput!r}")
        if budget is not None:
            budget.join(self)

    # --- requests -------------------------------------------------------------

    def start_request(
        self,
        req_id: Hashable,
        prompt: TokenArray,
        *,
        stage: str | None = None,
        pipeline: str | None = None,
    ) -> None:
        """Register a request with its prompt and its tags.

        Raises:
            InvalidArgumentError: the request is already active.
            TypeError, InvalidTokenError: bad prompt tokens (nothing registered).
        """
        if req_id in self._requests:
            raise InvalidArgumentError(f"request {req_id!r} is already active")
        cursor = Cursor(self._max_depth, local_tree=self._local_tree, prompt=prompt)
        self._requests[req_id] = _Request(cursor, (pipeline, stage), lead=self._lead(prompt))

    @property
    def live(self) -> bool:
        """Whether responses are learned while they are generated."""
        return self._live

    @property
    def lead_tokens(self) -> int:
        """How many of its prompt's last tokens each response is learned behind."""
        return self._lead_tokens

    def extend(self, req_id: Hashable, tokens: TokenArray) -> None:
        """Append generated (accepted) tokens to a request's context.

        With live learning they are also appended to the request's open
        sequence in its stage and pipeline shards.
        """
        req = self._request(req_id)
        ptr, n, keep = as_int32_buffer(tokens)
        req.cursor._extend_buffer(ptr, n, keep)
        if req.last is not None:
            self._report(req, keep)
        req.response.extend(keep.tolist() if not isinstance(keep, array.array) else keep)
        if self._live and n:
            self._grow(req, n)
            self._enforce()

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

    def draft(
        self,
        req_id: Hashable,
        params: DraftParams | None = None,
        *,
        extra_trees: Sequence[SuffixTree] = (),
        **overrides: Any,
    ) -> Draft:
        """Draft the next tokens of a request from its own tree and its shards.

        ``extra_trees`` are further global trees to draft from, after the
        request's own shards in order of preference on equal scores (e.g.
        shards pushed to a serving worker); at most `MAX_EXTRA_TREES`.
        """
        req = self._requests.get(req_id)
        if req is None:
            raise InvalidArgumentError(f"request {req_id!r} is not active")
        p = self._params if params is None and not overrides else resolve_params(params, overrides)
        trees = req.trees if req.version == self._version else self._request_trees(req)
        if extra_trees:
            trees = self._with_extra(trees, extra_trees)
        d = req.cursor._draft_multi(trees, p, self._handles)[0]
        return d if self._goodput is None else _control(self._goodput, [req], [d], None)[0]

    def draft_source(
        self,
        req_id: Hashable,
        params: DraftParams | None = None,
        *,
        extra_trees: Sequence[SuffixTree] = (),
    ) -> tuple[Draft, str]:
        """`draft`, plus which tree it came from: "stage", "pipeline", "extra"
        (one of ``extra_trees``), "local", "merged" or "none"."""
        req = self._request(req_id)
        own = self._request_trees(req)
        trees = self._with_extra(own, extra_trees)
        draft, index = req.cursor._draft_multi(trees, params or self._params, self._handles)
        name = self._source_name(req, own, draft, index)
        if self._goodput is not None:
            draft = _control(self._goodput, [req], [draft], None)[0]
        return draft, name

    def draft_batch(
        self,
        req_ids: Sequence[Hashable],
        params: DraftParams | None = None,
        *,
        caps: Sequence[int] | None = None,
        extra_trees: Sequence[Sequence[SuffixTree]] | None = None,
    ) -> list[Draft]:
        """Draft for several active requests in one native call (a decode step).

        Each draft equals what `draft` gives for that request.  ``caps``: per
        request, the most tokens its draft may hold (0: none), at most the
        params' ``max_spec_tokens``; ``extra_trees``: per request, further
        global trees (as in `draft`).

        Raises:
            InvalidArgumentError: an unknown or repeated request id, or bad
                caps / extra trees (nothing is drafted).
        """
        return [d for d, _ in self._draft_batch(req_ids, params, caps, extra_trees)]

    def draft_batch_source(
        self,
        req_ids: Sequence[Hashable],
        params: DraftParams | None = None,
        *,
        caps: Sequence[int] | None = None,
        extra_trees: Sequence[Sequence[SuffixTree]] | None = None,
        control: bool = True,
    ) -> list[tuple[Draft, str]]:
        """`draft_batch`, plus per request the tree its draft came from (as
        `draft_source` names it).

        ``control=False`` returns the drafts before goodput control (within
        ``caps``): for an engine whose step also holds other speculators'
        requests, which then cuts the whole step at once with `control_step`.
        """
        return self._draft_batch(req_ids, params, caps, extra_trees, control=control)

    def _draft_batch(
        self,
        req_ids: Sequence[Hashable],
        params: DraftParams | None,
        caps: Sequence[int] | None,
        extra_trees: Sequence[Sequence[SuffixTree]] | None,
        *,
        control: bool = True,
    ) -> list[tuple[Draft, str]]:
        ids = list(req_ids)
        if not ids:
            return []
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError("a request id appears twice in one batch")
        if extra_trees is not None and len(extra_trees) != len(ids):
            raise InvalidArgumentError(
                f"extra_trees must have one entry per request ({len(ids)}), not {len(extra_trees)}"
            )
        if len(ids) == 1 and caps is None and control:  # one request: the single call is cheaper
            extra = () if extra_trees is None else extra_trees[0]
            return [self.draft_source(ids[0], params, extra_trees=extra)]
        reqs = [self._request(r) for r in ids]
        owns = [self._request_trees(req) for req in reqs]
        if extra_trees is None:
            trees: list[list[SuffixTree]] = owns
        else:
            pairs = zip(owns, extra_trees, strict=True)
            trees = [self._with_extra(own, extra) for own, extra in pairs]
        checked = None if caps is None else _check_caps(caps, len(ids))
        drafter = self._batcher(params or self._params, len(ids))
        rows = drafter._draft_rows([req.cursor for req in reqs], trees, None, [], checked)
        drafts = [d for d, _ in rows]
        if self._goodput is not None and control:
            drafts = _control(self._goodput, reqs, drafts, checked)
        return [
            (draft, self._source_name(req, own, raw, index))
            for req, own, draft, (raw, index) in zip(reqs, owns, drafts, rows, strict=True)
        ]

    # --- goodput control ------------------------------------------------------

    @property
    def goodput(self) -> GoodputController | None:
        """The goodput controller (None: the fixed policy)."""
        return self._goodput

    def observe_step(self, batch: int, tokens: int, seconds: float) -> None:
        """Report a verification step: ``batch`` requests verified ``tokens``
        tokens (their own plus every draft token) in ``seconds``.

        Feeds the goodput controller's step-cost model (nothing without one).
        """
        if self._goodput is not None:
            self._goodput.observe_step(as_int(batch, "batch"), as_int(tokens, "tokens"), seconds)

    @staticmethod
    def control_step(
        parts: Sequence[tuple[Speculator, Sequence[Hashable], Sequence[Draft]]],
        *,
        undrafted: int = 0,
    ) -> list[list[Draft]]:
        """Cut one engine step's drafts together, across speculators.

        ``parts``: per speculator, request ids and their drafts from
        ``draft_batch_source(..., control=False)``.  Every speculator must
        share one `GoodputController` (the step's cost is the engine's, not a
        tenant's): the allocation then weighs every request of the step
        against the others, as one `draft_batch` does within a speculator.
        ``undrafted``: further requests in the step with no draft on offer
        (rows still computing their prompt, rows at their length limit): the
        allocation weighs a draft token at the batch they make together
        (see `agentspec._core.goodput.allocate`).  Returns the cut drafts in the
        same shape, and remembers them for `extend` (the acceptance
        calibration).

        Raises:
            InvalidArgumentError: speculators with different controllers,
                ids and drafts of different lengths, an unknown request, or
                a negative ``undrafted``.
            TypeError: ``undrafted`` is not an integer.
        """
        undrafted = as_int(undrafted, "undrafted", 0)
        ctl: GoodputController | None = None
        reqs: list[_Request] = []
        drafts: list[Draft] = []
        for spec, ids, ds in parts:
            if spec._goodput is None or (ctl is not None and spec._goodput is not ctl):
                raise InvalidArgumentError(
                    "control_step needs speculators sharing one GoodputController"
                )
            ctl = spec._goodput
            if len(ids) != len(ds):
                raise InvalidArgumentError(
                    f"{len(ids)} request ids but {len(ds)} drafts in one part of the step"
                )
            reqs += [spec._request(r) for r in ids]
            drafts += ds
        if ctl is None:
            return []
        cut = _control(ctl, reqs, drafts, None, undrafted)
        out: list[list[Draft]] = []
        start = 0
        for _, ids, _ in parts:
            out.append(cut[start : start + len(ids)])
            start += len(ids)
        return out

    def _report(self, req: _Request, tokens: Any) -> None:
        """Tell the controller how much of the request's last draft ``tokens`` accepted
        (a tree draft along the path the tokens took)."""
        d = req.last
        req.last = None
        ctl = self._goodput
        if d is None or ctl is None:
            return
        ctl.observe_verified(_group(req, d), d, tokens)

    def _batcher(self, params: DraftParams, n: int) -> BatchDrafter:
        """A reusable `BatchDrafter` for ``params`` with room for ``n`` items."""
        last = self._last_batcher
        if last is not None and last[0] is params and last[1].max_batch >= n:
            return last[1]
        drafter = self._batchers.get(params)
        if drafter is None or drafter.max_batch < n:
            size = max(n, 2 * drafter.max_batch if drafter is not None else 16)
            if len(self._batchers) >= 16:  # params vary per call: keep a few
                self._batchers.clear()
            drafter = self._batchers[params] = BatchDrafter(params, max_batch=size)
        self._last_batcher = (params, drafter)
        return drafter

    @staticmethod
    def _with_extra(own: list[SuffixTree], extra: Sequence[SuffixTree]) -> list[SuffixTree]:
        """A request's trees followed by ``extra`` (checked), skipping duplicates."""
        if not extra:
            return own
        if len(extra) > MAX_EXTRA_TREES:
            raise InvalidArgumentError(f"at most {MAX_EXTRA_TREES} extra trees, not {len(extra)}")
        trees = list(own)
        for tree in extra:
            if not isinstance(tree, SuffixTree):
                raise TypeError(f"extra_trees must hold SuffixTree, not {type(tree).__name__}")
            if all(tree is not t for t in trees):
                trees.append(tree)
        return trees

    def finish(self, req_id: Hashable, *, learn: bool = True) -> None:
        """End a request; with ``learn`` its response joins its stage and pipeline shards.

        With live learning the response is already there, as an open
        sequence: ``learn`` closes it, otherwise it is removed.
        """
        req = self._requests.pop(req_id, None)
        if req is None:
            raise InvalidArgumentError(f"request {req_id!r} is not active")
        req.cursor.close()
        if req.seq is not None:
            self._version += 1
            stamp = self._stamp()
            for shard in self._shards_for(req.key, create=False):
                n = shard.live.pop(req.seq, None)
                if n is None:
                    continue
                if learn:
                    shard.tree.close_sequence(req.seq)
                    shard.order.append((req.seq, n, stamp))
                    self._evict(shard)
                else:
                    shard.tree.remove(req.seq)
                    self._resize(shard, -n)
                self._meter(shard)
            if not learn:
                self._drop_empty(req.key)
            self._enforce()
        elif learn and len(req.response) > 0:
            seq = req.response if req.lead is None else req.lead + req.response
            self._add(seq, (req.key[0], req.key[1]))

    def add_response(
        self,
        tokens: TokenArray,
        *,
        stage: str | None = None,
        pipeline: str | None = None,
        prompt: TokenArray | None = None,
    ) -> None:
        """Learn one response into its shards (also the offline warm-up path).

        With ``prompt``, the response is learned behind the prompt's last
        ``lead_tokens`` tokens, as `finish` does.
        """
        lead = self._lead(prompt) if prompt is not None else None
        if lead is None:
            self._add(tokens, (pipeline, stage))
        else:
            self._add(lead + _int32_array(tokens), (pipeline, stage))

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

    def _drop_empty(self, key: StageKey) -> None:
        """Undo the shards an unlearned live response made, as if it never came.

        Without live learning a shard exists once a response was learned into
        it, and a pipeline tree once its pipeline has two stage shards; a
        removed open sequence may leave a shard that breaks this.
        """
        shards = self._stages if self._stage_shards else self._pipelines
        skey: Any = key if self._stage_shards else key[0]
        shard = shards.get(skey)
        if shard is None or shard.order or shard.live:
            return
        # The trees are dropped, not closed: a caller may still hold one (see `shard`).
        self._unmeter(shards.pop(skey))
        self._version += 1
        if self._stage_shards and sum(k[0] == key[0] for k in self._stages) < 2:
            pipe = self._pipelines.pop(key[0], None)
            if pipe is not None:
                self._unmeter(pipe)

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

    # --- byte budgets ---------------------------------------------------------

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

    def memory(self) -> dict[str, Any]:
        """Live bytes held by the shards, the budgets and the evictions (JSON-ready).

        ``evicted_sequences`` counts removals from each tree (a sequence held
        by a stage shard and its pipeline tree counts twice);
        ``evicted_bytes`` the live bytes those removals freed (0 when the
        speculator has no byte budget).
        """
        # Copied at once: another thread may ask while this one learns.
        shards = [*self._stages.values(), *self._pipelines.values()]
        held = (
            self._bytes
            if self._metered
            else sum(live_bytes(s.tree.stats()) for s in shards if not s.tree.closed)
        )
        return {
            "bytes": held,
            "max_bytes": self._max_bytes,
            "max_shard_tokens": self._max_tokens,
            "shards": len(self._stages),
            "trees": len(shards),
            "tokens": sum(s.tokens for s in shards),
            "evicted_sequences": self.evicted_sequences,
            "evicted_bytes": self.evicted_bytes,
        }

    def _resize(self, shard: _Shard, delta: int) -> None:
        """Change a shard's token count, invalidating cached trees when it turns warm or cold."""
        was_warm = shard.tokens >= self._cold_tokens
        shard.tokens += delta
        if (shard.tokens >= self._cold_tokens) != was_warm:
            self._version += 1

    # --- shards ---------------------------------------------------------------

    def shard(self, stage: str | None = None, pipeline: str | None = None) -> SuffixTree | None:
        """The stage shard of (pipeline, stage), or None if it does not exist."""
        if not self._stage_shards:
            return None
        found = self._stages.get((pipeline, stage))
        return found.tree if found else None

    def pipeline_tree(self, pipeline: str | None = None) -> SuffixTree | None:
        """The pipeline-wide tree of a pipeline, or None."""
        found = self._pipelines.get(pipeline)
        return found.tree if found else None

    def shards(self) -> dict[StageKey, SuffixTree]:
        """Every stage shard by (pipeline, stage)."""
        return {key: shard.tree for key, shard in self._stages.items()}

    @property
    def active_requests(self) -> frozenset[Hashable]:
        """Ids of the requests started and not finished."""
        return frozenset(self._requests)

    def close(self) -> None:
        """Free every cursor and tree now."""
        for req in self._requests.values():
            req.cursor.close()
        self._requests.clear()
        for shard in self._all_shards():
            shard.tree.close()
            self._unmeter(shard)
        self._stages.clear()
        self._pipelines.clear()
        self._version += 1
        if self._budget is not None:
            self._budget.leave(self)

    def __enter__(self) -> Speculator:
        """Use in a ``with`` block; closed on exit."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close on leaving the ``with`` block."""
        self.close()

    # --- internals ------------------------------------------------------------

    def _request(self, req_id: Hashable) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise InvalidArgumentError(f"request {req_id!r} is not active")
        return req

    def _request_trees(self, req: _Request) -> list[SuffixTree]:
        """The trees a request drafts from, recomputed only when shards changed."""
        if req.version != self._version:
            req.trees = self._trees_for(req.key)
            req.version = self._version
        return req.trees

    def _all_shards(self) -> Iterator[_Shard]:
        yield from self._stages.values()
        yield from self._pipelines.values()

    def _new_shard(self) -> _Shard:
        self._version += 1
        shard = _Shard(SuffixTree(self._max_depth))
        self._meter(shard)
        return shard

    def _shards_for(self, key: StageKey, *, create: bool) -> list[_Shard]:
        """The shards a response of ``key`` is learned into: stage, then pipeline.

        While a pipeline has a single stage its pipeline tree would duplicate
        that stage's shard, so it is only made when a second stage shows up,
        filled with what the existing stage shards hold (their open
        sequences stay open there, for their requests to go on appending).
        """
        out: list[_Shard] = []
        if not self._stage_shards:
            shard = self._pipelines.get(key[0])
            if shard is None and create:
                shard = self._pipelines[key[0]] = self._new_shard()
            return [shard] if shard is not None else []
        stage = self._stages.get(key)
        if stage is None and create:
            stage = self._stages[key] = self._new_shard()
        if stage is not None:
            out.append(stage)
        if self._pipeline_tree:
            pipe = self._pipelines.get(key[0])
            if pipe is None and create:
                siblings = [s for k, s in self._stages.items() if k[0] == key[0] and k != key]
                if siblings:
                    pipe = self._pipelines[key[0]] = self._new_shard()
                    # In arrival order, so that the pipeline tree evicts oldest first.
                    closed = sorted(
                        (
                            (stamp, seq, n, sibling)
                            for sibling in siblings
                            for seq, n, stamp in sibling.order
                        ),
                        key=lambda e: (e[0], e[1]),
                    )
                    for stamp, seq, n, sibling in closed:
                        self._learn(pipe, seq, sibling.tree.sequence(seq), n, stamp)
                    for sibling in siblings:
                        for seq, n in sibling.live.items():
                            pipe.tree.append(seq, sibling.tree.sequence(seq))
                            pipe.live[seq] = n
                            self._resize(pipe, n)
                    self._meter(pipe)
            if pipe is not None:
                out.append(pipe)
        return out

    def _trees_for(self, key: StageKey) -> list[SuffixTree]:
        """The global trees a request of ``key`` drafts from, most specific first.

        The fallback for a missing or cold stage shard is the pipeline tree,
        or, while the pipeline has a single stage (and so no pipeline tree
        yet), that stage's shard.
        """
        if not self._stage_shards:
            pipe = self._pipelines.get(key[0])
            return [pipe.tree] if pipe is not None else []
        stage = self._stages.get(key)
        fallback: _Shard | None = None
        if self._pipeline_tree:
            fallback = self._pipelines.get(key[0])
            if fallback is None:
                fallback = next((s for k, s in self._stages.items() if k[0] == key[0]), None)
        trees: list[SuffixTree] = []
        if stage is not None and (
            fallback is None or fallback is stage or stage.tokens >= self._cold_tokens
        ):
            trees.append(stage.tree)
        if fallback is not None and fallback is not stage:
            trees.append(fallback.tree)
        return trees

    def _source_name(self, req: _Request, own: list[SuffixTree], draft: Draft, index: int) -> str:
        """Where a draft of ``req`` came from (see `draft_source`); ``index``
        names its global tree among ``own`` (the request's trees) and the extras
        after them."""
        if draft.source != "global":
            return draft.source
        if index >= len(own):
            return "extra"
        stage = self._stages.get(req.key)
        return "stage" if stage is not None and stage.tree is own[index] else "pipeline"
