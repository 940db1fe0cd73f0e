"""Server subprocesses for tests and benchmarks: start, wait until healthy, stop.

A server (vLLM, a LiteLLM proxy, agentspec's engine) runs in its own process
group with its output in a log file; `wait_healthy` polls a URL until it
answers 200 (failing early, with the end of the log, when the process
exits); `stop_group` sends SIGTERM to the whole group and SIGKILL after a
grace period, so workers the server forked go too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["free_port", "log_tail", "spawn", "stop_group", "wait_healthy"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(
    argv: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new process group, stdout and stderr into ``log_path``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            cwd=cwd,
            start_new_session=True,
        )


def log_tail(log_path: Path, n: int = 4000) -> str:
    """The last ``n`` characters of a log file ("" if it cannot be read)."""
    try:
        return log_path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout: float, log_path: Path) -> None:
    """Poll ``url`` until it answers 200.

    Raises:
        RuntimeError: the process exited first, or ``timeout`` seconds
            passed (the process is then stopped); the message ends with the
            log's tail.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{proc.args!r} exited with {proc.returncode} before {url} answered:\n"
                f"{log_tail(log_path)}"
            )
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.5)
    stop_group(proc)
    raise RuntimeError(f"{url} did not answer within {timeout} s:\n{log_tail(log_path)}")


def stop_group(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM the process group of ``proc``, SIGKILL it after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
