"""resolve_tags: source priority, tenant sources, and invalid values dropped, not raised."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from agentspec_litellm.config import HookConfig, hash_key
from agentspec_litellm.tags import MASTER_KEY_ALIAS, resolve_tags

KEY = SimpleNamespace(
    token=hash_key("sk-a"), api_key=None, team_id="team-a", key_alias="alias-a", user_id="user-a"
)


def data(**kw: Any) -> dict[str, Any]:
    headers = kw.pop("headers", {})
    return {"model": "coder", "proxy_server_request": {"headers": headers}, "metadata": {}, **kw}


def test_body_beats_headers_beats_metadata_beats_litellm_session() -> None:
    d = data(
        vllm_xargs={"agentspec_stage": "from-body"},
        headers={"x-agentspec-stage": "from-header", "x-agentspec-session": "s-h"},
        metadata={"agentspec_stage": "from-md", "agentspec_pipeline": "p-md", "session_id": "lite"},
        litellm_session_id="lite",
    )
    tags, problems = resolve_tags(d, KEY, HookConfig())
    assert (tags.stage, tags.session, tags.pipeline) == ("from-body", "s-h", "p-md")
    assert problems == []
    tags, _ = resolve_tags(data(litellm_session_id="conv-1"), KEY, HookConfig())
    assert tags.session == "conv-1"


def test_percent_encoded_header_and_defaults() -> None:
    config = HookConfig.from_mapping(
        {"default_stage": {"coder": "agent"}, "default_pipeline": {"*": "p"}}
    )
    tags, _ = resolve_tags(data(headers={"x-agentspec-session": "caf%C3%A9"}), KEY, config)
    assert (tags.session, tags.stage, tags.pipeline, tags.tenant) == (
        "café",
        "agent",
        "p",
        "default",
    )


def test_invalid_values_are_dropped_and_reported() -> None:
    d = data(headers={"x-agentspec-stage": "x" * 200}, vllm_xargs={"agentspec_session": 5})
    tags, problems = resolve_tags(d, KEY, HookConfig())
    assert tags.stage is None
    assert tags.session is None
    assert len(problems) == 2
    assert "header x-agentspec-stage" in problems[0] + problems[1]


def test_client_tenant_is_trusted_only_with_tenant_from_client() -> None:
    d = data(vllm_xargs={"agentspec_tenant": "victim"}, metadata={"agentspec_tenant": "victim"})
    assert resolve_tags(d, KEY, HookConfig()).__getitem__(0).tenant == "victim"
    for source, expected in (("team", "team-a"), ("key_alias", "alias-a"), ("user", "user-a")):
        tags, _ = resolve_tags(d, KEY, HookConfig(tenant_from=source))  # type: ignore[arg-type]
        assert tags.tenant == expected
    keyed = HookConfig.from_mapping({"tenant_from": "key", "tenant_keys": {"sk-a": "acme"}})
    assert resolve_tags(d, KEY, keyed)[0].tenant == "acme"
    raw = SimpleNamespace(token=None, api_key="sk-a")  # a raw key is hashed before the lookup
    assert resolve_tags(d, raw, keyed)[0].tenant == "acme"
    stranger = SimpleNamespace(token=hash_key("sk-other"), api_key=None, team_id=None)
    assert resolve_tags(d, stranger, keyed)[0].tenant == "default"
    assert resolve_tags(d, stranger, HookConfig(tenant_from="team"))[0].tenant == "default"


def test_xargs_form_leaves_out_untagged() -> None:
    tags, _ = resolve_tags(data(), KEY, HookConfig())
    assert tags.xargs() == {"agentspec_tenant": "default"}


def test_tenant_keys_match_the_keys_as_litellm_shows_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # The stock auth path hands the hook LiteLLM's UserAPIKeyAuth: a virtual key hashed
    # with hash_token (what a database-backed key also carries), the master key as an alias.
    from litellm.proxy._types import LitellmUserRoles, UserAPIKeyAuth, hash_token

    import agentspec_litellm.tags as tags_module

    master, virtual = "sk-master-0123456789", "sk-virtual-0123456789"
    assert hash_key(virtual) == hash_token(virtual)
    config = HookConfig.from_mapping(
        {"tenant_from": "key", "tenant_keys": {master: "admins", virtual: "acme"}}
    )

    def tenant(key: Any) -> str:
        return resolve_tags(data(), key, config)[0].tenant

    as_sent = UserAPIKeyAuth(api_key=virtual)
    assert as_sent.token == hash_token(virtual)  # what LiteLLM shows a hook
    assert tenant(as_sent) == "acme"
    from_db = UserAPIKeyAuth(token=hash_token(virtual), api_key=hash_token(virtual))
    assert tenant(from_db) == "acme"

    admin = UserAPIKeyAuth(api_key=MASTER_KEY_ALIAS, user_role=LitellmUserRoles.PROXY_ADMIN)
    monkeypatch.setattr(tags_module, "_master_key", lambda: master)
    assert tenant(admin) == "admins"
    not_admin = UserAPIKeyAuth(api_key=MASTER_KEY_ALIAS)  # the alias alone proves nothing
    assert tenant(not_admin) == "default"
    monkeypatch.setattr(tags_module, "_master_key", lambda: "sk-another-master-key")
    assert tenant(admin) == "default"
