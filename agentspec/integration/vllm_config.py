"""Configuration of the vLLM plugin (``agentspec_vllm``): its proposer and worker extension.

Read from ``--additional-config '{"agentspec": {...}}'`` (``vllm_config.additional_config``)
and from environment variables; a key in the additional config wins over its variable,
which wins over the default.  Each key's environment variable is
``AGENTSPEC_VLLM_<KEY>`` (upper case) unless named; defaults in brackets:

- ``max_depth`` [64]: depth of every tree; pushed shards must have the same
  depth (else 409).
- ``policy`` [confidence]: how drafts are grown: ``confidence`` (every token
  weighed by how often tokens with its matched length and count are accepted,
  `agentspec.DraftParams.confident`) or ``counts`` (branch frequencies and a
  budget of ``alpha`` tokens per matched token, as arctic-inference drafts).
- ``alpha`` [the policy's: 32 for confidence, 1.0 for counts]: draft budget per
  matched token.
- ``min_token_prob`` [the policy's: 0.25 for confidence, 0.1 for counts]: drop
  draft tokens less likely than this.
- ``lead_tokens`` [8]: learn responses behind this many prompt tokens.
- ``cold_tokens`` [256]: see `agentspec.Speculator`.
- ``max_shard_tokens`` [none]: FIFO token budget per learned tree.
- ``max_learned_bytes`` [1 GiB]: learned shards of all tenants together; the
  oldest learned sequences (any tenant) are evicted beyond it.
- ``max_tenant_learned_bytes`` [256 MiB]: learned shards of one tenant; its
  oldest sequences are evicted beyond it.
- ``max_shard_bytes`` [1 GiB]: pushed shards of all tenants; a push beyond it
  gets 507.
- ``max_tenant_shard_bytes`` [256 MiB]: pushed shards of one tenant; a push
  beyond it gets 507.
- ``local_tree`` [true]: per-request tree over prompt + output.
- ``learn`` [true]: learn finished responses on the worker.
- ``live_learning`` [true]: learn responses while they are generated, so
  concurrent requests draft from each other (with learn).
- ``api_key`` (``AGENTSPEC_API_KEY``) [none]: bearer token the shard intake
  demands.
- ``shm_dir`` (``AGENTSPEC_SHM_DIR``) [none]: directory ``snapshot-file``
  pushes may name (none: refused).
- ``max_body_bytes`` [32 MiB]: largest push accepted (413 above).
- ``redis_url`` [none]: join the fleet (see `agentspec_vllm.fleet`): draft
  from the shards every replica learned and publish each finished response
  there.  ``redis://``, ``rediss://`` or ``unix://``; prefer the variable
  ``AGENTSPEC_VLLM_REDIS_URL`` when it holds a password (vLLM logs its
  configuration; the plugin itself only ever shows the URL redacted), or
  ``AGENTSPEC_VLLM_REDIS_URL_FILE``: the path of a file holding the URL
  (whitespace around it stripped; a file other users may read, or its group
  may write, is refused: ``chmod 600``).  Setting both variables is an error.
- ``fleet_max_tenants`` [16]: most tenants one worker subscribes to (one
  background thread and one Redis connection each); later tenants draft
  without fleet shards.
- ``goodput`` [true]: cut each step's drafts to what pays (see
  ``agentspec.GoodputController``): calibrated acceptance probabilities,
  learned from what the worker's steps accept, against the step time the
  proposer measures between its calls.  false: the fixed policy (every
  draft as ``alpha``/``min_token_prob`` give it).
- ``fleet_publish`` [true]: publish the responses this worker serves.
  false: a replica that only subscribes, e.g. with a read-only Redis user
  (``agentspec.fleet.tenant_acl_rules(tenant, read_only=True)``); the
  clients (``AgentSpecClient``/``ShardStore`` with ``redis=``, the LiteLLM
  hook) are then the fleet's only learners.
- ``fleet_max_shard_tokens`` [1048576]: token budget of each fleet shard,
  written for a tenant that has no fleet config in Redis yet (the first
  writer wins; the depth written is ``max_depth``).
- ``metrics`` (``AGENTSPEC_METRICS``) [true]: the plugin's Prometheus metrics
  (``agentspec_*`` on vLLM's ``/metrics`` and ``/v1/agentspec/metrics``);
  false: neither the per-position and step-time counting in the proposer
  nor the API server's refresh.
- ``metrics_interval`` [5.0]: seconds between the API server's collections of
  the workers' counters for ``/metrics`` (one ``collective_rpc`` each).

Byte budgets count live tree bytes per worker (see `agentspec.integration`); they
take an int or a size such as ``512MiB`` / ``1GiB``, and ``none`` turns a
budget off.  Prefer the environment variable for ``api_key``: vLLM logs its
configuration, additional config included.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentspec import DraftParams
from agentspec.exceptions import InvalidArgumentError
from agentspec.integration import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_LEARNED_BYTES,
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_MAX_TENANT_LEARNED_BYTES,
    DEFAULT_MAX_TENANT_SHARD_BYTES,
    parse_byte_size,
    read_url_file,
)

__all__ = ["ENV_PREFIX", "REDIS_URL_FILE_ENV", "AgentSpecVllmConfig", "load_config"]

#: Prefix of the environment variables of the tuning knobs.
ENV_PREFIX = "AGENTSPEC_VLLM_"

#: The variable naming a file that holds ``redis_url`` (read when neither the
#: additional config nor ``AGENTSPEC_VLLM_REDIS_URL`` gives it).
REDIS_URL_FILE_ENV = "AGENTSPEC_VLLM_REDIS_URL_FILE"

#: Keys whose environment variable does not follow ``ENV_PREFIX + KEY``.
_ENV_NAMES = {
    "api_key": "AGENTSPEC_API_KEY",
    "shm_dir": "AGENTSPEC_SHM_DIR",
    "metrics": "AGENTSPEC_METRICS",
}

#: Keys holding byte counts (sizes such as ``512MiB`` accepted).
_SIZE_KEYS = frozenset(
    {
        "max_learned_bytes",
        "max_tenant_learned_bytes",
        "max_shard_bytes",
        "max_tenant_shard_bytes",
        "max_body_bytes",
    }
)

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://", "redis+cluster://")


def _redacted(url: str) -> str:
    """``url`` with its password as ``***`` (imported late: redis is optional)."""
    from agentspec.fleet import redact_url

    return redact_url(url)


#: The drafting policies (``policy``): see the module docstring.
POLICIES = ("confidence", "counts")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class AgentSpecVllmConfig:
    """The settings of one worker (see the module docstring for each key)."""

    max_depth: int = 64
    policy: str = "confidence"
    alpha: float | None = None
    min_token_prob: float | None = None
    lead_tokens: int = 8
    cold_tokens: int = 256
    max_shard_tokens: int | None = None
    max_learned_bytes: int | None = DEFAULT_MAX_LEARNED_BYTES
    max_tenant_learned_bytes: int | None = DEFAULT_MAX_TENANT_LEARNED_BYTES
    max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES
    max_tenant_shard_bytes: int | None = DEFAULT_MAX_TENANT_SHARD_BYTES
    local_tree: bool = True
    learn: bool = True
    live_learning: bool = True
    goodput: bool = True
    api_key: str | None = dataclasses.field(default=None, repr=False)
    shm_dir: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    redis_url: str | None = dataclasses.field(default=None, repr=False)
    fleet_max_tenants: int = 16
    fleet_publish: bool = True
    fleet_max_shard_tokens: int | None = 1 << 20
    metrics: bool = True
    metrics_interval: float = 5.0

    def __post_init__(self) -> None:
        """Validate the fields (InvalidArgumentError names the bad one)."""
        if not 2 <= self.max_depth <= 1024:
            raise InvalidArgumentError(
                f"agentspec max_depth must be in [2, 1024], not {self.max_depth}"
            )
        if self.policy not in POLICIES:
            raise InvalidArgumentError(
                f"agentspec policy must be one of {', '.join(POLICIES)}, not {self.policy!r:.40}"
            )
        if self.alpha is not None and not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise InvalidArgumentError(
                f"agentspec alpha must be a finite number >= 0, not {self.alpha}"
            )
        if self.min_token_prob is not None and not 0.0 <= self.min_token_prob <= 1.0:
            raise InvalidArgumentError(
                f"agentspec min_token_prob must be in [0, 1], not {self.min_token_prob}"
            )
        if not 0 <= self.lead_tokens <= self.max_depth:
            raise InvalidArgumentError(
                f"agentspec lead_tokens must be in [0, max_depth], not {self.lead_tokens}"
            )
        if self.cold_tokens < 0:
            raise InvalidArgumentError(
                f"agentspec cold_tokens must be >= 0, not {self.cold_tokens}"
            )
        if self.max_shard_tokens is not None and self.max_shard_tokens < 0:
            raise InvalidArgumentError(
                f"agentspec max_shard_tokens must be >= 0, not {self.max_shard_tokens}"
            )
        for name in (
            "max_learned_bytes",
            "max_tenant_learned_bytes",
            "max_shard_bytes",
            "max_tenant_shard_bytes",
        ):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidArgumentError(f"agentspec {name} must be >= 0 or none, not {value}")
        if self.max_body_bytes < 1:
            raise InvalidArgumentError(
                f"agentspec max_body_bytes must be >= 1, not {self.max_body_bytes}"
            )

        if self.redis_url is not None and not self.redis_url.startswith(_REDIS_SCHEMES):
            raise InvalidArgumentError(
                "agentspec redis_url must start with redis://, rediss://, unix://, "
                "redis+sentinel:// or redis+cluster://",
                f"got {_redacted(self.redis_url)!r:.80}",
            )
        if self.fleet_max_tenants < 1:
            raise InvalidArgumentError(
                f"agentspec fleet_max_tenants must be >= 1, not {self.fleet_max_tenants}"
            )
        if self.fleet_max_shard_tokens is not None and self.fleet_max_shard_tokens < 1:
            raise InvalidArgumentError(
                "agentspec fleet_max_shard_tokens must be >= 1 or none, "
                f"not {self.fleet_max_shard_tokens}"
            )
        if not (math.isfinite(self.metrics_interval) and 0.1 <= self.metrics_interval <= 3600):
            raise InvalidArgumentError(
                f"agentspec metrics_interval must be in [0.1, 3600] seconds, "
                f"not {self.metrics_interval}"
            )

    def draft_params(self, max_spec_tokens: int, vocab_size: int | None) -> DraftParams:
        """The drafting parameters of the policy, with ``alpha``/``min_token_prob``
        where they are set."""
        kw: dict[str, Any] = {"max_spec_tokens": max_spec_tokens, "vocab_size": vocab_size}
        if self.alpha is not None:
            kw["alpha"] = self.alpha
        if self.min_token_prob is not None:
            kw["min_token_prob"] = self.min_token_prob
        return DraftParams.confident(**kw) if self.policy == "confidence" else DraftParams(**kw)

    def public(self) -> dict[str, Any]:
        """The settings as JSON-ready values: the API key replaced by whether one is
        set, the Redis URL's password by ``***``."""
        out = dataclasses.asdict(self)
        out["api_key"] = self.api_key is not None
        if self.redis_url is not None:
            out["redis_url"] = _redacted(self.redis_url)
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(AgentSpecVllmConfig)}


def _env_name(key: str) -> str:
    return _ENV_NAMES.get(key, ENV_PREFIX + key.upper())


def _convert(key: str, value: object, where: str) -> Any:
    """``value`` as the type of field ``key`` (strings from the environment are parsed)."""
    kind = _FIELDS[key].type
    try:
        if key in _SIZE_KEYS and not isinstance(value, (bool, float)):
            size = parse_byte_size(value, key)
            if size is None and kind == "int":
                raise ValueError(value)
            return size
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE or text in _FALSE:
                return text in _TRUE
            raise ValueError(value)
        if kind in ("int", "int | None"):
            if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
                if kind == "int":
                    raise ValueError(value)
                return None
            if isinstance(value, (bool, float)):
                raise ValueError(value)
            return int(str(value).strip()) if isinstance(value, str) else int(value)  # type: ignore[call-overload]
        if kind in ("float", "float | None"):
            if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
                if kind == "float":
                    raise ValueError(value)
                return None
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)  # type: ignore[arg-type]
        # str | None
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise ValueError(value)
        return value
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"agentspec setting {key} from {where} must be {kind}, not {value!r:.60}"
        ) from None


def load_config(
    additional_config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> AgentSpecVllmConfig:
    """The settings from ``additional_config["agentspec"]`` and the environment.

    Raises:
        InvalidArgumentError: an unknown key, a value of the wrong type or out of range.
    """
    env = os.environ if environ is None else environ
    section: Any = (additional_config or {}).get("agentspec") or {}
    if not isinstance(section, Mapping):
        raise InvalidArgumentError(
            "--additional-config 'agentspec' must be a JSON object",
            f"got {type(section).__name__}",
        )
    unknown = sorted(set(section) - set(_FIELDS))
    if unknown:
        raise InvalidArgumentError(
            f"unknown agentspec setting(s) {', '.join(map(str, unknown))}",
            f"known: {', '.join(sorted(_FIELDS))}",
        )
    values: dict[str, Any] = {}
    for key in _FIELDS:
        if key in section:
            values[key] = _convert(key, section[key], "--additional-config")
        elif _env_name(key) in env:
            values[key] = _convert(key, env[_env_name(key)], _env_name(key))
    url_file = env.get(REDIS_URL_FILE_ENV) or None
    if url_file is not None and "redis_url" not in section:
        if env.get(_env_name("redis_url")):
            raise InvalidArgumentError(
                f"set either {_env_name('redis_url')} or {REDIS_URL_FILE_ENV}, not both"
            )
        values["redis_url"] = read_url_file(url_file, REDIS_URL_FILE_ENV)
    return AgentSpecVllmConfig(**values)
