"""``agentspec demo``: the text-to-SQL agent with speculation off, then on, on one server.

`run_demo` runs the pipeline of ``examples/text_to_sql`` on N questions
twice per question (plain decoding, then speculative decoding with stage
shards that start empty and learn as they go), recording every call on the
wire; the result's `DemoReport` says whether the outputs were identical and
gives per-stage calls, tokens, verification steps, tokens per step and
measured wall times.  `format_table`, `write_outputs` render it.

Importing this package needs the pipeline, which ships in the source tree
(``examples/``), not in the installed package: it raises `DemoError` when
the pipeline cannot be found (see `agentspec.demo._pipeline.PIPELINE_MODULE`).
The pipeline runs with the demo's prompts (`DEMO_PROMPTS`, `DEMO_STOP`),
fitted to the small default model.
"""

from __future__ import annotations

from agentspec.demo._prompts import DEMO_PROMPTS, DEMO_STOP
from agentspec.demo._questions import BUILTIN_SCHEMAS, BuiltinQuestion, builtin_questions
from agentspec.demo._report import (
    COLUMNS,
    CallRecord,
    Check,
    DemoReport,
    Mismatch,
    QuestionTiming,
    StageSummary,
    build_report,
    compare_runs,
    format_table,
    write_chart,
    write_outputs,
)
from agentspec.demo._run import (
    DEMO_MAX_TOKENS,
    DemoConfig,
    DemoError,
    DemoResult,
    run_demo,
)

__all__ = [
    "BUILTIN_SCHEMAS",
    "COLUMNS",
    "DEMO_MAX_TOKENS",
    "DEMO_PROMPTS",
    "DEMO_STOP",
    "BuiltinQuestion",
    "CallRecord",
    "Check",
    "DemoConfig",
    "DemoError",
    "DemoReport",
    "DemoResult",
    "Mismatch",
    "QuestionTiming",
    "StageSummary",
    "build_report",
    "builtin_questions",
    "compare_runs",
    "format_table",
    "run_demo",
    "write_chart",
    "write_outputs",
]
