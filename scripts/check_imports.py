#!/usr/bin/env python3
"""Check the package's import graph: no circles, no import pointing up a layer.

Reads every module under ``agentspec/`` with `ast` (nothing is imported or
run) and collects each ``import agentspec...`` / ``from agentspec... import``
it makes -- at module level, inside functions and under ``TYPE_CHECKING``
alike: an import deferred into a function still ties the two modules together.
A ``from package import name`` where ``name`` is a submodule counts as an import
of that submodule.

A module loaded by name -- ``importlib.import_module("...")`` or
``__import__("...")`` -- counts as imported too; such a load must name its
module with a string literal, or the check cannot follow it.

Rules, each failing the check (exit 1) with every offending edge named:

1. **No circles**: the module graph has no cycle (each strongly connected
   component of more than one module is printed with the edges that close it).
2. **Layers point down**: every module belongs to the first entry of `LAYERS`
   whose prefix matches it; a module may import its own layer and the layers
   listed before it, never one listed after it.  A module that no prefix
   matches is an error too, so a new module has to be placed on purpose.
3. **The integrations sit on top**: every package under ``integrations/*/``
   (``agentspec_vllm``, ``agentspec_litellm``, ...) builds on the public API
   only -- an import or load of ``agentspec._*`` (or of any module with a
   private part, ``agentspec.engine._openai``) from one fails -- and the
   package never imports or loads an integration (an arrow upwards).

``--graph`` prints the edges between layers (with counts), the map that
docs/architecture.md draws.  Run by ``scripts/test``; ``python
scripts/check_imports.py`` from the repository root.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "agentspec"

#: Lowest layer first: ``(name, prefixes)``.  A prefix names a module or a
#: whole package; ``agentspec`` itself names only the package's ``__init__``
#: (the public facade), not everything under it.  docs/architecture.md
#: describes each layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "agentspec.exceptions",
            "agentspec._util",
            "agentspec.traces",
            "agentspec.chat",
            "agentspec.models",
            "agentspec.protocol",
            "agentspec.metrics",
        ),
    ),
    ("core", ("agentspec._core", "agentspec.compat")),
    ("fleet", ("agentspec._fleet", "agentspec.fleet")),
    ("store", ("agentspec._store",)),
    ("push", ("agentspec._push",)),
    ("client", ("agentspec._client",)),
    ("facade", ("agentspec",)),
    ("integration", ("agentspec.integration",)),
    ("engine", ("agentspec.engine",)),
    ("bench", ("agentspec.bench",)),
    ("demo", ("agentspec.demo",)),
    ("cli", ("agentspec._cli", "agentspec.__main__")),
]

#: Compiled extension modules (no source to read; the binding imports them).
EXTENSIONS = frozenset({"agentspec._agentspec_cffi"})

#: The folder whose ``*/<package>/`` directories are the integrations.
INTEGRATIONS = "integrations"

#: Calls that load a module by name: ``importlib.import_module(name)``,
#: ``import_module(name)`` (imported from importlib) and ``__import__(name)``.
_LOADERS = frozenset({"import_module", "__import__"})


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the package."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def is_private(name: str) -> bool:
    """Whether a dotted ``agentspec...`` name has a private part (``_core``, ``_openai``)."""
    return name.split(".")[0] == PACKAGE and any(p.startswith("_") for p in name.split(".")[1:])


def integration_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every package under ``integrations/*/``."""
    out = {}
    for init in sorted((root / INTEGRATIONS).glob("*/*/__init__.py")):
        pkg = init.parent
        if pkg.name == "tests":
            continue
        for path in sorted(pkg.rglob("*.py")):
            parts = [pkg.name, *path.relative_to(pkg).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve_from(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_pkg:
        base.pop()
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def loads_of(tree: ast.AST) -> Iterator[tuple[str | None, int]]:
    """``(module name, line)`` of each load by name (None: not a string literal)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = (
            func.attr
            if isinstance(func, ast.Attribute)
            else func.id
            if isinstance(func, ast.Name)
            else None
        )
        if name not in _LOADERS or not node.args:
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            yield arg.value, node.lineno
        else:
            yield None, node.lineno


def imported_names(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """``(dotted name, line)`` of everything ``module`` imports or loads by name.

    A ``from X import a`` yields ``X.a`` (``a`` may be a submodule), or ``X``
    alone when ``X`` is private already; a load whose name is not a string
    literal yields ``""``.  Each name is yielded once per line.
    """
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    seen = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve_from(module, is_pkg, node)
            names = [target if is_private(target) else f"{target}.{a.name}" for a in node.names]
        for name in names:
            if (name, node.lineno) not in seen:
                seen.add((name, node.lineno))
                yield name, node.lineno
    for name, line in loads_of(tree):
        yield name or "", line


def imports_of(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """``(imported module, line)`` for each package module ``module`` imports."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    for name, line in loads_of(tree):
        if name is not None and (name == PACKAGE or name.startswith(PACKAGE + ".")):
            yield _known_prefix(name, known), line
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in EXTENSIONS:
                    continue
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    yield _known_prefix(alias.name, known), node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve_from(module, is_pkg, node)
            if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in EXTENSIONS or target in EXTENSIONS:
                    continue
                yield (sub if sub in known else _known_prefix(target, known)), node.lineno


def _known_prefix(name: str, known: set[str]) -> str:
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def layer_of(module: str) -> int | None:
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if module == p or (p != PACKAGE and module.startswith(p + ".")):
                return i
    return None


def integration_problems(root: Path, files: dict[str, Path]) -> list[str]:
    """Rule 3: the integrations import public modules only; the package never
    imports or loads an integration."""
    integrations = integration_files(root)
    tops = {m.split(".")[0] for m in integrations}
    problems = []
    for module, path in integrations.items():
        for name, line in imported_names(module, path):
            where = f"{path.relative_to(root)}:{line}: {module}"
            if name == "":
                problems.append(f"{where} loads a module whose name is not a string literal")
            elif is_private(name):
                problems.append(
                    f"{where} imports {name}, a private module (use the public API: "
                    "agentspec, agentspec.protocol, agentspec.integration, ...)"
                )
    for module, path in files.items():
        for name, line in imported_names(module, path):
            where = f"{path.relative_to(root)}:{line}: {module}"
            if name == "":
                problems.append(f"{where} loads a module whose name is not a string literal")
            elif name.split(".")[0] in tops:
                problems.append(
                    f"{where} imports {name}, an integration (integrations build on the "
                    "package, never the other way round)"
                )
    return problems


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def check(root: Path, show_graph: bool = False) -> list[str]:
    """Every problem found, one line each (empty: the graph is clean)."""
    files = module_files(root)
    known = set(files)
    edges: dict[str, set[str]] = {m: set() for m in files}
    where: dict[tuple[str, str], int] = {}
    problems = []
    for module, path in files.items():
        for target, line in imports_of(module, path, known):
            if target == module or target not in known:
                continue
            edges[module].add(target)
            where.setdefault((module, target), line)
    for module in sorted(files):
        if layer_of(module) is None:
            problems.append(f"{module}: in no layer (add it to LAYERS in {Path(__file__).name})")
    layer_edges: Counter[tuple[str, str]] = Counter()
    for module in sorted(edges):
        lm = layer_of(module)
        for target in sorted(edges[module]):
            lt = layer_of(target)
            if lm is None or lt is None:
                continue
            if lm != lt:
                layer_edges[(LAYERS[lm][0], LAYERS[lt][0])] += 1
            if lt > lm:
                problems.append(
                    f"{files[module].relative_to(root)}:{where[(module, target)]}: "
                    f"{module} ({LAYERS[lm][0]}) imports {target} ({LAYERS[lt][0]}), "
                    "a higher layer"
                )
    problems += integration_problems(root, files)
    for comp in cycles(edges):
        inside = [
            f"{m} -> {t} (line {where[(m, t)]})"
            for m in comp
            for t in sorted(edges[m])
            if t in comp
        ]
        problems.append("import circle: " + "; ".join(inside))
    if show_graph:
        for (a, b), n in sorted(layer_edges.items()):
            print(f"{a:>10} -> {b:<10} {n}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=ROOT, help="repository root")
    p.add_argument("--graph", action="store_true", help="print the edges between layers")
    args = p.parse_args(argv)
    problems = check(args.root, args.graph)
    for line in problems:
        print(line)
    if problems:
        print(f"check_imports: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    n = len(module_files(args.root))
    k = len(integration_files(args.root))
    print(
        f"check_imports: {n} modules, no circle, every import points down a layer; "
        f"{k} integration modules on the public API"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
