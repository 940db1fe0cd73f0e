"""agentspec._util.procs: server subprocesses started, awaited and stopped as a group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agentspec._util.procs import free_port, log_tail, spawn, stop_group, wait_healthy


def test_a_server_is_awaited_and_its_group_stopped(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    script = (
        "import http.server\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler)"
        ".serve_forever()\n"
    )
    proc = spawn([sys.executable, "-c", script], log, cwd=tmp_path)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}/", 30, log)
    finally:
        stop_group(proc, grace=5)
    assert proc.returncode is not None
    assert '"GET / HTTP/1.1" 200' in log_tail(log)


def test_an_early_exit_fails_with_the_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc = spawn([sys.executable, "-c", "print('bad flag --x'); raise SystemExit(3)"], log)
    with pytest.raises(RuntimeError, match=r"exited with 3 before(.|\n)*bad flag --x"):
        wait_healthy(proc, f"http://127.0.0.1:{free_port()}/health", 30, log)


def test_a_timeout_stops_the_server(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc = spawn([sys.executable, "-c", "import time; time.sleep(600)"], log)
    with pytest.raises(RuntimeError, match="did not answer within 1"):
        wait_healthy(proc, f"http://127.0.0.1:{free_port()}/health", 1, log)
    assert proc.poll() is not None
    assert log_tail(tmp_path / "missing.log") == ""
