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

It also takes a Cluster URL,
``redis+cluster://[user:pw@]host:port[,host:port...]`` (`parse_cluster_url`):
the client is a `FleetCluster` (a ``redis.cluster.RedisCluster``) that
discovers the nodes with ``CLUSTER SLOTS`` and sends each command to the
master of its key's slot.  It retries nothing either, except following the
cluster's own redirections (``MOVED``/``ASK``, and ``TRYAGAIN`` a few times,
within redis-py's request TTL); a dead node, ``CLUSTERDOWN`` or an exhausted
TTL after a failover end in the thread's own backoff, and the next attempt
finds the promoted replica (redis-py refreshes its slot map on the error).

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

import itertools
import re
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import redis
import redis.cluster
import redis.sentinel
from redis._parsers import CommandsParser
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
    "CLUSTER_SCHEME",
    "SENTINEL_SCHEME",
    "TRANSIENT_CODES",
    "ClusterUrl",
    "FleetCluster",
    "Redactor",
    "SentinelUrl",
    "hash_reply",
    "is_cluster",
    "is_transient",
    "open_client",
    "parse_cluster_url",
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
#: The URL scheme of a Redis Cluster (any of its nodes, each ``host:port``).
CLUSTER_SCHEME = "redis+cluster"
_REDIS_PORT = 6379

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
    # Cluster: "TTL exhausted" after many redirections, a redirection that
    # reaches us (the slot map is refreshed by then), no node of the slot known.
    redis.exceptions.ClusterError,
    redis.exceptions.AskError,  # also MovedError
    redis.exceptions.SlotNotCoveredError,
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
    - ``TRYAGAIN``, ``CLUSTERDOWN``: a Cluster resharding or down (and
      redis-py's cluster errors: a redirection that outlived its TTL, a
      slot no known node serves);
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
    parts, sentinels, user, pw, shown = _multi_host_url(
        url, SENTINEL_SCHEME, "sentinel", "sentinel", _SENTINEL_PORT
    )
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
        user,
        pw,
        query.get("sentinel_username") or None,
        query.get("sentinel_password") or None,
    )


def _multi_host_url(
    url: str, scheme: str, what: str, host_what: str, default_port: int
) -> tuple[urllib.parse.SplitResult, list[tuple[str, int]], str | None, str | None, str]:
    """``(parts, hosts, username, password, redacted url)`` of a many-host fleet URL.

    Raises:
        InvalidArgumentError: unparsable, another scheme, or a bad host or port.
    """
    shown = redact_url(url)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        raise InvalidArgumentError(f"unparsable redis {what} url", shown) from None
    if parts.scheme.lower() != scheme:
        raise InvalidArgumentError(f"not a {scheme}:// url", shown)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    user, sep, pw = userinfo.partition(":")
    return (
        parts,
        _hosts(hosts, default_port, host_what, shown),
        urllib.parse.unquote(user) if at and user else None,
        urllib.parse.unquote(pw) if at and sep else None,
        shown,
    )


def _hosts(text: str, default_port: int, what: str, shown: str) -> list[tuple[str, int]]:
    """``host[:port][,host[:port]...]`` (IPv6 hosts in brackets)."""
    out: list[tuple[str, int]] = []
    for item in text.split(","):
        m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", item)
        if m is None:
            raise InvalidArgumentError(f"bad {what} address in the url", shown)
        host = m.group(1) or m.group(3)
        digits = m.group(2) or m.group(4)
        port = int(digits) if digits else default_port
        if not 0 < port < 65536:
            raise InvalidArgumentError(f"bad {what} port in the url", shown)
        out.append((host, port))
    return out


@dataclass(frozen=True, slots=True)
class ClusterUrl:
    """The parts of a ``redis+cluster://`` URL (see `parse_cluster_url`)."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)


def parse_cluster_url(url: str) -> ClusterUrl:
    """Parse ``redis+cluster://[user:pw@]host[:port][,host[:port]...]``.

    The hosts are startup nodes: any reachable one is enough to discover the
    cluster (masters and replicas alike).  A port defaults to 6379; IPv6
    hosts go in brackets.  ``user:pw`` authenticate with every node (ACL
    users are per node: create them on each, see `tenant_acl_rules`).  No
    path other than ``/`` or ``/0`` (a cluster has one database) and no query
    parameters.

    Raises:
        InvalidArgumentError: not such a URL, or a part of it is malformed
            (the message never holds the password).
    """
    parts, nodes, user, pw, shown = _multi_host_url(
        url, CLUSTER_SCHEME, "cluster", "cluster node", _REDIS_PORT
    )
    if parts.path not in ("", "/", "/0"):
        raise InvalidArgumentError("a cluster url has no path but /0 (one database)", shown)
    if parts.query or parts.fragment:
        raise InvalidArgumentError("a cluster url takes no parameters", shown)
    return ClusterUrl(tuple(nodes), user, pw)


def _first_key(args: tuple[Any, ...]) -> list[Any]:
    return [args[1]]


#: Where the keys are in the commands the fleet sends, so that routing them
#: needs neither ``COMMAND`` nor ``COMMAND GETKEYS`` (a tenant's user may run
#: neither, and each would cost a round trip): command -> its keys.
_SIMPLE_KEYED = (
    "HGET", "HMGET", "HGETALL", "HVALS", "HLEN", "HSTRLEN", "HEXISTS", "HSCAN",
    "XRANGE", "XREVRANGE", "XLEN", "ZRANGEBYSCORE", "ZSCORE", "ZCARD", "TYPE",
    "HSET", "HSETNX", "HDEL", "XADD", "XTRIM", "ZADD", "ZREM", "PEXPIRE",
)  # fmt: skip
_FLEET_KEYS: dict[str, Callable[[tuple[Any, ...]], list[Any]]] = {
    **dict.fromkeys(_SIMPLE_KEYED, _first_key),
    "EXISTS": lambda a: list(a[1:]),
    "FCALL": lambda a: list(a[3 : 3 + int(a[2])]),
    "FCALL_RO": lambda a: list(a[3 : 3 + int(a[2])]),
    "XINFO STREAM": lambda a: [a[1]],
}


def _xread_keys(args: tuple[Any, ...]) -> list[Any] | None:
    """The streams of ``XREAD [COUNT n] [BLOCK ms] STREAMS k... id...``."""
    words = [a.upper() if isinstance(a, str) else a for a in args]
    for marker in ("STREAMS", b"STREAMS"):
        if marker in words:
            rest = args[words.index(marker) + 1 :]
            return list(rest[: len(rest) // 2])
    return None


class _FleetCommandsParser(CommandsParser):
    """redis-py's key finder, told the fleet's commands; asks ``COMMAND`` only for others."""

    def __init__(self, client: Any) -> None:
        self.commands: dict[str, Any] = {}  # filled on the first other command
        self.redis_connection = client

    def get_keys(self, redis_conn: Any, *args: Any) -> Any:
        name = str(args[0]).upper()
        if name == "XREAD":
            keys = _xread_keys(args)
            if keys:
                return keys
        elif name in _FLEET_KEYS:
            try:
                return _FLEET_KEYS[name](args)
            except (IndexError, ValueError):
                pass  # malformed: let redis-py (and Redis) say what is wrong
        if not self.commands:
            self.initialize(redis_conn)  # type: ignore[no-untyped-call]
        return super().get_keys(redis_conn, *args)  # type: ignore[no-untyped-call]


class FleetCluster(redis.cluster.RedisCluster):
    """A ``RedisCluster`` for the fleet's threads (see `open_client`).

    - It routes the fleet's commands by their keys without asking the server
      (`_FleetCommandsParser`): redis-py's own parser starts with ``COMMAND``,
      which a tenant's user may not run.
    - ``connections_made`` counts the connections it opened to any node
      (redis-py's connect hook): the publisher's durability window verifies
      its whole window when it moved, since a new connection may reach a
      restarted node or a promoted replica that lacks acknowledged entries
      (``CLIENT GETNAME`` / ``SETNAME`` cannot tell here: redis-py sends them
      to one node, not to each).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """As ``RedisCluster``; ``redis_connect_func`` is taken by the connection count."""
        self.connections_made = 0
        self.serial = next(_SERIALS)  #: tells this client's count from another's
        self._parser_ready = False
        kwargs["redis_connect_func"] = self._connected
        super().__init__(*args, **kwargs)
        self.commands_parser = _FleetCommandsParser(self)
        self._parser_ready = True

    def _connected(self, connection: Any) -> None:
        self.connections_made += 1  # one thread per client: no lock needed

    def command(self, **kwargs: Any) -> Any:
        """``COMMAND``; while redis-py builds its own parser (replaced at once), nothing."""
        if not self._parser_ready:
            return {}
        return super().command(**kwargs)


_SERIALS = itertools.count(1)


def hash_reply(reply: Any) -> dict[Any, Any]:
    """A hash read (``HGETALL``) as a dict, also from a cluster transaction.

    redis-py's cluster pipeline with ``transaction=True`` returns raw
    replies (a flat field, value list), not the parsed dict.
    """
    if isinstance(reply, dict):
        return reply
    items = list(reply)
    return dict(zip(items[::2], items[1::2], strict=True))


def is_cluster(client: object) -> bool:
    """Whether ``client`` (from `open_client`) talks to a Redis Cluster."""
    return isinstance(client, redis.cluster.RedisCluster)


def open_client(url: str, *, socket_timeout: float = 10.0) -> redis.Redis:
    """A client for ``url`` that never retries by itself.

    ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://`` (the
    master of a Sentinel service, see `parse_sentinel_url`) or
    ``redis+cluster://`` (a `FleetCluster`, see `parse_cluster_url`; typed as
    ``redis.Redis``, whose commands the fleet sends it; `is_cluster` tells).

    Raises:
        InvalidArgumentError: a malformed sentinel or cluster URL.
        ValueError: another malformed URL (redis-py's message).
        redis.RedisError, redis.exceptions.RedisClusterException: no cluster
            node could be reached (a cluster client connects at once).
    """
    timeouts: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": min(socket_timeout, 5.0),
        "retry": Retry(NoBackoff(), 0),
    }
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == CLUSTER_SCHEME:
        cu = parse_cluster_url(url)
        cluster = FleetCluster(
            startup_nodes=[
                redis.cluster.ClusterNode(h, p)  # type: ignore[no-untyped-call]
                for h, p in cu.nodes
            ],
            username=cu.username,
            password=cu.password,
            decode_responses=False,
            protocol=2,
            # The cluster-level retry: none beyond redirections (MOVED/ASK/TRYAGAIN
            # within redis-py's TTL); the node connections get none either.
            **timeouts,
        )
        return cast("redis.Redis", cluster)
    if scheme != SENTINEL_SCHEME:
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
