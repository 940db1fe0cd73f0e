"""A CodeAct-style agent loop on `agentspec.AgentSpecClient` (the drop-in path).

The loop builds its own ``openai.OpenAI`` client and wraps it with
``AgentSpecClient(client=...)``; each step asks the model for one tool call
in text form (``bash``, ``str_replace``, ``finish``), runs it inside a
temporary repository and feeds the observation back.  Calls are tagged with
the run's session and the ``CodeAct`` / ``Summarize`` stages, learned with
the server's token ids and pushed to the engine::

    python -m examples.codeact                 # embedded engine, SmolLM2-135M
    python -m examples.codeact --base-url http://localhost:8000/v1 --model M

See ``README.md`` next to this file.
"""

from __future__ import annotations

from .agent import (
    FEW_SHOT,
    PIPELINE,
    STAGE_ACT,
    STAGE_SUMMARIZE,
    SYSTEM_PROMPT,
    AgentConfig,
    CodeActAgent,
    RunResult,
    Step,
    build_client,
)
from .tasks import TASKS, CheckResult, Task, diff, snapshot
from .tools import (
    STOP,
    Observation,
    PathError,
    Toolbox,
    ToolCall,
    ToolCallError,
    complete_stop,
    parse_tool_call,
)

__all__ = [
    "FEW_SHOT",
    "PIPELINE",
    "STAGE_ACT",
    "STAGE_SUMMARIZE",
    "STOP",
    "SYSTEM_PROMPT",
    "TASKS",
    "AgentConfig",
    "CheckResult",
    "CodeActAgent",
    "Observation",
    "PathError",
    "RunResult",
    "Step",
    "Task",
    "ToolCall",
    "ToolCallError",
    "Toolbox",
    "build_client",
    "complete_stop",
    "diff",
    "parse_tool_call",
    "snapshot",
]
