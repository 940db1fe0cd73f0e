"""The package logger.

agentspec logs through structlog and never configures logging itself: how
(and whether) records are rendered is up to the application.
"""

from __future__ import annotations

from typing import Any

import structlog

__all__ = ["get_logger"]


def get_logger() -> Any:
    """The ``agentspec`` structlog logger (a lazy proxy; configuration is the app's)."""
    return structlog.get_logger("agentspec")
