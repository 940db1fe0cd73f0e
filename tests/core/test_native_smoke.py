"""Smoke test of the compiled CFFI extension through agentspec._core.lowlevel."""

from __future__ import annotations

from agentspec._core.lowlevel import ffi, lib


def test_strerror_names_ok_and_errors() -> None:
    """as_strerror gives a non-empty description for success and differs for an error."""
    ok = ffi.string(lib.as_strerror(lib.AS_OK)).decode("utf-8")
    nomem = ffi.string(lib.as_strerror(lib.AS_ERR_NOMEM)).decode("utf-8")
    unknown = lib.as_strerror(12345)
    assert ok
    assert nomem
    assert ok != nomem
    assert unknown != ffi.NULL


def test_tree_create_add_count_free() -> None:
    """A tree can be created, filled, queried and freed through the raw C API."""
    status = ffi.new("int *", -1)
    tree = lib.as_tree_create(8, status)
    assert tree != ffi.NULL
    assert status[0] == lib.AS_OK
    try:
        assert lib.as_tree_max_depth(tree) == 8
        tokens = ffi.new("int32_t[]", [1, 2, 1, 2, 3])
        assert lib.as_tree_add(tree, 7, tokens, 5) == lib.AS_OK
        assert lib.as_tree_contains(tree, 7) == 1
        count = ffi.new("uint64_t *")
        pattern = ffi.new("int32_t[]", [1, 2])
        assert lib.as_tree_count(tree, pattern, 2, count) == lib.AS_OK
        assert count[0] == 2
        assert lib.as_tree_check(tree) == lib.AS_OK
    finally:
        lib.as_tree_free(tree)


def test_tree_create_rejects_bad_depth() -> None:
    """as_tree_create refuses max_depth < 2 with AS_ERR_INVALID_ARG instead of crashing."""
    status = ffi.new("int *", -1)
    tree = lib.as_tree_create(1, status)
    assert tree == ffi.NULL
    assert status[0] == lib.AS_ERR_INVALID_ARG


def test_free_accepts_null() -> None:
    """Every *_free accepts NULL."""
    lib.as_tree_free(ffi.NULL)
    lib.as_cursor_free(ffi.NULL)
