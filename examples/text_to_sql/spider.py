"""Spider questions from the trace file, and SQLite databases built from their schemas.

The Spider trace (``spider-sql.dev.jsonl.gz`` of the development data, ``shared/data``
beside the checkout; its format is in ``shared/data/README.md``)
holds one record per dev question: the user message is the database schema as
``CREATE TABLE`` statements, a blank line and ``Question: <text>``; ``meta``
names the ``db_id``; the three assistant messages are other systems' SQL.

- `load_questions` reads the records as `SpiderQuestion`s;
- `SchemaDatabase` builds an in-memory SQLite database from a schema (empty
  tables: only the structure matters), describes it (`Table`, `compact_schema`)
  and checks a query with SQLite ``EXPLAIN`` (`explain`), which compiles the
  statement against the schema without running it.
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from agentspec.traces import TraceRecord, read_traces

__all__ = [
    "DEFAULT_TRACE",
    "Column",
    "ExplainResult",
    "SchemaDatabase",
    "SchemaError",
    "SpiderQuestion",
    "Table",
    "load_questions",
    "parse_prompt",
    "quote_identifier",
    "split_statements",
]

#: Where the development data keeps the Spider trace: ``../shared/data`` beside the checkout
#: (``python -m examples.text_to_sql --data PATH`` reads another file).
DEFAULT_TRACE = str(
    Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "spider-sql.dev.jsonl.gz"
)

_QUESTION_MARK = "\n\nQuestion: "
_PLAIN_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# SQLite's keywords (https://sqlite.org/lang_keywords.html): quoted when used as names.
_KEYWORD_TEXT = """
    ABORT ACTION ADD AFTER ALL ALTER ALWAYS ANALYZE AND AS ASC ATTACH AUTOINCREMENT BEFORE
    BEGIN BETWEEN BY CASCADE CASE CAST CHECK COLLATE COLUMN COMMIT CONFLICT CONSTRAINT CREATE
    CROSS CURRENT CURRENT_DATE CURRENT_TIME CURRENT_TIMESTAMP DATABASE DEFAULT DEFERRABLE
    DEFERRED DELETE DESC DETACH DISTINCT DO DROP EACH ELSE END ESCAPE EXCEPT EXCLUDE EXCLUSIVE
    EXISTS EXPLAIN FAIL FILTER FIRST FOLLOWING FOR FOREIGN FROM FULL GENERATED GLOB GROUP GROUPS
    HAVING IF IGNORE IMMEDIATE IN INDEX INDEXED INITIALLY INNER INSERT INSTEAD INTERSECT INTO IS
    ISNULL JOIN KEY LAST LEFT LIKE LIMIT MATCH MATERIALIZED NATURAL NO NOT NOTHING NOTNULL NULL
    NULLS OF OFFSET ON OR ORDER OTHERS OUTER OVER PARTITION PLAN PRAGMA PRECEDING PRIMARY QUERY
    RAISE RANGE RECURSIVE REFERENCES REGEXP REINDEX RELEASE RENAME REPLACE RESTRICT RETURNING
    RIGHT ROLLBACK ROW ROWS SAVEPOINT SELECT SET TABLE TEMP TEMPORARY THEN TIES TO TRANSACTION
    TRIGGER UNBOUNDED UNION UNIQUE UPDATE USING VACUUM VALUES VIEW VIRTUAL WHEN WHERE WINDOW
    WITH WITHOUT"""
_KEYWORDS = frozenset(_KEYWORD_TEXT.split())
# Leading SQL comments and whitespace, skipped before looking at the first keyword.
_LEADING_NOISE = re.compile(r"\A(?:\s+|--[^\n]*(?:\n|\Z)|/\*.*?\*/)*", re.DOTALL)


class SchemaError(ValueError):
    """A trace record or schema text that is not what the Spider trace holds."""


@dataclass(frozen=True)
class SpiderQuestion:
    """One Spider dev question with its database schema.

    ``reference_sql`` maps the trace's stages (``sql-dailsql``, ...) to the
    final SQL other systems gave; the pipeline does not see it.
    """

    session: str
    db_id: str
    question: str
    schema: str
    reference_sql: dict[str, str] = field(default_factory=dict)


def parse_prompt(text: str) -> tuple[str, str]:
    """Split a Spider user prompt into ``(schema, question)``.

    Raises `SchemaError` when the ``Question:`` line is missing.
    """
    schema, sep, question = text.rpartition(_QUESTION_MARK)
    if not sep or not schema.strip() or not question.strip():
        raise SchemaError("prompt has no 'CREATE TABLE ... \\n\\nQuestion: ...' layout")
    return schema, question.strip()


def _question_of(record: TraceRecord) -> SpiderQuestion:
    users = [m for m in record.messages if m.role == "user"]
    if not users:
        raise SchemaError(f"record {record.session!r} has no user message")
    try:
        schema, question = parse_prompt(users[0].content)
    except SchemaError as exc:
        raise SchemaError(f"record {record.session!r}: {exc}") from None
    db_id = record.meta.get("db_id")
    if not isinstance(db_id, str) or not db_id:
        raise SchemaError(f"record {record.session!r} has no meta.db_id")
    reference = {
        m.stage or record.stage: m.content for m in record.messages if m.role == "assistant"
    }
    return SpiderQuestion(record.session, db_id, question, schema, reference)


def load_questions(
    path: str | os.PathLike[str] = DEFAULT_TRACE,
    *,
    limit: int | None = None,
    offset: int = 0,
    db_ids: Iterable[str] | None = None,
) -> list[SpiderQuestion]:
    """The questions of a Spider trace file, in file order.

    ``offset`` skips that many matching questions, ``limit`` caps how many are
    returned and ``db_ids`` keeps only questions on those databases.  A record
    off the Spider layout raises `SchemaError` (trace format errors raise
    `agentspec.traces.TraceFormatError`).
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    wanted = None if db_ids is None else frozenset(db_ids)
    out: list[SpiderQuestion] = []
    skipped = 0
    if limit == 0:
        return out
    for record in read_traces(path):
        q = _question_of(record)
        if wanted is not None and q.db_id not in wanted:
            continue
        if skipped < offset:
            skipped += 1
            continue
        out.append(q)
        if limit is not None and len(out) >= limit:
            break
    return out


def split_statements(script: str) -> list[str]:
    """Split SQL text into complete statements (SQLite's own `complete_statement` test)."""
    out: list[str] = []
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            out.append(pending.strip())
            pending = ""
    if pending.strip():
        out.append(pending.strip())
    return out


def quote_identifier(name: str) -> str:
    """``name`` as an SQLite identifier: bare when plain and no keyword, else double-quoted."""
    if _PLAIN_IDENTIFIER.fullmatch(name) and name.upper() not in _KEYWORDS:
        return name
    return '"' + name.replace('"', '""') + '"'


@dataclass(frozen=True)
class Column:
    """A column of a schema table; ``references`` is ``(table, column)`` of its foreign key."""

    name: str
    type: str
    primary_key: bool = False
    references: tuple[str, str] | None = None

    def describe(self) -> str:
        """``name TYPE [PK] [-> table.column]``, as used in compact schemas."""
        parts = [quote_identifier(self.name)]
        if self.type:
            parts.append(self.type)
        if self.primary_key:
            parts.append("PK")
        if self.references is not None:
            table, column = self.references
            parts.append(f"-> {quote_identifier(table)}.{quote_identifier(column)}")
        return " ".join(parts)


@dataclass(frozen=True)
class Table:
    """A schema table and its columns, in declaration order."""

    name: str
    columns: tuple[Column, ...]

    def column(self, name: str) -> Column | None:
        """The column called ``name`` (case-insensitive, as SQLite), or None."""
        low = name.lower()
        return next((c for c in self.columns if c.name.lower() == low), None)

    def describe(self, columns: Iterable[str] | None = None) -> str:
        """``table(col TYPE PK, col TYPE -> other.col, ...)``.

        With ``columns``, only those (case-insensitive) plus the key columns
        (primary and foreign) are listed, in declaration order.
        """
        keep = None if columns is None else {c.lower() for c in columns}
        shown = [
            c.describe()
            for c in self.columns
            if keep is None or c.name.lower() in keep or c.primary_key or c.references is not None
        ]
        return f"{quote_identifier(self.name)}({', '.join(shown)})"


@dataclass(frozen=True)
class ExplainResult:
    """The outcome of `SchemaDatabase.explain`: ``ok`` or the SQLite ``error``."""

    ok: bool
    error: str | None = None


class SchemaDatabase:
    """An in-memory SQLite database with the tables of a ``CREATE TABLE`` schema.

    Statements SQLite refuses (for example a table named ``sqlite_sequence``,
    a reserved name, in Spider's ``world_1``) are left out and listed in
    `skipped` as ``(statement, error)``; a schema of which no table can be
    created raises `SchemaError`.  After building, the connection is switched
    to ``query_only``; `explain` is thread-safe.
    """

    def __init__(self, schema: str) -> None:
        """Create the tables of ``schema`` in a new in-memory database."""
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(":memory:", check_same_thread=False)
        self.skipped: list[tuple[str, str]] = []
        try:
            for statement in split_statements(schema):
                try:
                    self._conn.execute(statement)
                except sqlite3.Error as exc:
                    self.skipped.append((statement, str(exc)))
            self._conn.execute("PRAGMA query_only = ON")
            self.tables: tuple[Table, ...] = tuple(self._describe())
        except BaseException:
            self._conn.close()
            raise
        if not self.tables:
            self._conn.close()
            reasons = "; ".join(err for _, err in self.skipped) or "no CREATE TABLE statement"
            raise SchemaError(f"schema holds no usable table ({reasons})")

    def _describe(self) -> Iterator[Table]:
        names = [
            row[0]
            for row in self._conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY rowid"
            )
        ]
        for name in names:
            quoted = quote_identifier(name)
            refs = {
                str(row[3]).lower(): (row[2], row[4] if row[4] is not None else row[3])
                for row in self._conn.execute(f"PRAGMA foreign_key_list({quoted})")
            }
            columns = tuple(
                Column(row[1], row[2] or "", bool(row[5]), refs.get(str(row[1]).lower()))
                for row in self._conn.execute(f"PRAGMA table_info({quoted})")
            )
            yield Table(name, columns)

    def table(self, name: str) -> Table | None:
        """The table called ``name`` (case-insensitive, quotes allowed), or None."""
        low = name.strip().strip('"`[]').lower()
        return next((t for t in self.tables if t.name.lower() == low), None)

    def compact_schema(self, selection: Mapping[str, Sequence[str] | None] | None = None) -> str:
        """One line per table (`Table.describe`), for prompts.

        ``selection`` maps table names to the columns to show (None: all);
        tables not in it are left out.  Without it every table is shown.
        """
        if selection is None:
            return "\n".join(t.describe() for t in self.tables)
        lines = []
        for t in self.tables:
            for name, cols in selection.items():
                if name.lower() == t.name.lower():
                    lines.append(t.describe(cols))
                    break
        return "\n".join(lines)

    def explain(self, sql: str) -> ExplainResult:
        """Compile ``sql`` with ``EXPLAIN`` (nothing is run); ok or SQLite's error message.

        Only one read-only query (``SELECT`` / ``WITH`` / ``VALUES``) is
        accepted; a trailing ``;`` is fine, a second statement is an error.
        """
        text = sql.strip().rstrip(";").strip()
        if not text:
            return ExplainResult(False, "empty query")
        head = _LEADING_NOISE.sub("", text, count=1)[:6].upper()
        if not head.startswith(("SELECT", "WITH", "VALUES")):
            return ExplainResult(False, "not a query: it must start with SELECT or WITH")
        with self._lock:
            try:
                self._conn.execute("EXPLAIN " + text).fetchall()
            except (sqlite3.Error, sqlite3.Warning) as exc:
                return ExplainResult(False, str(exc))
        return ExplainResult(True)

    def close(self) -> None:
        """Close the database."""
        self._conn.close()

    def __enter__(self) -> SchemaDatabase:
        """Return the database."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """`close` the database."""
        self.close()
