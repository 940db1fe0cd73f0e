"""`agentspec bench entropy`: will suffix decoding help this workload? (seconds, no replay)

The SuffixDecoding paper's predictor: build a suffix tree over a stage's
responses and average, over its internal nodes, the entropy of each node's
next-token (child) distribution, weighted by the node's count. Low entropy
means that once a few tokens match, the continuation is nearly determined, so
drafts from the tree are long and accepted; high entropy (open-ended text)
means short, often rejected drafts.

Exactly: for every prefix x of length 1..depth-1 that occurs in a response
followed by another token, with child counts c_t (occurrences of x followed by
t) and total T = sum c_t, the entropy is H(x) = -sum (c_t/T) log2(c_t/T); the
reported value is sum_x T * H(x) / sum_x T, in bits. The root (the empty
prefix, i.e. the unigram distribution) is left out: drafting always starts
from a match of at least one token. Also reported: the same average per prefix
length and the count-weighted probability of the most frequent child (the
chance a one-token greedy draft from the tree is right).

The computation is exact (prefixes are renamed to dense integer ids level by
level with ``numpy.unique``), O(n log n) per level for n response tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from agentspec.traces import read_traces

__all__ = ["EntropyResult", "add_arguments", "child_entropy", "run", "run_cli"]

Tokens = npt.NDArray[np.int32]


@dataclass(frozen=True)
class EntropyResult:
    """Count-weighted child entropy of a set of sequences.

    Attributes:
        sequences: number of sequences.
        tokens: number of tokens.
        entropy_bits: count-weighted average child entropy over all internal
            nodes of depth 1..depth-1 (None if there is none).
        top1_prob: count-weighted probability of each node's most frequent child.
        weight: sum of the node totals (the number of (position, length) pairs).
        nodes: number of internal nodes.
        by_length: per prefix length: (entropy_bits, top1_prob, weight, nodes).
    """

    sequences: int
    tokens: int
    entropy_bits: float | None
    top1_prob: float | None
    weight: int
    nodes: int
    by_length: tuple[tuple[float | None, float | None, int, int], ...]

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON object."""
        return {
            "sequences": self.sequences,
            "tokens": self.tokens,
            "entropy_bits": self.entropy_bits,
            "top1_prob": self.top1_prob,
            "weight": self.weight,
            "nodes": self.nodes,
            "by_length": [
                {"length": i + 1, "entropy_bits": h, "top1_prob": p, "weight": w, "nodes": n}
                for i, (h, p, w, n) in enumerate(self.by_length)
            ],
        }


def child_entropy(seqs: Sequence[Sequence[int] | Tokens], depth: int = 8) -> EntropyResult:
    """Count-weighted child entropy of the tree of ``seqs`` up to ``depth`` (see module doc).

    Raises:
        ValueError: ``depth`` < 2 or a negative token.
    """
    if depth < 2:
        raise ValueError(f"depth must be >= 2, got {depth}")
    arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in seqs]
    lengths = np.asarray([len(a) for a in arrays], dtype=np.int64)
    n = int(lengths.sum())
    by_length: list[tuple[float | None, float | None, int, int]] = []
    if n == 0:
        return EntropyResult(len(arrays), 0, None, None, 0, 0, ())
    tok = np.concatenate(arrays)
    if int(tok.min()) < 0:
        raise ValueError("token ids must be >= 0")
    vocab = int(tok.max()) + 1
    ends = np.repeat(np.cumsum(lengths), lengths)  # end (exclusive) of each position's sequence
    pos = np.arange(n, dtype=np.int64)
    ids = tok  # ids[i]: dense id of the prefix of the current length starting at i
    sum_h = sum_top = 0.0
    sum_w = sum_nodes = 0
    for length in range(1, depth):
        valid = pos + length < ends  # a child token exists
        if not valid.any():
            break
        starts = pos[valid]
        key = ids[valid] * vocab + tok[starts + length]
        uniq, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
        parent = uniq // vocab
        first = np.flatnonzero(np.r_[True, parent[1:] != parent[:-1]])
        c = counts.astype(np.float64)
        totals = np.add.reduceat(c, first)
        clogc = np.add.reduceat(c * np.log2(c), first)
        top = np.maximum.reduceat(c, first)
        h = float((totals * np.log2(totals) - clogc).sum())  # sum_x T(x) * H(x)
        w = int(totals.sum())
        by_length.append((h / w, float(top.sum()) / w, w, len(first)))
        sum_h += h
        sum_top += float(top.sum())
        sum_w += w
        sum_nodes += len(first)
        nxt = np.full(n, -1, dtype=np.int64)
        nxt[starts] = inverse.reshape(-1)
        ids = nxt
    return EntropyResult(
        len(arrays),
        n,
        sum_h / sum_w if sum_w else None,
        sum_top / sum_w if sum_w else None,
        sum_w,
        sum_nodes,
        tuple(by_length),
    )


def load_responses(
    path: Path | str, tokenizer: Any, max_sessions: int | None = None
) -> tuple[str, list[tuple[str, Tokens]]]:
    """Tokenize only the responses of a trace file: (workload, [(stage, ids), ...])."""
    stages: list[str] = []
    texts: list[str] = []
    workloads: dict[str, None] = {}
    for rec in read_traces(path, max_sessions=max_sessions):
        workloads[rec.workload] = None
        for req in rec.requests():
            stages.append(req.stage)
            texts.append(req.response)
    encs = tokenizer.encode_batch(texts, add_special_tokens=False)
    out = [(s, np.asarray(e.ids, dtype=np.int32)) for s, e in zip(stages, encs, strict=True)]
    return ",".join(workloads), out


def run(
    paths: Sequence[Path], tokenizer: Any, *, depth: int = 8, max_sessions: int | None = None
) -> dict[str, Any]:
    """Entropy per stage and over all stages of each file; JSON-ready."""
    files = []
    for path in paths:
        t0 = time.perf_counter()
        workload, resps = load_responses(path, tokenizer, max_sessions)
        t1 = time.perf_counter()
        by_stage: dict[str, list[Tokens]] = {}
        for stage, ids in resps:
            by_stage.setdefault(stage, []).append(ids)
        stages = {s: child_entropy(v, depth).to_json() for s, v in by_stage.items()}
        overall = child_entropy([ids for _, ids in resps], depth).to_json()
        files.append(
            {
                "path": str(path),
                "name": Path(path).name.removesuffix(".gz").removesuffix(".jsonl"),
                "workload": workload,
                "stages": stages,
                "all": overall,
                "tokenize_s": t1 - t0,
                "compute_s": time.perf_counter() - t1,
            }
        )
    return {"depth": depth, "max_sessions": max_sessions, "files": files}


def render_table(results: dict[str, Any]) -> str:
    """One terminal table: a row per (file, stage) plus each file's overall row."""
    depth = results["depth"]
    head = ["file", "stage", "responses", "tokens", "H bits", "top-1 p"] + [
        f"H@{k}" for k in range(1, depth)
    ]
    rows: list[list[str]] = []

    def fmt(v: float | None, nd: int) -> str:
        return "-" if v is None or not math.isfinite(v) else f"{v:.{nd}f}"

    for f in results["files"]:
        items = [*f["stages"].items(), ("(all)", f["all"])]
        for stage, r in items:
            per = [fmt(b["entropy_bits"], 2) for b in r["by_length"]]
            per += ["-"] * (depth - 1 - len(per))
            rows.append(
                [
                    f["name"],
                    stage,
                    f"{r['sequences']:,}",
                    f"{r['tokens']:,}",
                    fmt(r["entropy_bits"], 3),
                    fmt(r["top1_prob"], 3),
                    *per,
                ]
            )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = [
        "  ".join(
            h.rjust(w) if i > 1 else h.ljust(w)
            for i, (h, w) in enumerate(zip(head, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append(
            "  ".join(
                c.rjust(w) if i > 1 else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    lines.append(
        "H bits: count-weighted entropy of next-token distributions after 1.."
        f"{depth - 1} matched tokens (lower: suffix decoding drafts longer and better); "
        "top-1 p: how often the most frequent continuation is the right one."
    )
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``bench entropy`` options to ``p``."""
    from agentspec.bench.replay import DEFAULT_TOKENIZER

    p.add_argument("traces", nargs="+", type=Path, help="trace files (.jsonl or .jsonl.gz)")
    p.add_argument(
        "--depth", type=int, default=8, help="tree depth: prefixes of 1..depth-1 tokens (default 8)"
    )
    p.add_argument("--max-sessions", type=int, default=None, help="first N sessions per file")
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help=f"HF tokenizer.json (default: {DEFAULT_TOKENIZER})",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")


def run_cli(args: argparse.Namespace) -> int:
    """Run ``agentspec bench entropy`` from parsed arguments; return the exit status."""
    from agentspec.bench.replay import load_tokenizer

    if args.depth < 2:
        raise ValueError(f"--depth must be >= 2, got {args.depth}")
    if args.max_sessions is not None and args.max_sessions < 1:
        raise ValueError(f"--max-sessions must be >= 1, got {args.max_sessions}")
    for p in args.traces:
        if not p.is_file():
            raise FileNotFoundError(f"trace file not found: {p}")
    tok = load_tokenizer(args.tokenizer, chatml=False)
    results = run(args.traces, tok, depth=args.depth, max_sessions=args.max_sessions)
    sys.stdout.write(render_table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0
