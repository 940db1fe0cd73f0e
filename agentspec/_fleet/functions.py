"""Calling the fleet's Redis function library (`_fleet_scripts`), loading it when allowed.

`fcall` runs one function (``FCALL``, or ``FCALL_RO`` for the read-only
ones).  When Redis answers ``Function not found`` (never loaded, or lost by
a restart without persistence) and the connection may run ``FUNCTION
LOAD`` (an admin, e.g. the default user), `load_library` loads it and the
call is retried once; a tenant user may not, and gets `LibraryMissingError`,
which names ``agentspec fleet setup``.  In a pipeline the reply is the
error; `is_missing` tells it apart so the caller can `load_library` and
send again.

In a Redis Cluster a function library lives on each node: `load_library`
loads it on every primary (``FUNCTION LOAD`` is replicated, so each replica
gets it from its primary and still has it once promoted).  A primary added
later needs ``agentspec fleet setup`` again (or an admin client's first
``Function not found`` there loads it on every primary).
"""

from __future__ import annotations

from typing import Any, cast

import redis
import redis.cluster

from agentspec._fleet.connection import is_cluster
from agentspec._fleet.scripts import LIBRARY, LIBRARY_NAME, READ_FUNCTIONS

__all__ = ["LibraryMissingError", "fcall", "function_name", "is_missing", "load_library"]


class LibraryMissingError(redis.exceptions.ConnectionError):
    """The function library is not loaded and this user may not load it.

    A `redis.ConnectionError`, so the fleet's threads keep retrying (with
    backoff) until an admin loads it, and report it meanwhile.
    """


def function_name(name: str) -> str:
    """The full name of the library function ``name``."""
    return f"{LIBRARY_NAME}_{name}"


def is_missing(exc: object) -> bool:
    """Whether ``exc`` is Redis saying the function does not exist."""
    return isinstance(exc, redis.ResponseError) and "Function not found" in str(exc)


def load_library(client: redis.Redis) -> None:
    """``FUNCTION LOAD REPLACE`` the library.

    Raises:
        LibraryMissingError: this user may not load functions.
    """
    try:
        if is_cluster(client):
            # Every primary: redis-py's default for FUNCTION LOAD, said explicitly.
            cast("Any", client).execute_command(
                "FUNCTION LOAD", "REPLACE", LIBRARY, target_nodes=redis.RedisCluster.PRIMARIES
            )
        else:
            client.function_load(LIBRARY, replace=True)
    except redis.exceptions.NoPermissionError:
        raise LibraryMissingError(
            f"the Redis function library {LIBRARY_NAME} is not loaded and this user may not "
            "load it: run `agentspec fleet setup --redis ADMIN_URL`"
        ) from None


def _send(target: Any, name: str, keys: list[str], args: list[Any]) -> Any:
    cmd = "FCALL_RO" if name in READ_FUNCTIONS else "FCALL"
    return target.execute_command(cmd, function_name(name), len(keys), *keys, *args)


def fcall(
    client: redis.Redis | redis.client.Pipeline,
    name: str,
    keys: list[str],
    args: list[Any],
) -> Any:
    """Run the library function ``name`` (queued only, on a pipeline).

    Raises:
        LibraryMissingError: it is not loaded and this user may not load it.
        redis.RedisError: whatever else Redis answers.
    """
    if isinstance(client, (redis.client.Pipeline, redis.cluster.ClusterPipeline)):
        return _send(client, name, keys, args)
    try:
        return _send(client, name, keys, args)
    except redis.ResponseError as e:
        if not is_missing(e):
            raise
    load_library(client)
    return _send(client, name, keys, args)
