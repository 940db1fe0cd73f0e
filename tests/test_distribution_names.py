"""Distribution names: ours, never the unrelated ``agentspec`` on the package index.

The import package is ``agentspec``; its distribution is ``agentspec-suffix``
(the name ``agentspec`` on PyPI belongs to another project).  The integrations
depend on that name, and every documented install of an integration installs
the core from the checkout in the same pip command, so no resolver ever looks
our packages up on the index.
"""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
CORE = "agentspec-suffix"
INTEGRATIONS = sorted(p.parent for p in (ROOT / "integrations").glob("*/pyproject.toml"))


def _pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))["project"]


def _req_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert m, req
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def test_core_distribution_name():
    assert _pyproject(ROOT / "pyproject.toml")["name"] == CORE


def test_installed_metadata_names_the_import_package():
    assert md.version(CORE)
    assert set(md.packages_distributions().get("agentspec", [])) == {CORE}


@pytest.mark.parametrize("pkg", INTEGRATIONS, ids=lambda p: p.name)
def test_integrations_depend_on_the_core_by_its_name(pkg: Path):
    project = _pyproject(pkg / "pyproject.toml")
    names = [_req_name(r) for r in project["dependencies"]]
    assert CORE in names, names
    assert "agentspec" not in names, names
    assert project["name"] != "agentspec"
    readme = project.get("readme")
    if readme is not None:
        assert (pkg / readme).is_file(), f"{pkg.name}: readme {readme} does not exist"


def _install_commands() -> list[tuple[Path, str]]:
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("integrations/*/README.md")]
    files += [*ROOT.glob("scripts/*"), ROOT / ".ci" / "run"]
    out = []
    for f in files:
        if not f.is_file():
            continue
        text = f.read_text(encoding="utf-8").replace("\\\n", " ")
        for line in text.splitlines():
            if re.search(r"(pip install\b|\$\{PIP\[@\]\}).*\bintegrations/", line):
                out.append((f, line))
    return out


def test_every_integration_install_brings_the_core_from_the_checkout():
    cmds = _install_commands()
    assert len(cmds) >= 4, cmds  # the docs and setup scripts do install integrations
    for f, line in cmds:
        # the checkout in the same command: `-e .`, `-e "$ROOT"`, or (a deployment's
        # non-editable install) `.` / `".[extra]"`
        checkout = r"(\.|\.\[[\w,-]+\]|\"\.\[[\w,-]+\]\"|'\.\[[\w,-]+\]'|\"\$ROOT\"|\$ROOT)"
        assert re.search(r"(^|\s)(-e\s+)?" + checkout + r"(\s|$)", line), (f.name, line)


def test_no_doc_installs_agentspec_from_the_index():
    from_index = re.compile(r"pip install\s+(-U\s+)?agentspec(\s|$|\[|-vllm|-litellm)")
    for f in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("integrations/*/README.md")]:
        for line in f.read_text(encoding="utf-8").splitlines():
            assert not from_index.search(line), (f.name, line)
