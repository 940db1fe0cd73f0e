"""The demo's prompts: the text-to-SQL pipeline's stages fitted to a very small model.

The pipeline's own prompts (``examples/text_to_sql/prompts.py``) describe
each answer format in words, which larger models follow.  SmolLM2-135M does
not: asked for JSON it repeats one block until ``max_tokens``, asked for a
word it writes a sentence.  What it does follow is a pattern, so every stage
here is a short chat of worked examples -- a user turn with a schema and a
question, an assistant turn with exactly the answer -- ending in the real
question, and every answer is one line (or, for Enrich and Combine, a few),
cut by stop strings (`DEMO_STOP`).  The examples use a small database of
their own (`EXAMPLE_SCHEMA`); the SQL stages also get this run's answered
questions on the same database, as the pipeline's few-shot strategy does.

The answers are read by the pipeline's parsers; `is_feature_json` is the
demo's strict check of Extract's answer (one JSON object, exactly the keys).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from agentspec.demo._pipeline import (
    FEATURE_KEYS,
    QUESTION_TYPES,
    SQL_STRATEGIES,
    Message,
    PromptSet,
)

__all__ = [
    "DEMO_PROMPTS",
    "DEMO_STOP",
    "EXAMPLES",
    "EXAMPLE_SCHEMA",
    "WorkedExample",
    "is_feature_json",
]

#: The worked examples' database, in the pipeline's compact schema format.
EXAMPLE_SCHEMA = (
    "department(Department_ID NUMBER PK, Name TEXT, Budget NUMBER)\n"
    "employee(Employee_ID NUMBER PK, Name TEXT, Age NUMBER, City TEXT, Salary NUMBER, "
    "Department_ID NUMBER -> department.Department_ID)"
)


@dataclass(frozen=True)
class WorkedExample:
    """One question on `EXAMPLE_SCHEMA` with the answers of Classify, Extract, SQL, Combine."""

    question: str
    kind: str
    features: Mapping[str, Any]
    sql: str
    answer: str


def _features(
    tables: list[str],
    columns: list[str],
    aggregation: str | None = None,
    filters: list[str] | None = None,
    ordering: str | None = None,
    limit: int | None = None,
) -> Mapping[str, Any]:
    return MappingProxyType(
        {
            "tables": tables,
            "columns": columns,
            "aggregation": aggregation,
            "filters": filters or [],
            "ordering": ordering,
            "limit": limit,
        }
    )


#: The worked examples, in the order the prompts show them.
EXAMPLES: tuple[WorkedExample, ...] = (
    WorkedExample(
        "Show the name, city and age of every employee, oldest first.",
        "list",
        _features(["employee"], ["Name", "City", "Age"], ordering="Age DESC"),
        "SELECT Name, City, Age FROM employee ORDER BY Age DESC",
        "The name, city and age of each employee, oldest first.",
    ),
    WorkedExample(
        "What is the name of the department with the largest budget?",
        "superlative",
        _features(["department"], ["Name"], ordering="Budget DESC", limit=1),
        "SELECT Name FROM department ORDER BY Budget DESC LIMIT 1",
        "The name of the department with the largest budget.",
    ),
    WorkedExample(
        "What is the average and maximum salary of employees from 'Paris'?",
        "aggregate",
        _features(["employee"], ["Salary"], "avg, max", ["City = 'Paris'"]),
        "SELECT avg(Salary), max(Salary) FROM employee WHERE City = 'Paris'",
        "The average and the maximum salary of the employees from Paris.",
    ),
    WorkedExample(
        "How many employees work in each department?",
        "grouping",
        _features(["employee"], ["Department_ID"], "count"),
        "SELECT Department_ID, count(*) FROM employee GROUP BY Department_ID",
        "The number of employees of each department.",
    ),
    WorkedExample(
        "What are the names of the employees of the 'Sales' department?",
        "lookup",
        _features(["employee", "department"], ["Name"], filters=["department.Name = 'Sales'"]),
        "SELECT employee.Name FROM employee JOIN department "
        "ON employee.Department_ID = department.Department_ID WHERE department.Name = 'Sales'",
        "The names of the employees of the Sales department.",
    ),
    WorkedExample(
        "How many employees are there?",
        "count",
        _features(["employee"], [], "count"),
        "SELECT count(*) FROM employee",
        "The number of employees.",
    ),
)

#: Stop strings per stage (the keys of the pipeline's ``max_tokens``): every
#: answer is one line, Enrich's and Combine's end at a blank line.  The SQL
#: stages also end at an alias (`` AS ``), which the examples never use: that
#: is where this model starts repeating ``AVG(Age) AS Age, AVG(Age) AS ...``;
#: the cut query then fails ``EXPLAIN`` (and is counted so) and goes to SQL-fix.
DEMO_STOP: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "Classify": ("\n",),
        "Extract": ("\n",),
        "Enrich": ("\n\n",),
        "SQL": ("\n", ";", " AS "),
        "SQL-fix": ("\n", ";", " AS "),
        "Combine": ("\n\n",),
    }
)

_TYPES = ", ".join(t for t in QUESTION_TYPES if t in {e.kind for e in EXAMPLES} | {"comparison"})


def _user(text: str) -> Message:
    return {"role": "user", "content": text}


def _assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


def _system(text: str) -> Message:
    return {"role": "system", "content": text}


def _ask(schema: str, question: str) -> str:
    return f"Schema:\n{schema}\n\nQuestion: {question}"


def _feature_line(features: Mapping[str, Any]) -> str:
    return json.dumps({k: features.get(k, v) for k, v in FEATURE_KEYS.items()})


def classify_messages(question: str) -> list[Message]:
    """Classify: one word; the examples' questions and types, then the question.

    No system message: with one (listing the types) the model answers with
    the same type for every question.
    """
    messages: list[Message] = []
    for ex in EXAMPLES:
        messages += [_user(f"Question: {ex.question}\nType:"), _assistant(ex.kind)]
    return [*messages, _user(f"Question: {question}\nType:")]


def extract_messages(question: str, schema: str) -> list[Message]:
    """Extract: one line of JSON with the pipeline's feature keys."""
    keys = ", ".join(FEATURE_KEYS)
    messages = [_system(f"You describe a database question as one line of JSON with: {keys}.")]
    for ex in EXAMPLES:
        messages += [
            _user(_ask(EXAMPLE_SCHEMA, ex.question)),
            _assistant(_feature_line(ex.features)),
        ]
    return [*messages, _user(_ask(schema, question))]


#: Enrich's worked examples: (the database's tables, question, tables needed), on
#: several small databases -- with one, the model answers with its table names.
ENRICH_EXAMPLES: tuple[tuple[str, str, str], ...] = (
    ("department, employee, project", "How many employees are there?", "employee"),
    ("album, artist, track", "List the titles of all albums by year.", "album"),
    (
        "city, country, language",
        "What is the average population of the countries in Europe?",
        "country",
    ),
    ("customer, invoice, product", "Show the name of each product and its price.", "product"),
    (
        "album, artist, track",
        "What are the names of the artists of albums released after 2000?",
        "artist\nalbum",
    ),
    ("department, employee, project", "Which department has the largest budget?", "department"),
)


def _table_names(schema: str) -> str:
    """``a, b, c``: the table names of a compact schema (``name(columns)`` lines)."""
    names = [line.split("(", 1)[0].strip() for line in schema.splitlines() if "(" in line]
    return ", ".join(n for n in names if n)


def enrich_messages(question: str, schema: str, features: Mapping[str, Any]) -> list[Message]:
    """Enrich: the tables the query reads, one name per line (so all their columns).

    Only the table names are shown and asked for: given the columns, the
    model copies whole schema lines.  Extract's features are not shown.
    """
    del features
    messages = [_system("You name the tables a database question needs, one per line.")]
    for tables, q, answer in ENRICH_EXAMPLES:
        messages += [_user(f"Tables: {tables}\nQuestion: {q}"), _assistant(answer)]
    return [*messages, _user(f"Tables: {_table_names(schema)}\nQuestion: {question}")]


def sql_messages(
    strategy: str,
    question: str,
    schema: str,
    *,
    question_type: str,
    features: Mapping[str, Any],
    examples: Sequence[tuple[str, str]] = (),
) -> list[Message]:
    """One SQL stage: one line of SQLite.

    Every strategy shows the worked examples, then this run's answered
    questions on the schema (``examples``); "clauses" and "decompose" add
    Classify's type and Extract's tables as a hint line, "few-shot" shows
    only the answered questions when there are any.
    """
    if strategy not in SQL_STRATEGIES:
        raise ValueError(f"unknown SQL strategy {strategy!r}; expected one of {SQL_STRATEGIES}")
    messages = [_system("You answer a database question with one SQLite query on one line.")]
    if strategy != "few-shot" or not examples:
        for ex in EXAMPLES:
            messages += [_user(_ask(EXAMPLE_SCHEMA, ex.question)), _assistant(ex.sql)]
    for q, sql in examples:
        messages += [_user(_ask(schema, q)), _assistant(sql)]
    ask = _ask(schema, question)
    if strategy in ("clauses", "decompose"):
        tables = ", ".join(features.get("tables") or []) or "?"
        ask += f"\n(Type: {question_type}; tables: {tables}.)"
    return [*messages, _user(ask)]


def fix_feedback(sql: str | None, error: str, schema: str) -> str:
    """SQL-fix: the turn sent after a query failed SQLite's ``EXPLAIN``."""
    what = f"That query fails in SQLite: {error}." if sql else "That is not a SQL query."
    return f"All tables:\n{schema}\n\n{what} Answer with the corrected query on one line."


def combine_messages(
    question: str, schema: str, candidates: Sequence[tuple[str | None, str]]
) -> list[Message]:
    """Combine: the number of the best candidate and one sentence on what it returns.

    A number, not the query: copying a query back, the model repeats the
    loops some candidates end in.
    """
    n = max(1, len(candidates))
    messages = [_system("You pick the best SQLite query for a question and say what it returns.")]
    for i, ex in enumerate(EXAMPLES):
        right = i % n  # the examples show as many candidates as the question has
        shown = [
            ex.sql if k == right else EXAMPLES[(i + k + 1) % len(EXAMPLES)].sql for k in range(n)
        ]
        listed = "\n".join(
            f"Candidate {k} (passes EXPLAIN): {sql}" for k, sql in enumerate(shown, 1)
        )
        messages += [
            _user(f"{_ask(EXAMPLE_SCHEMA, ex.question)}\n\n{listed}"),
            _assistant(f"SQL: {right + 1}\nANSWER: {ex.answer}"),
        ]
    listed = "\n".join(
        f"Candidate {i} ({status}): {sql or '(no query)'}"
        for i, (sql, status) in enumerate(candidates, 1)
    )
    return [*messages, _user(f"{_ask(schema, question)}\n\n{listed}")]


#: The demo's prompt builders (`PromptSet` of the pipeline).
DEMO_PROMPTS = PromptSet(
    classify=classify_messages,
    extract=extract_messages,
    enrich=enrich_messages,
    sql=sql_messages,
    fix_feedback=fix_feedback,
    combine=combine_messages,
)


def is_feature_json(text: str | None) -> bool:
    """Whether ``text`` is one JSON object with exactly the pipeline's feature keys."""
    if text is None:
        return False
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and set(obj) == set(FEATURE_KEYS)
