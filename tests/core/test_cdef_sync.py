"""The CFFI cdef (native/agentspec.cdef.h) must declare exactly the C API of agentspec.h.

Both files are parsed with a small brace-aware splitter: every ``as_*``
prototype, ``as_*`` type and ``AS_*`` constant of the header must appear in the
cdef with the same text (whitespace aside), and the cdef must declare nothing
the header lacks.  The compiled module's constants are checked against the
header's values too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import cffi
import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "native" / "include" / "agentspec.h"
CDEF = ROOT / "native" / "agentspec.cdef.h"


@dataclass
class CApi:
    """The declarations found in one C file."""

    functions: dict[str, str] = field(default_factory=dict)  # name -> normalized prototype
    defines: dict[str, str] = field(default_factory=dict)  # AS_* macro -> value text
    enums: dict[str, int] = field(default_factory=dict)  # AS_* enum member -> value
    types: dict[str, str] = field(default_factory=dict)  # as_* typedef -> normalized text


def _normalize(text: str) -> str:
    """Collapse whitespace and drop it around punctuation, so layout does not matter."""
    text = re.sub(r"\s+", " ", text).strip()
    return re.sub(r"\s*([*(),{}\[\];=])\s*", r"\1", text)


def _strip_comments(text: str) -> str:
    """Remove /* */ and // comments."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", " ", text)


def _statements(text: str) -> list[str]:
    """Split C declarations at top-level semicolons (braces of structs/enums kept whole)."""
    out: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == ";" and depth == 0:
            stmt = text[start:i].strip()
            if stmt:
                out.append(stmt)
            start = i + 1
    if text[start:].strip():
        raise AssertionError(f"unterminated declaration: {text[start:].strip()[:80]!r}")
    return out


def _int_value(text: str) -> int:
    """Value of a C integer literal such as ``1024`` or ``1u``."""
    return int(re.sub(r"[uUlL]+$", "", text.strip()), 0)


def parse_c_api(path: Path) -> CApi:
    """Collect functions, types, macros and enum members of one header-like file."""
    text = _strip_comments(path.read_text(encoding="utf-8"))
    # The C++ guard holds `extern "C" {` and its closing brace: not declarations.
    text = re.sub(r"#\s*ifdef\s+__cplusplus.*?#\s*endif", " ", text, flags=re.DOTALL)
    api = CApi()
    body_lines = []
    for line in text.splitlines():
        m = re.match(r"\s*#\s*define\s+(AS_\w+)\s+(.*?)\s*$", line)
        if m:
            api.defines[m.group(1)] = m.group(2)
        if not line.lstrip().startswith("#"):
            body_lines.append(line)
    for stmt in _statements("\n".join(body_lines)):
        norm = _normalize(stmt)
        if norm.startswith("typedef enum"):
            members = re.search(r"\{(.*)\}", norm)
            assert members is not None, norm
            for item in members.group(1).split(","):
                name, _, value = item.partition("=")
                api.enums[name] = _int_value(value)
            api.types[norm.rsplit("}", 1)[1]] = norm
        elif norm.startswith("typedef"):
            fnptr = re.search(r"\(\*(as_\w+)\)", norm)
            name = fnptr.group(1) if fnptr else re.findall(r"\w+", norm)[-1]
            api.types[name] = norm
        else:
            m = re.search(r"\b(as_\w+)\(", norm)
            assert m is not None, f"not a declaration of the C API: {norm!r}"
            api.functions[m.group(1)] = norm
    return api


@pytest.fixture(scope="module")
def header() -> CApi:
    """The parsed public header."""
    return parse_c_api(HEADER)


@pytest.fixture(scope="module")
def cdef() -> CApi:
    """The parsed cdef file."""
    return parse_c_api(CDEF)


def test_parser_finds_the_whole_header(header: CApi) -> None:
    """The parser really sees the header's API (so the sync checks are not vacuous)."""
    assert {"as_strerror", "as_tree_create", "as_draft_batch"} <= header.functions.keys()
    assert len(header.functions) >= 30
    assert header.enums["AS_OK"] == 0
    assert _int_value(header.defines["AS_MAX_DEPTH_LIMIT"]) == 1024
    assert {"as_tree", "as_draft_params", "as_draft_out", "as_malloc_fn"} <= header.types.keys()


def test_every_header_function_is_in_cdef(header: CApi, cdef: CApi) -> None:
    """Every as_* prototype of agentspec.h is declared in the cdef, with the same signature."""
    missing = sorted(header.functions.keys() - cdef.functions.keys())
    assert not missing, f"functions missing from agentspec.cdef.h: {missing}"
    differing = {
        name: (header.functions[name], cdef.functions[name])
        for name in header.functions
        if header.functions[name] != cdef.functions[name]
    }
    assert not differing, f"prototypes differ (header, cdef): {differing}"


def test_cdef_has_no_function_missing_from_header(header: CApi, cdef: CApi) -> None:
    """The cdef declares no function that agentspec.h lacks."""
    extra = sorted(cdef.functions.keys() - header.functions.keys())
    assert not extra, f"functions in agentspec.cdef.h but not in agentspec.h: {extra}"


def test_constants_match(header: CApi, cdef: CApi) -> None:
    """The cdef has exactly the header's AS_* macros and enum members, enum values equal."""
    assert sorted(cdef.defines) == sorted(header.defines)
    assert cdef.enums == header.enums


def test_cdef_macros_take_values_from_the_header(cdef: CApi) -> None:
    """Macros are declared as `...` so their values always come from the compiled header."""
    spelled_out = {name: value for name, value in cdef.defines.items() if value != "..."}
    assert not spelled_out, f"give these macros the value `...`: {spelled_out}"


def test_types_match(header: CApi, cdef: CApi) -> None:
    """Every as_* typedef (structs with their fields, callbacks) is the same in both files."""
    assert sorted(cdef.types) == sorted(header.types)
    differing = [name for name in header.types if header.types[name] != cdef.types[name]]
    assert not differing, f"typedefs differ: {differing}"


def test_cdef_parses_with_cffi() -> None:
    """CFFI accepts the cdef file as it is."""
    ffi = cffi.FFI()
    ffi.cdef(CDEF.read_text(encoding="utf-8"))
    assert ffi.sizeof("as_tree_stats") >= 7 * 4


def test_compiled_constants_equal_header_values(header: CApi) -> None:
    """The built extension exposes every AS_* constant with the header's value."""
    from agentspec._core.lowlevel import lib

    expected = {name: _int_value(value) for name, value in header.defines.items()}
    expected.update(header.enums)
    actual = {name: getattr(lib, name) for name in expected}
    assert actual == expected
