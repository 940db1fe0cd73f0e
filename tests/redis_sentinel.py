"""Real ``redis-sentinel`` processes for tests: started in a temporary directory, stopped after.

`RedisSentinel` writes a config file (sentinel rewrites it, so it lives in
its own directory) that monitors one master on 127.0.0.1 under a service
name, with quorum 1, a short ``down-after-milliseconds`` and
``failover-timeout``, and runs ``/usr/bin/redis-sentinel`` on a port the OS
picked.  Its log (stdout) is read by a thread; `wait_log` waits for a line
holding a text (an event, not a sleep), e.g. ``"+slave "`` once it found a
replica, ``"+sentinel "`` once it met another sentinel, ``"+switch-master"``
after a failover.  `master` asks it ``SENTINEL get-master-addr-by-name``.
`sentinel_url` builds the ``redis+sentinel://`` URL of a group of them.

Where the ``redis-sentinel`` binary is missing (Debian's ``redis-sentinel``
package, or ``redis-server --sentinel``), tests skip outside CI and fail under
it (tests/prereq.py).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from prereq import requires
from redis_server import REDIS_SERVER, _free_port, redis

REDIS_SENTINEL = shutil.which("redis-sentinel")

requires_redis_sentinel = requires(
    REDIS_SENTINEL is not None or REDIS_SERVER is not None,
    "redis-sentinel is not installed (apt-get install redis-sentinel)",
)


class RedisSentinel:
    """One redis-sentinel process (see the module docstring)."""

    def __init__(
        self,
        master_port: int,
        *,
        service: str = "fleet",
        down_after_ms: int = 500,
        failover_timeout_ms: int = 3000,
    ) -> None:
        """Prepare the directory and config (the sentinel starts with `start`)."""
        self.dir = Path(tempfile.mkdtemp(prefix="as-sentinel-", dir="/tmp"))
        self.port = _free_port()
        self.service = service
        self.config = self.dir / "sentinel.conf"
        self.config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"sentinel monitor {service} 127.0.0.1 {master_port} 1\n"
            f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
            f"sentinel failover-timeout {service} {failover_timeout_ms}\n"
            f"sentinel parallel-syncs {service} 1\n"
        )
        self.proc: subprocess.Popen[str] | None = None
        self.reader: threading.Thread | None = None
        self.log: list[str] = []
        self._changed = threading.Condition()

    def start(self, timeout: float = 20.0) -> None:
        """Start the sentinel and wait until it monitors its master."""
        if REDIS_SENTINEL is not None:
            args = [REDIS_SENTINEL, str(self.config)]
        else:
            assert REDIS_SERVER is not None
            args = [REDIS_SERVER, str(self.config), "--sentinel"]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        proc = self.proc

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                with self._changed:
                    self.log.append(line.rstrip())
                    self._changed.notify_all()
            with self._changed:
                self.log.append("<exited>")
                self._changed.notify_all()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not self.wait_log(f"+monitor master {self.service} ", timeout):
            self.stop()
            raise RuntimeError("redis-sentinel did not start:\n" + "\n".join(self.log))

    def wait_log(self, text: str, timeout: float, *, count: int = 1) -> bool:
        """Wait until ``count`` log lines hold ``text`` (False on timeout or exit)."""

        def seen() -> bool:
            return sum(text in line for line in self.log) >= count or "<exited>" in self.log

        with self._changed:
            self._changed.wait_for(seen, timeout)
            return sum(text in line for line in self.log) >= count

    def client(self) -> redis.Redis:
        """A client for the sentinel itself."""
        return redis.Redis("127.0.0.1", self.port, socket_timeout=10, decode_responses=True)

    def master(self) -> tuple[str, int] | None:
        """The master's address as this sentinel sees it now."""
        with self.client() as c:
            addr = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        return None if addr is None else (str(addr[0]), int(addr[1]))

    def stop(self) -> None:
        """SIGTERM the sentinel, wait for it and remove its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        if self.reader is not None:
            self.reader.join(30)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisSentinel:
        """Start; stopped and removed on exit."""
        try:
            self.start()
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the sentinel."""
        self.stop()


def sentinel_url(ports: Sequence[int], service: str, *, auth: str = "") -> str:
    """The ``redis+sentinel://`` URL of sentinels on 127.0.0.1 at ``ports``."""
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    return f"redis+sentinel://{auth + '@' if auth else ''}{hosts}/{service}/0"
