"""The proposer's logic on a real agentspec engine, without vLLM.

vLLM's model runner is replaced by the few attributes the proposer reads
(``requests[id].sampling_params.extra_args``, ``input_batch.req_ids`` /
``num_prompt_tokens``, ``drafter``); `Loop` drives it like the runner's greedy
decode loop: each step accepts the longest prefix of the previous draft that
matches the request's predetermined output, plus one token, writes them into
``token_ids_cpu`` and asks for the next drafts.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from agentspec_vllm.config import load_config
from agentspec_vllm.proposer import AgentSpecProposer
from agentspec_vllm.shards import reset_worker_intake
from agentspec_vllm.worker_ext import AgentSpecWorkerExtension

from agentspec import DraftParams, ShardIntake, Speculator, SuffixTree
from agentspec._push.wire import SHARD_CONTENT_TYPE, SHARDS_PATH, SNAPSHOT_PATH, encode_key_query
from agentspec.exceptions import InvalidArgumentError

K = 8
MAX_LEN = 256
VOCAB = 1000
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
ANSWER = [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316]
# Steps to generate ANSWER when every draft is right: the prefill step samples
# the first token without a draft, then each step accepts K drafted tokens + 1.
BEST = 1 + -(-(len(ANSWER) - 1) // (K + 1))


@pytest.fixture(autouse=True)
def fresh_intake() -> Any:
    """Each test gets its own worker intake (it is process-global, like in a worker)."""
    reset_worker_intake()
    yield
    reset_worker_intake()


def vllm_config(k: int = K, max_len: int = MAX_LEN, **agentspec: Any) -> Any:
    """The parts of vLLM's VllmConfig the proposer reads.

    The step counts below assume that every learned token is drafted, as the
    count-only policy does (``policy: counts``); the default confidence policy
    stops where one earlier response is thin evidence, and has its own test.
    """
    agentspec.setdefault("policy", "counts")
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_len, get_vocab_size=lambda: VOCAB),
        additional_config={"agentspec": agentspec} if agentspec else {},
    )


class Loop:
    """A stand-in for the runner: request table, input batch and greedy verification."""

    def __init__(self, proposer: AgentSpecProposer, max_reqs: int = 8) -> None:
        self.drafter = proposer
        self.requests: dict[str, Any] = {}
        self.token_ids_cpu = np.zeros((max_reqs, proposer.max_model_len), dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(max_reqs, dtype=np.int32)
        self.num_prompt = np.zeros(max_reqs, dtype=np.int32)
        self.rows: list[str] = []
        self.answers: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}  # answer tokens produced so far
        self.drafts: dict[str, list[int]] = {}
        self.accepted: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        proposer.bind_runner(self)

    @property
    def input_batch(self) -> Any:
        return SimpleNamespace(req_ids=list(self.rows), num_prompt_tokens=self.num_prompt)

    def add(
        self,
        req_id: str,
        prompt: list[int],
        answer: list[int],
        max_tokens: int | None = None,
        **tags: Any,
    ) -> None:
        extra = {f"agentspec_{k}": v for k, v in tags.items()}
        params = SimpleNamespace(extra_args=extra, max_tokens=max_tokens)
        self.requests[req_id] = SimpleNamespace(sampling_params=params)
        row = len(self.rows)
        self.rows.append(req_id)
        self.token_ids_cpu[row, : len(prompt)] = prompt
        self.num_tokens_no_spec[row] = len(prompt)
        self.num_prompt[row] = len(prompt)
        self.answers[req_id] = answer
        self.done[req_id] = 0
        self.drafts[req_id] = []
        self.accepted[req_id] = 0
        self.steps[req_id] = 0

    def remove(self, req_id: str) -> None:
        """The request finished: it leaves the request table and the batch."""
        del self.requests[req_id]
        self._drop_row(req_id)

    def _drop_row(self, req_id: str) -> None:
        row = self.rows.index(req_id)
        last = len(self.rows) - 1
        for arr in (self.token_ids_cpu, self.num_tokens_no_spec, self.num_prompt):
            arr[row] = arr[last]
        self.rows[row] = self.rows[last]
        self.rows.pop()

    def step(self, prefill: frozenset[str] = frozenset()) -> list[list[int]]:
        """One decode step for every row (rows in ``prefill`` sample nothing)."""
        sampled: list[list[int]] = []
        for row, rid in enumerate(self.rows):
            answer, done = self.answers[rid], self.done[rid]
            if rid in prefill or done >= len(answer):
                sampled.append([])
                continue
            good = 0
            for tok in self.drafts[rid]:
                if done + good + 1 < len(answer) and tok == answer[done + good]:
                    good += 1
                else:
                    break
            new = answer[done : done + good + 1]
            n = int(self.num_tokens_no_spec[row])
            self.token_ids_cpu[row, n : n + len(new)] = new
            self.num_tokens_no_spec[row] = n + len(new)
            self.done[rid] = done + len(new)
            self.accepted[rid] += good
            self.steps[rid] += 1
            sampled.append(new)
        drafts = self.drafter.propose(sampled, self.num_tokens_no_spec, self.token_ids_cpu)
        assert len(drafts) == len(self.rows)
        for rid, d in zip(self.rows, drafts, strict=True):
            self.drafts[rid] = d
        return drafts

    def run(self, req_id: str, prompt: list[int], answer: list[int], **tags: Any) -> int:
        """Generate one request to its end; returns its decode steps."""
        self.add(req_id, prompt, answer, **tags)
        while self.done[req_id] < len(answer):
            self.step()
        self.remove(req_id)
        return self.steps[req_id]


def test_drafts_respect_k_and_learn_a_stage() -> None:
    proposer = AgentSpecProposer(vllm_config())
    loop = Loop(proposer)
    first = loop.run("a", PROMPT, ANSWER, stage="SQL", pipeline="t2s")
    loop.step()  # the next step sweeps "a" out: its response is learned
    assert proposer.active_requests == frozenset()
    second = loop.run("b", PROMPT, ANSWER, stage="SQL", pipeline="t2s")
    # Without history every token costs a step; with the learned response every
    # draft (at most K tokens) is right.
    assert first == len(ANSWER)
    assert second == BEST
    stats = {(e["pipeline"], e["stage"]): e for e in proposer.stats()["keys"]}
    sql = stats[("t2s", "SQL")]
    assert sql["requests"] == 2
    assert sql["learned"] == 1  # "b" is swept at the next step
    assert sql["sources"].get("stage", 0) >= 1
    assert sql["accepted_tokens"] == loop.accepted["b"] == len(ANSWER) - second


def test_other_stage_and_other_tenant_do_not_use_the_shard() -> None:
    proposer = AgentSpecProposer(vllm_config())
    loop = Loop(proposer)
    loop.run("a", PROMPT, ANSWER, stage="SQL", pipeline="t2s", tenant="acme")
    loop.step()
    same = loop.run("b", PROMPT, ANSWER, stage="SQL", pipeline="t2s", tenant="acme")
    other_stage = loop.run("c", PROMPT, ANSWER, stage="Classify", pipeline="other", tenant="acme")
    other_tenant = loop.run("d", PROMPT, ANSWER, stage="SQL", pipeline="t2s", tenant="zeta")
    untagged = loop.run("e", PROMPT, ANSWER)
    assert same == BEST
    assert other_stage == other_tenant == untagged == len(ANSWER)
    assert proposer.stats()["tenants"] == ["acme", "default", "zeta"]


def test_prefill_rows_get_no_draft_and_requests_start_during_prefill() -> None:
    proposer = AgentSpecProposer(vllm_config())
    loop = Loop(proposer)
    loop.add("a", PROMPT, ANSWER, stage="S")
    drafts = loop.step(prefill=frozenset({"a"}))
    assert drafts == [[]]
    assert proposer.active_requests == {"a"}  # tree built while the prompt is prefilled


def test_never_drafts_past_max_model_len() -> None:
    max_len = len(PROMPT) + 6
    proposer = AgentSpecProposer(vllm_config(max_len=max_len))
    loop = Loop(proposer)
    repeat = ANSWER[:5] * 4
    loop.run("a", PROMPT, repeat[:5], stage="S")
    loop.step()
    loop.add("b", PROMPT, repeat, stage="S")
    while loop.done["b"] < 5:
        drafts = loop.step()
        n = int(loop.num_tokens_no_spec[0])
        assert len(drafts[0]) <= max(0, max_len - n - 1)
    row = loop.rows.index("b")
    loop.num_tokens_no_spec[row] = max_len - 1
    assert loop.step()[row] == []


def test_never_drafts_past_max_tokens() -> None:
    proposer = AgentSpecProposer(vllm_config())
    loop = Loop(proposer)
    loop.run("a", PROMPT, ANSWER, stage="S")
    loop.step()
    # "b" may produce 7 tokens: after the prefill's first token a draft of at
    # most 5 fills the rest (5 accepted + 1 bonus), and the last step drafts none.
    loop.add("b", PROMPT, ANSWER[:7], max_tokens=7, stage="S")
    lengths = []
    while loop.done["b"] < 7:
        drafts = loop.step()
        produced = int(loop.num_tokens_no_spec[0]) - len(PROMPT)
        assert len(drafts[0]) <= max(0, 7 - produced - 1)
        lengths.append(len(drafts[0]))
    assert lengths == [5, 0]  # the learned answer was drafted, cut at max_tokens
    assert loop.steps["b"] == 2


def test_left_requests_are_finished_paused_ones_kept_and_reused_ids_restarted() -> None:
    proposer = AgentSpecProposer(vllm_config())
    loop = Loop(proposer)
    loop.add("a", PROMPT, ANSWER, stage="S")
    loop.add("b", PROMPT, ANSWER, stage="S")
    loop.step()
    loop.step()
    loop._drop_row("b")  # preempted: out of the batch, still in the request table
    loop.step()
    assert proposer.active_requests == {"a", "b"}
    loop.remove("a")
    del loop.requests["b"]
    loop.add("c", PROMPT, ANSWER)
    loop.step()
    assert proposer.active_requests == {"c"}
    # Same id, new request object (aborted and resubmitted): the old one is finished.
    old = loop.requests["c"]
    loop.requests["c"] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args={}))
    loop.step()
    assert proposer.active_requests == {"c"}
    stats = proposer.stats()["keys"]
    assert sum(e["requests"] for e in stats) == 4
    assert old is not loop.requests["c"]
    assert proposer.sweep({}) == 1
    assert proposer.active_requests == frozenset()


def test_bad_tags_fall_back_to_the_default_shard() -> None:
    proposer = AgentSpecProposer(vllm_config())
    loop = Loop(proposer)
    loop.add("a", PROMPT, ANSWER, stage="bad\x01stage")
    loop.add("b", PROMPT, ANSWER, stage=["list"])
    loop.add("c", PROMPT, ANSWER, stage=7, pipeline=1.5)
    loop.step()
    stats = proposer.stats()
    assert stats["bad_tags"] == 2
    keys = {(e["tenant"], e["pipeline"], e["stage"]): e["requests"] for e in stats["keys"]}
    assert keys == {("default", None, None): 2, ("default", "1.5", "7"): 1}


def _snapshot(tokens: list[int], depth: int = 64) -> bytes:
    tree = SuffixTree(depth)
    tree.add(1, tokens)
    data = tree.to_bytes()
    tree.close()
    return bytes(data)


class Worker(AgentSpecWorkerExtension):
    """The attributes of vLLM's worker the extension uses."""

    def __init__(self, runner: Any, config: Any) -> None:
        self.model_runner = runner
        self.vllm_config = config


def _push(worker: Worker, key: tuple[str, str | None, str | None], data: bytes) -> int:
    status, headers, _ = worker.agentspec_handle(
        "PUT", SNAPSHOT_PATH, encode_key_query(key), {"Content-Type": SHARD_CONTENT_TYPE}, data
    )
    assert headers["Content-Type"].startswith("application/json")
    return status


def test_pushed_stage_shard_is_drafted_from_through_the_worker_extension() -> None:
    config = vllm_config()
    proposer = AgentSpecProposer(config)
    loop = Loop(proposer)
    worker = Worker(loop, config)
    assert worker.agentspec_intake() is proposer.intake
    assert _push(worker, ("acme", "t2s", "SQL"), _snapshot(PROMPT[-8:] + ANSWER)) == 200
    pushed = loop.run("a", PROMPT, ANSWER, stage="SQL", pipeline="t2s", tenant="acme")
    elsewhere = loop.run("b", PROMPT, ANSWER, stage="SQL", pipeline="t2s", tenant="other")
    assert pushed == BEST
    assert elsewhere == len(ANSWER)
    stats = worker.agentspec_stats()
    assert stats["instance"] == proposer.intake.instance
    assert [(s["tenant"], s["stage"]) for s in stats["pushed"]] == [("acme", "SQL")]
    acme = next(e for e in stats["proposer"]["keys"] if e["tenant"] == "acme")
    assert acme["sources"].get("extra", 0) >= 1
    assert stats["proposer"]["active_requests"] == 0  # the stats call swept "b"
    status, _, body = worker.agentspec_handle("GET", SHARDS_PATH, "", {}, b"")
    assert status == 200
    assert b'"acme"' in body


def test_intake_errors_come_back_as_answers() -> None:
    config = vllm_config(api_key="sekret")
    proposer = AgentSpecProposer(config)
    worker = Worker(Loop(proposer), config)
    assert _push(worker, ("default", None, "S"), _snapshot(ANSWER)) == 401
    status, _, _ = worker.agentspec_handle(
        "PUT",
        SNAPSHOT_PATH,
        "stage=S",
        {"Authorization": "Bearer sekret", "Content-Type": SHARD_CONTENT_TYPE},
        b"not a shard",
    )
    assert status == 400
    status, _, _ = worker.agentspec_handle(
        "PUT",
        SNAPSHOT_PATH,
        "stage=S",
        {"Authorization": "Bearer sekret", "Content-Type": SHARD_CONTENT_TYPE},
        _snapshot(ANSWER, depth=32),
    )
    assert status == 409  # the worker's trees have depth 64


def test_pushed_tokens_outside_the_vocabulary_are_cut() -> None:
    config = vllm_config()
    proposer = AgentSpecProposer(config)
    loop = Loop(proposer)
    worker = Worker(loop, config)
    bad = [*ANSWER[:3], VOCAB + 5, *ANSWER[3:]]
    # The intake knows the model's vocabulary: such a shard is refused.
    assert proposer.intake.vocab_size == VOCAB
    assert _push(worker, ("default", None, "S"), _snapshot(PROMPT[-8:] + bad)) == 422
    # Taken without the bound (e.g. before it was known), drafts still end there.
    proposer.intake.vocab_size = None
    assert _push(worker, ("default", None, "S"), _snapshot(PROMPT[-8:] + bad)) == 200
    loop.add("a", PROMPT, ANSWER, stage="S")
    loop.step()
    assert loop.drafts["a"] == ANSWER[1:3]


def test_worker_extension_without_the_proposer_still_takes_pushes() -> None:
    config = vllm_config(max_depth=32)
    worker = Worker(SimpleNamespace(drafter=None), config)
    assert worker.agentspec_proposer() is None
    assert _push(worker, ("default", None, "S"), _snapshot(ANSWER, depth=32)) == 200
    stats = worker.agentspec_stats()
    assert stats["proposer"] is None
    assert len(stats["pushed"]) == 1


def test_runner_is_found_in_the_callers_frame() -> None:
    proposer = AgentSpecProposer(vllm_config())

    class Runner:
        def __init__(self) -> None:
            self.drafter = proposer
            self.requests = {"x": SimpleNamespace(sampling_params=None)}
            self.input_batch = SimpleNamespace(req_ids=["x"], num_prompt_tokens=[3])

        def propose_draft_token_ids(self) -> list[list[int]]:
            tokens = np.array([[5, 6, 7, 8]], dtype=np.int32)
            return self.drafter.propose([[8]], np.array([4]), tokens, slot_mappings=None)

    runner = Runner()
    assert runner.propose_draft_token_ids() == [[]]
    assert proposer.stats()["bound"] is True
    assert proposer.active_requests == {"x"}


def test_unbound_proposer_proposes_nothing() -> None:
    proposer = AgentSpecProposer(vllm_config())
    tokens = np.array([[5, 6, 7, 8]], dtype=np.int32)
    assert proposer.propose([[8]], np.array([4]), tokens) == [[]]
    proposer.close()
    assert proposer.propose([[8]], np.array([4]), tokens) == [[]]


def test_config_sources_and_errors() -> None:
    env = {
        "AGENTSPEC_VLLM_ALPHA": "2.5",
        "AGENTSPEC_API_KEY": "sk-xyzzy",
        "AGENTSPEC_VLLM_LEARN": "no",
    }
    cfg = load_config({"agentspec": {"alpha": 1.5, "max_depth": 32}}, env)
    assert (cfg.alpha, cfg.max_depth, cfg.api_key, cfg.learn) == (1.5, 32, "sk-xyzzy", False)
    assert cfg.public()["api_key"] is True
    assert "xyzzy" not in repr(cfg)
    assert load_config(None, {}).max_shard_tokens is None
    assert load_config({}, {"AGENTSPEC_VLLM_MAX_SHARD_TOKENS": "100"}).max_shard_tokens == 100
    with pytest.raises(InvalidArgumentError, match="unknown agentspec setting"):
        load_config({"agentspec": {"depth": 3}}, {})
    with pytest.raises(InvalidArgumentError, match="max_depth"):
        load_config({"agentspec": {"max_depth": "deep"}}, {})
    with pytest.raises(InvalidArgumentError, match="min_token_prob"):
        load_config({}, {"AGENTSPEC_VLLM_MIN_TOKEN_PROB": "2"})
    with pytest.raises(InvalidArgumentError, match="JSON object"):
        load_config({"agentspec": [1]}, {})
    with pytest.raises(InvalidArgumentError, match="num_speculative_tokens"):
        AgentSpecProposer(vllm_config(k=0))


def test_config_policy_picks_the_draft_params() -> None:
    """The confidence policy is the default; ``counts`` drafts as arctic does; alpha and
    min_token_prob override either policy's own values only where they are set."""
    cfg = load_config(None, {})
    assert (cfg.policy, cfg.alpha, cfg.min_token_prob) == ("confidence", None, None)
    assert cfg.draft_params(8, 1000) == DraftParams.confident(max_spec_tokens=8, vocab_size=1000)
    counts = load_config({"agentspec": {"policy": "counts"}}, {})
    assert counts.draft_params(8, None) == DraftParams(max_spec_tokens=8)
    both = load_config({}, {"AGENTSPEC_VLLM_POLICY": "counts", "AGENTSPEC_VLLM_ALPHA": "2"})
    assert both.draft_params(8, None) == DraftParams(max_spec_tokens=8, alpha=2.0)
    cut = load_config({"agentspec": {"min_token_prob": 0.4}}, {})
    assert cut.draft_params(4, None) == DraftParams.confident(max_spec_tokens=4, min_token_prob=0.4)
    assert load_config({}, {"AGENTSPEC_VLLM_ALPHA": "none"}).alpha is None
    with pytest.raises(InvalidArgumentError, match="policy"):
        load_config({"agentspec": {"policy": "magic"}}, {})
    with pytest.raises(InvalidArgumentError, match="alpha"):
        load_config({}, {"AGENTSPEC_VLLM_ALPHA": "fast"})


def test_learning_can_be_switched_off() -> None:
    proposer = AgentSpecProposer(vllm_config(learn=False))
    loop = Loop(proposer)
    loop.run("a", PROMPT, ANSWER, stage="S")
    loop.step()
    assert loop.run("b", PROMPT, ANSWER, stage="S") == len(ANSWER)


def test_speculator_extra_trees_are_checked() -> None:
    with Speculator(16) as spec:
        spec.start_request("r", PROMPT)
        trees = [SuffixTree(16) for _ in range(3)]
        try:
            with pytest.raises(InvalidArgumentError, match="extra trees"):
                spec.draft("r", extra_trees=trees)
            with pytest.raises(TypeError, match="SuffixTree"):
                spec.draft("r", extra_trees=[object()])  # type: ignore[list-item]
            trees[0].add(1, [*PROMPT[-4:], 1, 2, 3])
            draft, source = spec.draft_source("r", extra_trees=trees[:1])
            assert (draft.token_ids, source) == ([1, 2, 3], "extra")
        finally:
            for t in trees:
                t.close()


def test_intake_is_shared_per_process() -> None:
    a = AgentSpecProposer(vllm_config())
    b = AgentSpecProposer(vllm_config())
    assert a.intake is b.intake
    assert isinstance(a.intake, ShardIntake)


def _head_start_steps(head: int, **agentspec: Any) -> int:
    """Steps "b" takes to generate ANSWER while "a", ``head`` tokens ahead, generates it too."""
    proposer = AgentSpecProposer(vllm_config(**agentspec))
    loop = Loop(proposer)
    loop.add("a", PROMPT, ANSWER, stage="SQL", pipeline="t2s")
    loop.add("b", [1, *PROMPT], ANSWER, stage="SQL", pipeline="t2s")
    for _ in range(head):
        loop.step(prefill=frozenset({"b"}))
    while loop.done["b"] < len(ANSWER):
        loop.step()
    return loop.steps["b"]


def test_live_learning_drafts_from_requests_in_flight() -> None:
    """A request drafts from a concurrent one's partial output only with live_learning."""
    assert load_config({}, {}).live_learning
    assert not load_config({}, {"AGENTSPEC_VLLM_LIVE_LEARNING": "off"}).live_learning
    live = _head_start_steps(10)
    late = _head_start_steps(10, live_learning=False)
    off = _head_start_steps(10, learn=False)
    assert live < late
    assert off == len(ANSWER)  # learn=False also turns live learning off


def test_live_response_of_a_restarted_request_is_not_learned() -> None:
    """A request whose prompt changed (recomputed) drops its partial response from the shard."""
    proposer = AgentSpecProposer(vllm_config())
    loop = Loop(proposer)
    loop.add("a", PROMPT, ANSWER, stage="S")
    for _ in range(4):
        loop.step()
    spec = proposer._tenants["default"]
    tree = spec.shard(stage="S")
    assert tree is not None
    assert tree.stats().open_sequences == 1
    loop.num_prompt[0] = len(PROMPT) + 1  # same request object, new prompt: restarted
    loop.step()
    tree = spec.shard(stage="S")
    assert tree is not None
    assert (len(tree), tree.stats().open_sequences) == (1, 1)  # the old one is gone
    loop.remove("a")
    loop.step()
    assert (len(tree), tree.stats().open_sequences) == (1, 0)


# --- memory budgets -------------------------------------------------------------------


def test_budget_settings_from_the_environment_and_the_config() -> None:
    cfg = load_config(None, {})
    assert (cfg.max_shard_bytes, cfg.max_tenant_shard_bytes) == (1 << 30, 256 << 20)
    assert (cfg.max_learned_bytes, cfg.max_tenant_learned_bytes) == (1 << 30, 256 << 20)
    assert cfg.max_body_bytes == 32 << 20
    env = {
        "AGENTSPEC_VLLM_MAX_SHARD_BYTES": "512MiB",
        "AGENTSPEC_VLLM_MAX_TENANT_SHARD_BYTES": "none",
        "AGENTSPEC_VLLM_MAX_LEARNED_BYTES": "2GiB",
        "AGENTSPEC_VLLM_MAX_TENANT_LEARNED_BYTES": "1000000",
        "AGENTSPEC_VLLM_MAX_SHARD_TOKENS": "4096",
        "AGENTSPEC_VLLM_MAX_BODY_BYTES": "8M",
    }
    cfg = load_config(None, env)
    assert cfg.max_shard_bytes == 512 << 20
    assert cfg.max_tenant_shard_bytes is None
    assert cfg.max_learned_bytes == 2 << 30
    assert cfg.max_tenant_learned_bytes == 1_000_000
    assert cfg.max_shard_tokens == 4096
    assert cfg.max_body_bytes == 8 << 20
    # the additional config wins over the environment
    cfg = load_config({"agentspec": {"max_shard_bytes": "1GiB", "max_learned_bytes": None}}, env)
    assert (cfg.max_shard_bytes, cfg.max_learned_bytes) == (1 << 30, None)
    assert cfg.public()["max_tenant_learned_bytes"] == 1_000_000
    with pytest.raises(InvalidArgumentError, match="max_shard_bytes"):
        load_config({}, {"AGENTSPEC_VLLM_MAX_SHARD_BYTES": "lots"})
    with pytest.raises(InvalidArgumentError, match="max_body_bytes"):
        load_config({}, {"AGENTSPEC_VLLM_MAX_BODY_BYTES": "none"})
    with pytest.raises(InvalidArgumentError, match="max_learned_bytes"):
        load_config({"agentspec": {"max_learned_bytes": -1}}, {})


def test_vllm_args_budgets_pass_the_plugin_check() -> None:
    from agentspec._cli.vllm import vllm_launch

    launch = vllm_launch(
        agentspec_config={"max_shard_bytes": 1 << 29, "max_learned_bytes": None}, environ={}
    )
    extra = launch.args[launch.args.index("--additional-config") + 1]
    assert load_config(json.loads(extra), {}).max_shard_bytes == 1 << 29
    with pytest.raises(InvalidArgumentError, match="max_tenant_shard_bytes"):
        vllm_launch(agentspec_config={"max_tenant_shard_bytes": "lots"}, environ={})


def test_worker_intake_has_the_budgets_and_the_vocabulary() -> None:
    config = vllm_config(max_shard_bytes="4MiB", max_tenant_shard_bytes=20_000, max_body_bytes=4096)
    proposer = AgentSpecProposer(config)
    intake = proposer.intake
    assert (intake.max_bytes, intake.max_tenant_bytes) == (4 << 20, 20_000)
    assert (intake.max_body_bytes, intake.vocab_size) == (4096, VOCAB)
    worker = Worker(Loop(proposer), config)
    assert _push(worker, ("acme", None, "S"), _snapshot(ANSWER)) == 200
    big = SuffixTree(64)
    big.add(1, [t % VOCAB for t in range(900)])
    assert _push(worker, ("acme", None, "T"), big.to_bytes()) == 507  # over acme's 20 kB
    assert _push(worker, ("other", None, "T"), _snapshot(ANSWER)) == 200
    status, _, body = worker.agentspec_handle("GET", SHARDS_PATH, "", {}, b"")
    assert status == 200
    listing = json.loads(body)
    assert listing["budget"]["tenants"]["acme"]["refused"] == 1
    assert listing["budget"]["tenants"]["other"]["refused"] == 0
    assert "learned" in listing
    assert worker.agentspec_stats()["pushed_budget"]["refused"] == 1


def test_worker_extension_alone_takes_the_vocabulary_from_the_model_config() -> None:
    config = vllm_config()
    worker = Worker(SimpleNamespace(drafter=None), config)
    assert worker.agentspec_intake().vocab_size == VOCAB
    assert _push(worker, ("default", None, "S"), _snapshot([1, 2, VOCAB])) == 422


def test_learned_shards_evict_at_the_tenant_budget() -> None:
    proposer = AgentSpecProposer(vllm_config(max_tenant_learned_bytes=12_000))
    loop = Loop(proposer)
    for i in range(12):
        answer = [(t * (i + 3)) % VOCAB for t in range(40)]
        loop.run(f"r{i}", PROMPT, answer, stage="S", tenant="acme")
        loop.step()
        learned = proposer.stats()["learned"]
        assert learned["tenants"]["acme"]["bytes"] <= 12_000
    assert learned["tenants"]["acme"]["evicted_sequences"] > 0
    assert learned["tenants"]["acme"]["evicted_bytes"] > 0
    assert learned["max_tenant_bytes"] == 12_000
    assert learned["bytes"] == proposer.learned_budget.bytes
