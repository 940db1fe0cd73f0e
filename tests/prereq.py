"""Missing prerequisites: one rule for every test, in one place.

A test that needs something the code under test does not make itself (the
development data under ``../shared/data``, the default model's download, an
optional Python package, ``redis-server``, vLLM, the LiteLLM environment, ...)
asks for it here:

- outside CI a missing prerequisite skips the test, with the reason;
- under CI (``CI`` set and non-empty; `.ci/run` exports ``CI=1``) it fails the
  test, since `.ci/run` provides every prerequisite on a fresh machine.

The development data is the one prerequisite `.ci/run` cannot make: it is the
``shared/data`` folder beside the checkout (`SHARED_DATA`).  Under CI its absence
fails only when ``AGENTSPEC_REQUIRE_SHARED=1`` is set, which `.ci/run` does
whenever ``../shared/data`` exists; elsewhere it skips with the reason.

Use `require` inside a test or fixture (or at module level), `requires` as a
mark (``pytestmark = requires(...)``, ``@requires(...)``), `require_module` for
an importable module and `require_shared` / `requires_shared` for files under
``../shared/data``.  Platform conditions (``/proc``, POSIX file modes) are not
prerequisites: they stay plain ``skipif`` marks.

This module is also a pytest plugin (the conftests load it): under CI the mark
`requires` gives to a missing prerequisite fails the test at setup.  The
integration suites' conftests import it before loading it as a plugin, so pytest
must not rewrite its asserts (it has none): PYTEST_DONT_REWRITE.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

#: Under CI (``CI`` set and non-empty): a missing prerequisite fails.
IN_CI = bool(os.environ.get("CI"))

#: The repository's root.
REPO = Path(__file__).resolve().parents[1]

#: The development data (traces, tokenizers): ``shared/data`` beside the checkout.
SHARED_DATA = REPO.parent / "shared" / "data"

#: Under CI with ``AGENTSPEC_REQUIRE_SHARED=1`` (`.ci/run` sets it where ``../shared/data``
#: exists), missing development data fails too.
REQUIRE_SHARED = IN_CI and os.environ.get("AGENTSPEC_REQUIRE_SHARED") == "1"

_MARK = "prerequisite_missing"


def _strict(strict: bool | None) -> bool:
    return IN_CI if strict is None else strict


def _failure(reason: str) -> str:
    return f"missing prerequisite under CI (a skip elsewhere): {reason}"


def missing(reason: str, *, strict: bool | None = None) -> NoReturn:
    """A prerequisite is missing: fail under CI (``strict``), else skip (module level too)."""
    if _strict(strict):
        pytest.fail(_failure(reason), pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(ok: object, reason: str, *, strict: bool | None = None) -> None:
    """Go on when ``ok`` holds; otherwise `missing` (``strict`` defaults to `IN_CI`)."""
    if not ok:
        missing(reason, strict=strict)


def requires(ok: object, reason: str, *, strict: bool | None = None) -> pytest.MarkDecorator:
    """The mark form of `require`: a skip mark outside CI, a failing one under it."""
    if ok:
        return pytest.mark.skipif(False, reason=reason)
    if _strict(strict):
        return getattr(pytest.mark, _MARK)(reason=reason)
    return pytest.mark.skipif(True, reason=reason)


def require_module(name: str, reason: str | None = None) -> ModuleType:
    """Import ``name``; a missing module is a missing prerequisite (under CI, a failure)."""
    if IN_CI:
        return importlib.import_module(name)  # an ImportError here fails the run
    return pytest.importorskip(name, reason=reason)


def shared(*parts: str) -> Path:
    """A path under `SHARED_DATA` (``../shared/data`` beside the checkout)."""
    return SHARED_DATA.joinpath(*parts)


def _shared_reason(paths: tuple[Path, ...]) -> tuple[bool, str]:
    absent = [str(p) for p in paths if not p.exists()]
    return not absent, f"the development data (../shared/data) is missing: {', '.join(absent)}"


def require_shared(*paths: Path) -> None:
    """`require` that every path (under `SHARED_DATA`) exists; strict under `REQUIRE_SHARED`."""
    ok, reason = _shared_reason(paths)
    require(ok, reason, strict=REQUIRE_SHARED)


def requires_shared(*paths: Path) -> pytest.MarkDecorator:
    """The mark form of `require_shared`."""
    ok, reason = _shared_reason(paths)
    return requires(ok, reason, strict=REQUIRE_SHARED)


# --- the plugin half --------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    """Register the mark `requires` puts on a test whose prerequisite is missing under CI."""
    config.addinivalue_line(
        "markers", f"{_MARK}(reason): a prerequisite is missing under CI: the test fails"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail a test marked by `requires` for a prerequisite missing under CI."""
    mark = item.get_closest_marker(_MARK)
    if mark is not None:
        pytest.fail(_failure(str(mark.kwargs["reason"])), pytrace=False)
