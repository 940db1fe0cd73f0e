"""Flags of ``agentspec serve`` that only one engine takes, and the Redis URL of both."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from agentspec._util import secrets_source
from agentspec._util.secrets_source import (
    RedisUrl,
)
from agentspec.exceptions import InvalidArgumentError

#: Flags that only one engine uses: flag -> (engine, why).
_EMBEDDED_ONLY = {
    "--threads": "the embedded engine's torch threads",
    "--admin-key": "the embedded engine's shard-route key; vLLM's shard routes take the "
    "plugin's $AGENTSPEC_API_KEY (see integrations/vllm/README.md)",
    "--fleet-tenants": "the tenants the embedded engine follows; vLLM workers follow each "
    "request's tenant as it comes (up to --set fleet_max_tenants=N, default 16)",
    "--no-metrics": "the embedded engine's GET /metrics; AGENTSPEC_METRICS=0 turns every "
    "component's metrics off",
    "--no-cpu-kernels": "the embedded engine's CPU kernels (vLLM brings its own)",
}
_VLLM_ONLY = {
    "--set": "settings of the agentspec vLLM plugin; the embedded engine takes "
    "--num-speculative-tokens, --max-depth and the memory flags",
    "--shm-dir": "the snapshot-file directory of the vLLM workers",
    "--no-middleware": "vLLM's header middleware; the embedded engine always reads the "
    "X-AgentSpec-* headers",
    "--python": "the Python that runs vLLM",
}
#: vLLM flags (after MODEL) the embedded engine takes too.
_EMBEDDED_VLLM_FLAGS = ("--served-model-name", "--max-model-len", "--dtype")
_DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")


def _given(args: argparse.Namespace, flags: Mapping[str, str]) -> list[str]:
    """Which of ``flags`` the arguments set."""
    given = []
    for flag in flags:
        if flag == "--set":
            present = bool(getattr(args, "settings", None))
        elif flag == "--no-middleware":
            present = getattr(args, "middleware", None) is False
        elif flag in ("--no-metrics", "--no-cpu-kernels"):
            present = getattr(args, flag[5:].replace("-", "_"), None) is False
        else:
            present = getattr(args, flag[2:].replace("-", "_"), None) is not None
        if present:
            given.append(flag)
    return given


def _refuse_other_engine(args: argparse.Namespace, engine: str) -> None:
    """Refuse the flags of the engine not chosen, naming the engine that needs each.

    Raises:
        InvalidArgumentError: such a flag was given.
    """
    if engine == "vllm":
        other, name, flag_engine = _EMBEDDED_ONLY, "the embedded engine", "embedded"
    else:
        other, name, flag_engine = _VLLM_ONLY, "vLLM", "vllm"
    given = _given(args, other)
    if given:
        flag = given[0]
        raise InvalidArgumentError(
            f"{flag} is a flag of {name} (--engine {flag_engine}): {other[flag]}; "
            f"this server runs --engine {engine}"
        )


def _serve_redis(args: argparse.Namespace) -> RedisUrl | None:
    """serve's Redis URL (flags, then environment), resolved once per run.

    The URL goes to the server through its environment (vLLM) or in-process
    (embedded), never through argv; a ``--redis`` password warns once.
    """
    cached = getattr(args, "_redis_resolved", None)
    if cached is None:
        cached = (secrets_source.from_args(args),)
        args._redis_resolved = cached
    resolved: RedisUrl | None = cached[0]
    return resolved
