"""The text-to-SQL pipeline the demo runs, imported from the source tree.

The pipeline lives in ``examples/text_to_sql`` of the source tree, outside
the installed package: `ensure_pipeline_importable` puts the repository root
on ``sys.path`` when needed (see `PIPELINE_MODULE`), and this module
re-exports what the demo uses.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from agentspec.exceptions import DemoError

__all__ = [
    "FEATURE_KEYS",
    "PIPELINE_MODULE",
    "QUESTION_TYPES",
    "SQL_STRATEGIES",
    "DemoError",
    "ExplainResult",
    "Message",
    "PipelineConfig",
    "PromptSet",
    "QuestionResult",
    "SchemaDatabase",
    "SpiderQuestion",
    "Text2SQLPipeline",
    "ensure_pipeline_importable",
    "extract_sql",
    "load_questions",
    "parse_combine",
    "parse_question_type",
    "parse_schema_selection",
]

#: Where the pipeline is imported from.  If it moves into the package
#: (``agentspec/examples/text_to_sql``), change this and the imports below.
PIPELINE_MODULE = "examples.text_to_sql"
REPO_ROOT = Path(__file__).resolve().parents[2]


def ensure_pipeline_importable() -> None:
    """Make `PIPELINE_MODULE` importable, adding the repository root to ``sys.path`` if needed.

    Raises:
        DemoError: the module is nowhere to be found (an installed package
            without the source tree's ``examples/`` folder).
    """
    try:
        if importlib.util.find_spec(PIPELINE_MODULE) is not None:
            return
    except ModuleNotFoundError:
        pass
    if (REPO_ROOT / "examples" / "text_to_sql" / "__init__.py").is_file():
        sys.path.insert(0, str(REPO_ROOT))
        importlib.invalidate_caches()
        try:
            if importlib.util.find_spec(PIPELINE_MODULE) is not None:
                return
        except ModuleNotFoundError:
            pass
    raise DemoError(
        f"the demo needs the text-to-SQL pipeline ({PIPELINE_MODULE}), which ships in the "
        "source tree, not in the installed package",
        f"run it from a checkout of agentspec (looked in {REPO_ROOT / 'examples'})",
    )


ensure_pipeline_importable()

from examples.text_to_sql import (  # noqa: E402  (needs ensure_pipeline_importable first)
    PipelineConfig,
    QuestionResult,
    SchemaDatabase,
    SpiderQuestion,
    Text2SQLPipeline,
    load_questions,
)
from examples.text_to_sql.prompts import (  # noqa: E402
    FEATURE_KEYS,
    QUESTION_TYPES,
    SQL_STRATEGIES,
    Message,
    PromptSet,
    extract_sql,
    parse_combine,
    parse_question_type,
    parse_schema_selection,
)
from examples.text_to_sql.spider import ExplainResult  # noqa: E402
