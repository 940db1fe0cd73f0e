"""The endpoint plugin: `ShardForwarder` against real worker intakes, then inside real vLLM.

The first half drives `ShardForwarder` with worker-side `ShardIntake`s (what
the worker extension answers with) standing behind the RPC; it needs no vLLM.
The tests marked ``vllm`` start one real vLLM server (SmolLM2-135M on CPU,
``--enforce-eager``) for the module, with the plugin loaded the way
``agentspec serve`` loads it, and talk HTTP to it.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
from prereq import missing

try:
    import agentspec_vllm  # noqa: F401
except ImportError:  # not installed (e.g. the main venv): use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentspec_vllm.config import AgentSpecVllmConfig
from agentspec_vllm.endpoint import (
    METRICS_PATH,
    RPC_HANDLE,
    RPC_STATS,
    STATS_PATH,
    AgentSpecEndpointPlugin,
    ShardForwarder,
    agentspec_endpoint_plugin,
)

from agentspec import ShardIntake, SuffixTree
from agentspec._push.wire import (
    DELTA_PATH,
    INSTANCE_HEADER,
    SHARD_CONTENT_TYPE,
    SHARDS_PATH,
    SNAPSHOT_FILE_PATH,
    SNAPSHOT_PATH,
)
from agentspec._util.procs import free_port, log_tail, spawn, stop_group, wait_healthy

API_KEY = "test-key-123"
SHARD_HEADERS = {"Content-Type": SHARD_CONTENT_TYPE}


def snapshot_bytes(*seqs, depth=64, start=1):
    tree = SuffixTree(depth)
    for i, seq in enumerate(seqs, start):
        tree.add(i, seq)
    data = tree.to_bytes()
    tree.close()
    return data


class Workers:
    """Worker intakes behind an RPC callable, counting the calls that reached them."""

    def __init__(self, n=1, shm_dir=None, fail=None):
        self.intakes = [ShardIntake(max_depth=64, shm_dir=shm_dir) for _ in range(n)]
        self.calls = []
        self.fail = fail

    async def rpc(self, method, args):
        self.calls.append((method, args))
        if self.fail is not None:
            raise self.fail
        if method == RPC_STATS:
            return [{"instance": w.instance} for w in self.intakes]
        assert method == RPC_HANDLE
        out = []
        for w in self.intakes:
            a = w.handle(*args)
            out.append((a.status, dict(a.headers), a.body))
        return out


def forward(fwd, method, path, query="", headers=None, body=b""):
    return asyncio.run(fwd.handle(method, path, query, headers or {}, body))


def make(n=1, *, shm_dir=None, fail=None, **config):
    workers = Workers(n, shm_dir=shm_dir, fail=fail)
    cfg = AgentSpecVllmConfig(shm_dir=None if shm_dir is None else str(shm_dir), **config)
    return workers, ShardForwarder(workers.rpc, cfg)


# --- ShardForwarder (no vLLM) ------------------------------------------------------


def test_snapshot_and_delta_reach_the_worker():
    workers, fwd = make()
    data = snapshot_bytes([1, 2, 3, 4], [5, 6, 7])
    a = forward(fwd, "PUT", SNAPSHOT_PATH, "stage=S", SHARD_HEADERS, data)
    assert a.status == 200, a.body
    inst = workers.intakes[0].instance
    assert a.headers[INSTANCE_HEADER] == inst
    assert a.json()["sequences"] == 2
    src = SuffixTree(64)
    src.add(3, [9, 9, 8])
    delta = src.delta_bytes([3])
    src.close()
    hdrs = {**SHARD_HEADERS, INSTANCE_HEADER: inst}
    for _ in range(2):  # a repeated delta changes nothing
        a = forward(fwd, "POST", DELTA_PATH, "stage=S", hdrs, delta)
        assert a.status == 200, a.body
        assert a.json()["sequences"] == 3
    listed = forward(fwd, "GET", SHARDS_PATH).json()
    assert listed["instance"] == inst
    assert [(s["stage"], s["sequences"], s["max_seq"]) for s in listed["shards"]] == [("S", 3, 3)]
    assert forward(fwd, "DELETE", SHARDS_PATH, "stage=S").json()["deleted"] is True
    assert forward(fwd, "GET", SHARDS_PATH).json()["shards"] == []


@pytest.mark.parametrize(
    ("method", "path", "query", "headers", "body", "status", "etype"),
    [
        ("PUT", SNAPSHOT_PATH, "stage=S", SHARD_HEADERS, b"not a shard", 400, "shard_format_error"),
        ("POST", DELTA_PATH, "stage=S", SHARD_HEADERS, b"\x00" * 64, 400, "shard_format_error"),
        (
            "PUT",
            SNAPSHOT_PATH,
            "stage=S",
            SHARD_HEADERS,
            snapshot_bytes([1, 2], depth=32),
            409,
            "depth_mismatch",
        ),
        (
            "PUT",
            SNAPSHOT_PATH,
            "stage=S",
            {"Content-Type": "text/plain"},
            b"x",
            415,
            "unsupported_media_type",
        ),
        ("PUT", SNAPSHOT_PATH, "bogus=1", SHARD_HEADERS, b"x", 400, "invalid_request_error"),
        ("DELETE", SHARDS_PATH, "stage=" + "x" * 200, {}, b"", 400, "invalid_request_error"),
        ("GET", "/v1/agentspec/nope", "", {}, b"", 404, "not_found_error"),
        ("POST", SHARDS_PATH, "", {}, b"", 405, "method_not_allowed"),
        ("POST", STATS_PATH, "", {}, b"", 405, "method_not_allowed"),
        (
            "POST",
            SNAPSHOT_FILE_PATH,
            "stage=S",
            {"Content-Type": "application/json"},
            b"{}",
            400,
            "invalid_request_error",
        ),
        (
            "POST",
            SNAPSHOT_FILE_PATH,
            "stage=S",
            {"Content-Type": "application/json"},
            b'{"path": "/dev/shm/x"}',
            403,
            "permission_error",
        ),
        (
            "POST",
            SNAPSHOT_FILE_PATH,
            "stage=S",
            {"Content-Type": "text/plain"},
            b"{}",
            415,
            "unsupported_media_type",
        ),
    ],
)
def test_bad_requests_are_refused_without_the_engine(
    method, path, query, headers, body, status, etype
):
    workers, fwd = make()
    a = forward(fwd, method, path, query, headers, body)
    assert a.status == status, a.body
    assert a.json()["error"]["type"] == etype
    assert INSTANCE_HEADER not in a.headers
    assert workers.calls == []


def test_body_over_the_limit_gets_413_before_reading():
    workers, fwd = make(max_body_bytes=1000)
    assert fwd.precheck("PUT", SNAPSHOT_PATH, {}, 1001).status == 413
    assert fwd.precheck("PUT", SNAPSHOT_PATH, {}, 1000) is None
    a = forward(fwd, "PUT", SNAPSHOT_PATH, "stage=S", SHARD_HEADERS, b"x" * 1001)
    assert a.status == 413
    assert workers.calls == []


def test_agentspec_api_key():
    workers, fwd = make(api_key=API_KEY)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        a = forward(fwd, "GET", SHARDS_PATH, headers=headers)
        assert a.status == 401
        assert a.json()["error"]["type"] == "authentication_error"
    assert forward(fwd, "GET", STATS_PATH).status == 401
    assert workers.calls == []
    workers.intakes = [ShardIntake(max_depth=64, api_key=API_KEY)]  # the worker checks it too
    ok = forward(fwd, "GET", SHARDS_PATH, headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status == 200, ok.body
    assert ok.json()["instance"] == workers.intakes[0].instance


def test_large_snapshot_goes_through_the_shm_dir(tmp_path):
    workers, fwd = make(shm_dir=tmp_path)
    fwd.shm_threshold = 100
    data = snapshot_bytes(list(range(1, 200)))
    assert len(data) >= 100
    a = forward(fwd, "PUT", SNAPSHOT_PATH, "stage=big", SHARD_HEADERS, data)
    assert a.status == 200, a.body
    assert a.json()["tokens"] == 199
    method, args = workers.calls[-1]
    assert (method, args[0], args[1]) == (RPC_HANDLE, "POST", SNAPSHOT_FILE_PATH)
    assert list(tmp_path.iterdir()) == []  # the file is removed afterwards


def test_snapshot_file_path_is_forwarded(tmp_path):
    workers, fwd = make(shm_dir=tmp_path)
    path = tmp_path / "s.ashd"
    path.write_bytes(snapshot_bytes([4, 5, 6]))
    body = json.dumps({"path": str(path)}).encode()
    a = forward(
        fwd, "POST", SNAPSHOT_FILE_PATH, "stage=F", {"Content-Type": "application/json"}, body
    )
    assert a.status == 200, a.body
    assert workers.calls[-1][1][4] == body
    outside = forward(
        fwd,
        "POST",
        SNAPSHOT_FILE_PATH,
        "stage=F",
        {"Content-Type": "application/json"},
        b'{"path": "/etc/passwd"}',
    )
    assert outside.status == 403  # the worker refuses paths outside its shm dir


def test_two_workers_answer_with_a_combined_instance():
    workers, fwd = make(2)
    data = snapshot_bytes([1, 2, 3])
    a = forward(fwd, "PUT", SNAPSHOT_PATH, "stage=S", SHARD_HEADERS, data)
    assert a.status == 200, a.body
    combined = "+".join(w.instance for w in workers.intakes)
    assert a.headers[INSTANCE_HEADER] == combined
    assert a.json()["instance"] == combined
    src = SuffixTree(64)
    src.add(2, [7, 7, 7])
    delta = src.delta_bytes([2])
    src.close()
    ok = forward(
        fwd, "POST", DELTA_PATH, "stage=S", {**SHARD_HEADERS, INSTANCE_HEADER: combined}, delta
    )
    assert ok.status == 200, ok.body
    assert all(len(w.tree(("default", None, "S"))) == 2 for w in workers.intakes)
    stale = forward(
        fwd, "POST", DELTA_PATH, "stage=S", {**SHARD_HEADERS, INSTANCE_HEADER: "old+older"}, delta
    )
    assert stale.status == 409
    assert stale.json()["error"]["type"] == "instance_mismatch"
    stats = forward(fwd, "GET", STATS_PATH).json()
    assert [w["instance"] for w in stats["workers"]] == [w.instance for w in workers.intakes]


def test_a_worker_error_is_passed_back():
    workers, fwd = make(2)
    workers.intakes[1] = ShardIntake(max_depth=64, api_key="only-worker-1-has-a-key")
    a = forward(fwd, "GET", SHARDS_PATH)
    assert a.status == 401
    assert a.headers[INSTANCE_HEADER] == workers.intakes[1].instance


def test_engine_failure_is_a_retryable_503():
    _, fwd = make(fail=AttributeError("'Worker' object has no attribute 'agentspec_handle'"))
    a = forward(fwd, "GET", SHARDS_PATH)
    assert a.status == 503
    assert "--worker-extension-cls" in a.json()["error"]["message"]
    assert "retry-after-ms" in a.headers
    assert forward(fwd, "GET", STATS_PATH).status == 503


def test_unexpected_worker_answer_is_a_500():
    async def rpc(method, args):
        return ["not a triple"]

    fwd = ShardForwarder(rpc, AgentSpecVllmConfig())
    a = forward(fwd, "GET", SHARDS_PATH)
    assert a.status == 500
    assert "unexpected worker answer" in a.json()["error"]["message"]


def test_plugin_object_matches_vllms_protocol():
    plugin = agentspec_endpoint_plugin()
    assert isinstance(plugin, AgentSpecEndpointPlugin)
    assert plugin.name == "agentspec"
    assert plugin.required_tasks == ("generate",)
    assert callable(plugin.attach_router)
    assert asyncio.iscoroutinefunction(plugin.init_state)


# --- real vLLM ---------------------------------------------------------------------


class VllmServer:
    """One vLLM API server started with agentspec's flags (as ``agentspec serve`` builds them)."""

    def __init__(self, log_dir, *, api_key=API_KEY, env=None, extra_args=()):
        from agentspec._cli import vllm as cli_vllm

        self.log_dir = Path(log_dir)
        self.api_key = api_key
        self.shm_dir = Path(tempfile.mkdtemp(prefix="agentspec-test-", dir="/dev/shm"))
        parser = argparse.ArgumentParser()
        cli_vllm.add_serve_arguments(parser)
        self.port = free_port()
        argv = [
            "smollm2-135m",
            "--port",
            str(self.port),
            "--api-key",
            api_key,
            "--shm-dir",
            str(self.shm_dir),
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--max-num-seqs",
            "32",
            *extra_args,
        ]
        args = parser.parse_args(argv)
        self.argv, self.env = cli_vllm.serve_launch(args)
        self.env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "VLLM_LOGGING_LEVEL": "WARNING",
                **(env or {}),
            }
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.starts = 0

    def start(self, timeout=300.0):
        self.starts += 1
        self.log_path = self.log_dir / f"vllm-{self.port}-{self.starts}.log"
        self.proc = spawn(self.argv, self.log_path, self.env)
        wait_healthy(self.proc, self.url + "/health", timeout, self.log_path)

    def log_tail(self, n=4000):
        return log_tail(self.log_path, n)

    def stop(self):
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc)

    def close(self):
        self.stop()
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def request(self, method, path, body=None, headers=None, auth=True):
        """One HTTP request; returns (status, headers, body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            hdrs = {"Authorization": f"Bearer {self.api_key}"} if auth else {}
            hdrs.update(headers or {})
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def shards(self):
        status, _, body = self.request("GET", SHARDS_PATH)
        assert status == 200, body
        obj = json.loads(body)
        return obj["instance"], {(s["tenant"], s["pipeline"], s["stage"]): s for s in obj["shards"]}

    def complete(self, prompt="The capital of France is", max_tokens=8, **xargs):
        body = {
            "model": "smollm2-135m",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if xargs:
            body["vllm_xargs"] = xargs
        status, _, out = self.request(
            "POST",
            "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 200, out
        return json.loads(out)


def need_vllm():
    if importlib.util.find_spec("vllm") is None:
        missing("vllm is not importable in this Python (scripts/setup-vllm makes .venv-vllm)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_vllm()
    env = {"AGENTSPEC_VLLM_MAX_BODY_BYTES": str(4 << 20), "AGENTSPEC_VLLM_METRICS_INTERVAL": "0.5"}
    srv = VllmServer(tmp_path_factory.mktemp("vllm"), env=env)
    try:
        srv.start()
        yield srv
    finally:
        srv.close()


@pytest.mark.vllm
def test_vllm_push_requires_the_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, _, _ = server.request("GET", SHARDS_PATH, headers=headers, auth=False)
        assert status == 401
        status, _, _ = server.request(
            "PUT",
            SNAPSHOT_PATH + "?stage=A",
            snapshot_bytes([1, 2]),
            {**SHARD_HEADERS, **headers},
            auth=False,
        )
        assert status == 401
    _, shards = server.shards()
    assert ("default", None, "A") not in shards


@pytest.mark.vllm
def test_vllm_malformed_shard_gets_400_and_the_server_keeps_serving(server):
    good = snapshot_bytes([11, 12, 13, 14])
    status, headers, body = server.request("PUT", SNAPSHOT_PATH + "?stage=M", good, SHARD_HEADERS)
    assert status == 200, body
    instance = headers[INSTANCE_HEADER.lower()]
    for bad in (b"garbage", good[:-3], good[:10] + b"\xff" * 50 + good[60:]):
        status, _, body = server.request("PUT", SNAPSHOT_PATH + "?stage=M", bad, SHARD_HEADERS)
        assert status == 400, body
        assert json.loads(body)["error"]["type"] == "shard_format_error"
    status, _, body = server.request("POST", DELTA_PATH + "?stage=M", b"\x01\x02", SHARD_HEADERS)
    assert status == 400
    inst, shards = server.shards()
    assert inst == instance
    assert shards[("default", None, "M")]["sequences"] == 1  # unchanged
    out = server.complete(agentspec_stage="M")
    assert out["choices"][0]["text"]


@pytest.mark.vllm
def test_vllm_protocol_errors(server):
    status, _, body = server.request("GET", "/v1/agentspec/unknown")
    assert (status, json.loads(body)["error"]["type"]) == (404, "not_found_error")
    status, _, _ = server.request("PATCH", SHARDS_PATH)
    assert status == 405
    big = b"\x00" * ((4 << 20) + 1)
    status, _, body = server.request("PUT", SNAPSHOT_PATH + "?stage=B", big, SHARD_HEADERS)
    assert status == 413
    status, _, _ = server.request(
        "PUT", SNAPSHOT_PATH + "?stage=B", b"{}", {"Content-Type": "application/json"}
    )
    assert status == 415
    status, _, _ = server.request(
        "PUT", SNAPSHOT_PATH + "?tenant=", snapshot_bytes([1, 2]), SHARD_HEADERS
    )
    assert status == 400


@pytest.mark.vllm
def test_vllm_snapshot_file_and_delete(server):
    path = server.shm_dir / "push.ashd"
    path.write_bytes(snapshot_bytes([21, 22, 23], [24, 25]))
    status, _, body = server.request(
        "POST",
        SNAPSHOT_FILE_PATH + "?pipeline=p&stage=F",
        json.dumps({"path": str(path)}).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 200, body
    _, shards = server.shards()
    assert shards[("default", "p", "F")]["tokens"] == 5
    status, _, body = server.request("DELETE", SHARDS_PATH + "?pipeline=p&stage=F")
    assert (status, json.loads(body)["deleted"]) == (200, True)
    _, shards = server.shards()
    assert ("default", "p", "F") not in shards


@pytest.mark.vllm
def test_vllm_stats_and_header_middleware(server):
    server.request("PUT", SNAPSHOT_PATH + "?stage=H", snapshot_bytes([31, 32, 33]), SHARD_HEADERS)
    body = json.dumps(
        {
            "model": "smollm2-135m",
            "max_tokens": 6,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello to the world"}],
        }
    )
    status, _, out = server.request(
        "POST",
        "/v1/chat/completions",
        body.encode(),
        {
            "Content-Type": "application/json",
            "X-AgentSpec-Stage": "st%C3%A4ge-H",
            "X-AgentSpec-Session": "sess-1",
        },
    )
    assert status == 200, out
    status, _, out = server.request(
        "POST",
        "/v1/chat/completions",
        body.encode(),
        {"Content-Type": "application/json", "X-AgentSpec-Stage": "%0A"},
    )
    assert status == 400
    status, _, out = server.request("GET", STATS_PATH)
    assert status == 200, out
    (worker,) = json.loads(out)["workers"]
    assert ("default", None, "H") in {
        (s["tenant"], s["pipeline"], s["stage"]) for s in worker["pushed"]
    }
    stages = {k.get("stage") for k in worker["proposer"]["keys"]} if worker["proposer"] else set()
    assert "stäge-H" in stages, worker["proposer"]


def _agentspec_series(text, tenant):
    """Per (pipeline, stage) of ``tenant``: the speculation counters in an exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {
        "agentspec_requests_total": "requests",
        "agentspec_verify_steps_total": "steps",
        "agentspec_draft_tokens_total": "drafted_tokens",
        "agentspec_accepted_tokens_total": "accepted_tokens",
        "agentspec_accepted_tokens_per_position_total": "per_position",
    }
    out = {}
    families = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for sample in family.samples:
            field = names.get(sample.name)
            if field is None or sample.labels.get("tenant") != tenant:
                continue
            entry = out.setdefault((sample.labels["pipeline"], sample.labels["stage"]), {})
            entry[field] = entry.get(field, 0) + sample.value
    return out, families


@pytest.mark.vllm
def test_vllm_metrics_per_stage_match_the_stats(server):
    """vLLM's own /metrics carries the workers' per-stage counters next to vllm:spec_decode_*."""
    prompt = "List the planets of the solar system in order, separated by commas:"
    for stage, n in (("M-A", 3), ("M-B", 1)):
        for _ in range(n):
            server.complete(
                prompt,
                max_tokens=24,
                agentspec_tenant="mt",
                agentspec_pipeline="mp",
                agentspec_stage=stage,
            )

    def stats():
        status, _, out = server.request("GET", STATS_PATH)
        assert status == 200, out
        (worker,) = json.loads(out)["workers"]
        return {
            (k["pipeline"], k["stage"]): {
                f: k[f] for f in ("requests", "steps", "drafted_tokens", "accepted_tokens")
            }
            for k in worker["proposer"]["keys"]
            if k["tenant"] == "mt"
        }

    deadline = time.monotonic() + 60
    while True:
        expected = stats()
        status, headers, body = server.request("GET", "/metrics")
        assert status == 200
        got, families = _agentspec_series(body.decode(), "mt")
        per_position = {k: v.pop("per_position", 0) for k, v in got.items()}
        if got == expected and stats() == expected:
            break  # the refresh caught up and the counters stand still
        assert time.monotonic() < deadline, (got, expected)
        time.sleep(0.2)
    assert set(expected) == {("mp", "M-A"), ("mp", "M-B")}
    assert expected[("mp", "M-A")]["requests"] == 3
    assert expected[("mp", "M-A")]["accepted_tokens"] > 0  # the repeats drafted from the stage
    assert per_position == {k: v["accepted_tokens"] for k, v in expected.items()}
    assert "vllm:spec_decode_num_draft_tokens" in families  # vLLM's own, in the same scrape
    assert "agentspec_step_seconds" in families
    # The plugin's route answers the same counters, collected afresh, behind the API key.
    status, headers, body = server.request("GET", METRICS_PATH)
    assert status == 200, body
    assert headers["content-type"].startswith("text/plain")
    fresh, _ = _agentspec_series(body.decode(), "mt")
    for v in fresh.values():
        v.pop("per_position")
    assert fresh == expected
    status, _, _ = server.request("GET", METRICS_PATH, auth=False)
    assert status == 401
