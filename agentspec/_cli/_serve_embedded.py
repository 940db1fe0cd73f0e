"""``agentspec serve --engine embedded``: serve with `agentspec.engine` in this process."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from agentspec._cli._serve_options import (
    _DTYPES,
    _EMBEDDED_VLLM_FLAGS,
    _refuse_other_engine,
    _serve_redis,
)
from agentspec._cli._vllm_launch import _budget_settings
from agentspec._util.keys import server_api_key
from agentspec.exceptions import InvalidArgumentError
from agentspec.protocol import ADMIN_KEY_ENV, TENANT_KEYS_ENV, load_tenant_keys


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
            metrics=getattr(args, "metrics", None),
            cpu_kernels=getattr(args, "cpu_kernels", None) is not False,
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
    kernels = engine.cpu_kernels
    cpu = (
        "stock"
        if kernels is None
        else f"{kernels.packed_linears}/{kernels.linears} linear layers oneDNN-packed, "
        f"attention {kernels.attention}"
    )
    print(
        f"agentspec serve: ready on {server.base_url} (model {names[0]}; engine embedded; "
        f"{spec}; cpu kernels {cpu}; max_model_len {engine.max_model_len}; api key "
        f"{'required' if server.api_key or server.tenant_keys else 'none'}; metrics "
        f"{server.url + '/metrics' if engine.metrics is not None else 'off'})",
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
