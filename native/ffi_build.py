"""CFFI (API mode) build script for ``agentspec._agentspec_cffi``.

setuptools runs it through ``cffi_modules=["native/ffi_build.py:ffibuilder"]``
(see ``setup.py``) for ``pip install .`` and ``pip install -e .``.  Running it
directly (``python native/ffi_build.py``) compiles the extension in place into
``agentspec/`` for quick iteration, with intermediate files under
``native/build/cffi``.

The extension is self-contained: every C file of ``native/src`` is compiled
into it, so there is no separate shared library to find at run time.  The cdef
(the declarations CFFI exposes) is read from ``native/agentspec.cdef.h``,
which ``tests/test_cdef_sync.py`` keeps in step with ``native/include/agentspec.h``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import cffi

NATIVE_DIR = Path(__file__).resolve().parent
ROOT_DIR = NATIVE_DIR.parent
INCLUDE_DIR = NATIVE_DIR / "include"
SRC_DIR = NATIVE_DIR / "src"
CDEF_PATH = NATIVE_DIR / "agentspec.cdef.h"

MODULE_NAME = "agentspec._agentspec_cffi"

EXTRA_COMPILE_ARGS = [
    "-std=c11",
    "-O2",
    "-Wall",
    "-Wextra",
    "-fvisibility=hidden",
]


def _for_build(path: Path, *, absolute: bool = False) -> str:
    """Return ``path`` relative to the working directory when it lies below it.

    setuptools is always run from the project root; relative source paths keep
    the object files inside its ``build/`` folder.  From anywhere else (or when
    ``absolute`` is set) the absolute path is used, which also works.
    """
    if absolute:
        return str(path)
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _c_sources(*, absolute: bool = False) -> list[str]:
    """All C files of ``native/src``, sorted so the build is reproducible."""
    sources = sorted(SRC_DIR.glob("*.c"))
    if not sources:
        raise RuntimeError(f"no C sources found in {SRC_DIR}")
    return [_for_build(p, absolute=absolute) for p in sources]


def make_builder(*, absolute: bool = False) -> cffi.FFI:
    """Create the FFI builder: cdef from the cdef file, sources from ``native/src``.

    ``absolute`` forces absolute paths, needed by ``FFI.compile`` which changes
    into its temporary folder before compiling.
    """
    builder = cffi.FFI()
    builder.cdef(CDEF_PATH.read_text(encoding="utf-8"))
    builder.set_source(
        MODULE_NAME,
        '#include "agentspec.h"\n',
        sources=_c_sources(absolute=absolute),
        include_dirs=[
            _for_build(INCLUDE_DIR, absolute=absolute),
            _for_build(SRC_DIR, absolute=absolute),
        ],
        extra_compile_args=list(EXTRA_COMPILE_ARGS),
        libraries=["pthread"],
    )
    return builder


ffibuilder = make_builder()


def _compile_in_place() -> None:
    """Compile the extension into ``agentspec/`` (intermediate files in native/build)."""
    builder = make_builder(absolute=True)
    tmpdir = NATIVE_DIR / "build" / "cffi"
    tmpdir.mkdir(parents=True, exist_ok=True)
    built = Path(builder.compile(tmpdir=str(tmpdir), verbose=True))
    package_dir = ROOT_DIR / "agentspec"
    for stale in package_dir.glob("_agentspec_cffi*.so"):
        stale.unlink()  # e.g. pip's abi3 build: keep exactly one importable copy
    target = package_dir / built.name
    shutil.copy2(built, target)
    print(f"installed {target}", file=sys.stderr)


if __name__ == "__main__":
    _compile_in_place()
