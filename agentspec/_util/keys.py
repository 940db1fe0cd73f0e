"""The API key variables: one for every command, plus each ecosystem's own.

``$AGENTSPEC_API_KEY`` is the one variable every agentspec command reads:
``agentspec serve`` (the key it demands), ``agentspec shards push|status``
and ``agentspec demo --base-url`` (the key they send), and `AgentSpecClient`
(its openai client's key and the key of its shard pushes).  Set it once and
the server and its clients agree.

Each side also honours its ecosystem's usual variable, after
``$AGENTSPEC_API_KEY``: the server ``$VLLM_API_KEY`` (what ``vllm serve``
reads), the clients ``$OPENAI_API_KEY`` (what the openai client reads).
A key given on the command line or as an argument always wins.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = [
    "API_KEY_ENV",
    "CLIENT_KEY_ENVS",
    "SERVER_KEY_ENVS",
    "client_api_key",
    "server_api_key",
]

#: The API key variable of every agentspec command.
API_KEY_ENV = "AGENTSPEC_API_KEY"
#: What a server (``agentspec serve``) reads, in order.
SERVER_KEY_ENVS = (API_KEY_ENV, "VLLM_API_KEY")
#: What a client (shards push/status, demo, AgentSpecClient) reads, in order.
CLIENT_KEY_ENVS = (API_KEY_ENV, "OPENAI_API_KEY")


def _first(names: tuple[str, ...], environ: Mapping[str, str] | None) -> str | None:
    env = os.environ if environ is None else environ
    for name in names:
        value = env.get(name)
        if value:
            return value
    return None


def server_api_key(
    explicit: str | None = None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The key a server demands: ``explicit``, else ``$AGENTSPEC_API_KEY``, ``$VLLM_API_KEY``."""
    return explicit or _first(SERVER_KEY_ENVS, environ)


def client_api_key(
    explicit: str | None = None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The key a client sends: ``explicit``, else ``$AGENTSPEC_API_KEY``, ``$OPENAI_API_KEY``."""
    return explicit or _first(CLIENT_KEY_ENVS, environ)
