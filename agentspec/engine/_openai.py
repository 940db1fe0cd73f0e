"""The OpenAI wire format of the embedded engine: parsing requests, building answers.

`parse_request` validates a ``/v1/chat/completions`` or ``/v1/completions``
body into a `ParsedRequest` (raising `ApiError`, an HTTP status with an
OpenAI-style error body, for anything unusable), and the ``*_object`` /
``*_chunk`` functions build the JSON answers, vLLM-style where OpenAI has no
field: ``choices[i].token_ids`` and a top-level ``prompt_token_ids`` when
``return_token_ids`` is set, and an ``"agentspec"`` field with the
speculation counters of the request.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentspec._util.log import get_logger
from agentspec.engine._chat import render_chat, short_repr, tokenize_prompt
from agentspec.engine._engine import Completion, Engine, GenerationRequest, SpecStats
from agentspec.engine._sampling import SamplingParams
from agentspec.exceptions import InvalidArgumentError
from agentspec.protocol import (
    DEFAULT_TENANT,
    TAG_HEADERS,
    XARG_PREFIX,
    XARG_REQUEST_ID,
    XARG_SPECULATE,
    XARG_TENANT,
    XARGS_FIELD,
    ShardKey,
    check_identity,
    check_tag,
    decode_header_value,
)

__all__ = [
    "ApiError",
    "ParsedRequest",
    "completion_object",
    "default_code",
    "error_body",
    "final_chunk",
    "first_chunk",
    "parse_request",
    "text_chunk",
    "usage_chunk",
]

CHAT = "chat"
COMPLETIONS = "completions"

_log = get_logger()

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class ApiError(Exception):
    """A request refused with an OpenAI-style error answer.

    Attributes:
        status: HTTP status.
        message: what is wrong, for the client.
        type: OpenAI error type (``invalid_request_error``, ...).
        param: the offending request field, if any.
        code: a short machine-readable code (a string); default: one for
            the status (`default_code`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        """Record the answer's parts."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code if code is not None else default_code(status)


#: The ``code`` of an error answer by HTTP status, when nothing more precise is known.
_STATUS_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    411: "length_required",
    413: "request_too_large",
    500: "internal_error",
}


def default_code(status: int) -> str:
    """The error ``code`` string of an HTTP ``status`` (``"http_<status>"`` for others)."""
    return _STATUS_CODES.get(status, f"http_{status}")


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> bytes:
    """The JSON body ``{"error": {"message", "type", "param", "code"}}``.

    ``code`` is a string or null, never a number (as OpenAI's API).
    """
    err = {
        "message": message,
        "type": type_,
        "param": param,
        "code": None if code is None else str(code),
    }
    return json.dumps({"error": err}).encode()


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request.

    Attributes:
        kind: "chat" or "completions".
        model: the model name to answer with.
        generation: what the engine runs.
        stream: answer as server-sent events.
        include_usage: (streams) send a usage chunk before ``[DONE]``.
        return_token_ids: add ``token_ids`` / ``prompt_token_ids``.
    """

    kind: str
    model: str
    generation: GenerationRequest
    stream: bool
    include_usage: bool
    return_token_ids: bool


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _refuse(param: str, why: str = "") -> ApiError:
    """The 400 of a parameter this engine cannot honour exactly (it names the parameter)."""
    return _bad(
        f"'{param}' is not supported by this engine{': ' + why if why else ''} "
        "(refused rather than ignored)",
        param,
        "unsupported_parameter",
    )


def _opt_bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be a boolean", name)
    return value


def _opt_number(
    body: Mapping[str, Any],
    name: str,
    default: float,
    lo: float,
    hi: float,
    param: str | None = None,
) -> float:
    value = body.get(name)
    param = param or name
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"'{param}' must be a number", param)
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(f"'{param}' must be a finite number", param)
    if not lo <= value <= hi:  # exact for ints of any size (no float conversion)
        raise _bad(f"'{param}' must be in [{lo:g}, {hi:g}], not {short_repr(value)}", param)
    return float(value)


def _opt_int(body: Mapping[str, Any], name: str, lo: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise _bad(f"'{name}' must be an integer", name)
    if value < lo:
        raise _bad(f"'{name}' must be >= {lo}, not {short_repr(value)}", name)
    return value


def _stop_strings(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    return tuple(s for s in stop if s)


def _flag(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _bad(f"{XARGS_FIELD}.{name} must be a boolean", XARGS_FIELD)


def _shard_key(
    body: Mapping[str, Any], headers: Mapping[str, str], tenant: str | None = None
) -> tuple[ShardKey, bool | None]:
    """The request's ``(tenant, pipeline, stage)`` and its speculation switch.

    ``tenant`` (from the API key) overrides the body's ``agentspec_tenant``.
    """
    xargs = body.get(XARGS_FIELD) or {}
    if not isinstance(xargs, dict):
        raise _bad(f"{XARGS_FIELD!r} must be an object", XARGS_FIELD)
    lower = {k.lower(): v for k, v in headers.items()}

    def tag(name: str) -> str | None:
        key = XARG_PREFIX + name
        value = xargs.get(key)
        header = TAG_HEADERS.get(name, "").lower()
        if value is None and header and header in lower:
            value = decode_header_value(lower[header])
        if value is None:
            return None
        try:
            checked = check_tag(value, name)
            checked.encode("utf-8")  # a lone surrogate cannot name a shard
        except InvalidArgumentError as exc:
            raise _bad(f"{XARGS_FIELD}.{key}: {exc}", XARGS_FIELD) from None
        except UnicodeEncodeError:
            raise _bad(f"{XARGS_FIELD}.{key} is not valid Unicode text", XARGS_FIELD) from None
        return checked

    if tenant is None:
        tenant = tag("tenant") or DEFAULT_TENANT
    elif xargs.get(XARG_TENANT, tenant) != tenant:
        # As the vLLM middleware does: the key's tenant stands, whatever was asked.
        _log.info("agentspec.engine.tenant_overridden", asked=str(xargs[XARG_TENANT])[:128])
    key = (tenant, tag("pipeline"), tag("stage"))
    raw = xargs.get(XARG_SPECULATE)
    return key, None if raw is None else _flag(raw, XARG_SPECULATE)


def _request_identity(body: Mapping[str, Any]) -> str | None:
    """``vllm_xargs.agentspec_request_id``, checked (None: absent; the server names it)."""
    xargs = body.get(XARGS_FIELD) or {}
    raw = xargs.get(XARG_REQUEST_ID) if isinstance(xargs, dict) else None
    if raw is None:
        return None
    try:
        return check_identity(raw)
    except InvalidArgumentError as exc:
        raise _bad(f"{XARGS_FIELD}.{XARG_REQUEST_ID}: {exc}", XARGS_FIELD) from None


#: Parameters of the OpenAI and vLLM APIs this engine cannot honour, with the
#: values that mean "off" (accepted, since they change nothing).  Any other
#: value is refused with a 400 naming the parameter, never ignored.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "prompt_logprobs": (None,),
    "echo": (None, False),
    "suffix": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "return_tokens_as_token_ids": (None, False),
}

_WHY = {
    "logprobs": "log-probabilities are not returned",
    "top_logprobs": "log-probabilities are not returned",
    "prompt_logprobs": "log-probabilities are not returned",
    "use_beam_search": "no beam search",
    "length_penalty": "no beam search",
    "best_of": "best_of must be 1",
    "min_tokens": "no minimum output length",
}


def _same(value: Any, off: Any) -> bool:
    """``value == off`` without counting True as 1 (or 1 as True)."""
    return type(value) is type(off) and value == off if off is not None else value is None


def _unsupported(body: Mapping[str, Any]) -> None:
    """Refuse options this engine cannot honour (rather than ignoring them)."""
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad(
            f"n={short_repr(n)} is not supported: this engine returns one choice per request "
            "(n must be 1)",
            "n",
            "unsupported_parameter",
        )
    for name, offs in _OFF_VALUES.items():
        value = body.get(name)
        if not any(_same(value, off) for off in offs):
            raise _refuse(name, _WHY.get(name, ""))
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        raise _refuse(
            "response_format",
            f"type {short_repr(kind)} (only {{'type': 'text'}}; no constrained decoding)",
        )
    if body.get("tools") or body.get("functions"):
        raise _bad(
            "native tool calling is not supported by this engine: describe the tools in the "
            "prompt and parse the text (OpenHands: LLM(native_tool_calling=False))",
            "tools" if body.get("tools") else "functions",
            "unsupported_parameter",
        )
    choice = body.get("tool_choice")
    if choice is not None and choice != "none":
        raise _bad(
            "tool_choice must be absent or 'none' on this engine",
            "tool_choice",
            "unsupported_parameter",
        )


def _token_ids(body: Mapping[str, Any], name: str, vocab: int) -> tuple[int, ...] | None:
    """An optional list of token ids in ``[0, vocab)``."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise _bad(f"'{name}' must be a list of integer token ids", name)
    if not value and name == "allowed_token_ids":
        raise _bad("'allowed_token_ids' must not be empty", name)
    for t in value:
        if not 0 <= t < vocab:
            raise _bad(f"'{name}': token id {short_repr(t)} is outside [0, {vocab})", name)
    return tuple(value)


def _logit_bias(body: Mapping[str, Any], vocab: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: an object of token id (a decimal string) -> bias in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _bad("'logit_bias' must be an object of token id -> bias", "logit_bias")
    out: list[tuple[int, float]] = []
    for key, bias in value.items():
        digits = isinstance(key, str) and 0 < len(key) <= 12 and key.isascii() and key.isdigit()
        tok = int(key) if digits else -1
        if not 0 <= tok < vocab:
            raise _bad(
                f"'logit_bias': {short_repr(key)} is not a token id in [0, {vocab})", "logit_bias"
            )
        out.append((tok, _opt_number({"b": bias}, "b", 0.0, -100.0, 100.0, "logit_bias")))
    return tuple(out)


def _sampling(body: Mapping[str, Any], vocab: int) -> tuple[SamplingParams, tuple[int, ...], bool]:
    """The request's `SamplingParams`, ``stop_token_ids`` and ``ignore_eos`` (vLLM names, ranges).

    The fields are checked in a fixed order, so a body with several bad
    fields always names the same one.
    """
    temperature = _opt_number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _opt_number(body, "top_p", 1.0, 0.0, 1.0)
    top_k = body.get("top_k")
    if top_k is None:
        top_k = 0
    if type(top_k) is not int:
        raise _bad("'top_k' must be an integer", "top_k")
    if top_k < -1:
        raise _bad(f"'top_k' must be -1, 0 (off) or >= 1, not {short_repr(top_k)}", "top_k")
    rep = _opt_number(body, "repetition_penalty", 1.0, 0.0, math.inf)
    if rep == 0:
        raise _bad("'repetition_penalty' must be > 0", "repetition_penalty")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise _bad("'ignore_eos' must be a boolean", "ignore_eos")
    min_p = _opt_number(body, "min_p", 0.0, 0.0, 1.0)
    frequency_penalty = _opt_number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    presence_penalty = _opt_number(body, "presence_penalty", 0.0, -2.0, 2.0)
    logit_bias = _logit_bias(body, vocab)
    allowed_token_ids = _token_ids(body, "allowed_token_ids", vocab)
    stop_token_ids = _token_ids(body, "stop_token_ids", vocab) or ()
    if top_p == 0:
        raise _bad("'top_p' must be in (0, 1]", "top_p")
    params = SamplingParams(
        temperature,
        top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=rep,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        logit_bias=logit_bias,
        allowed_token_ids=allowed_token_ids,
    )
    return params, stop_token_ids, bool(ignore_eos)


def parse_request(
    kind: str,
    raw: bytes,
    headers: Mapping[str, str],
    engine: Engine,
    models: tuple[str, ...],
    *,
    tenant: str | None = None,
) -> ParsedRequest:
    """Validate a request body for ``kind`` ("chat" or "completions").

    ``models`` are the names this server answers to (the first is reported).
    ``tenant``: the caller's tenant (from its API key), which the body's
    ``vllm_xargs.agentspec_tenant`` cannot change; None: the body picks it.

    Raises:
        ApiError: bad JSON, missing or malformed fields (400), an unknown
            model (404), a prompt longer than the context (400).
    """
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _bad("the request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    if model is not None and model not in models:
        raise ApiError(
            404,
            f"the model '{model[:200]}' does not exist; this server serves: {', '.join(models)}",
            param="model",
            code="model_not_found",
        )
    _unsupported(body)
    try:
        if kind == CHAT:
            if "messages" not in body:
                raise _bad("missing required field 'messages'", "messages")
            prompt = render_chat(
                engine.tokenizer,
                body["messages"],
                max_bytes=engine.max_prompt_bytes,
                max_len=engine.max_model_len,
            )
        else:
            if "prompt" not in body:
                raise _bad("missing required field 'prompt'", "prompt")
            prompt = tokenize_prompt(
                engine.tokenizer,
                body["prompt"],
                engine.verifier.vocab_size,
                max_bytes=engine.max_prompt_bytes,
                max_len=engine.max_model_len,
            )
        engine.check_prompt(prompt)
    except InvalidArgumentError as exc:
        raise _bad(str(exc), "messages" if kind == CHAT else "prompt") from None
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    seed = _opt_int(body, "seed", -(2**63))
    key, speculate = _shard_key(body, headers, tenant)
    identity = _request_identity(body)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    stop = _stop_strings(body)
    sampling, stop_token_ids, ignore_eos = _sampling(body, engine.verifier.vocab_size)
    generation = GenerationRequest(
        prompt_ids=prompt,
        max_tokens=max_tokens,
        stop=stop,
        seed=None if seed is None else seed % 2**63,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
        key=key,
        speculate=speculate,
        identity=identity,
        sampling=sampling,
    )
    return ParsedRequest(
        kind=kind,
        model=model or models[0],
        generation=generation,
        stream=_opt_bool(body, "stream"),
        include_usage=bool(options and options.get("include_usage")),
        return_token_ids=_opt_bool(body, "return_token_ids"),
    )


# --- answers ------------------------------------------------------------------


def new_id(kind: str) -> str:
    """A response id: ``chatcmpl-...`` or ``cmpl-...``."""
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_object(req: ParsedRequest, rid: str, done: Completion) -> dict[str, Any]:
    """The non-streamed answer."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": done.finish_reason}
    if req.kind == CHAT:
        choice["message"] = {"role": "assistant", "content": done.text}
    else:
        choice["text"] = done.text
    if req.return_token_ids:
        choice["token_ids"] = list(done.token_ids)
    obj: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if req.kind == CHAT else "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice],
        "usage": usage(len(done.prompt_ids), len(done.token_ids)),
        "agentspec": done.stats.to_json(),
    }
    if req.return_token_ids:
        obj["prompt_token_ids"] = list(done.prompt_ids)
    return obj


def _chunk(req: ParsedRequest, rid: str, created: int, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if req.kind == CHAT else "text_completion",
        "created": created,
        "model": req.model,
        "choices": [choice],
    }


def first_chunk(
    req: ParsedRequest, rid: str, created: int, prompt_ids: list[int]
) -> dict[str, Any] | None:
    """The opening chunk (the assistant role for chat); None when there is none to send."""
    if req.kind != CHAT and not req.return_token_ids:
        return None
    if req.kind == CHAT:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    else:
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": None}
    if req.return_token_ids:
        choice["token_ids"] = []
    obj = _chunk(req, rid, created, choice)
    if req.return_token_ids:
        obj["prompt_token_ids"] = list(prompt_ids)
    return obj


def text_chunk(
    req: ParsedRequest, rid: str, created: int, text: str, token_ids: list[int]
) -> dict[str, Any]:
    """A chunk carrying new text (and its token ids)."""
    if req.kind == CHAT:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": text},
            "logprobs": None,
            "finish_reason": None,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return _chunk(req, rid, created, choice)


def final_chunk(
    req: ParsedRequest, rid: str, created: int, finish_reason: str, stats: SpecStats
) -> dict[str, Any]:
    """The chunk with the finish reason and the speculation counters."""
    if req.kind == CHAT:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    else:
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
    if req.return_token_ids:
        choice["token_ids"] = []
    obj = _chunk(req, rid, created, choice)
    obj["agentspec"] = stats.to_json()
    return obj


def usage_chunk(req: ParsedRequest, rid: str, created: int, done: Completion) -> dict[str, Any]:
    """The ``stream_options.include_usage`` chunk (no choices)."""
    obj = _chunk(req, rid, created, {})
    obj["choices"] = []
    obj["usage"] = usage(len(done.prompt_ids), len(done.token_ids))
    return obj
