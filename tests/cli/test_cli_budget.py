"""Memory flags of ``agentspec vllm-args`` / ``agentspec serve`` reach both engines.

``--max-shard-bytes`` / ``--max-tenant-shard-bytes`` (pushed shards),
``--max-learned-bytes`` / ``--max-tenant-learned-bytes`` (learned shards),
``--max-shard-tokens`` and ``--max-body-bytes``: into vLLM's
``--additional-config`` (read by the plugin), into the embedded engine's
`EngineOptions` and from there its intake and speculators.
"""

from __future__ import annotations

import argparse
import json
import socket
from typing import Any

import pytest
from prereq import require_module

from agentspec._cli import vllm as cli_vllm
from agentspec.exceptions import InvalidArgumentError

FLAGS = [
    "--max-shard-bytes",
    "512MiB",
    "--max-tenant-shard-bytes",
    "64MiB",
    "--max-learned-bytes",
    "none",
    "--max-tenant-learned-bytes",
    "100000",
    "--max-shard-tokens",
    "5000",
    "--max-body-bytes",
    "8M",
]
EXPECTED = {
    "max_shard_bytes": 512 << 20,
    "max_tenant_shard_bytes": 64 << 20,
    "max_learned_bytes": None,
    "max_tenant_learned_bytes": 100_000,
    "max_shard_tokens": 5000,
    "max_body_bytes": 8 << 20,
}


def vllm_args_json(argv: list[str], capsys: Any) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    cli_vllm.add_vllm_args_arguments(parser)
    assert cli_vllm.run_vllm_args(parser.parse_args(["--format", "json", *argv])) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli_vllm.add_serve_arguments(parser)
    return parser.parse_args(argv)


def additional_config(args: list[str]) -> dict[str, Any] | None:
    if "--additional-config" not in args:
        return None
    return json.loads(args[args.index("--additional-config") + 1])["agentspec"]  # type: ignore[no-any-return]


def test_vllm_args_put_the_budgets_into_the_additional_config(capsys: Any) -> None:
    out = vllm_args_json(FLAGS, capsys)
    assert additional_config(out["args"]) == EXPECTED
    # not given: the plugin's own defaults apply (nothing added)
    assert additional_config(vllm_args_json([], capsys)["args"]) is None


def test_serve_vllm_takes_the_flags_before_and_after_model(tmp_path: Any) -> None:
    for argv in ([*FLAGS, str(tmp_path)], [str(tmp_path), *FLAGS, "--enforce-eager"]):
        args, _ = cli_vllm.serve_launch(serve_args([*argv, "--engine", "vllm"]))
        assert additional_config(args) == EXPECTED
        assert "--max-shard-bytes" not in args  # not passed on to vLLM itself


@pytest.mark.parametrize(
    "bad",
    [["--max-shard-bytes", "lots"], ["--max-shard-tokens", "-3"], ["--max-learned-bytes", "1x"]],
)
def test_bad_sizes_are_usage_errors(bad: list[str], capsys: Any) -> None:
    parser = argparse.ArgumentParser()
    cli_vllm.add_vllm_args_arguments(parser)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(bad)
    assert exc.value.code == 2
    assert bad[0] in capsys.readouterr().err


def test_body_cap_cannot_be_turned_off(tmp_path: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="max-body-bytes"):
        cli_vllm.serve_launch(serve_args([str(tmp_path), "--max-body-bytes", "none"]))


def test_serve_embedded_dry_run_shows_the_budgets(tmp_path: Any, capsys: Any) -> None:
    args = serve_args([str(tmp_path), "--engine", "embedded", "--dry-run", *FLAGS])
    assert cli_vllm.run_serve(args) == 0
    out = capsys.readouterr().out
    assert "pushed shards 512 MiB (64 MiB per tenant)" in out
    assert "learned shards none (97.7 KiB per tenant, 5000 token budget per shard)" in out
    assert "push bodies up to 8 MiB" in out
    args = serve_args([str(tmp_path), "--engine", "embedded", "--dry-run"])
    assert cli_vllm.run_serve(args) == 0
    out = capsys.readouterr().out
    assert "pushed shards 1 GiB (256 MiB per tenant)" in out
    assert "learned shards 1 GiB (256 MiB per tenant, no token budget per shard)" in out
    assert "push bodies up to 32 MiB" in out


def test_serve_embedded_budgets_reach_the_engine(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path: flags -> run_engine_server -> EngineOptions -> intake and speculators."""
    torch = require_module("torch")
    transformers = require_module("transformers")
    import agentspec.models
    from agentspec.engine import EngineServer, GenerationRequest
    from agentspec.models import ensure_default_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    tiny = (
        transformers.LlamaForCausalLM(cfg),
        transformers.AutoTokenizer.from_pretrained(ensure_default_model()),
    )
    monkeypatch.setattr(agentspec.models, "load_model", lambda *a, **kw: tiny)
    seen: list[EngineServer] = []
    learned: dict[str, Any] = {}

    def serve_once(self: EngineServer) -> None:
        seen.append(self)
        req = GenerationRequest(prompt_ids=[5, 6, 7], max_tokens=8, key=("t", None, "S"))
        for _ in self.engine.generate(req):
            pass
        learned.update(self.engine.learned_stats())  # the engine is closed on the way out
        raise KeyboardInterrupt

    monkeypatch.setattr(EngineServer, "serve_forever", serve_once)
    with socket.socket() as s:  # a free port for the server to bind
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = serve_args([str(tmp_path), "--engine", "embedded", "--port", str(port), *FLAGS])
    assert cli_vllm.run_serve(args) == 0
    (server,) = seen
    intake = server.intake
    assert (intake.max_bytes, intake.max_tenant_bytes) == (512 << 20, 64 << 20)
    assert intake.max_body_bytes == 8 << 20
    assert intake.vocab_size == 300
    opts = server.engine.options
    assert (opts.max_learned_bytes, opts.max_tenant_learned_bytes) == (None, 100_000)
    assert opts.max_shard_tokens == 5000
    assert learned["max_bytes"] is None
    assert learned["tenants"]["t"]["max_bytes"] == 100_000
    assert learned["tenants"]["t"]["max_shard_tokens"] == 5000
