"""Every sampling parameter works exactly, speculation on or off, or is refused with a 400.

- `process_logits` / `filtered_probs` against naive per-position references
  (allowed_token_ids, logit_bias, repetition / frequency / presence penalties,
  temperature, min_p, top_k, top_p);
- the verifier on the real SmolLM2-135M model with adversarial chain and tree
  drafts: greedy and seeded outputs with each parameter equal plain decoding
  token for token (the penalties of position i see the draft tokens accepted
  before it);
- the HTTP server: each parameter gives the same output with speculation on
  and off; parameters it cannot honour get a 400 naming them; every error
  body is OpenAI-shaped with a string ``code``.
"""

from __future__ import annotations

import http.client
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from prereq import require_module

from agentspec.engine._logits import process_logits, target_distribution
from agentspec.engine._sampling import SamplingParams, filtered_probs
from agentspec.exceptions import InvalidArgumentError

# --- naive references ----------------------------------------------------------------


def _ref_process(
    logits: np.ndarray, params: SamplingParams, prompt: Sequence[int], history: Sequence[int]
) -> np.ndarray:
    """One row, token by token, as vLLM's sampler describes it (``history``: the output)."""
    x = [float(v) for v in logits]
    vocab = len(x)
    if params.allowed_token_ids is not None:
        x = [v if t in params.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    for t, b in params.logit_bias:
        if t < vocab:
            x[t] += b
    for t in range(vocab):
        count = sum(1 for h in history if h == t)
        if t in prompt or count:
            r = params.repetition_penalty
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        x[t] -= params.frequency_penalty * count
        x[t] -= params.presence_penalty * (1 if count else 0)
    return np.array(x)


def _ref_probs(z: np.ndarray, params: SamplingParams) -> np.ndarray:
    """temperature, min_p, top_k, top_p, one row, with sorted lists."""
    if params.greedy:
        out = np.zeros(len(z))
        out[int(np.argmax(z))] = 1.0
        return out
    t = max(params.temperature, 1e-2)
    w = [math.exp(v / t - max(z) / t) for v in z]
    p = [v / sum(w) for v in w]
    keep = [True] * len(p)
    if params.min_p > 0:
        keep = [k and v >= params.min_p * max(p) for k, v in zip(keep, p, strict=True)]
    if 0 < params.top_k < len(p):
        kth = sorted(z, reverse=True)[params.top_k - 1]
        keep = [k and v >= kth for k, v in zip(keep, z, strict=True)]
    p = [v if k else 0.0 for v, k in zip(p, keep, strict=True)]
    p = [v / sum(p) for v in p]
    if params.top_p < 1:
        order = sorted(range(len(p)), key=lambda i: -p[i])
        mass, nucleus = 0.0, set()
        for i in order:
            if mass < params.top_p:
                nucleus.add(i)
            mass += p[i]
        p = [v if i in nucleus else 0.0 for i, v in enumerate(p)]
        p = [v / sum(p) for v in p]
    return np.array(p)


def _random_params(rng: np.random.Generator, vocab: int) -> SamplingParams:
    def maybe(value: Any, off: Any) -> Any:
        return value if rng.random() < 0.6 else off

    allowed = tuple(sorted({int(t) for t in rng.integers(0, vocab, 6)}))
    return SamplingParams(
        temperature=float(maybe(rng.uniform(0.3, 1.5), 0.0 if rng.random() < 0.3 else 1.0)),
        top_p=float(maybe(rng.uniform(0.3, 1.0), 1.0)),
        top_k=int(maybe(int(rng.integers(1, vocab + 2)), 0)),
        min_p=float(maybe(rng.uniform(0, 0.5), 0.0)),
        repetition_penalty=float(maybe(rng.uniform(0.5, 2.0), 1.0)),
        frequency_penalty=float(maybe(rng.uniform(-2, 2), 0.0)),
        presence_penalty=float(maybe(rng.uniform(-2, 2), 0.0)),
        logit_bias=maybe(((int(rng.integers(vocab)), float(rng.uniform(-5, 5))),), ()),
        allowed_token_ids=allowed if rng.random() < 0.2 else None,
    )


def test_process_logits_matches_the_per_position_reference() -> None:
    rng = np.random.default_rng(20240601)
    vocab = 12
    for _ in range(300):
        params = _random_params(rng, vocab)
        rows = int(rng.integers(1, 6))
        logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
        prompt = [int(t) for t in rng.integers(0, vocab, rng.integers(0, 6))]
        output = [int(t) for t in rng.integers(0, vocab, rng.integers(0, 8))]
        accepted = [[int(t) for t in rng.integers(0, vocab, i)] for i in range(rows)]
        got = process_logits(logits, params, prompt, output, accepted)
        probs = target_distribution(logits, params, prompt, output, accepted)
        assert got.shape == (rows, vocab)
        for r in range(rows):
            want = _ref_process(logits[r], params, prompt, output + accepted[r])
            np.testing.assert_allclose(got[r], want, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(probs[r], _ref_probs(want, params), atol=1e-12)
            assert probs[r].sum() == pytest.approx(1.0)
        # a single (V,) row works too, and the input is not modified
        one = process_logits(logits[0], params, prompt, output)
        np.testing.assert_array_equal(one, got[0])


def test_penalties_of_a_row_use_the_draft_tokens_before_it() -> None:
    logits = np.array([[2.0, -1.0, 0.5, 3.0]] * 3)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = process_logits(logits, params, prompt=[2], output=[0], accepted=[[], [3], [3, 3]])
    # token 0 (output once): 2 / 2 - 0.5 - 0.25; token 2 (prompt only): 0.5 / 2
    np.testing.assert_allclose(got[0], [0.25, -1.0, 0.25, 3.0])
    np.testing.assert_allclose(got[1], [0.25, -1.0, 0.25, 1.5 - 0.75])
    np.testing.assert_allclose(got[2], [0.25, -1.0, 0.25, 1.5 - 1.25])
    # presence and frequency ignore the prompt; repetition counts it
    only_prompt = process_logits(logits[:1], params, prompt=[0, 1], output=[])
    np.testing.assert_allclose(only_prompt[0], [1.0, -2.0, 0.5, 3.0])


def test_filtering_min_p_top_k_top_p() -> None:
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.06, 0.04]]))
    np.testing.assert_allclose(
        filtered_probs(logits, SamplingParams(top_k=2)), [[0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]]
    )
    np.testing.assert_allclose(
        filtered_probs(logits, SamplingParams(min_p=0.5)), [[0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0, 0]]
    )
    # top_p acts on what min_p / top_k left, renormalised: 0.4/0.9 < 0.5 <= 0.7/0.9
    np.testing.assert_allclose(
        filtered_probs(logits, SamplingParams(min_p=0.5, top_p=0.5)),
        [[0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]],
    )
    # ties at the k-th logit are kept
    tie = np.log(np.array([[0.3, 0.3, 0.3, 0.1]]))
    np.testing.assert_allclose(filtered_probs(tie, SamplingParams(top_k=2))[0, :3], [1 / 3] * 3)
    # greedy ignores the filters; top_k >= vocab and -1 are off
    np.testing.assert_array_equal(
        filtered_probs(logits, SamplingParams(0.0, top_k=3)), [[1, 0, 0, 0, 0]]
    )
    for k in (-1, 0, 5, 99):
        np.testing.assert_allclose(filtered_probs(logits, SamplingParams(top_k=k)), np.exp(logits))


@pytest.mark.parametrize(
    "kw",
    [
        {"top_k": -2},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": math.inf},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -3},
        {"logit_bias": ((1, 101.0),)},
        {"allowed_token_ids": ()},
    ],
)
def test_sampling_params_validation(kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kw)


# --- the verifier on the real model ---------------------------------------------------

torch = require_module("torch")
require_module("transformers")

from agentspec.engine import EngineOptions, EngineServer, Verifier  # noqa: E402

N_TOKENS = 20

#: One case per parameter (and a few together); each runs greedy and seeded.
CASES: dict[str, dict[str, Any]] = {
    "top_k": {"top_k": 3},
    "min_p": {"min_p": 0.1},
    "top_p": {"top_p": 0.8},
    "repetition_penalty": {"repetition_penalty": 1.5},
    "frequency_penalty": {"frequency_penalty": 1.2},
    "presence_penalty": {"presence_penalty": 1.5},
    "logit_bias": {"logit_bias": {"28": 4.0, "30": -100}},
    "all": {
        "top_k": 20,
        "min_p": 0.05,
        "top_p": 0.9,
        "repetition_penalty": 1.2,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
    },
}


def _params(case: dict[str, Any], temperature: float) -> SamplingParams:
    kw = dict(case)
    if "logit_bias" in kw:
        kw["logit_bias"] = tuple((int(k), float(v)) for k, v in kw["logit_bias"].items())
    return SamplingParams(temperature=temperature, **kw)


@pytest.fixture(scope="module")
def prompt(model_tok: tuple[Any, Any]) -> list[int]:
    enc = model_tok[1].apply_chat_template(
        [{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
        add_generation_prompt=True,
    )
    return list(enc["input_ids"])


def _decode(
    v: Verifier,
    prompt: list[int],
    sampling: SamplingParams,
    seed: int,
    drafter: Any = None,
) -> list[int]:
    v.prefill(prompt)
    out: list[int] = []
    while len(out) < N_TOKENS:
        draft = drafter(out) if drafter is not None else None
        out += v.step(draft, sampling=sampling, seed=seed)
    return out[:N_TOKENS]


def _adversarial(ref: list[int], rng: np.random.Generator, tree: bool) -> Any:
    """Drafts of the true continuation, wrong from a random depth on (a wrong sibling first)."""

    def draft(out: list[int]) -> tuple[list[int], list[int] | None]:
        true = ref[len(out) : len(out) + 6]
        if not true:
            return [], None
        cut = int(rng.integers(0, len(true) + 1))
        chain = true[:cut] + [int(t) for t in rng.integers(0, 1000, 3)]
        if not tree:
            return chain, None
        # a wrong branch at the root first, then the (partly right) chain
        tokens = [(true[0] + 1) % 1000, 17, *chain]
        parents = [-1, 0, -1, *range(2, 2 + len(chain) - 1)]
        return tokens, parents

    return draft


@pytest.mark.parametrize("name", sorted(CASES))
def test_verifier_drafts_never_change_the_output(
    model_tok: tuple[Any, Any], prompt: list[int], name: str
) -> None:
    v = Verifier(model_tok[0])
    rng = np.random.default_rng(7)
    changed = []
    # at 0.9 the race's winner is seldom a token min_p=0.1 or top_p=0.8 filters out
    for temperature in (0.0, 1.5):
        sampling = _params(CASES[name], temperature)
        plain = _decode(v, prompt, sampling, seed=11)
        for tree in (False, True):
            got = _decode(v, prompt, sampling, seed=11, drafter=_adversarial(plain, rng, tree))
            assert got == plain, (name, temperature, tree)
        base = _decode(v, prompt, SamplingParams(temperature=temperature), seed=11)
        changed.append(base != plain)
    assert any(changed), name  # the parameter changes the output (else this proves nothing)


def test_penalties_change_greedy_output(model_tok: tuple[Any, Any], prompt: list[int]) -> None:
    v = Verifier(model_tok[0])
    base = _decode(v, prompt, SamplingParams(0.0), seed=0)
    # (presence_penalty=2 leaves this confident count unchanged; it changes sampled output)
    for kw in ({"repetition_penalty": 1.5}, {"frequency_penalty": 1.5}):
        assert _decode(v, prompt, SamplingParams(0.0, **kw), seed=0) != base, kw


# --- the HTTP server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(start_server: Callable[..., EngineServer]) -> EngineServer:
    return start_server(EngineOptions(default_max_tokens=32))


def _post(
    server: Any, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    try:
        conn.request(
            "POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _completion(server: Any, stage: str, speculate: bool, **kw: Any) -> dict[str, Any]:
    body = {
        "model": "smollm2-135m",
        "prompt": "The three primary colors are",
        "max_tokens": N_TOKENS,
        "return_token_ids": True,
        "vllm_xargs": {"agentspec_stage": stage, "agentspec_speculate": speculate},
        **kw,
    }
    status, obj = _post(server, "/v1/completions", body)
    assert status == 200, obj
    assert obj["agentspec"]["speculate"] is speculate
    return obj


@pytest.mark.parametrize("name", sorted(CASES))
def test_server_parameters_same_with_speculation_on_and_off(server: Any, name: str) -> None:
    for temperature, seed in ((0, None), (0.9, 1234)):
        kw = {**CASES[name], "temperature": temperature}
        if seed is not None:
            kw["seed"] = seed
        stage = f"params-{name}-{temperature}"
        _completion(server, stage, False)  # the shard learns the unpenalised output
        off = _completion(server, stage, False, **kw)
        on = _completion(server, stage, True, **kw)
        assert on["choices"][0]["token_ids"] == off["choices"][0]["token_ids"], kw
        assert on["choices"][0]["text"] == off["choices"][0]["text"]
        assert on["agentspec"]["drafted"] > 0  # the drafts were verified, not skipped


def test_logit_bias_and_allowed_token_ids_steer_the_output(server: Any) -> None:
    # SmolLM2's tokens 28, 29, 30, 33: ",", "-", ".", "1"
    allowed = [28, 29, 30, 33]
    for speculate in (False, True):
        obj = _completion(
            server, "allowed", speculate, temperature=0.8, seed=5, allowed_token_ids=allowed
        )
        assert set(obj["choices"][0]["token_ids"]) <= set(allowed)
        obj = _completion(server, "bias", speculate, temperature=0, logit_bias={"28": 100})
        assert set(obj["choices"][0]["token_ids"]) == {28}


def test_stop_token_ids_and_ignore_eos(server: Any) -> None:
    full = _completion(server, "stop-ids", False, temperature=0)["choices"][0]
    ids = full["token_ids"]
    stop = ids[3]
    for speculate in (False, True):
        cut = _completion(server, "stop-ids", speculate, temperature=0, stop_token_ids=[stop])
        choice = cut["choices"][0]
        assert choice["token_ids"] == ids[: ids.index(stop) + 1]
        assert choice["finish_reason"] == "stop"
    status, obj = _post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 40,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert status == 200
    assert obj["usage"]["completion_tokens"] == 40
    assert obj["choices"][0]["finish_reason"] == "length"


# --- refusals and error bodies ---------------------------------------------------------------


def _check_error(obj: dict[str, Any]) -> dict[str, Any]:
    err = obj["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str)
    assert err["message"]
    assert isinstance(err["type"], str)
    assert isinstance(err["code"], str)
    return err  # type: ignore[no-any-return]


REFUSED: list[tuple[str, Any]] = [
    ("logprobs", True),
    ("logprobs", 2),
    ("top_logprobs", 3),
    ("prompt_logprobs", 1),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("best_of", 2),
    ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("min_tokens", 4),
    ("bad_words", ["red"]),
    ("guided_json", {"type": "object"}),
    ("guided_regex", "[a-z]+"),
    ("guided_choice", ["a", "b"]),
    ("guided_grammar", "root ::= 'a'"),
    ("structured_outputs", {"json": {}}),
    ("logits_processors", ["x"]),
    ("include_stop_str_in_output", True),
    ("skip_special_tokens", False),
    ("spaces_between_special_tokens", False),
    ("truncate_prompt_tokens", 4),
    ("echo", True),
    ("suffix", "end"),
    ("n", 2),
]

INVALID: list[tuple[str, Any]] = [
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", True),
    ("min_p", 1.1),
    ("min_p", "x"),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1),
    ("frequency_penalty", 2.1),
    ("presence_penalty", -2.1),
    ("logit_bias", {"abc": 1}),
    ("logit_bias", {"99999999": 1}),
    ("logit_bias", {"5": 101}),
    ("logit_bias", [1, 2]),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [10**9]),
    ("stop_token_ids", ["a"]),
    ("ignore_eos", "yes"),
    ("temperature", 3),
    ("top_p", 0),
]


@pytest.mark.parametrize(("param", "value"), REFUSED + INVALID)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_unsupported_or_invalid_parameters_get_a_400_naming_them(
    server: Any, path: str, param: str, value: Any
) -> None:
    body: dict[str, Any] = {"max_tokens": 2, param: value}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    status, obj = _post(server, path, body)
    assert status == 400, obj
    err = _check_error(obj)
    assert err["param"] == param
    assert param in err["message"]
    if (param, value) in REFUSED:
        assert err["code"] == "unsupported_parameter"


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("response_format", {"type": "text"}),
        ("logprobs", False),
        ("best_of", 1),
        ("use_beam_search", False),
        ("length_penalty", 1.0),
        ("min_tokens", 0),
        ("skip_special_tokens", True),
        ("top_k", -1),
        ("top_k", 0),
        ("repetition_penalty", 1),
        ("n", 1),
    ],
)
def test_off_values_are_accepted(server: Any, param: str, value: Any) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0, param: value}
    status, obj = _post(server, "/v1/completions", body)
    assert status == 200, obj


def test_every_error_body_has_a_string_code(server: Any) -> None:
    cases = [
        (b"{not json", {}, 400, "invalid_request"),
        (json.dumps({"model": "nope", "prompt": "hi"}).encode(), {}, 404, "model_not_found"),
        (json.dumps({"prompt": [1] * 9000}).encode(), {}, 400, "invalid_request"),
    ]
    for body, headers, status, code in cases:
        got, obj = _post(server, "/v1/completions", body, headers)
        assert got == status
        assert _check_error(obj)["code"] == code
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        for method, path, status, code in [
            ("GET", "/v1/nothing", 404, "not_found"),
            ("GET", "/v1/completions", 405, "method_not_allowed"),
        ]:
            conn.request(method, path)
            resp = conn.getresponse()
            assert resp.status == status
            assert _check_error(json.loads(resp.read()))["code"] == code
    finally:
        conn.close()
    with EngineServer(server.engine, api_key="k") as keyed:
        status, obj = _post(keyed, "/v1/completions", {"prompt": "hi"})
        assert status == 401
        assert _check_error(obj)["code"] == "invalid_api_key"


def test_generation_request_carries_one_sampling_params() -> None:
    """sampling= is the request's SamplingParams; the flat fields mirror it, or make it."""
    import dataclasses

    from agentspec.engine import GenerationRequest

    params = SamplingParams(0.7, 0.9, top_k=5, logit_bias=((3, 1.5),), allowed_token_ids=(3, 4))
    req = GenerationRequest([1, 2], sampling=params)
    assert req.sampling_params() is params
    assert (req.temperature, req.top_p, req.top_k, req.logit_bias) == (0.7, 0.9, 5, ((3, 1.5),))
    flat = GenerationRequest([1, 2], temperature=0.7, top_p=0.9, top_k=5, logit_bias=((3, 1.5),))
    assert flat.sampling_params() == SamplingParams(0.7, 0.9, top_k=5, logit_bias=((3, 1.5),))
    assert GenerationRequest([1]).sampling_params() == SamplingParams(0.0)
    with pytest.raises(InvalidArgumentError, match="not both"):
        GenerationRequest([1, 2], top_k=3, sampling=params)
    again = dataclasses.replace(req, identity="r1")  # the server names requests so
    assert again.sampling_params() is params
    assert again.top_k == 5
    bad = GenerationRequest([1], temperature=-1.0)  # checked when it runs, as before
    with pytest.raises(InvalidArgumentError):
        bad.sampling_params()


def test_the_openai_layer_hands_the_engine_one_sampling_params(server: Any) -> None:
    from agentspec.engine._openai import COMPLETIONS, parse_request

    body = {
        "prompt": "hi",
        "temperature": 0.5,
        "top_k": 7,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "logit_bias": {"5": 2},
        "stop_token_ids": [9],
        "ignore_eos": True,
    }
    parsed = parse_request(COMPLETIONS, json.dumps(body).encode(), {}, server.engine, ("m",))
    gen = parsed.generation
    assert gen.sampling == SamplingParams(
        0.5, 1.0, top_k=7, min_p=0.1, presence_penalty=0.5, logit_bias=((5, 2.0),)
    )
    assert gen.sampling_params() is gen.sampling
    assert (gen.stop_token_ids, gen.ignore_eos) == ((9,), True)
