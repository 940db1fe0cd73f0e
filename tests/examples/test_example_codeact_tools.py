"""The CodeAct example's tools, call parser and seeded tasks (no model, no server).

Covers the text call format (`parse_tool_call`, `complete_stop`), path
confinement (``..``, absolute paths, symlinks out of the workdir),
``str_replace`` (exactly one occurrence, atomic write, file untouched on every
error), ``bash`` (cwd, minimal environment, exit codes, timeout, background
jobs killed, bounded output) and the tasks (seeding, check, snapshot / diff).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from examples.codeact.tasks import TASKS, Task, diff, snapshot  # noqa: E402
from examples.codeact.tools import (  # noqa: E402
    STOP,
    PathError,
    Toolbox,
    ToolCall,
    ToolCallError,
    complete_stop,
    format_tool_call,
    parse_tool_call,
    run_command,
    truncate_text,
)

# --- the call format ----------------------------------------------------------------------


def test_parse_bash_and_str_replace_calls() -> None:
    call = parse_tool_call("<function=bash>\n<parameter=command>ls -la</parameter>\n</function>")
    assert call == ToolCall("bash", {"command": "ls -la"})
    text = (
        "I will fix it.\n<function=str_replace>\n<parameter=path>calc/ops.py</parameter>\n"
        "<parameter=old_str>\n    return a - b\n</parameter>\n"
        "<parameter=new_str>    return a + b</parameter>\n</function>"
    )
    call = parse_tool_call(text)
    assert call.name == "str_replace"
    # One newline after the open tag / before the close tag is dropped, indentation kept.
    assert dict(call.params) == {
        "path": "calc/ops.py",
        "old_str": "    return a - b",
        "new_str": "    return a + b",
    }
    assert parse_tool_call("<function=finish>\n</function>") == ToolCall("finish", {})
    finish = parse_tool_call("<function=finish>\n<parameter=message>done</parameter>\n</function>")
    assert finish.params["message"] == "done"


def test_format_round_trips() -> None:
    call = ToolCall("str_replace", {"path": "a.py", "old_str": "x = 1", "new_str": "x = 2"})
    assert format_tool_call(call).endswith(STOP)
    assert parse_tool_call(format_tool_call(call)) == call


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Sure, the bug is in add().", "no tool call found"),
        ("<function=python>\n<parameter=code>1</parameter>\n</function>", "unknown tool 'python'"),
        ("<function=bash>\n<parameter=command>ls</parameter>\n", "cut off"),
        ("<function=bash>\n<parameter=command>ls\n</function>", "not closed"),
        (
            "<function=bash>\n<parameter=command>ls</parameter>\n"
            "<parameter=command>pwd</parameter>\n</function>",
            "more than once",
        ),
        ("<function=bash>\n<parameter=cmd>ls</parameter>\n</function>", "no parameter 'cmd'"),
        (
            "<function=str_replace>\n<parameter=path>a.py</parameter>\n</function>",
            "needs the parameter(s) old_str, new_str",
        ),
        ("<function=bash>\n</function>", "needs the parameter(s) command"),
    ],
)
def test_parse_errors_say_why(text: str, message: str) -> None:
    with pytest.raises(ToolCallError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_tool_call(text)


def test_an_unclosed_call_ends_where_the_next_begins() -> None:
    text = (
        "<function=bash>\n<parameter=command>cat a.py</parameter>\n"
        "<function=bash>\n<parameter=command>rm -rf x</parameter>\n</function>"
    )
    assert parse_tool_call(text) == ToolCall("bash", {"command": "cat a.py"})


def test_complete_stop_only_when_the_reply_stopped_inside_a_call() -> None:
    open_call = "<function=bash>\n<parameter=command>ls</parameter>\n"
    assert complete_stop(open_call, "stop") == open_call + STOP
    assert complete_stop(open_call, "length") == open_call
    assert complete_stop("no call here", "stop") == "no call here"
    closed = open_call + STOP
    assert complete_stop(closed, "stop") == closed
    assert parse_tool_call(complete_stop(open_call, "stop")).params["command"] == "ls"


def test_truncate_text_keeps_head_and_tail() -> None:
    text = "".join(f"line {i}\n" for i in range(1000))
    cut = truncate_text(text, 300)
    assert len(cut) < 360
    assert cut.startswith("line 0\n")
    assert cut.endswith("line 999\n")
    assert "characters truncated" in cut
    assert truncate_text("short", 300) == "short"
    with pytest.raises(ValueError, match="limit"):
        truncate_text("x", 0)


# --- paths ----------------------------------------------------------------------------------


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("def f():\n    return 1\n\n\ndef g():\n    return 1\n")
    (tmp_path / "outside.txt").write_text("secret\n")
    return root


def test_paths_are_confined_to_the_workdir(repo: Path, tmp_path: Path) -> None:
    tools = Toolbox(repo)
    assert tools.resolve("pkg/mod.py") == repo.resolve() / "pkg" / "mod.py"
    assert tools.resolve(str(repo / "pkg" / "mod.py")) == repo.resolve() / "pkg" / "mod.py"
    assert tools.resolve("pkg/../pkg/mod.py") == repo.resolve() / "pkg" / "mod.py"
    for bad in ("../outside.txt", str(tmp_path / "outside.txt"), "/etc/passwd", "pkg/../../x"):
        with pytest.raises(PathError, match="outside the repository"):
            tools.resolve(bad)
    (repo / "link.txt").symlink_to(tmp_path / "outside.txt")
    (repo / "linkdir").symlink_to(tmp_path)
    for bad in ("link.txt", "linkdir/outside.txt"):
        with pytest.raises(PathError, match="outside the repository"):
            tools.resolve(bad)
    for bad, message in (("", "empty"), ("  ", "empty"), ("a\x00b", "NUL")):
        with pytest.raises(PathError, match=message):
            tools.resolve(bad)
    with pytest.raises(NotADirectoryError):
        Toolbox(repo / "pkg" / "mod.py")


# --- str_replace ----------------------------------------------------------------------------


def _state(path: Path) -> tuple[bytes, int]:
    st = path.stat()
    return path.read_bytes(), st.st_mtime_ns


def test_str_replace_edits_the_single_occurrence_atomically(repo: Path) -> None:
    path = repo / "pkg" / "mod.py"
    path.chmod(0o640)
    obs = Toolbox(repo).str_replace(
        "pkg/mod.py", "def g():\n    return 1", "def g():\n    return 2"
    )
    assert not obs.error
    assert obs.text.startswith("Replaced 1 occurrence in pkg/mod.py:")
    assert "return 2" in obs.text
    assert path.read_text() == "def f():\n    return 1\n\n\ndef g():\n    return 2\n"
    assert path.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in path.parent.iterdir()) == ["mod.py"]  # no temp file left


@pytest.mark.parametrize(
    ("file", "old", "new", "message"),
    [
        ("pkg/mod.py", "return 1", "return 3", "occurs 2 times"),
        ("pkg/mod.py", "return 7", "return 3", "was not found"),
        ("pkg/mod.py", "", "x", "old_str is empty"),
        ("pkg/mod.py", "def f", "def f", "same as old_str"),
        ("pkg", "a", "b", "a directory"),
        ("pkg/none.py", "a", "b", "no such file"),
        ("../outside.txt", "secret", "public", "outside the repository"),
        ("link.txt", "secret", "public", "outside the repository"),
        ("bin.dat", "a", "b", "not a UTF-8 text file"),
    ],
)
def test_str_replace_errors_leave_files_untouched(
    repo: Path, tmp_path: Path, file: str, old: str, new: str, message: str
) -> None:
    (repo / "link.txt").symlink_to(tmp_path / "outside.txt")
    (repo / "bin.dat").write_bytes(b"a\xff\xfeb")
    watched = [repo / "pkg" / "mod.py", tmp_path / "outside.txt", repo / "bin.dat"]
    before = [_state(p) for p in watched]
    obs = Toolbox(repo).str_replace(file, old, new)
    assert obs.error
    assert obs.text.startswith("ERROR: ")
    assert message in obs.text
    assert [_state(p) for p in watched] == before
    assert sorted(p.name for p in (repo / "pkg").iterdir()) == ["mod.py"]


def test_overlapping_occurrences_count(repo: Path) -> None:
    (repo / "a.txt").write_text("aaa\n")
    obs = Toolbox(repo).str_replace("a.txt", "aa", "b")
    assert obs.error
    assert "occurs 2 times" in obs.text
    assert (repo / "a.txt").read_text() == "aaa\n"


def test_str_replace_refuses_oversized_files(repo: Path) -> None:
    (repo / "big.txt").write_text("x" * 200 + "needle")
    obs = Toolbox(repo, max_file_bytes=100).str_replace("big.txt", "needle", "pin")
    assert obs.error
    assert "larger than 100 bytes" in obs.text


def test_execute_dispatches_calls(repo: Path) -> None:
    tools = Toolbox(repo)
    assert tools.execute(ToolCall("finish", {})).text == "Finished."
    obs = tools.execute(ToolCall("bash", {"command": "cat pkg/mod.py | head -1"}))
    assert obs.text == "def f():\n[exit code 0]"
    obs = tools.execute(
        ToolCall("str_replace", {"path": "pkg/mod.py", "old_str": "f()", "new_str": "h()"})
    )
    assert not obs.error
    assert "def h():" in (repo / "pkg" / "mod.py").read_text()
    assert tools.execute(ToolCall("rm", {})).error


# --- bash -------------------------------------------------------------------------------------


def test_bash_runs_in_the_workdir_with_a_minimal_env(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CODEACT_LEAK_CHECK", "leaked")
    tools = Toolbox(repo)
    obs = tools.bash("pwd; echo HOME=$HOME; echo LEAK=${CODEACT_LEAK_CHECK:-none}")
    assert not obs.error
    assert obs.text.splitlines() == [
        str(repo.resolve()),
        f"HOME={repo.resolve()}",
        "LEAK=none",
        "[exit code 0]",
    ]
    obs = tools.bash("python -c 'import sys; print(sys.version_info[0])'; echo err >&2; exit 3")
    assert not obs.error  # a failing command is a result, not a tool error
    assert obs.text == "3\nerr\n[exit code 3]"
    assert tools.bash("   ").error
    assert tools.bash("true").text == "[exit code 0]"
    assert tools.bash("read x; echo got=${x:-nothing}").text == "got=nothing\n[exit code 0]"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(") ", 1)[1].startswith("Z")  # a zombie is dead
    except (OSError, IndexError):
        return True


def test_bash_timeout_kills_the_whole_group(repo: Path) -> None:
    tools = Toolbox(repo, bash_timeout=0.5)
    start = time.monotonic()
    obs = tools.bash("echo started; sleep 30 & echo $! > bg.pid; sleep 30")
    assert obs.error
    assert obs.text == "started\n[timed out after 0.5s; the command was killed]"
    assert time.monotonic() - start < 20
    pid = int((repo / "bg.pid").read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)


def test_background_jobs_do_not_outlive_the_call(repo: Path) -> None:
    obs = Toolbox(repo).bash("sleep 30 >/dev/null 2>&1 & echo $! > bg.pid; echo done")
    assert obs.text == "done\n[exit code 0]"
    pid = int((repo / "bg.pid").read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)


def test_bash_output_is_bounded_head_and_tail(repo: Path) -> None:
    tools = Toolbox(repo, max_output_bytes=1000)
    obs = tools.bash("seq 1 100000")
    lines = obs.text.splitlines()
    assert lines[:3] == ["1", "2", "3"]
    assert lines[-2:] == ["100000", "[exit code 0]"]
    assert "bytes truncated" in obs.text
    assert len(obs.text) < 1200
    small = run_command("printf 'abc'", repo, max_output_bytes=3)
    assert (small.output, small.truncated_bytes, small.exit_code) == ("abc", 0, 0)
    with pytest.raises(ValueError, match="timeout"):
        run_command("true", repo, timeout=0)


# --- tasks ----------------------------------------------------------------------------------


def test_tasks_seed_check_and_diff(tmp_path: Path) -> None:
    fixes = {
        "calc": ("calc/ops.py", "return a - b", "return a + b", "+    return a + b\n"),
        "greet": ("greet.py", '"Helo, "', '"Hello, "', '+    return "Hello, " + name + "!"\n'),
        "stats": ("stats.py", "min(values)", "max(values)", "+    return max(values)\n"),
    }
    assert set(TASKS) == set(fixes)
    for name, task in TASKS.items():
        root = task.seed(tmp_path / name)
        assert task.prompt().startswith(f"Task: {task.instruction}\nFiles: ")
        before = snapshot(root)
        assert before == dict(task.files)
        failing = task.check(root)
        assert not failing.passed
        assert "AssertionError" in failing.output
        path, old, new, added = fixes[name]
        assert not Toolbox(root).str_replace(path, old, new).error
        passing = task.check(root)
        assert passing.passed, passing.output
        assert passing.output == "OK\n[exit code 0]"
        assert not (root / "__pycache__").exists()  # PYTHONDONTWRITEBYTECODE
        change = diff(before, snapshot(root))
        assert f"--- a/{path}\n+++ b/{path}\n" in change
        assert added in change
        with pytest.raises(FileExistsError):
            task.seed(root)


def test_snapshot_and_diff_cover_added_removed_and_skipped_files(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "__pycache__").mkdir(parents=True)
    (root / "__pycache__" / "x.pyc").write_bytes(b"\x00")
    (root / ".hidden").write_text("h")
    (root / "a.txt").write_text("one\n")
    (root / "b.bin").write_bytes(b"\xff\x00")
    before = snapshot(root)
    assert before == {"a.txt": "one\n", "b.bin": "<binary, 2 bytes>\n"}
    (root / "a.txt").unlink()
    (root / "c.txt").write_text("new\n")
    change = diff(before, snapshot(root))
    assert "--- a/a.txt\n+++ /dev/null\n" in change
    assert "--- /dev/null\n+++ b/c.txt\n" in change
    assert diff(before, before) == ""


def test_task_definitions_are_checked() -> None:
    with pytest.raises(ValueError, match="bad file path"):
        Task("t", "do it", {"../x.py": ""}, "true")
    with pytest.raises(ValueError, match="needs a name"):
        Task("t", "", {}, "true")
