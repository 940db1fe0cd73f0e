"""The embedded engine's OpenAI-compatible HTTP server (`agentspec._util.http_server`).

Routes:

- ``GET /v1/models`` -- the served model.
- ``POST /v1/chat/completions``, ``POST /v1/completions`` -- generation,
  streamed as server-sent events (``data: {...}`` ... ``data: [DONE]``) or not.
- ``/v1/agentspec/...`` -- the shard push routes of `agentspec.ShardIntake`,
  mounted as they are: shards a `ShardPusher` sends here are drafted from
  together with the engine's own learned shards.
- ``GET /health`` -- 200 while serving (no authentication).
- ``GET /metrics`` -- the engine's Prometheus metrics (`Engine.metrics`), for
  the keys of the shard routes (below); 404 when metrics are off.

Keys (see docs/engine.md, "Keys and tenants"):

- ``api_key``: with it every ``/v1`` route needs ``Authorization: Bearer
  <key>``.  Alone it guards everything, shard routes included, and the
  tenant is whatever the body's ``vllm_xargs.agentspec_tenant`` says: no
  isolation between tenants.
- ``tenant_keys`` (an API key -> tenant map, `agentspec.protocol`): the
  tenant of an OpenAI request comes from its bearer key only (the body's
  ``agentspec_tenant`` is overridden, as the vLLM middleware does); a key
  in the map is accepted, so is ``api_key`` (tenant ``"default"``), any
  other key gets 401.  Drafts, learned shards and the response's
  ``"agentspec"`` counters then only ever involve the caller's tenant.
- ``admin_key``: the only key the ``/v1/agentspec/...`` shard routes accept
  (push, delete, list); an inference key gets 403 there.  With a tenant map
  and no admin key the shard routes are closed (403).

Requests run one at a time in arrival order (the model holds one sequence);
a client that disconnects stops its request, queued or running.

`run_engine_server` is what ``agentspec serve`` calls when vLLM is not
installed; `EngineServer` runs the same server in-process (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from agentspec._push.intake import ShardIntake, serve_shard_request
from agentspec._push.wire import API_PREFIX, ErrorType, check_bearer
from agentspec._util.http_server import ThreadedHTTPServer, TrackedRequestHandler
from agentspec._util.log import get_logger
from agentspec.engine._engine import (
    Completion,
    Engine,
    EngineOptions,
    GenerationCancelledError,
    TextDelta,
)
from agentspec.engine._openai import (
    CHAT,
    COMPLETIONS,
    ApiError,
    ParsedRequest,
    completion_object,
    error_body,
    final_chunk,
    first_chunk,
    new_id,
    parse_request,
    text_chunk,
    usage_chunk,
)
from agentspec.exceptions import InvalidArgumentError
from agentspec.metrics import CONTENT_TYPE, metrics_enabled
from agentspec.protocol import DEFAULT_TENANT, bearer_token, check_tenant_keys, tenant_of

if TYPE_CHECKING:  # redis is only needed with a fleet
    from agentspec.engine._fleet import EngineFleet

__all__ = ["EngineServer", "default_threads", "run_engine_server"]

_log = get_logger()

#: Largest JSON request body accepted on the OpenAI routes.
MAX_REQUEST_BYTES = 16 << 20

_ROUTES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS}

#: The message of a 500 answer; what went wrong is logged, never sent.
_INTERNAL_ERROR = "internal server error (see the server log)"

#: The access log's status of a request whose client went away before the answer.
_CLIENT_CLOSED = 499

#: The Prometheus route (`EngineServer.metrics_access` says who may read it).
METRICS_PATH = "/metrics"


def default_threads() -> int:
    """The default torch thread count: ``min(4, cpu count)``."""
    return max(1, min(4, os.cpu_count() or 1))


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the client closed its side of ``sock`` (a pending EOF, or a dead socket)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True


class _Handler(TrackedRequestHandler, BaseHTTPRequestHandler):
    """OpenAI routes here; ``/v1/agentspec/...`` to the intake (`serve_shard_request`)."""

    server: _EngineHTTPServer
    #: The access log's status and result of the request being served.
    _access_status: int | None = None
    _access_done: Completion | None = None

    # --- routing ----------------------------------------------------------

    def _route(self) -> None:
        """Serve one request of any method."""
        path = self.path.partition("?")[0]
        if path.startswith(API_PREFIX):
            refused = self.server.owner.shard_access(self.headers.get("Authorization"))
            if refused is not None:
                self._drain()
                self._error(refused)
                return
            intake = self.server.intake
            serve_shard_request(self, intake, intake.handle)
            return
        try:
            self._openai(path)
        except ApiError as err:
            self._drain()
            self._error(err)

    def do_GET(self) -> None:
        """Serve a GET request."""
        self._route()

    def do_POST(self) -> None:
        """Serve a POST request."""
        self._route()

    def do_PUT(self) -> None:
        """Serve a PUT request."""
        self._route()

    def do_DELETE(self) -> None:
        """Serve a DELETE request."""
        self._route()

    def do_PATCH(self) -> None:
        """Serve a PATCH request."""
        self._route()

    def _openai(self, path: str) -> None:
        owner = self.server.owner
        if path == "/health" and self.command == "GET":
            self._json(200, {"status": "ok"})
            return
        if path == METRICS_PATH:
            self._metrics()
            return
        tenant = (
            owner.tenant_for(self.headers.get("Authorization")) if path.startswith("/v1/") else None
        )
        if path == "/v1/models":
            if self.command != "GET":
                raise ApiError(405, f"{self.command} not allowed on {path}")
            self._json(200, owner.models_object())
            return
        kind = _ROUTES.get(path)
        if kind is None:
            raise ApiError(404, f"unknown route {path[:200]}", "not_found_error")
        if self.command != "POST":
            raise ApiError(405, f"{self.command} not allowed on {path}")
        body = self._read_body()
        headers = dict(self.headers.items())
        req = parse_request(kind, body, headers, owner.engine, owner.model_names, tenant=tenant)
        if req.stream:
            self._stream(req)
        else:
            self._complete(req)

    def _metrics(self) -> None:
        """``GET /metrics``: the engine's registry, for the keys of the shard routes."""
        owner = self.server.owner
        if self.command != "GET":
            raise ApiError(405, f"{self.command} not allowed on {METRICS_PATH}")
        refused = owner.metrics_access(self.headers.get("Authorization"))
        if refused is not None:
            raise refused
        metrics = owner.engine.metrics
        if metrics is None:
            raise ApiError(
                404, "metrics are off on this server (AGENTSPEC_METRICS=0 or --no-metrics)",
                "not_found_error",
            )  # fmt: skip
        data = metrics.render()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # --- bodies -----------------------------------------------------------

    def _content_length(self) -> int | None:
        raw = self.headers.get("Content-Length")
        if raw is None:
            return None
        try:
            n = int(raw)
        except ValueError:
            n = -1
        if n < 0:
            self.close_connection = True
            raise ApiError(400, "bad Content-Length header")
        return n

    def _read_body(self) -> bytes:
        length = self._content_length()
        if length is None:
            self.close_connection = True
            raise ApiError(411, "a Content-Length header is required")
        if length > MAX_REQUEST_BYTES:
            self.close_connection = True
            raise ApiError(413, f"request body over {MAX_REQUEST_BYTES} bytes")
        body = self.rfile.read(length) if length else b""
        if len(body) != length:
            self.close_connection = True
            raise ApiError(400, "the request body ended early")
        self._body_read = True
        return body

    def _drain(self) -> None:
        """Read an unread small body so the client gets the answer, not a reset."""
        if getattr(self, "_body_read", False):
            return
        try:
            length = self._content_length()
        except ApiError:
            return
        if length:
            if length <= 1 << 20:
                self.rfile.read(length)
            else:
                self.close_connection = True

    # --- answers ----------------------------------------------------------

    def _json(self, status: int, obj: Any, extra: Mapping[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, err: ApiError) -> None:
        extra = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
        data = error_body(err.message, err.type, err.param, err.code)
        self.send_response(err.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in extra.items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _cancelled(self) -> bool:
        return _peer_closed(self.connection)

    def _complete(self, req: ParsedRequest) -> None:
        rid = new_id(req.kind)
        gen = self.server.owner.engine.generate(_named(req, rid).generation, self._cancelled)
        done: Completion | None = None
        try:
            for item in gen:
                if isinstance(item, Completion):
                    done = item
        except GenerationCancelledError:
            self.close_connection = True
            self._access_status = _CLIENT_CLOSED
            return
        finally:
            gen.close()
        if done is None:  # pragma: no cover - the engine always ends with a Completion
            raise ApiError(500, "the engine produced no result", "server_error")
        self._access_done = done
        self._json(200, completion_object(req, rid, done))

    def _stream(self, req: ParsedRequest) -> None:
        rid, created = new_id(req.kind), int(time.time())
        gen = self.server.owner.engine.generate(_named(req, rid).generation, self._cancelled)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            first = first_chunk(req, rid, created, list(req.generation.prompt_ids))
            if first is not None:
                self._event(first)
            for item in gen:
                if isinstance(item, TextDelta):
                    if item.text or (req.return_token_ids and item.token_ids):
                        self._event(text_chunk(req, rid, created, item.text, item.token_ids))
                    continue
                self._access_done = item
                self._event(final_chunk(req, rid, created, item.finish_reason, item.stats))
                if req.include_usage:
                    self._event(usage_chunk(req, rid, created, item))
            self._event("[DONE]")
        except (GenerationCancelledError, ConnectionError, TimeoutError):
            _log.debug("agentspec.engine.stream_cancelled", id=rid)
        except Exception:  # the answer has started: report the error in-band
            _log.exception("agentspec.engine.stream_failed", id=rid)
            with contextlib.suppress(OSError):  # details only in the log
                body = error_body(_INTERNAL_ERROR, "server_error", None, "internal_error")
                err = json.loads(body)
                self._event(err)
                self._event("[DONE]")
        finally:
            gen.close()

    def _event(self, obj: Any) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def handle_one_request(self) -> None:
        """Serve one request; unexpected errors become a 500 answer when none was sent.

        Every request answered (or cancelled by its client: status 499) gets
        one access-log line at INFO, ``agentspec.engine.request``.
        """
        self._body_read = False
        self._access_status = None
        self._access_done = None
        start = time.monotonic()
        try:
            super().handle_one_request()
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception:
            _log.exception("agentspec.engine.request_failed", path=self.path[:200])
            self.close_connection = True
            with contextlib.suppress(OSError):  # details only in the log
                self._error(ApiError(500, _INTERNAL_ERROR, "server_error"))
        finally:
            self._access_log(start)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Remember the answer's status for the access log (``send_response`` calls this)."""
        with contextlib.suppress(TypeError, ValueError):
            self._access_status = int(code)
        super().log_request(code, size)

    def _access_log(self, start: float) -> None:
        """The request's access-log line: status, tokens, verification steps, milliseconds."""
        status = self._access_status
        if status is None:
            return  # no request was read (an idle keep-alive connection ended)
        done = self._access_done
        _log.info(
            "agentspec.engine.request",
            method=getattr(self, "command", None) or "-",
            path=str(getattr(self, "path", "-")).partition("?")[0][:200],
            status=status,
            prompt_tokens=None if done is None else len(done.prompt_ids),
            completion_tokens=None if done is None else len(done.token_ids),
            steps=None if done is None else done.stats.steps,
            ms=round((time.monotonic() - start) * 1000.0, 1),
        )


def _named(req: ParsedRequest, rid: str) -> ParsedRequest:
    """``req`` with the fleet identity set: the client's request id, else the server's ``rid``."""
    if req.generation.identity is not None:
        return req
    return dataclasses.replace(req, generation=dataclasses.replace(req.generation, identity=rid))


class _EngineHTTPServer(ThreadedHTTPServer):
    """The engine's threaded HTTP server (backlog 1024), holding the intake it mounts."""

    owner: EngineServer
    #: The names its connection events have always had (the shard routes' server).
    log_name = "agentspec.intake"

    def __init__(
        self, address: tuple[str, int], intake: ShardIntake, handler: type[_Handler]
    ) -> None:
        """Bind to ``address`` (port 0: any free port) without serving yet."""
        self.intake = intake
        super().__init__(address, handler)


class EngineServer:
    """The engine's HTTP server: ``with EngineServer(engine) as srv: ... srv.base_url``.

    Args:
        engine: the `Engine` answering the OpenAI routes.
        host, port: where to listen (port 0: a free port).
        api_key: bearer token required on every ``/v1`` route (None: open);
            with ``tenant_keys`` it is one more accepted key, of the
            ``"default"`` tenant.
        served_model_name: the model name(s) requests may use; the first
            one is listed by ``/v1/models``.
        intake: the shard intake (default: a new `ShardIntake` demanding the
            admin key, else the API key, with the engine's tree depth).
            Give the same intake to the engine as its ``pushed_tree``
            source; `create` does both.
        tenant_keys: API key -> tenant map (see the module docstring); None:
            the body's ``agentspec_tenant`` picks the tenant (no isolation).
        admin_key: the key of the ``/v1/agentspec/...`` shard routes (None:
            they take ``api_key``, or are closed when there is a tenant map).
        fleet: the engine's `EngineFleet` (its counters join ``GET shards``
            stats as ``"fleet"``); the engine must use it (`create` does).

    Raises:
        InvalidArgumentError: a bad tenant map, or an admin key that is also
            an inference key.
    """

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        api_key: str | None = None,
        served_model_name: str | tuple[str, ...] = "smollm2-135m",
        intake: ShardIntake | None = None,
        tenant_keys: Mapping[str, str] | None = None,
        admin_key: str | None = None,
        fleet: EngineFleet | None = None,
    ) -> None:
        """Bind (serving starts with `start` or `serve_forever`)."""
        self.engine = engine
        self.api_key = api_key or None
        self.admin_key = admin_key or None
        self.tenant_keys: dict[str, str] | None = (
            None if tenant_keys is None else check_tenant_keys(tenant_keys)
        )
        _check_admin_key(self.admin_key, self.api_key, self.tenant_keys)
        names = (served_model_name,) if isinstance(served_model_name, str) else served_model_name
        if not names:
            raise ValueError("at least one served model name is needed")
        self.model_names: tuple[str, ...] = tuple(names)
        self.intake = intake or _engine_intake(engine.options, self.admin_key or self.api_key)
        if self.intake.vocab_size is None:
            self.intake.vocab_size = engine.verifier.vocab_size
        self.intake.add_stats("learned", engine.learned_stats)
        self.fleet = fleet
        if fleet is not None:
            self.intake.add_stats("fleet", fleet.stats)
        if engine.metrics is not None:
            engine.metrics.watch_intake(self.intake)
            engine.metrics.watch_fleet(fleet)
        self.created = int(time.time())
        self._httpd = _EngineHTTPServer((host, port), self.intake, _Handler)
        self._httpd.owner = self
        self._thread: threading.Thread | None = None

    @classmethod
    def create(
        cls,
        model: Any,
        tokenizer: Any,
        options: EngineOptions | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        api_key: str | None = None,
        served_model_name: str | tuple[str, ...] = "smollm2-135m",
        tenant_keys: Mapping[str, str] | None = None,
        admin_key: str | None = None,
        fleet: EngineFleet | None = None,
    ) -> EngineServer:
        """An `Engine` over ``model`` whose pushed shards come from this server's intake.

        With ``fleet`` the engine also drafts from the fleet's shards and
        publishes each finished response (see `EngineFleet`).
        """
        opts = options or EngineOptions()
        checked = None if tenant_keys is None else check_tenant_keys(tenant_keys)
        _check_admin_key(admin_key or None, api_key or None, checked)
        intake = _engine_intake(opts, admin_key or api_key or None)
        engine = Engine(
            model,
            tokenizer,
            opts,
            pushed_tree=intake.tree,
            fleet_tree=None if fleet is None else fleet.tree,
            on_learned=None if fleet is None else fleet.publish,
        )
        return cls(
            engine,
            host,
            port,
            api_key=api_key,
            served_model_name=served_model_name,
            intake=intake,
            tenant_keys=checked,
            admin_key=admin_key,
            fleet=fleet,
        )

    # --- keys -----------------------------------------------------------------

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of an OpenAI request with this ``Authorization`` header.

        None without a tenant map (the body names the tenant).

        Raises:
            ApiError: 401, the key is not accepted.
        """
        if self.tenant_keys is not None:
            tenant = tenant_of(self.tenant_keys, bearer_token(authorization))
            if tenant is not None:
                return tenant
            if self.api_key is not None and check_bearer(authorization, self.api_key):
                return DEFAULT_TENANT
        elif check_bearer(authorization, self.api_key):
            return None
        raise ApiError(401, "missing or invalid API key", ErrorType.AUTHENTICATION)

    def shard_access(self, authorization: str | None) -> ApiError | None:
        """Why a ``/v1/agentspec/...`` request with this header is refused (None: it may go on).

        With an admin key only that key gets through (an inference key: 403,
        anything else: 401).  With a tenant map and no admin key the routes
        are closed.  With neither, the intake checks the API key as before.
        """
        if self.admin_key is None and self.tenant_keys is None:
            return None
        if self.admin_key is not None and check_bearer(authorization, self.admin_key):
            return None
        try:
            self.tenant_for(authorization)
        except ApiError as err:
            return err
        if self.admin_key is None:
            return ApiError(
                403,
                "the shard routes are closed: this server maps API keys to tenants and has "
                "no admin key (agentspec serve --admin-key)",
                ErrorType.FORBIDDEN,
            )
        return ApiError(
            403, "the shard routes need the admin key, not an inference key", ErrorType.FORBIDDEN
        )

    def metrics_access(self, authorization: str | None) -> ApiError | None:
        """Why a ``GET /metrics`` with this header is refused (None: it may go on).

        The metrics name every tenant's stages, so they take the keys of the shard
        routes (`shard_access`): the admin key when there is one; with neither an
        admin key nor a tenant map, the API key (open without one); with a tenant
        map and no admin key they are closed (403).
        """
        if self.admin_key is None and self.tenant_keys is None:
            if check_bearer(authorization, self.api_key):
                return None
            return ApiError(401, "missing or invalid API key", ErrorType.AUTHENTICATION)
        if self.admin_key is not None and check_bearer(authorization, self.admin_key):
            return None
        try:
            self.tenant_for(authorization)
        except ApiError as err:
            return err
        why = "" if self.admin_key else " (agentspec serve --admin-key); this server has none"
        return ApiError(403, f"{METRICS_PATH} needs the admin key{why}", ErrorType.FORBIDDEN)

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return self._httpd.url

    @property
    def base_url(self) -> str:
        """``http://host:port/v1`` (an OpenAI client's ``base_url``)."""
        return self._httpd.url + "/v1"

    @property
    def port(self) -> int:
        """The bound port."""
        return self._httpd.port

    def models_object(self) -> dict[str, Any]:
        """The ``GET /v1/models`` answer."""
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "agentspec",
                    "root": self.model_names[0],
                    "max_model_len": self.engine.max_model_len,
                }
                for name in self.model_names
            ],
        }

    def serve_forever(self) -> None:
        """Serve in this thread until `stop` (from another thread) or KeyboardInterrupt."""
        self._httpd.serve_forever(poll_interval=0.2)

    def start(self) -> EngineServer:
        """Serve on a daemon thread."""
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"agentspec-engine-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving, close every connection and the socket."""
        if self._thread is not None:
            self._httpd.stop(self._thread, timeout)
            self._thread = None
        else:
            self._httpd.drop_connections()
            self._httpd.server_close()

    def __enter__(self) -> EngineServer:
        """Start serving on a daemon thread."""
        return self.start()

    def __exit__(self, *exc: object) -> None:
        """Stop serving."""
        self.stop()


def _engine_intake(options: EngineOptions, api_key: str | None) -> ShardIntake:
    """The shard intake of an engine server: its depth, body cap and budgets.

    The vocabulary bound is set once the engine (and so the model's
    vocabulary size) exists.
    """
    return ShardIntake(
        api_key=api_key,
        max_depth=options.max_depth,
        max_body_bytes=options.max_body_bytes,
        max_bytes=options.max_shard_bytes,
        max_tenant_bytes=options.max_tenant_shard_bytes,
    )


def _check_admin_key(
    admin_key: str | None, api_key: str | None, tenant_keys: Mapping[str, str] | None
) -> None:
    """An admin key must not also be an inference key (it would then do both)."""
    if admin_key is None:
        return
    if admin_key == api_key or (
        tenant_keys is not None and tenant_of(tenant_keys, admin_key) is not None
    ):
        raise InvalidArgumentError(
            "the admin key must differ from the API key and from every key of the tenant map"
        )


def run_engine_server(
    model: str = "smollm2-135m",
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    *,
    threads: int | None = None,
    served_model_name: str | Sequence[str] | None = None,
    max_model_len: int | None = None,
    speculate: bool = True,
    tree_drafts: bool = False,
    default_max_tokens: int = 1024,
    dtype: str = "float32",
    tenant_keys: Mapping[str, str] | None = None,
    admin_key: str | None = None,
    budgets: Mapping[str, Any] | None = None,
    redis_url: str | None = None,
    fleet_tenants: Sequence[str] | None = None,
    max_spec_tokens: int | None = None,
    max_depth: int | None = None,
    goodput: bool = True,
    ready: Callable[[EngineServer], object] | None = None,
    metrics: bool | None = None,
    cpu_kernels: bool = True,
) -> None:
    """Load ``model`` and serve it on ``host:port`` until interrupted (``agentspec serve``).

    Args:
        model: a model name (``"smollm2-135m"``, fetched on first use) or a
            Hugging Face model folder (see `agentspec.models.resolve_model`).
        host, port: where to listen.
        api_key: bearer token required on every ``/v1`` route.
        threads: torch CPU threads (default `default_threads`).
        served_model_name: the name clients use, or several (the first is
            listed by ``/v1/models``; default: ``model``).
        max_model_len: longest prompt + output (default: the model's).
        speculate: draft from stage shards unless a request turns it off.
        tree_drafts: draft trees instead of chains.
        goodput: cut drafts to what pays (see `EngineOptions`); False: the
            fixed draft rule.
        default_max_tokens: output limit of requests that set none.
        dtype: torch dtype of the weights.
        tenant_keys: API key -> tenant map (tenants from the keys only).
        admin_key: the only key of the shard routes.
        budgets: `EngineOptions` memory fields to set (``max_shard_bytes``,
            ``max_tenant_shard_bytes``, ``max_learned_bytes``,
            ``max_tenant_learned_bytes``, ``max_shard_tokens``,
            ``max_body_bytes``); the others keep their defaults.
        redis_url: follow the fleet on this Redis (`EngineFleet`): draft
            from its shards, publish finished responses.
        fleet_tenants: the tenants to follow (default: the tenant map's
            tenants, else ``"default"``).
        max_spec_tokens: most draft tokens per step (default: `DraftParams`'s).
        max_depth: depth of the shard trees (default: `EngineOptions`'s).
        ready: called with the server once its socket listens, just before
            it serves (``agentspec serve`` prints its ready line there).
        metrics: serve Prometheus metrics on ``GET /metrics`` (default: on
            unless ``AGENTSPEC_METRICS=0``).
        cpu_kernels: pack the model's linear layers for oneDNN and keep grouped
            attention heads grouped (see `EngineOptions`); False: stock kernels.

    Raises:
        agentspec.exceptions.ListenError: ``host:port`` cannot be listened on
            (checked before the model loads).
        agentspec.models.ModelError: the model cannot be fetched or loaded.
        OSError: the address cannot be bound.
    """
    from agentspec._util.cli import check_listen

    check_listen(host, port)  # before the model loads: a busy port fails at once

    import torch

    from agentspec._core.draft import DraftParams
    from agentspec.models import DEFAULT_MODEL, MODEL_ALIASES, load_model

    torch.set_num_threads(threads or default_threads())
    loaded, tokenizer = load_model(model, dtype=dtype)
    if served_model_name is None or isinstance(served_model_name, str):
        names: tuple[str, ...] = (served_model_name or str(model),)
    else:
        names = tuple(served_model_name) or (str(model),)
    if str(model).lower() in MODEL_ALIASES:
        names += tuple(sorted({DEFAULT_MODEL, *MODEL_ALIASES} - set(names)))
    depth: dict[str, Any] = {} if max_depth is None else {"max_depth": max_depth}
    options = EngineOptions(
        max_model_len=max_model_len,
        default_max_tokens=default_max_tokens,
        speculate=speculate,
        tree_drafts=tree_drafts,
        goodput=goodput,
        draft_params=None
        if max_spec_tokens is None
        else DraftParams.confident(max_spec_tokens=max_spec_tokens),
        metrics=metrics_enabled() if metrics is None else metrics,
        cpu_kernels=cpu_kernels,
        **depth,
        **dict(budgets or {}),
    )
    fleet = None
    if redis_url:
        from agentspec._fleet.config import FleetConfig
        from agentspec.engine._fleet import EngineFleet, fleet_tenants_for

        budget = options.max_shard_tokens
        fleet = EngineFleet(
            redis_url,
            fleet_tenants_for(fleet_tenants, tenant_keys, api_key),
            config=FleetConfig(
                options.max_depth, budget if budget else FleetConfig().max_shard_tokens
            ),
        )
    try:
        server = EngineServer.create(
            loaded,
            tokenizer,
            options,
            host,
            port,
            api_key=api_key,
            served_model_name=names,
            tenant_keys=tenant_keys,
            admin_key=admin_key,
            fleet=fleet,
        )
    except BaseException:
        if fleet is not None:
            fleet.close(0)
        raise
    _log.info(
        "agentspec.engine.serving",
        url=server.base_url,
        model=names[0],
        threads=torch.get_num_threads(),
        speculate=speculate,
        tree_drafts=tree_drafts,
        tenants="from API keys"
        if tenant_keys is not None
        else "from request bodies (no isolation)",
        shard_routes="admin key"
        if admin_key
        else ("closed" if tenant_keys is not None else "API key"),
        pushed_budget=server.intake.budget(),
        learned_budget={
            "max_bytes": options.max_learned_bytes,
            "max_tenant_bytes": options.max_tenant_learned_bytes,
            "max_shard_tokens": options.max_shard_tokens,
        },
        fleet=None if fleet is None else {"redis": fleet.url, "tenants": list(fleet.tenants)},
    )
    try:
        if ready is not None:
            ready(server)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        if fleet is not None:
            fleet.close()
        server.engine.close()
