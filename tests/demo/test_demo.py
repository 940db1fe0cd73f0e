"""``agentspec demo``: the identity check, the report, the command line, one real run.

Most tests run the demo against a scripted OpenAI-compatible server (stdlib
``ThreadingHTTPServer``, below) that answers each pipeline stage with a fixed
text, returns token ids and the ``agentspec`` extension field, and can be
told to misbehave (change an output when speculation is on, ignore the
speculation switch, fail a stage).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prereq import missing, require_module

from agentspec._cli import demo as cli_demo
from agentspec.demo import (
    BUILTIN_SCHEMAS,
    COLUMNS,
    DEMO_MAX_TOKENS,
    CallRecord,
    Check,
    DemoConfig,
    QuestionTiming,
    build_report,
    builtin_questions,
    compare_runs,
    format_table,
    run_demo,
)
from agentspec.demo._prompts import DEMO_PROMPTS, DEMO_STOP, is_feature_json
from agentspec.demo._report import attribute_exclusive_time
from agentspec.demo._run import output_valid
from examples.text_to_sql import SchemaDatabase

SPEC_FACTOR = 4  # the scripted server's tokens per step when speculation is on

REPLIES = {
    "Classify": "count",
    "Extract": (
        '{"tables": ["book"], "columns": ["Title"], "aggregation": "count", '
        '"filters": [], "ordering": null, "limit": null}'
    ),
    "Enrich": "book(Book_ID, Title)",
    "SQL1": "```sql\nSELECT count(*) FROM book\n```",
    "SQL2": "```sql\nSELECT count(Book_ID) FROM book\n```",
    "SQL-fix": "```sql\nSELECT count(*) FROM book\n```",
    "Combine": "SQL: SELECT count(*) FROM book\nANSWER: The library has that many books.",
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})
        else:
            self._send(404, {"error": {"message": "no such route"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        xargs = body.get("vllm_xargs") or {}
        stage = xargs.get("agentspec_stage")
        speculate = xargs.get("agentspec_speculate")
        owner = self.server.owner
        with owner.lock:
            owner.requests.append(body)
        if stage is not None and stage == owner.fail_stage:
            self._send(500, {"error": {"message": "scripted failure", "type": "server_error"}})
            return
        text = {**REPLIES, **owner.replies}.get(stage, "OK")  # no stage: the warm-up call
        ids = [ord(c) for c in text]
        if speculate and stage == owner.diverge_text:
            text += " (changed)"
            ids = [ord(c) for c in text]
        if speculate and stage == owner.diverge_ids:
            ids = [*ids[:-1], 0]
        steps = math.ceil(len(ids) / SPEC_FACTOR) if speculate else len(ids)
        ext = {
            "steps": steps,
            "drafted": 8 * steps if speculate else 0,
            "accepted": len(ids) - steps,
            "speculate": bool(speculate) or owner.always_speculate,
            "cached_tokens": 4,
            # the server's own account: 10 ms prefill, 5 ms per step, 1 ms per draft
            "seconds": {
                "prefill": 0.01,
                "draft": 0.001 * steps if speculate else 0.0,
                "verify": 0.005 * steps,
                "engine": 0.01 + (0.006 if speculate else 0.005) * steps + 0.002,
            },
        }
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length" if stage in owner.capped else "stop",
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        answer = {
            "id": "chatcmpl-scripted",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model"),
            "choices": [choice],
            "usage": {"prompt_tokens": 10, "completion_tokens": len(ids), "total_tokens": 0},
        }
        if not owner.no_extension:
            answer["agentspec"] = ext
        self._send(200, answer)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: ScriptedServer


class ScriptedServer:
    """The scripted server; the attributes choose how it misbehaves."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.diverge_text: str | None = None
        self.diverge_ids: str | None = None
        self.fail_stage: str | None = None
        self.always_speculate = False
        self.no_extension = False
        self.replies: dict[str, str] = {}  # stage -> reply, over REPLIES
        self.capped: set[str] = set()  # stages answered with finish_reason "length"
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)


@pytest.fixture
def server():
    with ScriptedServer() as srv:
        yield srv


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="agentspec demo")
    cli_demo.add_arguments(parser)
    return parser.parse_args(argv)


def demo(server: ScriptedServer, tmp_path: Path, *extra: str) -> int:
    argv = ["--base-url", server.base_url, "-n", "2", "--builtin", "--out", str(tmp_path)]
    args = parse([*argv, "--quiet", *extra])
    return cli_demo.run_cli(args)


# --- against the scripted server -------------------------------------------------------------


def test_identical_runs_report_per_stage_numbers(server, tmp_path, capsys):
    assert demo(server, tmp_path, "--n-sql", "2") == 0  # with the chart
    out = capsys.readouterr().out
    assert "outputs identical" in out
    assert "Extract" in out
    assert "overall" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["identical"] is True
    assert report["mismatches"] == []
    assert report["errors"] == []
    stages = {s["stage"]: s for s in report["stages"]}
    # The library questions' query passes EXPLAIN, so no SQL-fix; stages in pipeline order.
    assert list(stages) == ["Classify", "Extract", "Enrich", "SQL1", "SQL2", "Combine"]
    for stage, s in stages.items():
        n = len(REPLIES[stage])
        assert s["calls"] == 2
        assert s["tokens"] == 2 * n
        assert s["steps_off"] == 2 * n  # plain decoding: one token per step
        assert s["steps_on"] == 2 * math.ceil(n / SPEC_FACTOR)
        assert s["tokens_per_step"] == pytest.approx(n / math.ceil(n / SPEC_FACTOR))
        assert s["seconds_off"] > 0
        assert s["seconds_on"] > 0
    assert report["overall"]["calls"] == 12
    assert report["wall_seconds"]["off"] > 0
    assert report["wall_seconds"]["on"] > 0
    assert report["speedup"] == pytest.approx(
        report["wall_seconds"]["off"] / report["wall_seconds"]["on"]
    )
    assert len(report["per_question"]) == 2
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 24
    assert all(c["token_ids"] for c in calls)
    # Every scripted reply is well formed and ends on its own.
    assert all(c["valid"] is True for c in calls)
    assert report["overall"]["capped"] == 0
    assert report["sql_explain"] == {"passed": 4, "checked": 4}
    assert report["final_explain"] == {"passed": 2, "checked": 2}
    _assert_counts_match_records(report, calls)
    _assert_table_explained(out, settled="q>=2")  # 2 questions: settled from the second
    assert f"wrote report.json, calls.jsonl, chart.png to {tmp_path}" in out or not (
        _has_matplotlib()
    )
    if _has_matplotlib():
        assert (tmp_path / "chart.png").stat().st_size > 1000
    # The baseline asked for no speculation, the other run for speculation, each on its
    # own tenant (so the "on" run never drafts from the baseline's outputs).
    tenants: dict[bool, set[str]] = {True: set(), False: set()}
    warm_up, measured = server.requests[:2], server.requests[2:]
    # two warm-up calls, speculation off then on, on a tenant of their own
    assert [b["vllm_xargs"]["agentspec_speculate"] for b in warm_up] == [False, True]
    assert {b["vllm_xargs"]["agentspec_tenant"] for b in warm_up} == {"demo-warmup"}
    for body in measured:
        xargs = body["vllm_xargs"]
        tenants[xargs["agentspec_speculate"]].add(xargs["agentspec_tenant"])
        assert body["model"] == "scripted"
        assert body["return_token_ids"] is True
        # The demo's stop strings and max_tokens of the stage ("SQL" for SQL1..n).
        stage = xargs["agentspec_stage"]
        budget = "SQL" if stage[3:].isdigit() else stage
        assert body["stop"] == list(DEMO_STOP[budget])
        assert body["max_tokens"] == DEMO_MAX_TOKENS[budget]
    assert len(tenants[True]) == len(tenants[False]) == 1
    assert tenants[True] != tenants[False]


def _assert_counts_match_records(report: dict[str, Any], calls: list[dict[str, Any]]) -> None:
    """The report's per-stage counts and uncapped speedups, recomputed from calls.jsonl."""
    on = [c for c in calls if c["run"] == "on"]
    off = {(c["question"], c["stage"], c["request_key"]): c for c in calls if c["run"] == "off"}
    rows = [*report["stages"], report["overall"]]
    for row in rows:
        recs = [c for c in on if row["stage"] in ("overall", c["stage"])]
        assert row["calls"] == len(recs)
        assert row["capped"] == sum(c["finish_reason"] == "length" for c in recs)
        assert row["valid"] == sum(c["valid"] is True for c in recs)
        pairs = [
            (off[(c["question"], c["stage"], c["request_key"])], c)
            for c in recs
            if c["finish_reason"] != "length"
            and off[(c["question"], c["stage"], c["request_key"])]["finish_reason"] != "length"
        ]
        assert row["calls_uncapped"] == len(pairs)
        t_off = sum(a["exclusive_s"] for a, _ in pairs)
        t_on = sum(b["exclusive_s"] for _, b in pairs)
        if pairs:
            assert row["speedup_uncapped"] == pytest.approx(t_off / t_on)
        else:
            assert row["speedup_uncapped"] is None
    sql = [c for c in on if c["stage"].startswith("SQL")]
    passed = sum(c["valid"] is True for c in sql)
    assert report["sql_explain"] == {"passed": passed, "checked": len(sql)}
    extract = next((s for s in report["stages"] if s["stage"] == "Extract"), None)
    if extract is not None:
        check = next(c for c in report["checks"] if c["name"].startswith("Extract outputs"))
        assert check["value"] == pytest.approx(extract["valid"] / extract["calls"])
    capped = next(c for c in report["checks"] if c["name"].startswith("calls stopped"))
    assert capped["value"] == pytest.approx(report["overall"]["capped"] / len(on))
    assert capped["ok"] == (capped["value"] <= 1 / 6)


def _assert_table_explained(out: str, settled: str) -> None:
    """The table's header names every column, and its legend explains each one."""
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("stage "))
    legend = lines[lines.index("columns:") + 1 :]
    for name, text in COLUMNS:
        shown = settled if name == "q>=N" else name
        assert shown in header
        entry = next(line for line in legend if line.split()[0] == shown)
        assert text.split()[0] in entry
    assert "uncapped" in header
    assert "on the" in next(line for line in lines if line.startswith("wall clock:"))


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_malformed_and_capped_outputs_are_counted(server, tmp_path, capsys):
    server.replies = {
        "Extract": '{"tables": ["book"], "columns": ["Title"]}',  # keys missing
        "SQL1": "```sql\nSELECT Nope FROM book\n```",  # fails EXPLAIN: SQL-fix runs
    }
    server.capped = {"Extract", "Enrich"}
    assert demo(server, tmp_path, "--no-chart") == 0  # identical outputs: the exit status
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    stages = {s["stage"]: s for s in report["stages"]}
    assert stages["Extract"]["valid"] == 0
    assert stages["Extract"]["capped"] == 2
    assert stages["Extract"]["speedup_uncapped"] is None  # every call capped
    assert stages["SQL1"]["valid"] == 0
    assert stages["SQL-fix"]["valid"] == 2
    assert stages["Combine"]["valid"] == 2
    assert report["sql_explain"] == {"passed": 2, "checked": 4}
    assert report["overall"]["capped"] == 4
    assert report["overall"]["calls_uncapped"] == report["overall"]["calls"] - 4
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    _assert_counts_match_records(report, calls)
    checks = {c["name"]: c for c in report["checks"]}
    assert not checks["calls stopped at max_tokens, fraction"]["ok"]  # 4 of 12
    assert not checks["Extract outputs that are JSON with the feature keys, fraction"]["ok"]
    assert "[MISSED] calls stopped at max_tokens, fraction: 0.33 (wanted <= 0.167)" in out
    assert "Extract outputs that are JSON with the feature keys: 0/2" in out
    assert "SQL / SQL-fix queries passing EXPLAIN: 2/4" in out
    extract_row = next(line for line in out.splitlines() if line.startswith("Extract "))
    assert extract_row.split()[1:4] == ["2", "2", "0/2"]  # calls, capped, valid
    assert extract_row.endswith(" n/a")  # no uncapped call: no uncapped speedup


def test_changed_text_is_a_mismatch(server, tmp_path, capsys):
    server.diverge_text = "Extract"
    assert demo(server, tmp_path, "--no-chart") == 1
    err = capsys.readouterr().err
    assert "MISMATCH" in err
    assert "builtin-0 Extract: output text differs" in err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["identical"] is False
    assert {m["stage"] for m in report["mismatches"]} == {"Extract"}
    assert not (tmp_path / "chart.png").exists()  # --no-chart


def test_changed_token_ids_are_a_mismatch(server, tmp_path, capsys):
    server.diverge_ids = "Combine"
    assert demo(server, tmp_path, "--no-chart") == 1
    err = capsys.readouterr().err
    assert "Combine: token ids differ" in err


def test_server_ignoring_the_switch_fails(server, tmp_path, capsys):
    server.always_speculate = True
    assert demo(server, tmp_path, "--no-chart") == 1
    assert "ignores vllm_xargs.agentspec_speculate=false" in capsys.readouterr().err


def test_failed_calls_fail_the_demo(server, tmp_path, capsys):
    server.fail_stage = "Enrich"
    assert demo(server, tmp_path, "--no-chart") == 1
    err = capsys.readouterr().err
    assert "FAILED" in err
    assert "Enrich: HTTP 500" in err


def test_time_table_says_where_the_time_went(server, tmp_path, capsys):
    assert demo(server, tmp_path, "--no-chart") == 0
    out = capsys.readouterr().out
    assert "where the time went" in out
    for name in ("prefill", "cached", "verify", "ms/step", "draft", "python", "outside"):
        assert name in out
    report = json.loads((tmp_path / "report.json").read_text())
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    for s in [*report["stages"], report["overall"]]:
        off, on = s["time_off"], s["time_on"]
        recs = [c for c in calls if s["stage"] in ("overall", c["stage"])]
        for run, t in (("off", off), ("on", on)):
            mine = [c for c in recs if c["run"] == run]
            assert t["steps"] == s[f"steps_{run}"]
            assert t["prefill"] == pytest.approx(0.01 * len(mine))
            assert t["verify"] == pytest.approx(0.005 * t["steps"])
            assert t["python"] == pytest.approx(0.002 * len(mine))
            assert t["cached_tokens"] == 4 * len(mine)
            assert t["prompt_tokens"] == 10 * len(mine)
            engine = sum(c["engine_s"] for c in mine)
            assert t["outside"] == pytest.approx(
                max(0.0, sum(c["exclusive_s"] for c in mine) - engine)
            )
        assert off["draft"] == 0.0
        assert on["draft"] == pytest.approx(0.001 * on["steps"])
    # the sentence from tokens per step to wall clock, from the overall numbers
    off, on = report["overall"]["time_off"], report["overall"]["time_on"]
    text = out.replace("\n  ", " ")
    ms_off, ms_on = (1000 * t["verify"] / t["steps"] for t in (off, on))
    tps = report["overall"]["tokens_per_step"]
    assert f"from tokens per step to wall clock: {tps:.2f} tokens per step;" in text
    assert f"a step cost {ms_on / ms_off:.2f}x a plain one" in text
    assert f"took {off['verify'] / on['verify']:.2f}x less time" in text
    engine_on = on["prefill"] + on["draft"] + on["verify"] + on["python"]
    assert f"is {100 * on['prefill'] / engine_on:.0f}% of the engine's time" in text


def test_server_without_step_counts(server, tmp_path, capsys):
    server.no_extension = True
    assert demo(server, tmp_path, "--no-chart") == 0
    captured = capsys.readouterr()
    assert "no 'agentspec' step counts" in captured.err
    assert "n/a" in captured.out
    assert "where the time went" not in captured.out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["overall"]["tokens_per_step"] is None
    assert report["overall"]["time_on"] is None
    assert not next(c for c in report["checks"] if "Extract" in c["name"])["ok"]


def test_progress_lines(server):
    stream = io.StringIO()
    config = DemoConfig(base_url=server.base_url, questions=1, builtin=True)
    result = run_demo(config, progress=stream)
    lines = stream.getvalue().splitlines()
    assert any("question 1/1, speculation off" in line for line in lines)
    assert any("question 1/1, speculation on" in line for line in lines)
    assert lines[-1].endswith("s on")
    assert result.report.identical


def test_missing_spider_trace_falls_back_to_builtin(server, tmp_path, monkeypatch):
    import agentspec.demo._run as run_module

    monkeypatch.setattr(run_module, "default_spider_paths", lambda: [tmp_path / "absent.gz"])
    result = run_demo(DemoConfig(base_url=server.base_url, questions=1))
    assert result.report.source == "built-in questions"
    assert result.report.warnings[0] == "Spider trace not found; using the built-in questions"
    assert [q.session for q in result.report.questions] == ["builtin-0"]


def test_unreachable_server(tmp_path, capsys):
    args = parse(["--base-url", "http://127.0.0.1:9/v1", "--builtin", "--out", str(tmp_path)])
    args.timeout = 5.0
    assert cli_demo.run_cli(args) == 2
    assert "cannot list the server's models" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


# --- report logic ---------------------------------------------------------------------------


def _rec(run: str, stage: str, started: float, ended: float, **kw: Any) -> CallRecord:
    defaults: dict[str, Any] = {"text": "x", "token_ids": [1], "completion_tokens": 4, "steps": 2}
    return CallRecord(
        run,
        0,
        "s0",
        stage,
        "k-" + stage,
        started=started,
        ended=ended,
        **{
            **defaults,
            **kw,
        },
    )


def test_exclusive_time_never_counts_overlap_twice():
    recs = [
        _rec("on", "SQL1", 0.0, 4.0),
        _rec("on", "SQL2", 0.0, 6.0),  # queued behind SQL1 on a one-at-a-time server
        _rec("on", "Combine", 7.0, 8.0),
        _rec("off", "SQL1", 100.0, 103.0),  # another run: its own timeline
    ]
    attribute_exclusive_time(recs)
    assert [r.exclusive_s for r in recs] == [4.0, 2.0, 1.0, 3.0]


def test_compare_runs_finds_missing_and_extra_calls():
    off = [_rec("off", "SQL1", 0, 1), _rec("off", "SQL-fix", 1, 2)]
    on = [_rec("on", "SQL1", 0, 1), _rec("on", "Combine", 1, 2)]
    found = {(m.stage, m.what) for m in compare_runs(off, on)}
    assert found == {
        ("SQL-fix", "request made only in the 'off' run"),
        ("Combine", "request made only in the 'on' run"),
    }
    timings = [QuestionTiming("s0", "db", 1.0, 1.0, "SELECT 1", "SELECT 2")]
    assert [m.stage for m in compare_runs(off[:1], on[:1], timings)] == ["final"]


def test_report_sums_and_checks():
    off = [_rec("off", "Extract", 0, 4, steps=4), _rec("off", "SQL1", 4, 8, steps=4)]
    on = [_rec("on", "Extract", 10, 11, steps=1), _rec("on", "SQL1", 11, 13, steps=2)]
    timing = QuestionTiming("s0", "db", 8.5, 3.4)
    report = build_report(off, on, [timing], model="m", server="srv", source="src", settled_from=0)
    stages = {s.stage: s for s in report.stages}
    assert stages["Extract"].tokens_per_step == 4.0
    assert stages["Extract"].speedup == 4.0
    assert stages["SQL1"].speedup == 2.0
    assert report.overall.tokens_per_step == pytest.approx(8 / 3)
    assert report.speedup == pytest.approx(8.5 / 3.4)  # the measured wall times, not the steps
    assert [c.ok for c in report.checks()] == [True, True, True, True]
    table = format_table(report)
    assert "2.50x measured speedup" in table
    assert "MISSED" not in table
    assert report.median_question_speedup == pytest.approx(2.5)
    slow = QuestionTiming("s1", "db", 2.0, 2.0)
    report.questions = [timing, slow, QuestionTiming("s2", "db", 3.0, 1.0)]
    assert report.median_question_speedup == pytest.approx(2.5)  # of 1.0, 2.5, 3.0
    report.questions = [timing, slow]
    assert report.median_question_speedup == pytest.approx(1.75)


def test_uncapped_speedup_leaves_out_capped_calls():
    off = [
        _rec("off", "Extract", 0, 4, steps=4),
        _rec("off", "SQL1", 4, 10, steps=4, finish_reason="length", valid=False),
    ]
    on = [
        _rec("on", "Extract", 10, 12, steps=1, valid=True),
        _rec("on", "SQL1", 12, 13, steps=1, finish_reason="length", valid=False),
    ]
    report = build_report(
        off,
        on,
        [QuestionTiming("s0", "db", 10, 3)],
        model="m",
        server="s",
        source="src",
        settled_from=0,
    )
    o = report.overall
    assert o.speedup == pytest.approx(10 / 3)  # all calls
    assert o.speedup_uncapped == pytest.approx(2.0)  # Extract only
    assert (o.capped, o.calls_uncapped, o.valid) == (1, 1, 1)
    assert o.tokens_per_step == pytest.approx(4.0)
    assert o.tokens_per_step_uncapped == pytest.approx(4.0)
    assert o.tokens_per_step_off == pytest.approx(1.0)
    sql = report.stage("SQL1")
    assert sql is not None
    assert sql.speedup == pytest.approx(6.0)
    assert sql.speedup_uncapped is None
    assert report.sql_explain == (0, 1)
    checks = {c.name: c for c in report.checks()}
    assert checks["calls stopped at max_tokens, fraction"].value == pytest.approx(0.5)
    assert not checks["calls stopped at max_tokens, fraction"].ok
    assert checks["Extract outputs that are JSON with the feature keys, fraction"].ok
    table = format_table(report)
    assert "model calls only: 3.33x, on the 1 uncapped calls 2.00x" in table
    assert "calls stopped at max_tokens: 1 of 2" in table


def test_check_thresholds():
    assert Check("tokens per step", 3.0, 3.0).ok
    assert not Check("wall-clock speedup", 1.0, 1.0).ok  # a speedup must exceed 1
    assert not Check("tokens per step", None, 1.0).ok
    assert Check("capped", 0.1, 0.0, 1 / 6).ok
    assert not Check("capped", 0.2, 0.0, 1 / 6).ok
    assert Check("capped", 0.2, 0.0, 1 / 6).wanted() == "<= 0.167"


# --- command line and questions -------------------------------------------------------------


def test_arguments_and_defaults():
    args = parse([])
    assert args.num_questions == cli_demo.DEFAULT_QUESTIONS == DemoConfig().questions
    assert args.out is None  # the cache folder, resolved when the demo runs
    assert args.base_url is None
    assert args.model is None
    assert args.threads is None
    args = parse(["-n", "3", "--max-tokens", "SQL=40", "--max-tokens", "Extract=64"])
    assert args.num_questions == 3
    assert dict(args.max_tokens) == {"SQL": 40, "Extract": 64}


def test_default_out_dir_is_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSPEC_CACHE", str(tmp_path / "cache"))
    assert cli_demo.default_out_dir() == tmp_path / "cache" / "demo"
    monkeypatch.delenv("AGENTSPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cli_demo.default_out_dir() == tmp_path / "xdg" / "agentspec" / "demo"


def test_demo_writes_to_the_cache_by_default(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AGENTSPEC_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    args = parse(["--base-url", server.base_url, "-n", "1", "--builtin", "--quiet", "--no-chart"])
    assert cli_demo.run_cli(args) == 0
    assert (tmp_path / "demo" / "report.json").is_file()
    assert f"to {tmp_path / 'demo'}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # nothing in the cwd


def test_gitignore_covers_the_old_output_folder():
    gitignore = Path(__file__).resolve().parents[2] / ".gitignore"
    assert "agentspec-demo-out/" in gitignore.read_text().splitlines()


@pytest.mark.parametrize(
    "argv",
    [
        ["-n", "0"],
        ["-n", "many"],
        ["--threads", "0"],
        ["--max-tokens", "Bogus=3"],
        ["--max-tokens", "SQL"],
        ["--max-tokens", "SQL=-1"],
        ["--data", "x.jsonl", "--builtin"],
    ],
)
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_bad_values_exit_2(tmp_path, capsys):
    args = parse(["--base-url", "http://127.0.0.1:9/v1", "--n-sql", "9", "--out", str(tmp_path)])
    assert cli_demo.run_cli(args) == 2
    assert "n_sql" in capsys.readouterr().err
    args = parse(["--data", str(tmp_path / "missing.jsonl.gz"), "--base-url", "http://x/v1"])
    assert cli_demo.run_cli(args) == 2
    assert "no such Spider trace file" in capsys.readouterr().err


def test_builtin_questions_build_databases():
    questions = builtin_questions()
    assert len(questions) == 12
    assert {q.db_id for q in questions} == set(BUILTIN_SCHEMAS)
    assert [q.session for q in builtin_questions(2)] == ["builtin-0", "builtin-1"]
    for schema in BUILTIN_SCHEMAS.values():
        with SchemaDatabase(schema) as db:
            assert len(db.tables) >= 3
            assert db.explain(f"SELECT count(*) FROM {db.tables[0].name}").ok
    with pytest.raises(ValueError, match="limit"):
        builtin_questions(-1)


# --- the demo's prompts and output checks ---------------------------------------------------


def test_output_checks_per_stage():
    with SchemaDatabase(BUILTIN_SCHEMAS["library"]) as db:
        assert output_valid("Classify", "count", db)
        assert not output_valid("Classify", "the count", db)
        assert output_valid("Extract", REPLIES["Extract"], db)
        assert not output_valid("Extract", REPLIES["Extract"] + "\n" + REPLIES["Extract"], db)
        assert not output_valid("Extract", '{"tables": []}', db)
        assert output_valid("Enrich", "book\nauthor", db)
        assert not output_valid("Enrich", "singer", db)
        assert output_valid("SQL1", "SELECT Title FROM book WHERE Pages > 300", db)
        assert not output_valid("SQL1", "SELECT Title FROM book WHERE Pages > 300 AND", db)
        assert not output_valid("SQL-fix", "SELECT Song FROM book", db)
        assert output_valid("Combine", "SQL: SELECT count(*) FROM book\nANSWER: x", db)
        assert not output_valid("Combine", "SQL: 1\nANSWER: x", db)  # no candidates given
        assert output_valid("SQL2", None, db) is None  # a failed call is not checked


def test_is_feature_json():
    assert is_feature_json(REPLIES["Extract"])
    assert not is_feature_json(REPLIES["Extract"][:-1])
    assert not is_feature_json('{"tables": [], "columns": [], "extra": 1}')
    assert not is_feature_json("[]")
    assert not is_feature_json(None)


def test_demo_prompts_build_chats_for_every_stage():
    from agentspec.demo._pipeline import SQL_STRATEGIES, PipelineConfig
    from agentspec.demo._prompts import EXAMPLE_SCHEMA, EXAMPLES

    PipelineConfig(model="m", prompts=DEMO_PROMPTS, stop=DEMO_STOP)  # known stages only
    with pytest.raises(ValueError, match="unknown stages"):
        PipelineConfig(model="m", stop={"Bogus": ["\n"]})
    with pytest.raises(ValueError, match="list of non-empty str"):
        PipelineConfig(model="m", stop={"SQL": "\n"})
    schema = "book(Book_ID NUMBER PK, Title TEXT)\nauthor(Author_ID NUMBER PK, Name TEXT)"
    question = "How many books are there?"
    chats = [
        DEMO_PROMPTS.classify(question),
        DEMO_PROMPTS.extract(question, schema),
        DEMO_PROMPTS.enrich(question, schema, {}),
        DEMO_PROMPTS.combine(question, schema, [("SELECT 1", "passes EXPLAIN")] * 2),
        *(
            DEMO_PROMPTS.sql(
                s,
                question,
                schema,
                question_type="count",
                features={},
                examples=[("Q?", "SELECT 2")],
            )
            for s in SQL_STRATEGIES
        ),
    ]
    for chat in chats:
        assert chat[-1]["role"] == "user"
        assert question in chat[-1]["content"]
        turns = [m["role"] for m in chat if m["role"] != "system"]
        assert turns == ["user", "assistant"] * (len(turns) // 2) + ["user"]
    assert "Tables: book, author" in chats[2][-1]["content"]
    assert "SQL: 2" in {m["content"].splitlines()[0] for m in chats[3]}  # 2 candidates shown
    assert any(m["content"] == "SELECT 2" for m in chats[4])  # answered questions shown
    with pytest.raises(ValueError, match="strategy"):
        DEMO_PROMPTS.sql("bogus", question, schema, question_type="count", features={})
    # The worked examples are right: their JSON has the keys, their SQL compiles.
    import sqlite3

    con = sqlite3.connect(":memory:")
    for line in EXAMPLE_SCHEMA.splitlines():
        name, _, cols = line.partition("(")
        columns = [c.split()[0] for c in cols.rstrip(")").split(", ")]
        con.execute(f"CREATE TABLE {name} ({', '.join(columns)})")
    for ex in EXAMPLES:
        assert ex.kind in ("count", "list", "lookup", "aggregate", "superlative", "grouping")
        assert is_feature_json(json.dumps(dict(ex.features)))
        con.execute(f"EXPLAIN {ex.sql}")
    con.close()


# --- one real run on the embedded engine ----------------------------------------------------


@pytest.mark.slow
def test_real_run_on_the_embedded_engine(tmp_path, capsys):
    require_module("torch", reason="the embedded engine needs torch (agentspec[local])")
    require_module("transformers", reason="the embedded engine needs transformers")
    from agentspec.models import ModelDownloadError, ensure_default_model

    try:
        ensure_default_model()
    except ModelDownloadError as exc:
        missing(f"cannot download the default model here: {exc}")
    argv = ["-n", "1", "--builtin", "--out", str(tmp_path), "--quiet", "--threads", "2"]
    assert cli_demo.run_cli(parse(argv)) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["identical"] is True
    assert report["server"].startswith("embedded engine")
    assert report["overall"]["steps_off"] == report["overall"]["tokens"]
    assert report["overall"]["steps_on"] <= report["overall"]["tokens"]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert all(c["valid"] is not None for c in calls)
    _assert_counts_match_records(report, calls)
    _assert_table_explained(out, settled="q>=1")
