"""`agentspec bench replay`: replay traces through a simulated greedy verifier.

Every request of a trace file is replayed in file order, for each drafting
method in turn (each method starts empty, or from ``--warmup-from`` data):

1. ``start``: the method ingests the request's prompt (Qwen3 ChatML:
   ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per earlier message, then
   ``<|im_start|>assistant\\n``);
2. per step: ``draft``; the verifier accepts the longest draft prefix (tree
   drafts: the longest root-to-node path) equal to the true continuation and
   adds one bonus token; ``extend`` by those tokens; until the response (its
   content tokens, no special tokens) is complete;
3. ``finish``: the method learns the response (online learning).

Reported per file, per stage and per "responses already in the request's stage
shard" bucket: requests, tokens, steps, MAT (accepted + bonus per step),
acceptance rate (accepted / drafted), drafted tokens per step, drafting µs per
call (p50/p99), update µs per token, memory, and each method's MAT as a
fraction of the oracle's (the ceiling for copy-based drafting, see
`agentspec.bench.oracle`).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import platform
import sys
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from agentspec.bench.ngram import NgramProposer
from agentspec.bench.oracle import Oracle
from agentspec.bench.verifier import accept_linear, accept_tree, advance
from agentspec.traces import read_traces

__all__ = [
    "METHODS",
    "ReplayConfig",
    "Request",
    "TraceData",
    "add_arguments",
    "load_tokenizer",
    "load_trace",
    "render_tables",
    "run",
    "run_cli",
]

Tokens = npt.NDArray[np.int32]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER = REPO_ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3" / "tokenizer.json"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

#: Every method, in report order, with a one-line description.
METHODS: dict[str, str] = {
    "confidence": "stage-shards with the confidence policy (DraftParams.confident, the default)",
    "stage-shards": "Speculator: a shard per (pipeline, stage), pipeline tree, per-request tree",
    "one-tree": "Speculator(stage_shards=False): one tree per pipeline for all stages",
    "stage-only": "Speculator(pipeline_tree=False): one tree per stage, no pipeline tree",
    "global-only": "stage-shards without the per-request tree (use_local=False)",
    "local-only": "stage-shards drafting from the per-request tree only (use_global=False)",
    "tree-drafts": "stage-shards with best-first tree drafts (tree=True)",
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


# --------------------------------------------------------------------------
# traces


@dataclass(frozen=True)
class Request:
    """One tokenized request: the prompt is built on demand from its session's tokens."""

    index: int
    session: int
    workload: str
    stage: str
    context: Tokens  # the session's rendered messages, concatenated (shared)
    prompt_len: int  # tokens of ``context`` before the generation prompt
    generation_prompt: Tokens
    response: Tokens

    @property
    def prompt_tokens(self) -> int:
        """Length of the rendered prompt."""
        return self.prompt_len + len(self.generation_prompt)

    def prompt(self) -> Tokens:
        """The prompt ids: earlier messages as ChatML, then the generation prompt."""
        return np.concatenate((self.context[: self.prompt_len], self.generation_prompt))


@dataclass(frozen=True)
class TraceData:
    """A tokenized trace file."""

    path: Path
    name: str
    workload: str
    sessions: int
    requests: tuple[Request, ...]
    tokenize_s: float

    def counts(self) -> dict[str, int]:
        """Sessions, requests, prompt tokens and response tokens."""
        return {
            "sessions": self.sessions,
            "requests": len(self.requests),
            "prompt_tokens": sum(r.prompt_tokens for r in self.requests),
            "response_tokens": sum(len(r.response) for r in self.requests),
        }

    def stages(self) -> list[str]:
        """Stage names in order of first appearance."""
        return list(dict.fromkeys(r.stage for r in self.requests))


def load_tokenizer(path: Path | str | None = None, *, chatml: bool = True) -> Any:
    """Load a HF ``tokenizer.json`` (default: Qwen3 under ../shared beside the repo).

    With ``chatml`` the tokenizer must know ``<|im_start|>`` and ``<|im_end|>``.

    Raises:
        FileNotFoundError: no such file.
        RuntimeError: the ``tokenizers`` package is missing.
        ValueError: the tokenizer has no ChatML special tokens.
    """
    p = Path(path) if path is not None else DEFAULT_TOKENIZER
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {p} (pass --tokenizer PATH)")
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise RuntimeError(
            "agentspec bench needs the 'tokenizers' package: pip install 'agentspec[bench]'"
        ) from e
    tok = Tokenizer.from_file(str(p))
    if chatml and (tok.token_to_id(IM_START) is None or tok.token_to_id(IM_END) is None):
        raise ValueError(f"{p}: tokenizer has no {IM_START}/{IM_END} tokens (ChatML is required)")
    return tok


def load_trace(path: Path | str, tokenizer: Any, max_sessions: int | None = None) -> TraceData:
    """Read and tokenize a trace file (its first ``max_sessions`` sessions).

    Each message is rendered and tokenized once; a request's prompt is a slice
    of its session's concatenated message ids plus the generation prompt
    (special tokens are split out by the tokenizer, so this equals tokenizing
    the whole rendered prompt).
    """
    from agentspec.chat import CHATML_GENERATION_PROMPT, chatml_message

    p = Path(path)
    t0 = time.perf_counter()
    records = list(read_traces(p, max_sessions=max_sessions))
    if not records:
        raise ValueError(f"{p}: no records")
    texts: list[str] = []
    for rec in records:
        for m in rec.messages:
            texts.append(chatml_message(m.role, m.content))
            if m.role == "assistant":
                texts.append(m.content)
    encs = tokenizer.encode_batch(texts, add_special_tokens=False)
    gen = np.asarray(
        tokenizer.encode(CHATML_GENERATION_PROMPT, add_special_tokens=False).ids, dtype=np.int32
    )
    requests: list[Request] = []
    k = 0
    for s, rec in enumerate(records):
        parts: list[Tokens] = []
        pending: list[tuple[int, str, Tokens]] = []  # (prompt_len, stage, response)
        running = 0
        for m in rec.messages:
            ids = np.asarray(encs[k].ids, dtype=np.int32)
            k += 1
            if m.role == "assistant":
                resp = np.asarray(encs[k].ids, dtype=np.int32)
                k += 1
                stage = m.stage if m.stage is not None else rec.stage
                if len(resp):
                    pending.append((running, stage, resp))
            parts.append(ids)
            running += len(ids)
        context = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        for plen, stage, resp in pending:
            requests.append(
                Request(len(requests), s, rec.workload, stage, context, plen, gen, resp)
            )
    workloads = list(dict.fromkeys(r.workload for r in records))
    name = p.name.removesuffix(".gz").removesuffix(".jsonl")
    return TraceData(
        p,
        name,
        workloads[0] if len(workloads) == 1 else ",".join(workloads),
        len(records),
        tuple(requests),
        time.perf_counter() - t0,
    )


# --------------------------------------------------------------------------
# methods


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


# --------------------------------------------------------------------------
# replay


@dataclass
class _Acc:
    """Counters of one method over a set of requests."""

    requests: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0
    steps: int = 0
    accepted: int = 0
    drafted: int = 0
    nonempty: int = 0
    start_ns: int = 0
    update_ns: int = 0
    finish_ns: int = 0
    draft_ns: list[int] = field(default_factory=list)


def shard_bin(n: int) -> tuple[int, int]:
    """The bucket ``[lo, hi]`` of a shard size: 0, 1, 2-3, 4-7, 8-15, ..."""
    if n < 0:
        raise ValueError(f"shard size must be >= 0, got {n}")
    if n == 0:
        return 0, 0
    lo = 1 << (n.bit_length() - 1)
    return lo, 2 * lo - 1


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def release_free_memory() -> None:
    """Collect garbage and return freed heap pages to the OS (glibc ``malloc_trim``).

    Run before each method so that its RSS growth is not hidden by memory an
    earlier method freed (no-op where glibc is not available).
    """
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int | None:
    """Resident set size of this process (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class Progress:
    """A one-line ``\\r`` progress display on a terminal; one final line otherwise."""

    def __init__(self, stream: TextIO | None, label: str, total: int) -> None:
        """Show progress of ``total`` items under ``label`` on ``stream`` (None: silent)."""
        self._stream = stream
        self._tty = bool(stream is not None and stream.isatty())
        self._label = label
        self._total = max(total, 1)
        self._t0 = time.perf_counter()
        self._last = 0.0
        self._width = 0

    def update(self, done: int) -> None:
        """Redraw (at most 5 times a second)."""
        if not self._tty or self._stream is None:
            return
        now = time.perf_counter()
        if now - self._last < 0.2 and done < self._total:
            return
        self._last = now
        frac = done / self._total
        bar = "#" * int(frac * 20)
        self._write(
            f"\r{self._label} [{bar:<20}] {done}/{self._total} requests  {now - self._t0:.0f} s"
        )

    def _write(self, text: str) -> None:
        assert self._stream is not None
        pad = max(self._width - len(text), 0)
        self._stream.write(text + " " * pad)
        self._stream.flush()
        self._width = len(text)

    def close(self, tail: str) -> None:
        """Print the final line."""
        if self._stream is None:
            return
        line = f"{self._label}: {tail}"
        if self._tty:
            self._write("\r" + line)
            self._stream.write("\n")
        else:
            self._stream.write(line + "\n")
        self._stream.flush()


@dataclass
class _Run:
    """Raw results of one method over one file."""

    stages: dict[str, _Acc]
    bins: dict[tuple[int, int], list[int]]  # (lo, hi) -> [requests, tokens, steps, acc, drafted]
    wall_s: float
    warmup_s: float
    peak_tree_bytes: int | None
    rss_start: int | None
    rss_peak: int | None
    stage_bytes: dict[str, int]


def replay(
    method: Method,
    trace: TraceData,
    warmup: Sequence[Request] = (),
    progress: Progress | None = None,
) -> _Run:
    """Replay every request of ``trace`` through ``method`` (garbage collector paused)."""
    release_free_memory()
    gc.disable()
    try:
        return _replay(method, trace, warmup, progress)
    finally:
        gc.enable()


def _replay(
    method: Method,
    trace: TraceData,
    warmup: Sequence[Request],
    progress: Progress | None,
) -> _Run:
    t_warm = time.perf_counter()
    if warmup:
        method.warmup(warmup)
    warmup_s = time.perf_counter() - t_warm
    shard_n: Counter[tuple[str, str]] = Counter((r.workload, r.stage) for r in warmup)
    stages: dict[str, _Acc] = {}
    bins: dict[tuple[int, int], list[int]] = {}
    rss0 = rss_peak = rss_bytes()
    peak_bytes = method.tree_bytes()
    draft, extend = method.draft, method.extend
    # tree sizes are sampled about 100 times (arctic's estimate walks its whole tree)
    total = len(trace.requests)
    sample_every = max(total // 100, 1)
    t_wall = time.perf_counter()
    for i, req in enumerate(trace.requests):
        acc = stages.get(req.stage)
        if acc is None:
            acc = stages[req.stage] = _Acc()
        prompt = req.prompt()
        resp = req.response.tolist()
        n = len(resp)
        acc.start_ns += method.start(i, req, prompt)
        if rss0 is not None:
            r = rss_bytes()
            if r is not None and rss_peak is not None and r > rss_peak:
                rss_peak = r
        dl = acc.draft_ns
        pos = steps = accepted = drafted = nonempty = upd = 0
        while pos < n:
            toks, parents, ns = draft(pos)
            dl.append(ns)
            if parents is None:
                a = accept_linear(toks, resp, pos)
            else:
                a = accept_tree(toks, parents, resp, pos)
            nd = len(toks)
            drafted += nd
            if nd:
                nonempty += 1
            step = advance(a, n - pos)
            upd += extend(resp[pos : pos + step])
            pos += step
            steps += 1
            accepted += a
        acc.finish_ns += method.finish()
        acc.update_ns += upd
        acc.requests += 1
        acc.prompt_tokens += len(prompt)
        acc.response_tokens += n
        acc.steps += steps
        acc.accepted += accepted
        acc.drafted += drafted
        acc.nonempty += nonempty
        key = (req.workload, req.stage)
        b = bins.setdefault(shard_bin(shard_n[key]), [0, 0, 0, 0, 0])
        b[0] += 1
        b[1] += n
        b[2] += steps
        b[3] += accepted
        b[4] += drafted
        shard_n[key] += 1
        if (i + 1) % sample_every == 0 or i + 1 == total:
            tb = method.tree_bytes()
            if tb is not None and (peak_bytes is None or tb > peak_bytes):
                peak_bytes = tb
        if rss0 is not None:
            r = rss_bytes()
            if r is not None and rss_peak is not None and r > rss_peak:
                rss_peak = r
        if progress is not None:
            progress.update(i + 1)
    wall = time.perf_counter() - t_wall
    return _Run(stages, bins, wall, warmup_s, peak_bytes, rss0, rss_peak, method.stage_bytes())


# --------------------------------------------------------------------------
# summaries


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _summary(acc: _Acc) -> dict[str, Any]:
    """Reported metrics of a set of counters."""
    d = np.asarray(acc.draft_ns, dtype=np.float64) / 1e3
    return {
        "requests": acc.requests,
        "prompt_tokens": acc.prompt_tokens,
        "response_tokens": acc.response_tokens,
        "steps": acc.steps,
        "mat": _ratio(acc.response_tokens, acc.steps),
        "accepted_per_step": _ratio(acc.accepted, acc.steps),
        "drafted_per_step": _ratio(acc.drafted, acc.steps),
        "acceptance_rate": _ratio(acc.accepted, acc.drafted),
        "nonempty_draft_fraction": _ratio(acc.nonempty, acc.steps),
        "draft_p50_us": float(np.percentile(d, 50)) if d.size else None,
        "draft_p99_us": float(np.percentile(d, 99)) if d.size else None,
        "draft_mean_us": float(d.mean()) if d.size else None,
        "update_us_per_token": _ratio(acc.update_ns / 1e3, acc.response_tokens),
        "ingest_us_per_prompt_token": _ratio(acc.start_ns / 1e3, acc.prompt_tokens),
        "finish_us_per_response_token": _ratio(acc.finish_ns / 1e3, acc.response_tokens),
    }


def _merge(accs: Sequence[_Acc]) -> _Acc:
    out = _Acc()
    for a in accs:
        for f in (
            "requests",
            "prompt_tokens",
            "response_tokens",
            "steps",
            "accepted",
            "drafted",
            "nonempty",
            "start_ns",
            "update_ns",
            "finish_ns",
        ):
            setattr(out, f, getattr(out, f) + getattr(a, f))
        out.draft_ns.extend(a.draft_ns)
    return out


def summarize_run(run: _Run) -> dict[str, Any]:
    """The JSON summary of one method over one file."""
    out = _summary(_merge(list(run.stages.values())))
    out["wall_s"] = run.wall_s
    out["warmup_s"] = run.warmup_s
    out["peak_tree_bytes"] = run.peak_tree_bytes
    out["tree_bytes_per_response_token"] = (
        _ratio(run.peak_tree_bytes, out["response_tokens"])
        if run.peak_tree_bytes is not None
        else None
    )
    out["rss_growth_bytes"] = (
        run.rss_peak - run.rss_start
        if run.rss_peak is not None and run.rss_start is not None
        else None
    )
    per_stage = {}
    for stage, acc in run.stages.items():
        s = _summary(acc)
        s["tree_bytes"] = run.stage_bytes.get(stage)
        per_stage[stage] = s
    out["per_stage"] = per_stage
    out["by_shard_size"] = [
        {
            "shard_responses_lo": lo,
            "shard_responses_hi": hi,
            "requests": v[0],
            "response_tokens": v[1],
            "steps": v[2],
            "mat": _ratio(v[1], v[2]),
            "acceptance_rate": _ratio(v[3], v[4]),
        }
        for (lo, hi), v in sorted(run.bins.items())
    ]
    return out


def add_oracle_fractions(methods: dict[str, dict[str, Any]]) -> None:
    """Set ``mat_vs_oracle`` (overall, per stage, per shard bucket) on every method."""
    oracle = methods.get(ORACLE)
    for res in methods.values():
        res["mat_vs_oracle"] = _frac(res.get("mat"), oracle.get("mat") if oracle else None)
        for stage, s in res["per_stage"].items():
            o = oracle["per_stage"].get(stage) if oracle else None
            s["mat_vs_oracle"] = _frac(s.get("mat"), o.get("mat") if o else None)
        obins = {(b["shard_responses_lo"]): b for b in oracle["by_shard_size"]} if oracle else {}
        for b in res["by_shard_size"]:
            ob = obins.get(b["shard_responses_lo"])
            b["mat_vs_oracle"] = _frac(b.get("mat"), ob.get("mat") if ob else None)


def _frac(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


# --------------------------------------------------------------------------
# driver


def run(
    paths: Sequence[Path],
    *,
    cfg: ReplayConfig,
    methods: Sequence[str],
    tokenizer: Any,
    max_sessions: int | None = None,
    warmup_from: Path | None = None,
    log: Callable[[str], None] = lambda s: None,
    progress_stream: TextIO | None = None,
) -> dict[str, Any]:
    """Replay every file with every runnable method; return the JSON-ready results.

    The oracle always runs (its MAT is the denominator of the fractions).
    Methods that cannot run here are listed under ``skipped`` with the reason.
    """
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    status = method_status()
    wanted = [m for m in METHODS if m in methods or m == ORACLE]
    skipped = {m: status[m] for m in wanted if status[m] is not None}
    runnable = [m for m in wanted if status[m] is None]
    for m, why in skipped.items():
        log(f"skipping {m}: {why}")
    warm: tuple[Request, ...] = ()
    warm_info: dict[str, Any] | None = None
    if warmup_from is not None:
        wt = load_trace(warmup_from, tokenizer)
        warm = wt.requests
        warm_info = {"path": str(warmup_from), **wt.counts(), "tokenize_s": wt.tokenize_s}
        log(f"warm-up: {wt.name}: {len(warm)} responses")
    files = []
    for path in paths:
        t_file = time.perf_counter()
        trace = load_trace(path, tokenizer, max_sessions)
        counts = trace.counts()
        log(
            f"[{trace.name}] {counts['sessions']} sessions, {counts['requests']} requests, "
            f"{counts['response_tokens']} response tokens (tokenized in {trace.tokenize_s:.1f} s)"
        )
        results: dict[str, dict[str, Any]] = {}
        for m in runnable:
            method = make_method(m, cfg)
            prog = Progress(progress_stream, f"[{trace.name}] {m}", len(trace.requests))
            try:
                r = replay(method, trace, warm, prog)
            finally:
                method.close()
            res = summarize_run(r)
            results[m] = res
            prog.close(
                f"MAT {_fmt(res['mat'], 3)}, {r.wall_s:.1f} s"
                + (f" (+{r.warmup_s:.1f} s warm-up)" if warm else "")
            )
        add_oracle_fractions(results)
        files.append(
            {
                "path": str(path),
                "name": trace.name,
                "workload": trace.workload,
                "counts": counts,
                "stages": trace.stages(),
                "tokenize_s": trace.tokenize_s,
                "methods": results,
                "wall_s": time.perf_counter() - t_file,
            }
        )
    return {
        "config": asdict(cfg),
        "max_sessions": max_sessions,
        "warmup": warm_info,
        "methods": runnable,
        "skipped": skipped,
        "environment": _environment(),
        "files": files,
    }


def _environment() -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for dist in ("agentspec", "arctic-inference", "tokenizers", "numpy"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": versions,
    }


# --------------------------------------------------------------------------
# tables


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:,.{nd}f}"
    return str(v)


def _mb(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:,.1f}"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)
    ]
    lines = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(head, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(lines)


_COMMON_HEAD = ["steps", "MAT", "/oracle", "accept", "drafted/step", "draft p50 µs", "p99 µs"]


def _common_cells(m: dict[str, Any]) -> list[str]:
    return [
        _fmt(m["steps"]),
        _fmt(m["mat"], 3),
        _fmt(m["mat_vs_oracle"], 3),
        _fmt(m["acceptance_rate"], 3),
        _fmt(m["drafted_per_step"], 2),
        _fmt(m["draft_p50_us"], 2),
        _fmt(m["draft_p99_us"], 2),
        _fmt(m["update_us_per_token"], 3),
    ]


def render_tables(results: dict[str, Any]) -> str:
    """Terminal tables per file: every method overall, then per stage (several stages)."""
    out: list[str] = []
    for f in results["files"]:
        c = f["counts"]
        out.append(
            f"== {f['name']} ({f['workload']}): {c['sessions']:,} sessions, "
            f"{c['requests']:,} requests, {c['prompt_tokens']:,} prompt tokens, "
            f"{c['response_tokens']:,} response tokens"
        )
        head = ["method", *_COMMON_HEAD, "update µs/tok", "trees MB", "RSS +MB", "wall s"]
        rows = [
            [
                name,
                *_common_cells(m),
                _mb(m["peak_tree_bytes"]),
                _mb(m["rss_growth_bytes"]),
                _fmt(m["wall_s"], 1),
            ]
            for name, m in f["methods"].items()
        ]
        out.append(_table(head, rows))
        if len(f["stages"]) > 1:
            out.append("")
            shead = ["stage / method", "requests", "tokens", *_COMMON_HEAD, "update µs/tok"]
            shead.append("shard MB")
            srows: list[list[str]] = []
            for stage in f["stages"]:
                for name, m in f["methods"].items():
                    st = m["per_stage"].get(stage)
                    if st is None:
                        continue
                    srows.append(
                        [
                            f"{stage} / {name}",
                            _fmt(st["requests"]),
                            _fmt(st["response_tokens"]),
                            *_common_cells(st),
                            _mb(st.get("tree_bytes")),
                        ]
                    )
            out.append(_table(shead, srows))
        out.append("")
    if results.get("skipped"):
        for m, why in results["skipped"].items():
            out.append(f"skipped {m}: {why}")
    return "\n".join(out).rstrip() + "\n"


# --------------------------------------------------------------------------
# command line


def add_common_arguments(p: argparse.ArgumentParser, *, budget_rule: bool = True) -> None:
    """The options every ``bench`` replay command shares: tokenizer, tree and draft
    configuration (``--alpha``/``--min-prob`` only with ``budget_rule``), outputs."""
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help=f"HF tokenizer.json with ChatML tokens (default: {DEFAULT_TOKENIZER})",
    )
    p.add_argument("--depth", type=int, default=64, help="tree depth (default 64)")
    p.add_argument(
        "--max-spec-tokens", type=int, default=32, help="most draft tokens per step (default 32)"
    )
    if budget_rule:
        p.add_argument("--alpha", type=float, default=1.0, help="draft budget per matched token")
        p.add_argument(
            "--min-prob", type=float, default=0.1, help="min path probability of a token"
        )
        p.add_argument(
            "--conf-min-prob",
            type=float,
            default=0.25,
            help="the confidence method's min path probability (default 0.25; it has no alpha)",
        )
    p.add_argument("--json", type=Path, default=None, help="write all results to this JSON file")
    p.add_argument("--plots", type=Path, default=None, help="write PNG plots into this directory")
    p.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def add_trace_arguments(p: argparse.ArgumentParser, *, warmup: bool = False) -> None:
    """The trace files, ``--max-sessions`` and (with ``warmup``) ``--warmup-from``."""
    p.add_argument("traces", nargs="+", type=Path, help="trace files (.jsonl or .jsonl.gz)")
    p.add_argument(
        "--max-sessions", type=int, default=None, help="replay only the first N sessions per file"
    )
    if warmup:
        p.add_argument(
            "--warmup-from",
            type=Path,
            default=None,
            help="learn all responses of this trace file before each replay (offline warm-up)",
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``bench replay`` options to ``p``."""
    add_trace_arguments(p, warmup=True)
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated methods (default: all): {', '.join(METHODS)}; "
        "the oracle always runs",
    )
    add_common_arguments(p)


def parse_methods(spec: str) -> list[str]:
    """Split and check a ``--methods`` value."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError("--methods is empty")
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise ValueError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}")
    return names


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def check_inputs(paths: Sequence[Path], max_sessions: int | None) -> None:
    """Raise before any work when a trace file is missing or ``--max-sessions`` < 1."""
    if max_sessions is not None and max_sessions < 1:
        raise ValueError(f"--max-sessions must be >= 1, got {max_sessions}")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"trace file not found: {p}")


def run_cli(args: argparse.Namespace) -> int:
    """Run ``agentspec bench replay`` from parsed arguments; return the exit status."""
    warm = [args.warmup_from] if args.warmup_from else []
    check_inputs([*args.traces, *warm], args.max_sessions)
    methods = parse_methods(args.methods)
    cfg = ReplayConfig(
        args.depth, args.max_spec_tokens, args.alpha, args.min_prob, args.conf_min_prob
    )
    tok = load_tokenizer(args.tokenizer)
    err, log = cli_log(args.quiet)
    results = run(
        args.traces,
        cfg=cfg,
        methods=methods,
        tokenizer=tok,
        max_sessions=args.max_sessions,
        warmup_from=args.warmup_from,
        log=log,
        progress_stream=err,
    )
    results["command"] = getattr(args, "argv", None)
    from agentspec.bench.plots import plot_replay

    write_outputs(results, render_tables(results), args.json, args.plots, plot_replay, log)
    return 0


def cli_log(quiet: bool) -> tuple[TextIO | None, Callable[[str], None]]:
    """The progress stream (stderr, or None when ``quiet``) and a logger writing to it."""
    err = None if quiet else sys.stderr

    def log(msg: str) -> None:
        if err is not None:
            print(msg, file=err, flush=True)

    return err, log


def write_outputs(
    results: dict[str, Any],
    table: str,
    json_path: Path | None,
    plots_dir: Path | None,
    plot: Callable[[dict[str, Any], Path], tuple[list[Path], str | None]],
    log: Callable[[str], None],
) -> None:
    """Print ``table``; write ``results`` as JSON and ``plot`` them when asked."""
    sys.stdout.write(table)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(_json_safe(results), indent=1) + "\n", encoding="utf-8")
        log(f"wrote {json_path}")
    if plots_dir is not None:
        written, why = plot(results, plots_dir)
        if why is not None:
            print(f"plots skipped: {why}", file=sys.stderr)
        for w in written:
            log(f"wrote {w}")
