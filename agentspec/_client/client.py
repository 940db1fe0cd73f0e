"""`AgentSpecClient` / `AsyncAgentSpecClient`: drop-ins for ``openai.OpenAI`` / ``AsyncOpenAI``.

The client wraps an openai client (built from the usual arguments, or given
as ``client=``) and changes three things about model calls
(``chat.completions.create`` / ``.parse``, ``completions.create``,
``responses.create`` / ``.parse``, each also under ``with_raw_response``):

- **Tags.**  The session / stage / pipeline of the call -- the per-call
  ``session=`` / ``stage=`` / ``pipeline=`` keywords (removed before the
  request), else the enclosing `client.session(...)` / `agentspec.stage(...)`
  scopes -- and the client's tenant are sent in the body as
  ``extra_body={"vllm_xargs": {"agentspec_session", "agentspec_stage",
  "agentspec_pipeline", "agentspec_tenant"}}`` (merged with the caller's own
  ``extra_body`` and ``vllm_xargs``; keys the caller set win) and as the
  ``X-AgentSpec-Session`` / ``-Stage`` / ``-Pipeline`` headers (merged with the
  caller's ``extra_headers``, again the caller's win).
- **Learning.**  Each finished response -- streamed or not, every choice -- is
  handed to a background thread that learns it into the shard store under
  ``(tenant, pipeline, stage)``: the token ids the server returned (vLLM, with
  ``return_token_ids=True``) or the text encoded by ``tokenizer=``.  The
  caller's path only enqueues; a full queue drops (counted, logged).
- **Traces** (``trace_path=``): sessions are written as conversation records
  readable by `agentspec.traces.read_traces` (``agentspec bench replay``).
- **Fleet** (``redis=``, or a store made with it): each call also gets a
  random ``agentspec_request_id`` in ``vllm_xargs`` (a caller's own value
  wins), and every choice is learned -- and published to the fleet -- under
  that identity, so a vLLM worker (or the embedded engine) that publishes
  the same output under the same identity adds nothing twice
  (docs/fleet.md, "Identities").
- **Spans** (with ``opentelemetry-api`` installed and a tracer provider set
  by the application): one GenAI-convention span per call, tags included
  (`agentspec._client.otel`).

Results are the openai objects themselves: a streamed call returns the real
``openai.Stream`` / ``AsyncStream`` (its iterator is teed).  Everything else
(``models``, ``embeddings``, ``base_url``, ...) is the wrapped client's.
``with_options`` / ``copy`` return a wrapped copy sharing the store, the
recorder and the trace file.  No retries are added: the openai client's own
``max_retries`` policy is the only one.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from time import monotonic
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import openai

from agentspec._client import otel
from agentspec._client.learn import Finished, Recorder, RecorderStats
from agentspec._client.outputs import Api, text_encoder
from agentspec._client.stream import tee_async_stream, tee_stream
from agentspec._client.tags import Tags, TagScope, resolve
from agentspec._client.trace import TraceSessions
from agentspec._util import live_metrics
from agentspec._util.keys import client_api_key
from agentspec._util.log import get_logger
from agentspec.exceptions import InvalidArgumentError
from agentspec.metrics import (
    CLIENT_CALLS_TOTAL,
    CLIENT_LEARN_QUEUE_DEPTH,
    CLIENT_LEARNED_SEQUENCES_TOTAL,
    CLIENT_PUBLISH_BACKLOG,
    CLIENT_PUBLISH_FAILURES_TOTAL,
    CLIENT_PUSH_BACKLOG,
    CLIENT_PUSH_FAILURES_TOTAL,
    key_labels,
)
from agentspec.protocol import (
    DEFAULT_TENANT,
    HEADER_PIPELINE,
    HEADER_SESSION,
    HEADER_STAGE,
    MAX_IDENTITY,
    XARG_REQUEST_ID,
    XARGS_FIELD,
    check_tag,
    encode_header_value,
    tag_xargs,
)

if TYPE_CHECKING:
    from agentspec._push.pusher import ShardPusher
    from agentspec._store.fleet_outbox import FleetOptions
    from agentspec._store.store import ShardStore

__all__ = ["AgentSpecClient", "AsyncAgentSpecClient", "ClientOptions", "RecorderStats"]

_log = get_logger()

#: Seconds `AgentSpecClient.close` waits for the workers to acknowledge pending pushes.
DEFAULT_CLOSE_TIMEOUT = 10.0

# Request fields kept (shallow-copied) for trace records.
_TRACE_FIELDS = ("model", "messages", "prompt", "input", "instructions", "n")


@dataclass(frozen=True)
class ClientOptions:
    """agentspec's own keywords of `AgentSpecClient` and `AsyncAgentSpecClient`.

    Both clients take these as keyword arguments, with these defaults (see
    `AgentSpecClient` for what each means), and hand them on as one value.
    """

    store: ShardStore | None = None
    tokenizer: object = None
    trace_path: str | os.PathLike[str] | None = None
    tenant: str = DEFAULT_TENANT
    return_token_ids: bool = False
    tags_in_body: bool = True
    queue_size: int = 1024
    push_to: str | Sequence[str] | None = None
    push_api_key: str | None = None
    lead_tokens: int = 8
    redis: str | FleetOptions | Literal[False] | None = None


class _Core:
    """What a client and its ``with_options`` copies share: tenant, options, recorder."""

    __slots__ = (
        "__weakref__",
        "calls",
        "calls_lock",
        "fleet",
        "owns_store",
        "pusher",
        "recorder",
        "return_token_ids",
        "store",
        "tags_in_body",
        "tenant",
    )

    def __init__(self, options: ClientOptions) -> None:
        self.tenant = check_tag(options.tenant, "tenant")
        self.return_token_ids = bool(options.return_token_ids)
        self.tags_in_body = bool(options.tags_in_body)
        encoder = text_encoder(options.tokenizer)
        store = options.store
        self.owns_store = store is None
        if store is None:
            from agentspec._store.store import ShardStore

            store = ShardStore(redis=options.redis)
        elif options.redis is not None:
            raise InvalidArgumentError("pass redis= to the ShardStore given as store=, not here")
        self.store = store
        self.fleet = store.fleet is not None
        trace_path = options.trace_path
        trace = TraceSessions(trace_path) if trace_path is not None else None
        self.recorder = Recorder(
            store,
            tenant=self.tenant,
            encoder=encoder,
            trace=trace,
            queue_size=options.queue_size,
            lead_tokens=options.lead_tokens,
        )
        self.pusher: ShardPusher | None = None
        if options.push_to is not None:
            from agentspec._push.pusher import ShardPusher

            self.pusher = ShardPusher(
                store, options.push_to, api_key=client_api_key(options.push_api_key)
            )
        self.calls: dict[tuple[str | None, str | None], int] = {}  # by (pipeline, stage)
        self.calls_lock = threading.Lock()
        live_metrics.track(self, _metric_samples)

    def count_call(self, tags: Tags) -> None:
        """Count one call under its ``(pipeline, stage)`` (for ``agentspec_client_calls_total``)."""
        key = (tags.pipeline, tags.stage)
        with self.calls_lock:
            self.calls[key] = self.calls.get(key, 0) + 1

    # -- the request side

    def prepare(
        self, api: Api, kwargs: dict[str, Any]
    ) -> tuple[Tags, dict[str, Any] | None, str | None]:
        """Strip the tag keywords, add tags to body and headers (in place).

        Returns the call's tags, when traces are recorded a snapshot of the
        request fields they need, and with a fleet the call's request id.
        """
        tags = resolve(
            kwargs.pop("session", None), kwargs.pop("stage", None), kwargs.pop("pipeline", None)
        )
        body = kwargs.get("extra_body")
        if body is None:
            body = {}
        elif isinstance(body, Mapping):
            body = dict(body)
        else:
            raise InvalidArgumentError(
                f"extra_body must be a mapping to add agentspec tags, got {type(body).__name__}"
            )
        request_id = None
        if self.tags_in_body:
            xargs = tag_xargs(
                self.tenant,
                session=tags.session,
                stage=tags.stage,
                pipeline=tags.pipeline,
                request_id=uuid.uuid4().hex if self.fleet else None,
            )
            own = body.get(XARGS_FIELD)
            if own is None:
                body[XARGS_FIELD] = xargs
            elif isinstance(own, Mapping):
                body[XARGS_FIELD] = {**xargs, **own}
            else:
                raise InvalidArgumentError(
                    f"extra_body[{XARGS_FIELD!r}] must be a mapping, got {type(own).__name__}"
                )
            if self.fleet:
                rid = body[XARGS_FIELD].get(XARG_REQUEST_ID)
                request_id = rid if isinstance(rid, str) and 1 <= len(rid) <= MAX_IDENTITY else None
        if self.return_token_ids and api != "responses":
            body.setdefault("return_token_ids", True)
        if body:
            kwargs["extra_body"] = body
        if tags.session is not None or tags.stage is not None or tags.pipeline is not None:
            given = kwargs.get("extra_headers")
            headers = dict(given) if isinstance(given, Mapping) else {}
            taken = {k.lower() for k in headers}
            for name, value in (
                (HEADER_SESSION, tags.session),
                (HEADER_STAGE, tags.stage),
                (HEADER_PIPELINE, tags.pipeline),
            ):
                if value is not None and name.lower() not in taken:
                    headers[name] = encode_header_value(value)
            kwargs["extra_headers"] = headers
        request = None
        if self.recorder.trace is not None:
            request = {
                k: list(v) if isinstance(v, list) else v
                for k in _TRACE_FIELDS
                if (v := kwargs.get(k)) is not None
            }
        return tags, request, request_id

    # -- the response side

    def finish(
        self,
        api: Api,
        tags: Tags,
        request: dict[str, Any] | None,
        result: Any,
        *,
        raw: bool,
        streamed: bool,
        is_async: bool,
        request_id: str | None = None,
        span: otel.CallSpan | None = None,
    ) -> Any:
        """Hand ``result`` to the recorder (now, or when its stream ends); return it.

        ``span`` (the call's OpenTelemetry span) is ended now, or when the stream ends.
        """
        recorder = self.recorder
        if raw and streamed:
            stream = result.parse()  # cached: the caller's parse() gets this same stream
        elif isinstance(result, (openai.Stream, openai.AsyncStream)):
            stream = result
        else:
            if span is not None:
                otel.end_result(span, api, result, raw)
            recorder.submit(Finished(api, tags, result, False, request, request_id))
            return result

        def done(items: list[Any]) -> None:
            recorder.submit(Finished(api, tags, items, True, request, request_id))

        on_exit: Callable[[list[Any], BaseException | None], object] | None = None
        if span is not None:
            call_span = span

            def on_exit(items: list[Any], error: BaseException | None) -> None:
                otel.end_stream(call_span, api, items, error)

            otel.end_when_dropped(stream, span)
        if is_async:
            tee_async_stream(stream, done, on_exit)
        else:
            tee_stream(stream, done, on_exit)
        return result

    def flush(self, timeout: float | None) -> bool:
        """Wait until queued calls are learned (and traced) and, with a pusher, pushed."""
        deadline = None if timeout is None else monotonic() + timeout
        if not self.recorder.flush(timeout):
            return False
        if self.pusher is None:
            return True
        return self.pusher.flush(None if deadline is None else max(0.0, deadline - monotonic()))

    def close(self, timeout: float | None = DEFAULT_CLOSE_TIMEOUT) -> bool:
        """Learn what is queued, push it (for up to ``timeout`` s), stop; close an owned store.

        Returns False when something was not learned, or not acknowledged by
        every worker in time; what was not pushed is then logged (a warning
        naming each endpoint's pending shard keys).
        """
        try:
            done = self.recorder.close()
            if self.pusher is not None:
                pushed = self.pusher.flush(timeout)
                if not pushed:
                    self._warn_unpushed(timeout)
                done = done and pushed
            live_metrics.retire(self)  # its counters stay counted
        finally:
            try:
                if self.pusher is not None:
                    self.pusher.close()
            finally:
                if self.owns_store:
                    self.store.close()
        return done

    def _warn_unpushed(self, timeout: float | None) -> None:
        """Log which shard keys each worker had not acknowledged when `close` gave up."""
        assert self.pusher is not None
        pending = {
            url: {
                "pending": ["/".join("-" if p is None else p for p in key) for key in st.pending],
                "last_error": st.last_error,
            }
            for url, st in self.pusher.status().items()
            if st.pending
        }
        _log.warning(
            "agentspec.client.push_incomplete",
            timeout=timeout,
            endpoints=pending,
            hint="the shards stay in the store: flush() longer before close(), or push the "
            "store again later (agentspec shards push)",
        )


def _metric_samples(core: _Core) -> Iterator[live_metrics.Sample]:
    """A client's ``agentspec_client_*`` rows for the default registry (`live_metrics`).

    The publish rows come from the client's store, counted once however many
    clients share it.
    """
    tenant = core.tenant
    with core.calls_lock:
        calls = list(core.calls.items())
    for (pipeline, stage), n in calls:
        yield (CLIENT_CALLS_TOTAL, key_labels(tenant, pipeline, stage), n)
    for (pipeline, stage), n in core.recorder.learned_by_key().items():
        yield (CLIENT_LEARNED_SEQUENCES_TOTAL, key_labels(tenant, pipeline, stage), n)
    yield (CLIENT_LEARN_QUEUE_DEPTH, (), core.recorder.stats().pending)
    backlog = failures = 0
    if core.pusher is not None and not core.pusher.closed:
        for st in core.pusher.status().values():
            backlog += len(st.pending)
            failures += st.errors
    yield (CLIENT_PUSH_BACKLOG, (), backlog)
    yield (CLIENT_PUSH_FAILURES_TOTAL, (), failures)
    outbox = core.store.fleet
    if outbox is not None:
        ost = outbox.stats()
        token = id(core.store)
        yield (CLIENT_PUBLISH_BACKLOG, (), ost.pending, token)
        yield (
            CLIENT_PUBLISH_FAILURES_TOTAL,
            (),
            ost.publisher.failures + ost.publisher.rejected,
            token,
        )
    else:
        yield (CLIENT_PUBLISH_BACKLOG, (), 0)
        yield (CLIENT_PUBLISH_FAILURES_TOTAL, (), 0)


# --- resource wrappers ------------------------------------------------------------------


def _server_of(client: Any) -> tuple[str | None, int | None]:
    """``(host, port)`` of an openai client's base URL, for spans."""
    url = getattr(client, "base_url", None)
    host = getattr(url, "host", None)
    port = getattr(url, "port", None)
    if port is None and host:
        port = 443 if getattr(url, "scheme", None) == "https" else 80
    return (host if isinstance(host, str) else None, port if isinstance(port, int) else None)


class _Resource:
    """A wrapped model-call resource (``chat.completions``, ``completions``, ``responses``)."""

    __slots__ = ("_api", "_core", "_raw", "_server", "_target")

    def __init__(
        self,
        core: _Core,
        target: Any,
        api: Api,
        *,
        raw: bool = False,
        server: tuple[str | None, int | None] = (None, None),
    ) -> None:
        self._core = core
        self._target = target
        self._api = api
        self._raw = raw
        self._server = server

    def _span(self, tags: Tags, kwargs: dict[str, Any]) -> otel.CallSpan | None:
        return otel.start_span(
            self._api, kwargs.get("model"), tags, self._core.tenant, self._server
        )

    def _call(self, method: str, kwargs: dict[str, Any], streamed: bool) -> Any:
        core = self._core
        tags, request, rid = core.prepare(self._api, kwargs)
        core.count_call(tags)
        span = self._span(tags, kwargs) if otel.ENABLED else None
        if span is None:
            result = getattr(self._target, method)(**kwargs)
        else:
            with otel.use(span):
                try:
                    result = getattr(self._target, method)(**kwargs)
                except BaseException as exc:
                    otel.end_error(span, exc)
                    raise
        return core.finish(
            self._api,
            tags,
            request,
            result,
            raw=self._raw,
            streamed=streamed and bool(kwargs.get("stream")),
            is_async=False,
            request_id=rid,
            span=span,
        )

    def create(self, **kwargs: Any) -> Any:
        """The openai ``create``, tagged and learned; also takes ``session=/stage=/pipeline=``."""
        return self._call("create", kwargs, True)

    def parse(self, **kwargs: Any) -> Any:
        """The openai ``parse`` (structured outputs), tagged and learned."""
        return self._call("parse", kwargs, False)

    def stream(self, **kwargs: Any) -> Any:
        """The openai ``stream`` helper, tagged (its output is not learned)."""
        self._core.prepare(self._api, kwargs)
        return self._target.stream(**kwargs)

    @property
    def with_raw_response(self) -> _Resource:
        """The same resource returning openai's raw responses."""
        return type(self)(
            self._core, self._target.with_raw_response, self._api, raw=True, server=self._server
        )

    @property
    def with_streaming_response(self) -> _TaggedOnly:
        """openai's ``with_streaming_response``, tagged (outputs are not learned)."""
        return _TaggedOnly(self._core, self._target.with_streaming_response, self._api)

    def __getattr__(self, name: str) -> Any:
        """Anything else is the wrapped resource's."""
        return getattr(self._target, name)


class _AsyncResource(_Resource):
    """`_Resource` for the async client."""

    __slots__ = ()

    async def _acall(self, method: str, kwargs: dict[str, Any], streamed: bool) -> Any:
        core = self._core
        tags, request, rid = core.prepare(self._api, kwargs)
        core.count_call(tags)
        span = self._span(tags, kwargs) if otel.ENABLED else None
        if span is None:
            result = await getattr(self._target, method)(**kwargs)
        else:
            with otel.use(span):
                try:
                    result = await getattr(self._target, method)(**kwargs)
                except BaseException as exc:
                    otel.end_error(span, exc)
                    raise
        return core.finish(
            self._api,
            tags,
            request,
            result,
            raw=self._raw,
            streamed=streamed and bool(kwargs.get("stream")),
            is_async=True,
            request_id=rid,
            span=span,
        )

    async def create(self, **kwargs: Any) -> Any:
        """The openai ``create``, tagged and learned; also takes ``session=/stage=/pipeline=``."""
        return await self._acall("create", kwargs, True)

    async def parse(self, **kwargs: Any) -> Any:
        """The openai ``parse`` (structured outputs), tagged and learned."""
        return await self._acall("parse", kwargs, False)


class _TaggedOnly:
    """A resource whose calls are tagged but not learned (``with_streaming_response``)."""

    __slots__ = ("_api", "_core", "_target")

    def __init__(self, core: _Core, target: Any, api: Api) -> None:
        self._core = core
        self._target = target
        self._api = api

    def __getattr__(self, name: str) -> Any:
        """Methods of the wrapped resource, with the tag keywords handled."""
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr
        core, api = self._core, self._api

        def call(**kwargs: Any) -> Any:
            core.prepare(api, kwargs)
            return attr(**kwargs)

        return call


class _Chat:
    """``client.chat``: its ``completions`` wrapped, anything else forwarded."""

    __slots__ = ("_target", "completions")

    def __init__(self, target: Any, completions: _Resource) -> None:
        self._target = target
        self.completions = completions

    def __getattr__(self, name: str) -> Any:
        """Anything else is the wrapped ``chat`` resource's."""
        return getattr(self._target, name)


class _View:
    """``client.with_raw_response`` / ``with_streaming_response`` of a wrapped client."""

    __slots__ = ("_target", "chat", "completions", "responses")

    def __init__(self, target: Any, make: Callable[[Any, Api], Any]) -> None:
        self._target = target
        self.chat = _Chat(target.chat, make(target.chat.completions, "chat"))
        self.completions = make(target.completions, "completions")
        self.responses = make(target.responses, "responses")

    def __getattr__(self, name: str) -> Any:
        """Anything else is the wrapped view's."""
        return getattr(self._target, name)


# --- the clients -------------------------------------------------------------------------


class _Base:
    """What the sync and async clients share."""

    _core: _Core
    _client: Any
    _resource_cls: type[_Resource] = _Resource
    chat: _Chat
    completions: _Resource
    responses: _Resource

    def _init(
        self,
        client_cls: type[Any],
        args: tuple[Any, ...],
        client: Any,
        openai_kwargs: dict[str, Any],
        options: ClientOptions,
    ) -> None:
        if client is None:
            if openai_kwargs.get("api_key") is None and not args:
                key = client_api_key()  # $AGENTSPEC_API_KEY, else $OPENAI_API_KEY
                if key is not None:
                    openai_kwargs = {**openai_kwargs, "api_key": key}
            client = client_cls(*args, **openai_kwargs)
        elif args or openai_kwargs:
            raise InvalidArgumentError(
                "pass either client= or openai constructor arguments, not both "
                f"(got {sorted(openai_kwargs) or len(args)})"
            )
        elif not isinstance(client, client_cls):
            raise TypeError(
                f"{type(self).__name__} wraps an openai.{client_cls.__name__}, "
                f"got {type(client).__name__}"
            )
        self._bind(_Core(options), client)

    def _bind(self, core: _Core, client: Any) -> None:
        self._core = core
        self._client = client
        cls = self._resource_cls
        server = _server_of(client)
        self.chat = _Chat(client.chat, cls(core, client.chat.completions, "chat", server=server))
        self.completions = cls(core, client.completions, "completions", server=server)
        self.responses = cls(core, client.responses, "responses", server=server)

    @property
    def openai_client(self) -> Any:
        """The wrapped openai client."""
        return self._client

    @property
    def store(self) -> ShardStore:
        """The shard store finished responses are learned into."""
        return self._core.store

    @property
    def tenant(self) -> str:
        """The tenant of every call of this client."""
        return self._core.tenant

    def session(
        self,
        session_id: str | None = None,
        *,
        pipeline: str | None = None,
        stage: str | None = None,
    ) -> TagScope:
        """A scope (``with`` / ``async with``) tagging calls with one session.

        A random id is made when ``session_id`` is None; entering returns the
        `Tags` in effect.  With a trace file, the session's conversation is
        written when the scope exits.
        """
        if session_id is None:
            import uuid

            session_id = uuid.uuid4().hex
        recorder = self._core.recorder
        return TagScope(
            session=session_id,
            pipeline=pipeline,
            stage=stage,
            on_exit=lambda tags: recorder.end_session(tags.session) if tags.session else None,
        )

    def stats(self) -> RecorderStats:
        """Counters of the learning recorder (submitted, learned, dropped, ...)."""
        return self._core.recorder.stats()

    def with_options(self, **kwargs: Any) -> Any:
        """openai's ``with_options`` / ``copy``, wrapped.

        The copy shares this client's store, recorder, trace file and pusher
        (closing either closes them).
        """
        new = object.__new__(type(self))
        new._bind(self._core, self._client.with_options(**kwargs))
        return new

    copy = with_options

    @property
    def with_raw_response(self) -> _View:
        """openai's ``client.with_raw_response``, with model calls tagged and learned."""
        core, cls, server = self._core, self._resource_cls, _server_of(self._client)
        return _View(
            self._client.with_raw_response,
            lambda r, api: cls(core, r, api, raw=True, server=server),
        )

    @property
    def with_streaming_response(self) -> _View:
        """openai's ``client.with_streaming_response``, with model calls tagged."""
        core = self._core
        return _View(self._client.with_streaming_response, lambda r, api: _TaggedOnly(core, r, api))

    def __getattr__(self, name: str) -> Any:
        """Anything not wrapped is the openai client's."""
        if name.startswith("__") or name in ("_core", "_client"):
            raise AttributeError(name)
        return getattr(self._client, name)

    def __repr__(self) -> str:
        """``AgentSpecClient(base_url=..., tenant=...)``."""
        return (
            f"{type(self).__name__}(base_url={str(self._client.base_url)!r}, "
            f"tenant={self._core.tenant!r})"
        )


class AgentSpecClient(_Base):
    """A drop-in for ``openai.OpenAI`` that tags calls and learns their outputs.

    ``AgentSpecClient(api_key=..., base_url=...)`` builds the openai client;
    ``AgentSpecClient(client=OpenAI(...))`` wraps one.  agentspec's own
    keywords:

    - ``store``: the `ShardStore` to learn into (default: a new in-memory
      store, closed with the client);
    - ``tokenizer``: fallback for responses without token ids -- a path to
      ``tokenizer.json`` (or its directory), a ``tokenizers.Tokenizer`` or a
      callable ``str -> list[int]``;
    - ``return_token_ids``: ask the server (vLLM) for the output token ids
      (``return_token_ids: true`` in chat / completions bodies);
    - ``trace_path``: append the sessions as conversation records to this
      trace file (``.gz`` for gzip);
    - ``tenant``: the tenant of every call (default ``"default"``);
    - ``tags_in_body``: send ``vllm_xargs`` (set False for servers that
      refuse unknown body fields; the headers are still sent);
    - ``queue_size``: the recorder's queue bound (calls; more are dropped);
    - ``push_to`` / ``push_api_key``: worker URLs to push the store's shards
      to (a `ShardPusher` on its own thread; `flush` waits for the workers,
      `close` too, for up to ``timeout`` seconds) and their key (default
      ``$AGENTSPEC_API_KEY``, else ``$OPENAI_API_KEY``);
    - ``lead_tokens``: when the server returns the prompt's token ids too
      (vLLM ``prompt_token_ids``), learn each output behind the prompt's last
      ``lead_tokens`` ids, as `agentspec.Speculator` does (0: output only);
    - ``redis``: publish what is learned to the fleet (a Redis URL or
      `FleetOptions`; only for the store the client makes itself -- give a
      ``store=`` its own ``redis=``; default: ``AGENTSPEC_REDIS_URL``, else the
      file named by ``AGENTSPEC_REDIS_URL_FILE``).

    Without ``api_key`` (and ``client``) the openai client's key is
    ``$AGENTSPEC_API_KEY``, else ``$OPENAI_API_KEY`` (see `agentspec._util.keys`).
    See the module docstring for what is tagged and learned.
    """

    def __init__(
        self,
        *args: Any,
        client: openai.OpenAI | None = None,
        store: ShardStore | None = None,
        tokenizer: object = None,
        trace_path: str | os.PathLike[str] | None = None,
        tenant: str = DEFAULT_TENANT,
        return_token_ids: bool = False,
        tags_in_body: bool = True,
        queue_size: int = 1024,
        push_to: str | Sequence[str] | None = None,
        push_api_key: str | None = None,
        lead_tokens: int = 8,
        redis: str | FleetOptions | Literal[False] | None = None,
        **openai_kwargs: Any,
    ) -> None:
        """Build or wrap the openai client; see the class docstring."""
        self._init(
            openai.OpenAI,
            args,
            client,
            openai_kwargs,
            ClientOptions(
                store=store,
                tokenizer=tokenizer,
                trace_path=trace_path,
                tenant=tenant,
                return_token_ids=return_token_ids,
                tags_in_body=tags_in_body,
                queue_size=queue_size,
                push_to=push_to,
                push_api_key=push_api_key,
                lead_tokens=lead_tokens,
                redis=redis,
            ),
        )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every finished call is learned, traced and pushed; False on timeout."""
        return self._core.flush(timeout)

    def close(self, timeout: float | None = DEFAULT_CLOSE_TIMEOUT) -> bool:
        """Learn what is queued, push it, stop recorder and pusher; close the store and openai.

        With ``push_to``, waits up to ``timeout`` seconds (None: no limit) for
        every worker to acknowledge what was learned, as `flush` does.
        Returns True when everything was learned and pushed; False otherwise,
        and then a warning (logger ``agentspec``, event
        ``agentspec.client.push_incomplete``) names each endpoint's pending
        shard keys.
        """
        try:
            return self._core.close(timeout)
        finally:
            self._client.close()

    def __enter__(self) -> AgentSpecClient:
        """Return the client."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """`close` the client."""
        self.close()


class AsyncAgentSpecClient(_Base):
    """A drop-in for ``openai.AsyncOpenAI``; same keywords as `AgentSpecClient`.

    Learning runs on a worker thread as for the sync client: the event loop
    only enqueues.  `flush` and `close` are coroutines.
    """

    _resource_cls = _AsyncResource

    def __init__(
        self,
        *args: Any,
        client: openai.AsyncOpenAI | None = None,
        store: ShardStore | None = None,
        tokenizer: object = None,
        trace_path: str | os.PathLike[str] | None = None,
        tenant: str = DEFAULT_TENANT,
        return_token_ids: bool = False,
        tags_in_body: bool = True,
        queue_size: int = 1024,
        push_to: str | Sequence[str] | None = None,
        push_api_key: str | None = None,
        lead_tokens: int = 8,
        redis: str | FleetOptions | Literal[False] | None = None,
        **openai_kwargs: Any,
    ) -> None:
        """Build or wrap the openai client; see the class docstring."""
        self._init(
            openai.AsyncOpenAI,
            args,
            client,
            openai_kwargs,
            ClientOptions(
                store=store,
                tokenizer=tokenizer,
                trace_path=trace_path,
                tenant=tenant,
                return_token_ids=return_token_ids,
                tags_in_body=tags_in_body,
                queue_size=queue_size,
                push_to=push_to,
                push_api_key=push_api_key,
                lead_tokens=lead_tokens,
                redis=redis,
            ),
        )

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every finished call is learned, traced and pushed; False on timeout."""
        return await asyncio.to_thread(self._core.flush, timeout)

    async def close(self, timeout: float | None = DEFAULT_CLOSE_TIMEOUT) -> bool:
        """Learn, push (up to ``timeout`` s), stop, close (see `AgentSpecClient.close`)."""
        try:
            return await asyncio.to_thread(self._core.close, timeout)
        finally:
            await self._client.close()

    async def __aenter__(self) -> AsyncAgentSpecClient:
        """Return the client."""
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """`close` the client."""
        await self.close()
