#!/usr/bin/env python
"""Side-by-side replay benchmark: agentspec against arctic-inference 0.3.0.

Every request of a trace file is replayed, in file order, through a simulated
greedy verifier: the request's prompt is ingested, then each step drafts from
the last ``--depth`` context tokens, accepts the longest draft prefix equal to
the true response, adds one bonus token and feeds the accepted tokens back.
Finished responses stay in the global tree (as arctic does), so later requests
can draft from earlier ones.

Backends (all with the same parameters):

* ``arctic``: ``arctic_inference.suffix_decoding.SuffixDecodingCache``
  (the reference; skipped when not importable or with ``--no-arctic``);
* ``agentspec``: ``agentspec.compat.SuffixDecodingCache``, same API and calls;
* ``agentspec-cursor``: the native agentspec API: a global ``SuffixTree`` of
  finished responses (``tree.add`` after each request) and one ``Cursor``
  with a per-request tree per request (``extend`` then ``draft``);
* ``agentspec-confident``: the same cursor path with the default policy of
  ``Speculator`` and the engines, ``DraftParams.confident()`` (confidence
  table, cut 0.25; ``--alpha``/``--min-prob`` do not apply to it);
* ``agentspec-raw`` (only on request, ``--backends ...,agentspec-raw``): the
  cursor path through bare C calls, a diagnostic of the engine's own cost.

Memory is measured twice: allocator bytes of the global tree after the
replay, and RSS growth while building the global tree of all responses of the
file in a fresh subprocess per backend (so RSS is isolated).

Run ``python benchmarks/bench_native.py --help``; results and commands are in
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._traces import (
    DEFAULT_TOKENIZER,
    Request,
    TraceSet,
    load_tokenizer,
    load_traces,
)

ARCTIC = "arctic"
AGENTSPEC = "agentspec"
CURSOR = "agentspec-cursor"
CONFIDENT = "agentspec-confident"
RAW = "agentspec-raw"
DEFAULT_BACKENDS = (ARCTIC, AGENTSPEC, CURSOR, CONFIDENT)
ALL_BACKENDS = (*DEFAULT_BACKENDS, RAW)
OURS = (AGENTSPEC, CURSOR, CONFIDENT)

# (metric key, target ratio ours/arctic or absolute bound, kind, label)
RATIO_TARGETS: tuple[tuple[str, float, str], ...] = (
    ("draft_p50_us", 1 / 3, "drafting p50 per call"),
    ("draft_p99_us", 1 / 3, "drafting p99 per call"),
    ("draft_us_per_drafted_token", 1 / 3, "drafting per drafted token"),
    ("update_us_per_token", 1 / 2, "update per appended token"),
    ("ingest_us_per_prompt_token", 1 / 2, "prompt ingestion per prompt token"),
)
MEMORY_TARGET_BYTES = 100.0


@dataclass(frozen=True)
class Config:
    """Drafting parameters shared by every backend."""

    depth: int = 64
    max_spec_tokens: int = 32
    alpha: float = 1.0
    min_prob: float = 0.1


# --------------------------------------------------------------------------
# backends


def backend_status(no_arctic: bool) -> dict[str, str | None]:
    """Map each backend to None when usable, else to why it is skipped."""
    out: dict[str, str | None] = {}
    if no_arctic:
        out[ARCTIC] = "disabled by --no-arctic"
    else:
        try:
            import arctic_inference.suffix_decoding  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: F401
        except ImportError as e:
            out[ARCTIC] = f"not importable ({e}); run scripts/install_arctic.sh"
        else:
            out[ARCTIC] = None
    try:
        import agentspec
        import agentspec.compat  # noqa: F401
    except ImportError as e:
        out[AGENTSPEC] = out[CURSOR] = out[CONFIDENT] = out[RAW] = f"agentspec not importable ({e})"
    else:
        out[AGENTSPEC] = out[CURSOR] = out[CONFIDENT] = None
        out[RAW] = _raw_missing()
    return out


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


_RAW_NEEDS = (
    "cursor_create",
    "cursor_extend",
    "draft",
    "release",
    "tree_add",
    "int32_ptr",
    "DraftBuffers",
)


def _raw_missing() -> str | None:
    """None when the private layer ``agentspec-raw`` uses is present, else what is missing."""
    from agentspec._core import lowlevel

    missing = [n for n in _RAW_NEEDS if not hasattr(lowlevel, n)]
    return f"agentspec._core.lowlevel lacks {', '.join(missing)}" if missing else None


def agentspec_build() -> dict[str, Any] | None:
    """Path, mtime and sha256 prefix of the loaded agentspec extension (None if absent)."""
    try:
        from agentspec._core import lowlevel
    except ImportError:
        return None
    mod = sys.modules.get("agentspec._agentspec_cffi")
    path = getattr(mod, "__file__", None) or getattr(lowlevel, "__file__", None)
    if path is None:
        return None
    data = Path(path).read_bytes()
    mtime = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(Path(path).stat().st_mtime))
    return {"path": path, "sha256_16": hashlib.sha256(data).hexdigest()[:16], "mtime_utc": mtime}


def make_cache(backend: str, depth: int) -> Any:
    """Create an arctic-API cache for ``arctic`` or ``agentspec``."""
    if backend == ARCTIC:
        from arctic_inference.suffix_decoding import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
            SuffixDecodingCache,
        )

        return SuffixDecodingCache(max_tree_depth=depth)
    if backend == AGENTSPEC:
        from agentspec.compat import SuffixDecodingCache as AsCache

        return AsCache(max_tree_depth=depth)
    raise ValueError(f"backend {backend!r} has no cache API")


def cache_global_bytes(backend: str, cache: Any) -> int | None:
    """Allocator bytes of a cache's global tree (arctic: its own estimate)."""
    if backend == ARCTIC:
        return int(cache._global_tree.estimate_memory())
    tree = getattr(cache, "global_tree", None)
    if tree is None:
        tree = getattr(cache, "_global_tree", None)
    if tree is None or not hasattr(tree, "stats"):
        return None
    return int(tree.stats().bytes)


# --------------------------------------------------------------------------
# replay


@dataclass
class Counters:
    """Raw counters and timings of one replay of one backend over one file."""

    draft_ns: list[int]
    update_ns: list[int]
    ingest_ns: int = 0
    finish_ns: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    nonempty: int = 0
    appended: int = 0
    requests: int = 0
    wall_s: float = 0.0
    global_bytes: int | None = None
    cached_tokens: int = 0
    stage_steps: dict[str, list[int]] | None = None  # stage -> [steps, appended, accepted]


def _verify(tokens: Sequence[int], resp: list[int], pos: int, remaining: int) -> int:
    """Length of the longest prefix of a linear draft equal to the true continuation."""
    lim = len(tokens)
    if lim > remaining:
        lim = remaining
    acc = 0
    while acc < lim and tokens[acc] == resp[pos + acc]:
        acc += 1
    return acc


def replay_cache(backend: str, reqs: Sequence[Request], cfg: Config) -> Counters:
    """Replay with the arctic cache API (``arctic`` and ``agentspec``)."""
    cache = make_cache(backend, cfg.depth)
    c = Counters([], [], stage_steps={})
    assert c.stage_steps is not None
    start, spec = cache.start_request, cache.speculate
    upd, stop = cache.add_active_response, cache.stop_request
    pc = time.perf_counter_ns
    depth, k, alpha, mp = cfg.depth, cfg.max_spec_tokens, cfg.alpha, cfg.min_prob
    dns, uns = c.draft_ns, c.update_ns
    t_wall = time.perf_counter()
    for rid, req in enumerate(reqs):
        prompt, resp_arr = req.prompt, req.response
        full = np.concatenate([prompt, resp_arr])
        resp = resp_arr.tolist()
        n_p, n_r = len(prompt), len(resp)
        t0 = pc()
        start(rid, prompt)
        c.ingest_ns += pc() - t0
        pos = steps = accepted = 0
        while pos < n_r:
            end = n_p + pos
            tail = full[end - depth if end > depth else 0 : end]
            t0 = pc()
            d = spec(
                rid,
                tail,
                max_spec_tokens=k,
                max_spec_factor=alpha,
                max_spec_offset=0.0,
                min_token_prob=mp,
            )
            t1 = pc()
            dns.append(t1 - t0)
            toks = d.token_ids
            acc = _verify(toks, resp, pos, n_r - pos)
            c.drafted += len(toks)
            c.nonempty += 1 if toks else 0
            n_new = acc + 1 if acc < n_r - pos else acc
            new = resp[pos : pos + n_new]
            t0 = pc()
            upd(rid, new)
            uns.append(pc() - t0)
            pos += n_new
            steps += 1
            accepted += acc
        t0 = pc()
        stop(rid)
        c.finish_ns += pc() - t0
        _count_request(c, req, n_p, n_r, steps, accepted)
    c.wall_s = time.perf_counter() - t_wall
    c.global_bytes = cache_global_bytes(backend, cache)
    c.cached_tokens = c.response_tokens
    return c


def replay_cursor(reqs: Sequence[Request], cfg: Config, *, confident: bool = False) -> Counters:
    """Replay with the native agentspec API (``agentspec-cursor``; with ``confident``,
    ``agentspec-confident``: the default policy's params)."""
    from agentspec import Cursor, DraftParams, SuffixTree

    tree = SuffixTree(max_depth=cfg.depth)
    if confident:
        params = DraftParams.confident(max_spec_tokens=cfg.max_spec_tokens)
    else:
        params = DraftParams(
            max_spec_tokens=cfg.max_spec_tokens, alpha=cfg.alpha, min_token_prob=cfg.min_prob
        )
    c = Counters([], [], stage_steps={})
    pc = time.perf_counter_ns
    dns, uns = c.draft_ns, c.update_ns
    depth = cfg.depth
    t_wall = time.perf_counter()
    for rid, req in enumerate(reqs):
        prompt, resp_arr = req.prompt, req.response
        resp = resp_arr.tolist()
        n_p, n_r = len(prompt), len(resp)
        t0 = pc()
        cur = Cursor(depth, local_tree=True)
        cur.extend(prompt)
        c.ingest_ns += pc() - t0
        ext, draft = cur.extend, cur.draft
        pos = steps = accepted = 0
        while pos < n_r:
            t0 = pc()
            d = draft(tree, params)
            t1 = pc()
            dns.append(t1 - t0)
            toks = d.token_ids
            acc = _verify(toks, resp, pos, n_r - pos)
            c.drafted += len(toks)
            c.nonempty += 1 if toks else 0
            n_new = acc + 1 if acc < n_r - pos else acc
            new = resp[pos : pos + n_new]
            t0 = pc()
            ext(new)
            uns.append(pc() - t0)
            pos += n_new
            steps += 1
            accepted += acc
        t0 = pc()
        cur.close()
        tree.add(rid, resp_arr)
        c.finish_ns += pc() - t0
        _count_request(c, req, n_p, n_r, steps, accepted)
    c.wall_s = time.perf_counter() - t_wall
    st = tree.stats()
    c.global_bytes = int(st.bytes)
    c.cached_tokens = int(st.tokens)
    tree.close()
    return c


def replay_raw(reqs: Sequence[Request], cfg: Config) -> Counters:
    """Replay ``agentspec-raw``: the cursor path with bare C calls (diagnostic only).

    Same work as ``agentspec-cursor`` but through the private cffi layer
    (``agentspec._core.lowlevel``), timing only the C calls: token packing and the
    conversion of the draft to Python lists happen outside the timed region.
    It shows what the engine itself costs, so that the difference to
    ``agentspec-cursor`` is the Python wrapper's per-call cost.
    """
    from agentspec import DraftParams, SuffixTree
    from agentspec._core import lowlevel

    tree = SuffixTree(max_depth=cfg.depth)
    params = DraftParams(
        max_spec_tokens=cfg.max_spec_tokens, alpha=cfg.alpha, min_token_prob=cfg.min_prob
    )
    gh = tree._h
    c_params = params._c
    bufs = lowlevel.DraftBuffers(cfg.max_spec_tokens)
    create, extend = lowlevel.cursor_create, lowlevel.cursor_extend
    draft, out = lowlevel.lib.as_draft, bufs.out  # the bare C call; converted outside the timing
    ptr_of, result = lowlevel.int32_ptr, bufs.result
    c = Counters([], [], stage_steps={})
    pc = time.perf_counter_ns
    dns, uns = c.draft_ns, c.update_ns
    depth = cfg.depth
    t_wall = time.perf_counter()
    for rid, req in enumerate(reqs):
        prompt, resp_arr = req.prompt, req.response
        resp = resp_arr.tolist()
        n_p, n_r = len(prompt), len(resp)
        p_ptr = ptr_of(prompt)
        t0 = pc()
        h = create(depth, True)
        extend(h, p_ptr, n_p, prompt)
        c.ingest_ns += pc() - t0
        pos = steps = accepted = 0
        while pos < n_r:
            t0 = pc()
            st = draft(h, gh, c_params, out)
            t1 = pc()
            if st:
                raise lowlevel.error(st)
            dns.append(t1 - t0)
            toks = result()[0]
            acc = _verify(toks, resp, pos, n_r - pos)
            c.drafted += len(toks)
            c.nonempty += 1 if toks else 0
            n_new = acc + 1 if acc < n_r - pos else acc
            new = resp_arr[pos : pos + n_new]
            new_ptr = ptr_of(new)
            t0 = pc()
            extend(h, new_ptr, n_new, new)
            uns.append(pc() - t0)
            pos += n_new
            steps += 1
            accepted += acc
        r_ptr = ptr_of(resp_arr)
        t0 = pc()
        lowlevel.release(h)
        lowlevel.tree_add(gh, rid, r_ptr, n_r, resp_arr)
        c.finish_ns += pc() - t0
        _count_request(c, req, n_p, n_r, steps, accepted)
    c.wall_s = time.perf_counter() - t_wall
    st = tree.stats()
    c.global_bytes = int(st.bytes)
    c.cached_tokens = int(st.tokens)
    tree.close()
    return c


def _count_request(
    c: Counters, req: Request, n_p: int, n_r: int, steps: int, accepted: int
) -> None:
    c.requests += 1
    c.prompt_tokens += n_p
    c.response_tokens += n_r
    c.appended += n_r
    c.steps += steps
    c.accepted += accepted
    assert c.stage_steps is not None
    s = c.stage_steps.setdefault(req.stage, [0, 0, 0])
    s[0] += steps
    s[1] += n_r
    s[2] += accepted


def run_replay(backend: str, reqs: Sequence[Request], cfg: Config) -> Counters:
    """Run one replay of ``backend`` with the garbage collector paused (as timeit does)."""
    gc.collect()
    gc.disable()
    try:
        if backend in (CURSOR, CONFIDENT):
            return replay_cursor(reqs, cfg, confident=backend == CONFIDENT)
        if backend == RAW:
            return replay_raw(reqs, cfg)
        return replay_cache(backend, reqs, cfg)
    finally:
        gc.enable()


def summarize(c: Counters) -> dict[str, Any]:
    """Turn raw counters into the reported metrics (µs, per-token rates, acceptance)."""
    d = np.asarray(c.draft_ns, dtype=np.float64) / 1e3
    u = np.asarray(c.update_ns, dtype=np.float64) / 1e3
    draft_total = float(d.sum())
    update_total = float(u.sum())
    steps = max(c.steps, 1)
    out: dict[str, Any] = {
        "requests": c.requests,
        "steps": c.steps,
        "prompt_tokens": c.prompt_tokens,
        "response_tokens": c.response_tokens,
        "draft_p50_us": float(np.percentile(d, 50)) if d.size else 0.0,
        "draft_p99_us": float(np.percentile(d, 99)) if d.size else 0.0,
        "draft_mean_us": float(d.mean()) if d.size else 0.0,
        "draft_us_per_drafted_token": draft_total / c.drafted if c.drafted else float("nan"),
        "update_us_per_token": update_total / max(c.appended, 1),
        "update_p50_us": float(np.percentile(u, 50)) if u.size else 0.0,
        "ingest_us_per_prompt_token": c.ingest_ns / 1e3 / max(c.prompt_tokens, 1),
        "finish_us_per_response_token": c.finish_ns / 1e3 / max(c.response_tokens, 1),
        "overhead_us_per_output_token": (draft_total + update_total + c.finish_ns / 1e3)
        / max(c.response_tokens, 1),
        "mat": c.appended / steps,
        "accepted_per_step": c.accepted / steps,
        "drafted_per_step": c.drafted / steps,
        "acceptance_rate": c.accepted / c.drafted if c.drafted else 0.0,
        "nonempty_draft_fraction": c.nonempty / steps,
        "wall_s": c.wall_s,
        "alloc_bytes_per_cached_token": (c.global_bytes / c.cached_tokens)
        if c.global_bytes is not None and c.cached_tokens
        else None,
        "global_bytes": c.global_bytes,
        "cached_tokens": c.cached_tokens,
        "per_stage": {
            k: {
                "steps": v[0],
                "response_tokens": v[1],
                "mat": v[1] / max(v[0], 1),
                "accepted_per_step": v[2] / max(v[0], 1),
            }
            for k, v in sorted((c.stage_steps or {}).items())
        },
    }
    return out


TIMING_KEYS = (
    "draft_p50_us",
    "draft_p99_us",
    "draft_mean_us",
    "draft_us_per_drafted_token",
    "update_us_per_token",
    "update_p50_us",
    "ingest_us_per_prompt_token",
    "finish_us_per_response_token",
    "overhead_us_per_output_token",
    "wall_s",
)
ACCEPT_KEYS = (
    "mat",
    "accepted_per_step",
    "drafted_per_step",
    "acceptance_rate",
    "nonempty_draft_fraction",
    "steps",
)


def median_over_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of every timing metric over repeats; acceptance metrics from the first run."""
    med = dict(runs[0])
    for key in TIMING_KEYS:
        med[key] = statistics.median(r[key] for r in runs)
    med["acceptance_deterministic"] = all(
        all(r[k] == runs[0][k] for k in ACCEPT_KEYS) for r in runs
    )
    return med


# --------------------------------------------------------------------------
# RSS measurement in a fresh subprocess


def rss_child(backend: str, data_path: str, depth: int) -> dict[str, Any]:
    """Build the global tree of all responses in this process; report RSS growth."""
    import psutil

    proc = psutil.Process()
    data = np.load(data_path)
    toks = np.ascontiguousarray(data["tokens"], dtype=np.int32)
    offs = data["offsets"].tolist()
    resps = [toks[offs[i] : offs[i + 1]] for i in range(len(offs) - 1)]
    empty = np.zeros(0, dtype=np.int32)
    tree: Any = None
    cache: Any = None
    if backend in (CURSOR, CONFIDENT, RAW):
        from agentspec import SuffixTree

        tree = SuffixTree(max_depth=depth)
    else:
        cache = make_cache(backend, depth)
    gc.collect()
    rss0 = int(proc.memory_info().rss)
    t0 = time.perf_counter_ns()
    if tree is not None:
        for i, r in enumerate(resps):
            tree.add(i, r)
    else:
        for i, r in enumerate(resps):
            cache.start_request(i, empty)
            cache.add_active_response(i, r)
            cache.stop_request(i)
    ns = time.perf_counter_ns() - t0
    gc.collect()
    rss1 = int(proc.memory_info().rss)
    n_tok = int(toks.size)
    alloc = int(tree.stats().bytes) if tree is not None else cache_global_bytes(backend, cache)
    return {
        "backend": backend,
        "cached_tokens": n_tok,
        "rss_before": rss0,
        "rss_after": rss1,
        "rss_bytes_per_cached_token": (rss1 - rss0) / max(n_tok, 1),
        "alloc_bytes": alloc,
        "alloc_bytes_per_cached_token": (alloc / n_tok) if alloc is not None and n_tok else None,
        "bulk_us_per_token": ns / 1e3 / max(n_tok, 1),
    }


def measure_rss(backend: str, ts: TraceSet, depth: int) -> dict[str, Any]:
    """Run :func:`rss_child` in a fresh interpreter for ``backend`` over all responses of ``ts``."""
    resps = [r.response for r in ts.requests()]
    offsets = np.zeros(len(resps) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(r) for r in resps])
    with tempfile.TemporaryDirectory(prefix="bench_native_") as tmp:
        path = os.path.join(tmp, "responses.npz")
        np.savez(path, tokens=np.concatenate(resps), offsets=offsets)
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--rss-child",
            backend,
            "--rss-data",
            path,
            "--depth",
            str(depth),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"RSS child for {backend} failed (rc={res.returncode}):\n{res.stderr}")
    parsed: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return parsed


# --------------------------------------------------------------------------
# reporting


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        if v != v:  # nan
            return "n/a"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{nd}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


ROWS: tuple[tuple[str, str, int], ...] = (
    ("draft_p50_us", "draft µs/call p50", 2),
    ("draft_p99_us", "draft µs/call p99", 2),
    ("draft_mean_us", "draft µs/call mean", 2),
    ("draft_us_per_drafted_token", "draft µs per drafted token", 3),
    ("update_us_per_token", "update µs per appended token", 3),
    ("update_p50_us", "update µs/call p50", 2),
    ("ingest_us_per_prompt_token", "ingest µs per prompt token", 3),
    ("finish_us_per_response_token", "finish µs per response token", 3),
    ("overhead_us_per_output_token", "draft+update+finish µs per output token", 2),
    ("alloc_bytes_per_cached_token", "memory B/cached token (allocator)", 1),
    ("rss_bytes_per_cached_token", "memory B/cached token (RSS, fresh process)", 1),
    ("bulk_us_per_token", "bulk cache build µs/token (RSS run)", 3),
    ("mat", "MAT (accepted+bonus per step)", 3),
    ("accepted_per_step", "accepted per step", 3),
    ("drafted_per_step", "drafted tokens per step", 3),
    ("acceptance_rate", "acceptance rate", 3),
    ("nonempty_draft_fraction", "non-empty draft fraction", 3),
    ("steps", "steps", 0),
    ("wall_s", "replay wall s", 1),
)


def _ratio(ours: Any, ref: Any) -> float | None:
    """ours/ref for two finite numbers with ref != 0, else None."""
    if not isinstance(ours, (int, float)) or not isinstance(ref, (int, float)):
        return None
    if ref == 0 or ours != ours or ref != ref:
        return None
    return float(ours) / float(ref)


def compute_targets(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Evaluate each target for each of our backends present (ratios need arctic)."""
    out: list[dict[str, Any]] = []
    arc = results.get(ARCTIC)
    for ours in OURS:
        r = results.get(ours)
        if r is None:
            continue
        if arc is not None:
            for key, bound, label in RATIO_TARGETS:
                ratio = _ratio(r.get(key), arc.get(key))
                out.append(
                    {
                        "backend": ours,
                        "target": f"{label}: ours/arctic <= {bound:.3g}",
                        "metric": key,
                        "value": ratio,
                        "pass": ratio is not None and ratio <= bound,
                    }
                )
            out.append(
                {
                    "backend": ours,
                    "target": "MAT: ours >= arctic",
                    "metric": "mat",
                    "value": r["mat"] - arc["mat"],
                    "pass": r["mat"] >= arc["mat"],
                }
            )
        for key, label in (
            ("rss_bytes_per_cached_token", "RSS"),
            ("alloc_bytes_per_cached_token", "allocator"),
        ):
            v = r.get(key)
            out.append(
                {
                    "backend": ours,
                    "target": f"memory per cached token ({label}) <= {MEMORY_TARGET_BYTES:.0f} B",
                    "metric": key,
                    "value": v,
                    "pass": v is not None and v <= MEMORY_TARGET_BYTES,
                }
            )
    return out


def render_table(file_res: dict[str, Any]) -> str:
    """Markdown table of one trace file: backends side by side plus ratios and targets."""
    results: dict[str, dict[str, Any]] = file_res["backends"]
    names = [b for b in ALL_BACKENDS if b in results]
    has_arc = ARCTIC in results
    ours = [b for b in (*OURS, RAW) if b in results]
    head = ["metric", *names] + ([f"{b}/arctic" for b in ours] if has_arc else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for key, label, nd in ROWS:
        row = [label] + [_fmt(results[b].get(key), nd) for b in names]
        if has_arc:
            for b in ours:
                ratio = _ratio(results[b].get(key), results[ARCTIC].get(key))
                row.append(f"{ratio:.3f}" if ratio is not None else "")
        lines.append("| " + " | ".join(row) + " |")
    c = file_res["counts"]
    hdr = (
        f"### {file_res['name']}: {c['sessions']:,} sessions, {c['requests']:,} requests, "
        f"{c['prompt_tokens']:,} prompt tokens, {c['response_tokens']:,} response tokens\n\n"
        f"tokenize {file_res['tokenize_s']:.1f} s, file wall {file_res['wall_s']:.1f} s, "
        f"load avg before/after {file_res['load_before']} / {file_res['load_after']}\n"
    )
    tl = ["", "| backend | target | value | result |", "|---|---|---:|---|"]
    for t in file_res["targets"]:
        v = t["value"]
        vs = _fmt(v, 3) if t["metric"] != "mat" else (f"{v:+.3f}" if v is not None else "n/a")
        tl.append(f"| {t['backend']} | {t['target']} | {vs} | {'PASS' if t['pass'] else 'FAIL'} |")
    return (
        hdr + "\n" + "\n".join(lines) + "\n" + ("\n".join(tl) if file_res["targets"] else "") + "\n"
    )


def uptime_line() -> str:
    """The output of ``uptime`` (falls back to os.getloadavg)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --------------------------------------------------------------------------
# main


def bench_file(
    path: Path,
    tok: Any,
    args: argparse.Namespace,
    cfg: Config,
    backends: list[str],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Benchmark every backend on one trace file; return its result dict."""
    t_file = time.perf_counter()
    load_before = _load()
    ts = load_traces(path, tok, args.max_sessions)
    reqs = list(ts.requests())
    counts = ts.counts()
    name = path.name.removesuffix(".jsonl.gz")
    log(
        f"[{name}] {counts['sessions']} sessions, {counts['requests']} requests, "
        f"{counts['response_tokens']} response tokens; tokenized in {ts.tokenize_seconds:.1f} s"
    )
    runs: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
    for rep in range(args.repeats):
        for b in backends:
            res = summarize(run_replay(b, reqs, cfg))
            runs[b].append(res)
            log(
                f"[{name}] {b} repeat {rep + 1}/{args.repeats}: {res['wall_s']:.1f} s, "
                f"MAT {res['mat']:.3f}, draft p50 {res['draft_p50_us']:.2f} µs (load {_load()})"
            )
    results: dict[str, dict[str, Any]] = {}
    for b in backends:
        med = median_over_repeats(runs[b])
        if not args.no_rss:
            rss = measure_rss(b, ts, cfg.depth)
            med["rss_bytes_per_cached_token"] = rss["rss_bytes_per_cached_token"]
            med["bulk_us_per_token"] = rss["bulk_us_per_token"]
            med["rss"] = rss
            log(
                f"[{name}] {b} RSS {rss['rss_bytes_per_cached_token']:.1f} B/token over "
                f"{rss['cached_tokens']} tokens"
            )
        med["repeats"] = runs[b]
        results[b] = med
    file_res: dict[str, Any] = {
        "path": str(path),
        "name": name,
        "workload": ts.workload,
        "counts": counts,
        "tokenize_s": ts.tokenize_seconds,
        "backends": results,
        "load_before": load_before,
        "load_after": _load(),
        "uptime_after": uptime_line(),
    }
    file_res["targets"] = compute_targets(results)
    file_res["wall_s"] = time.perf_counter() - t_file
    return file_res


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(
        description="Replay traces through agentspec and arctic-inference 0.3.0 side by side."
    )
    p.add_argument("traces", nargs="*", type=Path, help="trace files (.jsonl.gz)")
    p.add_argument(
        "--max-sessions",
        type=int,
        default=None,
        help="replay only the first N sessions of each file (default: all)",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=DEFAULT_TOKENIZER,
        help="tokenizer.json (default: the Qwen3 one under ../shared)",
    )
    p.add_argument("--depth", type=int, default=64, help="max tree depth (default 64)")
    p.add_argument("--max-spec-tokens", type=int, default=32, help="draft budget (default 32)")
    p.add_argument("--alpha", type=float, default=1.0, help="max_spec_factor (default 1.0)")
    p.add_argument("--min-prob", type=float, default=0.1, help="min token prob (default 0.1)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="replays per backend; timings are medians (default 1)",
    )
    p.add_argument(
        "--backends",
        default=",".join(DEFAULT_BACKENDS),
        help=f"comma-separated subset of {','.join(ALL_BACKENDS)} (default: all but {RAW})",
    )
    p.add_argument("--no-arctic", action="store_true", help="skip arctic-inference")
    p.add_argument("--no-rss", action="store_true", help="skip the RSS subprocess measurement")
    p.add_argument("--json", type=Path, default=None, help="write all results to this file")
    p.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rss-data", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rss_child is None:
        if not a.traces:
            p.error("give at least one trace file")
        for t in a.traces:
            if not t.is_file():
                p.error(f"trace file not found: {t}")
    if a.max_sessions is not None and a.max_sessions < 1:
        p.error("--max-sessions must be >= 1")
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    if not 2 <= a.depth <= 1024:
        p.error("--depth must be in [2, 1024]")
    if not 1 <= a.max_spec_tokens <= 1024:
        p.error("--max-spec-tokens must be in [1, 1024]")
    if not 0.0 <= a.min_prob <= 1.0:
        p.error("--min-prob must be in [0, 1]")
    if a.alpha <= 0:
        p.error("--alpha must be > 0")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: benchmark the given trace files and print one table per file."""
    args = parse_args(argv)
    if args.rss_child is not None:
        print(json.dumps(rss_child(args.rss_child, args.rss_data, args.depth)))
        return 0

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    cfg = Config(args.depth, args.max_spec_tokens, args.alpha, args.min_prob)
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in wanted:
        if b not in ALL_BACKENDS:
            log(f"unknown backend {b!r}; choose from {', '.join(ALL_BACKENDS)}")
            return 2
    status = backend_status(args.no_arctic)
    backends = [b for b in ALL_BACKENDS if b in wanted and status[b] is None]
    for b in wanted:
        if status[b] is not None:
            log(f"skipping {b}: {status[b]}")
    if not backends:
        log("no backend available")
        return 2
    tok = load_tokenizer(args.tokenizer)
    up0 = uptime_line()
    print(f"# bench_native: {' '.join(sys.argv)}")
    print(f"# config: {asdict(cfg)}, repeats {args.repeats}, backends {', '.join(backends)}")
    build = agentspec_build() if set(backends) & {AGENTSPEC, CURSOR, CONFIDENT, RAW} else None
    if build is not None:
        print(f"# agentspec extension: sha256 {build['sha256_16']}, built {build['mtime_utc']} UTC")
    print(f"# arctic-inference: {_version('arctic-inference')}")
    print(f"# uptime at start: {up0}\n")
    files = []
    t0 = time.perf_counter()
    for path in args.traces:
        fr = bench_file(path, tok, args, cfg, backends, log)
        files.append(fr)
        print(render_table(fr), flush=True)
    up1 = uptime_line()
    print(f"# uptime at end: {up1}; total {time.perf_counter() - t0:.1f} s")
    if args.json is not None:
        doc = {
            "command": [sys.executable, *sys.argv],
            "config": asdict(cfg),
            "repeats": args.repeats,
            "max_sessions": args.max_sessions,
            "tokenizer": str(args.tokenizer),
            "backends": backends,
            "skipped": {b: status[b] for b in wanted if status[b] is not None},
            "versions": {
                "arctic-inference": _version("arctic-inference"),
                "agentspec": _version("agentspec-suffix"),
                "numpy": np.__version__,
                "python": platform.python_version(),
            },
            "agentspec_build": build,
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "processor": platform.processor(),
            },
            "uptime_start": up0,
            "uptime_end": up1,
            "total_s": time.perf_counter() - t0,
            "files": files,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
