"""Argument checks for the public entry points: a bad value fails at once, before any worker
starts, with a `ValueError` that names the value and says what to pass instead."""

from __future__ import annotations

import math


def whole_number(name: str, value, minimum: int = 1, example: str | None = None) -> int:
    """`value` if it is an int >= `minimum` (not a bool), else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        hint = f"; pass e.g. {example}" if example else ""
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}{hint}")
    return value


def positive_number(name: str, value, example: str | None = None, unit: str | None = None) -> float:
    """`value` if it is a finite int or float > 0 (not a bool), else a ValueError naming it
    (and the `unit` it counts, e.g. "MiB")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        hint = f"; pass e.g. {example}" if example else ""
        of_unit = f" of {unit}" if unit else ""
        raise ValueError(f"{name} must be a number{of_unit} > 0, got {value!r}{hint}")
    return value


def divisors(n: int, limit: int | None = None) -> list[int]:
    """The whole numbers that divide `n` (up to `limit`): what to suggest when a split is uneven."""
    top = n if limit is None else min(n, limit)
    return [k for k in range(1, top + 1) if n % k == 0]
