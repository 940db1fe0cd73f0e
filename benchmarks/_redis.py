"""A real ``redis-server`` for benchmarks: own temporary directory, loopback port, AOF.

`RedisServer` starts ``redis-server`` (``$PATH``) on 127.0.0.1 with a port the
OS picked, ``appendonly yes`` and ``appendfsync everysec`` (Redis's usual
durability setting), waits for the server's "Ready to accept connections"
log line (read by a thread: an event, not a sleep) and a PING, and on exit
stops the server and removes its directory.  (``tests/redis_server.py`` is
the test suite's fuller version; benchmarks do not import from ``tests/``.)
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
from collections import deque
from pathlib import Path
from types import TracebackType

import redis

__all__ = ["REDIS_SERVER", "RedisServer"]

REDIS_SERVER = shutil.which("redis-server")
_READY = "ready to accept connections"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` on loopback (see the module docstring)."""

    def __init__(self, appendfsync: str = "everysec") -> None:
        """Pick the directory and port (the server starts on ``__enter__``)."""
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.dir = Path(tempfile.mkdtemp(prefix="as-bench-redis-", dir="/tmp"))
        self.port = _free_port()
        self.appendfsync = appendfsync
        self.proc: subprocess.Popen[str] | None = None
        self.log: deque[str] = deque(maxlen=200)
        self._reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """An admin client (the default user)."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=30)

    def __enter__(self) -> RedisServer:
        """Start the server and wait until it answers PING."""
        assert REDIS_SERVER is not None
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.dir), "--save", "", "--appendonly", "yes"]
        args += ["--appendfsync", self.appendfsync]
        ready = threading.Event()
        proc = self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.log.append(line.rstrip())
                if _READY in line.lower():
                    ready.set()
            ready.set()  # exited: stop waiting; the check below fails

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not ready.wait(30) or proc.poll() is not None:
            self.__exit__(None, None, None)
            raise RuntimeError("redis-server did not start:\n" + "\n".join(self.log))
        with self.client() as c:
            c.ping()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its directory."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        if self._reader is not None:
            self._reader.join(30)
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)
