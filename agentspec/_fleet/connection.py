"""Redis connections of the fleet: clients, redaction of secrets, and retry with backoff.

Every fleet thread owns its own client (`open_client`): plain RESP2, bytes
in and out, and no retries inside redis-py, so a dead server is reported at
once and the thread's own backoff (`retry_until_stopped`, tenacity's
exponential wait plus jitter, interruptible by the thread's stop event)
decides when to try again.  Nothing here ever raises into a caller's hot
path; the threads log and count instead.

`open_client` also takes a Sentinel URL,
``redis+sentinel://[user:pw@]host:port[,host:port...]/SERVICE[/DB]`` (query
parameters ``sentinel_username=`` / ``sentinel_password=`` for the
sentinels' own auth): the client asks the sentinels for SERVICE's current
master on every new connection (redis-py's ``SentinelConnectionPool``), and
a master that was demoted under it answers READONLY, which redis-py turns
into a connection error, so the next attempt finds the new master.

`is_transient` decides which errors are worth retrying (a replica, a
failover in progress, a loading server ...) and which refuse an entry for
good.

Secrets never leave this module in text: `redact_url` replaces the
passwords of a URL (in its userinfo, a ``password=`` or a
``sentinel_password=`` query parameter) with ``***``, and `Redactor.scrub`
removes them from any error text before that text is logged, kept as
``last_error`` or shown in a repr.
"""

from __future__ import annotations

import re
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
import redis.sentinel
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

from agentspec.exceptions import InvalidArgumentError

__all__ = [
    "SENTINEL_SCHEME",
    "TRANSIENT_CODES",
    "Redactor",
    "SentinelUrl",
    "is_transient",
    "open_client",
    "parse_sentinel_url",
    "redact_url",
    "retry_until_stopped",
]

_T = TypeVar("_T")
_MASK = "***"
#: Query parameters that hold a password.
_SECRET_PARAMS = frozenset({"password", "sentinel_password"})
#: The URL scheme of a Redis Sentinel deployment.
SENTINEL_SCHEME = "redis+sentinel"
_SENTINEL_PORT = 26379

#: Error replies that refuse a write for now, not for good (see `is_transient`).
TRANSIENT_CODES = (
    "READONLY",
    "NOREPLICAS",
    "LOADING",
    "BUSY",
    "MASTERDOWN",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "OOM",
    "MISCONF",
    "NOMASTERLINK",
)
# The code starts the reply, or follows "-" (a Lua error before Redis 7) or
# ": " (redis-py's "Command # 1 (...) of pipeline caused error: CODE ...").
_TRANSIENT_RE = re.compile(r"(?:^|-|: )(" + "|".join(TRANSIENT_CODES) + r")(?: |$)")
_TRANSIENT_CLASSES: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,  # also BusyLoadingError, MasterNotFoundError
    redis.exceptions.TimeoutError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,  # also MasterDownError
)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` refuses a Redis call for now (retry later) rather than for good.

    Transient: no connection or a timeout (``redis.ConnectionError``,
    ``redis.TimeoutError``, and redis-py's subclasses), and these error
    replies, recognised by redis-py's class or by the reply's code, also
    where a Lua script or a pipeline wraps the reply's text:

    - ``READONLY``: a replica (e.g. a demoted master right after a failover);
    - ``NOREPLICAS``: fewer good replicas than ``min-replicas-to-write``;
    - ``LOADING``: the server is loading its data set;
    - ``BUSY``: a script or function is running too long;
    - ``MASTERDOWN``: a replica lost its master (``replica-serve-stale-data no``);
    - ``TRYAGAIN``, ``CLUSTERDOWN``: a Cluster resharding or down;
    - ``OOM``: over ``maxmemory`` (a compaction may trim);
    - ``MISCONF``: writes stopped after a failed RDB save;
    - ``NOMASTERLINK``: a replica not yet linked to its master.

    Everything else is permanent (``NOPERM``, ``WRONGTYPE``, an oversized
    entry, ``NOSCRIPT`` is handled by redis-py ...).
    """
    if isinstance(exc, _TRANSIENT_CLASSES):
        return True
    if not isinstance(exc, redis.exceptions.ResponseError):
        return False
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and code in TRANSIENT_CODES:
        return True
    return _TRANSIENT_RE.search(str(exc).strip()) is not None


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
            f"{k}={_MASK}" if k.lower() in _SECRET_PARAMS else f"{k}={v}" for k, v in pairs
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
            userinfo, at, _ = parts.netloc.rpartition("@")
            if at and ":" in userinfo:
                secrets.add(userinfo.partition(":")[2])
            for k, v in urllib.parse.parse_qsl(parts.query):
                if k.lower() in _SECRET_PARAMS and v:
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


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    """The parts of a ``redis+sentinel://`` URL (see `parse_sentinel_url`)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Parse ``redis+sentinel://[user:pw@]host[:port][,host[:port]...]/SERVICE[/DB]``.

    ``user:pw`` authenticates with the master (and its replicas); the query
    parameters ``sentinel_username`` and ``sentinel_password`` with the
    sentinels.  A port defaults to 26379; IPv6 hosts go in brackets.

    Raises:
        InvalidArgumentError: not such a URL, or a part of it is malformed
            (the message never holds the password).
    """
    shown = redact_url(url)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        raise InvalidArgumentError("unparsable redis sentinel url", shown) from None
    if parts.scheme.lower() != SENTINEL_SCHEME:
        raise InvalidArgumentError(f"not a {SENTINEL_SCHEME}:// url", shown)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    user, sep, pw = userinfo.partition(":")
    sentinels: list[tuple[str, int]] = []
    for item in hosts.split(","):
        m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", item)
        if m is None:
            raise InvalidArgumentError("bad sentinel address in the url", shown)
        host = m.group(1) or m.group(3)
        digits = m.group(2) or m.group(4)
        port = int(digits) if digits else _SENTINEL_PORT
        if not 0 < port < 65536:
            raise InvalidArgumentError("bad sentinel port in the url", shown)
        sentinels.append((host, port))
    path = [urllib.parse.unquote(p) for p in parts.path.split("/")[1:]]
    if not path or not path[0] or len(path) > 2:
        raise InvalidArgumentError("the sentinel url needs /SERVICE[/DB]", shown)
    db = 0
    if len(path) == 2 and path[1]:
        if not path[1].isdigit():
            raise InvalidArgumentError("the database in the sentinel url is not a number", shown)
        db = int(path[1])
    query: dict[str, str] = {}
    for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if k not in ("sentinel_username", "sentinel_password"):
            raise InvalidArgumentError(f"unknown parameter in the sentinel url: {k}", shown)
        query[k] = v
    return SentinelUrl(
        tuple(sentinels),
        path[0],
        db,
        urllib.parse.unquote(user) if at and user else None,
        urllib.parse.unquote(pw) if at and sep else None,
        query.get("sentinel_username") or None,
        query.get("sentinel_password") or None,
    )


def open_client(url: str, *, socket_timeout: float = 10.0) -> redis.Redis:
    """A client for ``url`` that never retries by itself.

    ``redis://``, ``rediss://``, ``unix://``, or ``redis+sentinel://`` (the
    master of a Sentinel service, see `parse_sentinel_url`).

    Raises:
        InvalidArgumentError: a malformed sentinel URL.
        ValueError: another malformed URL (redis-py's message).
    """
    timeouts: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": min(socket_timeout, 5.0),
        "retry": Retry(NoBackoff(), 0),
    }
    if urllib.parse.urlsplit(url).scheme.lower() != SENTINEL_SCHEME:
        return redis.Redis.from_url(url, decode_responses=False, protocol=2, **timeouts)
    su = parse_sentinel_url(url)
    sentinel_kwargs: dict[str, Any] = dict(timeouts, protocol=2)
    if su.sentinel_username is not None:
        sentinel_kwargs["username"] = su.sentinel_username
    if su.sentinel_password is not None:
        sentinel_kwargs["password"] = su.sentinel_password
    sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        list(su.sentinels), sentinel_kwargs=sentinel_kwargs
    )
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        su.service,
        db=su.db,
        username=su.username,
        password=su.password,
        decode_responses=False,
        protocol=2,
        **timeouts,
    )
    return client


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
