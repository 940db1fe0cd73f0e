"""setuptools shim: everything is in pyproject.toml except ``cffi_modules``.

``cffi_modules`` is a keyword that cffi adds to ``setup()``; pyproject.toml's
``[tool.setuptools]`` table cannot carry it, so it lives here.
"""

from setuptools import setup

setup(cffi_modules=["native/ffi_build.py:ffibuilder"])
