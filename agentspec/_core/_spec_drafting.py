"""Batching and goodput control of `agentspec._core.speculator.Speculator`'s drafts.

Drafts are cut by the `GoodputController` (`_control`), which learns from
what the verifier accepted (`_Drafting._report`); batched drafting reuses a
few `BatchDrafter` objects; extra trees join a request's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentspec._core import lowlevel
from agentspec._core._spec_state import _Request, _SpeculatorState
from agentspec._core.batch import BatchDrafter
from agentspec._core.draft import Draft, DraftParams
from agentspec._core.goodput import GoodputController
from agentspec._core.tree import SuffixTree
from agentspec.exceptions import InvalidArgumentError
from agentspec.protocol import StageKey

#: Most ``extra_trees`` one draft accepts: a request drafts from its stage shard
#: and its pipeline tree, and the native call takes `lowlevel.MAX_GLOBALS` trees.
MAX_EXTRA_TREES: int = lowlevel.MAX_GLOBALS - 2


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


class _Drafting(_SpeculatorState):
    """Reports verified tokens to the controller, keeps batch drafters, adds extra trees."""

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
