"""The exception tree and the mapping of C status codes onto it."""

from __future__ import annotations

import inspect

import pytest

from agentspec import SuffixTree, exceptions
from agentspec._core import lowlevel
from agentspec._core.lowlevel import ffi, lib
from agentspec.exceptions import (
    AgentSpecError,
    CapacityError,
    DepthMismatchError,
    InvalidArgumentError,
    InvalidTokenError,
    NativeMemoryError,
    SequenceClosedError,
    SequenceExistsError,
    SequenceNotFoundError,
    ShardChecksumError,
    ShardFormatError,
    ShardTruncatedError,
    ShardVersionError,
    ThreadStartError,
    TreeClosedError,
)

# (class, the builtin it must also be, the C status that maps to it or None)
TREE: list[tuple[type[AgentSpecError], type[BaseException], str | None]] = [
    (NativeMemoryError, MemoryError, "AS_ERR_NOMEM"),
    (InvalidArgumentError, ValueError, "AS_ERR_INVALID_ARG"),
    (InvalidTokenError, ValueError, "AS_ERR_INVALID_TOKEN"),
    (SequenceExistsError, ValueError, "AS_ERR_SEQ_EXISTS"),
    (SequenceNotFoundError, KeyError, "AS_ERR_SEQ_NOT_FOUND"),
    (SequenceClosedError, ValueError, "AS_ERR_SEQ_CLOSED"),
    (CapacityError, OverflowError, "AS_ERR_CAPACITY"),
    (ShardFormatError, ValueError, "AS_ERR_FORMAT"),
    (ShardVersionError, ShardFormatError, "AS_ERR_VERSION"),
    (ShardTruncatedError, ShardFormatError, "AS_ERR_TRUNCATED"),
    (ShardChecksumError, ShardFormatError, "AS_ERR_CHECKSUM"),
    (DepthMismatchError, ShardFormatError, "AS_ERR_DEPTH_MISMATCH"),
    (ThreadStartError, RuntimeError, "AS_ERR_THREAD"),
    (TreeClosedError, ValueError, None),
]


@pytest.mark.parametrize(
    ("cls", "builtin", "status"), TREE, ids=lambda v: getattr(v, "__name__", v)
)
def test_every_class_has_both_bases(
    cls: type[AgentSpecError], builtin: type[BaseException], status: str | None
) -> None:
    """Each error is an AgentSpecError and the builtin a user would catch."""
    assert issubclass(cls, AgentSpecError)
    assert issubclass(cls, builtin)


@pytest.mark.parametrize(
    ("cls", "status"),
    [(c, s) for c, _, s in TREE if s is not None],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_status_maps_to_class_with_c_message(cls: type[AgentSpecError], status: str) -> None:
    """error(status) is the mapped class with the C engine's message in args[0]."""
    code = getattr(lib, status)
    exc = lowlevel.error(code)
    assert type(exc) is cls
    assert exc.args[0] == ffi.string(lib.as_strerror(code)).decode()
    assert exc.args[0]
    with pytest.raises(cls):
        lowlevel.check(code)


def test_check_accepts_ok_and_unknown_codes_raise_base() -> None:
    """check(AS_OK) returns; a code unknown to Python still raises AgentSpecError."""
    lowlevel.check(lib.AS_OK)
    exc = lowlevel.error(999)
    assert type(exc) is AgentSpecError
    assert exc.args[0] == ffi.string(lib.as_strerror(999)).decode()


def test_engine_error_carries_message_and_detail() -> None:
    """A real engine error keeps the C message in args[0] and names the sequence."""
    tree = SuffixTree(4)
    with pytest.raises(KeyError) as info:
        tree.sequence(42)
    exc = info.value
    assert isinstance(exc, SequenceNotFoundError)
    assert exc.args[0] == lowlevel.strerror(lib.AS_ERR_SEQ_NOT_FOUND)
    assert str(exc) == f"{exc.args[0]} (seq_id 42)"


def test_str_is_never_quoted() -> None:
    """str() of a KeyError subclass shows the message, not its repr."""
    assert str(SequenceNotFoundError("no such id")) == "no such id"
    assert (
        str(InvalidTokenError("bad token", "index 3: value -1")) == "bad token (index 3: value -1)"
    )
    assert str(CapacityError()) == ""


def test_module_lists_and_draws_every_class() -> None:
    """__all__ names every exception class, and the docstring's tree shows each one."""
    classes = {
        name
        for name, obj in vars(exceptions).items()
        if inspect.isclass(obj) and issubclass(obj, AgentSpecError)
    }
    assert set(exceptions.__all__) == classes
    assert exceptions.__all__ == sorted(exceptions.__all__)
    doc = exceptions.__doc__ or ""
    for name in classes:
        assert name in doc
        assert getattr(exceptions, name).__doc__


def test_public_errors_are_reexported_where_they_were() -> None:
    """Each error defined here is the same class at its older, user-facing import path."""
    import agentspec
    from agentspec import chat, demo, engine, models, traces
    from agentspec._push import pusher, wire
    from agentspec._util import cli

    homes = {
        agentspec: ["PushError"],
        pusher: ["PushError"],
        traces: ["TraceFormatError"],
        chat: ["ChatTemplateError"],
        models: ["ModelError", "ModelDownloadError", "ModelNotFoundError"],
        engine: ["GenerationCancelledError"],
        cli: ["ListenError"],
        demo: ["DemoError"],
    }
    for module, names in homes.items():
        for name in names:
            assert getattr(module, name) is getattr(exceptions, name), (module.__name__, name)
    assert pusher.TRANSIENT_STATUSES is exceptions.TRANSIENT_STATUSES
    permanent = {wire.ErrorType.DEPTH_MISMATCH, wire.ErrorType.INSTANCE_MISMATCH}
    assert permanent == exceptions._PERMANENT_409
