"""The API-server half of the plugin: ``/v1/agentspec/*`` routes forwarded to the workers.

vLLM loads it as the ``vllm.endpoint_plugins`` entry point ``agentspec``, but
only when ``VLLM_PLUGINS`` names it::

    VLLM_PLUGINS=agentspec python -m vllm.entrypoints.openai.api_server ... \\
        --worker-extension-cls agentspec_vllm.worker_ext.AgentSpecWorkerExtension

It speaks exactly the push protocol of `agentspec.integration` (what `ShardPusher`
sends and `ShardIntake` answers), under ``/v1`` so that vLLM's ``--api-key``
guards it:

* checks that need no engine run here, in the API server process: the
  agentspec API key (``api_key`` of `agentspec_vllm.config`, on top of
  vLLM's own ``--api-key``), route and method, body size (413 before the
  body is read), the shard key, the content type, and the shard bytes
  themselves (a snapshot or delta is loaded into a scratch tree, off the
  event loop): malformed input gets its 400 / 409 / 415 without the engine
  being touched;
* accepted requests go to every worker through
  ``engine_client.collective_rpc("agentspec_handle", args=(method, path,
  query, headers, body))``, answered by the worker's `ShardIntake`; its
  answer (and its ``instance`` id) is passed back unchanged;
* ``snapshot-file`` requests forward the file's path (the worker reads the
  file, which must lie in its ``shm_dir``); a large uploaded snapshot is
  itself handed over as a file in ``shm_dir`` when one is configured, so
  that big shards do not travel through the engine's RPC channel;
* ``GET /v1/agentspec/stats`` returns every worker's ``agentspec_stats()``;
* ``GET /v1/agentspec/metrics`` returns the plugin's Prometheus metrics,
  collected afresh from every worker; the same families are on vLLM's own
  ``/metrics``, refreshed every ``metrics_interval`` seconds by a task of
  this plugin (see `agentspec_vllm.metrics`).

vLLM runs ``collective_rpc`` between engine steps, so a push pauses
generation for as long as the workers take to apply it (milliseconds for a
delta).  With several workers (tensor parallelism) each has its own intake;
the answer then names the combined instance ``"<rank0>+<rank1>+..."``, and a
delta naming such an instance is checked here against the workers' current
one.

The core is `ShardForwarder`, framework-neutral (it takes the RPC as an
async callable); `AgentSpecEndpointPlugin` is the thin Starlette glue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from argparse import Namespace
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentspec import ShardIntake, SuffixTree
from agentspec.exceptions import DepthMismatchError, InvalidArgumentError, ShardFormatError
from agentspec.integration import (
    API_PREFIX,
    DELTA_PATH,
    INSTANCE_HEADER,
    JSON_CONTENT_TYPE,
    SHARD_CONTENT_TYPE,
    SHARDS_PATH,
    SNAPSHOT_FILE_PATH,
    SNAPSHOT_PATH,
    ErrorType,
    WireResponse,
    decode_key_query,
    error_response,
    get_logger,
    json_response,
    parse_content_length,
    write_shm_file,
)
from agentspec.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from agentspec_vllm.config import AgentSpecVllmConfig, load_config
from agentspec_vllm.metrics import (
    METRICS_PATH,
    MetricsRefresher,
    WorkerMetrics,
    install_collector,
)

__all__ = [
    "METRICS_PATH",
    "PLUGIN_NAME",
    "RPC_HANDLE",
    "RPC_STATS",
    "STATS_PATH",
    "AgentSpecEndpointPlugin",
    "ShardForwarder",
    "agentspec_endpoint_plugin",
]

#: Name of the plugin (the entry point; what ``VLLM_PLUGINS`` must name).
PLUGIN_NAME = "agentspec"
#: ``GET``: every worker's statistics.
STATS_PATH = "/v1/agentspec/stats"
#: Worker-extension method answering one push-protocol request.
RPC_HANDLE = "agentspec_handle"
#: Worker-extension method returning the worker's statistics.
RPC_STATS = "agentspec_stats"
#: Error type of answers given when the workers cannot be reached.
ENGINE_ERROR = "engine_error"

#: Request headers passed on to the workers (lower-case).
_FORWARDED = ("authorization", "content-type", INSTANCE_HEADER.lower())
#: Shard bytes up to this size are validated in the API server (larger: by the worker).
DEFAULT_VALIDATE_LIMIT = 64 << 20
#: Uploaded snapshots of this size or more go to the workers as a file in ``shm_dir``.
DEFAULT_SHM_THRESHOLD = 8 << 20
#: Seconds a ``collective_rpc`` may take.
DEFAULT_RPC_TIMEOUT = 120.0

Rpc = Callable[[str, tuple[Any, ...]], Awaitable[Sequence[Any]]]

_log = get_logger()


class ShardForwarder:
    """Validates push-protocol requests and forwards them to the workers.

    Args:
        rpc: ``await rpc(method, args)`` runs a worker-extension method on every
            worker and returns their results (``engine_client.collective_rpc``).
        config: the plugin settings (API key, tree depth, body limit, shm dir).
        validate_limit: shard bytes above this size are not validated here
            (the worker still does, and answers 400 for malformed bytes).
        shm_threshold: uploaded snapshots of this size or more are handed to
            the workers as a file in ``config.shm_dir`` (when set).
        metrics: the collector ``GET /v1/agentspec/metrics`` refreshes and
            renders (None: that route answers 404).
    """

    def __init__(
        self,
        rpc: Rpc,
        config: AgentSpecVllmConfig,
        *,
        validate_limit: int = DEFAULT_VALIDATE_LIMIT,
        shm_threshold: int = DEFAULT_SHM_THRESHOLD,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        """Forward through ``rpc`` (see the class docstring for the arguments)."""
        self._rpc = rpc
        self.metrics = metrics
        self.config = config
        self.validate_limit = validate_limit
        self.shm_threshold = shm_threshold
        # Used for its checks only (auth, routes, sizes); it never holds a shard.
        self._checker = ShardIntake(
            api_key=config.api_key,
            max_depth=config.max_depth,
            max_body_bytes=config.max_body_bytes,
        )
        if metrics is not None:  # the pushes refused here, before any worker sees them
            metrics.add_local_pushes(self._checker.push_counts)

    @property
    def max_body_bytes(self) -> int:
        """The largest body accepted (413 above)."""
        return self.config.max_body_bytes

    def precheck(
        self, method: str, path: str, headers: Mapping[str, str], content_length: int | None
    ) -> WireResponse | None:
        """Checks before the body is read: API key, route, method, size (None: go on)."""
        if path in (STATS_PATH, METRICS_PATH):
            early = self._checker.precheck("GET", SHARDS_PATH, headers, content_length)
            if early is None and method.upper() != "GET":
                early = error_response(
                    405,
                    f"{method[:20]} not allowed on {path}",
                    ErrorType.METHOD_NOT_ALLOWED,
                    {"Allow": "GET"},
                )
            return _local(early)
        return _local(self._checker.precheck(method.upper(), path, headers, content_length))

    async def handle(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> WireResponse:
        """Answer one request under ``/v1/agentspec/`` (errors become answers).

        A push refused here, before it reaches the workers, is counted in the
        metrics' ``agentspec_pushes_total`` (the workers count what they answer).
        """
        forwarded: list[bool] = []
        answer = await self._handle(method, path, query, headers, body, forwarded)
        if not forwarded:
            self._checker.count_push(path, answer.status)  # pushes only
        return answer

    async def _handle(
        self,
        method: str,
        path: str,
        query: str,
        headers: Mapping[str, str],
        body: bytes,
        forwarded: list[bool],
    ) -> WireResponse:
        method = method.upper()
        lower = {k.lower(): v for k, v in headers.items()}
        early = self.precheck(method, path, lower, len(body))
        if early is not None:
            return early
        if path == STATS_PATH:
            return await self._stats()
        if path == METRICS_PATH:
            return await self._metrics()
        if not (path == SHARDS_PATH and method == "GET"):
            try:
                decode_key_query(query)
            except InvalidArgumentError as e:
                return error_response(400, str(e), ErrorType.INVALID_REQUEST)
        refused = await self._validate(path, lower, body)
        if refused is not None:
            return refused
        fwd = {k: lower[k] for k in _FORWARDED if k in lower}
        expected = fwd.get(INSTANCE_HEADER.lower())
        if expected is not None and "+" in expected:  # a combined (multi-worker) instance
            mismatch = await self._check_combined_instance(expected)
            if mismatch is not None:
                return mismatch
            del fwd[INSTANCE_HEADER.lower()]
        forwarded.append(True)
        if path == SNAPSHOT_PATH and self._use_shm(body):
            return await self._snapshot_via_file(query, fwd, body)
        return await self._forward(method, path, query, fwd, body)

    # --- validation -------------------------------------------------------

    async def _validate(
        self, path: str, headers: Mapping[str, str], body: bytes
    ) -> WireResponse | None:
        """Content type and body checks of the writing routes (None: valid)."""
        if path == SNAPSHOT_FILE_PATH:
            return self._validate_file_request(headers, body)
        if path not in (SNAPSHOT_PATH, DELTA_PATH):
            return None
        ctype = headers.get("content-type")
        if ctype is not None:
            base = ctype.split(";")[0].strip().lower()
            if base not in (SHARD_CONTENT_TYPE, "application/octet-stream"):
                return error_response(
                    415,
                    f"shard bytes must be sent as {SHARD_CONTENT_TYPE}, not {base[:80]}",
                    ErrorType.UNSUPPORTED_MEDIA_TYPE,
                )
        if len(body) > self.validate_limit:
            return None
        return await asyncio.to_thread(self._check_shard_bytes, body)

    def _check_shard_bytes(self, body: bytes) -> WireResponse | None:
        """Load the bytes into a scratch tree of the workers' depth (None: valid)."""
        tree = SuffixTree(self.config.max_depth)
        try:
            tree.load(body)
        except DepthMismatchError as e:
            return error_response(409, str(e), ErrorType.DEPTH_MISMATCH)
        except ShardFormatError as e:
            return error_response(400, f"malformed shard bytes: {e}", ErrorType.SHARD_FORMAT)
        except InvalidArgumentError as e:
            return error_response(400, f"malformed shard bytes: {e}", ErrorType.SHARD_FORMAT)
        finally:
            tree.close()
        return None

    def _validate_file_request(
        self, headers: Mapping[str, str], body: bytes
    ) -> WireResponse | None:
        """A ``snapshot-file`` body must be JSON ``{"path": str}`` (None: valid)."""
        ctype = headers.get("content-type", JSON_CONTENT_TYPE).split(";")[0].strip().lower()
        if ctype != JSON_CONTENT_TYPE:
            return error_response(415, "snapshot-file takes JSON", ErrorType.UNSUPPORTED_MEDIA_TYPE)
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        raw = obj.get("path") if isinstance(obj, dict) else None
        if not isinstance(raw, str) or not raw or "\x00" in raw:
            return error_response(400, 'body must be JSON {"path": str}', ErrorType.INVALID_REQUEST)
        if self.config.shm_dir is None:
            return error_response(
                403, "snapshot files are disabled on this worker", ErrorType.FORBIDDEN
            )
        return None

    async def _check_combined_instance(self, expected: str) -> WireResponse | None:
        """Compare a delta's combined instance with the workers' (None: it matches)."""
        current = await self._forward("GET", SHARDS_PATH, "", {}, b"")
        now = current.headers.get(INSTANCE_HEADER)
        if current.status != 200:
            return current
        if now == expected:
            return None
        return error_response(
            409,
            f"delta computed for instance {expected[:200]}, the workers are {now}: send a snapshot",
            ErrorType.INSTANCE_MISMATCH,
            {INSTANCE_HEADER: now or ""},
        )

    # --- forwarding -------------------------------------------------------

    def _use_shm(self, body: bytes) -> bool:
        """Whether an uploaded snapshot goes to the workers as a file."""
        return self.config.shm_dir is not None and len(body) >= self.shm_threshold

    async def _snapshot_via_file(
        self, query: str, headers: dict[str, str], body: bytes
    ) -> WireResponse:
        """Write the snapshot into ``shm_dir`` and forward a ``snapshot-file`` request."""
        assert self.config.shm_dir is not None
        shm_dir = Path(self.config.shm_dir)
        try:
            path = await asyncio.to_thread(write_shm_file, shm_dir, body)
        except OSError as e:
            _log.warning("agentspec.endpoint.shm_write_failed", dir=str(shm_dir), error=str(e))
            return await self._forward("PUT", SNAPSHOT_PATH, query, headers, body)
        try:
            fwd = {**headers, "content-type": JSON_CONTENT_TYPE}
            req = json.dumps({"path": str(path)}).encode()
            return await self._forward("POST", SNAPSHOT_FILE_PATH, query, fwd, req)
        finally:
            with contextlib.suppress(OSError):
                path.unlink()

    async def _forward(
        self, method: str, path: str, query: str, headers: dict[str, str], body: bytes
    ) -> WireResponse:
        """Run the request on every worker and merge their answers."""
        try:
            results = await self._rpc(RPC_HANDLE, (method, path, query, headers, body))
        except Exception as e:
            return _engine_error(e)
        try:
            answers = [_as_response(r) for r in results]
        except (TypeError, ValueError) as e:
            _log.error("agentspec.endpoint.bad_worker_answer", error=str(e))
            return error_response(500, f"unexpected worker answer: {e}", ENGINE_ERROR)
        return _merge_answers(answers)

    async def _stats(self) -> WireResponse:
        """``GET /v1/agentspec/stats``: ``{"workers": [stats of each worker]}``."""
        try:
            results = await self._rpc(RPC_STATS, ())
        except Exception as e:
            return _engine_error(e)
        return json_response(200, {"workers": list(results)})

    async def _metrics(self) -> WireResponse:
        """``GET /v1/agentspec/metrics``: the workers' counters, collected now."""
        metrics = self.metrics
        if metrics is None:
            return error_response(404, "agentspec metrics are off", ErrorType.NOT_FOUND)
        try:
            await MetricsRefresher(self._rpc, metrics, 1.0).refresh()
        except Exception as e:
            return _engine_error(e)
        body = await asyncio.to_thread(metrics.render_text)
        return WireResponse(200, {"Content-Type": METRICS_CONTENT_TYPE}, body)


def _local(answer: WireResponse | None) -> WireResponse | None:
    """An answer of the local checker without its (meaningless) instance header."""
    if answer is None:
        return None
    headers = {k: v for k, v in answer.headers.items() if k != INSTANCE_HEADER}
    return WireResponse(answer.status, headers, answer.body)


def _as_response(result: Any) -> WireResponse:
    """A worker's ``(status, headers, body)`` (tuple or list after serialisation)."""
    if isinstance(result, WireResponse):
        return result
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise TypeError(f"expected (status, headers, body), got {type(result).__name__}")
    status, headers, body = result
    if isinstance(body, str):
        body = body.encode()
    if type(status) is not int or not isinstance(headers, Mapping):
        raise TypeError("expected (int status, headers mapping, bytes body)")
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise TypeError(f"body is {type(body).__name__}, not bytes")
    return WireResponse(status, {str(k): str(v) for k, v in headers.items()}, bytes(body))


def _instance_of(answer: WireResponse) -> str | None:
    """The instance named by an answer's header (case-insensitive)."""
    for k, v in answer.headers.items():
        if k.lower() == INSTANCE_HEADER.lower():
            return str(v)
    return None


def _merge_answers(answers: list[WireResponse]) -> WireResponse:
    """One answer for all workers: the first error, else rank 0's with the combined instance."""
    if not answers:
        return error_response(503, "no worker answered", ENGINE_ERROR)
    for a in answers:
        if a.status != 200:
            return a
    first = answers[0]
    if len(answers) == 1:
        return first
    combined = "+".join(_instance_of(a) or "?" for a in answers)
    headers = {k: v for k, v in first.headers.items() if k.lower() != INSTANCE_HEADER.lower()}
    headers[INSTANCE_HEADER] = combined
    try:
        obj = json.loads(first.body)
    except ValueError:
        return WireResponse(200, headers, first.body)
    if isinstance(obj, dict) and "instance" in obj:
        obj["instance"] = combined
    return json_response(200, obj, {k: v for k, v in headers.items() if k != "Content-Type"})


def _engine_error(e: Exception) -> WireResponse:
    """503 (the pusher retries) for a failed ``collective_rpc``, with a hint when it is ours."""
    text = f"{type(e).__name__}: {e}"
    hint = ""
    if RPC_HANDLE in text or RPC_STATS in text or isinstance(e, AttributeError):
        hint = (
            " (is the worker extension loaded? pass --worker-extension-cls "
            "agentspec_vllm.worker_ext.AgentSpecWorkerExtension)"
        )
    _log.warning("agentspec.endpoint.rpc_failed", error=text[:500])
    return error_response(
        503,
        f"the engine did not answer: {text[:300]}{hint}",
        ENGINE_ERROR,
        {"retry-after-ms": "500"},
    )


# --- vLLM glue -------------------------------------------------------------


class AgentSpecEndpointPlugin:
    """The ``vllm.endpoint_plugins`` object: routes ``/v1/agentspec/*`` to a `ShardForwarder`."""

    name = PLUGIN_NAME
    #: Loaded by servers that generate text (not by embedding-only or render servers).
    required_tasks: tuple[str, ...] | None = ("generate",)

    def __init__(self) -> None:
        """No forwarder until `init_state` runs."""
        self.forwarder: ShardForwarder | None = None
        self._refresh_task: asyncio.Task[None] | None = None

    def attach_router(self, app: Any) -> None:
        """Register the catch-all ``/v1/agentspec/{rest}`` route on vLLM's FastAPI app."""
        app.add_route(
            API_PREFIX + "{rest:path}",
            self._route,
            methods=["GET", "PUT", "POST", "DELETE", "PATCH"],
            include_in_schema=False,
        )

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        """Build the forwarder from ``--additional-config`` and the environment."""
        if engine_client is None:  # a render-only server has no engine
            return
        extra = getattr(args, "additional_config", None)
        if isinstance(extra, str):
            extra = json.loads(extra) if extra.strip() else None
        config = load_config(extra if isinstance(extra, Mapping) else None)

        async def rpc(method: str, rpc_args: tuple[Any, ...]) -> Sequence[Any]:
            result = await engine_client.collective_rpc(
                method, timeout=DEFAULT_RPC_TIMEOUT, args=rpc_args
            )
            return list(result)

        metrics = None
        if config.metrics:
            metrics = install_collector()
            refresher = MetricsRefresher(rpc, metrics, config.metrics_interval)
            self._refresh_task = asyncio.get_running_loop().create_task(refresher.run())
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                _log.warning(
                    "agentspec.endpoint.metrics_multiprocess",
                    hint="several API server processes: vLLM's /metrics serves only its "
                    f"multiprocess files; scrape {METRICS_PATH} for the agentspec metrics",
                )
        self.forwarder = ShardForwarder(rpc, config, metrics=metrics)
        state.agentspec_forwarder = self.forwarder
        _log.info("agentspec.endpoint.ready", config=config.public())

    async def _route(self, request: Any) -> Any:
        """The Starlette endpoint: precheck, read the body within the limit, forward."""
        from starlette.responses import Response

        forwarder = self.forwarder
        path = request.url.path.removeprefix(request.scope.get("root_path", ""))
        if forwarder is None:
            answer = error_response(503, "agentspec is not initialised", ENGINE_ERROR)
        else:
            answer = await _serve(forwarder, request, path)
        return Response(answer.body, status_code=answer.status, headers=dict(answer.headers))


async def _serve(forwarder: ShardForwarder, request: Any, path: str) -> WireResponse:
    """Read a Starlette request (refusing early when possible) and answer it."""
    headers = {k.lower(): v for k, v in request.headers.items()}
    try:
        length = parse_content_length(headers.get("content-length"))
    except ValueError:
        return error_response(400, "bad Content-Length", ErrorType.INVALID_REQUEST)
    early = forwarder.precheck(request.method, path, headers, length)
    if early is not None:
        return early
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > forwarder.max_body_bytes:
            return error_response(
                413,
                f"body exceeds the limit of {forwarder.max_body_bytes} bytes",
                ErrorType.PAYLOAD_TOO_LARGE,
            )
        chunks.append(chunk)
    body = b"".join(chunks)
    return await forwarder.handle(request.method, path, request.url.query, headers, body)


def agentspec_endpoint_plugin() -> AgentSpecEndpointPlugin:
    """The factory the ``vllm.endpoint_plugins`` entry point ``agentspec`` names."""
    return AgentSpecEndpointPlugin()
