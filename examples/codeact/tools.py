"""The CodeAct agent's tools (``bash``, ``str_replace``, ``finish``) and their text call format.

Design: the embedded engine has no native tool calling, so calls travel as
text, in the OpenHands "non-native" style::

    <function=str_replace>
    <parameter=path>calc/ops.py</parameter>
    <parameter=old_str>return a - b</parameter>
    <parameter=new_str>return a + b</parameter>
    </function>

The agent asks for completions with the stop string `STOP` (``</function>``);
servers drop the stop text, so `complete_stop` appends it back before
`parse_tool_call` reads the reply.  Parsing is strict about what it accepts
(one known tool, every required parameter exactly once, no unknown or
unclosed parameter) and raises `ToolCallError` with a message meant for the
model; the loop sends that back as the observation, never crashing.

`Toolbox` runs calls inside one directory, the workdir:

- paths are resolved (symlinks included) and must stay inside the workdir;
- ``str_replace`` edits UTF-8 text files only when ``old_str`` occurs exactly
  once (overlapping matches count), and writes atomically (temp file in the
  same folder, fsync, rename), keeping the file's mode; on any error the file
  is untouched and the observation says why;
- ``bash`` runs ``bash -c`` with ``cwd`` = workdir, a minimal environment
  (``PATH``, ``HOME`` = workdir, UTF-8 locale, no bytecode files), no stdin,
  a timeout, and its own process group, which is killed when the command
  ends or times out (background jobs do not outlive the call).  Output
  (stdout + stderr) is kept to a bound, head and tail, while the rest is
  drained and counted.

``bash`` is not a security sandbox: a command can still name absolute paths
outside the workdir.  Run the example only on trusted models and machines.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = [
    "DEFAULT_BASH_TIMEOUT",
    "DEFAULT_MAX_OUTPUT_BYTES",
    "STOP",
    "TOOL_PARAMETERS",
    "CommandResult",
    "Observation",
    "PathError",
    "ToolCall",
    "ToolCallError",
    "Toolbox",
    "complete_stop",
    "format_bash_output",
    "format_tool_call",
    "minimal_env",
    "parse_tool_call",
    "run_command",
    "truncate_text",
]

#: The stop string of every agent step; servers leave it out of the text.
STOP = "</function>"
#: Seconds a ``bash`` call may run by default.
DEFAULT_BASH_TIMEOUT = 10.0
#: Bytes of ``bash`` output kept by default (head and tail).
DEFAULT_MAX_OUTPUT_BYTES = 8192
#: Largest file ``str_replace`` edits.
MAX_FILE_BYTES = 1 << 20

#: Each tool's ``(required, optional)`` parameters.
TOOL_PARAMETERS: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = MappingProxyType(
    {
        "bash": (("command",), ()),
        "str_replace": (("path", "old_str", "new_str"), ()),
        "finish": ((), ("message",)),
    }
)

_FUNCTION = re.compile(r"<function=([^>\s]*)>")
_PARAM_OPEN = re.compile(r"<parameter=([^>\s]*)>")
_PARAM = re.compile(r"<parameter=([^>\s]*)>(.*?)</parameter>", re.DOTALL)
_KILL_GRACE_S = 2.0  # seconds to wait for the output reader after the group is killed


class ToolCallError(ValueError):
    """A reply holds no usable tool call; the message is written for the model."""


class PathError(ValueError):
    """A path names nothing inside the workdir (empty, NUL, or escaping it)."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its parameters (each given once)."""

    name: str
    params: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """``{"name": ..., "params": {...}}``."""
        return {"name": self.name, "params": dict(self.params)}


@dataclass(frozen=True)
class Observation:
    """What a call produced, as sent back to the model.

    ``error`` is True when the call could not be carried out as asked (bad
    parameters, a path outside the workdir, ``old_str`` not unique, a
    timeout); a command exiting non-zero is a normal result, not an error.
    """

    text: str
    error: bool = False


def format_tool_call(call: ToolCall) -> str:
    """``call`` in the text format (what a well-behaved model writes), `STOP` included."""
    lines = [f"<function={call.name}>"]
    lines += [f"<parameter={k}>{v}</parameter>" for k, v in call.params.items()]
    lines.append(STOP)
    return "\n".join(lines)


def complete_stop(text: str, finish_reason: str | None) -> str:
    """``text`` with `STOP` appended when the reply ended on it (the server dropped it).

    Only a reply that stopped (``finish_reason == "stop"``) inside an open
    ``<function=...>`` block gets it; a reply cut off by ``max_tokens`` stays
    as it is, so `parse_tool_call` can tell it was truncated.
    """
    if finish_reason == "stop" and STOP not in text and _FUNCTION.search(text):
        return text + STOP
    return text


def _param_value(name: str, value: str) -> str:
    """Drop one newline after the open tag and one before the close tag (block style)."""
    if name == "command":
        return value.strip()
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def parse_tool_call(text: str) -> ToolCall:
    """The first tool call in ``text`` (text before it is ignored, as a thought).

    The call runs from ``<function=NAME>`` to `STOP`, or to the next
    ``<function=`` tag when the model started another call without closing
    this one.

    Raises:
        ToolCallError: no call, an unknown tool, a call cut off before its end,
            an unclosed, unknown, repeated or missing parameter.
    """
    tools = ", ".join(TOOL_PARAMETERS)
    match = _FUNCTION.search(text)
    if match is None:
        raise ToolCallError(f"no tool call found; reply with one <function=NAME> block ({tools})")
    name = match.group(1)
    if name not in TOOL_PARAMETERS:
        raise ToolCallError(f"unknown tool {name!r}; the tools are {tools}")
    rest = text[match.end() :]
    ends = [rest.find(STOP)]
    following = _FUNCTION.search(rest)
    if following is not None:
        ends.append(following.start())
    ends = [e for e in ends if e >= 0]
    if not ends:
        raise ToolCallError(f"the call to {name} was cut off before {STOP}; write less")
    body = rest[: min(ends)]
    required, optional = TOOL_PARAMETERS[name]
    params: dict[str, str] = {}
    pos = 0
    while (opening := _PARAM_OPEN.search(body, pos)) is not None:
        param = _PARAM.match(body, opening.start())
        key = opening.group(1)
        if param is None:
            raise ToolCallError(f"<parameter={key}> is not closed with </parameter>")
        if key not in required and key not in optional:
            allowed = ", ".join(required + optional) or "none"
            raise ToolCallError(f"{name} has no parameter {key!r} (parameters: {allowed})")
        if key in params:
            raise ToolCallError(f"parameter {key!r} of {name} is given more than once")
        params[key] = _param_value(key, param.group(2))
        pos = param.end()
    missing = [k for k in required if k not in params]
    if missing:
        raise ToolCallError(f"{name} needs the parameter(s) {', '.join(missing)}")
    return ToolCall(name, params)


def truncate_text(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping head and tail with a marker."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if len(text) <= limit:
        return text
    tail = limit // 3
    head = limit - tail
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters truncated ...]\n{text[len(text) - tail :]}"


# --- running commands -----------------------------------------------------------------------


def minimal_env(home: str | os.PathLike[str]) -> dict[str, str]:
    """The environment of commands: a short ``PATH`` (this Python's folder first), ``HOME``."""
    path = [str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]
    return {
        "PATH": os.pathsep.join(dict.fromkeys(path)),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
        "TERM": "dumb",
    }


class _Capture:
    """Output kept to ``limit`` bytes: the first half and the last half, the rest counted."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.head_limit = limit - limit // 2
        self.tail_limit = limit // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail_limit > 0:
            self.tail += chunk
            extra = len(self.tail) - self.tail_limit
            if extra > 0:
                del self.tail[:extra]

    def text(self) -> tuple[str, int]:
        """The kept output (decoded, bad bytes replaced) and the bytes left out."""
        dropped = self.total - len(self.head) - len(self.tail)
        if dropped <= 0:
            return bytes(self.head + self.tail).decode("utf-8", "replace"), 0
        head = bytes(self.head).decode("utf-8", "replace")
        tail = bytes(self.tail).decode("utf-8", "replace")
        return f"{head}\n[... {dropped} bytes truncated ...]\n{tail}", dropped


@dataclass(frozen=True)
class CommandResult:
    """A finished command: exit code (None when killed on timeout), output, what was cut."""

    exit_code: int | None
    output: str
    timed_out: bool = False
    truncated_bytes: int = 0


def _drain(fd: int, capture: _Capture) -> None:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        capture.feed(chunk)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_command(
    command: str,
    cwd: str | os.PathLike[str],
    *,
    timeout: float = DEFAULT_BASH_TIMEOUT,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    env: Mapping[str, str] | None = None,
) -> CommandResult:
    """Run ``bash -c command`` in ``cwd``; stdout and stderr together, bounded.

    The command gets its own process group, killed when the shell exits or
    after ``timeout`` seconds.  ``env`` defaults to `minimal_env` (``cwd``).

    Raises:
        OSError: bash cannot be started.
        ValueError: a non-positive timeout or output bound.
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    if max_output_bytes < 1:
        raise ValueError(f"max_output_bytes must be >= 1, got {max_output_bytes}")
    environ = dict(env) if env is not None else minimal_env(cwd)
    bash = shutil.which("bash", path=environ.get("PATH")) or "/bin/bash"
    proc = subprocess.Popen(  # running the model's command is this tool's job
        [bash, "--noprofile", "--norc", "-c", command],
        cwd=cwd,
        env=environ,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    capture = _Capture(max_output_bytes)
    reader = threading.Thread(
        target=_drain, args=(proc.stdout.fileno(), capture), name="codeact-bash-output", daemon=True
    )
    reader.start()
    timed_out = False
    try:
        code: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        code = None
    finally:
        _kill_group(proc.pid)  # the shell's leftovers (background jobs) too
        proc.wait()
    reader.join(_KILL_GRACE_S)
    if not reader.is_alive():  # else a process that left the group still holds the pipe
        proc.stdout.close()
    output, dropped = capture.text()
    return CommandResult(code, output, timed_out, dropped)


def format_bash_output(result: CommandResult, timeout: float) -> str:
    """A command's observation text: its output and ``[exit code N]`` (or the timeout)."""
    out = result.output.rstrip("\n")
    status = (
        f"[timed out after {timeout:g}s; the command was killed]"
        if result.timed_out
        else f"[exit code {result.exit_code}]"
    )
    return f"{out}\n{status}" if out else status


# --- the toolbox ------------------------------------------------------------------------------


def _occurrences(text: str, needle: str, cap: int = 100) -> list[int]:
    """Start offsets of ``needle`` in ``text``, overlapping ones included (at most ``cap``)."""
    found: list[int] = []
    start = text.find(needle)
    while start >= 0 and len(found) < cap:
        found.append(start)
        start = text.find(needle, start + 1)
    return found


def _snippet(text: str, start: int, length: int, context: int = 2) -> str:
    """Numbered lines around ``text[start:start + length]``."""
    lines = text.splitlines()
    first = text.count("\n", 0, start)
    last = first + text.count("\n", start, start + length)
    lo, hi = max(0, first - context), min(len(lines), last + context + 1)
    return "\n".join(f"{n + 1:4d}  {lines[n]}" for n in range(lo, hi))


class Toolbox:
    """The tools, confined to ``root`` (an existing directory).

    Args:
        root: the workdir.
        bash_timeout: seconds per ``bash`` call.
        max_output_bytes: ``bash`` output kept (head and tail).
        max_file_bytes: largest file ``str_replace`` edits.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        bash_timeout: float = DEFAULT_BASH_TIMEOUT,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        max_file_bytes: int = MAX_FILE_BYTES,
    ) -> None:
        """Check ``root`` and the limits."""
        real = Path(os.path.realpath(root))
        if not real.is_dir():
            raise NotADirectoryError(f"the workdir is not a directory: {root}")
        if bash_timeout <= 0:
            raise ValueError(f"bash_timeout must be > 0, got {bash_timeout}")
        if max_output_bytes < 1 or max_file_bytes < 1:
            raise ValueError("max_output_bytes and max_file_bytes must be >= 1")
        self.root = real
        self.bash_timeout = bash_timeout
        self.max_output_bytes = max_output_bytes
        self.max_file_bytes = max_file_bytes
        self.env = minimal_env(real)

    def resolve(self, path: str) -> Path:
        """The real path of ``path`` (relative to the workdir, or absolute inside it).

        Raises:
            PathError: empty, holds NUL, or resolves (through ``..`` or
                symlinks) outside the workdir.
        """
        cleaned = path.strip()
        if not cleaned:
            raise PathError("the path is empty")
        if "\x00" in cleaned:
            raise PathError("the path holds a NUL character")
        given = Path(cleaned)
        real = Path(os.path.realpath(given if given.is_absolute() else self.root / given))
        if real != self.root and self.root not in real.parents:
            raise PathError(f"{cleaned} is outside the repository")
        return real

    def relative(self, path: Path) -> str:
        """``path`` (inside the workdir) as shown to the model."""
        return path.relative_to(self.root).as_posix() or "."

    def execute(self, call: ToolCall) -> Observation:
        """Run ``call`` (a parsed call of a known tool)."""
        if call.name == "bash":
            return self.bash(call.params["command"])
        if call.name == "str_replace":
            p = call.params
            return self.str_replace(p["path"], p["old_str"], p["new_str"])
        if call.name == "finish":
            return Observation("Finished.")
        return Observation(f"ERROR: unknown tool {call.name!r}", error=True)

    def bash(self, command: str) -> Observation:
        """Run ``command`` in the workdir; the output and exit code (or timeout)."""
        if not command.strip():
            return Observation("ERROR: the command is empty", error=True)
        try:
            result = run_command(
                command,
                self.root,
                timeout=self.bash_timeout,
                max_output_bytes=self.max_output_bytes,
                env=self.env,
            )
        except OSError as exc:
            return Observation(f"ERROR: cannot run bash: {exc}", error=True)
        return Observation(format_bash_output(result, self.bash_timeout), error=result.timed_out)

    def str_replace(self, path: str, old_str: str, new_str: str) -> Observation:
        """Replace the single occurrence of ``old_str`` in ``path`` by ``new_str``.

        The file is left untouched on every error (the observation says why).
        """
        try:
            target = self.resolve(path)
        except PathError as exc:
            return Observation(f"ERROR: {exc}", error=True)
        shown = self.relative(target)
        if not target.is_file():
            what = "a directory" if target.is_dir() else "no such file"
            return Observation(f"ERROR: {shown}: {what}", error=True)
        if not old_str:
            return Observation("ERROR: old_str is empty", error=True)
        if old_str == new_str:
            return Observation("ERROR: new_str is the same as old_str", error=True)
        try:
            fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as fh:
                data = fh.read(self.max_file_bytes + 1)
                mode = os.fstat(fh.fileno()).st_mode & 0o7777
        except OSError as exc:
            return Observation(f"ERROR: cannot read {shown}: {exc.strerror}", error=True)
        if len(data) > self.max_file_bytes:
            return Observation(
                f"ERROR: {shown} is larger than {self.max_file_bytes} bytes", error=True
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return Observation(f"ERROR: {shown} is not a UTF-8 text file", error=True)
        found = _occurrences(text, old_str)
        if not found:
            return Observation(
                f"ERROR: old_str was not found in {shown} (it must match exactly, "
                "whitespace included); the file was not changed",
                error=True,
            )
        if len(found) > 1:
            many = f"{len(found)}+" if len(found) >= 100 else str(len(found))
            return Observation(
                f"ERROR: old_str occurs {many} times in {shown}; include more of the "
                "surrounding text so it occurs exactly once; the file was not changed",
                error=True,
            )
        start = found[0]
        new_text = text[:start] + new_str + text[start + len(old_str) :]
        try:
            _atomic_write(target, new_text.encode("utf-8"), mode)
        except OSError as exc:
            return Observation(f"ERROR: cannot write {shown}: {exc.strerror}", error=True)
        snippet = _snippet(new_text, start, len(new_str))
        return Observation(f"Replaced 1 occurrence in {shown}:\n{snippet}")


def _atomic_write(target: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to a temp file beside ``target``, fsync, and rename it over ``target``."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
