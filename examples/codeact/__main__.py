"""``python -m examples.codeact``: run the CodeAct agent on the seeded tasks and report.

Without ``--base-url`` the embedded engine (agentspec's CPU engine, default
model SmolLM2-135M-Instruct) is started in this process on a free port, as
``agentspec demo`` does, and the client pushes its shards to it.  Each task
(``--task``, default all) runs ``--runs`` times, each run in a freshly seeded
repository and as its own session, all through one client and one
`ShardStore` (``--store DIR`` to keep it), so later runs speculate from
earlier ones.

Prints per run each step (tool call or parse error, tokens, verification
steps, accepted draft tokens, tokens per step, time, the observation's first
line), the check, the summary and the diff; then the totals: parse rate,
tokens per verification step, accepted drafts, wall time.

Exit status: 0 when every run got its replies, 1 when a request failed,
2 when nothing could run (bad arguments, no model, a busy workdir).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from agentspec import ShardStore

from .agent import AgentConfig, CodeActAgent, RunResult, build_client
from .tasks import TASKS

__all__ = ["main", "print_run", "print_totals"]

_DEFAULT_MODEL = "smollm2-135m"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.codeact",
        description="Run the CodeAct agent (bash + str_replace) on small seeded repositories.",
    )
    p.add_argument(
        "--base-url", metavar="URL", help="OpenAI-compatible server (.../v1); default: embedded"
    )
    p.add_argument(
        "--model",
        metavar="NAME|PATH",
        help="embedded engine: model name or HF folder (default smollm2-135m); "
        "with --base-url: the model to request (default: the server's first)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
        help="API key for --base-url (default: $OPENAI_API_KEY, else 'EMPTY')",
    )
    p.add_argument(
        "--task",
        action="append",
        choices=sorted(TASKS),
        help="task to run (repeatable; default: all)",
    )
    p.add_argument("--runs", type=_positive_int, default=1, help="runs per task (default: 1)")
    p.add_argument("--steps", type=_positive_int, default=6, help="agent steps at most (6)")
    p.add_argument("--max-tokens", type=_positive_int, default=96, help="max_tokens per step")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--no-summary", action="store_true", help="skip the Summarize call")
    p.add_argument(
        "--workdir",
        metavar="DIR",
        help="seed the repositories under DIR/<task>-<run> and keep them "
        "(default: a temporary directory, removed afterwards)",
    )
    p.add_argument("--store", metavar="DIR", help="keep the learned shards in this ShardStore")
    p.add_argument(
        "--push-to",
        action="append",
        metavar="URL",
        help="push the shards to this engine's root URL (repeatable; default: the embedded engine)",
    )
    p.add_argument("--no-push", action="store_true", help="do not push shards anywhere")
    p.add_argument("--threads", type=_positive_int, help="torch threads of the embedded engine")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--json", metavar="PATH", help="also write the run results as JSON lines")
    p.add_argument("--quiet", action="store_true", help="print only the totals")
    return p


def _start_engine(model: str, threads: int | None) -> tuple[Any, str]:
    """Start the embedded engine for ``model`` on a free port: ``(server, served name)``."""
    import torch

    from agentspec.engine import EngineOptions, EngineServer, default_threads
    from agentspec.models import load_model

    torch.set_num_threads(threads or default_threads())
    loaded, tokenizer = load_model(model)
    name = Path(model).name if Path(model).is_dir() else model
    server = EngineServer.create(loaded, tokenizer, EngineOptions(), served_model_name=name)
    return server.start(), name


def _served_model(base_url: str, api_key: str) -> str:
    import openai

    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        models = client.models.list().data
    if not models:
        raise RuntimeError(f"{base_url} lists no models; pass --model")
    return str(models[0].id)


def _first_line(text: str, width: int = 60) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


def print_run(result: RunResult, out: TextIO | None = None) -> None:
    """Print one run: its steps, check, summary and diff (to stdout by default)."""
    out = sys.stdout if out is None else out
    state = "passed" if result.check_passed else "FAILED"
    print(
        f"== {result.task} (session {result.session}): {len(result.steps)} steps, "
        f"stop: {result.stop_reason}, check {state}, {result.seconds:.1f}s",
        file=out,
    )
    print(
        f"  {'step':>4}  {'call':<12} {'tokens':>6} {'steps':>5} {'accepted':>8} "
        f"{'tok/step':>8} {'time':>6}  observation",
        file=out,
    )
    for s in result.steps:
        if s.api_error is not None:
            print(f"  {s.index:4d}  API ERROR: {s.api_error}", file=out)
            continue
        call = "PARSE ERROR" if s.call is None else s.call.name
        rate = f"{(s.completion_tokens or 0) / s.spec_steps:8.2f}" if s.spec_steps else f"{'-':>8}"
        print(
            f"  {s.index:4d}  {call:<12} {_num(s.completion_tokens):>6} {_num(s.spec_steps):>5} "
            f"{_num(s.accepted):>8} {rate} {s.seconds:5.1f}s  {_first_line(s.observation)}",
            file=out,
        )
    if result.summary is not None:
        print(f"  summary: {_first_line(result.summary, 100)}", file=out)
    elif result.summary_error is not None:
        print(f"  summary failed: {result.summary_error}", file=out)
    print(f"  check: {_first_line(result.check_output, 100)}", file=out)
    if result.diff:
        print("  diff:", file=out)
        for line in result.diff.splitlines():
            print(f"    {line}", file=out)
    else:
        print("  diff: (no changes)", file=out)


def print_totals(results: Sequence[RunResult], seconds: float, out: TextIO | None = None) -> None:
    """Print the totals over ``results``: parse rate, tokens per step, drafts, wall time."""
    out = sys.stdout if out is None else out
    answered = sum(r.answered for r in results)
    parsed = sum(r.parsed for r in results)
    errors = sum(s.tool_error for r in results for s in r.steps)
    tokens = spec_steps = drafted = accepted = 0
    for r in results:
        t = r.totals()
        tokens += t["completion_tokens"]
        spec_steps += t["spec_steps"]
        drafted += t["drafted"]
        accepted += t["accepted"]
    shaped = sum("<function=" in s.raw for r in results for s in r.steps if s.api_error is None)

    def pct(n: int) -> str:
        return f"{100 * n / answered:.0f}%" if answered else "-"

    passed = sum(r.check_passed for r in results)
    print(
        f"== {len(results)} runs, {answered} answered steps: {shaped} in the call format "
        f"({pct(shaped)}), {parsed} parsed tool calls ({pct(parsed)}), "
        f"{errors} error observations; checks passed {passed}/{len(results)}",
        file=out,
    )
    if spec_steps:
        print(
            f"  agent steps: {tokens} tokens in {spec_steps} verification steps "
            f"({tokens / spec_steps:.2f} tokens/step, {tokens / answered:.1f} tokens per reply); "
            f"accepted {accepted} of {drafted} drafted tokens",
            file=out,
        )
    else:
        print("  the server sent no speculation counts (no 'agentspec' field)", file=out)
    print(f"  wall time {seconds:.1f}s", file=out)


def _shards(store: ShardStore, out: TextIO) -> None:
    keys = store.keys()
    print(f"== learned shards: {len(keys)}", file=out)
    for key in keys:
        st = store.stats(key)
        print(f"  {key}: {st.sequences} sequences, {st.tokens} tokens", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 a request failed, 2 cannot run)."""
    args = _parser().parse_args(argv)
    tasks = [TASKS[name] for name in (args.task or sorted(TASKS))]
    if args.temperature < 0 or args.timeout <= 0:
        print("error: --temperature must be >= 0 and --timeout > 0", file=sys.stderr)
        return 2
    results: list[RunResult] = []
    with contextlib.ExitStack() as stack:
        try:
            if args.base_url is None:
                server, model = _start_engine(args.model or _DEFAULT_MODEL, args.threads)
                stack.callback(server.engine.close)
                stack.callback(server.stop)
                base_url = server.base_url
                push_to = [] if args.no_push else (args.push_to or [server.url])
            else:
                base_url = args.base_url.rstrip("/")
                model = args.model or _served_model(base_url, args.api_key)
                push_to = [] if args.no_push else (args.push_to or [])
            store = stack.enter_context(ShardStore(args.store) if args.store else ShardStore())
            if args.workdir is None:
                parent = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="codeact-")))
            else:
                parent = Path(args.workdir)
            config = AgentConfig(
                model=model,
                max_steps=args.steps,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                summarize=not args.no_summary,
            )
        except Exception as exc:  # no model, no server, a locked store: report, exit 2
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        client = stack.enter_context(
            build_client(
                base_url,
                api_key=args.api_key,
                store=store,
                push_to=push_to or None,
                timeout=args.timeout,
            )
        )
        agent = CodeActAgent(client, config)
        sink = stack.enter_context(open(args.json, "w", encoding="utf-8")) if args.json else None
        t0 = time.perf_counter()
        for run in range(args.runs):
            for task in tasks:
                try:
                    workdir = task.seed(parent / f"{task.name}-{run + 1}")
                except OSError as exc:
                    print(f"error: cannot seed {task.name}: {exc}", file=sys.stderr)
                    return 2
                result = agent.run(task, workdir)
                results.append(result)
                if not args.quiet:
                    print_run(result)
                if sink is not None:
                    sink.write(json.dumps(result.to_json()) + "\n")
                    sink.flush()
        elapsed = time.perf_counter() - t0
        if not client.flush(args.timeout):
            print("warning: learning / pushing did not finish in time", file=sys.stderr)
        print_totals(results, elapsed)
        _shards(store, sys.stdout)
    failed = any(r.stop_reason == "api_error" for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
