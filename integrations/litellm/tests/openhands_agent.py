"""Drive a real OpenHands SDK (CodeAct) agent against an OpenAI-compatible endpoint.

Design: this is the OpenHands side of the agentspec LiteLLM integration. It
reaches agentspec by configuration only, exactly as a user would: two
OpenHands ``LLM`` objects pointing at ``--base-url`` (the agentspec engine, or
a LiteLLM proxy running the agentspec hook), one for the agent and one for the
condenser, each tagged with its stage through ``extra_headers``
(``X-AgentSpec-Stage: agent`` / ``condenser``).  OpenHands itself adds
``x-litellm-session-id: <conversation id>`` to every call.

It is sized for a tiny CPU model (SmolLM2-135M, 8192-token context): a short
inline system prompt, the terminal tool only by default (``--tools`` adds the
file editor), prompt-based tool calling (``native_tool_calling=False``), few
output tokens, no retries, and an ``LLMSummarizingCondenser`` with a tiny
``max_size`` so a condenser call happens within a few agent steps.  The model
rarely produces a valid tool call; that is fine, the point is the traffic:
whenever the agent stops, a follow-up user message keeps the conversation
going until ``--steps`` LLM calls were made.

It needs only openhands-sdk / openhands-tools and the standard library (run it
with the Python 3.12 venv that has them).  It writes a JSON summary to
``--out`` (conversation id, LLM calls per usage id and stage with prompt sizes
and latencies, event kinds, errors) and exits 0 on success, 1 when the run
failed its goals (with the reason on stderr and in the JSON), 2 on bad
arguments, 3 when the overall ``--timeout`` expired.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

# Offline-safe defaults, set before LiteLLM / OpenHands are imported: LiteLLM
# would otherwise fetch its model price map from GitHub at import time (and
# can deadlock in its retry thread when there is no network).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
os.environ.setdefault("LOG_LEVEL", "WARNING")  # OpenHands' own logger

STAGE_HEADER = "X-AgentSpec-Stage"
AGENT_STAGE = "agent"
CONDENSER_STAGE = "condenser"

#: A deliberately short system prompt: the default OpenHands prompt plus tool
#: descriptions does not leave much of an 8192-token context to a small model.
SYSTEM_PROMPT = (
    "You are a coding agent working in a Linux shell. "
    "Solve the task step by step with the tools below. "
    "Call exactly one tool per reply. When the task is done, call finish."
)

#: SmolLM2-135M does not manage to emit a valid ``<function=...>`` call even
#: when the task spells one out (tried), so with it the conversation is plain
#: message turns plus condensations; a real model also produces actions.
TASK = "Create a file named hello.txt that contains the word hello, then show it with cat."
FOLLOW_UP = "Continue with the task. Use one tool call."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="OpenAI-compatible base URL, e.g. .../v1")
    p.add_argument("--model", required=True, help="LiteLLM model name, e.g. openai/smollm2-135m")
    p.add_argument("--api-key", default="none", help="bearer token for the endpoint")
    p.add_argument("--workspace", required=True, help="directory the agent works in")
    p.add_argument("--steps", type=int, default=4, help="minimum number of LLM calls (>= 1)")
    p.add_argument("--out", required=True, help="where to write the JSON summary")
    p.add_argument(
        "--condenser",
        action="store_true",
        help="add an LLMSummarizingCondenser (stage 'condenser') and require it to run",
    )
    p.add_argument(
        "--condenser-max-size",
        type=int,
        default=4,
        help="events in the view before the condenser summarizes (default 4: fires early)",
    )
    p.add_argument(
        "--tools",
        default="terminal",
        help="comma-separated tools: terminal, file_editor (default: terminal)",
    )
    p.add_argument("--max-output-tokens", type=int, default=48, help="agent max_output_tokens")
    p.add_argument(
        "--condenser-max-output-tokens", type=int, default=32, help="condenser max_output_tokens"
    )
    p.add_argument("--llm-timeout", type=int, default=120, help="seconds per LLM call")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    p.add_argument(
        "--default-system-prompt",
        action="store_true",
        help="keep OpenHands' own system prompt instead of the short one",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.condenser_max_size < 4:
        p.error("--condenser-max-size must be >= 4 (OpenHands needs keep_first < max_size // 2)")
    if args.timeout <= 0 or args.llm_timeout <= 0:
        p.error("--timeout and --llm-timeout must be positive")
    known = {"terminal", "file_editor"}
    args.tool_names = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = sorted(set(args.tool_names) - known)
    if bad or not args.tool_names:
        p.error(f"--tools: unknown {bad or 'empty list'}; choose from {sorted(known)}")
    if not os.path.isdir(args.workspace):
        p.error(f"--workspace {args.workspace!r} is not a directory")
    return args


def make_llm(args: argparse.Namespace, stage: str, max_output_tokens: int) -> Any:
    """An OpenHands ``LLM`` for one agentspec stage (usage id == stage name)."""
    from openhands.sdk import LLM

    return LLM(
        model=args.model,
        base_url=args.base_url,
        api_key=args.api_key,
        usage_id=stage,
        extra_headers={STAGE_HEADER: stage},
        native_tool_calling=False,
        temperature=0.0,
        # LiteLLM lists reasoning_effort among the params of every openai/...
        # model, so OpenHands would treat the model as a reasoning model: send
        # reasoning_effort="high" and silently drop temperature/top_p.  The
        # overrides keep temperature=0 (greedy) on the wire.
        capability_overrides={"supports_reasoning_effort": False, "supports_sampling_params": True},
        reasoning_effort=None,
        api_mode="chat",  # the engine and vLLM serve /v1/chat/completions
        max_output_tokens=max_output_tokens,
        timeout=args.llm_timeout,
        num_retries=0,
        caching_prompt=False,
        stream=False,
        # A local model has no price; without these LiteLLM warns on every call.
        input_cost_per_token=0.0,
        output_cost_per_token=0.0,
    )


def make_tools(names: list[str]) -> list[Any]:
    """OpenHands tool specs for the requested tool names."""
    from openhands.sdk import Tool
    from openhands.tools.file_editor import FileEditorTool
    from openhands.tools.terminal import TerminalTool

    specs = {
        "terminal": Tool(name=TerminalTool.name, params={"terminal_type": "subprocess"}),
        "file_editor": Tool(name=FileEditorTool.name),
    }
    return [specs[n] for n in names]


def make_agent(args: argparse.Namespace) -> Any:
    """The CodeAct agent: agent LLM, tools, optional summarizing condenser."""
    from openhands.sdk import Agent
    from openhands.sdk.context.condenser import LLMSummarizingCondenser

    condenser = None
    if args.condenser:
        condenser = LLMSummarizingCondenser(
            llm=make_llm(args, CONDENSER_STAGE, args.condenser_max_output_tokens),
            max_size=args.condenser_max_size,
            keep_first=0,  # the system prompt event is always kept anyway
        )
    extra: dict[str, Any] = {}
    if not args.default_system_prompt:
        extra["system_prompt"] = SYSTEM_PROMPT
    return Agent(
        llm=make_llm(args, AGENT_STAGE, args.max_output_tokens),
        tools=make_tools(args.tool_names),
        include_default_tools=["FinishTool"],
        condenser=condenser,
        **extra,
    )


def llm_calls(conversation: Any) -> dict[str, dict[str, Any]]:
    """Per usage id: number of calls, prompt/completion tokens and latency of each."""
    out: dict[str, dict[str, Any]] = {}
    for usage_id, metrics in conversation.conversation_stats.usage_to_metrics.items():
        usages = list(metrics.token_usages)
        out[usage_id] = {
            "calls": len(metrics.response_latencies),
            "prompt_tokens": [u.prompt_tokens for u in usages],
            "completion_tokens": [u.completion_tokens for u in usages],
            "latency_s": [round(r.latency, 3) for r in metrics.response_latencies],
        }
    return out


def total_calls(conversation: Any) -> int:
    """LLM calls made so far, all usage ids together."""
    return sum(
        len(m.response_latencies) for m in conversation.conversation_stats.usage_to_metrics.values()
    )


def calls_of(conversation: Any, usage_id: str) -> int:
    """LLM calls made so far by the LLM with ``usage_id`` (0 if it has none yet)."""
    metrics = conversation.conversation_stats.usage_to_metrics.get(usage_id)
    return 0 if metrics is None else len(metrics.response_latencies)


def event_errors(events: list[Any]) -> list[dict[str, str]]:
    """Error events of the conversation (tool-call parse errors, iteration limits, ...)."""
    errors = []
    for ev in events:
        name = type(ev).__name__
        if "Error" in name:
            detail = getattr(ev, "detail", None) or getattr(ev, "error", None) or str(ev)
            errors.append({"kind": name, "detail": str(detail)[:500]})
    return errors


class Watchdog:
    """Writes the summary gathered so far and hard-exits (code 3) when time is up.

    OpenHands' run loop blocks in HTTP calls and tool subprocesses, so a
    cooperative stop cannot be relied on: the process itself is ended.
    """

    def __init__(self, seconds: float, out: Path, summary: dict[str, Any]) -> None:
        """Arm a timer for ``seconds``."""
        self._out, self._summary = out, summary
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._seconds = seconds

    def __enter__(self) -> Watchdog:
        """Start the timer."""
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Disarm the timer."""
        self._timer.cancel()

    def _fire(self) -> None:
        msg = f"timeout: the run did not finish within {self._seconds:g} s"
        self._summary.setdefault("errors", []).append({"kind": "Timeout", "detail": msg})
        self._summary["ok"] = False
        write_json(self._out, self._summary)
        print(f"openhands_agent: {msg}", file=sys.stderr, flush=True)
        terminate_children()
        os._exit(3)


def terminate_children() -> None:
    """SIGTERM this process's own child processes (the agent's shell), Linux only."""
    for children in Path("/proc/self/task").glob("*/children"):
        try:
            pids = [int(p) for p in children.read_text().split()]
        except (OSError, ValueError):
            continue
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, path)


def run(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    """Run the conversation, filling ``summary`` as it goes."""
    from openhands.sdk import Conversation
    from openhands.sdk.conversation.exceptions import ConversationRunError

    t0 = time.monotonic()
    agent = make_agent(args)
    conversation = Conversation(
        agent=agent,
        workspace=args.workspace,
        max_iteration_per_run=args.steps,
        stuck_detection=False,
        visualizer=None,
    )
    summary["conversation_id"] = str(conversation.id)
    try:
        message = TASK
        rounds = 0
        while total_calls(conversation) < args.steps or (
            args.condenser and calls_of(conversation, CONDENSER_STAGE) == 0
        ):
            if rounds >= 4 * args.steps:
                raise RuntimeError(f"no progress after {rounds} messages")
            rounds += 1
            conversation.send_message(message)
            message = FOLLOW_UP
            try:
                conversation.run()
            except ConversationRunError as exc:
                summary["errors"].append(
                    {"kind": "ConversationRunError", "detail": str(exc)[:1000]}
                )
                break
            summary["messages_sent"] = rounds
    finally:
        events = list(conversation.state.events)
        summary["llm_calls"] = llm_calls(conversation)
        summary["total_llm_calls"] = total_calls(conversation)
        summary["event_kinds"] = dict(Counter(type(e).__name__ for e in events))
        summary["error_events"] = event_errors(events)
        summary["execution_status"] = str(conversation.state.execution_status.value)
        summary["wall_s"] = round(time.monotonic() - t0, 2)
        conversation.close()


def check(args: argparse.Namespace, summary: dict[str, Any]) -> list[str]:
    """Why the run failed its goals (empty when it met them)."""
    problems = []
    calls = summary.get("llm_calls", {})
    if summary.get("total_llm_calls", 0) < args.steps:
        problems.append(f"only {summary.get('total_llm_calls', 0)} LLM calls, wanted {args.steps}")
    if calls.get(AGENT_STAGE, {}).get("calls", 0) == 0:
        problems.append("the agent LLM was never called")
    if args.condenser and calls.get(CONDENSER_STAGE, {}).get("calls", 0) == 0:
        problems.append("the condenser LLM was never called")
    if summary["errors"]:
        problems.append(f"the conversation failed: {summary['errors'][0]['detail'][:300]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = parse_args(argv)
    out = Path(args.out)
    summary: dict[str, Any] = {
        "ok": False,
        "base_url": args.base_url,
        "model": args.model,
        "tools": args.tool_names,
        "condenser": args.condenser,
        "stage_headers": {
            usage_id: {STAGE_HEADER: usage_id}
            for usage_id in (AGENT_STAGE, CONDENSER_STAGE)
            if usage_id == AGENT_STAGE or args.condenser
        },
        "errors": [],
    }
    with Watchdog(args.timeout, out, summary):
        try:
            run(args, summary)
        except Exception as exc:  # reported in the JSON and on stderr, exit 1
            summary["errors"].append({"kind": type(exc).__name__, "detail": str(exc)[:1000]})
            summary["problems"] = [f"{type(exc).__name__}: {exc}"]
            write_json(out, summary)
            print(f"openhands_agent: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        problems = check(args, summary)
        summary["ok"] = not problems
        summary["problems"] = problems
        write_json(out, summary)
    if problems:
        print("openhands_agent: failed: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(
        f"openhands_agent: ok: {summary['total_llm_calls']} LLM calls "
        f"{ {k: v['calls'] for k, v in summary['llm_calls'].items()} } in {summary['wall_s']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
