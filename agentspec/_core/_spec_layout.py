"""Shard layout of `agentspec._core.speculator.Speculator`: where a key learns and drafts.

With stage shards each (pipeline, stage) has a tree, and a pipeline with two
stages or more gets a pipeline-wide tree too (the fallback while a stage
shard is cold); without, one tree per pipeline.
"""

from __future__ import annotations

from typing import Any

from agentspec._core._spec_budget import _ByteBudget
from agentspec._core._spec_state import _Request, _Shard
from agentspec._core.draft import Draft
from agentspec._core.tree import SuffixTree
from agentspec.protocol import StageKey


class _ShardLayout(_ByteBudget):
    """Makes, finds and drops the shards of a key; names the tree a draft came from."""

    def _request_trees(self, req: _Request) -> list[SuffixTree]:
        """The trees a request drafts from, recomputed only when shards changed."""
        if req.version != self._version:
            req.trees = self._trees_for(req.key)
            req.version = self._version
        return req.trees

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
