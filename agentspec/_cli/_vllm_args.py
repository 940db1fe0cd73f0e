"""``agentspec vllm-args``: print the flags and environment that enable agentspec in vLLM."""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

from agentspec._cli._vllm_launch import (
    _FORMATS,
    REDIS_URL_ENV,
    REDIS_URL_ENV_CLI,
    VllmLaunch,
    _agentspec_config,
    _launch_arguments,
    _spec_tokens,
    vllm_launch,
)
from agentspec._util import secrets_source
from agentspec._util.secrets_source import (
    RedisUrl,
    RedisUrlError,
    has_password,
)


def add_vllm_args_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``agentspec vllm-args`` to ``parser``."""
    parser.add_argument("--model", default=None, help="add --model MODEL to the printed command")
    parser.add_argument(
        "--format",
        choices=_FORMATS,
        default="shell",
        help="shell: export line + server command (default); args: the flags on one "
        "line; env: the export line; json: {'env': {...}, 'args': [...]}",
    )
    secrets_source.add_arguments(
        parser,
        "join the fleet on this Redis (redis://, rediss://, unix://, redis+sentinel:// "
        "or redis+cluster://; default: "
        "$AGENTSPEC_REDIS_URL): the workers "
        "draft from the shards every replica learned and publish each finished response "
        "(identity: vllm_xargs.agentspec_request_id, else vLLM's request id). Emitted as "
        "$AGENTSPEC_VLLM_REDIS_URL, never in --additional-config (vLLM logs that). A URL "
        "with a password is refused here (it would be printed): use --redis-file, "
        "emitted as $AGENTSPEC_VLLM_REDIS_URL_FILE, or $AGENTSPEC_REDIS_URL, emitted as a "
        "reference to that variable",
    )
    _launch_arguments(parser)


def _printable_redis(resolved: RedisUrl | None) -> tuple[str | None, str | None, bool]:
    """``(url, url_file, from_env)`` for vllm-args: what may be printed of the URL.

    Raises:
        RedisUrlError: a ``--redis`` URL holding a password (it would be printed).
    """
    if resolved is None:
        return None, None, False
    if resolved.source == "file":
        return None, resolved.path, False
    if resolved.source == "env":
        return None, None, True
    if has_password(resolved.url):
        raise RedisUrlError(
            "vllm-args prints no passwords: give the Redis URL in a file (--redis-file PATH "
            f"or ${secrets_source.REDIS_URL_FILE_ENV}; the output names the file) or in "
            f"${REDIS_URL_ENV_CLI} (the output refers to that variable)"
        )
    return resolved.url, None, False


def run_vllm_args(args: argparse.Namespace) -> int:
    """Print the flags; returns the exit status."""
    url, url_file, from_env = _printable_redis(secrets_source.from_args(args))
    launch = vllm_launch(
        num_speculative_tokens=_spec_tokens(args),
        middleware=args.middleware is not False,
        agentspec_config=_agentspec_config(args),
        redis_url=url,
        redis_url_file=url_file,
    )
    env_from = {REDIS_URL_ENV: REDIS_URL_ENV_CLI} if from_env else {}
    model = [] if args.model is None else ["--model", args.model]
    launch = VllmLaunch(launch.env, [*model, *launch.args], env_from)
    if args.format == "json":
        out: dict[str, Any] = {"env": launch.env, "args": launch.args}
        if env_from:
            out["env_from"] = env_from
        print(json.dumps(out, indent=1))
    elif args.format == "env":
        for line in launch.exports():
            print(line)
    elif args.format == "args":
        print(shlex.join(launch.args))
    else:
        print(launch.shell())
    return 0
