"""`scripts/bench-vllm-cuda` without a GPU: its plan (traces, model, estimate), its built-in trace.

The script's ``--dry-run`` stops after the plan, before the GPU check and before
anything is installed or written, so it runs here as a user would run it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench-vllm-cuda"


def _load(name: str, path: Path) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


plan = _load("cuda_plan_under_test", REPO / "benchmarks" / "_cuda_plan.py")


def _dry_run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash")
    assert bash is not None
    base = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "PYTHON": sys.executable,
        "TRACES": str(tmp_path / "no-traces"),
        "OUT": str(tmp_path / "out"),
    }
    return subprocess.run(
        [bash, str(SCRIPT), "--dry-run", *args],
        env={**base, **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_without_traces_the_plan_uses_the_builtin_prompts(tmp_path: Path) -> None:
    proc = _dry_run(tmp_path, GPU_MEMORY_MIB="81559")
    assert proc.returncode == 0, proc.stderr
    assert "built-in demo prompts" in proc.stderr
    assert "model: Qwen/Qwen2.5-7B-Instruct" in proc.stderr
    assert "not measured on a GPU" in proc.stderr
    assert "server starts" in proc.stderr
    assert " min " in proc.stderr
    assert "weights 14.2 GiB" in proc.stderr
    runs = [line for line in proc.stdout.splitlines() if ".jsonl" in line]
    assert len(runs) == 1
    assert "builtin-demo-prompts.jsonl.gz --warmup-sessions 8" in runs[0]
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_the_users_traces_come_first(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl"
    plan.write_builtin_trace(a)
    b.write_text("")
    proc = _dry_run(tmp_path, "--rounds", "2", TRACE=f"{a},{b}", GPU_MEMORY_MIB="81559")
    assert proc.returncode == 0, proc.stderr
    runs = [line for line in proc.stdout.splitlines() if ".jsonl" in line]
    assert runs == [f"{a} --concurrency 1,8,32", f"{b} --concurrency 1,8,32"]
    assert "36 server starts" in proc.stderr  # 9 methods x 2 rounds x 2 traces


def test_a_missing_trace_exits_2(tmp_path: Path) -> None:
    proc = _dry_run(tmp_path, TRACE=str(tmp_path / "nope.jsonl.gz"))
    assert proc.returncode == 2
    assert "trace not found" in proc.stderr


def test_the_development_traces_when_a_folder_has_them(tmp_path: Path) -> None:
    d = tmp_path / "traces"
    for name in plan.DEVELOPMENT_TRACES:
        plan.write_builtin_trace(d / name)
    proc = _dry_run(tmp_path, TRACES=str(d))
    assert proc.returncode == 0, proc.stderr
    runs = [line for line in proc.stdout.splitlines() if ".jsonl" in line]
    assert runs[0].endswith("spider-sql.dev.jsonl.gz --concurrency 1,8,32")
    assert runs[1].endswith(
        "swe-gemini3pro.dev.jsonl.gz --concurrency 1,8,32 --max-prompt-chars 12000 "
        "--max-model-len 4096"
    )


def test_a_model_too_big_for_the_gpu_stops_before_installing(tmp_path: Path) -> None:
    proc = _dry_run(tmp_path, GPU_MEMORY_MIB="8192")
    assert proc.returncode == 2
    assert "does not fit" in proc.stderr
    assert "Qwen/Qwen2.5-1.5B-Instruct" in proc.stderr
    ok = _dry_run(
        tmp_path, GPU_MEMORY_MIB="8192", AGENTSPEC_BENCH_MODEL="Qwen/Qwen2.5-1.5B-Instruct"
    )
    assert ok.returncode == 0, ok.stderr
    small = _dry_run(tmp_path, AGENTSPEC_BENCH_MODEL="smollm2-135m")
    assert small.returncode == 0, small.stderr
    assert "weights 0.3 GiB" in small.stderr


def test_a_model_folder_is_sized_from_its_weight_files(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 3 * 2**20)
    assert plan.model_bytes(str(model)) == 3 * 2**20
    assert plan.model_bytes("someone/unknown-model") is None


def test_the_estimate_grows_with_rounds_methods_and_requests() -> None:
    runs = plan.find_runs(None, None, "builtin.jsonl.gz")
    one = plan.estimate(runs, plan.DEFAULT_MODEL, 81559, [])
    assert one.servers == len(plan.ALL_METHODS)
    assert one.fits is True
    three = plan.estimate(runs, plan.DEFAULT_MODEL, 81559, ["--rounds", "3"])
    assert three.servers == 3 * one.servers
    assert three.seconds == pytest.approx(3 * one.seconds)
    few = plan.estimate(runs, plan.DEFAULT_MODEL, 81559, ["--methods", "none,agentspec"])
    assert few.servers == 2
    assert few.seconds < one.seconds
    more = plan.estimate(runs, plan.DEFAULT_MODEL, 81559, ["--requests", "64"])
    assert more.seconds > one.seconds


def test_the_methods_are_bench_vllms() -> None:
    bench = _load("bench_vllm_for_plan", REPO / "benchmarks" / "bench_vllm.py")
    assert tuple(bench.ALL_METHODS) == plan.ALL_METHODS


def test_the_builtin_trace_holds_prompts_only_and_loads(tmp_path: Path) -> None:
    path = tmp_path / "builtin.jsonl.gz"
    assert plan.write_builtin_trace(path) == plan.BUILTIN_RECORDS
    bench = _load("bench_vllm_for_plan", REPO / "benchmarks" / "bench_vllm.py")
    sessions = bench.load_prompts(path, 12000)
    assert len(sessions) == plan.BUILTIN_RECORDS
    prompts = [s[0] for s in sessions]
    assert all(len(s) == 1 for s in sessions)
    assert {p.stage for p in prompts} == {"Classify", "Extract"}
    # a prompt ends with the question: no model output is stored anywhere
    assert all(p.messages[-1]["role"] == "user" for p in prompts)
    # the built-in settings use exactly the trace: 8 warm-up, 8 at c=1, 8 at c=8
    args = dict(zip(plan.BUILTIN_ARGS[::2], plan.BUILTIN_ARGS[1::2], strict=True))
    assert int(args["--warmup-sessions"]) + 2 * int(args["--requests"]) == plan.BUILTIN_RECORDS
