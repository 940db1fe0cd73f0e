"""``agentspec vllm-args`` and ``agentspec serve`` (command building; no vLLM started)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys

import pytest

from agentspec._cli import vllm as cli_vllm
from agentspec._cli.vllm import (
    MIDDLEWARE_CLASS,
    PROPOSER_CLASS,
    WORKER_EXTENSION_CLASS,
    VllmLaunch,
    vllm_launch,
)
from agentspec.exceptions import InvalidArgumentError

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def vllm_args(argv, capsys):
    parser = argparse.ArgumentParser()
    cli_vllm.add_vllm_args_arguments(parser)
    assert cli_vllm.run_vllm_args(parser.parse_args(argv)) == 0
    return capsys.readouterr().out


def serve_args(argv):
    parser = argparse.ArgumentParser()
    cli_vllm.add_serve_arguments(parser)
    return parser.parse_args(argv)


def flag(args, name):
    return args[args.index(name) + 1]


def test_json_output_has_every_flag(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    out = json.loads(vllm_args(["--format", "json", "--num-speculative-tokens", "12"], capsys))
    assert out["env"] == {"VLLM_PLUGINS": "agentspec"}
    args = out["args"]
    spec = json.loads(flag(args, "--speculative-config"))
    assert spec == {
        "method": "custom_class",
        "model": PROPOSER_CLASS,
        "num_speculative_tokens": 12,
    }
    assert flag(args, "--worker-extension-cls") == WORKER_EXTENSION_CLASS
    assert flag(args, "--middleware") == MIDDLEWARE_CLASS
    assert "--additional-config" not in args
    assert "--model" not in args


def test_additional_config_and_options(capsys):
    out = json.loads(
        vllm_args(
            [
                "--format",
                "json",
                "--max-depth",
                "32",
                "--shm-dir",
                "/dev/shm",
                "--set",
                "min_token_prob=0.25",
                "--set",
                "learn=false",
                "--no-middleware",
                "--model",
                "/models/x",
            ],
            capsys,
        )
    )
    args = out["args"]
    assert json.loads(flag(args, "--additional-config")) == {
        "agentspec": {
            "min_token_prob": 0.25,
            "learn": False,
            "max_depth": 32,
            "shm_dir": "/dev/shm",
        }
    }
    assert "--middleware" not in args
    assert flag(args, "--model") == "/models/x"


def test_shell_output_round_trips_through_shlex(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    text = vllm_args(["--set", "alpha=0.5", "--model", "my model"], capsys)
    lines = text.strip().split("\n")
    assert lines[0] == "export VLLM_PLUGINS=lora_filesystem_resolver,agentspec"
    words = shlex.split(" ".join(line.rstrip("\\") for line in lines[1:]))
    assert words[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(words, "--model") == "my model"
    assert json.loads(flag(words, "--additional-config")) == {"agentspec": {"alpha": 0.5}}
    assert json.loads(flag(words, "--speculative-config"))["model"] == PROPOSER_CLASS


def test_args_and_env_formats(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "agentspec")
    words = shlex.split(vllm_args(["--format", "args"], capsys))
    assert words == vllm_launch().args
    assert vllm_args(["--format", "env"], capsys).strip() == "export VLLM_PLUGINS=agentspec"


@pytest.mark.parametrize("n", [0, 129, True])
def test_bad_speculation_length_is_refused(n):
    with pytest.raises(InvalidArgumentError, match="num_speculative_tokens"):
        vllm_launch(num_speculative_tokens=n)


def test_api_key_is_never_put_in_the_config(capsys):
    parser = argparse.ArgumentParser()
    cli_vllm.add_vllm_args_arguments(parser)
    with pytest.raises(InvalidArgumentError, match="API key"):
        cli_vllm.run_vllm_args(parser.parse_args(["--set", "api_key=secret"]))


def test_bad_setting_syntax_is_a_usage_error(capsys):
    parser = argparse.ArgumentParser()
    cli_vllm.add_vllm_args_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--set", "no-equals-sign"])
    assert "KEY=VALUE" in capsys.readouterr().err


def test_serve_command_and_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = serve_args(
        [
            "--port",
            "9001",
            str(tmp_path),
            "--api-key",
            "sekrit",
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--set",
            "alpha=2",
            "--host",
            "0.0.0.0",
        ]
    )
    argv, env = cli_vllm.serve_launch(args)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(argv, "--model") == str(tmp_path)
    assert "--served-model-name" not in argv
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("0.0.0.0", "9001")
    assert argv[-3:] == ["--max-model-len", "1024", "--enforce-eager"]
    assert json.loads(flag(argv, "--additional-config")) == {"agentspec": {"alpha": 2}}
    assert "sekrit" not in argv  # the key travels in the environment only
    assert env["VLLM_API_KEY"] == "sekrit"
    assert env["VLLM_PLUGINS"] == "agentspec"


def test_serve_dry_run_hides_the_key(tmp_path, capsys):
    args = serve_args([str(tmp_path), "--api-key", "sekrit", "--dry-run", "--engine", "vllm"])
    assert cli_vllm.run_serve(args) == 0
    out = capsys.readouterr().out
    assert "sekrit" not in out
    assert "export VLLM_API_KEY='***'" in out
    assert f"--model {tmp_path}" in out


def test_serve_vllm_joins_the_fleet_through_the_workers_environment(tmp_path, capsys):
    url = "redis://fleet:pw-S3cret@10.0.0.5:6379/0"
    args = serve_args([str(tmp_path), "--redis", url, "--engine", "vllm"])
    argv, env = cli_vllm.serve_launch(args)
    assert env[cli_vllm.REDIS_URL_ENV] == url
    assert "pw-S3cret" not in " ".join(argv)  # never in vLLM's logged arguments
    args = serve_args([str(tmp_path), "--redis", url, "--engine", "vllm", "--dry-run"])
    assert cli_vllm.run_serve(args) == 0
    out = capsys.readouterr().out
    assert "pw-S3cret" not in out
    assert f"{cli_vllm.REDIS_URL_ENV}=" in out


def test_serve_vllm_refuses_fleet_tenants_and_bad_urls(tmp_path):
    args = serve_args([str(tmp_path), "--redis", "redis://h", "--fleet-tenants", "a"])
    args.engine = "vllm"
    with pytest.raises(InvalidArgumentError, match="fleet_max_tenants"):
        cli_vllm.serve_launch(args)
    with pytest.raises(InvalidArgumentError, match="redis://"):
        cli_vllm.serve_launch(serve_args([str(tmp_path), "--redis", "http://h"]))


def test_serve_bad_port(tmp_path):
    with pytest.raises(InvalidArgumentError, match="port"):
        cli_vllm.serve_launch(serve_args([str(tmp_path), "--port", "70000"]))


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this Python"
)
def test_serve_without_vllm_exits_2(tmp_path, capsys):
    args = serve_args([str(tmp_path), "--port", "9002", "--engine", "vllm"])
    assert cli_vllm.run_serve(args) == 2
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err
    assert "--engine embedded" in err


@pytest.mark.skipif(HAVE_VLLM, reason="auto picks vLLM where it is installed")
def test_serve_auto_without_vllm_picks_the_embedded_engine(tmp_path, capsys):
    args = serve_args([str(tmp_path), "--port", "9003", "--dry-run"])
    assert cli_vllm.run_serve(args) == 0
    assert "embedded engine" in capsys.readouterr().out


def test_embedded_engine_refuses_vllm_flags(tmp_path):
    args = serve_args([str(tmp_path), "--engine", "embedded", "--enforce-eager"])
    with pytest.raises(InvalidArgumentError, match="no vLLM flags other than") as exc:
        cli_vllm.run_serve(args)
    assert "--enforce-eager" in str(exc.value)
    assert "--engine vllm" in str(exc.value)


def test_serve_with_an_unusable_python_exits_2(tmp_path, capsys):
    args = serve_args([str(tmp_path), "--python", str(tmp_path / "no-python"), "--engine", "vllm"])
    assert cli_vllm.run_serve(args) == 2
    assert "cannot run" in capsys.readouterr().err


def test_launch_shell_quotes_odd_values():
    launch = VllmLaunch({"A": "x y"}, ["--flag", "it's", "--bare"])
    text = launch.shell("/opt/py thon")
    assert text.startswith("export A='x y'\n'/opt/py thon' -m ")
    body = " ".join(line.rstrip("\\") for line in text.split("\n")[1:])
    assert shlex.split(body)[3:] == ["--flag", "it's", "--bare"]
