"""What every bench command shares: the CLI opening and options, outputs, tables, memory.

`cli_start` is the opening of every ``run_cli`` (check the inputs, build the
`ReplayConfig`, load the tokenizer, open the progress log);
`add_common_arguments`/`add_trace_arguments` the shared options;
`write_outputs` prints the table and writes JSON and plots; `table`, `fmt`,
`mb` format terminal tables; `environment` records the machine and versions;
`Progress`, `release_free_memory` and `rss_bytes` serve the replay loops.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from agentspec.bench._methods import ReplayConfig
from agentspec.bench._trace import DEFAULT_TOKENIZER, load_tokenizer

__all__ = [
    "CliStart",
    "Progress",
    "add_common_arguments",
    "add_trace_arguments",
    "check_inputs",
    "cli_log",
    "cli_start",
    "environment",
    "fmt",
    "json_safe",
    "mb",
    "mirror_prompt",
    "release_free_memory",
    "rss_bytes",
    "table",
    "write_outputs",
]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

#: The sequence id of a request's context in a `mirror_prompt` tree.
LOCAL_SEQ = 0


def mirror_prompt(tree: Any, ctx: Any, prompt: Any, depth: int) -> Any:
    """A `SuffixTree` over ``prompt`` as a request's per-request tree holds it.

    ``tree`` mirrors the previous request's context ``ctx`` (or is None): when
    ``prompt`` extends ``ctx`` (a session's next turn) only the new tokens are
    appended to it; otherwise it is closed and a fresh tree is made.  The
    caller appends the response's tokens under `LOCAL_SEQ` as they come.
    """
    import numpy as np

    from agentspec import SuffixTree

    if tree is not None and len(prompt) >= len(ctx) and np.array_equal(prompt[: len(ctx)], ctx):
        if len(prompt) > len(ctx):
            tree.append(LOCAL_SEQ, prompt[len(ctx) :])
        return tree
    if tree is not None:
        tree.close()
    tree = SuffixTree(depth)
    if len(prompt):
        tree.append(LOCAL_SEQ, prompt)
    return tree


def release_free_memory() -> None:
    """Collect garbage and return freed heap pages to the OS (glibc ``malloc_trim``).

    Run before each method so that its RSS growth is not hidden by memory an
    earlier method freed (no-op where glibc is not available).
    """
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int | None:
    """Resident set size of this process (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class Progress:
    """A one-line ``\\r`` progress display on a terminal; one final line otherwise."""

    def __init__(self, stream: TextIO | None, label: str, total: int) -> None:
        """Show progress of ``total`` items under ``label`` on ``stream`` (None: silent)."""
        self._stream = stream
        self._tty = bool(stream is not None and stream.isatty())
        self._label = label
        self._total = max(total, 1)
        self._t0 = time.perf_counter()
        self._last = 0.0
        self._width = 0

    def update(self, done: int) -> None:
        """Redraw (at most 5 times a second)."""
        if not self._tty or self._stream is None:
            return
        now = time.perf_counter()
        if now - self._last < 0.2 and done < self._total:
            return
        self._last = now
        frac = done / self._total
        bar = "#" * int(frac * 20)
        self._write(
            f"\r{self._label} [{bar:<20}] {done}/{self._total} requests  {now - self._t0:.0f} s"
        )

    def _write(self, text: str) -> None:
        assert self._stream is not None
        pad = max(self._width - len(text), 0)
        self._stream.write(text + " " * pad)
        self._stream.flush()
        self._width = len(text)

    def close(self, tail: str) -> None:
        """Print the final line."""
        if self._stream is None:
            return
        line = f"{self._label}: {tail}"
        if self._tty:
            self._write("\r" + line)
            self._stream.write("\n")
        else:
            self._stream.write(line + "\n")
        self._stream.flush()


def environment() -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for dist in ("agentspec", "arctic-inference", "tokenizers", "numpy"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": versions,
    }


def fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:,.{nd}f}"
    return str(v)


def mb(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:,.1f}"


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)
    ]
    lines = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(head, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(lines)


def add_common_arguments(p: argparse.ArgumentParser, *, budget_rule: bool = True) -> None:
    """The options every ``bench`` replay command shares: tokenizer, tree and draft
    configuration (``--alpha``/``--min-prob`` only with ``budget_rule``), outputs."""
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help=f"HF tokenizer.json with ChatML tokens (default: {DEFAULT_TOKENIZER})",
    )
    p.add_argument("--depth", type=int, default=64, help="tree depth (default 64)")
    p.add_argument(
        "--max-spec-tokens", type=int, default=32, help="most draft tokens per step (default 32)"
    )
    if budget_rule:
        p.add_argument("--alpha", type=float, default=1.0, help="draft budget per matched token")
        p.add_argument(
            "--min-prob", type=float, default=0.1, help="min path probability of a token"
        )
        p.add_argument(
            "--conf-min-prob",
            type=float,
            default=0.25,
            help="the confidence method's min path probability (default 0.25; it has no alpha)",
        )
    p.add_argument("--json", type=Path, default=None, help="write all results to this JSON file")
    p.add_argument("--plots", type=Path, default=None, help="write PNG plots into this directory")
    p.add_argument("--quiet", action="store_true", help="no progress output on stderr")


def add_trace_arguments(p: argparse.ArgumentParser, *, warmup: bool = False) -> None:
    """The trace files, ``--max-sessions`` and (with ``warmup``) ``--warmup-from``."""
    p.add_argument("traces", nargs="+", type=Path, help="trace files (.jsonl or .jsonl.gz)")
    p.add_argument(
        "--max-sessions", type=int, default=None, help="replay only the first N sessions per file"
    )
    if warmup:
        p.add_argument(
            "--warmup-from",
            type=Path,
            default=None,
            help="learn all responses of this trace file before each replay (offline warm-up)",
        )


def json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def check_inputs(paths: Sequence[Path], max_sessions: int | None) -> None:
    """Raise before any work when a trace file is missing or ``--max-sessions`` < 1."""
    if max_sessions is not None and max_sessions < 1:
        raise ValueError(f"--max-sessions must be >= 1, got {max_sessions}")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"trace file not found: {p}")


def cli_log(quiet: bool) -> tuple[TextIO | None, Callable[[str], None]]:
    """The progress stream (stderr, or None when ``quiet``) and a logger writing to it."""
    err = None if quiet else sys.stderr

    def log(msg: str) -> None:
        if err is not None:
            print(msg, file=err, flush=True)

    return err, log


def write_outputs(
    results: dict[str, Any],
    table: str,
    json_path: Path | None,
    plots_dir: Path | None,
    plot: Callable[[dict[str, Any], Path], tuple[list[Path], str | None]],
    log: Callable[[str], None],
) -> None:
    """Print ``table``; write ``results`` as JSON and ``plot`` them when asked."""
    sys.stdout.write(table)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(json_safe(results), indent=1) + "\n", encoding="utf-8")
        log(f"wrote {json_path}")
    if plots_dir is not None:
        written, why = plot(results, plots_dir)
        if why is not None:
            print(f"plots skipped: {why}", file=sys.stderr)
        for w in written:
            log(f"wrote {w}")


@dataclass(frozen=True)
class CliStart:
    """What a bench command's ``run_cli`` starts from (see `cli_start`)."""

    cfg: ReplayConfig
    tokenizer: Any
    err: TextIO | None
    log: Callable[[str], None]


def cli_start(
    args: argparse.Namespace,
    *,
    budget_rule: bool = True,
    inputs: bool = True,
    warmup: bool = False,
) -> CliStart:
    """The opening every bench ``run_cli`` shares, in its order.

    With ``inputs``: `check_inputs` on ``args.traces`` (and ``args.warmup_from``
    with ``warmup``) and ``args.max_sessions``.  Then the `ReplayConfig` of
    ``--depth``/``--max-spec-tokens`` (and, with ``budget_rule``, ``--alpha``,
    ``--min-prob``, ``--conf-min-prob``), the ``--tokenizer``, and the
    progress stream and log of ``--quiet`` (`cli_log`).
    """
    if inputs:
        warm = [args.warmup_from] if warmup and args.warmup_from else []
        check_inputs([*args.traces, *warm], args.max_sessions)
    if budget_rule:
        cfg = ReplayConfig(
            args.depth, args.max_spec_tokens, args.alpha, args.min_prob, args.conf_min_prob
        )
    else:
        cfg = ReplayConfig(args.depth, args.max_spec_tokens)
    tok = load_tokenizer(args.tokenizer)
    err, log = cli_log(args.quiet)
    return CliStart(cfg, tok, err, log)
