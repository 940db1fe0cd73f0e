"""agentspec._util.args.as_int: the one check behind every integer argument."""

from __future__ import annotations

import enum
from fractions import Fraction

import numpy as np
import pytest

from agentspec._util.args import as_int
from agentspec.exceptions import InvalidArgumentError

INTEGRAL = (
    int,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
)


class Level(enum.IntEnum):
    """An int subclass that is not a bool."""

    FIVE = 5


@pytest.mark.parametrize("kind", INTEGRAL, ids=lambda k: k.__name__)
def test_integral_types_become_plain_ints(kind: type) -> None:
    value = as_int(kind(5), "n", 0, 10)
    assert value == 5
    assert type(value) is int


def test_int_subclass_becomes_plain_int() -> None:
    value = as_int(Level.FIVE, "n")
    assert value == 5
    assert type(value) is int


def test_large_unsigned_values_are_exact() -> None:
    assert as_int(np.uint64(2**64 - 1), "n") == 2**64 - 1
    assert as_int(np.int64(-(2**63)), "n") == -(2**63)


@pytest.mark.parametrize("value", [True, False, np.True_, np.bool_(False)], ids=repr)
def test_bools_are_refused(value: object) -> None:
    with pytest.raises(TypeError, match=r"^count must be an int, not bool"):
        as_int(value, "count")


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        (5.0, "float"),
        (np.float32(5), "float32"),
        ("5", "str"),
        (None, "NoneType"),
        (Fraction(5), "Fraction"),
        (np.array([5]), "ndarray"),
    ],
)
def test_non_integers_are_refused_naming_the_argument(value: object, type_name: str) -> None:
    with pytest.raises(TypeError, match=rf"^max_batch must be an int, not {type_name}$"):
        as_int(value, "max_batch")


def test_expected_wording() -> None:
    with pytest.raises(TypeError, match=r"^k must be an int or None, not str$"):
        as_int("x", "k", expected="an int or None")


@pytest.mark.parametrize(
    ("lo", "hi", "value", "message"),
    [
        (1, 8, np.int32(0), "n must be in [1, 8]"),
        (1, 8, np.uint16(9), "n must be in [1, 8]"),
        (0, None, np.int64(-1), "n must be >= 0"),
        (None, 3, 4, "n must be <= 3"),
    ],
)
def test_bounds(lo: int | None, hi: int | None, value: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        as_int(value, "n", lo, hi)
    assert info.value.args[0] == message
    assert str(info.value) == f"{message} (got {int(value)})"  # type: ignore[call-overload]


def test_bounds_are_inclusive() -> None:
    assert as_int(np.int32(1), "n", 1, 8) == 1
    assert as_int(np.int32(8), "n", 1, 8) == 8
