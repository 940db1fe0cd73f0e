"""`AgentSpecProposer`: agentspec's stage-aware SuffixDecoding drafts as a vLLM proposer.

Load it with::

    --speculative-config '{"method": "custom_class",
                           "model": "agentspec_vllm.proposer.AgentSpecProposer",
                           "num_speculative_tokens": 8}'

vLLM's V1 model runner builds one instance per worker and, after every decode
step's bookkeeping, calls ``propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu, slot_mappings=...)`` synchronously; row ``i`` of those arrays is
``runner.input_batch.req_ids[i]`` and the answer is one draft (a list of token
ids, possibly empty) per row.  The call carries no request ids, so the
proposer binds the runner: through the worker extension's
``init_worker_extension`` hook on vLLM >= 0.33, otherwise by finding the
runner among its caller's frames on the first call.

Per request the proposer keeps an `agentspec.Speculator` request (a cursor and
a per-request tree over prompt + output), made when the request first shows
up, which is during its prefill when the prompt is chunked.  Tags come from
``SamplingParams.extra_args`` (``vllm_xargs`` in the OpenAI API):
``agentspec_tenant``, ``agentspec_pipeline``, ``agentspec_stage`` and
``agentspec_session``; untagged requests share the default shard
``("default", None, None)``.  Each tenant has its own `Speculator`, so tenants
never draft from each other's responses; within a tenant a request drafts
from its stage shard, its pipeline tree and the stage's pushed shard (see
`agentspec_vllm.shards`).  A request that left the runner's request table
finished: its response is learned into its stage shard (behind its prompt's
last tokens) and its cursor freed.  With ``live_learning`` (the default) a
response joins its shards token batch by token batch while it is generated,
so requests running at the same time (e.g. several candidate answers to one
question) draft from each other's partial outputs.

Each step feeds every row's new tokens first, then drafts all rows of a tenant
in one native call (`Speculator.draft_batch_source`; one call per tenant
present in the batch, usually one).  Drafts never exceed
``num_speculative_tokens`` nor reach ``max_model_len`` or the request's
``max_tokens`` (vLLM verifies a draft whole even when the request must stop
inside it, so those tokens would cost compute for nothing),
requests still in prefill get none, and drafted ids are always below the
model's vocabulary size (a pushed shard from another tokenizer cannot crash
the engine).

With ``redis_url`` set the worker joins the fleet (`agentspec_vllm.fleet`):
a request also drafts from the fleet shard of its key (the first request of
a tenant starts that tenant's subscriber), and each finished response is
published under ``extra_args["agentspec_request_id"]`` when the client sent
one, else vLLM's request id.  Neither ever waits on Redis.
"""

from __future__ import annotations

import array
import bisect
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from agentspec import Draft, DraftParams, GoodputController, ShardKey, Speculator, SuffixTree
from agentspec.exceptions import InvalidArgumentError
from agentspec.integration import LearnedBudget, get_logger
from agentspec.metrics import STEP_SECONDS_BUCKETS
from agentspec.protocol import (
    DEFAULT_TENANT,
    MAX_IDENTITY,
    XARG_PIPELINE,
    XARG_REQUEST_ID,
    XARG_SESSION,
    XARG_STAGE,
    XARG_TENANT,
    check_key,
)
from agentspec_vllm.config import AgentSpecVllmConfig, load_config
from agentspec_vllm.shards import pushed_tree, worker_intake

if TYPE_CHECKING:
    from agentspec_vllm.fleet import WorkerFleet

__all__ = [
    "TAG_PIPELINE",
    "TAG_REQUEST_ID",
    "TAG_SESSION",
    "TAG_STAGE",
    "TAG_TENANT",
    "AgentSpecProposer",
]

_log = get_logger()

#: The ``extra_args`` (``vllm_xargs``) keys read, as `agentspec.protocol` names them.
TAG_TENANT = XARG_TENANT
TAG_PIPELINE = XARG_PIPELINE
TAG_STAGE = XARG_STAGE
TAG_SESSION = XARG_SESSION
#: The request identity fleet publications use (else vLLM's request id).
TAG_REQUEST_ID = XARG_REQUEST_ID

#: How many caller frames the runner is looked for in (propose <- runner method <- closure).
_FRAME_DEPTH = 4


@dataclass
class KeyStats:
    """Counters of one shard key (tenant, pipeline, stage)."""

    requests: int = 0
    learned: int = 0
    steps: int = 0  # decode steps drafted for (a draft may be empty)
    drafts: int = 0  # non-empty drafts
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # of drafted tokens, those the target model confirmed
    published: int = 0  # finished responses handed to the fleet publisher
    sources: dict[str, int] = field(default_factory=dict)
    # Metrics only (not in `to_json`): verified drafts by their accepted length
    # (index n: n tokens accepted), and the "extra" drafts by the tree kind
    # the request had ("pushed", "fleet", or "pushed_or_fleet" with both).
    accepted_len: list[int] = field(default_factory=list)
    extra_kinds: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The counters plus the acceptance rate (accepted / drafted)."""
        rate = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        return {
            "requests": self.requests,
            "learned": self.learned,
            "steps": self.steps,
            "drafts": self.drafts,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "published": self.published,
            "acceptance_rate": rate,
            "sources": dict(self.sources),
        }


@dataclass
class _Active:
    """One request the proposer tracks."""

    state: Any  # the runner's request state object (identity tells a reused id apart)
    key: ShardKey
    session: str | None
    prompt_len: int
    fed: int  # tokens of the row given to the speculator so far
    end: int  # the row's last possible length (prompt + max_tokens, or max_model_len)
    last_draft: int = 0  # length of the draft proposed at the previous step
    identity: str = ""  # fleet identity (the client's agentspec_request_id, or vLLM's id)
    tokens: array.array[int] | None = None  # lead + output so far (only in a fleet)
    extra_kind: str = "pushed"  # which extra trees the last draft could come from


class AgentSpecProposer:
    """vLLM ``custom_class`` proposer drafting from agentspec stage shards.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (read: ``speculative_config.
            num_speculative_tokens``, ``model_config.max_model_len``,
            ``model_config.get_vocab_size()``, ``additional_config``).

    Not thread-safe: vLLM calls it from the worker's main thread only (RPCs
    such as pushes run between steps in that same thread).
    """

    def __init__(self, vllm_config: Any) -> None:
        """Read the settings and make the worker's shard intake."""
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        if self.num_speculative_tokens < 1:
            raise InvalidArgumentError(
                f"num_speculative_tokens must be >= 1, not {self.num_speculative_tokens}"
            )
        model = vllm_config.model_config
        self.max_model_len = int(model.max_model_len)
        self.vocab_size = int(model.get_vocab_size())
        self.config: AgentSpecVllmConfig = load_config(
            getattr(vllm_config, "additional_config", None)
        )
        # The intake refuses shards holding ids outside the model's vocabulary (422).
        self.intake = worker_intake(self.config, self.vocab_size)
        self.learned_budget = LearnedBudget(self.config.max_learned_bytes)
        self.intake.add_stats("learned", self.learned_stats)
        self._params: dict[int, DraftParams] = {}
        self._tenants: dict[str, Speculator] = {}
        self._active: dict[str, _Active] = {}
        self._stats: dict[ShardKey, KeyStats] = {}
        self._runner: Any = None
        self._warned_unbound = False
        self._bad_tags = 0
        self.closed = False
        # One controller for every tenant: the step cost is the worker's.
        self.goodput = GoodputController(enabled=self.config.goodput)
        self._clock = time.perf_counter
        self._last_call: float | None = None
        self._last_rows: frozenset[str] = frozenset()
        self._last_tokens = 0
        # Metrics (plain counters, read by `metrics_snapshot`).
        self.metrics = self.config.metrics
        self._step_counts = [0] * (len(STEP_SECONDS_BUCKETS) + 1)  # per bucket, +Inf last
        self._step_sum = 0.0
        self.fleet: WorkerFleet | None = None
        if self.config.redis_url is not None:
            self.fleet = self._make_fleet(self.config.redis_url)
        _log.info(
            "agentspec.vllm.proposer",
            num_speculative_tokens=self.num_speculative_tokens,
            max_model_len=self.max_model_len,
            config=self.config.public(),
        )

    def _make_fleet(self, url: str) -> WorkerFleet:
        """The worker's fleet link (redis is imported only when a URL is set)."""
        try:
            from agentspec.fleet import FleetConfig
            from agentspec_vllm.fleet import WorkerFleet
        except ImportError as e:
            raise InvalidArgumentError(
                "agentspec redis_url needs the redis client in vLLM's Python",
                "pip install 'agentspec-suffix[fleet]'",
            ) from e

        cfg = self.config
        return WorkerFleet(
            url,
            FleetConfig(cfg.max_depth, cfg.fleet_max_shard_tokens),
            max_tenants=cfg.fleet_max_tenants,
            publish=cfg.fleet_publish,
        )

    # --- vLLM interface -----------------------------------------------------

    def load_model(self, target_model: Any) -> None:
        """Nothing to load: the drafts come from suffix trees, not from a model."""

    def bind_runner(self, runner: Any) -> None:
        """Use ``runner`` (vLLM's model runner) for request ids and request state."""
        self._runner = runner

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: Any,
        token_ids_cpu: Any,
        slot_mappings: Any = None,
        **_: Any,
    ) -> list[list[int]]:
        """One draft per row of the runner's input batch (see the module docstring)."""
        if self.closed:
            return [[] for _ in sampled_token_ids]
        runner = self._runner if self._runner is not None else self._find_runner()
        if runner is None:
            if not self._warned_unbound:
                self._warned_unbound = True
                _log.error(
                    "agentspec.vllm.unbound",
                    reason="the model runner was not found: proposing no drafts",
                )
            return [[] for _ in sampled_token_ids]
        now = self._clock()
        requests: Mapping[str, Any] = runner.requests
        batch = runner.input_batch
        self.sweep(requests)
        req_ids = batch.req_ids
        num_prompt = batch.num_prompt_tokens
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        wanted: dict[str, list[tuple[int, str, _Active, int]]] = {}  # tenant -> rows to draft
        decoding: list[str] = []  # requests that sampled tokens this step
        prefill = False  # whether the step that just ran computed prompt tokens
        in_batch = 0  # requests in the batch
        for i, sampled in enumerate(sampled_token_ids):
            req_id = req_ids[i]
            state = requests.get(req_id) if req_id is not None else None
            if state is None:
                continue
            in_batch += 1
            act = self._track(req_id, state, int(num_prompt[i]), token_ids_cpu[i])
            # Nothing past the prompt fed yet: the step computed prompt tokens (a
            # new prompt, one of its chunks, or the last chunk, which samples the
            # first token).  Nothing sampled: a prefill chunk or a discarded step.
            if act.fed <= act.prompt_len or not len(sampled):
                prefill = True
            cap = self._feed(req_id, act, sampled, int(num_tokens_no_spec[i]), token_ids_cpu[i])
            if len(sampled):
                decoding.append(req_id)
            if cap > 0:
                wanted.setdefault(act.key[0], []).append((i, req_id, act, cap))
        self._time_step(now, frozenset(decoding), prefill)
        # Draft per tenant, then cut the whole step's drafts at once: the
        # goodput allocation weighs every request of the step (the verification
        # cost is the batch's, whichever tenants it mixes), those that offer no
        # draft included: rows still computing their prompt decode in the steps
        # an accepted token saves.
        parts = [
            (self._tenants[t], rows, self._draft_rows(self._tenants[t], rows))
            for t, rows in wanted.items()
        ]
        cut = Speculator.control_step(
            [
                (spec, [rid for _, rid, _, _ in rows], [d for d, _ in drafts])
                for spec, rows, drafts in parts
            ],
            undrafted=in_batch - sum(len(r) for r in wanted.values()),
        )
        for (_spec, rows, drafts), kept in zip(parts, cut, strict=True):
            for (i, _rid, act, _cap), (_raw, source), draft in zip(rows, drafts, kept, strict=True):
                out[i] = self._record(act, draft, source)
        self._last_tokens = len(decoding) + sum(len(d) for d in out)
        return out

    def _time_step(self, now: float, rows: frozenset[str], prefill: bool) -> None:
        """Feed the step-cost model: the time since the last call was the step that
        verified what that call proposed.  Only when some request decodes on (a
        request of that call is here again): else the engine sat idle in between.
        Nor when that step also computed prompt tokens (``prefill``): their cost
        is not a function of the verified tokens, and a step that prefills a
        few thousand of them would teach the model that a batch step is slow,
        so that a draft token looks cheap next to it."""
        last, prev = self._last_call, self._last_rows
        self._last_call, self._last_rows = now, rows
        if last is None or not prev or rows.isdisjoint(prev):
            return
        if self.metrics:
            seconds = now - last
            self._step_counts[bisect.bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1
            self._step_sum += seconds
        if prefill:
            return
        tokens = max(self._last_tokens, len(prev))
        self.goodput.observe_step(len(prev), tokens, now - last)

    # --- per request ----------------------------------------------------------

    def _track(self, req_id: str, state: Any, prompt_len: int, row: Any) -> _Active:
        """The tracked request of a row, started (or restarted) as needed."""
        act = self._active.get(req_id)
        if act is not None and act.state is state and act.prompt_len == prompt_len:
            return act
        if act is not None:  # the id now names another request, or its prompt changed
            self._finish(req_id, learn=act.state is not state)
        key, session = self._tags(state)
        spec = self._speculator(key[0])
        spec.start_request(req_id, row[:prompt_len], stage=key[2], pipeline=key[1])
        end = self.max_model_len
        max_tokens = getattr(getattr(state, "sampling_params", None), "max_tokens", None)
        if isinstance(max_tokens, int) and max_tokens > 0:
            end = min(end, prompt_len + max_tokens)
        act = self._active[req_id] = _Active(state, key, session, prompt_len, prompt_len, end)
        self._key_stats(key).requests += 1
        if self.fleet is not None:
            self.fleet.subscribe(key[0])
            act.identity = self._identity(state, req_id)
            start = max(0, prompt_len - self.config.lead_tokens)
            act.tokens = array.array("i", row[start:prompt_len])
        return act

    def _feed(self, req_id: str, act: _Active, sampled: Sequence[int], n: int, row: Any) -> int:
        """Feed a row's new tokens; returns how many tokens it may draft (0: none)."""
        stats = self._key_stats(act.key)
        if act.last_draft and len(sampled):
            stats.accepted_tokens += len(sampled) - 1
            if self.metrics:
                lens = stats.accepted_len
                if len(sampled) <= len(lens):
                    lens[len(sampled) - 1] += 1
        spec = self._tenants[act.key[0]]
        if n > act.fed:
            new = row[act.fed : n]
            spec.extend(req_id, new)
            if act.tokens is not None:
                act.tokens.extend(int(t) for t in new)
            act.fed = n
        act.last_draft = 0
        if not len(sampled):  # prefill chunk or discarded step
            return 0
        # A step adds the accepted drafts plus one token, and the request stops at
        # `end`: drafts past it would be verified for nothing.
        return max(0, min(self.num_speculative_tokens, act.end - n - 1))

    def _record(self, act: _Active, draft: Draft, source: str) -> list[int]:
        """A row's drafted ids (cut at the first one outside the vocabulary), counted."""
        stats = self._key_stats(act.key)
        tokens = draft.token_ids
        for j, tok in enumerate(tokens):
            if not 0 <= tok < self.vocab_size:
                tokens = tokens[:j]
                break
        stats.steps += 1
        stats.sources[source] = stats.sources.get(source, 0) + 1
        if source == "extra":
            stats.extra_kinds[act.extra_kind] = stats.extra_kinds.get(act.extra_kind, 0) + 1
        if tokens:
            stats.drafts += 1
            stats.drafted_tokens += len(tokens)
        act.last_draft = len(tokens)
        return tokens

    def _draft_rows(
        self, spec: Speculator, rows: list[tuple[int, str, _Active, int]]
    ) -> list[tuple[Draft, str]]:
        """Draft for one tenant's rows in one native call, each from its request's
        trees plus its stage's pushed shard, with at most its cap tokens (before
        goodput control, which `propose` applies to the whole step)."""
        params = self._params.get(self.num_speculative_tokens)
        if params is None:
            params = self._params[self.num_speculative_tokens] = self.config.draft_params(
                self.num_speculative_tokens, self.vocab_size
            )
        ids = [req_id for _, req_id, _, _ in rows]
        caps = [cap for _, _, _, cap in rows]
        extra: list[tuple[SuffixTree, ...]] = []
        fleet = self.fleet
        for _, _, act, _ in rows:
            pushed = pushed_tree(act.key)
            shared = None if fleet is None else fleet.tree(act.key)
            extra.append(tuple(t for t in (pushed, shared) if t is not None))
            act.extra_kind = (
                "pushed" if shared is None else "fleet" if pushed is None else "pushed_or_fleet"
            )
        try:
            return spec.draft_batch_source(ids, params, caps=caps, extra_trees=extra, control=False)
        except RuntimeError:  # a pushed (or fleet) tree is being modified right now
            return spec.draft_batch_source(ids, params, caps=caps, control=False)

    def _tags(self, state: Any) -> tuple[ShardKey, str | None]:
        """The shard key and session of a request, from its sampling params' extra_args."""
        params = getattr(state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        if not isinstance(extra, Mapping):
            return (DEFAULT_TENANT, None, None), None
        try:
            tenant = _tag(extra, TAG_TENANT)
            key = check_key(
                (
                    DEFAULT_TENANT if tenant is None else tenant,
                    _tag(extra, TAG_PIPELINE),
                    _tag(extra, TAG_STAGE),
                )
            )
            session = _tag(extra, TAG_SESSION)
        except InvalidArgumentError as e:
            self._bad_tags += 1
            _log.warning("agentspec.vllm.bad_tags", error=str(e))
            return (DEFAULT_TENANT, None, None), None
        return key, session

    def _identity(self, state: Any, req_id: str) -> str:
        """The fleet identity of a request: the client's ``agentspec_request_id``, else
        vLLM's request id."""
        params = getattr(state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        value = extra.get(TAG_REQUEST_ID) if isinstance(extra, Mapping) else None
        if isinstance(value, str) and 1 <= len(value) <= MAX_IDENTITY:
            return value
        if value is not None:
            self._bad_tags += 1
            _log.warning("agentspec.vllm.bad_request_id", using="vLLM's request id")
        return req_id

    def _speculator(self, tenant: str) -> Speculator:
        spec = self._tenants.get(tenant)
        if spec is None:
            cfg = self.config
            spec = self._tenants[tenant] = Speculator(
                cfg.max_depth,
                params=cfg.draft_params(self.num_speculative_tokens, self.vocab_size),
                local_tree=cfg.local_tree,
                cold_tokens=cfg.cold_tokens,
                max_shard_tokens=cfg.max_shard_tokens,
                lead_tokens=cfg.lead_tokens,
                live=cfg.live_learning and cfg.learn,
                max_bytes=cfg.max_tenant_learned_bytes,
                budget=self.learned_budget,
                goodput=self.goodput,
            )
        return spec

    def learned_stats(self) -> dict[str, Any]:
        """Memory of the learned shards: budgets, bytes held, evictions per tenant."""
        return {
            "max_bytes": self.learned_budget.max_bytes,
            "max_tenant_bytes": self.config.max_tenant_learned_bytes,
            "max_shard_tokens": self.config.max_shard_tokens,
            "bytes": self.learned_budget.bytes,
            "tenants": {t: self._tenants[t].memory() for t in sorted(self._tenants)},
        }

    def _key_stats(self, key: ShardKey) -> KeyStats:
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = KeyStats()
            stats.accepted_len = [0] * (self.num_speculative_tokens + 1)
        return stats

    def _finish(self, req_id: str, *, learn: bool) -> None:
        act = self._active.pop(req_id)
        spec = self._tenants[act.key[0]]
        learned = learn and self.config.learn and act.fed > act.prompt_len
        spec.finish(req_id, learn=learned)
        if learned:
            self._key_stats(act.key).learned += 1
        fleet = self.fleet
        if fleet is not None and act.tokens is not None and learn and act.fed > act.prompt_len:
            queued = fleet.publish(act.key, act.tokens, act.identity)
            self._key_stats(act.key).published += int(queued)

    def sweep(self, requests: Mapping[str, Any] | None = None) -> int:
        """Finish (and learn) every tracked request no longer in ``requests``.

        ``requests`` defaults to the bound runner's request table.  A request
        that is only paused (preempted, or not scheduled this step) stays in
        that table and is kept.  Returns how many requests were finished.
        """
        if requests is None:
            if self._runner is None:
                return 0
            requests = self._runner.requests
        gone = [rid for rid, act in self._active.items() if requests.get(rid) is not act.state]
        for rid in gone:
            self._finish(rid, learn=True)
        return len(gone)

    def _find_runner(self) -> Any:
        """The model runner among the callers' frames (vLLM < 0.33 has no init hook)."""
        frame: FrameType | None = sys._getframe(2)  # skip _find_runner and propose
        for _ in range(_FRAME_DEPTH):
            if frame is None:
                break
            obj = frame.f_locals.get("self")
            if getattr(obj, "drafter", None) is self and hasattr(obj, "requests"):
                self._runner = obj
                _log.info("agentspec.vllm.runner_bound", how="caller frame")
                return obj
            frame = frame.f_back
        return None

    # --- introspection --------------------------------------------------------

    @property
    def active_requests(self) -> frozenset[str]:
        """Ids of the requests being tracked."""
        return frozenset(self._active)

    def stats(self) -> dict[str, Any]:
        """Counters per shard key, learned shard sizes and the settings (JSON-ready)."""
        keys = []
        for key, st in sorted(self._stats.items(), key=lambda kv: _sort_key(kv[0])):
            entry: dict[str, Any] = {"tenant": key[0], "pipeline": key[1], "stage": key[2]}
            entry.update(st.to_json())
            spec = self._tenants.get(key[0])
            tree = spec.shard(stage=key[2], pipeline=key[1]) if spec is not None else None
            entry["learned_tokens"] = tree.stats().tokens if tree is not None else 0
            keys.append(entry)
        return {
            "bound": self._runner is not None,
            "num_speculative_tokens": self.num_speculative_tokens,
            "max_model_len": self.max_model_len,
            "active_requests": len(self._active),
            "sessions": len({a.session for a in self._active.values() if a.session}),
            "tenants": sorted(self._tenants),
            "bad_tags": self._bad_tags,
            "keys": keys,
            "learned": self.learned_stats(),
            "config": self.config.public(),
            "fleet": None if self.fleet is None else self.fleet.stats(),
            "goodput": self.goodput.stats(),
        }

    def metrics_snapshot(self) -> dict[str, Any]:
        """The counters `agentspec_vllm.metrics` renders (JSON-ready, small).

        ``keys``: per shard key ``[tenant, pipeline, stage, requests, steps,
        drafts, drafted_tokens, accepted_tokens, learned, published, sources,
        accepted_len, learned_tokens, learned_bytes]`` (pipeline and stage ""
        when untagged; ``sources`` with "extra" split into the kinds of
        `KeyStats.extra_kinds`); the step-time histogram; the goodput
        controller's and the learned shards' state.
        """
        keys = []
        for key, st in self._stats.items():
            sources = dict(st.sources)
            extra = sources.pop("extra", 0)
            for kind, n in st.extra_kinds.items():
                sources[kind] = sources.get(kind, 0) + n
                extra -= n
            if extra > 0:  # counted before metrics were on (cannot happen today)
                sources["pushed_or_fleet"] = sources.get("pushed_or_fleet", 0) + extra
            spec = self._tenants.get(key[0])
            tree = spec.shard(stage=key[2], pipeline=key[1]) if spec is not None else None
            tstats = tree.stats() if tree is not None and not tree.closed else None
            keys.append(
                [
                    key[0],
                    key[1] or "",
                    key[2] or "",
                    st.requests,
                    st.steps,
                    st.drafts,
                    st.drafted_tokens,
                    st.accepted_tokens,
                    st.learned,
                    st.published,
                    sources,
                    list(st.accepted_len),
                    0 if tstats is None else tstats.tokens,
                    0 if tstats is None else max(0, tstats.bytes - tstats.free_bytes),
                ]
            )
        memory = [spec.memory() for spec in self._tenants.values()]
        return {
            "keys": keys,
            "step_seconds": {
                "bounds": list(STEP_SECONDS_BUCKETS),
                "counts": list(self._step_counts),
                "sum": self._step_sum,
            },
            "goodput": self.goodput.stats(),
            "learned": {
                "bytes": sum(m["bytes"] for m in memory),
                "max_bytes": self.learned_budget.max_bytes,
                "shards": sum(m["shards"] for m in memory),
                "evictions": sum(m["evicted_sequences"] for m in memory),
            },
            "bad_tags": self._bad_tags,
            "active_requests": len(self._active),
        }

    def close(self) -> None:
        """Free every request and shard (the proposer proposes nothing afterwards)."""
        for spec in self._tenants.values():
            spec.close()
        self._tenants.clear()
        self._active.clear()
        self._runner = None
        self.closed = True
        if self.fleet is not None:
            self.fleet.close()


def _tag(extra: Mapping[str, Any], name: str) -> str | None:
    """One tag value as a string (numbers are accepted and converted), or None."""
    value = extra.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise InvalidArgumentError(f"{name} must be a string, not {type(value).__name__}")
    return value if isinstance(value, str) else str(value)


def _sort_key(key: ShardKey) -> tuple[str, str, str]:
    return (key[0], key[1] or "", key[2] or "")
