"""The public surface of the `agentspec` package is exactly its `__all__`."""

from __future__ import annotations

import types

import agentspec

# Submodules that become attributes of the package only once someone imports them.
LAZY_SUBMODULES = {"bench", "chat", "compat", "traces"}


def test_all_imports_are_exported() -> None:
    """Every public name of the package is in the sorted __all__, and nothing else."""
    included_private_members = ["__version__"]
    public = sorted(
        name
        for name, value in vars(agentspec).items()
        if (not name.startswith("_") or name in included_private_members)
        and not (isinstance(value, types.ModuleType) and name in LAZY_SUBMODULES)
    )
    assert agentspec.__all__ == public


def test_exported_api_is_the_documented_one() -> None:
    """__all__ holds exactly the names docs/design-native.md promises."""
    assert agentspec.__all__ == [
        "BatchDrafter",
        "Cursor",
        "Draft",
        "DraftParams",
        "Speculator",
        "SuffixTree",
        "TreeStats",
        "__version__",
        "draft_batch",
        "exceptions",
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
