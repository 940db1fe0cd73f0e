"""The suite's warning filters: a deprecation raised for agentspec_litellm's code fails."""

from __future__ import annotations

import warnings

import pytest


@pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning])
@pytest.mark.parametrize("module", ["agentspec_litellm.hook", "agentspec_litellm.outputs"])
def test_a_deprecation_in_our_code_is_an_error(category: type[Warning], module: str) -> None:
    # What a dependency's deprecated API reports (stacklevel=2) when the hook calls it.
    with pytest.raises(category):
        warnings.warn_explicit("deprecated", category, f"{module}.py", 1, module, registry={})
