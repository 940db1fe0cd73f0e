"""Connection bursts against a local HTTP server (the listen-backlog tests).

`open_burst` starts n non-blocking connects at once; `handshakes_done`
says whether all of them completed in the kernel's accept queue within a
window shorter than the first SYN retry (1 s), which a listen backlog too
small for the burst cannot meet; `get_round` then sends one GET on each
socket and returns the errors of those not answered 200.
"""

from __future__ import annotations

import selectors
import socket
import time


def open_burst(port: int, n: int) -> list[socket.socket]:
    """Start n non-blocking TCP connects to 127.0.0.1:port (no waiting between them)."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    return socks


def handshakes_done(socks: list[socket.socket], window: float = 0.9) -> bool:
    """True if every connect completed without error within ``window`` seconds.

    A server that is listening but not accepting yet holds completed
    handshakes in its accept queue; with a backlog smaller than the burst
    the kernel drops the extra SYNs, which are retried only after 1 s.
    Loopback handshakes take microseconds, so the window stays under that
    first retry.
    """
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_WRITE)
    ready: set[object] = set()
    deadline = time.monotonic() + window
    while len(ready) < len(socks) and time.monotonic() < deadline:
        ready |= {k.fileobj for k, _ in sel.select(max(0.0, deadline - time.monotonic()))}
    sel.close()
    return len(ready) == len(socks) and all(
        s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 for s in socks
    )


def get_round(socks: list[socket.socket], path: str, deadline: float) -> list[str]:
    """``GET path`` on each (connecting) socket; the errors of those not answered 200."""
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    sel = selectors.DefaultSelector()
    got: dict[socket.socket, bytes] = {}
    for s in socks:
        sel.register(s, selectors.EVENT_WRITE)
    errors: list[str] = []
    pending = len(socks)
    while pending and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                if key.events == selectors.EVENT_WRITE:
                    s.sendall(request)  # a small request fits the send buffer
                    got[s] = b""
                    sel.modify(s, selectors.EVENT_READ)
                    continue
                piece = s.recv(4096)
            except OSError as exc:
                errors.append(repr(exc))
                piece = b""
            if piece:
                got[s] += piece
                continue
            sel.unregister(s)
            pending -= 1
            if not got.get(s, b"").startswith(b"HTTP/1.1 200"):
                errors.append(f"answer {got.get(s, b'')[:40]!r}")
    errors += ["timed out"] * pending
    sel.close()
    for s in socks:
        s.close()
    return errors
