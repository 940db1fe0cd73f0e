#!/usr/bin/env python
"""What the agentspec LiteLLM hook costs per request: a proxy with it against one without.

Two ``litellm --config`` proxies run side by side in front of the same
upstream, identical but for ``litellm_settings.callbacks`` (the second one
runs `agentspec_litellm` with a store, tagging, learning and token-id
stripping; pushes are off so that only the request path is measured).  The
upstream is a stdlib server answering at once with a fixed completion of
``--tokens`` token ids (vLLM's ``return_token_ids`` format), so what is
measured is the proxy, not a model.  Requests alternate between the two
proxies (so machine noise hits both alike), streamed and non-streamed.

Printed: median and p90 latency per proxy and mode, the median ratio
hooked / plain, and what the hook learned (from its stats file).

Run in ``.venv-litellm`` (``scripts/setup-litellm``)::

    .venv-litellm/bin/python benchmarks/bench_litellm_hook.py [--requests 200]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from agentspec._util.procs import free_port, spawn, stop_group, wait_healthy

MASTER_KEY = "sk-bench-0123456789abcdef0123456789abcdef0123456789"


def upstream(tokens: int) -> ThreadingHTTPServer:
    """An OpenAI-compatible server answering every chat completion at once."""
    ids = list(range(1000, 1000 + tokens))
    words = [f"w{i} " for i in range(tokens)]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Headers and body go out as separate writes: without this, Nagle's
            # algorithm and the client's delayed ACK add ~40 ms to some answers.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            base = {"id": "c", "created": 1, "model": "m"}
            if body.get("stream"):
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                for i, (w, t) in enumerate(zip(words, ids, strict=True)):
                    delta = {"role": "assistant", "content": w} if i == 0 else {"content": w}
                    ch = {"index": 0, "delta": delta, "token_ids": [t]}
                    self.wfile.write(b"data: " + json.dumps({**base, "choices": [ch]}).encode())
                    self.wfile.write(b"\n\n")
                end = {"index": 0, "delta": {}, "finish_reason": "stop", "token_ids": []}
                self.wfile.write(b"data: " + json.dumps({**base, "choices": [end]}).encode())
                self.wfile.write(b"\n\ndata: [DONE]\n\n")
                self.close_connection = True
                return
            out = {
                **base,
                "object": "chat.completion",
                "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "".join(words)},
                        "token_ids": ids,
                    }
                ],
                "usage": {
                    "prompt_tokens": 9,
                    "completion_tokens": tokens,
                    "total_tokens": 9 + tokens,
                },
            }
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@contextlib.contextmanager
def proxy(
    workdir: Path, upstream_url: str, hooked: bool, extra: dict[str, Any] | None = None
) -> Iterator[str]:
    workdir.mkdir(parents=True)
    config: dict[str, Any] = {
        "model_list": [
            {
                "model_name": "m",
                "litellm_params": {
                    "model": "hosted_vllm/m",
                    "api_base": upstream_url,
                    "api_key": "x",
                },
            }
        ],
        "general_settings": {"master_key": MASTER_KEY},
    }
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")
    env.pop("AGENTSPEC_LITELLM_CONFIG", None)
    if hooked:
        config["litellm_settings"] = {"callbacks": "agentspec_litellm.proxy_handler_instance"}
        hook = {
            "store": str(workdir / "store"),
            "push": [],
            "stats_file": str(workdir / "stats.json"),
        }
        hook.update(extra or {})
        (workdir / "agentspec.json").write_text(json.dumps(hook))
        env["AGENTSPEC_LITELLM_CONFIG"] = str(workdir / "agentspec.json")
    (workdir / "config.yaml").write_text(json.dumps(config))
    port = free_port()
    litellm = Path(sys.executable).with_name("litellm")
    cmd = [str(litellm), "--config", str(workdir / "config.yaml"), "--port", str(port)]
    proc = spawn(cmd, workdir / "proxy.log", env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, f"{url}/health/liveliness", 120, workdir / "proxy.log")
        yield url
    finally:
        stop_group(proc, grace=15)


def one_request(url: str, stream: bool, i: int) -> float:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": f"request {i}"}],
        "stream": stream,
    }
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {MASTER_KEY}",
            "Content-Type": "application/json",
            "X-AgentSpec-Stage": "bench",
            "X-AgentSpec-Session": f"s{i % 7}",
        },
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()
    return time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--requests", type=int, default=200, help="per proxy and mode")
    ap.add_argument("--tokens", type=int, default=64, help="completion length")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--hook", default="{}", help="JSON: more hook settings (e.g. store: null)")
    args = ap.parse_args()
    up = upstream(args.tokens)
    up_url = f"http://127.0.0.1:{up.server_address[1]}/v1"
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        plain = stack.enter_context(proxy(Path(tmp) / "plain", up_url, hooked=False))
        hooked = stack.enter_context(
            proxy(Path(tmp) / "hooked", up_url, True, json.loads(args.hook))
        )
        print(f"proxies: plain {plain}, hooked {hooked}; upstream answers {args.tokens} tokens")
        rows = []
        for stream in (False, True):
            for i in range(args.warmup):
                one_request(plain, stream, i)
                one_request(hooked, stream, i)
            times: dict[str, list[float]] = {"plain": [], "hooked": []}
            for i in range(args.requests):
                order = ("plain", "hooked") if i % 2 == 0 else ("hooked", "plain")
                for name in order:
                    times[name].append(one_request(plain if name == "plain" else hooked, stream, i))
            mode = "stream" if stream else "non-stream"
            p50 = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            p90 = {k: pct(v, 0.9) * 1e3 for k, v in times.items()}
            rows.append((mode, p50, p90))
        print(
            f"\n{'mode':<11} {'plain p50':>10} {'hooked p50':>11} {'plain p90':>10} "
            f"{'hooked p90':>11} {'p50 ratio':>10} {'added p50':>10}"
        )
        for mode, p50, p90 in rows:
            print(
                f"{mode:<11} {p50['plain']:>8.2f}ms {p50['hooked']:>9.2f}ms {p90['plain']:>8.2f}ms "
                f"{p90['hooked']:>9.2f}ms {p50['hooked'] / p50['plain']:>10.3f} "
                f"{p50['hooked'] - p50['plain']:>8.2f}ms"
            )
        time.sleep(2)
        stats_path = Path(tmp) / "hooked" / "stats.json"
        stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
        print("\nhook counters:", json.dumps(stats.get("counters", {}), sort_keys=True))
    up.shutdown()


if __name__ == "__main__":
    main()
