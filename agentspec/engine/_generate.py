"""Greedy generation with drafts: the verifier's loop, and a Speculator drafter."""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentspec._core.draft import DraftParams
from agentspec._core.speculator import Speculator
from agentspec.engine._draft_tree import as_draft_tree
from agentspec.engine._verify import DraftInput, Verifier
from agentspec.exceptions import InvalidArgumentError

__all__ = [
    "Drafter",
    "GenerateResult",
    "SpeculatorDrafter",
    "StepStats",
    "generate_greedy",
    "speculator_drafter",
]

Drafter = Callable[[Sequence[int]], DraftInput]
"""A draft source: called with the context (prompt + tokens so far), returns a draft."""


@dataclass(frozen=True)
class StepStats:
    """One verification step: draft nodes verified, draft tokens accepted (bonus excluded)."""

    draft_len: int
    accepted: int


@dataclass
class GenerateResult:
    """Output of `generate_greedy`.

    Attributes:
        tokens: generated tokens; ends with the eos token when
            ``finish_reason == "stop"``.
        steps: one `StepStats` per forward pass after the prefill.
        finish_reason: "stop" (an eos token) or "length" (max_new_tokens).
    """

    tokens: list[int] = field(default_factory=list)
    steps: list[StepStats] = field(default_factory=list)
    finish_reason: str = "length"

    @property
    def forward_passes(self) -> int:
        """Verification forward passes (the prefill not counted)."""
        return len(self.steps)

    @property
    def accepted(self) -> int:
        """Draft tokens accepted over all steps."""
        return sum(s.accepted for s in self.steps)


def generate_greedy(
    verifier: Verifier,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos_ids: Collection[int] = (),
    drafter: Drafter | None = None,
) -> GenerateResult:
    """Greedy decoding of ``prompt`` with ``verifier``, verifying the drafter's drafts.

    The output is the model's greedy continuation whatever the drafts (they
    only change how many tokens each forward pass yields).  Drafts are cut to
    the tokens still allowed by ``max_new_tokens`` and the model's context.
    With ``drafter=None`` each forward pass yields one token.

    Raises:
        InvalidArgumentError: ``max_new_tokens < 0``, or a bad prompt/draft
            (see `Verifier.prefill` and `Verifier.step`).
    """
    limit = operator.index(max_new_tokens)
    if limit < 0:
        raise InvalidArgumentError("max_new_tokens must be >= 0", str(limit))
    eos = frozenset(eos_ids)
    result = GenerateResult()
    verifier.prefill(prompt)
    while len(result.tokens) < limit:
        remaining = limit - len(result.tokens)
        room = verifier.room()
        if room is not None and room < 1:
            break  # the context is full
        depth = remaining - 1 if room is None else min(remaining - 1, room)
        tree = (
            as_draft_tree(drafter(verifier.tokens), verifier.vocab_size, max_depth=depth)
            if drafter
            else None
        )
        emitted = verifier.step(tree)
        n_draft = 0 if tree is None else len(tree)
        result.steps.append(StepStats(n_draft, len(emitted) - 1))
        for tok in emitted[:remaining]:
            result.tokens.append(tok)
            if tok in eos:
                result.finish_reason = "stop"
                return result
    return result


class SpeculatorDrafter:
    """A `Drafter` over an active `Speculator` request (see `speculator_drafter`)."""

    def __init__(
        self,
        speculator: Speculator,
        req_id: Hashable,
        params: DraftParams | None = None,
        **overrides: Any,
    ) -> None:
        """Draft for ``req_id``, which must have been started with the prompt."""
        self.speculator = speculator
        self.req_id = req_id
        self.params = params
        self.overrides = overrides
        self._seen = -1  # context tokens the speculator has; -1 until the first call

    def sync(self, context: Sequence[int]) -> None:
        """Extend the request with the context tokens it has not seen yet.

        Call it with the final context before ``Speculator.finish`` so the
        last step's tokens are learned too.
        """
        if self._seen < 0:
            self._seen = len(context)  # the prompt, given to start_request
        elif len(context) > self._seen:
            self.speculator.extend(self.req_id, list(context[self._seen :]))
            self._seen = len(context)

    def __call__(self, context: Sequence[int]) -> DraftInput:
        """Sync with ``context`` and draft its continuation."""
        self.sync(context)
        return self.speculator.draft(self.req_id, self.params, **self.overrides)


def speculator_drafter(
    speculator: Speculator,
    req_id: Hashable,
    params: DraftParams | None = None,
    **overrides: Any,
) -> SpeculatorDrafter:
    """A `Drafter` over an active `Speculator` request.

    Each call extends the request with the context tokens that arrived since
    the previous call (the request must have been started with the prompt),
    then drafts.  ``overrides`` are `DraftParams` fields (e.g. ``tree=True``).
    """
    return SpeculatorDrafter(speculator, req_id, params, **overrides)
