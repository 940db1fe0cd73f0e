"""A real ``redis-server`` for tests: started in a temporary directory, stopped after.

`RedisServer` runs ``/usr/bin/redis-server`` (Debian's package) on a unix
socket in a short temporary directory (socket paths are limited to 107
bytes), optionally also on 127.0.0.1 with a port the OS picked.  It waits
for the server's own "Ready to accept connections" log line (read from its
stdout by a thread, an event, not a sleep), then for a PING to answer.
`kill` is a crash (SIGKILL); `start` again reuses the directory, so with
``appendfsync always`` (the default here) every acknowledged write comes
back (``appendfsync="everysec"`` for Redis's usual setting); ``persist=False``
turns persistence off, so a restart loses all.  ``tls=True`` serves the port
over TLS only, with a throwaway CA and server certificate made by the
``openssl`` command (`url_for` then gives ``rediss://`` URLs that name the
CA file).  ``extra_args`` go last on the command line (e.g.
``["--replicaof", "127.0.0.1", "6379"]``); `tcp_url` is the plain TCP URL.

Where the ``redis-server`` binary or the ``redis`` client is missing, tests
skip with the reason outside CI and fail under it (the rule of tests/prereq.py;
`.ci/run` installs both).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from prereq import require_module, requires

redis = require_module("redis", reason="the redis client is not installed")

REDIS_SERVER = shutil.which("redis-server")

requires_redis_server = requires(
    REDIS_SERVER is not None, "redis-server is not installed (apt-get install redis-server)"
)

_READY = "ready to accept connections"


def eventually(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes (state with no event to wait on)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process (see the module docstring)."""

    def __init__(
        self,
        *,
        tcp: bool = False,
        persist: bool = True,
        appendfsync: str = "always",
        tls: bool = False,
        extra_args: list[str] | None = None,
    ) -> None:
        """Prepare the directory (the server starts with `start`)."""
        assert REDIS_SERVER is not None
        self.dir = Path(tempfile.mkdtemp(prefix="as-redis-", dir="/tmp"))
        self.socket = self.dir / "r.sock"
        self.port = _free_port() if tcp or tls else 0
        self.tls = tls
        self.persist = persist
        self.appendfsync = appendfsync
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[str] | None = None
        self.reader: threading.Thread | None = None
        self.log: deque[str] = deque(maxlen=200)

    def args(self) -> list[str]:
        """The redis-server command line."""
        assert REDIS_SERVER is not None
        args = [REDIS_SERVER, "--port", str(self.port), "--unixsocket", str(self.socket)]
        args += ["--unixsocketperm", "700", "--dir", str(self.dir), "--save", ""]
        if self.tls:
            d = self.dir / "tls"
            if not d.exists():
                _make_certificates(d)
            args[1:3] = ["--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", str(d / "server.pem"), "--tls-key-file"]
            args += [str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.pem")]
            args += ["--tls-auth-clients", "no"]
        if self.port:
            args += ["--bind", "127.0.0.1"]
        if self.persist:
            args += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        else:
            args += ["--appendonly", "no"]
        return args + self.extra_args

    def start(self, timeout: float = 20.0) -> None:
        """Start the server and wait until it answers PING."""
        ready = threading.Event()
        self.proc = subprocess.Popen(
            self.args(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        proc = self.proc

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.log.append(line.rstrip())
                if _READY in line.lower():
                    ready.set()
            ready.set()  # exited: stop waiting, the check below fails

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not ready.wait(timeout) or proc.poll() is not None:
            self.kill()
            raise RuntimeError("redis-server did not start:\n" + "\n".join(self.log))
        with self.client() as c:
            assert c.ping()

    @property
    def url(self) -> str:
        """The unix-socket URL, no credentials."""
        return f"unix://{self.socket}"

    @property
    def tcp_url(self) -> str:
        """The TCP URL on 127.0.0.1, no credentials (the server needs ``tcp=True``)."""
        assert self.port, "a TCP port (tcp=True)"
        assert not self.tls, "plain TCP, not TLS"
        return f"redis://127.0.0.1:{self.port}/0"

    def url_for(self, user: str, password: str, *, tcp: bool = False) -> str:
        """A URL with credentials (unix socket, or TCP when the server has a port)."""
        if self.tls:
            ca = self.dir / "tls" / "ca.pem"
            return f"rediss://{user}:{password}@127.0.0.1:{self.port}/0?ssl_ca_certs={ca}"
        if tcp:
            return f"redis://{user}:{password}@127.0.0.1:{self.port}/0"
        return f"unix://{user}:{password}@{self.socket}"

    def client(self) -> redis.Redis:
        """An admin client (the default user)."""
        return redis.Redis(unix_socket_path=str(self.socket), socket_timeout=10)

    def kill(self) -> None:
        """SIGKILL the server (a crash) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self._close_pipe()

    def stop(self) -> None:
        """SIGTERM the server and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipe()

    def _close_pipe(self) -> None:
        # The reader ends at EOF once the server is gone; then its pipe can close.
        if self.reader is not None:
            self.reader.join(30)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> RedisServer:
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
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _make_certificates(folder: Path) -> None:
    """A CA and a server certificate for 127.0.0.1 signed by it, in ``folder``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is missing (apt-get install openssl)")
    folder.mkdir()
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (folder / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for cmd in (
        ["req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=agentspec-test-ca"],
        ["req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext"],
    ):  # fmt: skip
        subprocess.run([openssl, *cmd], cwd=folder, check=True, capture_output=True, timeout=60)
