"""docs/deploy.md, docs/deploy/compose.yaml and docs/deploy/helm-values.yaml against the code.

Every name a deployment copies from these files must be one the code reads, so the
files cannot go stale:

- the vLLM flags: every flag and value that ``agentspec vllm-args`` prints appears in the
  vLLM command (compose) and in ``extraArgs`` (Helm), and ``--additional-config`` is
  accepted by `agentspec.integration.vllm_config.load_config`, with the service's
  environment;
- ``VLLM_PLUGINS`` names the plugin's entry point in integrations/vllm/pyproject.toml, and
  every class or object a file names (proposer, worker extension, middleware, the
  endpoint plugin, the LiteLLM callback) is defined where it says;
- every ``AGENTSPEC_*`` variable is one the code reads: the vLLM plugin's for the vLLM
  service, the LiteLLM hook's for the proxy, and anywhere else one the package names;
- the hook's settings load with the hook's own `load_config`; a variable a setting
  names (``push_api_key_env``) is set in that service;
- every ``agentspec`` command in docs/deploy.md's shell blocks parses with the CLI's own
  parser.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from agentspec.__main__ import build_parser
from agentspec.integration import vllm_config
from agentspec.protocol import TENANT_KEYS_ENV

REPO = Path(__file__).resolve().parents[1]
DEPLOY_MD = REPO / "docs" / "deploy.md"
COMPOSE = REPO / "docs" / "deploy" / "compose.yaml"
HELM = REPO / "docs" / "deploy" / "helm-values.yaml"
VLLM_PKG = REPO / "integrations" / "vllm"
LITELLM_PKG = REPO / "integrations" / "litellm"


# --- what the code says ---------------------------------------------------------------


@cache
def vllm_args() -> list[str]:
    """``agentspec vllm-args --format json``: the flags the plugin needs, from the code."""
    out = subprocess.run(
        [sys.executable, "-m", "agentspec", "vllm-args", "--format", "json"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    data = json.loads(out)
    assert data["env"] == {"VLLM_PLUGINS": endpoint_plugin_name()}
    args: list[str] = data["args"]
    return args


@cache
def endpoint_plugin_name() -> str:
    text = (VLLM_PKG / "pyproject.toml").read_text(encoding="utf-8")  # tomllib: 3.11+
    section = text.split('[project.entry-points."vllm.endpoint_plugins"]\n', 1)[1]
    section = section.split("\n[", 1)[0]
    ((name, target),) = re.findall(r'^(\w+) = "([\w.:]+)"$', section, re.M)
    check_object_path(target.replace(":", "."), VLLM_PKG)
    return str(name)


def vllm_env_names() -> set[str]:
    """The variables the vLLM plugin reads (its config module's own naming rule)."""
    names = {
        vllm_config._ENV_NAMES.get(f.name, vllm_config.ENV_PREFIX + f.name.upper())
        for f in dataclasses.fields(vllm_config.AgentSpecVllmConfig)
    }
    names |= {vllm_config.ENV_PREFIX + "REDIS_URL", vllm_config.REDIS_URL_FILE_ENV}
    return names | {TENANT_KEYS_ENV}


@cache
def hook_config() -> ModuleType:
    """integrations/litellm/agentspec_litellm/config.py, loaded alone (it needs no litellm)."""
    name = "_agentspec_litellm_config_under_test"
    spec = importlib.util.spec_from_file_location(
        name, LITELLM_PKG / "agentspec_litellm" / "config.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def litellm_env_names() -> set[str]:
    cfg = hook_config()
    return {cfg.CONFIG_ENV, cfg.REDIS_URL_ENV, cfg.REDIS_URL_ENV + "_FILE"}


@cache
def package_env_names() -> frozenset[str]:
    """Every ``AGENTSPEC_*`` name written in the package or the integrations' source."""
    found: set[str] = set()
    for root in (
        REPO / "agentspec",
        VLLM_PKG / "agentspec_vllm",
        LITELLM_PKG / "agentspec_litellm",
    ):
        for path in root.rglob("*.py"):
            found |= set(re.findall(r"AGENTSPEC_[A-Z0-9_]*[A-Z0-9]", path.read_text("utf-8")))
    return frozenset(found)


def check_object_path(dotted: str, package_root: Path) -> None:
    """``module.path.Name`` names a top-level class, function or assignment of that module."""
    module, _, attr = dotted.rpartition(".")
    path = package_root / (module.replace(".", "/") + ".py")
    assert path.is_file(), f"{dotted}: no module file {path.relative_to(REPO)}"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
    assert attr in defined, f"{dotted}: {module} defines no {attr}"


# --- checks shared by compose and Helm -------------------------------------------------


def check_vllm_command(args: list[str], env: dict[str, str], tmp_path: Path) -> None:
    expected = vllm_args()
    for i in range(0, len(expected), 2):
        flag, value = expected[i], expected[i + 1]
        assert flag in args, f"{flag} missing from the vLLM command"
        got = args[args.index(flag) + 1]
        if flag == "--speculative-config":
            assert json.loads(got) == json.loads(value)
            check_object_path(json.loads(got)["model"], VLLM_PKG)
        else:
            assert got == value, f"{flag} {got!r}: the code says {value!r}"
            check_object_path(got, VLLM_PKG)
    for name in env:
        if name.startswith("AGENTSPEC_"):
            assert name in vllm_env_names(), f"the vLLM plugin reads no {name}"
    assert env.get("VLLM_PLUGINS") == endpoint_plugin_name()
    additional = None
    if "--additional-config" in args:
        additional = json.loads(args[args.index("--additional-config") + 1])
        assert set(additional) == {"agentspec"}
    environ = dict(env)
    url = None
    if vllm_config.REDIS_URL_FILE_ENV in environ:  # a real file, as the plugin demands
        url = "redis://:pw@redis:6379/0"
        url_file = tmp_path / "redis-url"
        url_file.write_text(url + "\n")
        url_file.chmod(0o600)
        environ[vllm_config.REDIS_URL_FILE_ENV] = str(url_file)
    config = vllm_config.load_config(additional, environ)
    assert config.redis_url == url


def check_hook_settings(text: str, env: dict[str, str], tmp_path: Path) -> Any:
    path = tmp_path / "agentspec-litellm.yaml"
    path.write_text(text)
    config = hook_config().load_config(path)
    if config.push_api_key_env is not None:
        assert config.push_api_key_env in env, f"{config.push_api_key_env} is not set"
    return config


def check_proxy_config(proxy: dict[str, Any]) -> None:
    callback = proxy["litellm_settings"]["callbacks"]
    assert callback == "agentspec_litellm.proxy_handler_instance"
    check_object_path("agentspec_litellm.__init__.proxy_handler_instance", LITELLM_PKG)
    for model in proxy["model_list"]:
        assert model["litellm_params"]["model"].startswith(("hosted_vllm/", "openai/"))


def check_litellm_env(env: dict[str, str]) -> None:
    for name in env:
        if name.startswith("AGENTSPEC_"):
            assert name in litellm_env_names(), f"the LiteLLM hook reads no {name}"
    assert hook_config().CONFIG_ENV in env


# --- the files ---------------------------------------------------------------------------


def _env(entries: Any) -> dict[str, str]:
    if isinstance(entries, dict):
        return {str(k): str(v) for k, v in entries.items()}
    return {e["name"]: str(e.get("value", "")) for e in entries}


def test_compose(tmp_path: Path) -> None:
    doc = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    services = doc["services"]
    assert set(services) == {"redis", "vllm", "litellm"}

    vllm = services["vllm"]
    args = [str(a) for a in vllm["entrypoint"] + vllm["command"]]
    assert args[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    vllm_env = _env(vllm["environment"])
    check_vllm_command(args, vllm_env, tmp_path)
    assert "redis-url" in vllm["secrets"]
    assert vllm_env[vllm_config.REDIS_URL_FILE_ENV] == "/run/secrets/redis-url"
    assert "integrations/vllm" in vllm["build"]["dockerfile_inline"]

    proxy = services["litellm"]
    env = _env(proxy["environment"])
    check_litellm_env(env)
    configs = {c["target"]: doc["configs"][c["source"]]["content"] for c in proxy["configs"]}
    assert proxy["command"][:3] == ["litellm", "--config", "/etc/litellm/config.yaml"]
    check_proxy_config(yaml.safe_load(configs["/etc/litellm/config.yaml"]))
    settings = check_hook_settings(configs[env[hook_config().CONFIG_ENV]], env, tmp_path)
    assert str(settings.store).startswith("/var/lib/agentspec")
    assert env[hook_config().REDIS_URL_ENV + "_FILE"] == "/run/secrets/redis-url"
    assert set(doc["secrets"]) == {"redis-password", "redis-url"}
    dockerfile = proxy["build"]["dockerfile_inline"]
    assert "scripts/constraints/litellm.txt" in dockerfile
    pinned = re.search(
        r"^litellm==(\S+)$", (REPO / "scripts/constraints/litellm.txt").read_text(), re.M
    )
    assert pinned is not None
    assert f'"litellm[proxy]=={pinned.group(1)}"' in dockerfile


def test_helm_values(tmp_path: Path) -> None:
    doc = yaml.safe_load(HELM.read_text(encoding="utf-8"))
    assert set(doc) == {"vllm-stack", "litellm-helm"}

    (model,) = doc["vllm-stack"]["servingEngineSpec"]["modelSpec"]
    args = [str(a) for a in model["vllmConfig"]["extraArgs"]]
    env = _env(model["env"])
    check_vllm_command(args, env, tmp_path)
    mounts = {m["name"]: m["mountPath"] for m in model["extraVolumeMounts"]}
    assert env[vllm_config.REDIS_URL_FILE_ENV].startswith(mounts["agentspec-redis"] + "/")

    proxy = doc["litellm-helm"]
    env = _env(proxy["envVars"])
    check_litellm_env(env)
    env |= {"VLLM_API_KEY": "from the agentspec-keys Secret"}  # environmentSecrets
    assert proxy["environmentSecrets"] == ["agentspec-keys"]
    check_proxy_config(proxy["proxy_config"])
    (settings_map,) = [r for r in proxy["extraResources"] if r["kind"] == "ConfigMap"]
    mounts = {m["name"]: m for m in proxy["volumeMounts"]}
    mount = mounts["agentspec-settings"]
    assert env[hook_config().CONFIG_ENV] == mount["mountPath"]
    settings = check_hook_settings(settings_map["data"][mount["subPath"]], env, tmp_path)
    assert not settings.push  # behind a Service a push reaches one pod; the fleet all
    assert env[hook_config().REDIS_URL_ENV + "_FILE"].startswith(
        mounts["agentspec-redis"]["mountPath"] + "/"
    )


@pytest.mark.parametrize("path", [DEPLOY_MD, COMPOSE, HELM], ids=lambda p: p.name)
def test_every_variable_is_read_by_the_code(path: Path) -> None:
    names = set(re.findall(r"AGENTSPEC_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8")))
    assert names, path
    unknown = sorted(n for n in names if n not in package_env_names() and n != "AGENTSPEC_VLLM_")
    assert unknown == []


def _shell_commands(text: str) -> list[str]:
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("agentspec "):
                out.append(line)
    return out


def test_every_agentspec_command_in_deploy_md_parses() -> None:
    commands = _shell_commands(DEPLOY_MD.read_text(encoding="utf-8"))
    assert len(commands) >= 4
    parser = build_parser()
    for line in commands:
        argv = shlex.split(line)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit as e:  # argparse's way of refusing
            raise AssertionError(f"{line!r} does not parse") from e


@pytest.mark.parametrize("path", [DEPLOY_MD, REPO / "README.md"], ids=lambda p: p.name)
def test_the_shown_vllm_args_output_is_the_real_one(path: Path) -> None:
    """The shell block after `agentspec vllm-args --model ...` is what that command prints."""
    text = path.read_text(encoding="utf-8")
    (line,) = [c for c in _shell_commands(text) if c.startswith("agentspec vllm-args --model")]
    shown = text.split(line, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    printed = subprocess.run(
        [sys.executable, "-m", "agentspec", *shlex.split(line)[1:]],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert shown == printed
