"""Threaded HTTP/1.1 server plumbing shared by the shard intake and the engine server.

`ThreadedHTTPServer` is the stdlib `ThreadingHTTPServer` with daemon handler
threads, a listen backlog sized for bursts of clients (`LISTEN_BACKLOG`), a
registry of open connections (`stop` closes them all, so a client holding a
keep-alive connection sees the restart), ``port``/``url`` properties and
routine disconnects logged at debug level.  `TrackedRequestHandler` is the
request-handler base that goes with it: HTTP/1.1 keep-alive, TCP_NODELAY, an
idle timeout, its connection registered with the server, access lines through
the structured log instead of stderr.

What a request means (routes, bodies, answers) is the subclasses' business:
`agentspec._push.intake` serves the shard push routes, `agentspec.engine`
the OpenAI routes (and mounts the intake's).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agentspec._util.log import get_logger

__all__ = ["LISTEN_BACKLOG", "ThreadedHTTPServer", "TrackedRequestHandler"]

_log = get_logger()

#: ``listen()`` backlog of `ThreadedHTTPServer` (socketserver's default, 5, drops
#: bursts of connections: clients then wait for SYN retransmits, or time out;
#: the kernel caps it at ``net.core.somaxconn``).
LISTEN_BACKLOG = 1024


class ThreadedHTTPServer(ThreadingHTTPServer):
    """A `ThreadingHTTPServer` (keep-alive, HTTP/1.1) that can drop its open connections.

    `stop` closes the listening socket *and* every open connection, so a
    client holding a keep-alive connection sees the restart.  Log events are
    named ``<log_name>.connection_lost`` and ``<log_name>.request_failed``.
    """

    daemon_threads = True
    block_on_close = False
    #: ``listen()`` backlog: a burst of pushers (or clients) is queued by the
    #: kernel instead of dropped (socketserver's default is 5).
    request_queue_size = LISTEN_BACKLOG
    #: Prefix of this server's log events (and of its handlers' access lines).
    log_name = "agentspec.http"

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[TrackedRequestHandler],
    ) -> None:
        """Bind to ``address`` (port 0: any free port) without serving yet."""
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, handler)

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        """``http://host:port`` of this server."""
        host = self.server_address[0]
        if isinstance(host, bytes):
            host = host.decode()
        return f"http://{host}:{self.port}"

    def track(self, conn: socket.socket, add: bool) -> None:
        """Register (add) or forget an open connection."""
        with self._conns_lock:
            if add:
                self._conns.add(conn)
            else:
                self._conns.discard(conn)

    def drop_connections(self) -> None:
        """Shut every open connection down (their handler threads then end)."""
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Log a failed request (a client dropping its connection is routine)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            _log.debug(
                f"{self.log_name}.connection_lost", client=str(client_address), error=str(exc)
            )
        else:
            _log.exception(f"{self.log_name}.request_failed", client=str(client_address))

    def stop(self, thread: threading.Thread | None = None, timeout: float = 5.0) -> None:
        """Stop serving, close every connection and the socket, join ``thread``."""
        self.shutdown()
        self.drop_connections()
        self.server_close()
        if thread is not None:
            thread.join(timeout)


class TrackedRequestHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive handler whose connection the `ThreadedHTTPServer` tracks."""

    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: without TCP_NODELAY, Nagle's
    # algorithm and the client's delayed ACK add ~40 ms to every answer.
    disable_nagle_algorithm = True
    server: ThreadedHTTPServer
    #: Idle keep-alive connections are closed after this many seconds.
    timeout = 60.0

    def setup(self) -> None:
        """Register the connection with the server."""
        super().setup()
        self.server.track(self.connection, True)

    def finish(self) -> None:
        """Forget the connection."""
        self.server.track(self.connection, False)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        """Log through structlog at debug level instead of stderr."""
        _log.debug(f"{self.server.log_name}.http", line=format % args)
