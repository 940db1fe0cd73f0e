"""Integer arguments of the public API: one check for every entry point.

Every integer parameter (depths, counts, budgets, caps, ids, versions, ports)
goes through `as_int`, so that they all accept the same values: anything
integral in the sense of ``operator.index`` -- Python ints, int subclasses
such as ``IntEnum``, numpy integer scalars (``np.int32(5)``, ``np.uint16``,
``np.int64`` ...) -- converted to a plain ``int`` before it reaches the C
engine.  ``bool`` is refused although it is an int subclass: ``True`` where a
count is expected is a bug, not a 1.  numpy's ``bool_`` has no
``__index__`` and is refused the same way.

Token ids inside token arrays are a different matter, handled by
`agentspec._core.tokens` (speed matters there, and ``bool`` elements count as
0/1, as documented in that module).
"""

from __future__ import annotations

import operator

from agentspec.exceptions import InvalidArgumentError

__all__ = ["as_int"]


def as_int(
    value: object,
    name: str,
    lo: int | None = None,
    hi: int | None = None,
    *,
    expected: str = "an int",
) -> int:
    """Return ``value`` as a plain int, refusing bools and non-integers.

    Args:
        value: the argument as passed.
        name: the argument's name, for the error messages.
        lo, hi: optional inclusive bounds.
        expected: what the TypeError says the argument must be
            (e.g. ``"an int or None"`` for optional arguments).

    Raises:
        TypeError: ``value`` is a bool or has no ``__index__`` (a float, a
            string, None ...); the message names the argument and the type.
        InvalidArgumentError: ``value`` is outside [lo, hi]; the message
            names the argument and the bounds, the detail the value.
    """
    if type(value) is int:  # the common case, first
        v = value
    elif isinstance(value, bool):
        raise TypeError(f"{name} must be {expected}, not bool")
    else:
        try:
            v = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"{name} must be {expected}, not {type(value).__name__}") from None
    if lo is not None and v < lo:
        raise InvalidArgumentError(_range(name, lo, hi), f"got {v}")
    if hi is not None and v > hi:
        raise InvalidArgumentError(_range(name, lo, hi), f"got {v}")
    return v


def _range(name: str, lo: int | None, hi: int | None) -> str:
    """``"name must be in [lo, hi]"`` (or ``>= lo`` / ``<= hi`` for one bound)."""
    if hi is None:
        return f"{name} must be >= {lo}"
    if lo is None:
        return f"{name} must be <= {hi}"
    return f"{name} must be in [{lo}, {hi}]"
