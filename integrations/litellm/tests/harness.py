"""Processes for the LiteLLM hook's tests: the upstream engine, a recording forwarder, proxies.

- `start_engine`: agentspec's embedded engine (SmolLM2-135M on CPU) as a
  subprocess of ``$AGENTSPEC_ENGINE_PYTHON`` -- a Python with
  ``agentspec[local]`` (torch, transformers), which this venv (LiteLLM's)
  does not have.
- `Forwarder`: a stdlib HTTP server between LiteLLM and the engine that
  records every request body and passes requests and answers (streams
  included) through unchanged, so tests see exactly what reached upstream.
- `start_proxy`: a real ``litellm --config`` process on loopback.

Every process is stopped in ``finally`` / fixture teardown: SIGTERM to its
process group, SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agentspec._util.procs import free_port, log_tail, spawn, stop_group, wait_healthy

ENGINE_PYTHON_ENV = "AGENTSPEC_ENGINE_PYTHON"
LITELLM_BIN = Path(sys.executable).with_name("litellm")


@dataclass
class Process:
    """A started server: its process, base URL and log file."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_tail(self, n: int = 4000) -> str:
        """The end of the process's output (for failure messages)."""
        return log_tail(self.log, n)


@contextlib.contextmanager
def start_engine(workdir: Path, *args: str) -> Iterator[Process]:
    """The embedded engine on a free port, with ``args`` added to its command line
    (skips are the caller's business)."""
    python = os.environ[ENGINE_PYTHON_ENV]
    port = free_port()
    log = workdir / "engine.log"
    cmd = [python, "-m", "agentspec", "serve", "smollm2-135m", "--engine", "embedded"]
    cmd += ["--port", str(port), "--threads", "2", *args]
    with _serving(spawn(cmd, log, os.environ), port, log, "/health", 240, "engine") as server:
        yield server


@contextlib.contextmanager
def _serving(
    proc: subprocess.Popen[bytes], port: int, log: Path, health: str, timeout: float, what: str
) -> Iterator[Process]:
    """Wait for ``health`` to answer, yield the server, stop it; failures carry its log."""
    server = Process(proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_healthy(proc, f"{server.url}{health}", timeout, log)
        yield server
    except Exception as exc:
        raise RuntimeError(f"{what} failed: {exc}\n{server.log_tail()}") from exc
    finally:
        stop_group(proc, grace=10)


@contextlib.contextmanager
def start_proxy(
    workdir: Path, config: Mapping[str, Any], hook_config: Mapping[str, Any] | None, **files: str
) -> Iterator[Process]:
    """A LiteLLM proxy with ``config`` (YAML from JSON) and the agentspec hook config.

    ``files`` are written next to the config (e.g. a ``custom_auth.py``).
    """
    proc, port, log = _spawn_proxy(workdir, config, hook_config, files)
    with _serving(proc, port, log, "/health/liveliness", 120, "proxy") as server:
        yield server


def failed_proxy_start(
    workdir: Path, config: Mapping[str, Any], hook_config: str, timeout: float
) -> tuple[int, str]:
    """Start a proxy, with ``hook_config`` (YAML text) as the hook's settings file, that
    must not come up: its exit status and output (a proxy still running after
    ``timeout`` seconds is stopped, and the test fails)."""
    proc, _, log = _spawn_proxy(workdir, config, hook_config, {})
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the proxy is still running:\n{log_tail(log)}") from None
    finally:
        stop_group(proc, grace=10)
    return rc, log.read_text(errors="replace")


def _spawn_proxy(
    workdir: Path,
    config: Mapping[str, Any],
    hook_config: Mapping[str, Any] | str | None,
    files: Mapping[str, str],
) -> tuple[subprocess.Popen[bytes], int, Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (workdir / name).write_text(text)
    (workdir / "config.yaml").write_text(json.dumps(dict(config)))  # JSON is YAML
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="INFO")
    env.pop("AGENTSPEC_LITELLM_CONFIG", None)
    if isinstance(hook_config, str):  # YAML text
        (workdir / "agentspec.yaml").write_text(hook_config)
        env["AGENTSPEC_LITELLM_CONFIG"] = str(workdir / "agentspec.yaml")
    elif hook_config is not None:
        (workdir / "agentspec.json").write_text(json.dumps(dict(hook_config)))
        env["AGENTSPEC_LITELLM_CONFIG"] = str(workdir / "agentspec.json")
    port = free_port()
    log = workdir / "proxy.log"
    cmd = [str(LITELLM_BIN), "--config", str(workdir / "config.yaml")]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    return spawn(cmd, log, env, cwd=workdir), port, log


class Forwarder:
    """Records request bodies and forwards every request to ``target`` unchanged."""

    def __init__(self, target: str) -> None:
        """Listen on a free loopback port; `close` stops it."""
        parts = urlsplit(target)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # close-delimited answers: streams pass as is

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                outer._record(self.command, self.path, dict(self.headers), body)
                conn = http.client.HTTPConnection(outer._host, outer._port, timeout=300)
                try:
                    headers = {
                        k: v
                        for k, v in self.headers.items()
                        if k.lower() not in ("host", "connection", "content-length")
                    }
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    while chunk := resp.read1(65536):
                        self.wfile.write(chunk)
                        self.wfile.flush()
                finally:
                    conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = _forward  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _record(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        entry: dict[str, Any] = {"method": method, "path": path, "headers": headers}
        if headers.get("Content-Type", headers.get("content-type", "")).startswith(
            "application/json"
        ):
            with contextlib.suppress(ValueError):
                entry["json"] = json.loads(body)
        with self._lock:
            self.requests.append(entry)

    def completions(self) -> list[dict[str, Any]]:
        """Recorded JSON bodies of chat / text completion requests, in order."""
        with self._lock:
            return [
                r["json"]
                for r in self.requests
                if r["path"].endswith("/completions") and isinstance(r.get("json"), dict)
            ]

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file's content, None while it does not exist or is being replaced."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    """Poll ``predicate()`` until it returns something truthy; raise on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)
