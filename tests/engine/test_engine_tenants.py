"""Tenant isolation of the embedded engine's server, on the real SmolLM2-135M model.

Regression tests of an outside review of ``agentspec serve --engine embedded``:

- the tenant was whatever the client wrote in ``vllm_xargs.agentspec_tenant``,
  so tenant B, probing with tenant A's prompt and tenant, saw A's shard in its
  response counters (16/16 drafted tokens accepted).  With a tenant map the
  tenant comes from the bearer key only: B's counters equal a fresh tenant's;
- the one API key also pushed, deleted and listed every tenant's shards.
  With an admin key only that key reaches ``/v1/agentspec/...``: an inference
  key gets 403, so B can neither list nor delete A's shards;
- keys outside the map get 401; with a map and no admin key the shard routes
  are closed; without either, the server behaves as before (no isolation).

Also the shared key map loader (`agentspec.protocol`), which the vLLM
middleware imports too.
"""

from __future__ import annotations

import hashlib
import http.client
import json
from collections.abc import Callable
from typing import Any

import pytest
from prereq import require_module

from agentspec._push.wire import encode_key_query
from agentspec.exceptions import InvalidArgumentError
from agentspec.protocol import (
    TENANT_KEYS_ENV,
    bearer_token,
    load_tenant_keys,
    tenant_keys_from_env,
    tenant_of,
)

MODEL = "smollm2-135m"
MAX_NEW = 16
PROMPT = "Count from 1 to 10, separated by commas."
OTHER = "Give me a JSON object with keys name and age for a person called Ann who is 30."
ADMIN = "sk-admin"
SHARED = "sk-shared"
TENANTS = ("a", "b", "c", "d", "e", "f")
KEYS = {f"sk-{t}": f"team-{t}" for t in TENANTS}


# --- the key map loader (no model) -------------------------------------------------------


def test_load_tenant_keys_reads_clear_and_hashed_keys(tmp_path: Any) -> None:
    digest = hashlib.sha256(b"sk-hidden").hexdigest()
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-a": "team-a", f"sha256:{digest}": "team-h"}))
    keys = load_tenant_keys(path)
    assert tenant_of(keys, "sk-a") == "team-a"
    assert tenant_of(keys, "sk-hidden") == "team-h"
    assert tenant_of(keys, f"sha256:{digest}") is None  # the digest is not a key
    assert tenant_of(keys, "sk-other") is None
    assert tenant_of(keys, None) is None
    assert tenant_keys_from_env({TENANT_KEYS_ENV: str(path)}) == keys
    assert tenant_keys_from_env({}) is None


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "[1]",
        '{"k": 3}',
        '{"": "t"}',
        '{"k": "bad\\u0001"}',
        '{"sha256:abc": "t"}',
        '{"sha256:' + "A" * 64 + '": "t"}',
        "[" * 100_000,
    ],
)
def test_bad_tenant_maps_are_refused(tmp_path: Any, content: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(InvalidArgumentError, match="tenant key map"):
        load_tenant_keys(path)


def test_bearer_token() -> None:
    assert bearer_token("Bearer sk-a") == "sk-a"
    assert bearer_token("  bearer   sk-a  ") == "sk-a"
    assert bearer_token("Basic sk-a") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


# --- the server (real model) -------------------------------------------------------------


def _create(model_tok: tuple[Any, Any], **kw: Any) -> Any:
    from agentspec.engine import EngineOptions, EngineServer

    # Goodput control off: the controller trims drafts by step times it learns
    # online, so with it on the drafted counters depend on timing.  Isolation is
    # about which shards a request drafts from, and the counters below compare
    # exactly what each tenant's shards propose.
    opts = EngineOptions(default_max_tokens=MAX_NEW, goodput=False)
    return EngineServer.create(*model_tok, opts, **kw)


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Any]) -> Any:
    from agentspec.engine import EngineOptions

    # Goodput control off: see `_create`.
    opts = EngineOptions(default_max_tokens=MAX_NEW, goodput=False)
    return start_server(opts, api_key=SHARED, tenant_keys=KEYS, admin_key=ADMIN)


def _http(
    srv: Any, method: str, path: str, key: str | None, body: Any = None, **headers: str
) -> tuple[int, Any]:
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **headers}
    if key is not None:
        hdrs["Authorization"] = f"Bearer {key}"
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
    try:
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
        ctype = resp.getheader("Content-Type") or ""
        return resp.status, json.loads(raw) if ctype.startswith("application/json") else raw
    finally:
        conn.close()


def _chat(
    srv: Any,
    key: str | None,
    stage: str,
    content: str = PROMPT,
    *,
    tenant: str | None = None,
    pipeline: str | None = None,
    speculate: bool = True,
) -> dict[str, Any]:
    xargs: dict[str, Any] = {"agentspec_stage": stage, "agentspec_speculate": speculate}
    if tenant is not None:
        xargs["agentspec_tenant"] = tenant
    if pipeline is not None:
        xargs["agentspec_pipeline"] = pipeline
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "return_token_ids": True,
        "vllm_xargs": xargs,
    }
    status, obj = _http(srv, "POST", "/v1/chat/completions", key, body)
    assert status == 200, obj
    return obj  # type: ignore[no-any-return]


def _error(status: int, obj: Any, expected: int) -> str:
    assert status == expected, obj
    err = obj["error"]
    assert err["message"]
    assert {"type", "param", "code"} <= set(err)
    return str(err["message"])


def _push(srv: Any, key: tuple[str, str, str], seq: list[int], api_key: str) -> bool:
    from agentspec import ShardPusher, ShardStore

    store = ShardStore()
    pusher = ShardPusher(store, [srv.url], api_key=api_key)
    try:
        store.learn(key, seq)
        return bool(pusher.flush(30))
    finally:
        pusher.close()
        store.close()


def _listed(srv: Any) -> set[tuple[str, str | None, str | None]]:
    status, obj = _http(srv, "GET", "/v1/agentspec/shards", ADMIN)
    assert status == 200
    return {(s["tenant"], s["pipeline"], s["stage"]) for s in obj["shards"]}


def _work(resp: dict[str, Any]) -> dict[str, Any]:
    """A response's ``agentspec`` counters without its wall-clock ``seconds``: steps,
    drafted and accepted tokens, and the prompt tokens taken from the (per-tenant)
    prefix cache must be equal, the timings never are."""
    return {k: v for k, v in resp["agentspec"].items() if k != "seconds"}


def test_learned_shard_of_one_tenant_never_drafts_for_another(server: Any) -> None:
    first = _chat(server, "sk-a", "probe")
    again = _chat(server, "sk-a", "probe")
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    # Tenant A learned its response: the repeat drafts from it.
    assert again["agentspec"]["accepted"] >= MAX_NEW // 2
    # B names A's tenant in the body: ignored, B drafts from B's own shards only,
    # exactly as a tenant that never sent anything.
    probe = _chat(server, "sk-b", "probe", tenant="team-a")
    fresh = _chat(server, "sk-c", "probe")
    assert probe["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert _work(probe) == _work(fresh) == _work(first)
    assert probe["agentspec"]["accepted"] < again["agentspec"]["accepted"]
    learned = server.engine.learned_shards()
    assert ("team-b", None, "probe") in learned  # B's response went to B's shard
    assert learned[("team-a", None, "probe")].stats().sequences == 2


def test_pushed_shard_of_one_tenant_never_drafts_for_another(server: Any) -> None:
    ref = _chat(server, "sk-d", "push-reference", OTHER, speculate=False)
    prompt, out = ref["prompt_token_ids"], ref["choices"][0]["token_ids"]
    key = ("team-a", "pushed-pipe", "pushed-stage")
    assert _push(server, key, prompt[-8:] + out, ADMIN)
    assert key in _listed(server)
    owner = _chat(server, "sk-a", "pushed-stage", OTHER, pipeline="pushed-pipe")
    assert owner["choices"][0]["token_ids"] == out
    assert owner["agentspec"]["accepted"] >= len(out) // 2
    probe = _chat(server, "sk-e", "pushed-stage", OTHER, tenant="team-a", pipeline="pushed-pipe")
    fresh = _chat(server, "sk-f", "pushed-stage", OTHER, pipeline="pushed-pipe")
    assert probe["choices"][0]["token_ids"] == out
    assert _work(probe) == _work(fresh)
    assert probe["agentspec"]["accepted"] < owner["agentspec"]["accepted"]


def test_inference_keys_cannot_list_push_or_delete_shards(server: Any) -> None:
    key = ("team-a", "kept-pipe", "kept-stage")
    assert _push(server, key, [1, 2, 3, 4, 5], ADMIN)
    query = "?" + encode_key_query(key)
    snapshot = b"\x00" * 64
    for api_key in ("sk-b", "sk-a", SHARED):
        for method, path, body in (
            ("GET", "/v1/agentspec/shards", None),
            ("DELETE", "/v1/agentspec/shards" + query, None),
            ("PUT", "/v1/agentspec/shards/snapshot" + query, snapshot),
            ("POST", "/v1/agentspec/shards/delta" + query, snapshot),
        ):
            status, obj = _http(server, method, path, api_key, body)
            assert "admin key" in _error(status, obj, 403)
    for bad in (None, "sk-nobody", f"{ADMIN}x"):
        status, obj = _http(server, "GET", "/v1/agentspec/shards", bad)
        _error(status, obj, 401)
    assert key in _listed(server)  # still there
    status, obj = _http(server, "DELETE", "/v1/agentspec/shards" + query, ADMIN)
    assert (status, obj["deleted"]) == (200, True)
    assert key not in _listed(server)


def test_keys_outside_the_map_get_401(server: Any) -> None:
    for bad in (None, "sk-nobody", ADMIN, "team-a"):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            body = None if method == "GET" else {"messages": [{"role": "user", "content": "x"}]}
            status, obj = _http(server, method, path, bad, body)
            _error(status, obj, 401)
    assert _http(server, "GET", "/v1/models", "sk-a")[0] == 200
    # The plain API key is accepted too, as the "default" tenant.
    _chat(server, SHARED, "shared-key", "Hi", tenant="team-a")
    learned = server.engine.learned_shards()
    assert ("default", None, "shared-key") in learned
    assert ("team-a", None, "shared-key") not in learned


def test_tenant_map_without_admin_key_closes_the_shard_routes(model_tok: tuple[Any, Any]) -> None:
    with _create(model_tok, tenant_keys={"sk-a": "team-a"}) as srv:
        try:
            status, obj = _http(srv, "GET", "/v1/agentspec/shards", "sk-a")
            assert "no admin key" in _error(status, obj, 403)
            _error(*_http(srv, "GET", "/v1/agentspec/shards", None), 401)
            _error(*_http(srv, "GET", "/v1/models", None), 401)
            assert _http(srv, "GET", "/v1/models", "sk-a")[0] == 200
        finally:
            srv.engine.close()


def test_admin_key_without_a_tenant_map(model_tok: tuple[Any, Any]) -> None:
    with _create(model_tok, api_key="sk-infer", admin_key=ADMIN) as srv:
        try:
            status, obj = _http(srv, "GET", "/v1/agentspec/shards", "sk-infer")
            assert "admin key" in _error(status, obj, 403)
            assert _http(srv, "GET", "/v1/agentspec/shards", ADMIN)[0] == 200
            _error(*_http(srv, "GET", "/v1/models", ADMIN), 401)
            assert _http(srv, "GET", "/v1/models", "sk-infer")[0] == 200
        finally:
            srv.engine.close()


def test_without_map_or_admin_key_nothing_is_isolated(model_tok: tuple[Any, Any]) -> None:
    # Today's behaviour, documented as such: the one key does everything and
    # the body picks the tenant.
    with _create(model_tok, api_key="sk-one") as srv:
        try:
            assert _push(srv, ("team-x", "p", "s"), [1, 2, 3], "sk-one")
            assert _http(srv, "GET", "/v1/agentspec/shards", "sk-one")[0] == 200
            _chat(srv, "sk-one", "body-tenant", "Hi", tenant="team-y")
            assert ("team-y", None, "body-tenant") in srv.engine.learned_shards()
        finally:
            srv.engine.close()


def test_admin_key_must_not_be_an_inference_key(model_tok: tuple[Any, Any]) -> None:
    digest = hashlib.sha256(b"sk-x").hexdigest()
    for kw in (
        {"api_key": "same", "admin_key": "same"},
        {"tenant_keys": {"sk-x": "team-x"}, "admin_key": "sk-x"},
        {"tenant_keys": {f"sha256:{digest}": "team-x"}, "admin_key": "sk-x"},
    ):
        with pytest.raises(InvalidArgumentError, match="admin key must differ"):
            _create(model_tok, **kw)
    with pytest.raises(InvalidArgumentError):
        _create(model_tok, tenant_keys={"sk-x": "bad\x01tenant"})


# --- agentspec serve flags (no model) ----------------------------------------------------


def _serve_args(argv: list[str]) -> Any:
    import argparse

    from agentspec._cli import vllm as cli_vllm

    parser = argparse.ArgumentParser()
    cli_vllm.add_serve_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def keys_file(tmp_path: Any) -> Any:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-a": "team-a", "sk-b": "team-b"}))
    return path


@pytest.fixture
def clean_env(monkeypatch: Any) -> Any:
    for name in (TENANT_KEYS_ENV, "AGENTSPEC_ADMIN_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_serve_embedded_dry_run_says_whether_tenants_are_isolated(
    tmp_path: Any, keys_file: Any, clean_env: Any, capsys: Any
) -> None:
    from agentspec._cli import vllm as cli_vllm

    base = [str(tmp_path), "--engine", "embedded", "--dry-run"]
    assert cli_vllm.run_serve(_serve_args(base)) == 0
    out = capsys.readouterr().out
    assert "NO ISOLATION" in out
    assert "every tenant's shards" in out
    flags = ["--tenant-keys", str(keys_file), "--admin-key", "sk-adm"]
    assert cli_vllm.run_serve(_serve_args([*base, *flags])) == 0
    out = capsys.readouterr().out
    assert "from the API key (2 keys" in out
    assert "admin key only" in out
    assert "sk-adm" not in out
    # The same from the environment, and flags given after MODEL.
    clean_env.setenv(TENANT_KEYS_ENV, str(keys_file))
    assert cli_vllm.run_serve(_serve_args(base)) == 0
    assert "shard routes: closed" in capsys.readouterr().out
    clean_env.setenv("AGENTSPEC_ADMIN_KEY", "sk-adm")
    assert cli_vllm.run_serve(_serve_args(base)) == 0
    assert "admin key only" in capsys.readouterr().out


def test_serve_embedded_passes_the_keys_on(
    tmp_path: Any, keys_file: Any, clean_env: Any, capsys: Any
) -> None:
    require_module("torch")
    import agentspec.engine
    from agentspec._cli import vllm as cli_vllm

    seen: dict[str, Any] = {}

    def fake(*args: Any, **kw: Any) -> None:
        seen.update(kw, args=args)

    clean_env.setattr(agentspec.engine, "run_engine_server", fake)
    argv = [str(tmp_path), "--engine", "embedded", "--api-key", "sk-s"]
    argv += ["--tenant-keys", str(keys_file), "--admin-key", "sk-adm"]
    assert cli_vllm.run_serve(_serve_args(argv)) == 0
    assert seen["tenant_keys"] == {"sk-a": "team-a", "sk-b": "team-b"}
    assert seen["admin_key"] == "sk-adm"
    assert seen["args"][3] == "sk-s"
    assert "admin key only" in capsys.readouterr().err


def test_serve_refuses_a_bad_tenant_map(tmp_path: Any, clean_env: Any) -> None:
    from agentspec._cli import vllm as cli_vllm

    bad = tmp_path / "bad.json"
    bad.write_text('{"sk-a": ""}')
    for engine in ("embedded", "vllm"):
        args = _serve_args([str(tmp_path), "--engine", engine, "--tenant-keys", str(bad)])
        with pytest.raises(InvalidArgumentError, match="tenant key map"):
            cli_vllm.run_serve(args) if engine == "embedded" else cli_vllm.serve_launch(args)


def test_serve_vllm_hands_the_map_to_the_middleware(
    tmp_path: Any, keys_file: Any, clean_env: Any
) -> None:
    from agentspec._cli import vllm as cli_vllm

    _, env = cli_vllm.serve_launch(_serve_args([str(tmp_path), "--tenant-keys", str(keys_file)]))
    assert env[TENANT_KEYS_ENV] == str(keys_file.resolve())
    with pytest.raises(InvalidArgumentError, match="middleware"):
        cli_vllm.serve_launch(
            _serve_args([str(tmp_path), "--tenant-keys", str(keys_file), "--no-middleware"])
        )
    with pytest.raises(InvalidArgumentError, match="embedded engine"):
        cli_vllm.serve_launch(_serve_args([str(tmp_path), "--admin-key", "sk-adm"]))
