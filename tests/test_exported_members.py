"""The public surface of the `agentspec` package is exactly its `__all__`."""

from __future__ import annotations

import types

import agentspec

# Submodules that become attributes of the package only once someone imports them.
LAZY_SUBMODULES = {
    "bench",
    "chat",
    "cli_fleet",
    "cli_push",
    "cli_shards",
    "cli_vllm",
    "cli_demo",
    "demo",
    "compat",
    "engine",
    "fleet",
    "models",
    "protocol",
    "integration",
    "metrics",
    "traces",
}
# Names loaded on first access (they import openai).
LAZY_NAMES = {"AgentSpecClient", "AsyncAgentSpecClient"}


def test_all_imports_are_exported() -> None:
    """Every public name of the package is in the sorted __all__, and nothing else."""
    included_private_members = ["__version__"]
    public = sorted(
        {
            name
            for name, value in vars(agentspec).items()
            if (not name.startswith("_") or name in included_private_members)
            and not (isinstance(value, types.ModuleType) and name in LAZY_SUBMODULES)
        }
        | LAZY_NAMES
    )
    assert agentspec.__all__ == public
    for name in agentspec.__all__:
        assert getattr(agentspec, name) is not None


def test_exported_api_is_the_documented_one() -> None:
    """__all__ holds exactly the names docs/design-native.md and design-client.md promise."""
    assert agentspec.__all__ == [
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
        "confidence_table",
        "current_tags",
        "draft_batch",
        "exceptions",
        "serve_intake",
        "session",
        "stage",
    ]


def test_every_export_is_documented() -> None:
    """Each exported class, function and module has a docstring."""
    for name in agentspec.__all__:
        value = getattr(agentspec, name)
        if name == "__version__":
            assert isinstance(value, str)
            assert value
        else:
            assert value.__doc__, name


def test_compat_exports() -> None:
    """agentspec.compat exports arctic's two names."""
    from agentspec import compat

    assert compat.__all__ == ["SuffixDecodingCache", "SuffixDecodingDraft"]


def test_fleet_exports_are_documented_and_typed() -> None:
    """agentspec.fleet: the fleet's public names, each documented, each from the private module."""
    from agentspec import fleet

    assert fleet.__all__ == sorted(fleet.__all__)
    public = {n for n in vars(fleet) if not n.startswith("_") and n != "annotations"}
    assert public == set(fleet.__all__)
    for name in fleet.__all__:
        assert getattr(fleet, name).__doc__, name
    assert "FleetSubscriber" in (fleet.__doc__ or "")
