"""Trace loading for the bench commands: a trace file tokenized into replayable requests.

`load_tokenizer` loads a HF ``tokenizer.json``; `load_trace` renders every
message as Qwen3 ChatML (``<|im_start|>{role}\\n{content}<|im_end|>\\n``),
tokenizes it once, and yields one `Request` per assistant response.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from agentspec.chat import CHATML_GENERATION_PROMPT, chatml_message
from agentspec.traces import read_traces

__all__ = ["DEFAULT_TOKENIZER", "Request", "TraceData", "load_tokenizer", "load_trace"]

Tokens = npt.NDArray[np.int32]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER = REPO_ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3" / "tokenizer.json"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


@dataclass(frozen=True)
class Request:
    """One tokenized request: the prompt is built on demand from its session's tokens."""

    index: int
    session: int
    workload: str
    stage: str
    context: Tokens  # the session's rendered messages, concatenated (shared)
    prompt_len: int  # tokens of ``context`` before the generation prompt
    generation_prompt: Tokens
    response: Tokens

    @property
    def prompt_tokens(self) -> int:
        """Length of the rendered prompt."""
        return self.prompt_len + len(self.generation_prompt)

    def prompt(self) -> Tokens:
        """The prompt ids: earlier messages as ChatML, then the generation prompt."""
        return np.concatenate((self.context[: self.prompt_len], self.generation_prompt))


@dataclass(frozen=True)
class TraceData:
    """A tokenized trace file."""

    path: Path
    name: str
    workload: str
    sessions: int
    requests: tuple[Request, ...]
    tokenize_s: float

    def counts(self) -> dict[str, int]:
        """Sessions, requests, prompt tokens and response tokens."""
        return {
            "sessions": self.sessions,
            "requests": len(self.requests),
            "prompt_tokens": sum(r.prompt_tokens for r in self.requests),
            "response_tokens": sum(len(r.response) for r in self.requests),
        }

    def stages(self) -> list[str]:
        """Stage names in order of first appearance."""
        return list(dict.fromkeys(r.stage for r in self.requests))


def load_tokenizer(path: Path | str | None = None, *, chatml: bool = True) -> Any:
    """Load a HF ``tokenizer.json`` (default: Qwen3 under ../shared beside the repo).

    With ``chatml`` the tokenizer must know ``<|im_start|>`` and ``<|im_end|>``.

    Raises:
        FileNotFoundError: no such file.
        RuntimeError: the ``tokenizers`` package is missing.
        ValueError: the tokenizer has no ChatML special tokens.
    """
    p = Path(path) if path is not None else DEFAULT_TOKENIZER
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {p} (pass --tokenizer PATH)")
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise RuntimeError(
            "agentspec bench needs the 'tokenizers' package: pip install 'agentspec[bench]'"
        ) from e
    tok = Tokenizer.from_file(str(p))
    if chatml and (tok.token_to_id(IM_START) is None or tok.token_to_id(IM_END) is None):
        raise ValueError(f"{p}: tokenizer has no {IM_START}/{IM_END} tokens (ChatML is required)")
    return tok


def load_trace(path: Path | str, tokenizer: Any, max_sessions: int | None = None) -> TraceData:
    """Read and tokenize a trace file (its first ``max_sessions`` sessions).

    Each message is rendered and tokenized once; a request's prompt is a slice
    of its session's concatenated message ids plus the generation prompt
    (special tokens are split out by the tokenizer, so this equals tokenizing
    the whole rendered prompt).
    """
    p = Path(path)
    t0 = time.perf_counter()
    records = list(read_traces(p, max_sessions=max_sessions))
    if not records:
        raise ValueError(f"{p}: no records")
    texts: list[str] = []
    for rec in records:
        for m in rec.messages:
            texts.append(chatml_message(m.role, m.content))
            if m.role == "assistant":
                texts.append(m.content)
    encs = tokenizer.encode_batch(texts, add_special_tokens=False)
    gen = np.asarray(
        tokenizer.encode(CHATML_GENERATION_PROMPT, add_special_tokens=False).ids, dtype=np.int32
    )
    requests: list[Request] = []
    k = 0
    for s, rec in enumerate(records):
        parts: list[Tokens] = []
        pending: list[tuple[int, str, Tokens]] = []  # (prompt_len, stage, response)
        running = 0
        for m in rec.messages:
            ids = np.asarray(encs[k].ids, dtype=np.int32)
            k += 1
            if m.role == "assistant":
                resp = np.asarray(encs[k].ids, dtype=np.int32)
                k += 1
                stage = m.stage if m.stage is not None else rec.stage
                if len(resp):
                    pending.append((running, stage, resp))
            parts.append(ids)
            running += len(ids)
        context = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        for plen, stage, resp in pending:
            requests.append(
                Request(len(requests), s, rec.workload, stage, context, plen, gen, resp)
            )
    workloads = list(dict.fromkeys(r.workload for r in records))
    name = p.name.removesuffix(".gz").removesuffix(".jsonl")
    return TraceData(
        p,
        name,
        workloads[0] if len(workloads) == 1 else ",".join(workloads),
        len(records),
        tuple(requests),
        time.perf_counter() - t0,
    )
