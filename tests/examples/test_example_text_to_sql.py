"""The text-to-SQL example (examples/text_to_sql) against real local HTTP servers.

Two uses of the repository's `OpenAIServer`: its deterministic echo replies
(so every query fails EXPLAIN), and `scripted_server` below, a reply hook that
answers each stage with a scripted reply chosen from the request's
``X-AgentSpec-Stage`` header, to drive the EXPLAIN / SQL-fix / Combine paths.  The Spider schemas
come from the real trace file.
"""

from __future__ import annotations

import io
import json
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from openai_server import OpenAIServer, RecordedRequest, Reply
from prereq import requires_shared

from agentspec import AgentSpecClient

# examples/ is not part of the installed package: import it from the repository root.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from examples.text_to_sql import (  # noqa: E402
    PipelineConfig,
    SchemaDatabase,
    SchemaError,
    SpiderQuestion,
    Text2SQLPipeline,
    load_questions,
)
from examples.text_to_sql.__main__ import main, print_result  # noqa: E402
from examples.text_to_sql.prompts import (  # noqa: E402
    FEATURE_KEYS,
    extract_sql,
    parse_combine,
    parse_features,
    parse_question_type,
    parse_schema_selection,
)
from examples.text_to_sql.spider import (  # noqa: E402
    DEFAULT_TRACE,
    parse_prompt,
    split_statements,
)

pytestmark = requires_shared(Path(DEFAULT_TRACE))

SQL_STAGES = ("SQL1", "SQL2", "SQL3")
FRONT = ("Classify", "Extract", "Enrich")


# --- a scripted OpenAI-compatible server -------------------------------------------------


def scripted_server(script: Mapping[str, str], *, barrier: bool = False) -> OpenAIServer:
    """An `OpenAIServer` answering ``script[stage]``, the stage from ``X-AgentSpec-Stage``.

    A stage missing from the script answers HTTP 500.  With ``barrier``, the
    SQL1..SQL3 requests each wait (up to 10 s) until all three have arrived,
    so they only succeed when the client sends them concurrently.
    """
    gate = threading.Barrier(3, timeout=10) if barrier else None

    def reply(request: RecordedRequest) -> Reply:
        stage = stage_of(request)
        if gate is not None and stage in SQL_STAGES:
            try:
                gate.wait()
            except threading.BrokenBarrierError:
                return Reply("SQL stages did not arrive concurrently", status=500)
        text = script.get(stage)
        if text is None:
            return Reply(f"no script for stage {stage!r}", status=500)
        return Reply(text)

    return OpenAIServer(reply=reply)


def stage_of(request: RecordedRequest) -> str:
    """The stage a recorded request was tagged with ("" without the header)."""
    return request.headers.get("x-agentspec-stage", "")


def stages(srv: OpenAIServer) -> list[str]:
    """The stages of the requests ``srv`` received, in arrival order."""
    return [stage_of(r) for r in srv.requests]


def bodies(srv: OpenAIServer, stage: str) -> list[dict[str, Any]]:
    """The bodies of ``srv``'s requests for ``stage``, in arrival order."""
    return [r.body for r in srv.requests if stage_of(r) == stage]


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def questions() -> list[SpiderQuestion]:
    return load_questions(limit=None)


@pytest.fixture(scope="module")
def singer_questions(questions: list[SpiderQuestion]) -> list[SpiderQuestion]:
    return [q for q in questions if q.db_id == "concert_singer"][:3]


@pytest.fixture
def client_for() -> Iterator[Callable[..., AgentSpecClient]]:
    made: list[AgentSpecClient] = []

    def make(base_url: str, **kwargs: Any) -> AgentSpecClient:
        client = AgentSpecClient(
            base_url=base_url, api_key="test", max_retries=0, timeout=20, **kwargs
        )
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


FIX_REPLY = "```sql\nSELECT count(Singer_ID) FROM singer\n```"
GOOD_SCRIPT: dict[str, str] = {
    "Classify": "count",
    "Extract": 'Sure: {"tables": ["singer"], "columns": ["singer.Singer_ID"], '
    '"aggregation": "count(*)", "filters": [], "ordering": null, "limit": null}',
    "Enrich": "singer(Singer_ID, Name)",
    "SQL1": "```sql\nSELECT count(*) FROM singer;\n```",
    "SQL2": "FROM singer\nSELECT count(*)\n```sql\nSELECT count(*) FROM singers\n```",
    "SQL3": "I am not sure how to answer that.",
    "SQL-fix": FIX_REPLY,
    "Combine": "SQL: SELECT count(*) FROM singer\nANSWER: The number of singers.",
}


# --- the pipeline against the repository's test server --------------------------------


def test_stages_in_order_with_tags(singer_questions, client_for):
    with OpenAIServer() as srv:
        client = client_for(srv.base_url, return_token_ids=True)
        with Text2SQLPipeline(client, PipelineConfig(model="tiny")) as pipe:
            results = list(pipe.run_all(singer_questions[:2]))
        assert client.flush(10)
        requests = srv.requests
    assert len(results) == 2
    by_session: dict[str, list[str]] = {}
    for req in requests:
        assert req.path == "/v1/chat/completions"
        assert req.headers["x-agentspec-pipeline"] == "text2sql"
        stage = req.headers["x-agentspec-stage"]
        session = req.headers["x-agentspec-session"]
        xargs = req.body["vllm_xargs"]
        assert xargs["agentspec_stage"] == stage
        assert xargs["agentspec_session"] == session
        assert xargs["agentspec_pipeline"] == "text2sql"
        assert req.body["temperature"] == 0
        assert 1 <= req.body["max_tokens"] <= 384
        by_session.setdefault(session, []).append(stage)
    assert list(by_session) == [q.session for q in singer_questions[:2]]
    for stages in by_session.values():
        # the echo replies never name a real table: every SQL stage is fixed exactly once
        assert stages[:3] == list(FRONT)
        assert sorted(stages[3:-1]) == sorted([*SQL_STAGES, *["SQL-fix"] * 3])
        assert stages[-1] == "Combine"
    for res in results:
        assert [c.stage for c in res.candidates] == list(SQL_STAGES)
        assert all(c.fixed and not c.explain_ok for c in res.candidates)
        assert not res.explain_ok
        assert res.explain_error
        assert "no such table" in res.explain_error
        assert set(res.usage()) == {*FRONT, *SQL_STAGES, "SQL-fix", "Combine"}
        assert res.usage()["SQL-fix"]["completion_tokens"] == 3  # the server says 1 per call
    # every stage learned into its own shard
    shards = client.store.keys()
    assert {key[2] for key in shards} == {*FRONT, *SQL_STAGES, "SQL-fix", "Combine"}
    assert {key[1] for key in shards} == {"text2sql"}


def test_result_lists_stages_in_pipeline_order(singer_questions, client_for):
    with OpenAIServer() as srv:
        client = client_for(srv.base_url)
        with Text2SQLPipeline(client, PipelineConfig(model="tiny", n_sql=2)) as pipe:
            res = pipe.run(singer_questions[0])
    stages = [r.stage for r in res.stages]
    assert stages == [*FRONT, "SQL1", "SQL2", "SQL-fix", "SQL-fix", "Combine"]
    fixes = [r for r in res.stages if r.stage == "SQL-fix"]
    assert sorted(r.fix_of or "" for r in fixes) == ["SQL1", "SQL2"]


# --- scripted paths ----------------------------------------------------------------------


def test_parallel_sql_fix_and_combine(singer_questions, client_for):
    with scripted_server(GOOD_SCRIPT, barrier=True) as srv:
        client = client_for(srv.base_url)
        with Text2SQLPipeline(client, PipelineConfig(model="m")) as pipe:
            res = pipe.run(singer_questions[0])
        fixes = bodies(srv, "SQL-fix")
        sql_bodies = {stage_of(r): r.body for r in srv.requests if stage_of(r) in SQL_STAGES}
    # the barrier only lets the three SQL stages through when they are in flight together
    assert all(r.error is None for r in res.stages), [r.error for r in res.stages]
    assert res.question_type == "count"
    assert list(res.features) == list(FEATURE_KEYS)
    assert res.features["aggregation"] == "count(*)"
    assert res.schema_subset == "singer(Singer_ID NUMBER PK, Name TEXT)"
    c1, c2, c3 = res.candidates
    assert (c1.sql, c1.explain_ok, c1.fixed) == ("SELECT count(*) FROM singer", True, False)
    assert c2.fixed
    assert c2.first_sql == "SELECT count(*) FROM singers"
    assert c2.first_error == "no such table: singers"
    assert (c2.sql, c2.explain_ok) == ("SELECT count(Singer_ID) FROM singer", True)
    assert c3.fixed
    assert c3.first_sql is None
    assert c3.explain_ok
    assert (res.final_sql, res.final_source) == ("SELECT count(*) FROM singer", "combine")
    assert res.explain_ok
    assert res.explain_error is None
    assert res.answer == "The number of singers."
    assert res.parse_failures() == {"SQL3": "no SQL query in 'I am not sure how to answer that.'"}
    # SQL-fix continues the failing stage's conversation with the EXPLAIN error
    assert len(fixes) == 2
    bad = next(b for b in fixes if "singers" in b["messages"][-2]["content"])
    assert [m["role"] for m in bad["messages"]] == ["system", "user", "assistant", "user"]
    assert bad["messages"][-2]["content"] == GOOD_SCRIPT["SQL2"]
    assert "no such table: singers" in bad["messages"][-1]["content"]
    assert "stadium(" in bad["messages"][-1]["content"]  # the full schema comes with it
    # the SQL stages used three different prompts on the schema subset
    prompts = {json.dumps(b["messages"]) for b in sql_bodies.values()}
    assert len(prompts) == 3
    assert all("singer(Singer_ID NUMBER PK, Name TEXT)" in p for p in prompts)
    assert all("stadium(" not in p for p in prompts)
    assert res.usage()["SQL-fix"]["completion_tokens"] == 2 * len(FIX_REPLY)


def test_no_fix_without_explain_error(singer_questions, client_for):
    script = {**GOOD_SCRIPT, "SQL2": GOOD_SCRIPT["SQL1"], "SQL3": GOOD_SCRIPT["SQL1"]}
    with scripted_server(script) as srv:
        client = client_for(srv.base_url)
        with Text2SQLPipeline(client, PipelineConfig(model="m")) as pipe:
            res = pipe.run(singer_questions[0])
        assert "SQL-fix" not in stages(srv)
    assert all(c.explain_ok and not c.fixed for c in res.candidates)


def test_fix_is_tried_once_then_given_up(singer_questions, client_for):
    script = {**GOOD_SCRIPT, "SQL-fix": "```sql\nSELECT nope FROM singer\n```"}
    with scripted_server(script) as srv:
        client = client_for(srv.base_url)
        with Text2SQLPipeline(client, PipelineConfig(model="m")) as pipe:
            res = pipe.run(singer_questions[0])
        assert stages(srv).count("SQL-fix") == 2  # SQL2 and SQL3, once each
    c2 = res.candidates[1]
    assert c2.fixed
    assert not c2.explain_ok
    assert c2.explain_error == "no such column: nope"


def test_no_fix_when_disabled(singer_questions, client_for):
    with scripted_server(GOOD_SCRIPT) as srv:
        client = client_for(srv.base_url)
        with Text2SQLPipeline(client, PipelineConfig(model="m", fix=False)) as pipe:
            res = pipe.run(singer_questions[0])
        assert "SQL-fix" not in stages(srv)
    assert [c.explain_ok for c in res.candidates] == [True, False, False]


def test_combine_choice_and_vote(singer_questions, client_for):
    choice = {**GOOD_SCRIPT, "Combine": "SQL: 2\nANSWER: How many singers there are."}
    with scripted_server(choice) as srv:
        client = client_for(srv.base_url)
        with Text2SQLPipeline(client, PipelineConfig(model="m")) as pipe:
            res = pipe.run(singer_questions[0])
    assert res.final_source == "combine-choice"
    assert res.final_sql == "SELECT count(Singer_ID) FROM singer"
    broken = {**GOOD_SCRIPT, "Combine": "SQL: SELECT everything FROM nowhere\nANSWER: x."}
    with scripted_server(broken) as srv:
        client = client_for(srv.base_url)
        with Text2SQLPipeline(client, PipelineConfig(model="m")) as pipe:
            res = pipe.run(singer_questions[0])
    # SQL1 is one vote, the two fixed candidates agree: they win
    assert (res.final_source, res.explain_ok) == ("vote", True)
    assert res.final_sql == "SELECT count(Singer_ID) FROM singer"


def test_garbage_answers_are_recorded_not_raised(singer_questions, client_for):
    script: dict[str, str] = {
        "Classify": "banana",
        "Extract": "tables: singer",
        "Enrich": "I would use the people table.",
        "SQL1": "no idea",
        "SQL2": "",
        "SQL3": "```python\nprint('SELECT')\n```",
        "SQL-fix": "sorry",
        "Combine": "???",
    }
    with scripted_server(script) as srv:
        client = client_for(srv.base_url)
        with Text2SQLPipeline(client, PipelineConfig(model="m")) as pipe:
            res = pipe.run(singer_questions[0])
    assert res.question_type == "other"
    assert res.features == {
        "tables": [],
        "columns": [],
        "aggregation": None,
        "filters": [],
        "ordering": None,
        "limit": None,
    }
    assert res.schema_subset.count("(") == 4  # Enrich unreadable: the whole schema
    assert set(res.parse_failures()) == {
        "Classify",
        "Extract",
        "Enrich",
        *SQL_STAGES,
        "SQL-fix(SQL1)",
        "SQL-fix(SQL2)",
        "SQL-fix(SQL3)",
        "Combine",
    }
    assert res.final_sql is None
    assert res.final_source == "none"
    assert not res.explain_ok
    assert res.explain_error == "no final query"
    json.dumps(res.to_json())  # the result is plain JSON data


def test_request_errors_are_recorded(singer_questions, client_for):
    script = {k: v for k, v in GOOD_SCRIPT.items() if k not in ("Extract", "SQL2")}
    with scripted_server(script) as srv:
        client = client_for(srv.base_url)
        with Text2SQLPipeline(client, PipelineConfig(model="m")) as pipe:
            res = pipe.run(singer_questions[0])
    errors = {r.stage: r.error for r in res.stages if r.error}
    assert set(errors) == {"Extract", "SQL2"}
    assert "500" in (errors["Extract"] or "")
    assert res.candidates[1].sql is None
    assert not res.candidates[1].fixed
    assert res.explain_ok
    assert res.final_sql == "SELECT count(*) FROM singer"


def test_few_shot_uses_earlier_answers(singer_questions, client_for):
    with scripted_server(GOOD_SCRIPT) as srv:
        client = client_for(srv.base_url)
        with Text2SQLPipeline(client, PipelineConfig(model="m")) as pipe:
            first, second = pipe.run_all(singer_questions[:2])
        sql3 = bodies(srv, "SQL3")
    assert first.explain_ok
    shot = f"Question: {first.question}\n```sql\n{first.final_sql}\n```"
    assert shot not in sql3[0]["messages"][-1]["content"]
    assert shot in sql3[1]["messages"][-1]["content"]
    assert second.question in sql3[1]["messages"][-1]["content"]


def test_extra_body_and_reasoning_blocks(singer_questions, client_for):
    script = {
        **GOOD_SCRIPT,
        "Classify": "<think>maybe a list?</think>\ncount",
        "Combine": "<think>SQL: SELECT bad FROM nowhere",  # cut off inside its reasoning
    }
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    with scripted_server(script) as srv:
        client = client_for(srv.base_url)
        config = PipelineConfig(model="m", extra_body=extra)
        with Text2SQLPipeline(client, config) as pipe:
            res = pipe.run(singer_questions[0])
        sent = [r.body for r in srv.requests]
    assert res.question_type == "count"
    assert res.stages[0].output == "count"
    assert res.stages[-1].output == ""
    assert res.final_source == "vote"
    for body in sent:
        assert body["chat_template_kwargs"] == {"enable_thinking": False}
        assert body["vllm_xargs"]["agentspec_pipeline"] == "text2sql"


def test_config_is_checked():
    with pytest.raises(ValueError, match="n_sql"):
        PipelineConfig(model="m", n_sql=0)
    with pytest.raises(ValueError, match="unknown stages"):
        PipelineConfig(model="m", max_tokens={"SQL9": 10})
    with pytest.raises(ValueError, match="positive"):
        PipelineConfig(model="m", max_tokens={"SQL": 0})
    assert PipelineConfig(model="m", max_tokens={"Combine": 7}).max_tokens["Combine"] == 7


# --- Spider data and databases -----------------------------------------------------------


def test_databases_from_real_schemas(questions):
    first_of: dict[str, SpiderQuestion] = {}
    for q in questions:
        first_of.setdefault(q.db_id, q)
    assert len(first_of) == 20
    passed = 0
    for db_id, q in first_of.items():
        creates = [s for s in split_statements(q.schema) if s.startswith("CREATE TABLE")]
        with SchemaDatabase(q.schema) as db:
            skipped = [s for s, _ in db.skipped]
            assert len(db.tables) + len(skipped) == len(creates), db_id
            assert all("sqlite_sequence" in s for s in skipped), db_id
            for table in db.tables:
                assert db.explain(f"SELECT * FROM {table.name}").ok
            bad = db.explain(f"SELECT no_such_column_xyz FROM {db.tables[0].name}")
            assert bad.error == "no such column: no_such_column_xyz"
            passed += any(db.explain(sql).ok for sql in q.reference_sql.values())
    assert passed >= 18  # a few reference answers in the trace do not compile themselves
    world = SchemaDatabase(first_of["world_1"].schema)
    try:
        city = world.table("city")
        assert city is not None
        country_code = city.column("countrycode")
        assert country_code is not None
        assert country_code.references == ("country", "Code")
        assert world.compact_schema({"city": ["Name"]}) == (
            "city(ID NUMBER PK, Name TEXT, CountryCode TEXT -> country.Code)"
        )
    finally:
        world.close()


def test_explain_refuses_what_is_not_one_query(questions):
    with SchemaDatabase(questions[0].schema) as db:
        assert db.explain("SELECT count(*) FROM singer;").ok
        assert db.explain("-- count\nSELECT 1").ok
        assert not db.explain("").ok
        assert db.explain("DROP TABLE singer").error == (
            "not a query: it must start with SELECT or WITH"
        )
        assert not db.explain("SELECT 1; DROP TABLE singer").ok
        assert db.explain("SELECT * FROM singer").ok  # still there


def test_load_questions_and_bad_schemas(questions):
    assert len(questions) == 1034
    q = questions[0]
    assert (q.session, q.db_id, q.question) == (
        "spider-dev-0",
        "concert_singer",
        "How many singers do we have?",
    )
    assert set(q.reference_sql) == {"sql-dailsql", "sql-c3", "sql-dinsql"}
    pets = [x for x in questions if x.db_id == "pets_1"]
    assert load_questions(limit=2, offset=1, db_ids=["pets_1"]) == pets[1:3]
    assert load_questions(limit=0) == []
    with pytest.raises(SchemaError, match="no usable table"):
        SchemaDatabase("CREATE TABLE sqlite_x (a TEXT);")
    with pytest.raises(SchemaError):
        parse_prompt("just a question")
    with pytest.raises(ValueError, match="limit"):
        load_questions(limit=-1)


# --- parsers -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "sql"),
    [
        ("```sql\nSELECT a FROM t;\n```", "SELECT a FROM t"),
        ("Here:\n```\nselect a\nfrom t\n```\nDone", "select a\nfrom t"),
        ("The query is SELECT a FROM t WHERE b = ';' ; and more", "SELECT a FROM t WHERE b = ';'"),
        ("I select columns.\nSELECT a FROM t\n\nExplanation", "SELECT a FROM t"),
        ("WITH x AS (SELECT 1) SELECT * FROM x", "WITH x AS (SELECT 1) SELECT * FROM x"),
        ("```sql\n-- a; comment\nSELECT 1; SELECT 2\n```", "SELECT 1"),
        ("```python\nprint('SELECT')\n```", None),
        ("```sql\nSELECT a -- why; not\nFROM t\n```", "SELECT a -- why; not\nFROM t"),
        ("no query here, with words", None),
        ("```sql\nSELECT a FROM t", "SELECT a FROM t"),
    ],
)
def test_extract_sql(text, sql):
    assert extract_sql(text) == sql


def test_parsers_fall_back():
    assert parse_question_type("Type: Superlatives.").value == "superlative"
    assert parse_question_type("hmm").failure is not None
    feats = parse_features("{'tables': ('a',), 'limit': '3', 'extra': 1, 'ordering': None}")
    assert feats.value["tables"] == ["a"]
    assert feats.value["limit"] == 3
    assert list(feats.value) == list(FEATURE_KEYS)
    assert feats.failure is not None
    assert "columns" in feats.failure
    assert (
        parse_features(
            '```json\n{"tables": "a", "columns": [], "aggregation": ["max(x)"], '
            '"filters": [], "ordering": "x desc", "limit": 5}\n```'
        ).failure
        is None
    )
    sel = parse_schema_selection(
        '- Singer(name, "Age", bogus)\nconcert: concert_ID\nstadium\nnope(x)',
        {"singer": ["Name", "Age"], "concert": ["concert_ID"], "stadium": ["Stadium_ID"]},
    )
    assert sel.value == {"singer": ["Name", "Age"], "concert": ["concert_ID"], "stadium": None}
    combined = parse_combine("**SQL**: Candidate 3\n**ANSWER**: It counts.", 3)
    assert (combined.value.choice, combined.value.answer) == (3, "It counts.")
    loose = parse_combine("Best is\n```sql\nSELECT 1\n```", 3)
    assert loose.value.sql == "SELECT 1"
    assert loose.failure == "no SQL line; no ANSWER line"


# --- the command line --------------------------------------------------------------------


def test_command_line(tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    with OpenAIServer() as srv:
        rc = main(
            [
                "--base-url",
                srv.base_url,
                "--model",
                "m",
                "-n",
                "2",
                "--n-sql",
                "2",
                "--json",
                str(out),
                "--max-tokens",
                "Combine=50",
            ]
        )
        combine = [r for r in srv.requests if r.headers["x-agentspec-stage"] == "Combine"]
    assert rc == 0
    text = capsys.readouterr().out
    assert "== spider-dev-0 [concert_singer] How many singers do we have?" in text
    assert "SQL-fix(SQL2)" in text
    assert "== 2 questions" in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["session"] for r in rows] == ["spider-dev-0", "spider-dev-1"]
    assert {c["max_tokens"] for c in (r.body for r in combine)} == {50}
    assert main(["--base-url", "http://x/v1", "--model", "m", "--n-sql", "9"]) == 2
    assert "n_sql" in capsys.readouterr().err
    assert main(["--base-url", "http://x/v1", "--model", "m", "--extra-body", "[1]"]) == 2
    assert "JSON object" in capsys.readouterr().err


def test_print_result_handles_errors(singer_questions, client_for):
    with scripted_server({"Classify": "count"}) as srv:
        client = client_for(srv.base_url)
        with Text2SQLPipeline(client, PipelineConfig(model="m")) as pipe:
            res = pipe.run(singer_questions[0])
    buf = io.StringIO()
    print_result(res, buf)
    assert buf.getvalue().count("ERROR InternalServerError") == 6
