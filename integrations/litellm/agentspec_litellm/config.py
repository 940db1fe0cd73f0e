"""Configuration of the agentspec LiteLLM hook.

The hook registered as ``agentspec_litellm.proxy_handler_instance`` reads a
YAML (or JSON) file named by ``$AGENTSPEC_LITELLM_CONFIG`` on its first
request; without it, it still tags requests but learns nothing.  Code that
builds its own hook passes a `HookConfig` (or a mapping) to `AgentSpecHook`.

=================  ===========  ==================================================
key                default      meaning
=================  ===========  ==================================================
store              none         `agentspec.ShardStore` directory outputs are learned
                                into (none: tag only, learn nothing)
store_max_bytes    none         byte budget of the store (oldest sequences evicted)
push               auto         where shards go: ``auto`` (the ``api_base`` of every
                                ``hosted_vllm/`` / ``openai/`` deployment), a list of
                                worker URLs, or ``[]`` (do not push)
push_api_key_env   none         environment variable holding the workers' bearer token
                                (``auto`` otherwise uses each deployment's api_key)
return_token_ids   true         ask the upstream for token ids (vLLM, agentspec engine);
                                they are stripped from answers the client did not ask
                                for them in
lead_tokens        8            learn each output behind this many prompt tokens
tokenizers         {}           model group -> ``tokenizer.json`` used when the
                                upstream returns no token ids
default_stage      {}           model group (or ``"*"``) -> stage of untagged calls
default_pipeline   {}           model group (or ``"*"``) -> pipeline of untagged calls
tenant_from        client       ``client`` (``agentspec_tenant`` of the body, else
                                ``default``), ``team``, ``key_alias``, ``user`` or
                                ``key`` (the ``tenant_keys`` map); anything but
                                ``client`` ignores what the client claims
tenant_keys        {}           API key (or ``sha256:<hex>`` of it) -> tenant, for
                                ``tenant_from: key``
queue_size         1024         finished calls waiting to be learned (more: dropped
                                and counted)
stats_file         none         JSON file the hook keeps its counters in
redis              env          the fleet's Redis (``redis://``, ``rediss://`` or
                                ``unix://``): every learned answer is also published
                                to the fleet, through the store (needs ``store``);
                                unset: ``$AGENTSPEC_REDIS_URL``, else the file named by
                                ``$AGENTSPEC_REDIS_URL_FILE`` (unset or empty: no
                                fleet); ``false``: no fleet whatever the environment
=================  ===========  ==================================================

Every value is checked when the config is loaded; a bad one raises
`InvalidArgumentError` naming the key.  A Redis URL's password never appears
in an error, a repr, a log line or the stats file (it is shown as ``***``);
prefer ``$AGENTSPEC_REDIS_URL`` or ``$AGENTSPEC_REDIS_URL_FILE`` (a file
holding the URL, mode 600; one other users may read is refused) for a URL
holding one, so the config file carries no secret.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from agentspec.exceptions import InvalidArgumentError
from agentspec.protocol import check_tag

__all__ = [
    "CONFIG_ENV",
    "REDIS_SCHEMES",
    "REDIS_URL_ENV",
    "TENANT_SOURCES",
    "HookConfig",
    "check_redis_url",
    "hash_key",
    "load_config",
    "redacted_url",
]

#: Environment variable naming the hook's config file.
CONFIG_ENV = "AGENTSPEC_LITELLM_CONFIG"
#: Environment variable holding the fleet's Redis URL when the config has no ``redis``
#: (the one `agentspec.ShardStore` reads).
REDIS_URL_ENV = "AGENTSPEC_REDIS_URL"
#: The URL schemes the fleet connects with.
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://", "redis+cluster://")
_SCHEME_TEXT = "redis://, rediss://, unix://, redis+sentinel:// or redis+cluster://"

#: Where the tenant of a request comes from.
TenantSource = Literal["client", "team", "key_alias", "user", "key"]
TENANT_SOURCES: tuple[TenantSource, ...] = ("client", "team", "key_alias", "user", "key")

_KEYS = frozenset(
    {
        "store",
        "store_max_bytes",
        "push",
        "push_api_key_env",
        "return_token_ids",
        "lead_tokens",
        "tokenizers",
        "default_stage",
        "default_pipeline",
        "tenant_from",
        "tenant_keys",
        "queue_size",
        "stats_file",
        "redis",
    }
)


def hash_key(api_key: str) -> str:
    """The hex SHA-256 of an API key, as LiteLLM stores virtual keys."""
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True)
class HookConfig:
    """The hook's settings; see the module docstring for each field."""

    store: Path | None = None
    store_max_bytes: int | None = None
    push: Literal["auto"] | tuple[str, ...] = "auto"
    push_api_key_env: str | None = None
    return_token_ids: bool = True
    lead_tokens: int = 8
    tokenizers: Mapping[str, Path] = field(default_factory=dict)
    default_stage: Mapping[str, str] = field(default_factory=dict)
    default_pipeline: Mapping[str, str] = field(default_factory=dict)
    tenant_from: TenantSource = "client"
    #: SHA-256 hex of an API key -> tenant.
    tenant_keys: Mapping[str, str] = field(default_factory=dict)
    queue_size: int = 1024
    stats_file: Path | None = None
    #: The fleet's Redis URL; None: ``$AGENTSPEC_REDIS_URL``; False: no fleet.  Never
    #: in the repr (it may hold a password).
    redis: str | Literal[False] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """Check the Redis URL (a bad one raises `InvalidArgumentError`, password hidden)."""
        if self.redis is not None and self.redis is not False:
            check_redis_url(self.redis, "redis")
            if self.store is None:
                raise InvalidArgumentError(
                    "redis needs store: the store's journal is the fleet's outbox",
                    "set store to a directory, or drop redis",
                )

    def redis_url(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The fleet's Redis URL: ``redis``, else ``$AGENTSPEC_REDIS_URL``, else the file
        named by ``$AGENTSPEC_REDIS_URL_FILE`` (None: no fleet).

        Raises:
            InvalidArgumentError: the variable holds a bad URL, both variables
                are set, or the file is missing, open to other users or holds
                no URL (the message never shows the URL's password).
        """
        if self.redis is False:
            return None
        if self.redis is not None:
            return self.redis
        from agentspec.integration import REDIS_URL_FILE_ENV, read_url_file

        environ = os.environ if environ is None else environ
        env = environ.get(REDIS_URL_ENV) or None
        path = environ.get(REDIS_URL_FILE_ENV) or None
        if env is not None and path is not None:
            raise InvalidArgumentError(
                f"set either ${REDIS_URL_ENV} or ${REDIS_URL_FILE_ENV}, not both"
            )
        if path is not None:
            where = f"${REDIS_URL_FILE_ENV} {path}"
            return check_redis_url(read_url_file(path, f"${REDIS_URL_FILE_ENV}"), where)
        return None if env is None else check_redis_url(env, f"${REDIS_URL_ENV}")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> HookConfig:
        """Validate a parsed config file (or a dict built in code)."""
        if not isinstance(raw, Mapping):
            raise InvalidArgumentError("the agentspec LiteLLM config must be a mapping")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise InvalidArgumentError(
                f"unknown agentspec LiteLLM config keys: {', '.join(map(str, unknown))}",
                f"known: {', '.join(sorted(_KEYS))}",
            )
        tenant_from = raw.get("tenant_from", "client")
        if tenant_from not in TENANT_SOURCES:
            raise InvalidArgumentError(
                f"tenant_from must be one of {', '.join(TENANT_SOURCES)}, got {tenant_from!r}"
            )
        tenant_keys = _tenant_keys(raw.get("tenant_keys") or {})
        if tenant_from == "key" and not tenant_keys:
            raise InvalidArgumentError("tenant_from: key needs a non-empty tenant_keys map")
        redis = raw.get("redis")
        if redis is not None and redis is not False:
            redis = check_redis_url(redis, "redis")
        config = cls(
            store=_opt_path(raw.get("store"), "store"),
            store_max_bytes=_opt_int(raw.get("store_max_bytes"), "store_max_bytes", 1),
            push=_push(raw.get("push", "auto")),
            push_api_key_env=_opt_str(raw.get("push_api_key_env"), "push_api_key_env"),
            return_token_ids=_bool(raw.get("return_token_ids", True), "return_token_ids"),
            lead_tokens=cast(int, _opt_int(raw.get("lead_tokens", 8), "lead_tokens", 0)),
            tokenizers={
                _model(k, "tokenizers"): Path(_str(v, f"tokenizers[{k!r}]"))
                for k, v in _mapping(raw.get("tokenizers") or {}, "tokenizers").items()
            },
            default_stage=_tag_map(raw.get("default_stage") or {}, "default_stage", "stage"),
            default_pipeline=_tag_map(
                raw.get("default_pipeline") or {}, "default_pipeline", "pipeline"
            ),
            tenant_from=cast(TenantSource, tenant_from),
            tenant_keys=tenant_keys,
            queue_size=cast(int, _opt_int(raw.get("queue_size", 1024), "queue_size", 1)),
            stats_file=_opt_path(raw.get("stats_file"), "stats_file"),
            redis=redis,
        )
        config.redis_url()  # a bad $AGENTSPEC_REDIS_URL is a config error too
        return config

    def default_for(self, table: Mapping[str, str], model: str | None) -> str | None:
        """``table[model]``, else ``table["*"]``, else None."""
        if model is not None and model in table:
            return table[model]
        return table.get("*")


def load_config(path: str | os.PathLike[str] | None = None) -> HookConfig:
    """The config in ``path`` (default ``$AGENTSPEC_LITELLM_CONFIG``; none: defaults).

    Raises:
        InvalidArgumentError: the file is missing, unreadable, not YAML /
            JSON, or holds a bad value.
    """
    if path is None:
        env = os.environ.get(CONFIG_ENV)
        if not env:
            return HookConfig()
        path = env
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read the agentspec LiteLLM config {p}: {exc}") from exc
    if p.suffix == ".json":
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise InvalidArgumentError(f"{p}: not valid JSON: {exc}") from exc
    else:
        import yaml

        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise InvalidArgumentError(f"{p}: not valid YAML: {_yaml_error(exc)}") from None
    try:
        return HookConfig.from_mapping(raw if raw is not None else {})
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{p}: {exc.args[0]}", *exc.args[1:]) from None


def _yaml_error(exc: Exception) -> str:
    """Where and what a YAML error is, without the snippet of the file it quotes (the
    line may hold a password)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    if mark is None:
        return str(problem)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


# --- the fleet's Redis URL ------------------------------------------------------------

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,19}")


def redacted_url(url: str) -> str:
    """``url`` with its password (user info or ``password=`` parameter) as ``***``."""
    from agentspec.fleet import redact_url

    return redact_url(url)


def check_redis_url(value: object, name: str) -> str:
    """``value`` if it is a ``redis://``, ``rediss://`` or ``unix://`` URL.

    The error never shows the value itself (it may hold a password): only
    its type, or the scheme it has.

    Raises:
        InvalidArgumentError: anything else, naming ``name``.
    """
    if not isinstance(value, str) or not value:
        got = "an empty string" if value == "" else f"a {type(value).__name__}"
        raise InvalidArgumentError(f"{name} must be a {_SCHEME_TEXT} URL (or false), got {got}")
    if not value.startswith(REDIS_SCHEMES):
        scheme, sep, _ = value.partition("://")
        got = f"a {scheme}:// URL" if sep and _SCHEME.fullmatch(scheme) else "no URL scheme"
        raise InvalidArgumentError(
            f"{name} must be a {_SCHEME_TEXT} URL, got {got}",
            "for example redis://user:PASSWORD@host:6379/0 or unix:///run/redis.sock",
        )
    try:
        parts = urllib.parse.urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError:
        raise InvalidArgumentError(
            f"{name} is not a valid URL: {redacted_url(value)!r:.120}"
        ) from None
    if parts.scheme != "unix" and not parts.hostname:
        raise InvalidArgumentError(f"{name} names no host: {redacted_url(value)!r:.120}")
    if parts.scheme == "unix" and not parts.path:
        raise InvalidArgumentError(f"{name} names no socket path: {redacted_url(value)!r:.120}")
    return value


# --- validation helpers ---------------------------------------------------------------


def _str(value: object, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{name} must be a non-empty string, got {value!r}")
    return value


def _opt_str(value: object, name: str) -> str | None:
    return None if value is None else _str(value, name)


def _opt_path(value: object, name: str) -> Path | None:
    return None if value is None else Path(_str(value, name))


def _opt_int(value: object, name: str, lo: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


def _bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be true or false, got {value!r}")
    return value


def _mapping(value: object, name: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{name} must be a mapping, got {type(value).__name__}")
    return value


def _model(value: object, name: str) -> str:
    return _str(value, f"a model name in {name}")


def _tag_map(value: object, name: str, tag: str) -> dict[str, str]:
    out = {}
    for k, v in _mapping(value, name).items():
        try:
            out[_model(k, name)] = check_tag(v, tag)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{name}[{k!r}]: {exc}") from None
    return out


def _tenant_keys(value: object) -> dict[str, str]:
    out = {}
    for k, v in _mapping(value, "tenant_keys").items():
        key = _str(k, "an API key in tenant_keys")
        try:
            tenant = check_tag(v, "tenant")
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"tenant_keys: {exc}") from None
        digest = key[len("sha256:") :] if key.startswith("sha256:") else hash_key(key)
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise InvalidArgumentError(f"tenant_keys: {key[:14]!r}... is not a valid sha256 hex")
        out[digest] = tenant
    return out


def _push(value: object) -> Literal["auto"] | tuple[str, ...]:
    if value == "auto":
        return "auto"
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise InvalidArgumentError(f"push must be 'auto' or a list of URLs, got {value!r}")
    urls = tuple(_str(u, "a push URL") for u in value)
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise InvalidArgumentError(f"push URL must start with http:// or https://: {u!r}")
    return urls
