"""`agentspec bench fleet`: isolated per-replica trees against fleet-synced shards.

A fleet of R replicas serves a trace. Each trace is replayed in two modes
per (replica count, routing), fleet mode once per lag:

- ``isolated``: each replica's stage and pipeline trees learn only the
  responses that replica served (what vLLM's built-in suffix decoding gives
  a fleet);
- ``fleet``: every replica's trees learn every finished response, the
  serving replica at once and every other replica ``--lag-ms`` after it
  finished (fleet-synced shards).

Each replica is one `agentspec.Speculator` configured as the ``stage-shards``
method of ``agentspec bench replay``, with the same tokenization, greedy
verifier and per-request tree (the prompt's own tree, local to the serving
replica in both modes). One replica is the ``bench replay`` stage-shards run.

Simulation (a discrete clock, deterministic):

- All requests are queued at time 0 in trace order (a saturated fleet);
  routing gives each request a replica: ``round-robin`` over requests, or
  ``session`` affinity (all requests of a session on one replica, sessions
  dealt round-robin in order of first appearance).
- Each replica serves its queue one request at a time, in trace order. A
  verification step (draft, verify, extend) costs ``--step-ms`` (default
  20 ms) on every replica, and all replicas step in parallel; prefill and
  routing cost nothing. Requests of a session are not held back until the
  previous one finished (with round-robin they may overlap; each prompt is
  the recorded one, holding the session's earlier responses anyway).
- A response finishing at time t is learned by the other replicas at
  t + lag: a step at time s drafts from it when s >= t + lag. With lag 0 the
  only difference from one replica is the ordering: a request cannot draft
  from requests still in flight on other replicas (nor they from it). Fleet
  mode at lag 0 is one shared Speculator serving R requests at a time;
  fleet mode with a lag longer than the whole run is isolated mode.
- ``--shuffle-sessions SEED`` serves the sessions in a random order. Traces
  whose neighbouring sessions are near-duplicates (Spider's paraphrased
  question pairs) gain from the serial one-replica order in a way that any
  concurrency takes away, with or without fleet sync; shuffling shows how
  much of a ratio below 1 is that ordering effect rather than lag.

Results: one record per (trace, replicas, routing, mode, lag) with its MAT
and the ratio to the one-replica MAT of the same trace. Identical runs are
simulated once: one replica (routing and mode change nothing), and routings
that place every request on the same replica (traces with one request per
session).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from agentspec.bench._common import (
    add_common_arguments,
    cli_start,
    environment,
    fmt,
    release_free_memory,
    table,
    write_outputs,
)
from agentspec.bench._methods import (
    ReplayConfig,
    SpeculatorMethod,
)
from agentspec.bench._trace import (
    Request,
    TraceData,
    load_trace,
)
from agentspec.bench.verifier import accept_linear, advance

__all__ = [
    "MODES",
    "ROUTINGS",
    "FleetResult",
    "add_arguments",
    "assign",
    "parse_lags",
    "parse_max_sessions",
    "parse_replicas",
    "parse_routings",
    "render_table",
    "run",
    "run_cli",
    "shuffle_sessions",
    "simulate",
]

#: Routing policies, with a one-line description.
ROUTINGS: dict[str, str] = {
    "round-robin": "request i goes to replica i mod R",
    "session": "session affinity: a session's requests go to one replica, sessions dealt "
    "round-robin",
}
MODES = ("isolated", "fleet")
DEFAULT_STEP_MS = 20.0
MAX_REPLICAS = 1024


# --------------------------------------------------------------------------
# simulation


def shuffle_sessions(trace: TraceData, seed: int) -> TraceData:
    """``trace`` with its sessions in a seeded random order (requests renumbered;
    a session's requests keep their order)."""
    by_session: dict[int, list[Request]] = {}
    for r in trace.requests:
        by_session.setdefault(r.session, []).append(r)
    order = list(by_session)
    random.Random(seed).shuffle(order)
    reqs: list[Request] = []
    for s in order:
        for r in by_session[s]:
            reqs.append(replace(r, index=len(reqs)))
    return replace(trace, requests=tuple(reqs))


def assign(trace: TraceData, replicas: int, routing: str) -> list[int]:
    """The replica of each request of ``trace`` (by request index)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if routing == "round-robin":
        return [i % replicas for i in range(len(trace.requests))]
    if routing == "session":
        slot: dict[int, int] = {}
        out = []
        for r in trace.requests:
            s = slot.get(r.session)
            if s is None:
                s = slot[r.session] = len(slot) % replicas
            out.append(s)
        return out
    raise ValueError(f"unknown routing {routing!r}; choose from {', '.join(ROUTINGS)}")


@dataclass(frozen=True)
class FleetResult:
    """Counters of one simulated fleet over one trace."""

    requests: int
    response_tokens: int
    steps: int
    accepted: int
    drafted: int
    sim_ticks: int  # verification-step slots until the last request finished
    unseen_at_start: float  # mean finished responses a request's replica had not learned
    wall_s: float

    @property
    def mat(self) -> float | None:
        """Mean accepted tokens per step (accepted + bonus)."""
        return self.response_tokens / self.steps if self.steps else None


class _Replica(SpeculatorMethod):
    """One replica: the ``stage-shards`` Speculator, plus learning a response served
    elsewhere."""

    def learn(self, req: Request, prompt_tail: np.ndarray[Any, Any]) -> None:
        """Learn ``req``'s response as `Speculator.finish` would have (behind the
        prompt's last tokens; ``prompt_tail`` is the prompt's last ``depth`` tokens)."""
        self._spec.add_response(
            req.response, stage=req.stage, pipeline=req.workload, prompt=prompt_tail
        )


def lag_ticks(lag_ms: float, step_ms: float) -> int:
    """Steps after its finish before a response is visible to the other replicas."""
    return math.ceil(lag_ms / step_ms - 1e-9) if lag_ms > 0 else 0


def simulate(
    trace: TraceData,
    cfg: ReplayConfig,
    placement: Sequence[int],
    *,
    fleet: bool,
    lag: int = 0,
) -> FleetResult:
    """Serve ``trace`` on ``max(placement) + 1`` replicas (see the module docstring).

    ``placement[i]`` is the replica of request i (`assign`); ``lag`` is in
    verification steps (`lag_ticks`). In fleet mode each finished response
    is learned by the other replicas ``lag`` steps after it finished.
    """
    if len(placement) != len(trace.requests):
        raise ValueError(f"{len(placement)} placements for {len(trace.requests)} requests")
    if lag < 0:
        raise ValueError(f"lag must be >= 0, got {lag}")
    n = max(placement, default=0) + 1
    release_free_memory()
    gc.disable()
    reps = [_Replica("stage-shards", cfg) for _ in range(n)]
    try:
        return _simulate(trace, cfg, placement, reps, fleet, lag)
    finally:
        for m in reps:
            m.close()
        gc.enable()


def _simulate(
    trace: TraceData,
    cfg: ReplayConfig,
    placement: Sequence[int],
    reps: list[_Replica],
    fleet: bool,
    lag: int,
) -> FleetResult:
    n = len(reps)
    queues: list[deque[Request]] = [deque() for _ in range(n)]
    for req in trace.requests:
        queues[placement[req.index]].append(req)
    # per replica: [request, response list, position] of the request it serves
    active: list[tuple[Request, list[int], list[int]] | None] = [None] * n
    # responses not yet visible elsewhere: (visible tick, serving replica, request, prompt tail)
    pending: deque[tuple[int, int, Request, np.ndarray[Any, Any]]] = deque()
    learned = [0] * n  # responses each replica has learned
    finished = 0  # responses finished before the current tick
    finishing = 0  # responses finishing at the end of the current tick
    unseen = 0
    steps = accepted = drafted = tokens = 0
    left = len(trace.requests)
    tick = 0
    t0 = time.perf_counter()
    while left:
        finished += finishing
        finishing = 0
        while pending and pending[0][0] <= tick:
            _, src, req, tail = pending.popleft()
            for r, m in enumerate(reps):
                if r != src:
                    m.learn(req, tail)
                    learned[r] += 1
        for r in range(n):
            cur = active[r]
            m = reps[r]
            if cur is None:
                q = queues[r]
                if not q:
                    continue
                req = q.popleft()
                m.start(req.index, req, req.prompt())
                unseen += finished - learned[r]
                cur = active[r] = (req, req.response.tolist(), [0])
            req, resp, state = cur
            pos = state[0]
            toks, _, _ = m.draft(pos)
            a = accept_linear(toks, resp, pos)
            step = advance(a, len(resp) - pos)
            m.extend(resp[pos : pos + step])
            pos += step
            state[0] = pos
            steps += 1
            accepted += a
            drafted += len(toks)
            if pos == len(resp):
                m.finish()  # the serving replica learns its own response at once
                learned[r] += 1
                finishing += 1
                tokens += pos
                left -= 1
                active[r] = None
                if fleet and n > 1:
                    tail = req.prompt()[-cfg.depth :]
                    pending.append((tick + 1 + lag, r, req, tail))
        tick += 1
    requests = len(trace.requests)
    return FleetResult(
        requests=requests,
        response_tokens=tokens,
        steps=steps,
        accepted=accepted,
        drafted=drafted,
        sim_ticks=tick,
        unseen_at_start=unseen / requests if requests else 0.0,
        wall_s=time.perf_counter() - t0,
    )


# --------------------------------------------------------------------------
# driver

_TRACES: list[TraceData] = []  # the traces of the running `run` (inherited by forked workers)


@dataclass(frozen=True)
class _Job:
    """One distinct simulation: trace, routing placement, mode and lag (in steps)."""

    trace: int
    replicas: int
    routing: str
    fleet: bool
    lag: int


def _run_job(job: _Job, cfg: ReplayConfig) -> FleetResult:
    trace = _TRACES[job.trace]
    return simulate(
        trace, cfg, assign(trace, job.replicas, job.routing), fleet=job.fleet, lag=job.lag
    )


def _job_cost(job: _Job) -> float:
    """A rough relative cost, to start the longest simulations first."""
    c = _TRACES[job.trace].counts()
    base = c["prompt_tokens"] + 8.0 * c["response_tokens"]
    return base + (2.0 * c["response_tokens"] * (job.replicas - 1) if job.fleet else 0.0)


def run(
    paths: Sequence[Path],
    *,
    cfg: ReplayConfig,
    tokenizer: Any,
    replicas: Sequence[int] = (1, 2, 4, 8, 16),
    routings: Sequence[str] = tuple(ROUTINGS),
    lags_ms: Sequence[float] = (50.0,),
    step_ms: float = DEFAULT_STEP_MS,
    max_sessions: Callable[[Path], int | None] = lambda p: None,
    shuffle_seed: int | None = None,
    jobs: int = 1,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Simulate every (trace, replicas, routing, mode, lag); return the JSON-ready results.

    One replica is always simulated (the baseline of the ratios).
    """
    _check_step(step_ms)
    reps = sorted({1, *replicas})
    t_all = time.perf_counter()
    traces: list[TraceData] = []
    for p in paths:
        t = load_trace(p, tokenizer, max_sessions(p))
        if shuffle_seed is not None:
            t = shuffle_sessions(t, shuffle_seed)
        c = t.counts()
        log(
            f"[{t.name}] {c['sessions']} sessions, {c['requests']} requests, "
            f"{c['response_tokens']} response tokens (tokenized in {t.tokenize_s:.1f} s)"
        )
        traces.append(t)
    _TRACES[:] = traces
    try:
        out = _run(traces, cfg, reps, routings, lags_ms, step_ms, jobs, log, t_all)
    finally:
        _TRACES.clear()
    out["shuffle_seed"] = shuffle_seed
    return out


def _run(
    traces: list[TraceData],
    cfg: ReplayConfig,
    reps: list[int],
    routings: Sequence[str],
    lags_ms: Sequence[float],
    step_ms: float,
    jobs: int,
    log: Callable[[str], None],
    t_all: float,
) -> dict[str, Any]:
    # every record -> its distinct job
    rows: list[tuple[dict[str, Any], _Job]] = []
    keys: dict[tuple[Any, ...], _Job] = {}
    for ti, trace in enumerate(traces):
        placements: dict[tuple[int, ...], str] = {}
        for n in reps:
            for routing in routings:
                pl = tuple(assign(trace, n, routing))
                canon = placements.setdefault(pl, routing)  # same placement: same run
                for mode in MODES:
                    for lag_ms in lags_ms if mode == "fleet" else [None]:
                        fleet = mode == "fleet" and n > 1
                        lag = lag_ticks(lag_ms, step_ms) if fleet and lag_ms is not None else 0
                        job = keys.setdefault(
                            (ti, n, pl if n > 1 else (), fleet, lag),
                            _Job(ti, n, canon if n > 1 else routings[0], fleet, lag),
                        )
                        rec = {
                            "trace": trace.name,
                            "replicas": n,
                            "routing": routing,
                            "mode": mode,
                            "lag_ms": lag_ms,
                        }
                        rows.append((rec, job))
    distinct = sorted(set(keys.values()), key=_job_cost, reverse=True)
    log(f"{len(rows)} records, {len(distinct)} distinct simulations, {jobs} job(s)")
    results: dict[_Job, FleetResult] = {}

    def done(job: _Job, res: FleetResult) -> None:
        results[job] = res
        what = "fleet" if job.fleet else "isolated"
        lag = f" lag {job.lag} steps" if job.fleet else ""
        log(
            f"[{traces[job.trace].name}] {job.replicas} x {job.routing} {what}{lag}: "
            f"MAT {fmt(res.mat, 3)}, {res.wall_s:.1f} s"
        )

    if jobs > 1 and len(distinct) > 1 and "fork" in _start_methods():
        # forked workers inherit the tokenized traces (`_TRACES`)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        with ProcessPoolExecutor(
            max_workers=min(jobs, len(distinct)), mp_context=get_context("fork")
        ) as pool:
            futs = {pool.submit(_run_job, j, cfg): j for j in distinct}
            for f in as_completed(futs):
                done(futs[f], f.result())
    else:
        for j in distinct:
            done(j, _run_job(j, cfg))
    base = {ti: results[keys[(ti, 1, (), False, 0)]].mat for ti in range(len(traces))}
    records = []
    for rec, job in rows:
        res = results[job]
        records.append(
            {
                **rec,
                "mat": res.mat,
                "mat_ratio": _ratio(res.mat, base[job.trace]),
                "requests": res.requests,
                "response_tokens": res.response_tokens,
                "steps": res.steps,
                "acceptance_rate": _ratio(res.accepted, res.drafted),
                "drafted_per_step": _ratio(res.drafted, res.steps),
                "unseen_at_start": res.unseen_at_start,
                "sim_s": res.sim_ticks * step_ms / 1e3,
                "wall_s": res.wall_s,
            }
        )
    return {
        "config": asdict(cfg),
        "step_ms": step_ms,
        "replicas": reps,
        "routings": list(routings),
        "lags_ms": list(lags_ms),
        "traces": [
            {
                "name": t.name,
                "path": str(t.path),
                "workload": t.workload,
                "counts": t.counts(),
                "mat_one_replica": base[ti],
            }
            for ti, t in enumerate(traces)
        ],
        "records": records,
        "simulations": len(distinct),
        "jobs": jobs,
        "environment": environment(),
        "wall_s": time.perf_counter() - t_all,
    }


def _check_step(step_ms: float) -> None:
    if not (math.isfinite(step_ms) and step_ms > 0):
        raise ValueError(f"--step-ms must be > 0, got {step_ms}")


def _start_methods() -> list[str]:
    import multiprocessing

    return multiprocessing.get_all_start_methods()


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


# --------------------------------------------------------------------------
# table and plot


def _cell(rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "-"
    return f"{fmt(rec['mat'], 3)} ({fmt(rec['mat_ratio'], 3)})"


def render_table(results: dict[str, Any]) -> str:
    """Per trace: MAT (ratio to one replica) per replica count and routing, one
    column for isolated and one per fleet lag."""
    out: list[str] = []
    lags = results["lags_ms"]
    cols = [("isolated", None)] + [("fleet", lag) for lag in lags]
    head = ["replicas", "routing", "isolated"] + [f"fleet {fmt(lag, 0)} ms" for lag in lags]
    for t in results["traces"]:
        c = t["counts"]
        out.append(
            f"== {t['name']} ({t['workload']}): {c['sessions']:,} sessions, "
            f"{c['requests']:,} requests, {c['response_tokens']:,} response tokens; "
            f"MAT (ratio to 1 replica = {fmt(t['mat_one_replica'], 3)})"
        )
        index = {
            (r["replicas"], r["routing"], r["mode"], r["lag_ms"]): r
            for r in results["records"]
            if r["trace"] == t["name"]
        }
        rows = []
        for n in results["replicas"]:
            for routing in results["routings"] if n > 1 else results["routings"][:1]:
                rows.append(
                    [
                        str(n),
                        routing if n > 1 else "-",
                        *(_cell(index.get((n, routing, mode, lag))) for mode, lag in cols),
                    ]
                )
        out.append(table(head, rows))
        out.append("")
    order = (
        "trace order"
        if results.get("shuffle_seed") is None
        else f"sessions shuffled (seed {results['shuffle_seed']})"
    )
    out.append(
        f"simulated: {results['step_ms']:g} ms per verification step, {order}; "
        f"{results['simulations']} distinct simulations in {results['wall_s']:.1f} s "
        f"({results['jobs']} job(s))"
    )
    return "\n".join(out) + "\n"


def plot_fleet(results: dict[str, Any], out_dir: Path | str) -> tuple[list[Path], str | None]:
    """``<trace>-fleet.png`` per trace: MAT ratio to one replica against replicas,
    one line per (routing, mode, lag)."""
    from agentspec.bench.plots import _NO_MATPLOTLIB, _prepare, _save

    plt, out = _prepare(out_dir)
    if plt is None:
        return [], _NO_MATPLOTLIB
    written: list[Path] = []
    for t in results["traces"]:
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in results["records"]:
            if r["trace"] != t["name"] or r["mat_ratio"] is None:
                continue
            label = f"{r['routing']} {r['mode']}" + (
                f" {fmt(r['lag_ms'], 0)} ms" if r["mode"] == "fleet" else ""
            )
            lines.setdefault(label, []).append((r["replicas"], r["mat_ratio"]))
        fig, ax = plt.subplots(figsize=(6.5, 4.0))
        for label, pts in lines.items():
            pts.sort()
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                "--" if "isolated" in label else "-",
                marker="o",
                markersize=3,
                label=label,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel("MAT / one-replica MAT")
        ax.set_title(f"{t['name']}: fleet-synced vs isolated trees")
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.grid(True, linewidth=0.3)
        ax.legend(fontsize=7)
        written.append(_save(plt, fig, out / f"{t['name']}-fleet.png"))
    return written, None


# --------------------------------------------------------------------------
# command line


def _split(spec: str, what: str) -> list[str]:
    items = [s.strip() for s in spec.split(",")]
    if not spec.strip() or any(not s for s in items):
        raise ValueError(f"{what} must be a comma-separated list, got {spec!r}")
    return items


def parse_replicas(spec: str) -> list[int]:
    """``--replicas``: comma-separated replica counts in [1, 1024]."""
    out = []
    for s in _split(spec, "--replicas"):
        try:
            n = int(s)
        except ValueError:
            raise ValueError(f"--replicas: {s!r} is not an integer") from None
        if not 1 <= n <= MAX_REPLICAS:
            raise ValueError(f"--replicas: {n} is outside [1, {MAX_REPLICAS}]")
        out.append(n)
    return sorted(set(out))


def parse_routings(spec: str) -> list[str]:
    """``--routing``: comma-separated routing names."""
    names = list(dict.fromkeys(_split(spec, "--routing")))
    bad = [n for n in names if n not in ROUTINGS]
    if bad:
        raise ValueError(
            f"--routing: unknown routing {', '.join(bad)}; choose from {', '.join(ROUTINGS)}"
        )
    return names


def parse_lags(spec: str) -> list[float]:
    """``--lag-ms``: comma-separated lags in milliseconds (>= 0)."""
    out = []
    for s in _split(spec, "--lag-ms"):
        try:
            v = float(s)
        except ValueError:
            raise ValueError(f"--lag-ms: {s!r} is not a number") from None
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"--lag-ms: {s} must be finite and >= 0")
        out.append(v)
    return list(dict.fromkeys(out))


def parse_max_sessions(spec: str | None) -> Callable[[Path], int | None]:
    """``--max-sessions``: ``N`` for every trace and/or ``NAME=N`` for the traces whose
    file name is NAME or starts with ``NAME.`` (e.g. ``swe-gemini3pro=60``)."""
    default: int | None = None
    per: dict[str, int] = {}
    if spec is not None:
        for item in _split(spec, "--max-sessions"):
            name, eq, num = item.rpartition("=")
            try:
                n = int(num)
            except ValueError:
                raise ValueError(f"--max-sessions: {item!r} is not N or NAME=N") from None
            if n < 1:
                raise ValueError(f"--max-sessions must be >= 1, got {n}")
            if eq:
                if not name:
                    raise ValueError(f"--max-sessions: {item!r} has no trace name")
                per[name] = n
            else:
                default = n

    def limit(path: Path) -> int | None:
        fname = path.name
        for name, n in per.items():
            if fname == name or fname.startswith(name + "."):
                return n
        return default

    return limit


def _default_jobs() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``bench fleet`` options to ``p``."""
    p.add_argument("traces", nargs="+", type=Path, help="trace files (.jsonl or .jsonl.gz)")
    p.add_argument(
        "--replicas",
        default="1,2,4,8,16",
        help="comma-separated replica counts (default 1,2,4,8,16; 1 always runs)",
    )
    p.add_argument(
        "--routing",
        default=",".join(ROUTINGS),
        help="comma-separated routings: round-robin (over requests), session (affinity); "
        "default both",
    )
    p.add_argument(
        "--lag-ms",
        default="50",
        help="comma-separated fleet sync lags in ms: a finished response reaches the other "
        "replicas this long after it finished (default 50)",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=DEFAULT_STEP_MS,
        help=f"simulated time of one verification step (default {DEFAULT_STEP_MS:g})",
    )
    p.add_argument(
        "--max-sessions",
        default=None,
        help="replay only the first N sessions: N for every trace, NAME=N for one "
        "(e.g. swe-gemini3pro=60), comma-separated",
    )
    p.add_argument(
        "--shuffle-sessions",
        type=int,
        default=None,
        metavar="SEED",
        help="serve the sessions in a seeded random order instead of trace order "
        "(a session's requests keep their order)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=_default_jobs(),
        help="parallel simulations (processes; default: CPUs, at most 8)",
    )
    add_common_arguments(p)


def run_cli(args: argparse.Namespace) -> int:
    """Run ``agentspec bench fleet`` from parsed arguments; return the exit status."""
    replicas = parse_replicas(args.replicas)
    routings = parse_routings(args.routing)
    lags = parse_lags(args.lag_ms)
    limit = parse_max_sessions(args.max_sessions)
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    _check_step(args.step_ms)
    for p in args.traces:
        if not p.is_file():
            raise FileNotFoundError(f"trace file not found: {p}")
    start = cli_start(args, inputs=False)
    cfg, tok, log = start.cfg, start.tokenizer, start.log
    results = run(
        args.traces,
        cfg=cfg,
        tokenizer=tok,
        replicas=replicas,
        routings=routings,
        lags_ms=lags,
        step_ms=args.step_ms,
        max_sessions=limit,
        shuffle_seed=args.shuffle_sessions,
        jobs=args.jobs,
        log=log,
    )
    results["command"] = getattr(args, "argv", None)
    write_outputs(results, render_table(results), args.json, args.plots, plot_fleet, log)
    return 0
