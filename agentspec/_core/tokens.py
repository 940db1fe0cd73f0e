"""Token arrays: validation and conversion to the int32 buffers the engine reads.

A token array is one of:

- a 1-D, C-contiguous numpy array of dtype int32 (used as is, no copy);
- an ``array.array('i')`` (used as is, no copy);
- any other sequence or iterable of Python ints (packed into ``array('i')``).

Token ids are ints in [0, 2**31-1] (anything with ``__index__``; ``bool``,
an int subclass, counts as 0/1).  A numpy array of another dtype, shape or
layout raises TypeError, as does a non-int element (floats, strings, None).
A value above 2**31-1 raises `InvalidTokenError` naming the index and value
here; a negative value is refused by the C engine, which checks every token
before it changes anything, with the same exception and message.  Leaving
that check to C keeps the per-step conversion of a short list to one
``array('i', tokens)`` call.
"""

from __future__ import annotations

import array
import operator
import struct
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from agentspec._core import lowlevel
from agentspec.exceptions import InvalidTokenError

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["MAX_TOKEN", "TokenArray", "as_int32_buffer", "check_ndarray", "int32_le"]

#: Largest valid token id.
MAX_TOKEN = 2**31 - 1

#: What the API accepts wherever tokens are expected.
TokenArray = Union["npt.NDArray[np.int32]", "array.array[int]", Iterable[int]]

_INT32 = np.dtype(np.int32)
_BYTES_LIKE = (str, bytes, bytearray, memoryview)


def as_int32_buffer(tokens: TokenArray) -> tuple[Any, int, Any]:
    """Return ``(int32_t pointer, length, keepalive)`` for a token array.

    The pointer is only valid while ``keepalive`` (the numpy array or the
    ``array('i')`` that owns the memory) is alive.
    """
    kind = type(tokens)
    if kind is np.ndarray and tokens.dtype is _INT32 and tokens.ndim == 1:  # type: ignore[union-attr]
        # The common case (vLLM passes slices of its token array), checked in
        # a few attribute reads; from_buffer refuses a non-contiguous view.
        try:
            return lowlevel.int32_ptr(tokens), len(tokens), tokens  # type: ignore[arg-type]
        except ValueError:
            check_ndarray(tokens)  # type: ignore[arg-type]
            raise
    if kind is list or kind is tuple:
        packed = _pack(tokens)  # type: ignore[arg-type]
        return lowlevel.int32_ptr(packed), len(packed), packed
    if isinstance(tokens, np.ndarray):
        check_ndarray(tokens)
        return lowlevel.int32_ptr(tokens), int(tokens.shape[0]), tokens
    if isinstance(tokens, array.array):
        if tokens.typecode == "i" and tokens.itemsize == 4:
            return lowlevel.int32_ptr(tokens), len(tokens), tokens
        packed = _pack(tokens.tolist())
        return lowlevel.int32_ptr(packed), len(packed), packed
    packed = _pack(_as_list(tokens))
    return lowlevel.int32_ptr(packed), len(packed), packed


def _as_list(tokens: object) -> list[Any]:
    """Materialise an iterable of tokens, refusing text, bytes and non-iterables."""
    if isinstance(tokens, _BYTES_LIKE):
        raise TypeError(
            f"token ids must be a sequence of ints or an int32 numpy array, "
            f"not {type(tokens).__name__}"
        )
    try:
        return list(tokens)  # type: ignore[call-overload, no-any-return]
    except TypeError:
        raise TypeError(
            f"token ids must be a sequence of ints or an int32 numpy array, "
            f"not {type(tokens).__name__}"
        ) from None


def check_ndarray(arr: npt.NDArray[Any]) -> None:
    """Refuse numpy arrays the engine cannot read in place."""
    if arr.dtype != _INT32:
        raise TypeError(
            f"token array must have dtype int32 (native byte order), not {arr.dtype}; "
            "convert with arr.astype(numpy.int32)"
        )
    if arr.ndim != 1:
        raise TypeError(f"token array must be 1-D, not {arr.ndim}-D with shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise TypeError("token array must be C-contiguous; pass numpy.ascontiguousarray(arr)")


def _pack(seq: list[Any] | tuple[Any, ...]) -> array.array[int]:
    """Pack ints into ``array('i')``; TypeError/InvalidTokenError for non-int32 values."""
    try:
        return array.array("i", seq)
    except (OverflowError, TypeError):
        raise _element_error(seq) from None


def _element_error(seq: list[Any] | tuple[Any, ...]) -> Exception:
    """The exception for the first invalid element of ``seq``."""
    for i, value in enumerate(seq):
        try:
            v = operator.index(value)
        except TypeError:
            return TypeError(f"token ids must be ints, not {type(value).__name__} (index {i})")
        if not 0 <= v <= MAX_TOKEN:
            return InvalidTokenError(
                lowlevel.strerror(lowlevel.ERR_INVALID_TOKEN), f"index {i}: value {v}"
            )
    return InvalidTokenError(lowlevel.strerror(lowlevel.ERR_INVALID_TOKEN))


def int32_le(tokens: memoryview | bytes) -> bytes:
    """Little-endian bytes of a native int32 buffer."""
    data = bytes(tokens)
    if sys.byteorder == "little":
        return data
    n = len(data) // 4
    return struct.pack(f"<{n}i", *struct.unpack(f"={n}i", data))
