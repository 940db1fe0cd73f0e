"""The CodeAct loop (examples/codeact) against a scripted server and the real embedded engine.

The scripted server (the repository's `OpenAIServer` with a reply hook, below)
replies with fixed texts, in order, so the loop's paths are exercised exactly:
unparseable replies, tool errors, an escape attempt, a fix, finish, an API
error.  The engine tests run the loop on
SmolLM2-135M for a few greedy steps and check what the loop guarantees --
never what the tiny model manages: the steps ran, every call carried the
session and stage tags (on the wire, in the client's store, in the engine's
learned and pushed shards), each observation was fed back, nothing outside
the workdir changed, and two greedy runs give the same transcript.  They are
skipped (with the reason) only when the model cannot be loaded.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai_server import OpenAIServer, RecordedRequest, Reply
from prereq import missing, require_module

openai = require_module("openai")

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from agentspec import ShardStore  # noqa: E402
from examples.codeact import (  # noqa: E402
    PIPELINE,
    STAGE_ACT,
    STAGE_SUMMARIZE,
    TASKS,
    AgentConfig,
    CodeActAgent,
    RunResult,
    build_client,
)
from examples.codeact.__main__ import main  # noqa: E402

ACT_KEY = ("default", PIPELINE, STAGE_ACT)
SUM_KEY = ("default", PIPELINE, STAGE_SUMMARIZE)


# --- a scripted OpenAI-compatible server ---------------------------------------------------

SPEC_COUNTS = {"steps": 2, "drafted": 3, "accepted": 1, "speculate": True}


def scripted_server(replies: list[tuple[int, str, str]]) -> OpenAIServer:
    """An `OpenAIServer` answering ``replies`` in order: ``(status, text, finish_reason)``.

    Past the last reply it answers HTTP 500.  Every reply carries 20 prompt
    token ids and the engine's ``agentspec`` counters (`SPEC_COUNTS`).
    """
    queue = list(replies)
    lock = threading.Lock()

    def reply(request: RecordedRequest) -> Reply:
        with lock:
            if not queue:
                return Reply("script exhausted", status=500)
            status, text, finish = queue.pop(0)
        return Reply(
            text,
            status=status,
            finish_reason=finish,
            prompt_token_ids=range(1, 21),
            extra={"agentspec": SPEC_COUNTS},
        )

    return OpenAIServer(reply=reply)


def _call(name: str, **params: str) -> str:
    """A call as the server sends it: the stop string ``</function>`` already dropped."""
    inner = "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in params.items())
    return f"<function={name}>\n{inner}"


def _last_user(body: dict[str, Any]) -> str:
    return str(body["messages"][-1]["content"])


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside.txt"
    path.write_text("do not touch\n")
    return path


def test_scripted_run_feeds_errors_back_fixes_and_finishes(tmp_path: Path, outside: Path) -> None:
    task = TASKS["calc"]
    workdir = task.seed(tmp_path / "repo")
    script = [
        (200, "The bug is in add, it subtracts.", "stop"),
        (200, _call("str_replace", path="../outside.txt", old_str="do", new_str="did"), "stop"),
        (200, _call("str_replace", path="calc/ops.py", old_str="return a", new_str="x"), "stop"),
        (200, "<function=bash>\n<parameter=command>cat calc/ops.py", "length"),
        (200, _call("str_replace", path="calc/ops.py", old_str="a - b", new_str="a + b"), "stop"),
        (200, _call("bash", command="python test_calc.py"), "stop"),
        (200, _call("finish"), "stop"),
        (200, "Fixed add() to return the sum.", "stop"),
    ]
    store = ShardStore()
    with scripted_server(script) as srv, build_client(srv.base_url, store=store) as client:
        agent = CodeActAgent(client, AgentConfig(model="scripted", max_steps=10))
        result = agent.run(task, workdir, session="scripted-1")
        assert client.flush(10)
        requests = list(srv.requests)
        assert store.stats(ACT_KEY).sequences == 7
        assert store.stats(SUM_KEY).sequences == 1
    assert result.stop_reason == "finish"
    assert result.check_passed
    assert result.check_output == "OK\n[exit code 0]"
    assert "-    return a - b\n+    return a + b\n" in result.diff
    assert result.summary == "Fixed add() to return the sum."
    assert outside.read_text() == "do not touch\n"
    steps = result.steps
    assert len(steps) == 7
    assert [s.call.name if s.call else None for s in steps] == [
        None,
        "str_replace",
        "str_replace",
        None,
        "str_replace",
        "bash",
        "finish",
    ]
    assert [s.tool_error for s in steps] == [True, True, True, True, False, False, False]
    assert "no tool call found" in steps[0].observation
    assert "outside the repository" in steps[1].observation
    assert "occurs 2 times" in steps[2].observation
    assert "cut off" in steps[3].observation
    assert steps[4].reply == steps[4].raw + "</function>"  # the stop string appended back
    assert steps[5].observation == "OK\n[exit code 0]"
    assert result.parsed == 5
    assert result.tokens_per_step() == sum(s.completion_tokens or 0 for s in steps) / 14
    # Each observation went back to the model as the next request's last message,
    # after the model's own reply (stop string included).
    assert len(requests) == 8
    for step, req in zip(steps[:-1], requests[1:-1], strict=True):
        assert _last_user(req.body) == f"OBSERVATION:\n{step.observation}"
        assert req.body["messages"][-2] == {"role": "assistant", "content": step.reply}
    for i, req in enumerate(requests):
        headers, body = req.headers, req.body
        stage = STAGE_SUMMARIZE if i == 7 else STAGE_ACT
        assert headers["x-agentspec-session"] == "scripted-1"
        assert headers["x-agentspec-stage"] == stage
        assert body["vllm_xargs"]["agentspec_session"] == "scripted-1"
        assert body["vllm_xargs"]["agentspec_stage"] == stage
        assert body["vllm_xargs"]["agentspec_pipeline"] == PIPELINE
        assert body["return_token_ids"] is True
        assert body["temperature"] == 0
        assert body.get("stop") == (["</function>"] if i < 7 else None)


def test_api_errors_end_the_run_without_raising(tmp_path: Path) -> None:
    task = TASKS["greet"]
    workdir = task.seed(tmp_path / "repo")
    script = [(200, _call("bash", command="ls"), "stop"), (500, "boom", "stop")]
    with scripted_server(script) as srv, build_client(srv.base_url) as client:
        config = AgentConfig(model="scripted", max_steps=5, summarize=True)
        result = CodeActAgent(client, config).run(task, workdir)
    assert result.stop_reason == "api_error"
    assert len(result.steps) == 2
    assert result.steps[0].observation == "greet.py\ntest_greet.py\n[exit code 0]"
    assert "500" in (result.steps[1].api_error or "")
    assert result.summary is None
    assert result.summary_error is not None  # the script is exhausted
    assert not result.check_passed
    assert result.diff == ""
    assert result.session.startswith("codeact-greet-")


def test_config_is_checked() -> None:
    for bad in ({"model": ""}, {"max_steps": 0}, {"max_tokens": 0}, {"temperature": -1.0}):
        with pytest.raises(ValueError, match=r"model|max_steps|max_tokens|temperature"):
            AgentConfig(**{"model": "m", **bad})  # type: ignore[arg-type]


def test_command_line_against_a_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = [
        (200, _call("str_replace", path="stats.py", old_str="min(", new_str="max("), "stop"),
        (200, _call("finish"), "stop"),
    ]
    out = tmp_path / "runs.jsonl"
    with scripted_server(script) as srv:
        code = main(
            [
                "--base-url",
                srv.base_url,
                "--model",
                "scripted",
                "--task",
                "stats",
                "--no-summary",
                "--workdir",
                str(tmp_path / "work"),
                "--json",
                str(out),
            ]
        )
    assert code == 0
    text = capsys.readouterr().out
    assert "check passed" in text
    assert "+    return max(values)" in text
    assert "2 parsed tool calls (100%)" in text
    assert (tmp_path / "work" / "stats-1" / "stats.py").read_text().count("max(values)") == 1
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["check_passed"] is True
    assert record["steps"][0]["call"]["name"] == "str_replace"
    # A workdir that already holds the task's folder is refused.
    with scripted_server([]) as srv:
        argv = ["--base-url", srv.base_url, "--model", "m", "--task", "stats"]
        assert main([*argv, "--workdir", str(tmp_path / "work")]) == 2


# --- the real embedded engine --------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    torch = require_module("torch")
    require_module("transformers")
    from agentspec.engine import EngineOptions, EngineServer
    from agentspec.models import ModelError, ensure_default_model, load_model

    torch.set_num_threads(1)  # 2 shared cores: avoid OpenMP oversubscription
    try:
        model, tokenizer = load_model(ensure_default_model())
    except ModelError as exc:
        missing(f"the default model cannot be loaded: {exc}")
    srv = EngineServer.create(model, tokenizer, EngineOptions(default_max_tokens=64))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        srv.engine.close()


class _Wire:
    """httpx hook keeping each chat request's headers and JSON body."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []

    def __call__(self, request: Any) -> None:
        if request.url.path.endswith("/chat/completions"):
            headers = {k.lower(): v for k, v in request.headers.items()}
            self.requests.append((headers, json.loads(request.content)))


def _sequences(tree: Any) -> int:
    return 0 if tree is None else len(tree.sequence_ids())


def test_greedy_runs_on_the_engine_are_tagged_pushed_and_deterministic(
    engine: Any, tmp_path: Path, outside: Path
) -> None:
    task = TASKS["calc"]
    workdir = tmp_path / "repo"
    wire = _Wire()
    store = ShardStore()
    config = AgentConfig(
        model="smollm2-135m", max_steps=3, max_tokens=40, summary_max_tokens=16, bash_timeout=5
    )
    http = openai.DefaultHttpxClient(event_hooks={"request": [wire]})
    results: list[RunResult] = []
    with build_client(
        engine.base_url, store=store, push_to=[engine.url], http_client=http
    ) as client:
        agent = CodeActAgent(client, config)
        for run in range(2):
            shutil.rmtree(workdir, ignore_errors=True)
            task.seed(workdir)  # the same path both times: observations may name it
            results.append(agent.run(task, workdir, session=f"engine-run-{run}"))
        assert client.flush(30)
        total = sum(len(r.steps) for r in results)
        assert store.stats(ACT_KEY).sequences == total
        assert store.stats(SUM_KEY).sequences == 2
        # The engine learned the same calls under the same keys, and got the pushed shards.
        learned = engine.engine.learned_shards()
        assert _sequences(learned.get(ACT_KEY)) == total
        assert _sequences(learned.get(SUM_KEY)) == 2
        assert _sequences(engine.intake.tree(ACT_KEY)) == total
        assert _sequences(engine.intake.tree(SUM_KEY)) == 2
    first, second = results
    for result in results:
        assert result.stop_reason in ("max_steps", "finish")
        assert len(result.steps) == 3 or result.stop_reason == "finish"
        assert all(s.api_error is None for s in result.steps)
        assert all(s.spec_steps is not None and s.spec_steps >= 1 for s in result.steps)
        assert result.summary is not None
        for s in result.steps:
            if s.parse_error is not None or s.observation.startswith("ERROR"):
                assert s.tool_error
    assert first.transcript() == second.transcript()
    assert first.diff == second.diff
    assert first.summary == second.summary
    # The second run drafted from the first run's shards: fewer verification steps.
    assert sum(s.spec_steps or 0 for s in second.steps) < sum(
        s.spec_steps or 0 for s in first.steps
    )
    assert outside.read_text() == "do not touch\n"
    # On the wire: every call tagged with its run's session and its stage, and each
    # observation fed back as the next call's last message.
    per_run = [len(r.steps) + 1 for r in results]
    assert len(wire.requests) == sum(per_run)
    offset = 0
    for result, count in zip(results, per_run, strict=True):
        calls = wire.requests[offset : offset + count]
        offset += count
        for i, (headers, body) in enumerate(calls):
            stage = STAGE_SUMMARIZE if i == count - 1 else STAGE_ACT
            assert headers["x-agentspec-session"] == result.session
            assert headers["x-agentspec-stage"] == stage
            assert body["vllm_xargs"]["agentspec_session"] == result.session
            assert body["vllm_xargs"]["agentspec_stage"] == stage
            assert body["return_token_ids"] is True
        for step, (_, body) in zip(result.steps[:-1], calls[1:-1], strict=True):
            assert _last_user(body) == f"OBSERVATION:\n{step.observation}"
