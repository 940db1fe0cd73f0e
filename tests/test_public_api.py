"""Every public name imports from where it did before the package layout moved.

The layout of ``agentspec/`` (private subpackages per layer, see
docs/architecture.md) is an implementation detail: what users import --
``agentspec.X``, ``agentspec.compat``, ``agentspec.exceptions``, ``agentspec.fleet``,
``agentspec.engine``, ``agentspec.bench.*`` ... -- must not move with it.
``tests/public_api.txt`` lists each public module's ``__all__`` as it was
before the move (the command modules ``agentspec.cli_*`` were never
documented and became ``agentspec._cli``).  A name may be added to a module
(extend the list); a name that disappears, or a public module that stops
importing, fails here.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

import agentspec

API_FILE = Path(__file__).with_name("public_api.txt")


def _read_api(path: Path) -> dict[str, tuple[str, ...]]:
    """``[module]`` headers, each followed by its names; ``#`` starts a comment."""
    api: dict[str, list[str]] = {}
    names: list[str] | None = None
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            names = api.setdefault(line[1:-1], [])
        elif names is None:
            raise ValueError(f"{path}: {line!r} comes before any [module] line")
        else:
            names.append(line)
    return {m: tuple(n) for m, n in api.items()}


PUBLIC_API = _read_api(API_FILE)


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
