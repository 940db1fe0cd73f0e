"""The shard push protocol: routes, headers, key encoding and JSON bodies.

Both ends import this module: `ShardPusher` (client side) builds requests
with it and `ShardIntake` (worker side) parses them with it, so the two
cannot drift apart.  Every route lives under ``/v1/agentspec/`` so that
vLLM's ``--api-key`` middleware protects it too:

==========================================  =====================================
``GET    /v1/agentspec/shards``             JSON list of the worker's shards
``PUT    /v1/agentspec/shards/snapshot?K``  replace shard K by a native snapshot
``POST   /v1/agentspec/shards/delta?K``     apply a native delta to shard K
``POST   /v1/agentspec/shards/snapshot-file?K``  JSON ``{"path": ...}`` of a
                                            snapshot file in the worker's shm dir
``DELETE /v1/agentspec/shards?K``           drop shard K
==========================================  =====================================

``K`` is the shard key ``(tenant, pipeline, stage)`` as the query parameters
``tenant``, ``pipeline`` and ``stage``; an absent parameter means None (an
absent tenant means ``"default"``).  Shard bytes travel as
``application/x-agentspec-shard``; answers and errors are JSON, errors as
``{"error": {"message": ..., "type": ..., "code": status}}``.  Every answer
of the worker names its ``instance`` (a random id per worker process) in the
`INSTANCE_HEADER` header, and a delta request may name the instance it was
computed against in the same header: a worker with another instance refuses
it with 409 ``instance_mismatch`` instead of applying it to the wrong base.
"""

from __future__ import annotations

import contextlib
import email.utils
import hmac
import json
import math
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

from agentspec.exceptions import InvalidArgumentError
from agentspec.protocol import DEFAULT_TENANT, MAX_COMPONENT, ShardKey, check_key

# The header naming the worker's instance id (answers) or the expected one (deltas).
from agentspec.protocol import HEADER_INSTANCE as INSTANCE_HEADER

__all__ = [
    "API_PREFIX",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_TENANT",
    "DELTA_PATH",
    "INSTANCE_HEADER",
    "JSON_CONTENT_TYPE",
    "MAX_KEY_COMPONENT",
    "MAX_RETRY_AFTER",
    "SHARDS_PATH",
    "SHARD_CONTENT_TYPE",
    "SNAPSHOT_FILE_PATH",
    "SNAPSHOT_PATH",
    "ErrorType",
    "ShardKey",
    "WireResponse",
    "WorkerShard",
    "bearer_headers",
    "check_bearer",
    "check_shard_key",
    "decode_key_query",
    "encode_key_query",
    "error_response",
    "json_response",
    "parse_content_length",
    "parse_error",
    "parse_retry_after",
    "parse_shard_list",
    "write_shm_file",
]

#: Prefix of every route (protected by vLLM's ``--api-key`` middleware).
API_PREFIX = "/v1/agentspec/"
#: ``GET``: list the worker's shards; ``DELETE?K``: drop shard K.
SHARDS_PATH = "/v1/agentspec/shards"
#: ``PUT?K``: replace shard K by the snapshot in the body.
SNAPSHOT_PATH = "/v1/agentspec/shards/snapshot"
#: ``POST?K``: apply the delta in the body to shard K.
DELTA_PATH = "/v1/agentspec/shards/delta"
#: ``POST?K``: replace shard K by the snapshot file named in the JSON body.
SNAPSHOT_FILE_PATH = "/v1/agentspec/shards/snapshot-file"

#: Content type of native shard bytes (snapshots and deltas).
SHARD_CONTENT_TYPE = "application/x-agentspec-shard"
#: Content type of every answer.
JSON_CONTENT_TYPE = "application/json"
#: Default limit on a request body (a snapshot): 32 MiB.  A snapshot builds
#: to about 15 times its size on ordinary text (4 bytes per token on the
#: wire, 55 to 75 in a tree), so 32 MiB is already about twice the default
#: per-tenant budget (256 MiB): larger bodies could only fit when they are
#: extremely repetitive, and a body that fails the exact budget check after
#: its build costs that build in transient memory.
DEFAULT_MAX_BODY_BYTES = 32 << 20
#: Longest key component, in characters.
MAX_KEY_COMPONENT = MAX_COMPONENT
#: Longest wait a ``Retry-After`` / ``retry-after-ms`` header can ask for, in seconds.
MAX_RETRY_AFTER = 60.0

_KEY_PARAMS = ("tenant", "pipeline", "stage")


class ErrorType:
    """The ``type`` strings of JSON error bodies."""

    SHARD_FORMAT = "shard_format_error"
    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    FORBIDDEN = "permission_error"
    NOT_FOUND = "not_found_error"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    DEPTH_MISMATCH = "depth_mismatch"
    INSTANCE_MISMATCH = "instance_mismatch"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    LENGTH_REQUIRED = "length_required"
    BUSY = "busy"
    OUT_OF_VOCABULARY = "out_of_vocabulary"
    INSUFFICIENT_STORAGE = "insufficient_storage"
    INTERNAL = "server_error"


@dataclass(frozen=True, slots=True)
class WireResponse:
    """One HTTP answer, independent of any web framework.

    Attributes:
        status: HTTP status code.
        headers: response headers (Content-Type included).
        body: response body.
    """

    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self) -> Any:
        """The body decoded as JSON."""
        return json.loads(self.body)


@dataclass(frozen=True, slots=True)
class WorkerShard:
    """One entry of the worker's shard list (``GET /v1/agentspec/shards``).

    Attributes:
        key: the shard key.
        sequences: live sequences.
        tokens: tokens in live sequences.
        bytes: allocator bytes of the tree.
        max_seq: the largest sequence id (0 for an empty shard).
    """

    key: ShardKey
    sequences: int
    tokens: int
    bytes: int
    max_seq: int

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this entry."""
        tenant, pipeline, stage = self.key
        return {
            "tenant": tenant,
            "pipeline": pipeline,
            "stage": stage,
            "sequences": self.sequences,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "max_seq": self.max_seq,
        }

    @classmethod
    def from_json(cls, obj: Any) -> WorkerShard:
        """Parse one JSON entry.

        Raises:
            InvalidArgumentError: not an object of the documented shape.
        """
        if not isinstance(obj, dict):
            raise InvalidArgumentError("shard entry is not a JSON object", repr(obj)[:80])
        key = check_shard_key((obj.get("tenant"), obj.get("pipeline"), obj.get("stage")))
        nums = []
        for name in ("sequences", "tokens", "bytes", "max_seq"):
            v = obj.get(name)
            if type(v) is not int or v < 0:
                raise InvalidArgumentError(f"shard entry field {name!r} is not an int >= 0")
            nums.append(v)
        return cls(key, *nums)


# --- shard keys -----------------------------------------------------------


def check_shard_key(key: object) -> ShardKey:
    """Validate a shard key ``(tenant, pipeline, stage)`` and return it as a tuple.

    The same check as the store's (`agentspec._core.shardkey.check_key`).

    Raises:
        InvalidArgumentError: not a 3-tuple of a str and two str-or-None, each
            of 1..128 characters without NUL or control characters and
            encodable as UTF-8 (no lone surrogate).
    """
    return check_key(key)


def encode_key_query(key: ShardKey) -> str:
    """The query string (without ``?``) naming a shard key.

    Raises:
        InvalidArgumentError: an invalid key (see `check_shard_key`).
    """
    k = check_shard_key(key)
    return urlencode([(n, v) for n, v in zip(_KEY_PARAMS, k, strict=True) if v is not None])


def decode_key_query(query: str) -> ShardKey:
    """Parse a query string into a shard key (absent tenant = ``"default"``).

    The query must be ASCII (as `encode_key_query` writes it: every other
    character percent-encoded) and its escapes must decode as UTF-8.

    Raises:
        InvalidArgumentError: a non-ASCII query, escapes that are not UTF-8,
            unknown or repeated parameters, an invalid key.
    """
    if not query.isascii():
        raise InvalidArgumentError("malformed query string", "non-ASCII characters")
    try:
        params = parse_qs(
            query, keep_blank_values=True, strict_parsing=bool(query), errors="strict"
        )
    except UnicodeDecodeError:  # a ValueError: test it first
        raise InvalidArgumentError("malformed query string", "escapes are not UTF-8") from None
    except ValueError as e:
        raise InvalidArgumentError("malformed query string", str(e)[:200]) from None
    unknown = sorted(set(params) - set(_KEY_PARAMS))
    if unknown:
        raise InvalidArgumentError("unknown query parameters", ", ".join(unknown)[:200])
    values: dict[str, str | None] = {}
    for name in _KEY_PARAMS:
        got = params.get(name)
        if got is not None and len(got) != 1:
            raise InvalidArgumentError(f"query parameter {name!r} is repeated")
        values[name] = got[0] if got else None
    tenant = values["tenant"] if values["tenant"] is not None else DEFAULT_TENANT
    return check_shard_key((tenant, values["pipeline"], values["stage"]))


# --- JSON bodies ----------------------------------------------------------


def json_response(status: int, obj: Any, headers: Mapping[str, str] | None = None) -> WireResponse:
    """A JSON answer."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    hdrs = {"Content-Type": JSON_CONTENT_TYPE, **(headers or {})}
    return WireResponse(status, hdrs, body)


def error_response(
    status: int, message: str, type_: str, headers: Mapping[str, str] | None = None
) -> WireResponse:
    """A JSON error answer ``{"error": {"message", "type", "code"}}``."""
    return json_response(
        status, {"error": {"message": message, "type": type_, "code": status}}, headers
    )


def parse_error(body: bytes) -> tuple[str | None, str]:
    """``(type, message)`` of a JSON error body; ``(None, text)`` for anything else."""
    try:
        obj = json.loads(body)
        err = obj["error"]
        return str(err["type"]), str(err["message"])
    except (ValueError, TypeError, KeyError):
        return None, body[:200].decode("utf-8", "replace")


def parse_shard_list(body: bytes) -> tuple[str, list[WorkerShard]]:
    """``(instance, shards)`` of a ``GET /v1/agentspec/shards`` answer.

    Raises:
        InvalidArgumentError: not the documented JSON shape.
    """
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise InvalidArgumentError("shard list is not JSON", str(e)) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("instance"), str):
        raise InvalidArgumentError("shard list has no 'instance' string")
    shards = obj.get("shards")
    if not isinstance(shards, list):
        raise InvalidArgumentError("shard list has no 'shards' array")
    return obj["instance"], [WorkerShard.from_json(s) for s in shards]


# --- authentication -------------------------------------------------------


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <key>"}``, or ``{}`` without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def check_bearer(authorization: str | None, api_key: str | None) -> bool:
    """Whether an ``Authorization`` header value carries ``api_key``.

    Always True without a configured key.  The comparison takes the same
    time wherever the first difference is (`hmac.compare_digest`).
    """
    if not api_key:
        return True
    if authorization is None:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    ok_scheme = scheme.lower() == "bearer"
    ok_token = hmac.compare_digest(token.strip().encode(), api_key.encode())
    return ok_scheme and ok_token


# --- retries --------------------------------------------------------------


def parse_retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds a ``retry-after-ms`` or ``Retry-After`` header asks to wait (<= 60).

    ``retry-after-ms`` (milliseconds, as the OpenAI SDK reads it) wins over
    ``Retry-After`` (seconds, fractional allowed, or an HTTP date).  Header
    names are matched case-insensitively; unparsable or negative values are
    ignored (None).
    """
    lower = {k.lower(): v for k, v in headers.items()}
    raw_ms = lower.get("retry-after-ms")
    if raw_ms is not None:
        try:
            ms = float(raw_ms)
        except ValueError:
            ms = math.nan
        if math.isfinite(ms) and ms >= 0:
            return min(ms / 1000.0, MAX_RETRY_AFTER)
    raw = lower.get("retry-after")
    if raw is None:
        return None
    try:
        secs = float(raw)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError):
            return None
        secs = when.timestamp() - (time.time() if now is None else now)
        secs = max(secs, 0.0)
    if not math.isfinite(secs) or secs < 0:
        return None
    return min(secs, MAX_RETRY_AFTER)


def write_shm_file(directory: Path, data: bytes) -> Path:
    """Write snapshot bytes to a new file in ``directory`` readable by this user only.

    The name is unique (pid + uuid4) and created exclusively; a failed write
    removes the file.  Used for snapshot-file handovers (pusher and endpoint).
    """
    path = directory / f"agentspec-{os.getpid()}-{uuid.uuid4().hex}.ashd"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    finally:
        os.close(fd)
    return path


def parse_content_length(raw: str | None) -> int | None:
    """A request's ``Content-Length`` (None when absent).

    Raises:
        ValueError: not a non-negative integer (answer 400).
    """
    if raw is None:
        return None
    length = int(raw)
    if length < 0:
        raise ValueError(f"negative Content-Length {length}")
    return length
