"""The threaded HTTP server base shared by the shard intake and the engine server."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler

from agentspec._util.http_server import LISTEN_BACKLOG, ThreadedHTTPServer, TrackedRequestHandler


class _Hello(TrackedRequestHandler, BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_serves_keep_alive_and_stop_drops_open_connections() -> None:
    server = ThreadedHTTPServer(("127.0.0.1", 0), _Hello)
    assert server.request_queue_size == LISTEN_BACKLOG
    assert server.url == f"http://127.0.0.1:{server.port}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        for _ in range(2):  # one connection, two requests (HTTP/1.1 keep-alive)
            conn.request("GET", "/")
            resp = conn.getresponse()
            assert (resp.status, resp.read()) == (200, b"hello")
        assert len(server._conns) == 1
        server.stop(thread)
        assert not thread.is_alive()
        conn.request("GET", "/")
        try:
            got = conn.getresponse().status
        except (ConnectionError, http.client.HTTPException, OSError):
            got = None
        assert got is None  # the kept-alive connection was shut down
    finally:
        conn.close()
