"""scripts/check_imports.py: the package has no import circle and no import up a layer.

The real tree must be clean; small fake trees show that each rule fails
when broken (a circle through a function-level import, an import of a
higher layer under ``TYPE_CHECKING``, a module in no layer).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "check_imports.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


check_imports = _load()


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in {"agentspec/__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_package_is_clean() -> None:
    assert check_imports.check(REPO) == []


def test_the_script_passes_on_the_package() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no circle" in proc.stdout


def test_every_module_of_the_package_is_in_a_layer() -> None:
    for module in check_imports.module_files(REPO):
        assert check_imports.layer_of(module) is not None, module


def test_a_clean_fake_tree_passes(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "agentspec/_core/__init__.py": "",
            "agentspec/_core/tree.py": "from agentspec.exceptions import X\n",
            "agentspec/_store/__init__.py": "",
            "agentspec/_store/store.py": "from agentspec._core import tree\n",
            "agentspec/exceptions.py": "",
        },
    )
    assert check_imports.check(root) == []


BROKEN = {
    "an import up a layer, under TYPE_CHECKING": (
        {
            "agentspec/_core/__init__.py": "",
            "agentspec/_core/tree.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from agentspec._store.store import ShardStore\n"
            ),
            "agentspec/_store/__init__.py": "",
            "agentspec/_store/store.py": "",
        },
        [
            "tree.py:3: ",
            "agentspec._core.tree (core) imports agentspec._store.store (store), a higher layer",
        ],
    ),
    "a circle through a function-level import": (
        {
            "agentspec/_core/__init__.py": "",
            "agentspec/_core/draft.py": "def f():\n    from agentspec._core import tree\n",
            "agentspec/_core/tree.py": "from agentspec._core.draft import f\n",
        },
        [
            "import circle: ",
            "agentspec._core.draft -> agentspec._core.tree (line 2)",
            "agentspec._core.tree -> agentspec._core.draft (line 1)",
        ],
    ),
    "a relative import of a higher layer": (
        {
            "agentspec/_core/__init__.py": "",
            "agentspec/_core/tree.py": "from ..fleet import x\n",
            "agentspec/fleet.py": "",
        },
        ["agentspec._core.tree (core) imports agentspec.fleet (fleet)"],
    ),
    "an integration importing a private module": (
        {
            "agentspec/_core/__init__.py": "",
            "agentspec/_core/tree.py": "",
            "integrations/x/agentspec_x/__init__.py": "",
            "integrations/x/agentspec_x/m.py": "from agentspec._core.tree import SuffixTree\n",
        },
        ["m.py:1: ", "agentspec_x.m imports agentspec._core.tree, a private module"],
    ),
    "an integration importing a private engine module": (
        {
            "agentspec/engine/__init__.py": "",
            "agentspec/engine/_openai.py": "",
            "integrations/x/agentspec_x/__init__.py": "from agentspec.engine import _openai\n",
        },
        ["agentspec_x imports agentspec.engine._openai, a private module"],
    ),
    "an integration loading a private module by name": (
        {
            "agentspec/_util/__init__.py": "",
            "integrations/x/agentspec_x/__init__.py": (
                "import importlib\nlog = importlib.import_module('agentspec._util')\n"
            ),
        },
        ["__init__.py:2: ", "agentspec_x imports agentspec._util, a private module"],
    ),
    "the package loading an integration by name": (
        {
            "agentspec/_cli/__init__.py": "",
            "agentspec/_cli/vllm.py": (
                "import importlib\n"
                "def check():\n"
                "    importlib.import_module('agentspec_x.config')\n"
            ),
            "integrations/x/agentspec_x/__init__.py": "",
            "integrations/x/agentspec_x/config.py": "",
        },
        ["vllm.py:3: ", "agentspec._cli.vllm imports agentspec_x.config, an integration"],
    ),
    "the package importing an integration": (
        {
            "agentspec/_cli/__init__.py": "",
            "agentspec/_cli/vllm.py": "from agentspec_x import config\n",
            "integrations/x/agentspec_x/__init__.py": "",
        },
        ["agentspec._cli.vllm imports agentspec_x.config, an integration"],
    ),
    "a load by name up a layer": (
        {
            "agentspec/_core/__init__.py": "",
            "agentspec/_core/tree.py": "__import__('agentspec._store.store')\n",
            "agentspec/_store/__init__.py": "",
            "agentspec/_store/store.py": "",
        },
        ["agentspec._core.tree (core) imports agentspec._store.store (store), a higher layer"],
    ),
    "a load by a computed name": (
        {
            "agentspec/_core/__init__.py": "",
            "agentspec/_core/tree.py": (
                "from importlib import import_module\nimport_module('agentspec.' + 'x')\n"
            ),
        },
        ["tree.py:2: ", "loads a module whose name is not a string literal"],
    ),
}


def test_an_integration_on_the_public_api_passes(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "agentspec/protocol.py": "",
            "agentspec/_util/__init__.py": "",
            "agentspec/integration/__init__.py": "from agentspec._util import log\n",
            "integrations/x/agentspec_x/__init__.py": (
                "import agentspec\n"
                "from agentspec.protocol import DEFAULT_TENANT\n"
                "from agentspec.integration import get_logger\n"
                "from . import m\n"
            ),
            "integrations/x/agentspec_x/m.py": "from agentspec_x import n\n",
            "integrations/x/tests/test_x.py": "from agentspec._util import log\n",
        },
    )
    assert check_imports.check(root) == []


def test_the_integrations_are_checked() -> None:
    modules = check_imports.integration_files(REPO)
    assert "agentspec_vllm.proposer" in modules
    assert "agentspec_litellm.hook" in modules
    assert not any(".tests" in m or m.startswith("tests") for m in modules)


def test_the_protocol_is_foundation() -> None:
    # the protocol module may be imported by every layer and every integration
    assert check_imports.layer_of("agentspec.protocol") == 0


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_rule_fails(tmp_path: Path, case: str) -> None:
    files, expected = BROKEN[case]
    problems = check_imports.check(_tree(tmp_path, files))
    assert len(problems) == 1, problems
    for part in expected:
        assert part in problems[0]


def test_a_module_in_no_layer_fails(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"agentspec/_misc.py": ""})
    assert check_imports.check(root) == [
        "agentspec._misc: in no layer (add it to LAYERS in check_imports.py)"
    ]


@pytest.mark.parametrize("module", ["agentspec", "agentspec.__main__", "agentspec._cli.vllm"])
def test_the_facade_and_the_cli_are_on_top(module: str) -> None:
    # the facade sits above the client; the command line above everything
    layer = check_imports.layer_of(module)
    assert layer is not None
    assert layer > check_imports.layer_of("agentspec._client.client")
