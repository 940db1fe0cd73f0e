"""Every public name imports from where it did before the package layout moved.

The layout of ``agentspec/`` (private subpackages per layer, see
docs/architecture.md) is an implementation detail: what users import --
``agentspec.X``, ``agentspec.compat``, ``agentspec.exceptions``, ``agentspec.fleet``,
``agentspec.engine``, ``agentspec.bench.*`` ... -- must not move with it.  The
table below is each public module's ``__all__`` as it was before the move (the
command modules ``agentspec.cli_*`` were never documented and became
``agentspec._cli``).  A name may be added to a module (extend the table); a
name that disappears, or a public module that stops importing, fails here.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import agentspec

PUBLIC_API: dict[str, tuple[str, ...]] = {
    "agentspec": (
        "AgentSpecClient",
        "AsyncAgentSpecClient",
        "BatchDrafter",
        "Cursor",
        "Draft",
        "DraftParams",
        "EndpointStatus",
        "GoodputController",
        "PushError",
        "ShardIntake",
        "ShardKey",
        "ShardPusher",
        "ShardStats",
        "ShardStore",
        "Speculator",
        "SuffixTree",
        "Tags",
        "TreeStats",
        "__version__",
        "current_tags",
        "draft_batch",
        "exceptions",
        "serve_intake",
        "session",
        "stage",
    ),
    "agentspec.bench": (
    ),
    "agentspec.bench.budget": (
        "Point",
        "add_arguments",
        "budget_for",
        "compare",
        "envelope",
        "mat_at",
        "render_tables",
        "run",
        "run_cli",
    ),
    "agentspec.bench.calibration": (
        "add_arguments",
        "calibrate_trace",
        "plot_calibration",
        "render_table",
        "run_cli",
    ),
    "agentspec.bench.entropy": (
        "EntropyResult",
        "add_arguments",
        "child_entropy",
        "run",
        "run_cli",
    ),
    "agentspec.bench.fleet": (
        "FleetResult",
        "MODES",
        "ROUTINGS",
        "add_arguments",
        "assign",
        "parse_lags",
        "parse_max_sessions",
        "parse_replicas",
        "parse_routings",
        "render_table",
        "run",
        "run_cli",
        "shuffle_sessions",
        "simulate",
    ),
    "agentspec.bench.ngram": (
        "NgramProposer",
    ),
    "agentspec.bench.oracle": (
        "Oracle",
        "longest_seen_prefix",
    ),
    "agentspec.bench.plots": (
        "plot_budget",
        "plot_replay",
        "pyplot",
    ),
    "agentspec.bench.replay": (
        "METHODS",
        "ReplayConfig",
        "Request",
        "TraceData",
        "add_arguments",
        "load_tokenizer",
        "load_trace",
        "render_tables",
        "run",
        "run_cli",
    ),
    "agentspec.bench.verifier": (
        "accept_linear",
        "accept_tree",
        "advance",
    ),
    "agentspec.chat": (
        "CHATML_TEMPLATE",
        "ChatTemplateError",
        "ChatTokenizer",
        "SessionRenderer",
        "chatml_prompt_ids",
    ),
    "agentspec.compat": (
        "SuffixDecodingCache",
        "SuffixDecodingDraft",
    ),
    "agentspec.demo": (
        "BUILTIN_SCHEMAS",
        "BuiltinQuestion",
        "COLUMNS",
        "CallRecord",
        "Check",
        "DEMO_MAX_TOKENS",
        "DEMO_PROMPTS",
        "DEMO_STOP",
        "DemoConfig",
        "DemoError",
        "DemoReport",
        "DemoResult",
        "Mismatch",
        "QuestionTiming",
        "StageSummary",
        "build_report",
        "builtin_questions",
        "compare_runs",
        "format_table",
        "run_demo",
        "write_chart",
        "write_outputs",
    ),
    "agentspec.engine": (
        "Completion",
        "DraftInput",
        "DraftLike",
        "DraftTree",
        "Drafter",
        "Engine",
        "EngineOptions",
        "EngineServer",
        "GenerateResult",
        "GenerationCancelledError",
        "GenerationRequest",
        "MIN_TEMPERATURE",
        "SAMPLING_EPS",
        "SamplingParams",
        "SpecStats",
        "SpeculatorDrafter",
        "StepStats",
        "TextDecoder",
        "TextDelta",
        "Verifier",
        "accept_sampling",
        "as_draft_tree",
        "branch_probabilities",
        "default_threads",
        "effective_temperature",
        "generate_greedy",
        "prune_draft_tree",
        "render_chat",
        "run_engine_server",
        "speculator_drafter",
        "target_probs",
    ),
    "agentspec.exceptions": (
        "AgentSpecError",
        "CapacityError",
        "DepthMismatchError",
        "InvalidArgumentError",
        "InvalidTokenError",
        "NativeMemoryError",
        "SequenceClosedError",
        "SequenceExistsError",
        "SequenceNotFoundError",
        "ShardChecksumError",
        "ShardFormatError",
        "ShardNotFoundError",
        "ShardTruncatedError",
        "ShardVersionError",
        "StoreCorruptError",
        "StoreLockedError",
        "ThreadStartError",
        "TreeClosedError",
    ),
    "agentspec.fleet": (
        "FleetConfig",
        "FleetPublisher",
        "FleetShardStats",
        "FleetSubscriber",
        "Heartbeat",
        "PublishStatus",
        "PublisherStats",
        "Redactor",
        "SubscriberStats",
        "check_identity",
        "fleet_status",
        "read_heartbeats",
        "redact_url",
        "tenant_acl_rules",
    ),
    "agentspec.models": (
        "DEFAULT_MODEL",
        "DownloadProgress",
        "MODEL_ALIASES",
        "ModelDownloadError",
        "ModelError",
        "ModelNotFoundError",
        "default_cache_dir",
        "ensure_default_model",
        "load_model",
        "resolve_model",
    ),
    "agentspec.traces": (
        "Message",
        "ROLES",
        "TraceFormatError",
        "TraceRecord",
        "TraceRequest",
        "TraceWriter",
        "iter_requests",
        "read_traces",
        "write_traces",
    ),
}


def _public_modules() -> list[str]:
    names = ["agentspec"]
    for info in pkgutil.walk_packages(agentspec.__path__, "agentspec."):
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            names.append(info.name)
    return names


@pytest.mark.parametrize(("module", "names"), sorted(PUBLIC_API.items()))
def test_every_public_name_imports_from_where_it_did(module: str, names: tuple[str, ...]) -> None:
    mod = importlib.import_module(module)
    missing = [n for n in names if n not in mod.__all__]
    assert not missing, f"{module}.__all__ lost {missing}"
    for name in names:
        if name == "__version__":
            continue
        obj = getattr(mod, name)  # AttributeError names what is gone
        assert obj is not None or name.isupper(), f"{module}.{name}"
        ns: dict[str, object] = {}
        exec(f"from {module} import {name} as _x", ns)  # the statement users write
        assert ns["_x"] is obj


def test_public_modules_are_the_ones_listed() -> None:
    # a new public module is a decision: it gets an entry (and a test) here
    assert sorted(_public_modules()) == sorted(PUBLIC_API)

