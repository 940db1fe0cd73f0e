"""Seeded repositories for the CodeAct agent: small Python projects with one bug each.

Design: a `Task` is plain data -- the instruction shown to the model, the
repository's files, and a check command (a test script that prints ``OK``
and exits 0 once the bug is fixed).  `Task.seed` writes the files into an
empty directory; `Task.check` runs the check there with the same bounded
runner as the ``bash`` tool.  `snapshot` / `diff` give the final file diff
of a run (text files, ``__pycache__`` and hidden files skipped).

The bugs are one-line fixes a single ``str_replace`` can make, so a capable
model solves each in two or three steps; the tiny default model mostly does
not, which the loop must survive.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import MappingProxyType

from .tools import DEFAULT_BASH_TIMEOUT, format_bash_output, run_command

__all__ = ["TASKS", "CheckResult", "Task", "diff", "snapshot"]

_MAX_SNAPSHOT_FILES = 500
_MAX_SNAPSHOT_BYTES = 256 * 1024


@dataclass(frozen=True)
class CheckResult:
    """Whether the task's check passed, and its output (with the exit code)."""

    passed: bool
    output: str


@dataclass(frozen=True)
class Task:
    """One repository and what to do in it.

    Attributes:
        name: short id (also the seeded folder's name in ``--workdir``).
        instruction: the task as told to the model.
        files: relative POSIX path -> text content.
        check_command: a shell command run in the repository; the task is
            solved when it exits 0 and prints ``check_marker``.
    """

    name: str
    instruction: str
    files: Mapping[str, str] = field(default_factory=dict)
    check_command: str = ""
    check_marker: str = "OK"

    def __post_init__(self) -> None:
        """Check the file paths (relative, no ``..``) and freeze ``files``."""
        if not self.name or not self.instruction or not self.check_command:
            raise ValueError("a task needs a name, an instruction and a check command")
        for rel in self.files:
            p = PurePosixPath(rel)
            if p.is_absolute() or not p.parts or ".." in p.parts:
                raise ValueError(f"task {self.name}: bad file path {rel!r}")
        object.__setattr__(self, "files", MappingProxyType(dict(self.files)))

    def prompt(self) -> str:
        """The first user message: the instruction and the repository's files."""
        return f"Task: {self.instruction}\nFiles: {' '.join(sorted(self.files))}"

    def seed(self, workdir: str | os.PathLike[str]) -> Path:
        """Write the files into ``workdir`` (created if missing; must be empty).

        Raises:
            FileExistsError: ``workdir`` exists and is not an empty directory.
        """
        root = Path(workdir)
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise FileExistsError(f"the workdir must be a new or empty directory: {root}")
        root.mkdir(parents=True, exist_ok=True)
        for rel, text in self.files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        return root

    def check(
        self, workdir: str | os.PathLike[str], timeout: float = DEFAULT_BASH_TIMEOUT
    ) -> CheckResult:
        """Run the check command in ``workdir``."""
        try:
            result = run_command(self.check_command, workdir, timeout=timeout)
        except OSError as exc:
            return CheckResult(False, f"cannot run the check: {exc}")
        passed = result.exit_code == 0 and self.check_marker in result.output
        return CheckResult(passed, format_bash_output(result, timeout))


def snapshot(root: str | os.PathLike[str]) -> dict[str, str]:
    """The repository's files as ``{relative path: text}``.

    Hidden entries and ``__pycache__`` are skipped; symlinks are recorded as
    ``-> target`` (not followed), binary or oversized files as a size note.
    At most 500 files.
    """
    base = Path(root)
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in sorted(filenames):
            if name.startswith(".") or len(out) >= _MAX_SNAPSHOT_FILES:
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(base).as_posix()
            if path.is_symlink():
                out[rel] = f"-> {os.readlink(path)}\n"
                continue
            try:
                size = path.stat().st_size
                data = path.read_bytes() if size <= _MAX_SNAPSHOT_BYTES else b""
            except OSError as exc:
                out[rel] = f"<unreadable: {exc.strerror}>\n"
                continue
            if size > _MAX_SNAPSHOT_BYTES:
                out[rel] = f"<{size} bytes>\n"
                continue
            try:
                out[rel] = data.decode("utf-8")
            except UnicodeDecodeError:
                out[rel] = f"<binary, {size} bytes>\n"
    return out


def diff(before: Mapping[str, str], after: Mapping[str, str]) -> str:
    """A unified diff from ``before`` to ``after`` (`snapshot` results); empty if equal."""
    parts: list[str] = []
    for rel in sorted(set(before) | set(after)):
        old, new = before.get(rel), after.get(rel)
        if old == new:
            continue
        parts += difflib.unified_diff(
            (old or "").splitlines(keepends=True),
            (new or "").splitlines(keepends=True),
            fromfile="/dev/null" if old is None else f"a/{rel}",
            tofile="/dev/null" if new is None else f"b/{rel}",
        )
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts)


_CALC = Task(
    name="calc",
    instruction="add() in calc/ops.py returns the wrong result. "
    "Fix it so that `python test_calc.py` prints OK.",
    files={
        "calc/__init__.py": "from .ops import add, mul\n",
        "calc/ops.py": (
            "def add(a, b):\n"
            '    """Return the sum of a and b."""\n'
            "    return a - b\n"
            "\n\n"
            "def mul(a, b):\n"
            '    """Return the product of a and b."""\n'
            "    return a * b\n"
        ),
        "test_calc.py": (
            "from calc import add, mul\n\n"
            'assert add(2, 3) == 5, f"add(2, 3) returned {add(2, 3)}"\n'
            "assert mul(2, 3) == 6\n"
            'print("OK")\n'
        ),
    },
    check_command="python test_calc.py",
)

_GREET = Task(
    name="greet",
    instruction='greet() in greet.py misspells "Hello". '
    "Fix it so that `python test_greet.py` prints OK.",
    files={
        "greet.py": 'def greet(name):\n    return "Helo, " + name + "!"\n',
        "test_greet.py": (
            "from greet import greet\n\n"
            'assert greet("Ann") == "Hello, Ann!", greet("Ann")\n'
            'print("OK")\n'
        ),
    },
    check_command="python test_greet.py",
)

_STATS = Task(
    name="stats",
    instruction="largest() in stats.py returns the smallest value. "
    "Fix it so that `python test_stats.py` prints OK.",
    files={
        "stats.py": (
            "def largest(values):\n"
            '    """Return the largest of values."""\n'
            "    return min(values)\n"
        ),
        "test_stats.py": (
            "from stats import largest\n\n"
            "assert largest([3, 9, 4]) == 9, largest([3, 9, 4])\n"
            'print("OK")\n'
        ),
    },
    check_command="python test_stats.py",
)

#: The built-in tasks by name.
TASKS: Mapping[str, Task] = MappingProxyType({t.name: t for t in (_CALC, _GREET, _STATS)})
