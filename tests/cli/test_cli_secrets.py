"""The Redis password stays out of argv and output: ``--redis-file``, the environment, warnings.

Every command runs as the real CLI in a subprocess (``python -m agentspec``).
``fleet status`` runs against a real ``redis-server`` with an ACL user; while
it runs (the server is stopped with SIGSTOP, so the command waits on it) the
test reads the command's ``/proc/<pid>/cmdline``.  ``serve --engine vllm``
execs a stand-in "python" that records the argv and environment vLLM would
get.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis_server import RedisServer, requires_redis_server

from agentspec._fleet.functions import load_library
from agentspec._fleet.names import tenant_acl_rules
from agentspec._util import secrets_source

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "pw-Secr3t-9f2"
TIMEOUT = 120
URL_VARS = (
    "AGENTSPEC_REDIS_URL",
    "AGENTSPEC_REDIS_URL_FILE",
    "AGENTSPEC_VLLM_REDIS_URL",
    "AGENTSPEC_VLLM_REDIS_URL_FILE",
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in URL_VARS}
    env["PYTHONPATH"] = str(ROOT)
    return {**env, **extra}


def agentspec(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentspec", *argv],
        cwd=ROOT,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def url_file(folder: Path, url: str, mode: int = 0o600, name: str = "redis-url") -> Path:
    path = folder / name
    path.write_text(f"\n  {url}  \n")
    path.chmod(mode)
    return path


@pytest.fixture(scope="module")
def server():
    """A TCP redis-server with the ACL user ``alice`` (password `PASSWORD`, tenant alice)."""
    with RedisServer(tcp=True) as srv:
        with srv.client() as admin:
            load_library(admin)  # a tenant user may only call the fleet's functions
            rules = tenant_acl_rules("alice")
            admin.execute_command("ACL", "SETUSER", "alice", "on", f">{PASSWORD}", *rules)
        yield srv


def _cmdline_once_exec_done(pid: int, timeout: float = 30.0) -> bytes:
    """``/proc/PID/cmdline`` once set: Popen returns at exec's point of no return, a
    moment before the kernel has placed the new program's arguments (empty until then)."""
    deadline = time.monotonic() + timeout
    while True:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if cmdline or time.monotonic() > deadline:
            return cmdline
        time.sleep(0.001)  # poll interval of the predicate, not a wait for a result


def _status_while_redis_waits(server, argv, env):
    """Run ``fleet status`` with Redis stopped; return (cmdline read while it ran, result)."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)  # the command blocks on its first reply
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "agentspec", "fleet", "status", *argv],
            cwd=ROOT,
            env=_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        cmdline = _cmdline_once_exec_done(child.pid)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    out, err = child.communicate(timeout=TIMEOUT)
    return cmdline, subprocess.CompletedProcess(child.args, child.returncode, out, err)


@requires_redis_server
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
@pytest.mark.parametrize("source", ["file-flag", "file-env", "env"])
def test_fleet_status_keeps_the_password_out_of_its_cmdline(server, tmp_path, source):
    url = server.url_for("alice", PASSWORD, tcp=True)
    secret = url_file(tmp_path, url)
    argv = ["--tenant", "alice"]
    env: dict[str, str] = {}
    if source == "file-flag":
        argv += ["--redis-file", str(secret)]
    elif source == "file-env":
        env["AGENTSPEC_REDIS_URL_FILE"] = str(secret)
    else:
        env["AGENTSPEC_REDIS_URL"] = url
    cmdline, result = _status_while_redis_waits(server, argv, env)
    assert b"fleet\0status\0" in cmdline, (
        cmdline,
        result,
    )  # the command's own argv, read while it ran
    assert PASSWORD.encode() not in cmdline
    assert result.returncode == 0, result.stderr
    assert "alice:***@127.0.0.1" in result.stdout
    assert PASSWORD not in result.stdout + result.stderr
    assert "warning" not in result.stderr


@requires_redis_server
def test_a_password_on_the_command_line_warns_without_showing_it(server):
    url = server.url_for("alice", PASSWORD, tcp=True)
    result = agentspec("fleet", "status", "--redis", url, "--tenant", "alice")
    assert result.returncode == 0, result.stderr  # it still works
    assert PASSWORD not in result.stdout + result.stderr
    warnings = [ln for ln in result.stderr.splitlines() if "warning" in ln]
    assert len(warnings) == 1
    assert "process list" in warnings[0]
    assert "--redis-file" in warnings[0]
    assert "$AGENTSPEC_REDIS_URL" in warnings[0]
    # a URL without a password: no warning
    result = agentspec("fleet", "status", "--redis", "redis://127.0.0.1:1/0")
    assert result.returncode == 1
    assert "warning" not in result.stderr


@requires_redis_server
def test_wrong_password_and_foreign_tenant_are_clear_errors_without_the_password(server, tmp_path):
    wrong = "pw-Wr0ng-77c"
    secret = url_file(tmp_path, server.url_for("alice", wrong, tcp=True))
    result = agentspec("fleet", "status", "--redis-file", str(secret), "--tenant", "alice")
    assert result.returncode == 1
    assert wrong not in result.stdout + result.stderr
    assert "AuthenticationError" in result.stderr
    assert "check the user and password" in result.stderr
    assert "alice:***@" in result.stderr
    assert "Traceback" not in result.stderr
    secret = url_file(tmp_path, server.url_for("alice", PASSWORD, tcp=True))
    result = agentspec("fleet", "status", "--redis-file", str(secret), "--tenant", "bob")
    assert result.returncode == 1
    assert PASSWORD not in result.stdout + result.stderr
    assert "tenant_acl_rules" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("fmt", ["shell", "env", "json", "args"])
def test_vllm_args_names_the_file_never_the_password(tmp_path, fmt):
    secret = url_file(tmp_path, f"redis://fleet:{PASSWORD}@10.0.0.5:6379/0")
    result = agentspec("vllm-args", "--redis-file", str(secret), "--format", fmt)
    assert result.returncode == 0, result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    if fmt == "json":
        env = json.loads(result.stdout)["env"]
        assert env["AGENTSPEC_VLLM_REDIS_URL_FILE"] == str(secret)
        assert "AGENTSPEC_VLLM_REDIS_URL" not in env
    elif fmt == "args":
        assert "REDIS" not in result.stdout
    else:
        assert f"export AGENTSPEC_VLLM_REDIS_URL_FILE={secret}" in result.stdout
    # the same through $AGENTSPEC_REDIS_URL_FILE
    same = agentspec("vllm-args", "--format", fmt, AGENTSPEC_REDIS_URL_FILE=str(secret))
    assert same.returncode == 0, same.stderr
    assert same.stdout == result.stdout


def test_vllm_args_refers_to_the_environment_variable(tmp_path):
    url = f"redis://fleet:{PASSWORD}@10.0.0.5:6379/0"
    result = agentspec("vllm-args", "--format", "env", AGENTSPEC_REDIS_URL=url)
    assert result.returncode == 0, result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    line = 'export AGENTSPEC_VLLM_REDIS_URL="$AGENTSPEC_REDIS_URL"'
    assert line in result.stdout.splitlines()
    # the line, run by a shell that has the variable, gives the workers the URL
    shell = subprocess.run(
        ["sh", "-c", f'{result.stdout}\nprintf %s "$AGENTSPEC_VLLM_REDIS_URL"'],
        env=_env(AGENTSPEC_REDIS_URL=url),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    )
    assert shell.stdout == url
    result = agentspec("vllm-args", "--format", "json", AGENTSPEC_REDIS_URL=url)
    assert PASSWORD not in result.stdout
    out = json.loads(result.stdout)
    assert out["env_from"] == {"AGENTSPEC_VLLM_REDIS_URL": "AGENTSPEC_REDIS_URL"}
    assert "AGENTSPEC_VLLM_REDIS_URL" not in out["env"]


def test_vllm_args_refuses_to_print_a_password_given_in_argv():
    url = f"redis://fleet:{PASSWORD}@10.0.0.5:6379/0"
    result = agentspec("vllm-args", "--redis", url)
    assert result.returncode == 2
    assert result.stdout == ""
    assert PASSWORD not in result.stderr
    assert "--redis-file" in result.stderr
    assert "Traceback" not in result.stderr
    # without a password the URL is printed as given
    result = agentspec("vllm-args", "--redis", "redis://10.0.0.5:6379/0", "--format", "env")
    assert result.returncode == 0, result.stderr
    assert "export AGENTSPEC_VLLM_REDIS_URL=redis://10.0.0.5:6379/0" in result.stdout
    assert "warning" not in result.stderr


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
@pytest.mark.parametrize("mode", [0o644, 0o604, 0o620, 0o606])
def test_a_file_other_users_can_read_or_change_is_refused(tmp_path, mode):
    secret = url_file(tmp_path, f"redis://fleet:{PASSWORD}@10.0.0.5:6379/0", mode)
    for argv, env in (
        (["--redis-file", str(secret)], {}),
        ([], {"AGENTSPEC_REDIS_URL_FILE": str(secret)}),
    ):
        result = agentspec("vllm-args", *argv, **env)
        assert result.returncode == 2
        assert result.stdout == ""
        assert PASSWORD not in result.stderr
        assert f"has mode {mode:04o}" in result.stderr
        assert f"chmod 600 {secret}" in result.stderr
        assert "Traceback" not in result.stderr


def test_the_owner_or_a_group_reader_is_accepted(tmp_path):
    for mode in (0o400, 0o600, 0o640, 0o440):
        secret = url_file(tmp_path, f"redis://fleet:{PASSWORD}@h:6379/0", mode, f"u{mode:o}")
        result = agentspec("vllm-args", "--redis-file", str(secret), "--format", "env")
        assert result.returncode == 0, (mode, result.stderr)


def test_missing_empty_and_bad_files_are_usage_errors(tmp_path):
    missing = tmp_path / "nope"
    result = agentspec("fleet", "status", "--redis-file", str(missing))
    assert result.returncode == 2
    assert f"cannot read --redis-file {missing}: No such file or directory" in result.stderr
    assert "Traceback" not in result.stderr
    result = agentspec("fleet", "status", AGENTSPEC_REDIS_URL_FILE=str(missing))
    assert result.returncode == 2
    assert "$AGENTSPEC_REDIS_URL_FILE" in result.stderr
    for text, why in (
        ("", "is empty"),
        (f"http://u:{PASSWORD}@h", "redis+sentinel:// or redis+cluster:// URL"),
        (f"redis://u:{PASSWORD}@h\nredis://u:{PASSWORD}@g", "one URL"),
    ):
        bad = tmp_path / "bad"
        bad.write_text(text)
        bad.chmod(0o600)
        result = agentspec("fleet", "status", "--redis-file", str(bad))
        assert result.returncode == 2, text
        assert why in result.stderr
        assert PASSWORD not in result.stderr
        assert "Traceback" not in result.stderr
    result = agentspec("fleet", "status", "--redis-file", str(tmp_path))  # a folder
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_two_sources_are_refused(tmp_path):
    secret = url_file(tmp_path, "redis://h:6379/0")
    result = agentspec("vllm-args", "--redis", "redis://h", "--redis-file", str(secret))
    assert result.returncode == 2
    assert "not both" in result.stderr
    result = agentspec(
        "vllm-args", AGENTSPEC_REDIS_URL="redis://h", AGENTSPEC_REDIS_URL_FILE=str(secret)
    )
    assert result.returncode == 2
    assert "not both" in result.stderr
    result = agentspec("fleet", "status")
    assert result.returncode == 2
    assert "--redis-file" in result.stderr


FAKE_PYTHON = """#!/bin/sh
# Stands in for vLLM's Python: answers serve's import check, records the exec.
if [ "$1" = "-c" ]; then echo; exit 0; fi
printf '%s\\n' "$@" > "{out}/argv"
cat /proc/$$/cmdline > "{out}/cmdline"
env > "{out}/env"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_vllm(tmp_path: Path, *argv: str, **env: str) -> tuple[str, str, dict[str, str], str]:
    """``serve --engine vllm`` with the stand-in Python: (argv, cmdline, environment, stderr)."""
    out = tmp_path / "exec"
    out.mkdir(exist_ok=True)
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON.format(out=out))
    python.chmod(stat.S_IRWXU)
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    result = agentspec(
        "serve",
        str(model),
        "--engine",
        "vllm",
        "--python",
        str(python),
        "--port",
        str(_free_port()),
        *argv,
        **env,
    )
    assert result.returncode == 0, result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    lines = (out / "env").read_text().splitlines()
    environ = dict(ln.split("=", 1) for ln in lines if "=" in ln)
    cmdline = (out / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return (out / "argv").read_text(), cmdline, environ, result.stderr


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_serve_vllm_hands_the_url_to_vllm_by_environment(tmp_path):
    url = f"redis://fleet:{PASSWORD}@10.0.0.5:6379/0"
    secret = url_file(tmp_path, url)
    # --redis-file: vLLM gets the file's path; a stale inherited URL variable is dropped
    argv, cmdline, env, err = _serve_vllm(
        tmp_path, "--redis-file", str(secret), AGENTSPEC_VLLM_REDIS_URL="redis://stale/0"
    )
    assert "warning" not in err
    assert "--speculative-config" in argv  # the recorded exec is vLLM's
    assert PASSWORD not in argv + cmdline
    assert env["AGENTSPEC_VLLM_REDIS_URL_FILE"] == str(secret)
    assert "AGENTSPEC_VLLM_REDIS_URL" not in env
    # $AGENTSPEC_REDIS_URL: the URL travels in the environment, never in argv
    argv, cmdline, env, err = _serve_vllm(tmp_path, AGENTSPEC_REDIS_URL=url)
    assert "warning" not in err
    assert PASSWORD not in argv + cmdline
    assert env["AGENTSPEC_VLLM_REDIS_URL"] == url
    # --redis with a password: works, warns once, and vLLM's argv still has no password
    argv, cmdline, env, err = _serve_vllm(tmp_path, "--redis", url)
    assert PASSWORD not in argv + cmdline
    assert env["AGENTSPEC_VLLM_REDIS_URL"] == url
    assert err.count("warning") == 1


def test_serve_warns_once_for_a_password_in_argv(tmp_path):
    url = f"redis://eng:{PASSWORD}@127.0.0.1:1/0"
    result = agentspec("serve", "smollm2-135m", "--engine", "embedded", "--dry-run", "--redis", url)
    assert result.returncode == 0, result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    assert result.stderr.count("warning") == 1
    assert "fleet: redis://eng:***@127.0.0.1:1/0" in result.stdout
    secret = url_file(tmp_path, url)
    result = agentspec(
        "serve", "smollm2-135m", "--engine", "embedded", "--dry-run", "--redis-file", str(secret)
    )
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr
    assert "fleet: redis://eng:***@127.0.0.1:1/0" in result.stdout
    assert PASSWORD not in result.stdout + result.stderr


def test_resolve_order_and_repr():
    env = {"AGENTSPEC_REDIS_URL": "redis://e/0"}
    assert secrets_source.resolve("redis://a/0", None, env).source == "argv"
    got = secrets_source.resolve(None, None, env)
    assert (got.url, got.source) == ("redis://e/0", "env")
    assert secrets_source.resolve(None, None, {}) is None
    secret = secrets_source.RedisUrl(f"redis://u:{PASSWORD}@h", "argv")
    assert PASSWORD not in repr(secret)
    assert secrets_source.has_password(f"redis://u:{PASSWORD}@h")
    assert secrets_source.has_password(f"redis://h/0?password={PASSWORD}")
    assert not secrets_source.has_password("redis://u@h/0")
    assert PASSWORD not in secrets_source.argv_password_warning()
