"""Argument checks shared by the loss functions.

Every check runs on static information only (shapes, dtypes, Python scalars),
so it costs nothing under ``jit`` and never reads traced values. Each raises
``ValueError`` naming the argument, what was given and what was expected.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(jnp.shape(x))


def _dtype(x: Any):
    return jnp.result_type(x)


def check_same_shape(**arrays: Any) -> tuple[int, ...]:
    """Checks that every named array has the same shape; returns that shape.

    ``None`` values are skipped (optional inputs).
    """
    given = {name: _shape(x) for name, x in arrays.items() if x is not None}
    if not given:
        raise ValueError("check_same_shape needs at least one array")
    first_name, first_shape = next(iter(given.items()))
    for name, shape in given.items():
        if shape != first_shape:
            listing = ", ".join(f"{n}={s}" for n, s in given.items())
            raise ValueError(
                f"{name} has shape {shape} but {first_name} has shape {first_shape}; "
                f"these arguments must all have the same shape (given: {listing})"
            )
    return first_shape


def check_rank(name: str, x: Any, rank: int | Iterable[int]) -> None:
    """Checks ``x.ndim`` is ``rank`` (or one of several allowed ranks)."""
    allowed = (rank,) if isinstance(rank, int) else tuple(rank)
    ndim = len(_shape(x))
    if ndim not in allowed:
        expected = " or ".join(str(r) for r in allowed)
        raise ValueError(
            f"{name} has rank {ndim} (shape {_shape(x)}) but rank {expected} was expected"
        )


def _check_dtype_kind(name: str, x: Any, kind, label: str, cast: str) -> None:
    dtype = _dtype(x)
    if not jnp.issubdtype(dtype, kind):
        raise ValueError(
            f"{name} has dtype {dtype} but {label} dtype was expected; cast it with .astype({cast})"
        )


def check_floating(name: str, x: Any) -> None:
    """Checks ``x`` has a floating dtype (float16/bfloat16/float32/float64)."""
    _check_dtype_kind(name, x, jnp.floating, "a floating", "jnp.float32")


def check_integer(name: str, x: Any) -> None:
    """Checks ``x`` has an integer dtype (e.g. group ids, turn ids)."""
    _check_dtype_kind(name, x, jnp.integer, "an integer", "jnp.int32")


def check_mask(name: str, x: Any) -> None:
    """Checks a mask is boolean or floating (0/1 values); integers are accepted too."""
    dtype = _dtype(x)
    if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.floating)
            or jnp.issubdtype(dtype, jnp.integer)):
        raise ValueError(
            f"{name} has dtype {dtype} but a bool or 0/1 numeric mask was expected"
        )


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """Checks ``value`` is one of ``choices`` (mode and kind names)."""
    allowed = tuple(choices)
    if value not in allowed:
        raise ValueError(
            f"{name}={value!r} is not a known choice; expected one of {list(allowed)}"
        )


def check_divides(name: str, group_size: int, batch: int, batch_name: str = "batch size") -> None:
    """Checks ``group_size`` is a positive integer dividing ``batch``."""
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"{name}={group_size!r} must be a positive integer")
    if batch % group_size != 0:
        raise ValueError(
            f"{name}={group_size} does not divide the {batch_name} {batch}; "
            f"pass a {batch_name} that is a multiple of {name} (e.g. {batch // group_size * group_size or group_size})"
        )


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    """Checks a Python scalar is > 0 (or >= 0 with ``allow_zero``)."""
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        expected = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value!r} but a value {expected} was expected")


def check_interval(name: str, value: float, low: float, high: float) -> None:
    """Checks ``low <= value <= high`` for a Python scalar."""
    if not low <= value <= high:
        raise ValueError(f"{name}={value!r} but a value in [{low}, {high}] was expected")


def check_ordered(low_name: str, low: float, high_name: str, high: float) -> None:
    """Checks ``low <= high`` for two related Python scalars (e.g. std_min, std_max)."""
    if not low <= high:
        raise ValueError(
            f"{low_name}={low!r} exceeds {high_name}={high!r}; expected {low_name} <= {high_name}"
        )
