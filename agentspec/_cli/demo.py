"""``agentspec demo``: the multi-stage text-to-SQL agent with speculation off, then on.

Starts the embedded engine in this process (or uses ``--base-url``, any
OpenAI-compatible server: vLLM with the agentspec plugin, ``agentspec
serve``), runs N questions through the text-to-SQL pipeline twice per
question -- speculation off (``vllm_xargs.agentspec_speculate=false``), then
on, with the "on" run's stage shards starting empty and learning as it goes
-- and checks that both runs produced identical outputs (every stage's text
and token ids).  Prints per stage: calls, tokens, verification steps, tokens
per step, wall time off / on and the speedup (also over the calls that did
not stop at ``max_tokens``), how many outputs are well formed (Extract's
JSON, SQL passing SQLite ``EXPLAIN``), then the overall wall-clock speedup
(measured, never computed from step counts), and a legend of the columns.
Writes ``report.json``, ``calls.jsonl`` and ``chart.png`` into ``--out``
(default: ``demo`` in the agentspec cache, ``$AGENTSPEC_CACHE/demo`` or
``~/.cache/agentspec/demo``, not the working directory) and prints where.

Exit status: 0 when the outputs are identical, 1 when they differ or calls
failed, 2 when the demo cannot run (bad arguments, no model, no pipeline).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agentspec._util.keys import client_api_key
from agentspec.exceptions import AgentSpecError

__all__ = ["DEFAULT_QUESTIONS", "add_arguments", "default_out_dir", "run_cli"]

#: Questions run by default: about 4 minutes for both runs with SmolLM2-135M on 2 CPU cores.
DEFAULT_QUESTIONS = 6


def default_out_dir() -> Path:
    """Where the report goes by default: ``demo`` beside the model cache.

    That is ``$AGENTSPEC_CACHE/demo`` when set, else
    ``$XDG_CACHE_HOME/agentspec/demo``, else ``~/.cache/agentspec/demo``
    (see `agentspec.models.default_cache_dir`).
    """
    from agentspec.models import default_cache_dir

    return default_cache_dir().parent / "demo"


_STAGES = ("Classify", "Extract", "Enrich", "SQL", "SQL-fix", "Combine")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _stage_tokens(text: str) -> tuple[str, int]:
    stage, sep, value = text.partition("=")
    stage = stage.strip()
    if not sep or stage not in _STAGES:
        raise argparse.ArgumentTypeError(
            f"want STAGE=N with STAGE one of {', '.join(_STAGES)}, got {text!r}"
        )
    return stage, _positive_int(value.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``agentspec demo`` options to ``parser``."""
    parser.add_argument(
        "--base-url",
        metavar="URL",
        help="an OpenAI-compatible server (.../v1); default: start the embedded engine here",
    )
    parser.add_argument(
        "-n",
        "--num-questions",
        type=_positive_int,
        default=DEFAULT_QUESTIONS,
        metavar="N",
        help="questions to run (default: %(default)s)",
    )
    parser.add_argument(
        "--model",
        metavar="PATH|NAME",
        help="embedded engine: model folder or name (default smollm2-135m); "
        "with --base-url: the model to request (default: the server's first)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help=f"where report.json, calls.jsonl and chart.png go (default: {default_out_dir()})",
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        metavar="T",
        help="torch threads of the embedded engine (default: min(4, CPUs))",
    )
    parser.add_argument(
        "--n-sql",
        type=_positive_int,
        default=1,
        metavar="K",
        help="parallel SQL stages of the pipeline, 1..4 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tokens",
        type=_stage_tokens,
        action="append",
        default=[],
        metavar="STAGE=N",
        help=f"max_tokens of a stage, repeatable ({', '.join(_STAGES)})",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--data",
        metavar="PATH",
        help="the Spider trace (default: ../shared/data/traces/spider-sql.dev.jsonl.gz "
        "beside the checkout, else the built-in questions)",
    )
    source.add_argument(
        "--builtin", action="store_true", help="use the built-in questions (no Spider trace)"
    )
    parser.add_argument(
        "--api-key",
        default=client_api_key() or "EMPTY",
        help="API key for --base-url (default: $AGENTSPEC_API_KEY, else $OPENAI_API_KEY, "
        "else 'EMPTY')",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="seconds per request"
    )
    parser.add_argument("--no-chart", action="store_true", help="do not write chart.png")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")


def run_cli(args: argparse.Namespace) -> int:
    """Run ``agentspec demo``; returns the exit status (0 identical, 1 not, 2 cannot run)."""
    try:
        from agentspec.demo import DemoConfig, DemoError, format_table, run_demo, write_outputs
    except (AgentSpecError, ImportError) as exc:  # no pipeline (installed without examples/)
        print(f"agentspec demo: {exc}", file=sys.stderr)
        return 2
    try:
        config = DemoConfig(
            base_url=args.base_url,
            model=args.model,
            questions=args.num_questions,
            n_sql=args.n_sql,
            max_tokens=dict(args.max_tokens),
            data=args.data,
            builtin=args.builtin,
            threads=args.threads,
            api_key=args.api_key,
            timeout=args.timeout,
        )
        result = run_demo(config, progress=None if args.quiet else sys.stderr)
    except (DemoError, ValueError) as exc:
        print(f"agentspec demo: {exc}", file=sys.stderr)
        return 2
    report = result.report
    print(f"agentspec demo: {report.model} on {report.server}; {report.source}")
    print(format_table(report))
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    out = args.out if args.out is not None else default_out_dir()
    written = write_outputs(report, out, result.records, chart=not args.no_chart)
    if "chart" not in written and not args.no_chart:
        print("note: matplotlib is not installed; no chart.png", file=sys.stderr)
    print(f"wrote {', '.join(p.name for p in written.values())} to {out}")
    if report.errors:
        print(f"\nFAILED: {len(report.errors)} call(s) failed:", file=sys.stderr)
        for err in report.errors[:20]:
            print(f"  {err}", file=sys.stderr)
    if report.mismatches:
        print(
            f"\nMISMATCH: speculation changed {len(report.mismatches)} output(s); "
            "speculative decoding must reproduce plain decoding exactly:",
            file=sys.stderr,
        )
        for m in report.mismatches[:20]:
            print(f"  {m}", file=sys.stderr)
    if not report.identical:
        return 1
    print("outputs identical with and without speculation (text and token ids of every call)")
    return 0
