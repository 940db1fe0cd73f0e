"""Prompt templates of the text-to-SQL pipeline and the parsers of their answers.

Each ``*_messages`` builder returns chat messages (``[{"role": ..., "content":
...}]``).  The prompts ask for outputs that are easy to parse from small
models: one word (Classify), one JSON object with fixed keys (Extract), one
``table(col, ...)`` line per table (Enrich), a fenced ```` ```sql ```` block
(SQL stages) and two labelled lines ``SQL:`` / ``ANSWER:`` (Combine).

The ``parse_*`` functions read those answers leniently (a fence missing, text
around the JSON, different case) and never raise on model output: what they
cannot read is reported as a `ParseFailure` next to a fallback value.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = [
    "DEFAULT_PROMPTS",
    "FEATURE_KEYS",
    "QUESTION_TYPES",
    "SQL_STRATEGIES",
    "CombineAnswer",
    "Message",
    "Parsed",
    "PromptSet",
    "classify_messages",
    "combine_messages",
    "enrich_messages",
    "extract_messages",
    "extract_sql",
    "fix_feedback",
    "parse_combine",
    "parse_features",
    "parse_question_type",
    "parse_schema_selection",
    "sql_messages",
]

T = TypeVar("T")

#: A chat message as sent to ``chat.completions.create``.
Message = dict[str, str]

#: The question types Classify chooses from ("other" marks an unparsable answer).
QUESTION_TYPES: tuple[str, ...] = (
    "count",
    "list",
    "lookup",
    "aggregate",
    "superlative",
    "grouping",
    "comparison",
    "set",
    "nested",
)

#: The keys of Extract's JSON object, in order, with their empty values.
FEATURE_KEYS: Mapping[str, Any] = {
    "tables": [],
    "columns": [],
    "aggregation": None,
    "filters": [],
    "ordering": None,
    "limit": None,
}

#: The prompting strategies of the parallel SQL stages (SQL1 uses the first, ...).
SQL_STRATEGIES: tuple[str, ...] = ("zero-shot", "clauses", "few-shot", "decompose")

_SQL_SYSTEM = (
    "You are an expert SQLite developer. You write one correct SQLite query for a "
    "question about a database, using only the tables and columns of its schema."
)
_FENCE_RULE = "Write the final query in a ```sql block."

# Used by the few-shot strategy before the run has answered questions of its own.
_SEED_EXAMPLES: tuple[tuple[str, str], ...] = (
    ("How many employees are there?", "SELECT count(*) FROM employee"),
    (
        "What is the name of the oldest employee in each city?",
        "SELECT city, name FROM employee AS T1 WHERE age = "
        "(SELECT max(age) FROM employee AS T2 WHERE T2.city = T1.city)",
    ),
    (
        "List the names of shops with more than 2 employees, ordered by name.",
        "SELECT T1.name FROM shop AS T1 JOIN hiring AS T2 ON T1.shop_id = T2.shop_id "
        "GROUP BY T1.shop_id HAVING count(*) > 2 ORDER BY T1.name",
    ),
)


def _user(text: str) -> Message:
    return {"role": "user", "content": text}


def _system(text: str) -> Message:
    return {"role": "system", "content": text}


def classify_messages(question: str) -> list[Message]:
    """Classify: the question's type, one word of `QUESTION_TYPES`."""
    types = ", ".join(QUESTION_TYPES)
    return [
        _system("You classify questions about databases. Answer with a single word."),
        _user(
            f"Question types: {types}.\n"
            "count = how many; list = list or show rows; lookup = one specific value; "
            "aggregate = sum/average/min/max; superlative = the most/least/top; "
            "grouping = per group or for each; comparison = more/less than; "
            "set = union/intersection/difference; nested = needs a subquery.\n\n"
            f"Question: {question}\n"
            f"Answer with exactly one word from: {types}."
        ),
    ]


def extract_messages(question: str, schema: str) -> list[Message]:
    """Extract: query features as one JSON object with the `FEATURE_KEYS`."""
    example = json.dumps(
        {
            "tables": ["singer"],
            "columns": ["singer.name", "singer.age"],
            "aggregation": "avg(singer.age)",
            "filters": ["singer.country = 'France'"],
            "ordering": None,
            "limit": None,
        }
    )
    return [
        _system("You extract the features of a database question as JSON."),
        _user(
            f"Schema:\n{schema}\n\nQuestion: {question}\n\n"
            "Answer with one JSON object with exactly these keys: "
            '"tables" (list of table names), "columns" (list of table.column), '
            '"aggregation" (string or null), "filters" (list of conditions), '
            '"ordering" (string or null), "limit" (integer or null).\n'
            f"Example: {example}"
        ),
    ]


def enrich_messages(question: str, schema: str, features: Mapping[str, Any]) -> list[Message]:
    """Enrich: the tables and columns the query needs, one ``table(col, col)`` per line."""
    return [
        _system("You select the part of a database schema needed to answer a question."),
        _user(
            f"Schema:\n{schema}\n\nQuestion: {question}\n"
            f"Extracted features: {json.dumps(dict(features))}\n\n"
            "List only the tables and columns needed to write the query (include join "
            "columns), one table per line in the form table(column, column). "
            "Write nothing else."
        ),
    ]


def _hints(question_type: str, features: Mapping[str, Any]) -> str:
    shown = {k: v for k, v in features.items() if v not in (None, [], "")}
    text = f"Question type: {question_type}."
    if shown:
        text += f"\nHints: {json.dumps(shown)}"
    return text


def sql_messages(
    strategy: str,
    question: str,
    schema: str,
    *,
    question_type: str,
    features: Mapping[str, Any],
    examples: Sequence[tuple[str, str]] = (),
) -> list[Message]:
    """One SQL stage's prompt, by strategy (one of `SQL_STRATEGIES`).

    ``examples`` (question, SQL) are the few-shot strategy's demonstrations;
    when empty it uses a few generic ones.  Raises ValueError for an unknown
    strategy.
    """
    head = f"Schema:\n{schema}\n\n{_hints(question_type, features)}\n\n"
    if strategy == "zero-shot":
        body = f"{head}Question: {question}\n\n{_FENCE_RULE}"
    elif strategy == "clauses":
        body = (
            f"{head}Question: {question}\n\n"
            "Think clause by clause, one short line each: FROM/JOIN, WHERE, "
            f"GROUP BY/HAVING, SELECT, ORDER BY/LIMIT. Then {_FENCE_RULE[0].lower()}"
            f"{_FENCE_RULE[1:]}"
        )
    elif strategy == "few-shot":
        shots = "\n\n".join(
            f"Question: {q}\n```sql\n{sql}\n```" for q, sql in (examples or _SEED_EXAMPLES)
        )
        body = f"Examples:\n\n{shots}\n\n{head}Question: {question}\n\n{_FENCE_RULE}"
    elif strategy == "decompose":
        body = (
            f"{head}Question: {question}\n\n"
            "First split the question into at most three simple sub-questions, one line "
            f"each, then combine them into one query. {_FENCE_RULE}"
        )
    else:
        raise ValueError(f"unknown SQL strategy {strategy!r}; expected one of {SQL_STRATEGIES}")
    return [_system(_SQL_SYSTEM), _user(body)]


def fix_feedback(sql: str | None, error: str, schema: str) -> str:
    """SQL-fix: the feedback turn sent after a query failed SQLite's ``EXPLAIN``."""
    what = (
        f"Your query\n```sql\n{sql}\n```\nfails in SQLite with: {error}"
        if sql
        else f"Your answer holds no SQL query ({error})."
    )
    return f"{what}\n\nThe full schema is:\n{schema}\n\nWrite the corrected query. {_FENCE_RULE}"


def combine_messages(
    question: str, schema: str, candidates: Sequence[tuple[str | None, str]]
) -> list[Message]:
    """Combine: choose or merge the candidates; ``(sql, status)`` per candidate."""
    listed = "\n\n".join(
        f"Candidate {i}: ({status})\n```sql\n{sql or '-- no query'}\n```"
        for i, (sql, status) in enumerate(candidates, 1)
    )
    return [
        _system("You review candidate SQLite queries and give the final one."),
        _user(
            f"Schema:\n{schema}\n\nQuestion: {question}\n\n{listed}\n\n"
            "Choose the best candidate, or merge them into a better query. Answer in "
            "exactly this format, two lines:\n"
            "SQL: <the final query on one line>\n"
            "ANSWER: <one sentence saying what the query returns>"
        ),
    ]


@dataclass(frozen=True)
class PromptSet:
    """The prompt builders the pipeline uses, one per stage (`DEFAULT_PROMPTS`: this module's).

    Each takes the arguments of the builder it replaces (``sql`` those of
    `sql_messages`, ``fix_feedback`` those of `fix_feedback`, ...), so a set
    fitted to one model (few-shot turns, tighter formats) can replace any of
    them; the answers are read by the same parsers.
    """

    classify: Callable[[str], list[Message]] = classify_messages
    extract: Callable[[str, str], list[Message]] = extract_messages
    enrich: Callable[[str, str, Mapping[str, Any]], list[Message]] = enrich_messages
    sql: Callable[..., list[Message]] = sql_messages
    fix_feedback: Callable[[str | None, str, str], str] = fix_feedback
    combine: Callable[[str, str, Sequence[tuple[str | None, str]]], list[Message]] = (
        combine_messages
    )


#: The pipeline's own prompts.
DEFAULT_PROMPTS = PromptSet()


# --- parsing the answers -----------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n?(.*?)(?:```|\Z)", re.DOTALL)
_SELECT_UPPER = re.compile(r"\bSELECT\b")
_SELECT_ANY = re.compile(r"\bselect\b", re.IGNORECASE)
_WITH_CTE = re.compile(r"\bWITH\s+(?:RECURSIVE\s+)?\w+\s*(?:\([^)]*\)\s*)?AS\s*\(", re.IGNORECASE)
_WORD = re.compile(r"[a-z]+")
_TABLE_LINE = re.compile(r"^\W*([\"`\[]?[\w ]+?[\"`\]]?)\s*[(:]\s*(.*?)\)?\s*$")
_LABEL = re.compile(r"^\s*\**\s*(SQL|ANSWER)\s*\**\s*:\s*(.*)$", re.IGNORECASE | re.MULTILINE)
_CHOICE = re.compile(r"^\s*(?:candidate\s*)?#?(\d+)\s*\.?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Parsed(Generic[T]):
    """A parsed answer: ``value`` (a fallback when unreadable) and what went wrong, if any."""

    value: T
    failure: str | None = None


@dataclass(frozen=True)
class CombineAnswer:
    """Combine's answer: the final query, or ``choice`` (1-based) of a candidate, + sentence."""

    sql: str | None
    answer: str | None
    choice: int | None = None


def _first_statement(sql: str) -> str:
    """``sql`` up to its first ``;`` outside quotes and comments, stripped, no ``;``."""
    quote: str | None = None
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if quote is not None:
            if c == quote:
                quote = None
        elif c in "'\"`":
            quote = c
        elif c == "-" and sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end
            continue
        elif c == ";":
            return sql[:i].strip()
        i += 1
    return sql.strip().rstrip(";").strip()


def _query_start(text: str) -> int | None:
    for pattern in (_SELECT_UPPER, _SELECT_ANY):
        starts = [m.start() for p in (pattern, _WITH_CTE) if (m := p.search(text))]
        if starts:
            return min(starts)
    return None


def extract_sql(text: str) -> str | None:
    """The first SQL query in a model answer, or None.

    A fenced block (```` ```sql ````, or any fence holding a query) wins;
    otherwise the text from the first ``SELECT`` / ``WITH x AS (`` on, up to
    a ``;``, a blank line or a fence.  Only the first statement is kept.
    """
    for m in _FENCE.finditer(text):
        lang, body = m.group(1).lower(), m.group(2)
        start = _query_start(body)
        if start is not None and lang in ("", "sql", "sqlite"):
            sql = _first_statement(body[start:])
            if sql:
                return sql
    # outside fences, but not inside a fence of another language
    text = _FENCE.sub(
        lambda m: "\n\n" if m.group(1).lower() not in ("", "sql", "sqlite") else m.group(0), text
    )
    start = _query_start(text)
    if start is None:
        return None
    rest = text[start:]
    for stop in ("\n\n", "```"):
        cut = rest.find(stop)
        if cut >= 0:
            rest = rest[:cut]
    return _first_statement(rest) or None


def parse_question_type(text: str) -> Parsed[str]:
    """Classify's answer: the first word of `QUESTION_TYPES` in it, else ``"other"``."""
    for word in _WORD.findall(text.lower()):
        for kind in QUESTION_TYPES:
            if word in (kind, kind + "s"):
                return Parsed(kind)
    return Parsed("other", f"no question type in {text[:80]!r}")


def _json_object(text: str) -> dict[str, Any] | None:
    decoder = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, m.start())
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:  # Python-style dicts (single quotes, None, True)
        try:
            obj = ast.literal_eval(text[start : end + 1])
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None
        if isinstance(obj, dict):
            return {str(k): v for k, v in obj.items()}
    return None


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value if v is not None and str(v).strip()]
    text = str(value).strip()
    return [text] if text else []


def _as_text(value: Any) -> str | None:
    if value is None or value == [] or value == "":
        return None
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or None
    return str(value)


def _as_limit(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    m = re.search(r"\d+", str(value))
    return int(m.group()) if m else None


def parse_features(text: str) -> Parsed[dict[str, Any]]:
    """Extract's answer: a dict with exactly the `FEATURE_KEYS`, values normalised.

    Lists become lists of str, ``aggregation`` / ``ordering`` a str or None,
    ``limit`` an int or None.  Missing keys get their empty value (and are
    reported); unknown keys are dropped.
    """
    obj = _json_object(text)
    empty = {k: (list(v) if isinstance(v, list) else v) for k, v in FEATURE_KEYS.items()}
    if obj is None:
        return Parsed(empty, f"no JSON object in {text[:80]!r}")
    lowered = {str(k).strip().lower(): v for k, v in obj.items()}
    features = {
        "tables": _as_list(lowered.get("tables")),
        "columns": _as_list(lowered.get("columns")),
        "aggregation": _as_text(lowered.get("aggregation")),
        "filters": _as_list(lowered.get("filters")),
        "ordering": _as_text(lowered.get("ordering")),
        "limit": _as_limit(lowered.get("limit")),
    }
    missing = [k for k in FEATURE_KEYS if k not in lowered]
    return Parsed(features, f"missing keys {missing}" if missing else None)


def _clean_name(name: str) -> str:
    """A bare name from ``"t"."c"``, ``t.c``, ``c TYPE PK``, ``[c]``, ... (the last part)."""
    words = name.strip().strip("*-").split()
    if not words:
        return ""
    return words[0].split(".")[-1].strip("\"`[]' ")


def parse_schema_selection(
    text: str, tables: Mapping[str, Sequence[str]]
) -> Parsed[dict[str, list[str] | None]]:
    """Enrich's answer: ``{table: columns}`` limited to the real ``tables``.

    ``tables`` maps each table name to its column names; names match
    case-insensitively and come back spelled as in the schema.  A table
    listed without a known column maps to None (all its columns).  Nothing
    recognisable gives an empty dict and a failure.
    """
    by_lower = {t.lower(): (t, {c.lower(): c for c in cols}) for t, cols in tables.items()}
    picked: dict[str, list[str] | None] = {}
    for line in text.splitlines():
        m = _TABLE_LINE.match(line)
        name, cols_text = (m.group(1), m.group(2)) if m else (line, "")
        hit = by_lower.get(name.strip().strip("\"`[]*' ").lower())
        if hit is None:
            continue
        table, columns = hit
        cols = [
            columns[c.lower()]
            for c in map(_clean_name, cols_text.split(","))
            if c.lower() in columns
        ]
        known = picked.get(table, [])
        if known is None or not cols:
            picked[table] = None if not cols else known
        else:
            picked[table] = known + [c for c in cols if c not in known]
    if not picked:
        return Parsed({}, f"no schema table in {text[:80]!r}")
    return Parsed(picked)


def parse_combine(text: str, candidates: int) -> Parsed[CombineAnswer]:
    """Combine's answer: ``SQL: ...`` (or a candidate number) and ``ANSWER: ...``.

    Without the ``SQL:`` label, the first query anywhere in the text is taken.
    """
    labels: dict[str, str] = {}
    spans = list(_LABEL.finditer(text))
    for i, m in enumerate(spans):
        end = spans[i + 1].start() if i + 1 < len(spans) else len(text)
        body = (m.group(2) + text[m.end() : end]).strip()
        labels.setdefault(m.group(1).upper(), body)
    answer = labels.get("ANSWER")
    answer = answer.splitlines()[0].strip() if answer else None
    sql_part = labels.get("SQL")
    problems = []
    if sql_part is not None and (choice := _CHOICE.match(sql_part)):
        number = int(choice.group(1))
        if 1 <= number <= candidates:
            return Parsed(CombineAnswer(None, answer, number), None if answer else "no ANSWER line")
    sql = extract_sql(sql_part) if sql_part is not None else None
    if sql is None:
        sql = extract_sql(text)
        problems.append("no SQL line" if sql is not None else "no SQL query")
    if answer is None:
        problems.append("no ANSWER line")
    return Parsed(CombineAnswer(sql, answer), "; ".join(problems) or None)
