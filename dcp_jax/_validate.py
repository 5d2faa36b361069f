"""Argument checks shared by the numpy planning layer (plan, packing, cost)."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np


def check_int_type(name: str, value: Any) -> int:
    """Return ``value`` as a Python int, refusing bools and non-integers (``8.0`` too): the type
    rule of every int argument; the caller checks the range with its own message. Python and
    numpy integers and 0-d integer arrays (``np.array(8)``) are ints here.

    Raises:
        TypeError: ``value`` is not an integer (the message names ``name`` and the value as given).
    """
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
        value = value[()]  # a 0-d integer array, as numpy reductions return: its scalar
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({name}={value!r})")
    return operator.index(value)


def check_int(name: str, value: Any, *, minimum: int) -> int:
    """Return ``value`` as a Python int, refusing bools, non-integers and values below ``minimum``.

    Raises:
        TypeError: ``value`` is not an integer (the message names ``name``).
        ValueError: ``value < minimum`` (the message names ``name``).
    """
    value = check_int_type(name, value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {name}={value}")
    return value


I64_MAX = int(np.iinfo(np.int64).max)


def as_int64(name: str, arr: np.ndarray) -> np.ndarray:
    """An integer array as int64; an unsigned value past int64 (it would wrap negative) is refused
    with the value as given, e.g. ``src_pages[0]=9223372036854775808``.

    Raises:
        ValueError: a value above ``2**63 - 1`` (the message names ``name``, the entry and its value).
    """
    if arr.dtype.kind == "u" and arr.size and arr.max() > I64_MAX:
        bad = np.unravel_index(int(np.argmax(arr > I64_MAX)), arr.shape)
        where = f"[{', '.join(str(int(k)) for k in bad)}]" if arr.ndim else ""  # a scalar: name=value
        raise ValueError(f"{name} must hold values <= 2**63 - 1 (int64), got {name}{where}={int(arr[bad])}")
    return arr.astype(np.int64, copy=False)


def plural(count: int, noun: str) -> str:
    """``"1 page"`` / ``"0 pages"`` / ``"2 pages"``: a count with its noun, for messages."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def pages_required_text(count: int, page_size: int | None = None) -> str:
    """``"1 page of 4 tokens is required"`` / ``"2 pages of 4 tokens are required"`` (without
    ``page_size``: ``"1 page is required"``): the one wording of a too-short page table."""
    tokens = "" if page_size is None else f" of {plural(page_size, 'token')}"
    return f"{plural(count, 'page')}{tokens} {'is' if count == 1 else 'are'} required"
