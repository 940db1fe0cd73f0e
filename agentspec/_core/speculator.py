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

`Speculator` holds the requests and every public method; its other jobs
are private bases, one module each: `_spec_state` (shards, requests),
`_spec_budget` (eviction by tokens and bytes), `_spec_layout` (which trees
a key learns into and drafts from), `_spec_learning` (learning responses,
closed or live), `_spec_drafting` (goodput control, batch drafters, extra
trees).
"""

from __future__ import annotations

import array
from collections.abc import Hashable, Sequence
from typing import Any

from agentspec._core import lowlevel
from agentspec._core._spec_drafting import MAX_EXTRA_TREES as MAX_EXTRA_TREES
from agentspec._core._spec_drafting import _control, _Drafting
from agentspec._core._spec_drafting import _group as _group
from agentspec._core._spec_learning import _Learning
from agentspec._core._spec_state import _int32_array, _Request, _Shard
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


class Speculator(_Learning, _Drafting):
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
        extra_names: Sequence[str] | None = None,
    ) -> tuple[Draft, str]:
        """`draft`, plus which tree it came from: "stage", "pipeline", "extra"
        (one of ``extra_trees``; with ``extra_names``, one name per extra tree,
        that tree's name), "local", "merged" or "none"."""
        req = self._request(req_id)
        own = self._request_trees(req)
        trees = self._with_extra(own, extra_trees)
        draft, index = req.cursor._draft_multi(trees, params or self._params, self._handles)
        name = self._source_name(req, own, draft, index)
        if name == "extra" and extra_names is not None:
            tree = trees[index]
            name = next(n for t, n in zip(extra_trees, extra_names, strict=True) if t is tree)
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

    def shard_sizes(self) -> dict[StageKey, tuple[int, int]]:
        """Per stage shard its tokens and live bytes (bytes 0 without a byte
        budget); a pipeline tree's are added under the key ``(pipeline, None)``.
        Read without waiting (copied at once)."""
        stages = list(self._stages.items())
        pipelines = list(self._pipelines.items())
        out: dict[StageKey, tuple[int, int]] = {k: (s.tokens, s.bytes) for k, s in stages}
        for pipeline, shard in pipelines:
            key: StageKey = (pipeline, None)
            tokens, nbytes = out.get(key, (0, 0))
            out[key] = (tokens + shard.tokens, nbytes + shard.bytes)
        return out

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
