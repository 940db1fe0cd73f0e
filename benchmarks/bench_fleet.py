#!/usr/bin/env python
"""The fleet for real: redis-server, embedded-engine replicas, sync lag, memory.

Everything runs on this machine: a ``redis-server`` (own temporary directory,
loopback port, ``appendonly yes``, ``appendfsync everysec``) and real
processes.  Phases (``--phases a,b,c,d,e``; a to d by default):

a. **Tokens per step.**  ``--replicas`` (3) ``agentspec serve MODEL --engine
   embedded`` processes, once isolated (no ``--redis``: each drafts from what
   it served) and once as a fleet (``--redis URL --fleet-tenants T``).
   ``--agents`` (3) clients run the text-to-SQL pipeline at once
   (``examples/text_to_sql``, Spider questions, ``temperature=0``; agent w
   runs questions w, w + 3, ...) through `AgentSpecClient`; a round-robin
   router in this process sends each call to the next replica, adding a fresh
   ``vllm_xargs.agentspec_request_id`` (the identity a replica publishes the
   response under) and reading the response's ``usage`` and ``agentspec``
   (steps, drafted, accepted) fields.  Printed: completion tokens / steps per
   mode and the ratio fleet / isolated, and whether the two runs produced the
   same tokens (speculation is lossless, so they must).
b. **Kill and restart.**  In the fleet run, after ``--kill-after`` questions,
   one replica is SIGKILLed and restarted (same port, empty: nothing of its own
   survives); at the same time an isolated control replica starts.  The
   restarted replica's first request, sent as soon as its ``/health`` answers,
   replays the longest call another replica answered before; the control gets
   the same request.  PASS: the restarted replica accepted draft tokens, more
   than the control (which drafts from the prompt only), and all three outputs
   are the same tokens.  Then the run goes on with the restarted replica.
c. **Sync lag.**  A `FleetPublisher` in this process publishes sequences at
   ``--rate`` (1,000) per second for ``--seconds`` (3); they are the Spider
   trace's responses (Qwen3 tokens, each after its prompt's last 8 tokens, as
   a replica publishes them) under their stage keys.  ``--subscribers`` (3)
   separate processes run a `FleetSubscriber` each (as a replica does) and
   note the wall-clock time at which their position passed each entry (the
   entry is then applied and visible to drafts).  Per sequence, the lag is the
   latest of those times minus the time ``publish`` was called (one clock, one
   machine).  Printed: the rate achieved, p50/p99/max of that lag, whether
   every subscriber applied every sequence, and whether p99 <= 50 ms.
d. **Memory.**  After that load (or, without c, the same number of sequences
   published as fast as possible): Redis bytes of the tenant's keys (``MEMORY
   USAGE``, stream and snapshots apart, plus the ``used_memory`` delta) per
   cached token, beside a subscriber's own tree bytes per token (one tree, and
   the two a subscriber keeps for lock-free reads) and the replicas' learned
   shard bytes per token (from phase a's fleet run).
e. **Throughput, many tenants** (only when named: ``--phases e``).
   ``--publishers`` (2) processes, one `FleetPublisher` each (pipelined
   batches of ``--publisher-batch``), publish ``--e-rate`` (10,000) sequences
   per second in all for ``--e-seconds`` (5), sequence i to tenant i mod
   ``--tenants`` (100) under stage ``s{(i // tenants) mod --stages}`` (10):
   the Spider responses as in phase c, with synthetic stage labels.
   ``--subscribers`` (3) processes each follow every tenant with one
   `FleetFollower` (one connection, one thread), ``compact_every``
   ``--compact-every`` (100) so rounds happen during the run.  Each notes the
   wall-clock time after every batch it applies or reload it does (hooks on
   the members, no extra thread) and times every compaction round.  Printed:
   the rate offered and acknowledged by Redis, lag p50/p99/max (published ->
   applied on all, one clock, as c), whether every process holds every
   sequence, CPU microseconds per sequence of the publishers, the followers
   and redis-server (and the rate the cores could hold at that cost),
   compaction seconds per round by shards written, Redis bytes per cached
   token (as d), and each follower process's RSS, threads and connections.

Usage::

    python benchmarks/bench_fleet.py [--phases a,b,c,d,e] [--questions 6] [--rate 1000]
        [--seconds 3] [--replicas 3] [--subscribers 3] [--e-rate 10000] [--e-seconds 5]
        [--tenants 100] [--stages 10] [--publishers 2] [--compact-every 100] [--json OUT]
"""

from __future__ import annotations

import argparse
import array
import contextlib
import http.client
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

from agentspec._util.procs import free_port, log_tail, spawn, wait_healthy  # noqa: E402

DEFAULT_TRACE = REPO.parent / "shared" / "data" / "traces" / "spider-sql.dev.jsonl.gz"
LEAD_TOKENS = 8  # prompt tokens before each published output, as the replicas publish
PHASES = ("a", "b", "c", "d", "e")
TARGET_P99_MS = 50.0


def log(msg: str) -> None:
    print(f"[bench_fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100) of a non-empty sequence."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))]


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def parse_sid(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    return int(ms), int(seq)


# --- replicas and the round-robin router --------------------------------------------------------


class Replica:
    """One ``agentspec serve MODEL --engine embedded`` process on a fixed port."""

    def __init__(
        self, args: argparse.Namespace, workdir: Path, name: str, redis_url: str | None, tenant: str
    ) -> None:
        self.args = args
        self.name = name
        self.redis_url = redis_url
        self.tenant = tenant
        self.port = free_port()
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [sys.executable, "-m", "agentspec", "serve", self.args.model]
        argv += ["--engine", "embedded", "--port", str(self.port)]
        if self.args.threads:
            argv += ["--threads", str(self.args.threads)]
        if self.redis_url:
            argv += ["--redis", self.redis_url, "--fleet-tenants", self.tenant]
        env = dict(os.environ)
        env.pop("AGENTSPEC_REDIS_URL", None)  # isolated means isolated
        self.starts += 1
        log_path = self.log_path.with_suffix(f".{self.starts}.log")
        self.proc = spawn(argv, log_path, env=env, cwd=REPO)
        self.current_log = log_path

    def wait_ready(self, timeout: float = 600.0) -> None:
        assert self.proc is not None
        wait_healthy(self.proc, self.url + "/health", timeout, self.current_log)

    def kill(self) -> None:
        """SIGKILL the replica's process group (a crash) and reap it."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()

    def shard_stats(self) -> dict[str, Any]:
        """``GET /v1/agentspec/shards`` (learned shards, fleet counters)."""
        with urllib.request.urlopen(self.url + "/v1/agentspec/shards", timeout=30) as resp:
            data: dict[str, Any] = json.loads(resp.read())
            return data


def post_json(base_url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    host, _, port = base_url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=900)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    try:
        obj = json.loads(data)
    except ValueError:
        obj = {"error": data[:300].decode(errors="replace")}
    return resp.status, obj if isinstance(obj, dict) else {"answer": obj}


def call_stats(obj: dict[str, Any]) -> dict[str, Any]:
    """Completion tokens, steps, drafted, accepted and token ids of an answer."""
    ext = obj.get("agentspec") or {}
    choices = obj.get("choices") or [{}]
    return {
        "completion_tokens": int((obj.get("usage") or {}).get("completion_tokens") or 0),
        "steps": int(ext.get("steps") or 0),
        "drafted": int(ext.get("drafted") or 0),
        "accepted": int(ext.get("accepted") or 0),
        "token_ids": choices[0].get("token_ids"),
    }


class Router:
    """An HTTP round-robin load balancer in front of the replicas, recording every call."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.records: list[dict[str, Any]] = []
        self.sessions: dict[str, int] = {}  # session tag -> question index
        self._next = 0
        self._lock = threading.Lock()
        router = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._forward(b"")

            def do_POST(self) -> None:
                self._forward(self.rfile.read(int(self.headers.get("content-length") or 0)))

            def _forward(self, body: bytes) -> None:
                status, ctype, data = router.forward(self.command, self.path, self.headers, body)
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def forward(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, str, bytes]:
        request: dict[str, Any] | None = None
        if method == "POST" and path.endswith("/chat/completions"):
            request = json.loads(body)
            xargs = request.setdefault("vllm_xargs", {})
            xargs.setdefault("agentspec_request_id", uuid.uuid4().hex)
            body = json.dumps(request).encode()
        with self._lock:
            index = self._next % len(self.replicas)
            self._next += 1
        replica = self.replicas[index]
        keep = {"content-type", "authorization"}
        fwd = {k: v for k, v in headers.items() if k.lower() in keep or k.lower().startswith("x-")}
        conn = http.client.HTTPConnection("127.0.0.1", replica.port, timeout=900)
        try:
            conn.request(method, path, body if method == "POST" else None, fwd)
            resp = conn.getresponse()
            data = resp.read()
            status, ctype = resp.status, resp.getheader("content-type") or "application/json"
        finally:
            conn.close()
        if request is not None:
            try:
                answer = json.loads(data)
            except ValueError:
                answer = {}
            xargs = request["vllm_xargs"]
            session = xargs.get("agentspec_session") or headers.get("x-agentspec-session")
            rec = {
                "question": self.sessions.get(str(session), -1),
                "stage": xargs.get("agentspec_stage") or headers.get("x-agentspec-stage"),
                "replica": index,
                "status": status,
                "request": request,
                **call_stats(answer if isinstance(answer, dict) else {}),
            }
            with self._lock:
                self.records.append(rec)
        return status, ctype, data

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def summarize_calls(records: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == 200]
    tokens = sum(r["completion_tokens"] for r in ok)
    steps = sum(r["steps"] for r in ok)
    stages: dict[str, dict[str, Any]] = {}
    by_stage: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in ok:
        by_stage[str(r["stage"])].append(r)
    for stage, recs in sorted(by_stage.items()):
        t, s = sum(r["completion_tokens"] for r in recs), sum(r["steps"] for r in recs)
        stages[stage] = {
            "calls": len(recs),
            "tokens": t,
            "steps": s,
            "tokens_per_step": ratio(t, s),
        }
    return {
        "calls": len(records),
        "failed": len(records) - len(ok),
        "completion_tokens": tokens,
        "steps": steps,
        "drafted": sum(r["drafted"] for r in ok),
        "accepted": sum(r["accepted"] for r in ok),
        "tokens_per_step": ratio(tokens, steps),
        "accepted_per_step": ratio(sum(r["accepted"] for r in ok), steps),
        "calls_per_replica": dict(sorted(Counter(r["replica"] for r in records).items())),
        "stages": stages,
    }


def _call_keys(records: list[dict[str, Any]]) -> dict[tuple[int, str, int], Any]:
    seen: Counter[tuple[int, str]] = Counter()
    out: dict[tuple[int, str, int], Any] = {}
    for r in records:
        k = (r["question"], str(r["stage"]))
        out[(k[0], k[1], seen[k])] = r["token_ids"]
        seen[k] += 1
    return out


def run_pipeline(
    args: argparse.Namespace,
    mode: str,
    workdir: Path,
    questions: list[Any],
    redis_url: str | None,
    kill: bool,
) -> dict[str, Any]:
    """One run of the pipeline over fresh replicas (``mode``: isolated or fleet)."""
    from agentspec import AgentSpecClient
    from agentspec._store.store import ShardStore
    from examples.text_to_sql import PipelineConfig, Text2SQLPipeline

    tenant = f"bench-{mode}-{uuid.uuid4().hex[:8]}"
    url = redis_url if mode == "fleet" else None
    replicas = [Replica(args, workdir, f"{mode}-{i}", url, tenant) for i in range(args.replicas)]
    out: dict[str, Any] = {"tenant": tenant, "replicas": args.replicas}
    with contextlib.ExitStack() as stack:
        for r in replicas:
            stack.callback(r.stop)
            r.start()
        t0 = time.perf_counter()
        for r in replicas:
            r.wait_ready()
        log(f"{mode}: {len(replicas)} replicas ready in {time.perf_counter() - t0:.1f} s")
        router = Router(replicas)
        stack.callback(router.close)
        client = stack.enter_context(
            AgentSpecClient(
                base_url=router.base_url,
                api_key="EMPTY",
                store=ShardStore(None, redis=False),
                tenant=tenant,
                return_token_ids=True,
                max_retries=0,
                timeout=900,
            )
        )
        config = PipelineConfig(model=args.model, n_sql=args.n_sql)
        # One pipeline per agent; agent w runs questions w, w + C, ... in order, so its
        # few-shot history (and so every prompt) is the same in both modes.
        agents = [stack.enter_context(Text2SQLPipeline(client, config)) for _ in range(args.agents)]
        router.sessions = {q.session: i for i, q in enumerate(questions)}
        cut = args.kill_after if kill else len(questions)
        t0 = time.perf_counter()
        for lo, hi in ((0, cut), (cut, len(questions))):
            run_round(agents, questions, lo, hi, mode)
            if kill and hi == cut:
                out["kill_restart"] = kill_restart(args, workdir, replicas, router.records, tenant)
        out["wall_s"] = time.perf_counter() - t0
        out["records"] = router.records
        out["summary"] = summarize_calls(router.records)
        out["replica_stats"] = [r.shard_stats() for r in replicas]
    return out


def run_round(agents: list[Any], questions: list[Any], lo: int, hi: int, mode: str) -> None:
    """Questions ``lo..hi-1``, agent ``i % len(agents)`` running question ``i``, agents at once."""
    errors: list[BaseException] = []

    def agent(w: int) -> None:
        try:
            for i in range(lo, hi):
                if i % len(agents) == w:
                    tq = time.perf_counter()
                    agents[w].run(questions[i])
                    took = time.perf_counter() - tq
                    log(f"{mode}: question {i + 1}/{len(questions)} in {took:.1f} s")
        except BaseException as exc:  # reported below, on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(w,)) for w in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def kill_restart(
    args: argparse.Namespace,
    workdir: Path,
    replicas: list[Replica],
    records: list[dict[str, Any]],
    tenant: str,
) -> dict[str, Any]:
    """Phase b: SIGKILL one fleet replica, restart it, replay a call another replica answered."""
    victim_index = args.kill_replica % len(replicas)
    victim = replicas[victim_index]
    learned = [
        r for r in records if r["status"] == 200 and r["replica"] != victim_index and r["token_ids"]
    ]
    if not learned:
        raise RuntimeError("phase b: no call answered by another replica to replay")
    probe = max(learned, key=lambda r: r["completion_tokens"])
    body = json.loads(json.dumps(probe["request"]))
    body["vllm_xargs"]["agentspec_request_id"] = uuid.uuid4().hex
    control = Replica(args, workdir, "control", None, tenant)
    t0 = time.perf_counter()
    victim.kill()
    log(f"phase b: replica {victim_index} SIGKILLed; restarting it and an isolated control")
    victim.start()
    control.start()
    try:
        victim.wait_ready()
        ready_s = time.perf_counter() - t0
        status, answer = post_json(victim.url, "/v1/chat/completions", body)
        restarted = {"status": status, **call_stats(answer)}
        after = victim.shard_stats()
        control.wait_ready()
        status, answer = post_json(control.url, "/v1/chat/completions", body)
        ctrl = {"status": status, **call_stats(answer)}
    finally:
        control.stop()
    sub = (after.get("fleet") or {}).get("subscribers", {}).get(tenant, {})
    same = restarted["token_ids"] == ctrl["token_ids"] == probe["token_ids"]
    for d in (restarted, ctrl):
        d["tokens_per_step"] = ratio(d["completion_tokens"], d["steps"])
        d["token_ids"] = None
    passed = bool(
        restarted["status"] == 200
        and restarted["accepted"] > 0
        and restarted["accepted"] > ctrl["accepted"]
        and same
    )
    return {
        "killed_replica": victim_index,
        "after_question": args.kill_after,
        "restart_to_ready_s": ready_s,
        "probe": {
            "question": probe["question"],
            "stage": probe["stage"],
            "answered_by_replica": probe["replica"],
            "completion_tokens": probe["completion_tokens"],
        },
        "restarted_first_request": restarted,
        "control_empty_isolated": ctrl,
        "restarted_fleet_after_first_request": {
            "sequences": sub.get("sequences"),
            "tokens": sub.get("tokens"),
            "loads": sub.get("loads"),
        },
        "same_tokens": same,
        "pass": passed,
    }


def phase_ab(
    args: argparse.Namespace, phases: set[str], redis_url: str, workdir: Path
) -> dict[str, Any]:
    from examples.text_to_sql import load_questions

    questions = load_questions(args.data, limit=args.questions)
    out: dict[str, Any] = {"questions": len(questions), "n_sql": args.n_sql, "model": args.model}
    modes = ["isolated", "fleet"] if "a" in phases else ["fleet"]
    for mode in modes:
        out[mode] = run_pipeline(
            args, mode, workdir, questions, redis_url, kill=mode == "fleet" and "b" in phases
        )
    if "isolated" in out:
        iso, fl = out["isolated"]["summary"], out["fleet"]["summary"]
        out["ratio_tokens_per_step"] = ratio(fl["tokens_per_step"], iso["tokens_per_step"])
        a = _call_keys(out["isolated"]["records"])
        b = _call_keys(out["fleet"]["records"])
        out["same_calls"] = len(a.keys() & b.keys())
        out["identical_outputs"] = sum(1 for k in a.keys() & b.keys() if a[k] == b[k])
    out["replica_memory"] = replica_memory(out["fleet"])
    for mode in modes:
        for rec in out[mode]["records"]:
            del rec["request"]
            rec["token_ids"] = None if rec["token_ids"] is None else len(rec["token_ids"])
    return out


def replica_memory(run: dict[str, Any]) -> dict[str, Any]:
    """Learned-shard bytes and tokens of each fleet replica (its own, not the fleet's)."""
    per: list[dict[str, Any]] = []
    for stats in run["replica_stats"]:
        tenant = (stats.get("learned") or {}).get("tenants", {}).get(run["tenant"], {})
        fleet = (stats.get("fleet") or {}).get("subscribers", {}).get(run["tenant"], {})
        per.append(
            {
                "learned_bytes": tenant.get("bytes"),
                "learned_tokens": tenant.get("tokens"),
                "fleet_sequences": fleet.get("sequences"),
                "fleet_tokens": fleet.get("tokens"),
            }
        )
    b = sum(p["learned_bytes"] or 0 for p in per)
    t = sum(p["learned_tokens"] or 0 for p in per)
    return {"replicas": per, "learned_bytes_per_token": ratio(b, t)}


# --- phases c and d: publisher, subscriber processes --------------------------------------------


def subscriber_child(url: str, tenant: str) -> int:
    """A subscriber process: notes when its position passes each entry; reports on END."""
    from agentspec._fleet.sub import FleetSubscriber

    def rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    sub = FleetSubscriber(url, tenant)
    ready = sub.wait_until(lambda: sub.stats().connected and sub.stats().loads >= 1, 60)
    rss_ready = rss()
    times: list[float] = []
    positions: list[str] = []
    last = ["0-0"]
    stop = threading.Event()

    def seen() -> bool:
        # Evaluated under the subscriber's lock at each of its notifications: the
        # position moves right after a batch is applied and its trees are swapped.
        pos = sub.stats().position
        if pos != last[0]:
            times.append(time.time())
            positions.append(pos)
            last[0] = pos
        return stop.is_set()

    def watch() -> None:
        while not stop.is_set():
            sub.wait_until(seen, 0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    print(json.dumps({"ready": ready}), flush=True)
    command = json.loads(sys.stdin.readline() or "{}")
    reached = bool(command) and sub.wait_for(command["last_id"], command["timeout"])
    stop.set()
    watcher.join(5)
    st = sub.stats()
    shards = []
    for key, shard in st.shards.items():
        tree = sub.tree(key)
        tstats = tree.stats() if tree is not None else None
        shards.append(
            {
                "key": list(key),
                "sequences": shard.sequences,
                "tokens": shard.tokens,
                "tree_bytes": None if tstats is None else tstats.bytes,
                "tree_tokens": None if tstats is None else tstats.tokens,
                "nodes": None if tstats is None else tstats.nodes,
            }
        )
    report = {
        "reached": reached,
        "times": times,
        "positions": positions,
        "position": st.position,
        "applied": st.applied,
        "duplicates": st.duplicates,
        "malformed": st.malformed,
        "loads": st.loads,
        "compactions": st.compactions,
        "reconnects": st.reconnects,
        "last_error": st.last_error,
        "shards": shards,
        "rss_ready": rss_ready,
        "rss_end": rss(),
    }
    sub.close()
    print(json.dumps(report), flush=True)
    return 0


def trace_sequences(args: argparse.Namespace, tenant: str) -> list[tuple[Any, list[int]]]:
    """(key, lead + response tokens) of every Spider trace response, in file order."""
    from benchmarks._traces import load_tokenizer, load_traces

    ts = load_traces(args.data, load_tokenizer(args.tokenizer))
    out: list[tuple[Any, list[int]]] = []
    for req in ts.requests():
        lead = req.prompt[-LEAD_TOKENS:].tolist()
        out.append(((tenant, "spider", req.stage), [*lead, *req.response.tolist()]))
    return out


@contextlib.contextmanager
def subscriber_procs(url: str, tenant: str, n: int, workdir: Path) -> Iterator[list[Any]]:
    procs: list[subprocess.Popen[str]] = []
    logs: list[TextIO] = []
    try:
        for i in range(n):
            err = open(workdir / f"subscriber-{i}.log", "w")  # noqa: SIM115 (closed below)
            logs.append(err)
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--subscriber-child", url, tenant],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    cwd=REPO,
                )
            )
        for i, p in enumerate(procs):
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line or not json.loads(line).get("ready"):
                raise RuntimeError(
                    f"subscriber {i} did not start:\n{log_tail(workdir / f'subscriber-{i}.log')}"
                )
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        for f in logs:
            f.close()


def run_load(
    args: argparse.Namespace, redis_url: str, workdir: Path, rate: float, n: int
) -> dict[str, Any]:
    """Publish ``n`` trace sequences at ``rate``/s (0: at once) to subscriber processes."""
    import array

    import redis

    from agentspec._fleet.entry import FleetEntry
    from agentspec._fleet.names import FleetKeys
    from agentspec._fleet.pub import FleetPublisher, Published, PublishStatus

    tenant = f"bench-lag-{uuid.uuid4().hex[:8]}"
    seqs = trace_sequences(args, tenant)
    identities = [f"lag-{i}" for i in range(n)]
    plan = [(seqs[i % len(seqs)][0], seqs[i % len(seqs)][1], identities[i]) for i in range(n)]
    seq_ids = [FleetEntry.make(k, ident, array.array("i", t)).seq_id for k, t, ident in plan]
    index = {sid: i for i, sid in enumerate(seq_ids)}
    admin = redis.Redis.from_url(redis_url)
    used_before = int(admin.info("memory")["used_memory"])
    acked: list[tuple[str, float] | None] = [None] * n

    def on_published(p: Published) -> None:
        i = index.get(p.entry.seq_id)
        if i is not None and acked[i] is None:
            acked[i] = (p.stream_id, time.time())

    t_pub = [0.0] * n
    refused = 0
    with subscriber_procs(redis_url, tenant, args.subscribers, workdir) as procs:
        pub = FleetPublisher(redis_url, on_published=on_published, max_pending=max(10_000, n))
        try:
            log(f"load: {n} sequences at {'max' if not rate else f'{rate:g}/s'}, tenant {tenant}")
            start = time.perf_counter()
            for i, (key, tokens, ident) in enumerate(plan):
                if rate:
                    delay = start + i / rate - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)  # pacing the publisher, not synchronisation
                t_pub[i] = time.time()
                if pub.publish(key, tokens, ident) is not PublishStatus.QUEUED:
                    refused += 1
            flushed = pub.flush(120)
            pub_stats = pub.stats()
        finally:
            pub.close(5)
        last_id = max((a[0] for a in acked if a is not None), key=parse_sid, default="0-0")
        reports = []
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps({"last_id": last_id, "timeout": 120}) + "\n")
            p.stdin.flush()
        for i, p in enumerate(procs):
            out, _ = p.communicate(timeout=300)
            try:
                reports.append(json.loads(out.strip().splitlines()[-1]))
            except (ValueError, IndexError):
                raise RuntimeError(
                    f"subscriber {i} gave no report:\n{log_tail(workdir / f'subscriber-{i}.log')}"
                ) from None
    used_after = int(admin.info("memory")["used_memory"])
    memory = redis_memory(admin, FleetKeys.of(tenant).prefix)
    admin.close()

    # Per sequence and subscriber: the first noted time its position was at or past the entry.
    applied_at: list[list[float | None]] = []
    for rep in reports:
        pos = [parse_sid(p) for p in rep["positions"]]
        times = rep["times"]
        row: list[float | None] = []
        for a in acked:
            if a is None:
                row.append(None)
                continue
            j = bisect_left(pos, parse_sid(a[0]))
            row.append(times[j] if j < len(pos) else None)
        applied_at.append(row)
    lags, lags_redis, acks = [], [], []
    per_sub: list[list[float]] = [[] for _ in reports]
    by_second: dict[int, list[float]] = defaultdict(list)
    missing = 0
    for i, a in enumerate(acked):
        col = [row[i] for row in applied_at]
        if a is None or any(t is None for t in col):
            missing += 1
            continue
        done = [t for t in col if t is not None]
        lags.append((max(done) - t_pub[i]) * 1000)
        by_second[int(t_pub[i] - t_pub[0])].append(lags[-1])
        lags_redis.append((max(done) - parse_sid(a[0])[0] / 1000) * 1000)
        acks.append((a[1] - t_pub[i]) * 1000)
        for s, t in enumerate(done):
            per_sub[s].append((t - t_pub[i]) * 1000)
    span = t_pub[-1] - t_pub[0] if n > 1 else 0.0
    cached_tokens = sum(s["tokens"] for s in reports[0]["shards"]) if reports else 0
    tree_bytes = sum(s["tree_bytes"] or 0 for s in reports[0]["shards"]) if reports else 0
    # Every subscriber reached the last entry and holds every sequence (applied from the
    # stream, or from a snapshot after a reload when it fell behind a trim).
    all_applied = all(
        r["reached"] and sum(s["sequences"] for s in r["shards"]) == n and r["malformed"] == 0
        for r in reports
    )

    def dist(v: list[float]) -> dict[str, float | None]:
        if not v:
            return {"p50": None, "p99": None, "max": None, "mean": None}
        return {"p50": pct(v, 50), "p99": pct(v, 99), "max": max(v), "mean": sum(v) / len(v)}

    lag = dist(lags)
    return {
        "tenant": tenant,
        "sequences": n,
        "target_rate": rate or None,
        "achieved_rate": (n - 1) / span if span > 0 else None,
        "publish_seconds": span,
        "refused": refused,
        "flushed": flushed,
        "publisher": {"published": pub_stats.published, "failures": pub_stats.failures},
        "subscribers": len(reports),
        "all_applied": all_applied and missing == 0,
        "missing": missing,
        "lag_ms": lag,
        "lag_from_xadd_ms": dist(lags_redis),
        "ack_ms": dist(acks),
        "per_subscriber_lag_ms": [dist(v) for v in per_sub],
        "lag_ms_per_second": [
            {"second": k, "sequences": len(v), **dist(v)} for k, v in sorted(by_second.items())
        ],
        "target_p99_ms": TARGET_P99_MS,
        "p99_ok": lag["p99"] is not None and lag["p99"] <= TARGET_P99_MS,
        "subscriber_stats": [
            {k: r[k] for k in ("applied", "duplicates", "malformed", "loads", "compactions")}
            | {"reconnects": r["reconnects"], "rss_ready": r["rss_ready"], "rss_end": r["rss_end"]}
            for r in reports
        ],
        "memory": {
            **memory,
            "cached_tokens": cached_tokens,
            "cached_sequences": sum(s["sequences"] for s in reports[0]["shards"]) if reports else 0,
            "redis_used_memory_delta": used_after - used_before,
            "redis_bytes_per_token": ratio(memory["tenant_bytes"], cached_tokens),
            "redis_used_delta_per_token": ratio(used_after - used_before, cached_tokens),
            "subscriber_tree_bytes": tree_bytes,
            "subscriber_tree_bytes_per_token": ratio(tree_bytes, cached_tokens),
            "subscriber_both_trees_bytes_per_token": ratio(2 * tree_bytes, cached_tokens),
            "subscriber_rss_delta_per_token": ratio(
                sum(r["rss_end"] - r["rss_ready"] for r in reports) / max(1, len(reports)),
                cached_tokens,
            ),
        },
    }


def redis_memory(client: Any, prefix: str) -> dict[str, Any]:
    """``MEMORY USAGE`` (all samples) of the tenant's keys: stream, snapshots, the rest."""
    parts = {"stream": 0, "snapshots": 0, "other": 0}
    keys = 0
    log_key = prefix + "log"
    for raw in client.scan_iter(match=prefix + "*", count=1000):
        key = raw.decode()
        used = int(client.memory_usage(raw, samples=0) or 0)
        keys += 1
        part = (
            "stream"
            if key == log_key
            else "snapshots"
            if key.startswith(prefix + "snap:")
            else "other"
        )
        parts[part] += used
    return {
        "tenant_keys": keys,
        "tenant_bytes": sum(parts.values()),
        **{f"{k}_bytes": v for k, v in parts.items()},
        "stream_entries": int(client.xlen(log_key)),
    }


# --- phase e: throughput, many tenants on one FleetFollower per subscriber process ----------


def _proc_status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _pid_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _connections_to(port: int) -> int:
    """Established TCP connections of this process to ``port`` (its sockets in /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    n = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if int(f[2].rsplit(":", 1)[1], 16) == port and f[3] == "01" and f[9] in inodes:
                    n += 1
    return n


def _process_view(port: int) -> dict[str, Any]:
    return {
        "rss": _proc_status("VmRSS") * 1024,
        "threads": _proc_status("Threads"),
        "python_threads": threading.active_count(),
        "redis_connections": _connections_to(port),
        "cpu_s": _cpu_s(),
    }


def follower_child(spec_json: str) -> int:
    """A subscriber process of phase e: one `FleetFollower` over every tenant.

    Notes the wall-clock time after each applied batch (hooked in the member's
    apply step: no extra thread) and times each compaction round; reports on END.
    """
    import agentspec._fleet.sub as sub_mod
    from agentspec._fleet.ids import format_id
    from agentspec.fleet import FleetFollower

    spec = json.loads(spec_json)
    tenants: list[str] = spec["tenants"]
    port = int(spec["port"])
    rounds: list[dict[str, Any]] = []
    plain_compact = sub_mod.__dict__["compact"]  # the name FleetSubscriber._compact calls

    def timed_compact(client: Any, keys: Any, shards: Any, position: Any, **kw: Any) -> Any:
        shards = list(shards)
        dirty = sum(1 for s in shards if s.dirty)
        t0 = time.perf_counter()
        result = plain_compact(client, keys, shards, position, **kw)
        took = time.perf_counter() - t0
        rounds.append(
            {
                "seconds": took,
                "shards": len(shards),
                "changed": dirty,
                "lease": result is not None,
                "written": None if result is None else result.written,
                "bumped": None if result is None else result.bumped,
                "removed": None if result is None else result.removed,
            }
        )
        return result

    setattr(sub_mod, "compact", timed_compact)  # noqa: B010 (the bench's stopwatch)
    follower = FleetFollower(
        spec["url"],
        tenants,
        compact_every=int(spec["compact_every"]),
        linger_ms=float(spec["linger_ms"]),
        start=False,
    )
    marks: dict[str, tuple[list[float], list[str]]] = {}
    counts = {"reads": 0, "wakeups": 0, "woken": 0}  # bounded reads; XREAD waits, members woken
    plain_wait = follower._wait

    def waited(client: Any, cluster: bool) -> set[str]:
        woken = plain_wait(client, cluster)
        counts["wakeups"] += 1
        counts["woken"] += len(woken)
        return woken

    setattr(follower, "_wait", waited)  # noqa: B010
    for t in tenants:
        member = follower.subscriber(t)
        marks[t] = ([], [])

        def applied(entries: list[list[Any]], _m: Any = member, _run: Any = member._apply) -> None:
            _run(entries)  # applied, trees swapped, position moved
            counts["reads"] += 1
            if entries:
                times, positions = marks[_m.tenant]
                times.append(time.time())
                positions.append(entries[-1][0].decode())

        def loaded(client: Any, _m: Any = member, _run: Any = member._load) -> None:
            _run(client)  # after a trim passed it: every entry up to the position is held
            times, positions = marks[_m.tenant]
            times.append(time.time())
            positions.append(format_id(_m._position))

        setattr(member, "_apply", applied)  # noqa: B010 (instance hooks: the bench's clock)
        setattr(member, "_load", loaded)  # noqa: B010
    follower.start()

    def started(member: Any) -> Callable[[], bool]:
        def check() -> bool:
            st = member.stats()
            return bool(st.connected and st.loads >= 1)

        return check

    members = [follower.subscriber(t) for t in tenants]
    ready = all(m.wait_until(started(m), 60) for m in members)
    at_ready = _process_view(port)
    print(json.dumps({"ready": ready, **at_ready}), flush=True)
    command = json.loads(sys.stdin.readline() or "{}")
    deadline = time.monotonic() + float(command.get("timeout", 0))
    reached = bool(command)
    for t, last_id in (command.get("last_ids") or {}).items():
        left = max(0.0, deadline - time.monotonic())
        reached = follower.subscriber(t).wait_for(last_id, left) and reached
    at_end = _process_view(port)
    per_tenant = {}
    for t in tenants:
        st = follower.subscriber(t).stats()
        per_tenant[t] = {
            "sequences": sum(s.sequences for s in st.shards.values()),
            "tokens": sum(s.tokens for s in st.shards.values()),
            "shards": len(st.shards),
            "bytes": st.bytes,
            "applied": st.applied,
            "duplicates": st.duplicates,
            "malformed": st.malformed,
            "loads": st.loads,
            "compactions": st.compactions,
            "reconnects": st.reconnects,
            "evicted_shards": st.evicted_shards,
            "last_error": st.last_error,
            "times": marks[t][0],
            "positions": marks[t][1],
        }
    follower.close()
    report = {"reached": reached, "ready": at_ready, "end": at_end, "tenants": per_tenant}
    report["rounds"] = rounds
    report["counts"] = counts
    print(json.dumps(report), flush=True)
    return 0


def publisher_child(spec_json: str) -> int:
    """A publisher process of phase e: every ``count``-th sequence from ``index``, paced."""
    from agentspec._fleet.entry import FleetEntry
    from agentspec._fleet.pub import FleetPublisher, Published, PublishStatus

    spec = json.loads(spec_json)
    plan = json.loads(Path(spec["plan"]).read_text())
    tenants, stages, seqs = plan["tenants"], plan["stages"], plan["seqs"]
    j, count, n = int(spec["index"]), int(spec["count"]), int(spec["n"])
    rate = float(spec["rate"]) / count  # this process's share
    mine = list(range(j, n, count))
    work = []
    for i in mine:
        key = (tenants[i % len(tenants)], "bench", f"s{(i // len(tenants)) % stages}")
        tokens = array.array("i", seqs[i % len(seqs)])
        ident = f"e-{i}"
        work.append((key, tokens, ident, FleetEntry.make(key, ident, tokens).seq_id))
    slot = {w[3]: k for k, w in enumerate(work)}
    acked: list[tuple[str, float] | None] = [None] * len(work)

    def on_published(p: Published) -> None:
        k = slot.get(p.entry.seq_id)
        if k is not None and acked[k] is None:
            acked[k] = (p.stream_id, time.time())

    pub = FleetPublisher(
        spec["url"],
        on_published=on_published,
        max_pending=max(10_000, len(work)),
        batch=int(spec["batch"]),
    )
    print(json.dumps({"ready": True}), flush=True)
    start = float(json.loads(sys.stdin.readline())["start"])
    t_pub = [0.0] * len(work)
    refused = 0
    cpu0 = _cpu_s()
    for k, (key, tokens, ident, _sid) in enumerate(work):
        delay = start + k / rate - time.time()
        if delay > 0:
            time.sleep(delay)  # pacing the publisher, not synchronisation
        t_pub[k] = time.time()
        if pub.publish(key, tokens, ident) is not PublishStatus.QUEUED:
            refused += 1
    t_end = time.time()
    flushed = pub.flush(120)
    t_flushed = time.time()
    cpu = _cpu_s() - cpu0
    st = pub.stats()
    pub.close(5)
    print(
        json.dumps(
            {
                "indices": mine,
                "t_pub": t_pub,
                "acked": acked,
                "refused": refused,
                "flushed": flushed,
                "published": st.published,
                "failures": st.failures,
                "cpu_s": cpu,
                "publish_end": t_end,
                "flushed_at": t_flushed,
            }
        ),
        flush=True,
    )
    return 0


def _child(argv: list[str], workdir: Path, name: str) -> subprocess.Popen[str]:
    err = open(workdir / f"{name}.log", "w")  # noqa: SIM115 (the child owns it; closed on exit)
    try:
        return subprocess.Popen(
            [sys.executable, __file__, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=REPO,
        )
    finally:
        err.close()


def _first_line(p: subprocess.Popen[str], workdir: Path, name: str) -> dict[str, Any]:
    assert p.stdout is not None
    line = p.stdout.readline()
    try:
        obj: dict[str, Any] = json.loads(line)
    except ValueError:
        obj = {}
    if not obj.get("ready"):
        raise RuntimeError(f"{name} did not start:\n{log_tail(workdir / f'{name}.log')}")
    return obj


def _last_line(
    p: subprocess.Popen[str], message: dict[str, Any] | None, workdir: Path, name: str
) -> dict[str, Any]:
    out, _ = p.communicate(None if message is None else json.dumps(message) + "\n", timeout=600)
    try:
        obj: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"{name} gave no report:\n{log_tail(workdir / f'{name}.log')}") from None
    return obj


def run_throughput(args: argparse.Namespace, server: Any, workdir: Path) -> dict[str, Any]:
    """Phase e: ``--e-rate`` sequences/s over tenants x stages to follower processes."""
    import redis

    from agentspec._fleet.names import FleetKeys

    run = uuid.uuid4().hex[:6]
    tenants = [f"bench-tp-{run}-{t:03d}" for t in range(args.tenants)]
    n = max(1, round(args.e_rate * args.e_seconds))
    seqs = [tokens for _key, tokens in trace_sequences(args, tenants[0])]
    plan_path = workdir / "plan.json"
    plan_path.write_text(json.dumps({"tenants": tenants, "stages": args.stages, "seqs": seqs}))
    admin = redis.Redis.from_url(server.url)
    used_before = int(admin.info("memory")["used_memory"])
    port = server.port
    sub_spec = {"url": server.url, "tenants": tenants, "port": port}
    sub_spec["compact_every"] = args.compact_every
    sub_spec["linger_ms"] = args.linger_ms
    procs: list[subprocess.Popen[str]] = []
    try:
        subs = []
        for s in range(args.subscribers):
            procs.append(
                _child(["--follower-child", json.dumps(sub_spec)], workdir, f"follower-{s}")
            )
            subs.append(procs[-1])
        ready = [_first_line(p, workdir, f"follower-{s}") for s, p in enumerate(subs)]
        clients_ready = len(admin.client_list())
        pubs = []
        for j in range(args.publishers):
            spec = {"url": server.url, "plan": str(plan_path), "index": j}
            spec |= {"count": args.publishers, "n": n, "rate": args.e_rate}
            spec["batch"] = args.publisher_batch
            procs.append(_child(["--publisher-child", json.dumps(spec)], workdir, f"publisher-{j}"))
            pubs.append(procs[-1])
        for j, p in enumerate(pubs):
            _first_line(p, workdir, f"publisher-{j}")
        log(
            f"e: {n:,} sequences at {args.e_rate:g}/s over {len(tenants)} tenants x "
            f"{args.stages} stages; {len(pubs)} publishers, {len(subs)} follower processes"
        )
        redis_cpu0 = _pid_cpu_s(server.proc.pid)
        start = time.time() + 0.5
        for p in pubs:
            assert p.stdin is not None
            p.stdin.write(json.dumps({"start": start}) + "\n")
            p.stdin.flush()
        pub_reports = [_last_line(p, None, workdir, f"publisher-{j}") for j, p in enumerate(pubs)]
        redis_cpu_publishing = _pid_cpu_s(server.proc.pid) - redis_cpu0
        t_pub = [0.0] * n
        acked: list[tuple[str, float] | None] = [None] * n
        for rep in pub_reports:
            for i, tp, a in zip(rep["indices"], rep["t_pub"], rep["acked"], strict=True):
                t_pub[i] = tp
                acked[i] = None if a is None else (a[0], a[1])
        last_ids: dict[str, str] = {}
        for i, a in enumerate(acked):
            if a is not None:
                t = tenants[i % len(tenants)]
                if t not in last_ids or parse_sid(a[0]) > parse_sid(last_ids[t]):
                    last_ids[t] = a[0]
        command = {"last_ids": last_ids, "timeout": 120}
        sub_reports = [_last_line(p, command, workdir, f"follower-{s}") for s, p in enumerate(subs)]
        redis_cpu = _pid_cpu_s(server.proc.pid) - redis_cpu0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    used_after = int(admin.info("memory")["used_memory"])
    memory_parts: Counter[str] = Counter()
    for t in tenants:
        memory_parts.update(redis_memory(admin, FleetKeys.of(t).prefix))
    admin.close()

    # Per sequence and subscriber: the first noted time the tenant's position was at or past it.
    applied_at: list[list[float | None]] = []
    for rep in sub_reports:
        marks = {}
        for t, d in rep["tenants"].items():
            reached: list[tuple[int, int]] = []  # running maximum: a reload may go back
            for p in d["positions"]:
                reached.append(max(parse_sid(p), reached[-1]) if reached else parse_sid(p))
            marks[t] = (reached, d["times"])
        row: list[float | None] = []
        for i, a in enumerate(acked):
            if a is None:
                row.append(None)
                continue
            pos, times = marks[tenants[i % len(tenants)]]
            k = bisect_left(pos, parse_sid(a[0]))
            row.append(times[k] if k < len(pos) else None)
        applied_at.append(row)
    lags: list[float] = []
    acks: list[float] = []
    by_second: dict[int, list[float]] = defaultdict(list)
    missing = 0
    t0 = min(t_pub)
    for i, a in enumerate(acked):
        col = [row[i] for row in applied_at]
        if a is None or any(t is None for t in col):
            missing += 1
            continue
        done = [t for t in col if t is not None]
        lags.append((max(done) - t_pub[i]) * 1000)
        acks.append((a[1] - t_pub[i]) * 1000)
        by_second[int(t_pub[i] - t0)].append(lags[-1])
    span = max(t_pub) - t0 if n > 1 else 0.0
    window = max(r["flushed_at"] for r in pub_reports) - t0

    def dist(v: list[float]) -> dict[str, float | None]:
        if not v:
            return {"p50": None, "p99": None, "max": None, "mean": None}
        return {"p50": pct(v, 50), "p99": pct(v, 99), "max": max(v), "mean": sum(v) / len(v)}

    per_tenant_published = Counter(tenants[i % len(tenants)] for i, a in enumerate(acked) if a)
    all_applied = missing == 0 and all(
        rep["reached"]
        and all(
            d["sequences"] == per_tenant_published[t] and d["malformed"] == 0
            for t, d in rep["tenants"].items()
        )
        for rep in sub_reports
    )
    rounds = [r for rep in sub_reports for r in rep["rounds"]]
    held = [r for r in rounds if r["lease"]]
    by_written: dict[int, list[float]] = defaultdict(list)
    for r in held:
        by_written[int(r["written"])].append(r["seconds"])
    cached_tokens = sum(d["tokens"] for d in sub_reports[0]["tenants"].values())
    tenant_bytes = memory_parts["tenant_bytes"]
    lag = dist(lags)
    subscriber_cpu = [rep["end"]["cpu_s"] - rep["ready"]["cpu_s"] for rep in sub_reports]
    # CPU per sequence of each role, over everything it did for the n sequences (idle
    # waits cost none): what bounds the rate this machine can hold.
    us_per_seq = {
        "publishers": sum(r["cpu_s"] for r in pub_reports) / n * 1e6,
        "followers": sum(subscriber_cpu) / n * 1e6,
        "per_follower": sum(subscriber_cpu) / max(1, len(subscriber_cpu)) / n * 1e6,
        "redis": redis_cpu / n * 1e6,
    }
    return {
        "tenants": len(tenants),
        "stages": args.stages,
        "shards": len(tenants) * args.stages,
        "tokens": "Spider responses (Qwen3, after 8 prompt tokens); stage labels s0.. synthetic",
        "sequences": n,
        "target_rate": args.e_rate,
        "offered_rate": (n - 1) / span if span > 0 else None,
        "achieved_rate": ratio(len(acks), max((a[1] for a in acked if a), default=t0) - t0),
        "publish_seconds": span,
        "publishers": len(pub_reports),
        "publisher_batch": args.publisher_batch,
        "refused": sum(r["refused"] for r in pub_reports),
        "flushed": all(r["flushed"] for r in pub_reports),
        "published": sum(r["published"] for r in pub_reports),
        "publisher_failures": sum(r["failures"] for r in pub_reports),
        "subscribers": len(sub_reports),
        "compact_every": args.compact_every,
        "linger_ms": args.linger_ms,
        "all_applied": all_applied,
        "missing": missing,
        "lag_ms": lag,
        "ack_ms": dist(acks),
        "lag_ms_per_second": [
            {"second": k, "sequences": len(v), **dist(v)} for k, v in sorted(by_second.items())
        ],
        "target_p99_ms": TARGET_P99_MS,
        "p99_ok": lag["p99"] is not None and lag["p99"] <= TARGET_P99_MS,
        "cpu": {
            "window_s": window,
            "cores": os.cpu_count(),
            "publishers_s": [r["cpu_s"] for r in pub_reports],
            "subscribers_s": subscriber_cpu,
            "redis_s_publishing": redis_cpu_publishing,
            "redis_s": redis_cpu,
            "us_per_sequence": us_per_seq,
            "capacity_seq_per_s": ratio(
                (os.cpu_count() or 1) * 1e6,
                us_per_seq["publishers"] + us_per_seq["followers"] + us_per_seq["redis"],
            ),
        },
        "compaction": {
            "rounds": len(held),
            "lease_busy": len(rounds) - len(held),
            "median_s": statistics.median([r["seconds"] for r in held]) if held else None,
            "p90_s": pct([r["seconds"] for r in held], 90) if held else None,
            "median_written": statistics.median([r["written"] for r in held]) if held else None,
            "median_changed": statistics.median([r["changed"] for r in held]) if held else None,
            "by_written": [
                {"written": w, "rounds": len(v), "median_s": statistics.median(v)}
                for w, v in sorted(by_written.items())
            ],
        },
        "per_subscriber": [
            {
                "reached": rep["reached"],
                "ready": rep["ready"],
                "end": {k: v for k, v in rep["end"].items() if k != "cpu_s"},
                "cpu_s": cpu,
                "tree_bytes": sum(d["bytes"] for d in rep["tenants"].values()),
                "sequences": sum(d["sequences"] for d in rep["tenants"].values()),
                "applied": sum(d["applied"] for d in rep["tenants"].values()),
                "duplicates": sum(d["duplicates"] for d in rep["tenants"].values()),
                "malformed": sum(d["malformed"] for d in rep["tenants"].values()),
                "loads": sum(d["loads"] for d in rep["tenants"].values()),
                "reconnects": max(d["reconnects"] for d in rep["tenants"].values()),
                **rep["counts"],
                "compactions": sum(d["compactions"] for d in rep["tenants"].values()),
                "evicted_shards": sum(d["evicted_shards"] for d in rep["tenants"].values()),
                "errors": sorted(
                    {d["last_error"] for d in rep["tenants"].values() if d["last_error"]}
                ),
            }
            for rep, cpu in zip(sub_reports, subscriber_cpu, strict=True)
        ],
        "redis_clients_with_followers": clients_ready,
        "followers_ready": [r["ready"] for r in ready],
        "memory": {
            **dict(memory_parts),
            "cached_tokens": cached_tokens,
            "redis_used_memory_delta": used_after - used_before,
            "redis_bytes_per_token": ratio(tenant_bytes, cached_tokens),
            "redis_used_delta_per_token": ratio(used_after - used_before, cached_tokens),
        },
    }


# --- output -------------------------------------------------------------------------------------


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def throughput_rows(tp: dict[str, Any] | None) -> list[tuple[str, str, str, str]]:
    if not tp:
        return []
    lag, cpu, comp, mem = tp["lag_ms"], tp["cpu"], tp["compaction"], tp["memory"]
    subs = tp["per_subscriber"]
    us = cpu["us_per_sequence"]
    return [
        (
            f"e. rate target / achieved (seq/s; {tp['tenants']} tenants x {tp['stages']} stages, "
            f"{tp['publishers']} publisher + {tp['subscribers']} follower procs)",
            fmt(tp["target_rate"], 0),
            f"{fmt(tp['achieved_rate'], 0)} into Redis ({fmt(tp['offered_rate'], 0)} offered)",
            "",
        ),
        (
            "e. sync lag publish->applied on all, ms p50 / p99 / max",
            "",
            f"{fmt(lag['p50'], 2)} / {fmt(lag['p99'], 2)} / {fmt(lag['max'], 2)}",
            f"p99 <= {TARGET_P99_MS:g}: {'PASS' if tp['p99_ok'] else 'FAIL'}",
        ),
        (
            "e. publish->XADD ack ms p50 / p99",
            "",
            f"{fmt(tp['ack_ms']['p50'], 2)} / {fmt(tp['ack_ms']['p99'], 2)}",
            "",
        ),
        (
            "e. every subscriber applied every sequence",
            "",
            f"{fmt(tp['all_applied'])} ({tp['sequences']:,})",
            "",
        ),
        (
            f"e. CPU us/sequence: publishers + {tp['subscribers']} followers + redis",
            f"{us['publishers']:.0f} + {us['followers']:.0f} + {us['redis']:.0f}",
            f"= {us['publishers'] + us['followers'] + us['redis']:.0f}",
            f"holds <= {fmt(cpu['capacity_seq_per_s'], 0)}/s on {cpu['cores']} cores",
        ),
        (
            "e. compaction rounds: count, median s / p90 s, median shards written",
            f"{comp['rounds']} (lease busy {comp['lease_busy']})",
            f"{fmt(comp['median_s'], 4)} / {fmt(comp['p90_s'], 4)}",
            fmt(comp["median_written"], 1),
        ),
        (
            f"e. Redis B/cached token ({mem['cached_tokens']:,} tokens, "
            f"{mem['stream_entries']:,} stream entries)",
            f"keys {fmt(mem['redis_bytes_per_token'], 1)}",
            f"used_memory delta {fmt(mem['redis_used_delta_per_token'], 1)}",
            "",
        ),
        (
            "e. per follower proc: RSS MB end / threads / Redis conns",
            "",
            "; ".join(
                f"{s['end']['rss'] / 2**20:.0f} / {s['end']['threads']} / "
                f"{s['end']['redis_connections']}"
                for s in subs
            ),
            "",
        ),
    ]


def table(results: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str, str]] = []
    ab = results.get("ab")
    if ab and "isolated" in ab:
        iso, fl = ab["isolated"]["summary"], ab["fleet"]["summary"]
        rows.append(
            (
                f"a. tokens/step ({ab['questions']} questions, {iso['calls']} calls)",
                fmt(iso["tokens_per_step"]),
                fmt(fl["tokens_per_step"]),
                fmt(ab["ratio_tokens_per_step"]),
            )
        )
        rows.append(
            (
                "a. accepted/step",
                fmt(iso["accepted_per_step"]),
                fmt(fl["accepted_per_step"]),
                fmt(ratio(fl["accepted_per_step"], iso["accepted_per_step"])),
            )
        )
        rows.append(
            (
                "a. completion tokens / steps",
                f"{iso['completion_tokens']:,} / {iso['steps']:,}",
                f"{fl['completion_tokens']:,} / {fl['steps']:,}",
                "",
            )
        )
        rows.append(
            (
                "a. wall s",
                fmt(ab["isolated"]["wall_s"], 1),
                fmt(ab["fleet"]["wall_s"], 1),
                fmt(ratio(ab["fleet"]["wall_s"], ab["isolated"]["wall_s"])),
            )
        )
        rows.append(
            ("a. identical outputs", "", f"{ab['identical_outputs']}/{ab['same_calls']}", "")
        )
    kr = ab and ab["fleet"].get("kill_restart")
    if kr:
        r, c = kr["restarted_first_request"], kr["control_empty_isolated"]

        def probe(d: dict[str, Any]) -> str:
            return (
                f"{d['accepted']}/{d['drafted']} in {d['steps']} steps, "
                f"{fmt(d['tokens_per_step'], 2)} tok/step"
            )

        rows.append(
            (
                f"b. restarted replica's 1st request ({kr['probe']['stage']}, "
                f"{kr['probe']['completion_tokens']} tokens): accepted/drafted",
                "empty control: " + probe(c),
                "restarted: " + probe(r),
                "PASS" if kr["pass"] else "FAIL",
            )
        )
        rows.append(("b. restart to ready s", "", fmt(kr["restart_to_ready_s"], 1), ""))
    load = results.get("load")
    if load and "c" in results["phases"]:
        lag = load["lag_ms"]
        rows.append(
            (
                f"c. rate target / achieved (seq/s, {load['subscribers']} subscriber procs)",
                fmt(load["target_rate"], 0),
                fmt(load["achieved_rate"], 0),
                "",
            )
        )
        rows.append(
            (
                "c. sync lag publish->applied on all, ms p50 / p99 / max",
                "",
                f"{fmt(lag['p50'], 2)} / {fmt(lag['p99'], 2)} / {fmt(lag['max'], 2)}",
                f"p99 <= {TARGET_P99_MS:g}: {'PASS' if load['p99_ok'] else 'FAIL'}",
            )
        )
        ack = load["ack_ms"]
        rows.append(
            (
                "c. publish->XADD ack ms p50 / p99",
                "",
                f"{fmt(ack['p50'], 2)} / {fmt(ack['p99'], 2)}",
                "",
            )
        )
        rows.append(
            (
                "c. every subscriber applied every sequence",
                "",
                f"{fmt(load['all_applied'])} ({load['sequences']:,})",
                "",
            )
        )
    if load and "d" in results["phases"]:
        m = load["memory"]
        rows.append(
            (
                f"d. Redis B/cached token ({m['cached_tokens']:,} tokens, "
                f"{m['stream_entries']:,} stream entries)",
                f"keys {fmt(m['redis_bytes_per_token'], 1)}",
                f"used_memory delta {fmt(m['redis_used_delta_per_token'], 1)}",
                "",
            )
        )
        rows.append(
            (
                "d. Redis bytes: stream / snapshots",
                "",
                f"{m['stream_bytes']:,} / {m['snapshots_bytes']:,}",
                "",
            )
        )
        rows.append(
            (
                "d. subscriber B/token: one tree / both trees / RSS delta",
                "",
                f"{fmt(m['subscriber_tree_bytes_per_token'], 1)} / "
                f"{fmt(m['subscriber_both_trees_bytes_per_token'], 1)} / "
                f"{fmt(m['subscriber_rss_delta_per_token'], 1)}",
                "",
            )
        )
    if ab and "d" in results["phases"]:
        rows.append(
            (
                "d. replica learned shards B/token (phase a fleet run)",
                "",
                fmt(ab["replica_memory"]["learned_bytes_per_token"], 1),
                "",
            )
        )
    rows += throughput_rows(results.get("throughput"))
    head = ("metric", "isolated / baseline", "fleet / measured", "ratio / check")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--phases", default="a,b,c,d", help="phases to run (default: %(default)s)")
    p.add_argument("--model", default="smollm2-135m", help="replica model (default: %(default)s)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--questions", type=int, default=6, help="pipeline questions per run")
    p.add_argument("--n-sql", type=int, default=1, help="parallel SQL stages of the pipeline")
    p.add_argument("--agents", type=int, default=3, help="pipelines running at once")
    p.add_argument("--kill-after", type=int, default=None, help="phase b: after this question")
    p.add_argument("--kill-replica", type=int, default=1, help="phase b: which replica")
    p.add_argument("--rate", type=float, default=1000.0, help="phase c: sequences per second")
    p.add_argument("--seconds", type=float, default=3.0, help="phase c: publishing time")
    p.add_argument("--sequences", type=int, default=None, help="c/d: sequences (rate*seconds)")
    p.add_argument("--subscribers", type=int, default=3, help="c/d: subscriber processes")
    p.add_argument("--data", type=Path, default=DEFAULT_TRACE, help="Spider trace")
    p.add_argument("--tokenizer", type=Path, default=None, help="c/d: tokenizer.json (Qwen3)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write all numbers")
    p.add_argument("--tenants", type=int, default=100, help="e: tenants")
    p.add_argument("--stages", type=int, default=10, help="e: stages (shards) per tenant")
    p.add_argument("--e-rate", type=float, default=10_000.0, help="e: sequences per second")
    p.add_argument("--e-seconds", type=float, default=5.0, help="e: publishing time")
    p.add_argument("--publishers", type=int, default=2, help="e: publisher processes")
    p.add_argument("--publisher-batch", type=int, default=128, help="e: entries per pipeline")
    p.add_argument("--compact-every", type=int, default=100, help="e: subscribers' compact_every")
    p.add_argument(
        "--linger-ms", type=float, default=5.0, help="e: the followers' linger_ms (0: none)"
    )
    p.add_argument("--subscriber-child", nargs=2, metavar=("URL", "TENANT"), help=argparse.SUPPRESS)
    p.add_argument("--follower-child", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--publisher-child", metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.kill_after is None:
        args.kill_after = max(1, args.questions // 2)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.subscriber_child:
        return subscriber_child(*args.subscriber_child)
    if args.follower_child:
        return follower_child(args.follower_child)
    if args.publisher_child:
        return publisher_child(args.publisher_child)
    phases = {x.strip() for x in args.phases.split(",") if x.strip()}
    if not phases or phases - set(PHASES):
        print(f"--phases: choose from {','.join(PHASES)}", file=sys.stderr)
        return 2
    if "b" in phases and args.kill_after >= args.questions:
        print("phase b needs --kill-after < --questions", file=sys.stderr)
        return 2
    from benchmarks._redis import RedisServer

    results: dict[str, Any] = {"phases": sorted(phases), "cpus": os.cpu_count()}
    t0 = time.perf_counter()
    with (
        RedisServer(appendfsync="everysec") as server,
        tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp,
    ):
        workdir = Path(tmp)
        results["redis"] = {"url": server.url, "appendfsync": "everysec"}
        if phases & {"a", "b"}:
            before = os.getloadavg()
            results["ab"] = phase_ab(args, phases, server.url, workdir)
            results["ab"]["loadavg_before_after"] = [before, os.getloadavg()]
        if phases & {"c", "d"}:
            n = args.sequences or max(1, round(args.rate * args.seconds))
            rate = args.rate if "c" in phases else 0.0
            before = os.getloadavg()
            results["load"] = run_load(args, server.url, workdir, rate, n)
            results["load"]["loadavg_before_after"] = [before, os.getloadavg()]
        if "e" in phases:
            before = os.getloadavg()
            results["throughput"] = run_throughput(args, server, workdir)
            results["throughput"]["loadavg_before_after"] = [before, os.getloadavg()]
    results["wall_s"] = time.perf_counter() - t0
    print(table(results))
    for part, what in (("ab", "phases a/b"), ("load", "phases c/d"), ("throughput", "phase e")):
        if part in results:
            b, a = results[part]["loadavg_before_after"]
            print(
                f"load average ({what}): "
                f"before {b[0]:.2f} {b[1]:.2f} {b[2]:.2f}, after {a[0]:.2f} {a[1]:.2f} {a[2]:.2f} "
                f"on {os.cpu_count()} CPUs"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
