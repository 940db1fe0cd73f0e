"""Trace loading and Qwen3 ChatML tokenization for the replay benchmark.

A trace file (format: ``../shared/data/README.md``) holds one record per
session; every assistant message is one LLM request whose prompt is all
earlier messages of the record.  Prompts are rendered the way Qwen3's chat
template renders a conversation::

    <|im_start|>{role}\\n{content}<|im_end|>\\n      (per earlier message)
    <|im_start|>assistant\\n                         (generation prompt)

Each rendered message is tokenized once (special tokens are split out by the
tokenizer, so per-message ids concatenate to exactly the ids of the whole
rendered prompt) and a session's prompts are built by concatenating those
ids, so a 14k-token agent prompt is never re-tokenized per turn.

The response of a request is ``encode(content) + [<|im_end|>]``: the tokens a
model emits after the generation prompt, stop token included.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER = REPO_ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3" / "tokenizer.json"
DEFAULT_TRACE_DIR = REPO_ROOT.parent / "shared" / "data" / "traces"

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

Tokens = npt.NDArray[np.int32]


@dataclass(frozen=True)
class Request:
    """One LLM request of a trace: its prompt and true response as int32 ids."""

    session: str
    turn: int
    stage: str
    prompt: Tokens
    response: Tokens


@dataclass(frozen=True)
class Session:
    """One tokenized trace record.

    ``rendered[i]`` is message i rendered as ChatML and tokenized;
    ``responses[i]`` is set for assistant messages only (content ids plus
    ``<|im_end|>``); ``stages[i]`` is the stage of assistant message i.
    """

    session: str
    roles: tuple[str, ...]
    rendered: tuple[Tokens, ...]
    responses: dict[int, Tokens]
    stages: dict[int, str]
    generation_prompt: Tokens

    def requests(self) -> Iterator[Request]:
        """Yield the session's requests in order, building each prompt by concatenation."""
        prefix: list[Tokens] = []
        for i, role in enumerate(self.roles):
            if role == "assistant":
                prompt = np.concatenate([*prefix, self.generation_prompt]).astype(
                    np.int32, copy=False
                )
                yield Request(self.session, i, self.stages[i], prompt, self.responses[i])
            prefix.append(self.rendered[i])


@dataclass(frozen=True)
class TraceSet:
    """All sessions of one trace file plus loading statistics."""

    path: Path
    workload: str
    sessions: tuple[Session, ...]
    load_seconds: float
    tokenize_seconds: float

    def requests(self) -> Iterator[Request]:
        """Yield every request of the file in replay (file) order."""
        for s in self.sessions:
            yield from s.requests()

    def counts(self) -> dict[str, int]:
        """Return sessions, requests, prompt tokens and response tokens of the file."""
        n_req = 0
        prompt_tokens = 0
        response_tokens = 0
        for s in self.sessions:
            running = 0
            for i, role in enumerate(s.roles):
                if role == "assistant":
                    n_req += 1
                    prompt_tokens += running + len(s.generation_prompt)
                    response_tokens += len(s.responses[i])
                running += len(s.rendered[i])
        return {
            "sessions": len(self.sessions),
            "requests": n_req,
            "prompt_tokens": prompt_tokens,
            "response_tokens": response_tokens,
        }


def load_tokenizer(path: Path | str | None = None) -> Tokenizer:
    """Load a HF ``tokenizer.json`` (default: the Qwen3 one under ../shared)."""
    p = Path(path) if path is not None else DEFAULT_TOKENIZER
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {p}")
    return Tokenizer.from_file(str(p))


def read_records(path: Path | str, max_sessions: int | None = None) -> list[dict[str, Any]]:
    """Read the first ``max_sessions`` records (all if None) of a .jsonl.gz trace file."""
    if max_sessions is not None and max_sessions < 1:
        raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
    out: list[dict[str, Any]] = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if max_sessions is not None and len(out) >= max_sessions:
                break
            if line.strip():
                rec = json.loads(line)
                if not isinstance(rec, dict) or not isinstance(rec.get("messages"), list):
                    raise ValueError(f"{path}: record {len(out)} has no 'messages' list")
                out.append(rec)
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def _ids(enc: Any) -> Tokens:
    return np.asarray(enc.ids, dtype=np.int32)


def load_traces(
    path: Path | str, tokenizer: Tokenizer, max_sessions: int | None = None
) -> TraceSet:
    """Read and tokenize a trace file (first ``max_sessions`` sessions)."""
    t0 = time.perf_counter()
    records = read_records(path, max_sessions)
    t1 = time.perf_counter()

    texts: list[str] = []
    for rec in records:
        for m in rec["messages"]:
            texts.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
            if m["role"] == "assistant":
                texts.append(m["content"])
    encs = tokenizer.encode_batch(texts, add_special_tokens=False)
    im_end = tokenizer.token_to_id(IM_END)
    if im_end is None or tokenizer.token_to_id(IM_START) is None:
        raise ValueError("tokenizer has no <|im_start|>/<|im_end|> tokens (not a ChatML tokenizer)")
    gen_prompt = _ids(tokenizer.encode(f"{IM_START}assistant\n", add_special_tokens=False))
    end_arr = np.asarray([im_end], dtype=np.int32)

    sessions: list[Session] = []
    k = 0
    workload = ""
    for rec in records:
        workload = str(rec.get("workload", workload))
        default_stage = str(rec.get("stage", ""))
        roles: list[str] = []
        rendered: list[Tokens] = []
        responses: dict[int, Tokens] = {}
        stages: dict[int, str] = {}
        for i, m in enumerate(rec["messages"]):
            roles.append(str(m["role"]))
            rendered.append(_ids(encs[k]))
            k += 1
            if m["role"] == "assistant":
                responses[i] = np.concatenate([_ids(encs[k]), end_arr])
                stages[i] = str(m.get("stage", default_stage))
                k += 1
        if not responses:
            raise ValueError(f"{path}: session {rec.get('session')!r} has no assistant message")
        sessions.append(
            Session(
                str(rec.get("session")),
                tuple(roles),
                tuple(rendered),
                responses,
                stages,
                gen_prompt,
            )
        )
    t2 = time.perf_counter()
    return TraceSet(Path(path), workload, tuple(sessions), t1 - t0, t2 - t1)
