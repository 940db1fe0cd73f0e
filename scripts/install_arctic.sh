#!/usr/bin/env bash
# Install the reference implementation arctic-inference 0.3.0 into the current
# Python environment, for the side-by-side benchmark (benchmarks/bench_native.py).
#
# arctic-inference ships only an sdist whose setup.py imports torch at build
# time. A default `pip install arctic-inference` would pull torch plus several
# GB of CUDA wheels into an isolated build env. Instead we install the local
# CPU build of torch 2.13.0 and build arctic without build isolation and
# without its runtime dependencies (the suffix-decoding module only needs
# numpy at run time). Takes a few minutes (it compiles C++).
#
# Usage: scripts/install_arctic.sh [PYTHON]   (default: python3 on PATH)
# Only the arctic package is installed; none of its code is copied anywhere.
set -euo pipefail

PY="${1:-python3}"
TORCH_WANT="2.13.0"

echo "[install_arctic] python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

if "$PY" -c 'import arctic_inference.suffix_decoding' >/dev/null 2>&1; then
    ver="$("$PY" -m pip show arctic-inference 2>/dev/null | sed -n 's/^Version: //p')"
    if [ "$ver" = "0.3.0" ]; then
        echo "[install_arctic] arctic-inference 0.3.0 already importable; nothing to do."
        exit 0
    fi
fi

# Refuse to touch a different torch: replacing it could break other work in
# this environment, and any torch other than the local CPU build would drag in
# CUDA wheels.
torch_have="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
if [ -n "$torch_have" ] && [ "${torch_have%%+*}" != "$TORCH_WANT" ]; then
    echo "[install_arctic] ERROR: torch $torch_have is installed; this script needs torch $TORCH_WANT" >&2
    echo "[install_arctic] (the local CPU build). Use a fresh environment or uninstall that torch first." >&2
    exit 1
fi

# torch==2.13.0 resolves to the local CPU wheel (2.13.0+cpu, found through pip's
# find-links here), whose dependencies are pure Python (no nvidia-* wheels).
echo "[install_arctic] step 1/2: torch==$TORCH_WANT (CPU build), numpy, nanobind==2.9.2, wheel"
"$PY" -m pip install "torch==$TORCH_WANT" numpy "nanobind==2.9.2" wheel
torch_now="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
case "$torch_now" in
    "$TORCH_WANT"*) ;;
    *) echo "[install_arctic] ERROR: got torch $torch_now, expected $TORCH_WANT" >&2; exit 1 ;;
esac
if "$PY" -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
    echo "[install_arctic] ERROR: CUDA wheels (nvidia-*) are present; refusing to continue." >&2
    exit 1
fi

echo "[install_arctic] step 2/2: arctic-inference==0.3.0 (builds from sdist, takes minutes)"
# Its CMake build finds nanobind through CMAKE_PREFIX_PATH, and runs `python3` from
# PATH for the rest: point both at this environment, or a PATH without it fails.
CMAKE_PREFIX_PATH="$("$PY" -m nanobind --cmake_dir)${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
export CMAKE_PREFIX_PATH
PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"
export PATH
"$PY" -m pip install --no-build-isolation --no-deps "arctic-inference==0.3.0"

"$PY" -c 'from arctic_inference.suffix_decoding import SuffixDecodingCache; SuffixDecodingCache(64); print("[install_arctic] import OK")'
