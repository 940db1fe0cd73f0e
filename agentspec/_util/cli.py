"""Small pieces of the command line: plain-text help, the server's log handler, port checks.

- `plain_text`: a docstring made readable in ``--help`` (reST backticks and
  roles removed).
- `cli_logging`: the ``agentspec`` logger rendered on stderr at a level, for
  as long as a command runs.  The library itself never configures logging
  (`agentspec._util.log`); the CLI is the application, so it may.
- `check_listen`: whether ``host:port`` can be listened on, tried before a
  server loads its model, with an error that names the address.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import socket
import sys
from collections.abc import Iterator
from typing import TextIO

from agentspec._util.log import LOGGER_NAME
from agentspec.exceptions import ListenError

__all__ = [
    "LOG_LEVELS",
    "ListenError",
    "check_listen",
    "cli_logging",
    "plain_text",
]

#: ``--log-level`` choices.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`([^`]+)`")  # :func:`x`, :py:class:`x`
_LITERAL = re.compile(r"``([^`]+)``")
_REFERENCE = re.compile(r"`([^`]+)`_?")


def plain_text(text: str | None) -> str:
    """``text`` without reST markup: ``x``, `x` and :role:`x` become x."""
    out = _ROLE.sub(r"\1", text or "")
    out = _LITERAL.sub(r"\1", out)
    return _REFERENCE.sub(r"\1", out)


def doc_description(doc: str | None) -> str:
    """A module docstring as an argparse description: its body (after the title), plain."""
    return plain_text((doc or "").split("\n\n", 1)[-1].strip())


#: LogRecord attributes that are not event fields (rendered by the format itself).
_RECORD_KEYS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "timestamp",  # structlog's TimeStamper; the handler prints its own time
}


class KeyValueFormatter(logging.Formatter):
    """``TIME LEVEL event key=value ...``: the event fields of structlog records, one line."""

    def __init__(self) -> None:
        """The format is fixed: ISO-like local time, level, event, fields."""
        super().__init__("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        """The base line plus ``key=value`` for every field of the event."""
        line = super().format(record)
        fields = [
            f"{k}={_field(v)}"
            for k, v in vars(record).items()
            if k not in _RECORD_KEYS and not k.startswith("_")
        ]
        if not fields:
            return line
        head, sep, tail = line.partition("\n")  # a traceback stays below the fields
        return f"{head} {' '.join(fields)}{sep}{tail}"


def _field(value: object) -> str:
    if value is None:
        return "-"  # as access logs do: no value
    text = value if isinstance(value, str) else repr(value)
    if not text or any(c.isspace() for c in text) or '"' in text:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


@contextlib.contextmanager
def cli_logging(level: str = "info", stream: TextIO | None = None) -> Iterator[logging.Handler]:
    """Render the ``agentspec`` logger on ``stream`` (default stderr) at ``level`` for the block.

    The handler and the logger's level are removed again on exit, so a
    command run in-process (tests) leaves logging as it found it.
    """
    logger = logging.getLogger(LOGGER_NAME)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    old_level = logger.level
    logger.setLevel(level.upper())
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def check_listen(host: str, port: int) -> None:
    """Raise `ListenError` naming ``host:port`` when a server could not listen there.

    Binds (with ``SO_REUSEADDR``, as the servers do) and releases the address
    at once; port 0 only checks the host.
    """
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenError(f"cannot listen on {where}: unknown host ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            hint = "address already in use: another server listens there (pick another --port)"
        elif e.errno == errno.EACCES:
            hint = "permission denied (ports below 1024 need privileges)"
        elif e.errno == errno.EADDRNOTAVAIL:
            hint = "no such address on this machine (check --host)"
        else:
            hint = e.strerror or str(e)
        raise ListenError(f"cannot listen on {where}: {hint}") from None
    finally:
        sock.close()
