"""Request execution for the embedded engine: one sequence at a time, drafts from stage shards.

`Engine` owns a model, its tokenizer, one `Verifier` (a single sequence) and
one `agentspec.Speculator` per tenant holding the engine's learned stage
shards.  `Engine.generate` runs one `GenerationRequest`: it waits for its
turn (requests are served first come, first served), prefills the prompt,
then loops: draft from the request's stage shard (and the shard pushed to
the engine for the same key, if any: `ShardIntake`), verify the draft in one
forward pass, emit the accepted tokens.  Greedy requests (temperature 0)
produce the model's greedy continuation whatever the drafts; sampled ones
use the verifier's lossless speculative sampling rule.  A finished response
is learned into its stage shard, so the next request of that stage drafts
from it.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from agentspec._core.budget import (
    DEFAULT_MAX_LEARNED_BYTES,
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_MAX_TENANT_LEARNED_BYTES,
    DEFAULT_MAX_TENANT_SHARD_BYTES,
    LearnedBudget,
    parse_byte_size,
)
from agentspec._core.draft import Draft, DraftParams
from agentspec._core.goodput import GoodputController
from agentspec._core.speculator import Speculator
from agentspec._core.tree import SuffixTree
from agentspec._push.wire import DEFAULT_MAX_BODY_BYTES
from agentspec._util.log import get_logger
from agentspec.engine._chat import TextDecoder, max_token_bytes
from agentspec.engine._cpu_kernels import CpuKernels, optimize_for_cpu
from agentspec.engine._draft_tree import prune_draft_tree
from agentspec.engine._metrics import EngineMetrics
from agentspec.engine._sampling import SamplingParams
from agentspec.engine._verify import SavedPrefix, Verifier
from agentspec.exceptions import AgentSpecError, GenerationCancelledError, InvalidArgumentError
from agentspec.metrics import metrics_enabled
from agentspec.protocol import DEFAULT_TENANT, ShardKey

__all__ = [
    "Completion",
    "Engine",
    "EngineOptions",
    "GenerationCancelledError",
    "GenerationRequest",
    "SpecStats",
    "TextDelta",
]

_log = get_logger()


#: Default byte budget of the engine's prompt prefix caches (`EngineOptions`).
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30

#: How often (seconds) a request waiting for its turn checks whether it was cancelled.
_WAIT_POLL_S = 0.05


@dataclass(frozen=True)
class EngineOptions:
    """Serving options of an `Engine`.

    Attributes:
        max_model_len: longest prompt + output in tokens (default: the
            model's ``max_position_embeddings``; never more).
        default_max_tokens: output limit of a request that sets none.
        speculate: draft by default (a request can turn it off).
        tree_drafts: draft trees instead of chains.
        goodput: cut drafts to what pays (`agentspec.GoodputController`:
            calibrated acceptance against the verifier's measured step
            time); False: every draft as the draft params give it.
        draft_params: drafting parameters (`DraftParams.confident()`; ``tree`` is
            overridden by ``tree_drafts``).
        max_depth: depth of the shard trees (pushed shards must match).
        max_shard_tokens: per-shard FIFO token budget of the learned shards
            (None: none; the byte budgets below bound them anyway).
        max_learned_bytes: total byte budget of the learned shards of every
            tenant (live bytes; the oldest learned sequences, any tenant,
            are evicted beyond it); None: none.
        max_tenant_learned_bytes: byte budget of one tenant's learned
            shards (its oldest sequences are evicted beyond it); None: none.
        max_shard_bytes: total byte budget of the pushed shards (a push
            beyond it gets 507); None: none.
        max_tenant_shard_bytes: byte budget of one tenant's pushed shards
            (507 beyond it); None: none.
        max_body_bytes: largest shard push body (413 above).
        prefix_cache_bytes: byte budget of the prompt KV caches kept for
            reuse, one per ``(tenant, pipeline, stage)``: a request's prompt
            starts from the KV of the longest prefix it shares with the last
            prompt of its key (the least recently used go beyond the budget);
            0 or None: no prefix cache.  Keyed by tenant, so one tenant's
            prompts never make another's faster.
        metrics: keep Prometheus metrics (`Engine.metrics`, served on the
            server's ``GET /metrics``); default on unless ``AGENTSPEC_METRICS=0``.
        cpu_kernels: before serving, pack a CPU model's linear layers for oneDNN
            and keep grouped attention heads grouped
            (`agentspec.engine.optimize_for_cpu`): a step verifying a few
            draft tokens then costs about a plain step.  In place, on the
            model the engine is given; False leaves the model as it is.

    Byte budgets accept sizes such as ``"512MiB"`` and are kept as ints.
    """

    max_model_len: int | None = None
    default_max_tokens: int = 1024
    speculate: bool = True
    tree_drafts: bool = False
    goodput: bool = True
    draft_params: DraftParams | None = None
    max_depth: int = 64
    max_shard_tokens: int | None = None
    max_learned_bytes: int | None = DEFAULT_MAX_LEARNED_BYTES
    max_tenant_learned_bytes: int | None = DEFAULT_MAX_TENANT_LEARNED_BYTES
    max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES
    max_tenant_shard_bytes: int | None = DEFAULT_MAX_TENANT_SHARD_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    prefix_cache_bytes: int | None = DEFAULT_PREFIX_CACHE_BYTES
    metrics: bool = field(default_factory=metrics_enabled)
    cpu_kernels: bool = True

    def __post_init__(self) -> None:
        """Validate the numbers."""
        for name in (
            "max_learned_bytes",
            "max_tenant_learned_bytes",
            "max_shard_bytes",
            "max_tenant_shard_bytes",
            "prefix_cache_bytes",
        ):
            object.__setattr__(self, name, parse_byte_size(getattr(self, name), name))
        body = parse_byte_size(self.max_body_bytes, "max_body_bytes")
        if body is None or body < 1:
            raise InvalidArgumentError("max_body_bytes must be >= 1", str(self.max_body_bytes))
        object.__setattr__(self, "max_body_bytes", body)
        if self.max_shard_tokens is not None and self.max_shard_tokens < 0:
            raise InvalidArgumentError("max_shard_tokens must be >= 0", str(self.max_shard_tokens))
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidArgumentError("max_model_len must be >= 2", str(self.max_model_len))
        if self.default_max_tokens < 1:
            raise InvalidArgumentError("default_max_tokens must be >= 1")


@dataclass(frozen=True)
class GenerationRequest:
    """One request to run.

    Attributes:
        prompt_ids: the prompt's token ids.
        max_tokens: most tokens to generate (None: the engine's default,
            capped by the room left in the context).
        stop: stop strings; the output ends before the first one.
        temperature: 0 for greedy decoding, else sampling.
        top_p: nucleus sampling mass.
        top_k, min_p, repetition_penalty, frequency_penalty,
            presence_penalty, logit_bias, allowed_token_ids: the other
            sampling parameters (see `SamplingParams`; defaults: off).
        sampling: all of the nine fields above as one `SamplingParams`
            (what the OpenAI layer passes).  When given, those fields are set
            from it (each must be left at its default or equal it).
        seed: the sampling noise of output position k is
            ``position_noise(seed, 0, k, vocab)`` (None: a random seed), so a
            seeded request gives the same tokens with speculation on or off.
        stop_token_ids: more token ids that end the output as EOS does
            (the token is kept in ``token_ids``, its text is not sent).
        ignore_eos: do not stop at the model's EOS tokens.
        key: the stage shard ``(tenant, pipeline, stage)``.
        speculate: draft (None: the engine's default).
        identity: names the request to the fleet: its finished response is
            published under it (see `Engine`'s ``on_learned``); None: not
            published.
    """

    prompt_ids: Sequence[int]
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    key: ShardKey = (DEFAULT_TENANT, None, None)
    speculate: bool | None = None
    identity: str | None = None
    sampling: SamplingParams | None = None

    def __post_init__(self) -> None:
        """With ``sampling``, mirror it into the nine flat fields (unset, or equal to it)."""
        if self.sampling is None:
            return
        for name in _SAMPLING_FIELDS:
            value, given = getattr(self.sampling, name), getattr(self, name)
            if given != _FLAT_DEFAULTS[name] and given != value:
                raise InvalidArgumentError(
                    f"give the sampling parameters as sampling= or as fields, not both ({name})"
                )
            object.__setattr__(self, name, value)

    def sampling_params(self) -> SamplingParams:
        """The request's `SamplingParams`: ``sampling``, else one made of the flat fields.

        Raises:
            InvalidArgumentError: a flat field out of its range.
        """
        if self.sampling is not None:
            return self.sampling
        return SamplingParams(
            self.temperature,
            self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=tuple(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
        )


#: The `GenerationRequest` fields that `SamplingParams` holds, and their flat defaults.
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
_FLAT_DEFAULTS = {
    f.name: f.default for f in fields(GenerationRequest) if f.name in _SAMPLING_FIELDS
}


@dataclass
class SpecStats:
    """Speculation counters of one request.

    Attributes:
        steps: verification forward passes (the prefill not counted).
        drafted: draft tokens verified.
        accepted: draft tokens accepted and kept (each step's bonus token not
            counted, nor tokens after a stop string, EOS or the length limit).
        speculate: whether the request drafted.
        cached_tokens: prompt tokens whose KV came from the prefix cache.
        prefill_s: seconds in the prefill (the prompt's forward pass).
        draft_s: seconds drafting (suffix-tree drafts, goodput control, pruning).
        verify_s: seconds in the verification steps (forward pass, acceptance,
            KV-cache update).
        engine_s: seconds from the request's turn to its end; what the three
            above leave is per-step Python work (detokenizing, stop strings,
            learning, counters).
    """

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    speculate: bool = True
    cached_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    engine_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The ``"agentspec"`` field of a response."""
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "speculate": self.speculate,
            "cached_tokens": self.cached_tokens,
            "seconds": {
                "prefill": round(self.prefill_s, 6),
                "draft": round(self.draft_s, 6),
                "verify": round(self.verify_s, 6),
                "engine": round(self.engine_s, 6),
            },
        }


@dataclass(frozen=True)
class TextDelta:
    """Output that became final during a step: new text and the tokens behind it."""

    text: str
    token_ids: list[int]


@dataclass
class Completion:
    """The end of a request.

    Attributes:
        text: the whole output text (stop string excluded).
        token_ids: every generated token (the eos token included when hit).
        prompt_ids: the prompt's tokens.
        finish_reason: "stop" (eos or a stop string) or "length".
        stats: speculation counters.
    """

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    stats: SpecStats = field(default_factory=SpecStats)


class _FifoLock:
    """A lock granted in request order; a waiter may give up its turn."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0  # next ticket to hand out
        self._serving = 0  # ticket that holds the lock (or may take it)
        self._abandoned: set[int] = set()

    def acquire(self, cancelled: Callable[[], bool] | None = None) -> bool:
        """Wait for this caller's turn; False when ``cancelled()`` became true first."""
        with self._cond:
            ticket = self._next
            self._next += 1
            while self._serving != ticket:
                if cancelled is not None and cancelled():
                    self._abandoned.add(ticket)
                    return False
                self._cond.wait(_WAIT_POLL_S)
            return True

    def release(self) -> None:
        """Pass the lock to the next ticket still waiting."""
        with self._cond:
            self._serving += 1
            while self._serving in self._abandoned:
                self._abandoned.discard(self._serving)
                self._serving += 1
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        """Requests holding or waiting for the lock."""
        with self._cond:
            return self._next - self._serving - len(self._abandoned)


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The end-of-sequence ids of the tokenizer and the model's generation config."""
    ids: set[int] = set()
    for src in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(t) for t in src)
    return frozenset(ids)


class Engine:
    """Runs generation requests on one model, one at a time, with stage-shard drafts.

    Args:
        model: a transformers causal LM (see `Verifier`).
        tokenizer: its Hugging Face tokenizer.
        options: serving options.
        pushed_tree: ``key -> SuffixTree | None``, the shard pushed to this
            engine for a key (e.g. ``ShardIntake.tree``); drafted from
            together with the engine's own shard of that key.
        fleet_tree: ``key -> SuffixTree | None``, the fleet's shard for a
            key (e.g. `EngineFleet.tree`), one more draft tree.  Drafting
            stays lossless: the verifier keeps only what the model produces.
        on_learned: called with ``(key, lead + output tokens, identity)`` after a
            request with an ``identity`` finished and was learned (e.g.
            `EngineFleet.publish`); it must not block.

    Thread-safe: `generate` may be called from many threads; requests run
    one after another in arrival order.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        options: EngineOptions | None = None,
        *,
        pushed_tree: Callable[[ShardKey], SuffixTree | None] | None = None,
        fleet_tree: Callable[[ShardKey], SuffixTree | None] | None = None,
        on_learned: Callable[[ShardKey, list[int], str], object] | None = None,
    ) -> None:
        """Wrap ``model`` in a `Verifier` (see the class docstring)."""
        self.options = options or EngineOptions()
        self.model = model
        self.tokenizer = tokenizer
        #: What `optimize_for_cpu` changed (None: ``cpu_kernels`` off).
        self.cpu_kernels: CpuKernels | None = (
            optimize_for_cpu(model) if self.options.cpu_kernels else None
        )
        if self.cpu_kernels is not None:
            k = self.cpu_kernels
            (_log.warning if k.reason else _log.debug)(
                "agentspec.engine.cpu_kernels",
                packed_linears=k.packed_linears,
                linears=k.linears,
                attention=k.attention,
                reason=k.reason,
            )
        self.verifier = Verifier(model)
        limit = self.verifier.max_positions
        wanted = self.options.max_model_len
        if wanted is None:
            wanted = limit if limit is not None else 4096
        self.max_model_len: int = wanted if limit is None else min(wanted, limit)
        self.eos_ids = _eos_ids(model, tokenizer)
        base = self.options.draft_params or DraftParams.confident()
        vocab = self.verifier.vocab_size
        if base.vocab_size is not None:
            vocab = min(vocab, base.vocab_size)
        # Drafts end at the first token outside the model's vocabulary (a pushed
        # shard of another tokenizer), natively: see DraftParams.vocab_size.
        self.draft_params = dataclasses.replace(
            base, tree=self.options.tree_drafts, vocab_size=vocab
        )
        self.learned_budget = LearnedBudget(self.options.max_learned_bytes)
        self._pushed_tree = pushed_tree
        self._fleet_tree = fleet_tree
        self._on_learned = on_learned
        self._lock = _FifoLock()
        self._speculators: dict[str, Speculator] = {}  # per tenant; used under _lock
        # One controller for every tenant: the step cost is the verifier's.
        self.goodput = GoodputController(enabled=self.options.goodput)
        self._ids = itertools.count(1)
        self._max_prompt_bytes: int | None = None
        # the last prompt's KV per shard key, least recently used first; used under _lock
        self._prefixes: OrderedDict[ShardKey, SavedPrefix] = OrderedDict()
        self._prefix_bytes = 0
        #: This engine's Prometheus metrics, in a registry of its own (None: off).
        self.metrics: EngineMetrics | None = None
        if self.options.metrics:
            self.metrics = EngineMetrics()
            self.metrics.watch_engine(
                self.goodput, lambda: dict(self._speculators), lambda: self.learned_budget.max_bytes
            )

    # --- shards ---------------------------------------------------------------

    def _speculator(self, tenant: str) -> Speculator:
        spec = self._speculators.get(tenant)
        if spec is None:
            spec = self._speculators[tenant] = Speculator(
                self.options.max_depth,
                max_shard_tokens=self.options.max_shard_tokens,
                max_bytes=self.options.max_tenant_learned_bytes,
                budget=self.learned_budget,
                goodput=self.goodput,
            )
        return spec

    def learned_stats(self) -> dict[str, Any]:
        """Memory of the learned shards: budgets, bytes held, evictions per tenant.

        Read without waiting for the running request (counters of a tenant
        whose request is running may be one step behind).
        """
        specs = list(self._speculators.items())
        specs.sort(key=lambda kv: kv[0])
        return {
            "max_bytes": self.learned_budget.max_bytes,
            "max_tenant_bytes": self.options.max_tenant_learned_bytes,
            "max_shard_tokens": self.options.max_shard_tokens,
            "bytes": self.learned_budget.bytes,
            "tenants": {tenant: spec.memory() for tenant, spec in specs},
        }

    def learned_shards(self) -> dict[ShardKey, SuffixTree]:
        """The engine's learned stage shards by ``(tenant, pipeline, stage)`` (read only)."""
        self._lock.acquire()
        try:
            return {
                (tenant, pipeline, stage): tree
                for tenant, spec in self._speculators.items()
                for (pipeline, stage), tree in spec.shards().items()
            }
        finally:
            self._lock.release()

    @property
    def max_prompt_bytes(self) -> int:
        """Most UTF-8 bytes of prompt text that might fit in ``max_model_len`` tokens.

        No token decodes to more than `max_token_bytes` bytes (plus one for a
        leading space a decoder may drop), so a longer text has more tokens
        than the context holds: it is refused without tokenizing it.
        """
        if self._max_prompt_bytes is None:
            self._max_prompt_bytes = self.max_model_len * (max_token_bytes(self.tokenizer) + 1)
        return self._max_prompt_bytes

    @property
    def queue_depth(self) -> int:
        """Requests running or waiting."""
        return self._lock.waiting

    def close(self) -> None:
        """Free the learned shards and the prefix caches."""
        self._lock.acquire()
        try:
            for spec in self._speculators.values():
                spec.close()
            self._speculators.clear()
            self._prefixes.clear()
            self._prefix_bytes = 0
        finally:
            self._lock.release()

    def prefix_cache_stats(self) -> dict[str, Any]:
        """The prompt prefix caches: budget, bytes held, entries (read without waiting)."""
        return {
            "max_bytes": self.options.prefix_cache_bytes,
            "bytes": self._prefix_bytes,
            "entries": len(self._prefixes),
        }

    def _keep_prefix(self, key: ShardKey) -> None:
        """Keep the verifier's prompt KV for ``key``, evicting the least recently used."""
        budget = self.options.prefix_cache_bytes
        if not budget:
            return
        old = self._prefixes.pop(key, None)
        if old is not None:
            self._prefix_bytes -= old.nbytes
        saved = self.verifier.saved_prefix()
        if saved is None or saved.nbytes > budget:
            return
        while self._prefixes and self._prefix_bytes + saved.nbytes > budget:
            _, dropped = self._prefixes.popitem(last=False)
            self._prefix_bytes -= dropped.nbytes
        self._prefixes[key] = saved
        self._prefix_bytes += saved.nbytes

    # --- requests -------------------------------------------------------------

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Refuse a prompt that leaves no room for output.

        Raises:
            InvalidArgumentError: empty, or ``len >= max_model_len``.
        """
        if not prompt_ids:
            raise InvalidArgumentError("the prompt must not be empty")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidArgumentError(
                f"the prompt has {len(prompt_ids)} tokens; this model's maximum context "
                f"length is {self.max_model_len} tokens (prompt and output together)"
            )

    def generate(
        self, request: GenerationRequest, cancelled: Callable[[], bool] | None = None
    ) -> Generator[TextDelta | Completion, None, None]:
        """Run ``request``; yields `TextDelta` items as output is produced, then a `Completion`.

        Nothing runs until the first ``next``; the request then waits for its
        turn.  ``cancelled()`` is polled while waiting and before each step;
        when it turns true the generator raises `GenerationCancelledError`
        (nothing is learned).  Close the generator to abandon the request.

        Raises:
            InvalidArgumentError: a bad prompt or bad sampling parameters.
        """
        self.check_prompt(request.prompt_ids)
        return self._run(request, request.sampling_params(), cancelled or (lambda: False))

    def _run(
        self, req: GenerationRequest, sampling: SamplingParams, cancelled: Callable[[], bool]
    ) -> Generator[TextDelta | Completion, None, None]:
        if not self._lock.acquire(cancelled):
            raise GenerationCancelledError("the client went away while the request was queued")
        try:
            yield from self._locked_run(req, sampling, cancelled)
        finally:
            self._lock.release()

    def _locked_run(
        self, req: GenerationRequest, sampling: SamplingParams, cancelled: Callable[[], bool]
    ) -> Generator[TextDelta | Completion, None, None]:
        prompt = [int(t) for t in req.prompt_ids]
        tenant, pipeline, stage = req.key
        speculate = self.options.speculate if req.speculate is None else req.speculate
        stats = SpecStats(speculate=speculate)
        # One seed per request (a random one when none was given): the noise of
        # output position k is position_noise(seed, 0, k, vocab), whatever the drafts.
        seed = secrets.randbits(63) if req.seed is None else req.seed % 2**63
        stop_ids = (frozenset() if req.ignore_eos else self.eos_ids) | frozenset(req.stop_token_ids)
        room_total = self.max_model_len - len(prompt)
        limit = min(req.max_tokens or self.options.default_max_tokens, room_total)
        spec = self._speculator(tenant)
        rid = next(self._ids)
        verifier = self.verifier
        decoder = TextDecoder(self.tokenizer, req.stop, self.eos_ids | stop_ids)
        out: list[int] = []
        text: list[str] = []
        finish = "length"
        clock = time.perf_counter
        t_start = clock()
        verifier.prefill(prompt, prefix=self._prefixes.get(req.key), logits=False)
        stats.prefill_s = clock() - t_start
        stats.cached_tokens = verifier.reused_tokens
        spec.start_request(rid, prompt, stage=stage, pipeline=pipeline)
        metrics = self.metrics
        # per request, for the metrics: steps by draft tokens accepted, drafts by source
        runs: dict[int, int] = {}
        sources: dict[str, int] = {}
        learn = False
        try:
            while len(out) < limit and finish == "length":
                if cancelled():
                    raise GenerationCancelledError("the client went away during generation")
                remaining = limit - len(out)
                depth = min(remaining - 1, self.max_model_len - len(verifier.tokens))
                tree = None
                t0 = clock()
                if speculate and depth > 0:
                    draft = self._draft(spec, rid, req.key, None if metrics is None else sources)
                    if len(draft):
                        # A shard (a pushed one above all) may hold ids this model has
                        # not: the draft params' vocab_size already ends a draft there
                        # (natively); pruning stays as a cheap guard for the verifier.
                        # The one DraftTree of this step, cut to the room left.
                        vocab = verifier.vocab_size
                        tree = prune_draft_tree(draft, vocab, max_depth=depth)
                        if len(tree) < len(draft) and any(
                            not 0 <= t < vocab for t in draft.token_ids
                        ):
                            _log.debug("agentspec.engine.draft_out_of_vocab", key=req.key)
                    t1 = clock()
                    stats.draft_s += t1 - t0
                    t0 = t1
                emitted = verifier.step(tree, sampling=sampling, seed=seed)
                seconds = clock() - t0
                stats.verify_s += seconds
                spec.observe_step(1, 1 + (0 if tree is None else len(tree)), seconds)
                stats.steps += 1
                stats.drafted += 0 if tree is None else len(tree)
                kept: list[int] = []
                piece: list[str] = []
                for tok in emitted:
                    kept.append(tok)
                    if tok in stop_ids:
                        finish = "stop"
                        break
                    piece.append(decoder.push(tok))
                    if decoder.stopped:
                        finish = "stop"
                        break
                    if len(out) + len(kept) >= limit:
                        break
                # Accepted draft tokens that were kept: a stop string, EOS or the
                # length limit can cut the step's tokens short.
                accepted = min(len(kept), len(emitted) - 1)
                stats.accepted += accepted
                if metrics is not None:
                    metrics.step_seconds.observe((), seconds)
                    metrics.tokens_per_step.observe((stage or "",), len(kept))
                    if accepted:
                        runs[accepted] = runs.get(accepted, 0) + 1
                out.extend(kept)
                spec.extend(rid, kept)
                chunk = "".join(piece)
                if finish != "length" or len(out) >= limit:
                    chunk += decoder.flush()  # the text held back for a possible stop string
                text.append(chunk)
                yield TextDelta(chunk, kept)
            learn = True
        finally:
            spec.finish(rid, learn=learn and bool(out))
            self._keep_prefix(req.key)  # the prompt's KV is whole whatever happened after
        if learn and out and req.identity is not None and self._on_learned is not None:
            # what the shards learned: the prompt's last lead tokens, then the output
            # (the client and the vLLM worker publish the same, so copies collapse)
            lead = prompt[max(0, len(prompt) - spec.lead_tokens) :] if spec.lead_tokens else []
            try:
                self._on_learned(req.key, [*lead, *out], req.identity)
            except Exception as exc:  # publishing must never fail a request
                _log.warning("agentspec.engine.on_learned_failed", error=repr(exc)[:300])
        stats.engine_s = clock() - t_start
        if metrics is not None:
            metrics.record_request(
                req.key, stats.steps, stats.drafted, stats.accepted, runs, sources
            )
        yield Completion("".join(text), out, prompt, finish, stats)

    def _draft(
        self, spec: Speculator, rid: int, key: ShardKey, sources: dict[str, int] | None = None
    ) -> Draft:
        """The request's draft from its own shards, the shard pushed and the fleet's for ``key``.

        ``sources``: count the draft there by the tree it came from (an empty draft
        as "none")."""
        extra: list[SuffixTree] = []
        names: list[str] = []
        for name, source in (("pushed", self._pushed_tree), ("fleet", self._fleet_tree)):
            tree = source(key) if source is not None else None
            if tree is not None:
                extra.append(tree)
                names.append(name)
        while True:
            try:
                if sources is None:
                    return spec.draft(rid, self.draft_params, extra_trees=tuple(extra))
                draft, name = spec.draft_source(
                    rid, self.draft_params, extra_trees=tuple(extra), extra_names=names
                )
                name = name if len(draft) else "none"
                sources[name] = sources.get(name, 0) + 1
                return draft
            except (RuntimeError, AgentSpecError) as exc:
                if not extra:
                    raise
                # A delta is being applied to the pushed tree (or it was just replaced
                # and closed), or a fleet tree has another depth: drop the last extra
                # tree and draft from the others this step.
                _log.debug("agentspec.engine.extra_tree_busy", key=key, error=str(exc))
                extra.pop()
                names.pop()
