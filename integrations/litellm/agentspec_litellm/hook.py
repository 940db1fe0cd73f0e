"""`AgentSpecHook`: the LiteLLM proxy callback that brings agentspec to any agent stack.

Registered in the proxy's ``config.yaml``::

    litellm_settings:
      callbacks: agentspec_litellm.proxy_handler_instance

it runs at four points of every chat / text completion:

1. ``async_pre_call_hook`` resolves the request's tenant, session, stage and
   pipeline (`agentspec_litellm.tags`), stashes them in the request
   ``metadata`` (which LiteLLM does not forward upstream) and asks the
   upstream for token ids (``return_token_ids``);
2. ``async_pre_call_deployment_hook`` -- after LiteLLM picked the deployment
   -- merges the tags into ``vllm_xargs``: the deployment's ``extra_body``
   (its ``vllm_xargs`` included) and the client's own ``vllm_xargs`` are
   kept, the agentspec keys are set.  LiteLLM would otherwise let a
   request-level ``extra_body`` replace the deployment's;
3. ``async_post_call_success_hook`` (non-streamed answers) and
   ``async_post_call_streaming_iterator_hook`` (streams, teed chunk by
   chunk) hand the output to the `Learner`, which learns it into the stage
   shard of a `ShardStore` on its own thread; a `ShardPusher` sends the
   shards to the vLLM workers behind the proxy.  Token-id fields the client
   did not ask for are removed from its answer.

Fleet: with ``redis`` in the config (or ``$AGENTSPEC_REDIS_URL``) the store
also publishes every learned answer to the fleet's Redis stream, from its
journal (the outbox), so Redis being down never holds up a request and the
backlog goes out once it is back.  Each call then carries a request
identity, ``vllm_xargs.agentspec_request_id`` (the client's own value when
it sent a valid one, else a fresh random one), and its answer is learned
under it: a vLLM worker (or agentspec's engine) publishing the same answer
under the same identity adds nothing to the fleet (docs/fleet.md).

agentspec never fails a user request: every hook catches its own errors,
counts them (``hook.counters``, and ``stats_file``) and logs the error type,
and the request goes on untouched.  The store, tokenizers and pusher are set
up on the first request (the proxy's router exists by then); a setup failure
leaves the hook tagging requests without learning.
"""

from __future__ import annotations

import atexit
import os
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

from agentspec import ShardPusher, ShardStore
from agentspec.fleet import check_identity
from agentspec.integration import get_logger, load_tokenizer
from agentspec.metrics import metrics_enabled
from agentspec.protocol import XARG_REQUEST_ID, XARGS_FIELD
from agentspec_litellm.config import HookConfig, load_config, redacted_url
from agentspec_litellm.learner import Counters, Encoder, Job, Learner
from agentspec_litellm.metrics import HookMetrics, install
from agentspec_litellm.outputs import (
    Outputs,
    StreamAccumulator,
    response_outputs,
    strip_token_ids,
)
from agentspec_litellm.tags import RequestTags, client_xargs, resolve_tags

__all__ = ["REQUEST_ID_XARG", "STASH_KEY", "AgentSpecHook", "merge_xargs"]

_log = get_logger()

#: Key of the hook's per-request state in the request ``metadata``.
STASH_KEY = "agentspec"
#: The ``vllm_xargs`` key of the request identity the fleet knows an answer by.
REQUEST_ID_XARG = XARG_REQUEST_ID

#: LiteLLM call types the hook handles (chat and text completions).
_CALL_TYPES = frozenset({"completion", "acompletion", "text_completion", "atext_completion"})
#: Providers whose deployments are vLLM-compatible push targets under ``push: auto``.
_PUSH_PROVIDERS = ("hosted_vllm/", "openai/")


def merge_xargs(kwargs: dict[str, Any], tags: Mapping[str, str]) -> dict[str, Any]:
    """``kwargs`` of a deployment call with ``tags`` merged into its ``vllm_xargs``.

    The deployment's ``extra_body`` keeps its other fields; its ``vllm_xargs``
    and the client's (top-level) ``vllm_xargs`` are merged, in that order,
    and ``tags`` is applied last.  Nothing passed in is mutated.
    """
    out = dict(kwargs)
    extra = kwargs.get("extra_body")
    body = dict(extra) if isinstance(extra, Mapping) else {}
    merged: dict[str, Any] = {}
    for source in (body.get(XARGS_FIELD), kwargs.get(XARGS_FIELD)):
        if isinstance(source, Mapping):
            merged.update(source)
    merged.update(tags)
    body[XARGS_FIELD] = merged
    out["extra_body"] = body
    out[XARGS_FIELD] = dict(merged)
    return out


@dataclass
class _State:
    """What the hook sets up on its first request."""

    config: HookConfig
    learner: Learner
    pushers: list[ShardPusher] = field(default_factory=list)
    #: The fleet's Redis URL, password hidden (None: no fleet).
    fleet: str | None = None


def _stash(data: Mapping[str, Any]) -> dict[str, Any] | None:
    for name in ("metadata", "litellm_metadata"):
        md = data.get(name)
        if isinstance(md, Mapping):
            stash = md.get(STASH_KEY)
            if isinstance(stash, dict) and "tenant" in stash:
                return stash
    return None


def _key(stash: Mapping[str, Any]) -> tuple[str, str | None, str | None]:
    return (stash["tenant"], stash.get("pipeline"), stash.get("stage"))


def _job(stash: Mapping[str, Any], outputs: Outputs) -> Job:
    """The learner's job for a finished answer (under the call's fleet identity, if any)."""
    rid = stash.get("request_id")
    identity = rid if isinstance(rid, str) else None
    return Job(_key(stash), outputs, stash.get("model"), identity)


#: ``flush(None)``: wait this long (seconds) for the fleet, which is as good as forever.
_FOREVER = 1e9


def _no_secrets(text: str) -> str:
    return text


def _scrubber(url: str) -> Callable[[str], str]:
    """A function removing ``url``'s password from a text."""
    from agentspec.fleet import Redactor

    return Redactor(url).scrub


class AgentSpecHook(CustomLogger):
    """The LiteLLM callback (see the module docstring).

    Args:
        config: a `HookConfig`, a mapping in the config-file format, or None
            to read ``$AGENTSPEC_LITELLM_CONFIG`` on the first request.
    """

    def __init__(self, config: HookConfig | Mapping[str, Any] | None = None) -> None:
        """Create the hook; nothing is opened before the first request."""
        super().__init__()
        self._config_arg = config
        self._state: _State | None = None
        self._lock = threading.Lock()
        self._scrub: Callable[[str], str] = _no_secrets
        self.counters = Counters()
        self.metrics = HookMetrics()  # Prometheus (agentspec_litellm.metrics)
        if metrics_enabled():
            install(self)

    # --- setup --------------------------------------------------------------------------

    def _setup(self) -> _State:
        """The state, built once (a failure leaves a tag-only hook, logged and counted)."""
        state = self._state
        if state is not None:
            return state
        with self._lock:
            if self._state is None:
                self._state = self._build()
            return self._state

    def _build(self) -> _State:
        try:
            arg = self._config_arg
            config = (
                arg
                if isinstance(arg, HookConfig)
                else HookConfig.from_mapping(arg)
                if arg is not None
                else load_config()
            )
            url = config.redis_url()
        except Exception as exc:
            self._error("config", exc)
            config, url = HookConfig(), None
        if url is not None:
            self._scrub = _scrubber(url)
            if config.store is None:
                _log.warning(
                    "agentspec_litellm_fleet_without_store",
                    redis=redacted_url(url),
                    hint="the fleet publishes from the store's journal: set store in the "
                    "agentspec LiteLLM config to publish there",
                )
        store = None
        if config.store is not None:
            try:
                store = ShardStore(
                    config.store,
                    max_bytes=config.store_max_bytes,
                    redis=url if url is not None else False,
                )
            except Exception as exc:
                self._error("store_open", exc)
        encoders: dict[str, Encoder] = {}
        for model, path in config.tokenizers.items():
            try:
                enc = load_tokenizer(path)
                if enc is not None:
                    encoders[model] = enc
            except Exception as exc:
                self._error("tokenizer", exc)
        learner = Learner(
            store,
            self.counters,
            encoders=encoders,
            lead_tokens=config.lead_tokens,
            queue_size=config.queue_size,
            stats_file=config.stats_file,
            scrub=self._scrub,
            metrics=self.metrics,
        )
        fleet = redacted_url(url) if url is not None and store is not None else None
        state = _State(config, learner, fleet=fleet)
        if store is not None:
            state.pushers = self._start_pushers(config, store)
        atexit.register(self.close)
        _log.info(
            "agentspec_litellm_ready",
            store=str(config.store) if store is not None else None,
            push=[url for p in state.pushers for url in p.endpoints],
            tenant_from=config.tenant_from,
            fleet=fleet,
        )
        return state

    def _start_pushers(self, config: HookConfig, store: ShardStore) -> list[ShardPusher]:
        """One pusher per API key among the push targets."""
        token = os.environ.get(config.push_api_key_env) if config.push_api_key_env else None
        groups: dict[str | None, list[str]] = {}
        if config.push == "auto":
            for url, key in _deployment_targets():
                groups.setdefault(token or key, []).append(url)
        elif config.push:
            groups[token] = list(config.push)
        pushers = []
        for api_key, urls in groups.items():
            try:
                pushers.append(ShardPusher(store, sorted(set(urls)), api_key=api_key))
            except Exception as exc:
                self._error("pusher", exc)
        return pushers

    def close(self, timeout: float = 5.0) -> None:
        """Learn what is queued, push it, close the store (also run at exit)."""
        state = self._state
        if state is None:
            return
        try:
            state.learner.close(timeout)
            for p in state.pushers:
                p.flush(timeout)
                p.close(timeout)
            if state.learner.store is not None:
                state.learner.store.close()
        except Exception as exc:
            self._error("close", exc)

    @property
    def store(self) -> ShardStore | None:
        """The store answers are learned into (None: before the first request, or none)."""
        state = self._state
        return None if state is None else state.learner.store

    def flush(self, timeout: float | None = None, *, fleet: bool = True) -> bool:
        """Wait until queued answers are learned, the workers caught up and, with a
        fleet (unless ``fleet=False``), Redis durably holds every answer learned so
        far; False on timeout."""
        state = self._state
        if state is None:
            return True
        done = state.learner.flush(timeout)
        for p in state.pushers:
            done = p.flush(timeout) and done
        store = state.learner.store
        outbox = store.fleet if store is not None and fleet else None
        if outbox is not None:
            done = outbox.flush(_FOREVER if timeout is None else timeout) and done
        return done

    def _error(self, where: str, exc: BaseException) -> None:
        """Count and log one failure of agentspec (never of the user's request)."""
        self.counters.add("errors")
        self.counters.add(f"errors.{where}")
        _log.warning("agentspec_litellm_error", where=where, error=type(exc).__name__)
        _log.debug("agentspec_litellm_error", where=where, detail=self._scrub(str(exc))[:500])
        state = self._state
        if state is not None:
            state.learner.poke()

    # --- LiteLLM hooks ------------------------------------------------------------------

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: Any
    ) -> dict[str, Any]:
        """Resolve and stash the tags; ask the upstream for token ids."""
        try:
            if str(getattr(call_type, "value", call_type)) not in _CALL_TYPES:
                return data
            state = self._setup()
            tags, problems = resolve_tags(data, user_api_key_dict, state.config)
            for problem in problems:
                self.counters.add("tag_problems")
                _log.warning("agentspec_litellm_bad_tag", problem=problem[:200])
            md = data.get("metadata")
            if not isinstance(md, dict):
                md = {}
            stash: dict[str, Any] = tags.as_dict()
            stash["client_ids"] = bool(data.get("return_token_ids"))
            stash["model"] = data.get("model") if isinstance(data.get("model"), str) else None
            if state.fleet is not None:
                stash["request_id"] = self._request_id(data)
            ask_ids = state.config.return_token_ids and not stash["client_ids"]
            md[STASH_KEY] = stash
            data["metadata"] = md
            if ask_ids:
                data["return_token_ids"] = True
            self.counters.add("requests")
            self.metrics.call(_key(stash))
        except Exception as exc:
            self._error("pre_call", exc)
        return data

    def _request_id(self, data: Mapping[str, Any]) -> str:
        """The call's identity in the fleet: the client's own, if valid, else a new one."""
        raw = client_xargs(data).get(REQUEST_ID_XARG)
        if raw is not None:
            try:
                return check_identity(raw)
            except Exception as exc:
                self.counters.add("tag_problems")
                _log.warning(
                    "agentspec_litellm_bad_tag",
                    problem=f"vllm_xargs.{REQUEST_ID_XARG}: {exc}"[:200],
                )
        return uuid.uuid4().hex

    async def async_pre_call_deployment_hook(
        self, kwargs: dict[str, Any], call_type: Any
    ) -> dict[str, Any] | None:
        """Merge the stashed tags into the deployment call's ``vllm_xargs``."""
        try:
            stash = _stash(kwargs)
            if stash is None:
                return None
            tags = RequestTags(
                stash["tenant"], stash.get("session"), stash.get("stage"), stash.get("pipeline")
            )
            xargs = tags.xargs()
            if isinstance(stash.get("request_id"), str):
                xargs[REQUEST_ID_XARG] = stash["request_id"]
            return merge_xargs(kwargs, xargs)
        except Exception as exc:
            self._error("deployment", exc)
            return None

    async def async_post_call_success_hook(
        self, data: dict[str, Any], user_api_key_dict: Any, response: Any
    ) -> None:
        """Learn a non-streamed answer; strip token ids the client did not ask for."""
        try:
            stash = _stash(data)
            if stash is None or self._state is None:
                return
            outputs = response_outputs(response)
            self._state.learner.submit(_job(stash, outputs))
            if not stash.get("client_ids"):
                strip_token_ids(response)
        except Exception as exc:
            self._error("post_call", exc)

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: Any, response: Any, request_data: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        """Pass every chunk on unchanged; learn the output once the stream finished.

        However the stream ends -- its last chunk, the client dropping it
        (the generator closed at its ``yield``), an upstream error, a
        cancellation -- `_stream_ended` accounts for it: the output is
        learned only when every choice reported its finish reason, and any
        other stream is counted in ``unfinished_streams``, never learned.
        """
        stash = None
        acc: StreamAccumulator | None = None
        try:
            stash = _stash(request_data)
            if stash is not None and self._state is not None:
                n = request_data.get("n")
                acc = StreamAccumulator(n if type(n) is int else 1)
        except Exception as exc:
            self._error("stream", exc)
        try:
            async for chunk in response:
                if acc is not None:
                    try:
                        acc.add(chunk)
                    except Exception as exc:
                        self._error("stream", exc)
                        acc = None
                yield chunk
        finally:
            # Also reached by GeneratorExit / CancelledError: nothing here awaits or yields.
            if acc is not None and stash is not None:
                self._stream_ended(stash, acc)

    def _stream_ended(self, stash: Mapping[str, Any], acc: StreamAccumulator) -> None:
        """Learn a finished stream's output; count an unfinished one."""
        try:
            state = self._state
            if state is None:
                return
            if acc.finished:
                state.learner.submit(_job(stash, acc.outputs()))
            else:
                self.counters.add("unfinished_streams")
                state.learner.poke()  # the stats file shows the count
        except Exception as exc:
            self._error("stream", exc)


def _deployment_targets() -> list[tuple[str, str | None]]:
    """``(api_base, api_key)`` of the proxy's vLLM-compatible deployments."""
    from litellm.proxy import proxy_server

    router = getattr(proxy_server, "llm_router", None)
    out = []
    for dep in getattr(router, "model_list", None) or ():
        params = dep.get("litellm_params") or {}
        model, base = params.get("model"), params.get("api_base")
        if isinstance(model, str) and model.startswith(_PUSH_PROVIDERS) and isinstance(base, str):
            key = params.get("api_key")
            out.append((base, key if isinstance(key, str) and key else None))
    return out
