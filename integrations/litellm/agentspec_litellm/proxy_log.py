"""The hook's log lines in the LiteLLM proxy's own log.

agentspec logs to the standard-library logger ``"agentspec"``, which only
has a `logging.NullHandler`: a library never configures its application's
logging.  Inside a LiteLLM proxy, though, the proxy is the application and
its log is where an operator looks, so `forward_to_litellm` (called when the
proxy loads the hook) hands every record that reaches ``"agentspec"`` --
warnings and errors, unless the application lowers that logger's level --
to the handlers of LiteLLM's ``"LiteLLM Proxy"`` logger, with the record's
fields written into its message (``event key=value ...``).
"""

from __future__ import annotations

import logging
import threading

__all__ = ["LITELLM_PROXY_LOGGER", "forward_to_litellm"]

#: LiteLLM's proxy logger (``litellm._logging.verbose_proxy_logger``).
LITELLM_PROXY_LOGGER = "LiteLLM Proxy"
#: The standard-library logger agentspec logs to.
_AGENTSPEC_LOGGER = "agentspec"
#: Attributes every `logging.LogRecord` has; the others are the event's fields.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "timestamp",  # structlog's; LiteLLM's format has its own time
}
_lock = threading.Lock()


class _ToLiteLLM(logging.Handler):
    """Re-emits ``agentspec`` records through LiteLLM's proxy log handlers."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = {k: v for k, v in vars(record).items() if k not in _STANDARD}
            text = " ".join([record.getMessage(), *(f"{k}={v!r}" for k, v in fields.items())])
            out = logging.makeLogRecord({**vars(record), "msg": text, "args": None})
            for handler in logging.getLogger(LITELLM_PROXY_LOGGER).handlers:
                if out.levelno >= handler.level:
                    handler.handle(out)
        except Exception:
            self.handleError(record)


def forward_to_litellm() -> None:
    """Send the ``agentspec`` logger's records to LiteLLM's proxy log (idempotent)."""
    logger = logging.getLogger(_AGENTSPEC_LOGGER)
    with _lock:
        if not any(isinstance(h, _ToLiteLLM) for h in logger.handlers):
            logger.addHandler(_ToLiteLLM())
