"""Redis connections of the fleet: clients, redaction of secrets, and retry with backoff.

Every fleet thread owns its own client (`open_client`): plain RESP2, bytes
in and out, and no retries inside redis-py, so a dead server is reported at
once and the thread's own backoff (`retry_until_stopped`, tenacity's
exponential wait plus jitter, interruptible by the thread's stop event)
decides when to try again.  Nothing here ever raises into a caller's hot
path; the threads log and count instead.

Secrets never leave this module in text: `redact_url` replaces the password
of a URL (in its userinfo or a ``password=`` query parameter) with ``***``,
and `Redactor.scrub` removes it from any error text before that text is
logged, kept as ``last_error`` or shown in a repr.
"""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_not_exception_type,
    wait_exponential,
    wait_random,
)

__all__ = ["Redactor", "open_client", "redact_url", "retry_until_stopped"]

_T = TypeVar("_T")
_MASK = "***"


def redact_url(url: str) -> str:
    """``url`` with its password (userinfo or ``password=`` parameter) as ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable redis url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}:{_MASK}@{host}" if sep else f"{userinfo}@{host}"
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = "&".join(
            f"{k}={_MASK}" if k.lower() == "password" else f"{k}={v}" for k, v in pairs
        )
    out = f"{parts.scheme}://{netloc}{parts.path}"
    return out + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")


class Redactor:
    """Removes the secrets of one Redis URL from text."""

    __slots__ = ("_secrets", "url")

    def __init__(self, url: str) -> None:
        """Remember the URL's password (raw and percent-decoded forms)."""
        self.url = redact_url(url)
        secrets: set[str] = set()
        try:
            parts = urllib.parse.urlsplit(url)
            if parts.password:
                secrets.add(parts.password)
            for k, v in urllib.parse.parse_qsl(parts.query):
                if k.lower() == "password" and v:
                    secrets.add(v)
        except ValueError:
            pass
        secrets |= {urllib.parse.unquote(s) for s in secrets}
        self._secrets = sorted((s for s in secrets if s), key=len, reverse=True)

    def scrub(self, text: str) -> str:
        """``text`` with every secret replaced by ``***``."""
        for s in self._secrets:
            text = text.replace(s, _MASK)
        return text

    def error(self, exc: BaseException) -> str:
        """``"TypeName: message"`` of an exception, scrubbed."""
        return self.scrub(f"{type(exc).__name__}: {exc}")[:500]


def open_client(url: str, *, socket_timeout: float = 10.0) -> redis.Redis:
    """A client for ``url`` (``redis://``, ``rediss://`` or ``unix://``) that never retries."""
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=min(socket_timeout, 5.0),
        retry=Retry(NoBackoff(), 0),
        decode_responses=False,
        protocol=2,
    )


def retry_until_stopped(
    fn: Callable[[], _T],
    stop: threading.Event,
    on_error: Callable[[BaseException], None],
    *,
    initial: float = 0.05,
    maximum: float = 2.0,
) -> _T | None:
    """Call ``fn`` until it returns, waiting with backoff after each exception.

    ``on_error`` sees every exception.  Returns None once ``stop`` is set.
    """

    def before_sleep(state: RetryCallState) -> None:
        if state.outcome is not None and (exc := state.outcome.exception()) is not None:
            on_error(exc)

    def guarded() -> _T:
        if stop.is_set():
            raise _StoppedError
        return fn()

    def sleep(seconds: float) -> None:
        stop.wait(seconds)

    retrying = Retrying(
        sleep=sleep,
        stop=lambda _state: stop.is_set(),
        wait=wait_exponential(multiplier=initial, max=maximum) + wait_random(0, initial),
        retry=retry_if_not_exception_type(_StoppedError),
        before_sleep=before_sleep,
    )
    try:
        return retrying(guarded)
    except (RetryError, _StoppedError):
        return None


class _StoppedError(Exception):
    """Raised inside `retry_until_stopped` once its stop event is set."""
