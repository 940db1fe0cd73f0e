"""The package logger.

agentspec logs through structlog and never configures logging itself: it never
calls ``structlog.configure`` (process-global state that belongs to the
application).  Its logger is a library-local structlog pipeline that ends in
the standard-library logger ``"agentspec"``, which carries a `NullHandler`:
silent by default, and rendered however the application configures stdlib
logging once it attaches a handler and a level to ``"agentspec"`` (or the
root logger).  Values bound with ``structlog.contextvars`` (session, stage)
arrive as attributes of the `logging.LogRecord`.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["LOGGER_NAME", "get_logger"]

LOGGER_NAME = "agentspec"

_stdlib = logging.getLogger(LOGGER_NAME)
_stdlib.addHandler(logging.NullHandler())

_logger: Any = structlog.wrap_logger(
    _stdlib,
    wrapper_class=structlog.stdlib.BoundLogger,
    processors=[
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.filter_by_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        structlog.stdlib.render_to_log_kwargs,
    ],
    cache_logger_on_first_use=True,
)


def get_logger() -> Any:
    """The ``agentspec`` structlog logger (rendering is the application's business)."""
    return _logger
