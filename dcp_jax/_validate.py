"""Argument checks shared by the numpy planning layer (plan, packing, cost)."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np


def check_int(name: str, value: Any, *, minimum: int) -> int:
    """Return ``value`` as a Python int, refusing bools, non-integers and values below ``minimum``.

    Raises:
        TypeError: ``value`` is not an integer (the message names ``name``).
        ValueError: ``value < minimum`` (the message names ``name``).
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({name}={value!r})")
    value = operator.index(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {name}={value}")
    return value
