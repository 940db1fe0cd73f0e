"""docs/measure.md as written: record traces from an agent, then replay them.

The documented ``record.py`` runs against ``agentspec serve smollm2-135m
--engine embedded`` (a free port instead of 8000), and the documented
``agentspec bench replay`` / ``budget`` / ``fleet`` / ``entropy`` lines run on the
file it wrote, with the small model's tokenizer.  The trace must hold what the
agent did (3 sessions, 6 calls, both stages) and the replay must have replayed
exactly those calls.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "measure.md"
READY = "agentspec serve: ready on "
KEY = "sk-measure-doc"
SERVE = [sys.executable, "-m", "agentspec", "serve", "smollm2-135m", "--engine", "embedded"]

pytestmark = pytest.mark.slow


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.M | re.S)


def _record_script() -> str:
    (script,) = [b for b in _blocks("python") if b.startswith("# record.py")]
    return script


def _bench_lines() -> list[str]:
    out = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            if line.startswith("agentspec bench "):
                out.append(line.split("#", 1)[0].strip())
    return out


def test_the_doc_has_what_the_test_runs() -> None:
    assert "trace_path=" in _record_script()
    kinds = {line.split()[2] for line in _bench_lines()}
    assert kinds == {"replay", "budget", "fleet", "entropy"}


class _Server:
    """``agentspec serve smollm2-135m --engine embedded`` on a free port."""

    def __init__(self) -> None:
        env = {**os.environ, "AGENTSPEC_API_KEY": KEY, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [*SERVE, "--port", "0", "--threads", "1"],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:
            for line in self.proc.stderr:
                self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def base_url(self, timeout: float = 180.0) -> str:
        seen = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=deadline - time.monotonic())
            except queue.Empty:
                break
            assert line is not None, f"the server exited: {seen}"
            seen.append(line)
            if line.startswith(READY):
                return line[len(READY) :].split()[0]
        raise AssertionError(f"no ready line in {timeout} s: {seen}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(30)


def test_record_then_replay_as_documented(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from agentspec.models import ensure_default_model
    from agentspec.traces import read_traces

    tokenizer = ensure_default_model() / "tokenizer.json"
    server = _Server()
    try:
        url = server.base_url()
        script = _record_script()
        assert "http://127.0.0.1:8000/v1" in script
        (tmp_path / "record.py").write_text(script.replace("http://127.0.0.1:8000/v1", url))
        env = {**os.environ, "AGENTSPEC_API_KEY": KEY, "PYTHONPATH": str(REPO)}
        subprocess.run(
            [sys.executable, "record.py"], cwd=tmp_path, env=env, check=True, timeout=240
        )
    finally:
        server.stop()

    records = list(read_traces(tmp_path / "my-traces.jsonl.gz"))
    assert [r.session for r in records] == ["task-0", "task-1", "task-2"]
    answers = [m for r in records for m in r.messages if m.role == "assistant"]
    assert len(answers) == 6
    assert {r.stage for r in records} == {"Plan"}
    assert [m.stage for m in answers if m.stage is not None] == ["SQL"] * 3
    assert {r.meta.get("pipeline") for r in records} == {"text2sql"}

    for line in _bench_lines():
        argv = shlex.split(line.replace("$TOK", str(tokenizer)))
        assert argv[:2] == ["agentspec", "bench"]
        quiet = [] if argv[2] == "entropy" else ["--quiet"]  # entropy prints no progress
        subprocess.run(
            [sys.executable, "-m", "agentspec", *argv[1:], *quiet],
            cwd=tmp_path,
            check=True,
            timeout=240,
            stdout=subprocess.DEVNULL,
        )
    (replayed,) = json.loads((tmp_path / "replay.json").read_text())["files"]
    assert replayed["counts"]["sessions"] == 3
    assert replayed["counts"]["requests"] == 6
    assert replayed["counts"]["response_tokens"] > 0
    assert set(replayed["methods"]) >= {"confidence", "stage-shards", "ngram-3-5"}
