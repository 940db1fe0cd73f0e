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
from collections.abc import MutableMapping
from typing import Any

import structlog

__all__ = ["LOGGER_NAME", "get_logger"]

LOGGER_NAME = "agentspec"

_stdlib = logging.getLogger(LOGGER_NAME)
_stdlib.addHandler(logging.NullHandler())

#: `logging.LogRecord` attributes: an ``extra`` key among them makes
#: `logging.Logger.makeRecord` raise KeyError (``message=...`` would).
_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}


def _rename_reserved(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Suffix ``_`` to keys that would collide with LogRecord attributes."""
    for key in [k for k in event_dict if k in _RESERVED]:
        event_dict[f"{key}_"] = event_dict.pop(key)
    return event_dict


_logger: Any = structlog.wrap_logger(
    _stdlib,
    wrapper_class=structlog.stdlib.BoundLogger,
    processors=[
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.filter_by_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        _rename_reserved,
        structlog.stdlib.render_to_log_kwargs,
    ],
    cache_logger_on_first_use=True,
)


def get_logger() -> Any:
    """The ``agentspec`` structlog logger (rendering is the application's business)."""
    return _logger
