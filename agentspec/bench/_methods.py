"""The drafting methods a bench replay compares, behind one `Method` interface.

`METHODS` names every method; `make_method` builds one from a `ReplayConfig`;
`method_status` says which can run here (arctic-inference is optional).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentspec.bench._trace import Request, Tokens
from agentspec.bench.ngram import NgramProposer
from agentspec.bench.oracle import Oracle
from agentspec.bench.pointer import CopyPointer

__all__ = [
    "METHODS",
    "ORACLE",
    "ArcticMethod",
    "CopyPointerMethod",
    "Method",
    "NgramMethod",
    "OracleMethod",
    "ReplayConfig",
    "SpeculatorMethod",
    "make_method",
    "method_status",
]

#: Every method, in report order, with a one-line description.
METHODS: dict[str, str] = {
    "confidence": "stage-shards with the confidence policy (DraftParams.confident, the default)",
    "stage-shards": "Speculator: a shard per (pipeline, stage), pipeline tree, per-request tree",
    "one-tree": "Speculator(stage_shards=False): one tree per pipeline for all stages",
    "stage-only": "Speculator(pipeline_tree=False): one tree per stage, no pipeline tree",
    "global-only": "stage-shards without the per-request tree (use_local=False)",
    "local-only": "stage-shards drafting from the per-request tree only (use_global=False)",
    "tree-drafts": "stage-shards with best-first tree drafts (tree=True)",
    "copy-pointer": "confidence, with each draft's tokens taken from the copy the request follows",
    "ngram-5-5": "vLLM n-gram prompt lookup, n in [5, 5], k = max spec tokens",
    "ngram-3-5": "vLLM n-gram prompt lookup, n in [3, 5], k = max spec tokens",
    "arctic": "arctic-inference 0.3.0 SuffixDecodingCache (one global tree)",
    "arctic-per-stage": "one arctic-inference SuffixDecodingCache per stage",
    "oracle": "longest prefix of the truth seen before (prompt, output, earlier responses)",
}
ORACLE = "oracle"
_SPECULATOR_METHODS = (
    "confidence",
    "stage-shards",
    "one-tree",
    "stage-only",
    "global-only",
    "local-only",
    "tree-drafts",
    "copy-pointer",
)
_ARCTIC_METHODS = ("arctic", "arctic-per-stage")


@dataclass(frozen=True)
class ReplayConfig:
    """Parameters shared by every method."""

    depth: int = 64
    max_spec_tokens: int = 32
    alpha: float = 1.0
    min_prob: float = 0.1
    conf_min_prob: float = 0.25  # the confidence method's cut (it has no alpha budget)

    def __post_init__(self) -> None:
        """Check the ranges."""
        if not 2 <= self.depth <= 1024:
            raise ValueError(f"depth must be in [2, 1024], got {self.depth}")
        if not 1 <= self.max_spec_tokens <= 1024:
            raise ValueError(f"max spec tokens must be in [1, 1024], got {self.max_spec_tokens}")
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"alpha must be finite and >= 0, got {self.alpha}")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"min prob must be in [0, 1], got {self.min_prob}")
        if not 0.0 <= self.conf_min_prob <= 1.0:
            raise ValueError(f"conf min prob must be in [0, 1], got {self.conf_min_prob}")


class Method(ABC):
    """One drafting method under replay; one request is active at a time.

    ``start``/``draft``/``extend``/``finish`` return the nanoseconds spent in
    the method's own call (the replay loop's bookkeeping is not timed).
    """

    name: str = ""
    #: True when `draft` returns tree drafts (``parents`` not None).
    tree_drafts: bool = False

    def warmup(self, responses: Sequence[Request]) -> None:  # noqa: B027 (optional hook)
        """Learn finished responses offline before the replay (default: nothing)."""

    @abstractmethod
    def start(self, rid: int, req: Request, prompt: Tokens) -> int:
        """Begin request ``rid`` with its prompt."""

    @abstractmethod
    def draft(self, pos: int) -> tuple[Sequence[int], Sequence[int] | None, int]:
        """Draft after ``pos`` response tokens: ``(tokens, parents or None, ns)``."""

    @abstractmethod
    def extend(self, tokens: list[int]) -> int:
        """Append the tokens of one verification step to the context."""

    @abstractmethod
    def finish(self) -> int:
        """End the active request (the method learns its response)."""

    def tree_bytes(self) -> int | None:
        """Allocator bytes of the trees kept across requests (None: not measured)."""
        return None

    def stage_bytes(self) -> dict[str, int]:
        """Allocator bytes per stage where the method keeps one structure per stage."""
        return {}

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Free everything."""


class SpeculatorMethod(Method):
    """`agentspec.Speculator` with stage shards or one tree, and chosen params."""

    def __init__(
        self,
        name: str,
        cfg: ReplayConfig,
        *,
        stage_shards: bool = True,
        pipeline_tree: bool = True,
        local_tree: bool = True,
        **overrides: Any,
    ) -> None:
        """Build the speculator for method ``name``."""
        from agentspec import DraftParams, Speculator

        self.name = name
        self.tree_drafts = bool(overrides.get("tree", False))
        fields: dict[str, Any] = {
            "max_spec_tokens": cfg.max_spec_tokens,
            "alpha": cfg.alpha,
            "min_token_prob": cfg.min_prob,
        }
        fields.update(overrides)
        params = DraftParams(**fields)
        self._spec = Speculator(
            cfg.depth,
            params=params,
            stage_shards=stage_shards,
            pipeline_tree=pipeline_tree,
            local_tree=local_tree,
        )
        self._draft = self._spec.draft
        self._extend = self._spec.extend
        self._rid = 0
        self._keys: set[tuple[str, str]] = set()

    def warmup(self, responses: Sequence[Request]) -> None:
        """Learn each response into its shards (`Speculator.add_response`)."""
        for r in responses:
            self._spec.add_response(
                r.response, stage=r.stage, pipeline=r.workload, prompt=r.prompt()
            )
            self._keys.add((r.workload, r.stage))

    def start(self, rid: int, req: Request, prompt: Tokens) -> int:
        """`Speculator.start_request` tagged with the stage and the workload as pipeline."""
        self._rid = rid
        self._keys.add((req.workload, req.stage))
        t0 = time.perf_counter_ns()
        self._spec.start_request(rid, prompt, stage=req.stage, pipeline=req.workload)
        return time.perf_counter_ns() - t0

    def draft(self, pos: int) -> tuple[Sequence[int], Sequence[int] | None, int]:
        """`Speculator.draft` with the method's params."""
        t0 = time.perf_counter_ns()
        d = self._draft(self._rid)
        ns = time.perf_counter_ns() - t0
        return d.token_ids, (d.parents if self.tree_drafts else None), ns

    def extend(self, tokens: list[int]) -> int:
        """`Speculator.extend`."""
        t0 = time.perf_counter_ns()
        self._extend(self._rid, tokens)
        return time.perf_counter_ns() - t0

    def finish(self) -> int:
        """`Speculator.finish` with learning."""
        t0 = time.perf_counter_ns()
        self._spec.finish(self._rid, learn=True)
        return time.perf_counter_ns() - t0

    def tree_bytes(self) -> int:
        """Stage shards plus pipeline trees."""
        total = sum(t.stats().bytes for t in self._spec.shards().values())
        for pipeline in {w for w, _ in self._keys}:
            tree = self._spec.pipeline_tree(pipeline)
            if tree is not None:
                total += tree.stats().bytes
        return total

    def stage_bytes(self) -> dict[str, int]:
        """Bytes of each stage shard (empty without stage shards)."""
        out: dict[str, int] = {}
        for workload, stage in sorted(self._keys):
            tree = self._spec.shard(stage=stage, pipeline=workload)
            if tree is not None:
                out[stage] = out.get(stage, 0) + tree.stats().bytes
        return out

    def close(self) -> None:
        """Close the speculator."""
        self._spec.close()


class CopyPointerMethod(SpeculatorMethod):
    """The confidence policy, its draft's tokens replaced by a `CopyPointer`'s.

    The speculator decides how many tokens to draft; once the request has
    followed one earlier copy for ``min_streak`` tokens, the draft holds what
    followed that copy instead (same length), so the two differ only in which
    continuation they pick.
    """

    def __init__(self, name: str, cfg: ReplayConfig, *, min_streak: int = 4) -> None:
        """Build the confidence speculator and an empty pointer index."""
        from agentspec._core.draft import CONFIDENT_ALPHA, DEFAULT_CONF

        super().__init__(
            name, cfg, alpha=CONFIDENT_ALPHA, min_token_prob=cfg.conf_min_prob, conf=DEFAULT_CONF
        )
        self.min_streak = min_streak
        self._ptr = CopyPointer()

    def warmup(self, responses: Sequence[Request]) -> None:
        """Learn each response into the shards and the pointer's index."""
        super().warmup(responses)
        for r in responses:
            self._ptr.begin(r.response.tolist())

    def start(self, rid: int, req: Request, prompt: Tokens) -> int:
        """Start the request in both."""
        ns = super().start(rid, req, prompt)
        t0 = time.perf_counter_ns()
        self._ptr.begin(prompt.tolist())
        return ns + time.perf_counter_ns() - t0

    def draft(self, pos: int) -> tuple[Sequence[int], Sequence[int] | None, int]:
        """The speculator's draft length, the copy's tokens when one is followed."""
        toks, parents, ns = super().draft(pos)
        if not len(toks) or self._ptr.streak < self.min_streak:
            return toks, parents, ns
        t0 = time.perf_counter_ns()
        copy = self._ptr.propose(len(toks))
        ns += time.perf_counter_ns() - t0
        return (copy, None, ns) if len(copy) == len(toks) else (toks, parents, ns)

    def extend(self, tokens: list[int]) -> int:
        """Extend both."""
        ns = super().extend(tokens)
        t0 = time.perf_counter_ns()
        self._ptr.observe(tokens)
        return ns + time.perf_counter_ns() - t0


class NgramMethod(Method):
    """vLLM's n-gram prompt lookup (`agentspec.bench.ngram.NgramProposer`)."""

    def __init__(self, name: str, min_n: int, max_n: int, cfg: ReplayConfig) -> None:
        """An n-gram proposer for n in [min_n, max_n] drafting max_spec_tokens tokens."""
        self.name = name
        self._prop = NgramProposer(min_n, max_n, cfg.max_spec_tokens)

    def start(self, rid: int, req: Request, prompt: Tokens) -> int:
        """Index the prompt (only its new tokens when it extends the previous context)."""
        t0 = time.perf_counter_ns()
        ids = prompt.tolist()
        ctx = self._prop.context
        if len(ids) >= len(ctx) > 0 and ids[: len(ctx)] == ctx:
            self._prop.extend(ids[len(ctx) :])
        else:
            self._prop.reset(ids)
        return time.perf_counter_ns() - t0

    def draft(self, pos: int) -> tuple[Sequence[int], Sequence[int] | None, int]:
        """The n-gram proposal."""
        t0 = time.perf_counter_ns()
        toks = self._prop.propose()
        return toks, None, time.perf_counter_ns() - t0

    def extend(self, tokens: list[int]) -> int:
        """Index the new tokens."""
        t0 = time.perf_counter_ns()
        self._prop.extend(tokens)
        return time.perf_counter_ns() - t0

    def finish(self) -> int:
        """Nothing is learned across requests."""
        return 0


class ArcticMethod(Method):
    """arctic-inference's SuffixDecodingCache, one global cache or one per stage."""

    def __init__(self, name: str, cfg: ReplayConfig, *, per_stage: bool) -> None:
        """Prepare the caches (created on first use)."""
        from arctic_inference.suffix_decoding import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
            SuffixDecodingCache,
        )

        self.name = name
        self._cls = SuffixDecodingCache
        self._cfg = cfg
        self._per_stage = per_stage
        self._caches: dict[tuple[str, str] | None, Any] = {}
        self._cache: Any = None
        self._rid = 0
        self._full: Tokens = np.zeros(0, dtype=np.int32)
        self._np = 0
        self._warm = 0

    def _get(self, req: Request) -> Any:
        key = (req.workload, req.stage) if self._per_stage else None
        cache = self._caches.get(key)
        if cache is None:
            cache = self._caches[key] = self._cls(max_tree_depth=self._cfg.depth)
        return cache

    def warmup(self, responses: Sequence[Request]) -> None:
        """Cache each response as a finished request with an empty prompt."""
        empty = np.zeros(0, dtype=np.int32)
        for r in responses:
            cache = self._get(r)
            rid = ("warmup", self._warm)
            self._warm += 1
            cache.start_request(rid, empty)
            cache.add_active_response(rid, r.response)
            cache.stop_request(rid)

    def start(self, rid: int, req: Request, prompt: Tokens) -> int:
        """``start_request``."""
        self._cache = self._get(req)
        self._rid = rid
        self._np = len(prompt)
        self._full = np.concatenate((prompt, req.response))
        t0 = time.perf_counter_ns()
        self._cache.start_request(rid, prompt)
        return time.perf_counter_ns() - t0

    def draft(self, pos: int) -> tuple[Sequence[int], Sequence[int] | None, int]:
        """``speculate`` on the last ``depth`` context tokens (an int32 numpy slice)."""
        end = self._np + pos
        depth = self._cfg.depth
        tail = self._full[end - depth if end > depth else 0 : end]
        c = self._cfg
        t0 = time.perf_counter_ns()
        d = self._cache.speculate(
            self._rid,
            tail,
            max_spec_tokens=c.max_spec_tokens,
            max_spec_factor=c.alpha,
            max_spec_offset=0.0,
            min_token_prob=c.min_prob,
        )
        ns = time.perf_counter_ns() - t0
        return d.token_ids, None, ns

    def extend(self, tokens: list[int]) -> int:
        """``add_active_response``."""
        t0 = time.perf_counter_ns()
        self._cache.add_active_response(self._rid, tokens)
        return time.perf_counter_ns() - t0

    def finish(self) -> int:
        """``stop_request`` (the response stays cached)."""
        t0 = time.perf_counter_ns()
        self._cache.stop_request(self._rid)
        return time.perf_counter_ns() - t0

    @staticmethod
    def _bytes(cache: Any) -> int | None:
        tree = getattr(cache, "_global_tree", None)
        est = getattr(tree, "estimate_memory", None)
        return int(est()) if est is not None else None

    def tree_bytes(self) -> int | None:
        """Sum of arctic's own ``estimate_memory()`` of the global trees."""
        sizes = [self._bytes(c) for c in self._caches.values()]
        return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)

    def stage_bytes(self) -> dict[str, int]:
        """Per stage (per-stage caches only)."""
        out: dict[str, int] = {}
        if self._per_stage:
            for key, cache in self._caches.items():
                n = self._bytes(cache)
                if key is not None and n is not None:
                    out[key[1]] = out.get(key[1], 0) + n
        return out


class OracleMethod(Method):
    """The copy-drafting ceiling (`agentspec.bench.oracle.Oracle`)."""

    def __init__(self, cfg: ReplayConfig) -> None:
        """An empty oracle drafting at most max_spec_tokens tokens."""
        self.name = ORACLE
        self._oracle = Oracle(cfg.max_spec_tokens)

    def warmup(self, responses: Sequence[Request]) -> None:
        """Warm-up responses count as seen data."""
        for r in responses:
            self._oracle.add_response(r.response)

    def start(self, rid: int, req: Request, prompt: Tokens) -> int:
        """Index the prompt; the truth is the response."""
        t0 = time.perf_counter_ns()
        self._oracle.start(prompt, req.response.tolist())
        return time.perf_counter_ns() - t0

    def draft(self, pos: int) -> tuple[Sequence[int], Sequence[int] | None, int]:
        """The longest seen prefix of the truth."""
        t0 = time.perf_counter_ns()
        toks = self._oracle.draft(pos)
        return toks, None, time.perf_counter_ns() - t0

    def extend(self, tokens: list[int]) -> int:
        """Index the output."""
        t0 = time.perf_counter_ns()
        self._oracle.extend(tokens)
        return time.perf_counter_ns() - t0

    def finish(self) -> int:
        """Learn the response."""
        t0 = time.perf_counter_ns()
        self._oracle.finish()
        return time.perf_counter_ns() - t0

    def tree_bytes(self) -> int:
        """Both oracle indexes."""
        return self._oracle.tree_bytes()

    def close(self) -> None:
        """Free the indexes."""
        self._oracle.close()


def method_status() -> dict[str, str | None]:
    """Map every method to None when it can run here, else to why it is skipped."""
    out: dict[str, str | None] = dict.fromkeys(METHODS)
    try:
        from agentspec import Speculator  # noqa: F401
    except ImportError as e:
        for m in _SPECULATOR_METHODS:
            out[m] = f"agentspec.Speculator is not importable ({e})"
    try:
        import arctic_inference.suffix_decoding  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: F401
    except ImportError as e:
        for m in _ARCTIC_METHODS:
            out[m] = f"arctic_inference.suffix_decoding is not importable ({e})"
    return out


def make_method(name: str, cfg: ReplayConfig) -> Method:
    """Create the method called ``name`` (one of `METHODS`)."""
    if name == "confidence":
        from agentspec._core.draft import CONFIDENT_ALPHA, DEFAULT_CONF

        return SpeculatorMethod(
            name, cfg, alpha=CONFIDENT_ALPHA, min_token_prob=cfg.conf_min_prob, conf=DEFAULT_CONF
        )
    if name == "copy-pointer":
        return CopyPointerMethod(name, cfg)
    if name == "stage-shards":
        return SpeculatorMethod(name, cfg)
    if name == "one-tree":
        return SpeculatorMethod(name, cfg, stage_shards=False)
    if name == "stage-only":
        return SpeculatorMethod(name, cfg, pipeline_tree=False)
    if name == "global-only":
        return SpeculatorMethod(name, cfg, local_tree=False, use_local=False)
    if name == "local-only":
        return SpeculatorMethod(name, cfg, use_global=False)
    if name == "tree-drafts":
        return SpeculatorMethod(name, cfg, tree=True)
    if name == "ngram-5-5":
        return NgramMethod(name, 5, 5, cfg)
    if name == "ngram-3-5":
        return NgramMethod(name, 3, 5, cfg)
    if name == "arctic":
        return ArcticMethod(name, cfg, per_stage=False)
    if name == "arctic-per-stage":
        return ArcticMethod(name, cfg, per_stage=True)
    if name == ORACLE:
        return OracleMethod(cfg)
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
