"""HookConfig: defaults, file loading, and a clear error for every bad value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentspec.exceptions import InvalidArgumentError
from agentspec_litellm.config import CONFIG_ENV, REDIS_URL_ENV, HookConfig, hash_key, load_config


def test_defaults_without_a_config_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    config = load_config()
    assert config == HookConfig()
    assert config.store is None
    assert config.push == "auto"
    assert config.tenant_from == "client"


def test_yaml_and_json_files_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.yaml").write_text(
        "store: /tmp/s\npush: [http://127.0.0.1:8000]\ndefault_stage: {coder: agent, '*': x}\n"
        "tenant_from: key\ntenant_keys: {sk-a: acme}\n"
    )
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "a.yaml"))
    config = load_config()
    assert config.store == Path("/tmp/s")
    assert config.push == ("http://127.0.0.1:8000",)
    assert config.default_for(config.default_stage, "coder") == "agent"
    assert config.default_for(config.default_stage, "other") == "x"
    assert config.tenant_keys == {hash_key("sk-a"): "acme"}
    (tmp_path / "b.json").write_text(json.dumps({"tenant_keys": {"sha256:" + "ab" * 32: "t"}}))
    assert load_config(tmp_path / "b.json").tenant_keys == {"ab" * 32: "t"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"stor": "/x"}, "unknown agentspec LiteLLM config keys: stor"),
        ({"tenant_from": "header"}, "tenant_from must be one of"),
        ({"tenant_from": "key"}, "needs a non-empty tenant_keys"),
        ({"tenant_keys": {"sha256:zz": "t"}}, "not a valid sha256"),
        ({"tenant_keys": {"sk": "bad\ntenant"}}, "tenant_keys"),
        ({"push": "ftp://x"}, "must start with http"),
        ({"push": 3}, "push must be 'auto' or a list"),
        ({"lead_tokens": -1}, "lead_tokens must be an int >= 0"),
        ({"queue_size": True}, "queue_size must be an int >= 1"),
        ({"return_token_ids": "yes"}, "return_token_ids must be true or false"),
        ({"default_stage": {"m": ""}}, "default_stage['m']"),
        ({"default_stage": ["m"]}, "default_stage must be a mapping"),
        ({"store": 3}, "store must be a non-empty string"),
    ],
)
def test_bad_values_are_named(raw: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace("[", r"\[").replace("*", r"\*")):
        HookConfig.from_mapping(raw)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("store: [unclosed")
    with pytest.raises(InvalidArgumentError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        load_config(tmp_path / "bad.json")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(InvalidArgumentError, match="must be a mapping"):
        load_config(tmp_path / "list.yaml")


# --- redis: the fleet's URL, from the config or $AGENTSPEC_REDIS_URL --------------------

SECRET = "s3cret-Pa55"


def test_redis_from_the_config_key_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    assert HookConfig().redis_url() is None
    (tmp_path / "a.yaml").write_text("store: /tmp/s\nredis: redis://cache:6379/2\n")
    assert load_config(tmp_path / "a.yaml").redis_url() == "redis://cache:6379/2"
    monkeypatch.setenv(REDIS_URL_ENV, f"rediss://u:{SECRET}@env:6380/0")
    assert HookConfig().redis_url() == f"rediss://u:{SECRET}@env:6380/0"
    assert load_config(tmp_path / "a.yaml").redis_url() == "redis://cache:6379/2"  # key wins
    off = HookConfig.from_mapping({"store": "/tmp/s", "redis": False})
    assert off.redis is False
    assert off.redis_url() is None  # false: no fleet whatever the environment says
    monkeypatch.setenv(REDIS_URL_ENV, "")
    assert HookConfig().redis_url() is None
    unix = HookConfig.from_mapping({"store": "/tmp/s", "redis": "unix:///run/r.sock"})
    assert unix.redis_url() == "unix:///run/r.sock"


@pytest.mark.parametrize(
    "url",
    [
        f"http://u:{SECRET}@h:6379",
        f"u:{SECRET}@h:6379",
        "h:6379",
        f"redis://u:{SECRET}@h:port",
        f"redis://:{SECRET}@",
        f"unix://u:{SECRET}@",
        f"redis://u:{SECRET}@[::1",
        "",
        3,
        True,
    ],
)
def test_bad_redis_urls_are_refused_without_their_password(
    url: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    with pytest.raises(InvalidArgumentError, match=r"^redis ") as info:
        HookConfig.from_mapping({"store": "/tmp/s", "redis": url})
    text = f"{info.value} {info.value!r}"
    assert SECRET not in text
    if url == f"redis://u:{SECRET}@h:port":
        assert "redis://u:***@h:port" in text  # the URL, redacted
    if isinstance(url, str) and url:
        monkeypatch.setenv(REDIS_URL_ENV, url)
        with pytest.raises(InvalidArgumentError, match=rf"^\${REDIS_URL_ENV} ") as info:
            HookConfig.from_mapping({"store": "/tmp/s"})
        assert SECRET not in f"{info.value} {info.value!r}"


def test_the_refusals_say_what_is_wanted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    with pytest.raises(InvalidArgumentError, match=r"or redis\+cluster:// URL, got a http:// URL"):
        HookConfig.from_mapping({"store": "/tmp/s", "redis": f"http://u:{SECRET}@h"})
    with pytest.raises(InvalidArgumentError, match="got no URL scheme"):
        HookConfig.from_mapping({"store": "/tmp/s", "redis": f"u:{SECRET}@h:6379"})
    with pytest.raises(InvalidArgumentError, match="redis needs store"):
        HookConfig.from_mapping({"redis": "redis://h:6379"})
    with pytest.raises(InvalidArgumentError, match="redis needs store"):
        HookConfig(redis="redis://h:6379")


def test_the_password_is_not_in_the_repr() -> None:
    config = HookConfig(store=Path("/tmp/s"), redis=f"redis://u:{SECRET}@h:6379/0")
    assert SECRET not in repr(config)
    assert SECRET not in str(config)
    assert config.redis_url() == f"redis://u:{SECRET}@h:6379/0"


def test_a_yaml_error_does_not_quote_the_file(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(f"store: /tmp/s\nredis: redis://u:{SECRET}@h:6379: [\n")
    with pytest.raises(InvalidArgumentError, match=r"not valid YAML: line 2, column \d+") as info:
        load_config(tmp_path / "a.yaml")
    assert SECRET not in f"{info.value} {info.value!r}"
    assert info.value.__cause__ is None


def test_redis_from_a_url_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentspec._util.secrets_source import REDIS_URL_FILE_ENV

    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    url = f"rediss://u:{SECRET}@env:6380/0"
    secret_file = tmp_path / "redis-url"
    secret_file.write_text(f"  {url}\n")
    secret_file.chmod(0o600)
    monkeypatch.setenv(REDIS_URL_FILE_ENV, str(secret_file))
    assert HookConfig().redis_url() == url  # whitespace stripped
    monkeypatch.setenv(REDIS_URL_ENV, url)
    with pytest.raises(InvalidArgumentError, match="not both"):
        HookConfig().redis_url()
    monkeypatch.delenv(REDIS_URL_ENV)
    secret_file.chmod(0o604)  # other users may read it: refused, the password not shown
    with pytest.raises(InvalidArgumentError, match="mode 0604") as info:
        HookConfig.from_mapping({"store": "/tmp/s"})
    assert SECRET not in f"{info.value} {info.value!r}"
    monkeypatch.setenv(REDIS_URL_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        HookConfig().redis_url()
    secret_file.chmod(0o600)
    secret_file.write_text(f"http://u:{SECRET}@h\n")
    monkeypatch.setenv(REDIS_URL_FILE_ENV, str(secret_file))
    with pytest.raises(InvalidArgumentError, match="redis://") as info:
        HookConfig().redis_url()
    assert SECRET not in f"{info.value} {info.value!r}"
