"""Command line: run N Spider questions through the pipeline and print per-stage results.

    python -m examples.text_to_sql --base-url http://127.0.0.1:8000/v1 --model M -n 5

Prints, per question, each stage's timing, token usage and parsed output, the
final SQL and its EXPLAIN status, then totals.  ``--json PATH`` also writes
one JSON result per line; ``--trace PATH`` records the sessions as an
agentspec trace (``agentspec bench replay`` reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from agentspec import AgentSpecClient

from .pipeline import DEFAULT_MAX_TOKENS, PipelineConfig, QuestionResult, Text2SQLPipeline
from .prompts import SQL_STRATEGIES
from .spider import DEFAULT_TRACE, load_questions

__all__ = ["main", "print_result"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.text_to_sql",
        description="Run Spider questions through the multi-stage text-to-SQL agent.",
    )
    p.add_argument("--base-url", required=True, help="OpenAI-compatible base URL (.../v1)")
    p.add_argument("--model", required=True, help="model name to request")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
        help="API key (default: $OPENAI_API_KEY, else 'EMPTY')",
    )
    p.add_argument("-n", "--num-questions", type=int, default=5, help="questions to run")
    p.add_argument("--offset", type=int, default=0, help="questions to skip first")
    p.add_argument("--db", action="append", help="only questions on this db_id (repeatable)")
    p.add_argument("--data", default=DEFAULT_TRACE, help="the Spider trace file")
    p.add_argument(
        "--n-sql",
        type=int,
        default=3,
        help=f"parallel SQL stages, 1..{len(SQL_STRATEGIES)} ({', '.join(SQL_STRATEGIES)})",
    )
    p.add_argument("--no-fix", action="store_true", help="do not send failing queries back")
    p.add_argument("--few-shot", type=int, default=3, help="few-shot examples at most")
    p.add_argument(
        "--max-tokens",
        action="append",
        default=[],
        metavar="STAGE=N",
        help=f"max_tokens of a stage (repeatable); defaults {dict(DEFAULT_MAX_TOKENS)}",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--max-retries", type=int, default=0, help="openai client retries")
    p.add_argument(
        "--no-tags-in-body",
        action="store_true",
        help="send tags only as headers (for servers refusing 'vllm_xargs')",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer.json (or its folder) to learn outputs from text (default: none)",
    )
    p.add_argument(
        "--return-token-ids",
        action="store_true",
        help="ask the server for output token ids (vLLM) and learn those",
    )
    p.add_argument(
        "--push-to",
        action="append",
        metavar="URL",
        help="push the learned shards to this worker (repeatable)",
    )
    p.add_argument(
        "--extra-body",
        metavar="JSON",
        help='extra request fields, e.g. \'{"chat_template_kwargs": {"enable_thinking": false}}\'',
    )
    p.add_argument("--json", metavar="PATH", help="also write results as JSON lines")
    p.add_argument("--trace", metavar="PATH", help="record the sessions as an agentspec trace")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    return p


def _max_tokens(items: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        stage, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise ValueError(f"--max-tokens wants STAGE=N, got {item!r}")
        out[stage.strip()] = int(value)
    return out


def _extra_body(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError("--extra-body must be a JSON object")
    return body


def _short(value: Any, width: int = 100) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def print_result(result: QuestionResult, out: TextIO | None = None) -> None:
    """Print one question's stages, final SQL and EXPLAIN status (to stdout by default)."""
    out = sys.stdout if out is None else out
    print(f"== {result.session} [{result.db_id}] {result.question}", file=out)
    for rec in result.stages:
        name = rec.stage if rec.fix_of is None else f"{rec.stage}({rec.fix_of})"
        tokens = f"{rec.prompt_tokens or 0}+{rec.completion_tokens or 0} tok"
        if rec.error is not None:
            what = f"ERROR {_short(rec.error)}"
        elif rec.parse_failure is not None:
            what = f"{_short(rec.parsed)}  [parse: {_short(rec.parse_failure, 60)}]"
        else:
            what = _short(rec.parsed)
        print(
            f"  {name:<18} +{rec.started:6.2f}s {rec.seconds:6.2f}s {tokens:>14}  {what}",
            file=out,
        )
    for cand in result.candidates:
        state = "ok" if cand.explain_ok else f"EXPLAIN error: {cand.explain_error}"
        fixed = " (after SQL-fix)" if cand.fixed else ""
        print(f"  candidate {cand.stage} {cand.strategy}{fixed}: {state}", file=out)
    state = "ok" if result.explain_ok else f"error: {result.explain_error}"
    print(f"  final ({result.final_source}): {result.final_sql}", file=out)
    print(f"  EXPLAIN {state}; answer: {result.answer}; {result.seconds:.2f}s", file=out)


def _summary(results: Sequence[QuestionResult], out: TextIO) -> None:
    totals: dict[str, list[int]] = {}
    for res in results:
        for stage, use in res.usage().items():
            t = totals.setdefault(stage, [0, 0, 0])
            t[0] += 1
            t[1] += use["prompt_tokens"]
            t[2] += use["completion_tokens"]
    ok = sum(r.explain_ok for r in results)
    fixes = sum(c.fixed for r in results for c in r.candidates)
    failures = sum(len(r.parse_failures()) for r in results)
    seconds = sum(r.seconds for r in results)
    print(
        f"== {len(results)} questions, {ok} final queries pass EXPLAIN, {fixes} SQL-fix "
        f"calls, {failures} parse failures, {seconds:.1f}s",
        file=out,
    )
    for stage, (n, prompt, completion) in totals.items():
        print(
            f"  {stage:<10} {n:4d} questions  {prompt:8d} prompt  {completion:7d} completion",
            file=out,
        )


def _shards(client: AgentSpecClient, out: TextIO) -> None:
    stats = client.stats()
    keys = client.store.keys()
    print(
        f"== learned {stats.learned} outputs ({stats.unlearned} without token ids, "
        f"{stats.dropped} dropped) into {len(keys)} stage shards",
        file=out,
    )
    for key in keys:
        shard = client.store.stats(key)
        print(f"  {key[2]!s:<10} {shard.sequences:4d} sequences {shard.tokens:8d} tokens", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad arguments)."""
    args = _parser().parse_args(argv)
    try:
        config = PipelineConfig(
            model=args.model,
            n_sql=args.n_sql,
            max_tokens=_max_tokens(args.max_tokens),
            few_shot=args.few_shot,
            fix=not args.no_fix,
            extra_body=_extra_body(args.extra_body),
        )
        questions = load_questions(
            args.data, limit=args.num_questions, offset=args.offset, db_ids=args.db
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results: list[QuestionResult] = []
    client = AgentSpecClient(
        base_url=args.base_url,
        api_key=args.api_key,
        timeout=args.timeout,
        max_retries=args.max_retries,
        trace_path=args.trace,
        tags_in_body=not args.no_tags_in_body,
        tokenizer=args.tokenizer,
        return_token_ids=args.return_token_ids,
        push_to=args.push_to,
    )
    sink = open(args.json, "w", encoding="utf-8") if args.json else None  # noqa: SIM115
    try:
        with client, Text2SQLPipeline(client, config) as pipeline:
            for result in pipeline.run_all(questions):
                results.append(result)
                if not args.quiet:
                    print_result(result)
                if sink is not None:
                    sink.write(json.dumps(result.to_json()) + "\n")
                    sink.flush()
            if not client.flush(args.timeout):
                print("warning: learning / pushing did not finish in time", file=sys.stderr)
            _summary(results, sys.stdout)
            _shards(client, sys.stdout)
    finally:
        if sink is not None:
            sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
