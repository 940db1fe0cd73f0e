"""A multi-stage text-to-SQL agent on Spider, written against `agentspec.AgentSpecClient`.

The showcase workload of agentspec: each question runs Classify, Extract,
Enrich, parallel SQL stages (with an EXPLAIN-driven SQL-fix) and Combine, each
call tagged with its session, stage and pipeline, so the agentspec shards
learn per stage.  It talks to any OpenAI-compatible server::

    python -m examples.text_to_sql --base-url http://localhost:8000/v1 --model M -n 5

See ``README.md`` next to this file.
"""

from __future__ import annotations

from .pipeline import (
    PIPELINE,
    Candidate,
    PipelineConfig,
    QuestionResult,
    StageRecord,
    Text2SQLPipeline,
    sql_stage,
)
from .spider import SchemaDatabase, SchemaError, SpiderQuestion, load_questions

__all__ = [
    "PIPELINE",
    "Candidate",
    "PipelineConfig",
    "QuestionResult",
    "SchemaDatabase",
    "SchemaError",
    "SpiderQuestion",
    "StageRecord",
    "Text2SQLPipeline",
    "load_questions",
    "sql_stage",
]
