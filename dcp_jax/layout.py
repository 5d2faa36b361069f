"""Token ownership on the decode side of DCP: ``owner / local_index / local_len / count``.

Block round-robin with interleave ``I`` over ``N = dcp_size`` ranks (token round-robin is
``I = 1``; page round-robin is ``I = page_size``), as in the project spec, section 2::

    owner(t)        = (t // I) % N
    local_index(t)  = (t // (I*N)) * I + t % I
    local_len(L, r) = (L // (I*N)) * I + clamp(L % (I*N) - r*I, 0, I)
    count(S, L, r)  = local_len(S + L, r) - local_len(S, r)

Each formula is written once, generic over the array module (``jax.numpy`` or ``numpy``). The
public JAX functions are jitted with ``dcp_size``, ``dcp_rank`` and ``interleave_size`` static;
the ``*_np`` twins are the ones the numpy planning layer (``dcp_jax.plan``) calls. Both validate
the static ints before tracing and raise ``ValueError`` naming the argument.

Token positions are counted from 0 over the whole request (prefix included) and must be
non-negative. Both forms check concrete inputs (``ValueError`` naming the argument); inside a
``jit`` the JAX functions see traced values they cannot check.

JAX keeps 32-bit integers unless ``jax_enable_x64`` is set: then concrete positions of 2**31
tokens or more are refused rather than wrapped.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dcp_jax._validate import as_int64

__all__ = [
    "owner",
    "local_index",
    "local_len",
    "count",
    "owner_np",
    "local_index_np",
    "local_len_np",
    "count_int",
    "count_np",
    "check_layout_args",
]


# --------------------------------------------------------------------------------------------
# Validation of the static ints (shared by the JAX and numpy forms).
# --------------------------------------------------------------------------------------------


def _check_int(name: str, value: Any) -> int:
    # bool is an int subclass, but dcp_size=True is a bug, not a size.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({name}={value!r})")
    return operator.index(value)


def check_layout_args(
    dcp_size: Any, interleave_size: Any = 1, dcp_rank: Any = None
) -> tuple[int, int, int | None]:
    """Validates the static layout ints and returns them as Python ints.

    Args:
        dcp_size: N, ranks in the decode DCP group; must be >= 1.
        interleave_size: I, tokens per ownership block; must be >= 1.
        dcp_rank: r, optional; when given must satisfy ``0 <= r < dcp_size``.

    Returns:
        ``(dcp_size, interleave_size, dcp_rank)`` as Python ints (``dcp_rank`` may be None).

    Raises:
        TypeError: an argument is not an integer.
        ValueError: ``dcp_size`` or ``interleave_size`` is not positive, or ``dcp_rank`` is
            out of range; the message names the argument.
    """
    dcp_size = _check_int("dcp_size", dcp_size)
    interleave_size = _check_int("interleave_size", interleave_size)
    if dcp_size < 1:
        raise ValueError(f"dcp_size must be >= 1, got {dcp_size=}")
    if interleave_size < 1:
        raise ValueError(f"interleave_size must be >= 1, got {interleave_size=}")
    if dcp_rank is not None:
        dcp_rank = _check_int("dcp_rank", dcp_rank)
        if not 0 <= dcp_rank < dcp_size:
            raise ValueError(f"dcp_rank must satisfy 0 <= dcp_rank < dcp_size, got {dcp_rank=}, {dcp_size=}")
    return dcp_size, interleave_size, dcp_rank


# --------------------------------------------------------------------------------------------
# The formulas, once each, generic over the array module ``xp`` (numpy or jax.numpy).
# --------------------------------------------------------------------------------------------


def _owner(xp, t, n: int, i: int):
    return (t // i) % n


def _local_index(xp, t, n: int, i: int):
    return (t // (i * n)) * i + t % i


def _local_len(xp, length, n: int, r: int, i: int):
    return (length // (i * n)) * i + xp.clip(length % (i * n) - r * i, 0, i)


def _count(xp, start, length, n: int, r: int, i: int):
    return _local_len(xp, start + length, n, r, i) - _local_len(xp, start, n, r, i)


# --------------------------------------------------------------------------------------------
# JAX (jitted) forms.
# --------------------------------------------------------------------------------------------


def _jax_layout_args(dcp_size: Any, interleave_size: Any = 1, dcp_rank: Any = None):
    """`check_layout_args`, plus: the JAX forms compute ``t // (I * N)`` in int32 without x64,
    so ``I * N`` must fit int32 (the numpy twins compute in int64)."""
    n, i, r = check_layout_args(dcp_size, interleave_size, dcp_rank)
    if not jax.config.jax_enable_x64 and n * i > np.iinfo(np.int32).max:
        raise ValueError(f"dcp_size * interleave_size = {n * i} does not fit int32; enable "
                         "jax_enable_x64 or use the numpy twins (*_np)")
    return n, i, r


def _as_int_array(name: str, x) -> jax.Array:
    """Integer positions as a JAX array; concrete inputs are checked, traced ones cannot be."""
    if isinstance(x, jax.core.Tracer):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be integers, got dtype {x.dtype}")
        return x
    arr = np.asarray(x)
    if arr.size == 0:  # [] has no dtype to speak of
        return jnp.zeros(arr.shape, jnp.int32)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.min() < 0:
        raise ValueError(f"{name} must be >= 0 tokens, got {name}={int(arr.min())}")
    # Without jax_enable_x64 JAX computes in int32: refuse what would silently wrap.
    if not jax.config.jax_enable_x64 and arr.max() > np.iinfo(np.int32).max:
        raise ValueError(f"{name}={int(arr.max())} does not fit int32; enable jax_enable_x64 "
                         f"or use the numpy twin (*_np)")
    return jnp.asarray(arr)


@functools.partial(jax.jit, static_argnames=("n", "i"))
def _owner_jit(t, *, n, i):
    return _owner(jnp, t, n, i)


@functools.partial(jax.jit, static_argnames=("n", "i"))
def _local_index_jit(t, *, n, i):
    return _local_index(jnp, t, n, i)


@functools.partial(jax.jit, static_argnames=("n", "r", "i"))
def _local_len_jit(length, *, n, r, i):
    return _local_len(jnp, length, n, r, i)


@functools.partial(jax.jit, static_argnames=("n", "r", "i"))
def _count_jit(start, length, *, n, r, i):
    return _count(jnp, start, length, n, r, i)


def owner(t, dcp_size: int, interleave_size: int = 1) -> jax.Array:
    """Decode rank that owns token position ``t``: ``(t // I) % N``.

    Args:
        t: int32/int64 token positions (tokens, >= 0), any shape; a Python int is accepted.
        dcp_size: N, ranks in the DCP group (static).
        interleave_size: I, tokens per ownership block (static); 1 is token round-robin.

    Returns:
        Integer array of ranks in ``[0, N)``, same shape as ``t``.

    Raises:
        TypeError: ``t`` is not integer, or a static argument is not an int.
        ValueError: ``dcp_size`` or ``interleave_size`` is not positive; a concrete ``t`` is
            negative (or >= 2**31 without x64).

    Example:
        >>> [int(x) for x in owner(jnp.arange(6), 2, 2)]
        [0, 0, 1, 1, 0, 0]
    """
    n, i, _ = _jax_layout_args(dcp_size, interleave_size)
    return _owner_jit(_as_int_array("t", t), n=n, i=i)


def local_index(t, dcp_size: int, interleave_size: int = 1) -> jax.Array:
    """Dense index of token ``t`` among the tokens its owner holds: ``(t // (I*N)) * I + t % I``.

    Args:
        t: int32/int64 token positions (tokens, >= 0), any shape; a Python int is accepted.
        dcp_size: N, ranks in the DCP group (static).
        interleave_size: I, tokens per ownership block (static).

    Returns:
        Integer array of rank-local indices (rows of the owner's dense token order).

    Raises:
        TypeError: ``t`` is not integer, or a static argument is not an int.
        ValueError: ``dcp_size`` or ``interleave_size`` is not positive; a concrete ``t`` is
            negative (or >= 2**31 without x64).

    Example:
        >>> [int(x) for x in local_index(jnp.arange(6), 2)]
        [0, 0, 1, 1, 2, 2]
    """
    n, i, _ = _jax_layout_args(dcp_size, interleave_size)
    return _local_index_jit(_as_int_array("t", t), n=n, i=i)


def local_len(length, dcp_size: int, dcp_rank: int, interleave_size: int = 1) -> jax.Array:
    """Tokens of a request prefix ``[0, L)`` that rank ``r`` holds.

    ``local_len(L, r) = (L // (I*N)) * I + clamp(L % (I*N) - r*I, 0, I)``; summed over ranks it
    is ``L``.

    Args:
        length: int32/int64 prefix lengths L (tokens, >= 0), any shape; Python int accepted.
        dcp_size: N (static).
        dcp_rank: r, ``0 <= r < N`` (static).
        interleave_size: I (static).

    Returns:
        Integer array of token counts (tokens), same shape as ``length``.

    Raises:
        TypeError: ``length`` is not integer, or a static argument is not an int.
        ValueError: ``dcp_size``/``interleave_size`` not positive or ``dcp_rank`` out of range.

    Example:
        >>> [int(local_len(L, 2, 0, 4)) for L in (1, 4, 5, 8, 9)]
        [1, 4, 4, 4, 5]
    """
    n, i, r = _jax_layout_args(dcp_size, interleave_size, dcp_rank)
    return _local_len_jit(_as_int_array("length", length), n=n, r=r, i=i)


def count(start, length, dcp_size: int, dcp_rank: int, interleave_size: int = 1) -> jax.Array:
    """Tokens of the range ``[S, S+L)`` that rank ``r`` holds: ``local_len(S+L) - local_len(S)``.

    Args:
        start: int32/int64 range starts S (tokens, >= 0); broadcast with ``length``.
        length: int32/int64 range lengths L (tokens, >= 0).
        dcp_size: N (static).
        dcp_rank: r, ``0 <= r < N`` (static).
        interleave_size: I (static).

    Returns:
        Integer array of token counts (tokens), the broadcast shape of ``start`` and ``length``.

    Raises:
        TypeError: an input is not integer, or a static argument is not an int.
        ValueError: ``dcp_size``/``interleave_size`` not positive or ``dcp_rank`` out of range.

    Traced inputs (under ``jax.jit``) cannot be checked: keep ``S + L < 2**31`` there, or enable
    ``jax_enable_x64``; concrete inputs past that raise.

    Example:
        >>> int(count(3, 5, 2, 1))  # tokens 3..7, rank 1 holds 3, 5, 7
        3
    """
    n, i, r = _jax_layout_args(dcp_size, interleave_size, dcp_rank)
    s_arr, l_arr = _as_int_array("start", start), _as_int_array("length", length)
    # The range end S + L is computed too: it must fit int32 as well (concrete inputs only).
    if (not jax.config.jax_enable_x64 and not isinstance(start, jax.core.Tracer)
            and not isinstance(length, jax.core.Tracer) and s_arr.size and l_arr.size):
        end = int((np.asarray(start, np.int64) + np.asarray(length, np.int64)).max())
        if end > np.iinfo(np.int32).max:
            raise ValueError(f"start + length = {end} does not fit int32; enable jax_enable_x64 "
                             f"or use count_np")
    return _count_jit(s_arr, l_arr, n=n, r=r, i=i)


# --------------------------------------------------------------------------------------------
# numpy twins (int64), used by the planning layer.
# --------------------------------------------------------------------------------------------


def _np_layout_args(dcp_size: Any, interleave_size: Any = 1) -> tuple[int, int]:
    """`check_layout_args`, plus: the numpy twins compute ``t // (I * N)`` in int64, so ``I * N``
    must fit int64 (numpy would raise a bare OverflowError)."""
    n, i, _ = check_layout_args(dcp_size, interleave_size)
    if n * i > np.iinfo(np.int64).max:
        raise ValueError(f"dcp_size * interleave_size = {n * i} does not fit int64, got {dcp_size=}, "
                         f"{interleave_size=} (use count_int for sizes this large)")
    return n, i


def _as_np_positions(name: str, x) -> np.ndarray:
    arr = np.asarray(x)
    if arr.size == 0:
        return arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be integers, got dtype {arr.dtype}")
    arr = as_int64(name, arr)  # a uint64 past int64 is refused as given, not wrapped negative
    if (arr < 0).any():
        raise ValueError(f"{name} must be >= 0, got min {name}={int(arr.min())}")
    return arr


def owner_np(t, dcp_size: int, interleave_size: int = 1) -> np.ndarray:
    """numpy twin of :func:`owner` (int64). Raises ``ValueError`` for negative ``t`` as well."""
    n, i = _np_layout_args(dcp_size, interleave_size)
    return _owner(np, _as_np_positions("t", t), n, i)


def local_index_np(t, dcp_size: int, interleave_size: int = 1) -> np.ndarray:
    """numpy twin of :func:`local_index` (int64). Raises ``ValueError`` for negative ``t``."""
    n, i = _np_layout_args(dcp_size, interleave_size)
    return _local_index(np, _as_np_positions("t", t), n, i)


def _np_rank(n: int, i: int, dcp_rank):
    r = np.asarray(dcp_rank)
    if r.ndim == 0:
        return check_layout_args(n, i, dcp_rank)[2]
    if r.size and (not np.issubdtype(r.dtype, np.integer) or r.min() < 0 or r.max() >= n):
        raise ValueError(f"dcp_rank entries must be integers in [0, {n}), got {dcp_rank=}")
    return r.astype(np.int64)


def local_len_np(length, dcp_size: int, dcp_rank, interleave_size: int = 1) -> np.ndarray:
    """numpy twin of :func:`local_len` (int64).

    Unlike the JAX form, ``dcp_rank`` may also be an integer array (vectorised over ranks,
    broadcast with ``length``); every entry must lie in ``[0, dcp_size)``.

    Raises:
        ValueError: as :func:`local_len`, negative ``length``, or ``dcp_size * interleave_size``
            past int64 (as every numpy twin).
    """
    n, i = _np_layout_args(dcp_size, interleave_size)
    return _local_len(np, _as_np_positions("length", length), n, _np_rank(n, i, dcp_rank), i)


def count_np(start, length, dcp_size: int, dcp_rank, interleave_size: int = 1) -> np.ndarray:
    """numpy twin of :func:`count` (int64); ``dcp_rank`` may be an array as in :func:`local_len_np`.

    Raises:
        ValueError: as :func:`count`, or ``start + length`` past int64 (`count_int` is exact
            for any size).
    """
    n, i = _np_layout_args(dcp_size, interleave_size)
    start = _as_np_positions("start", start)
    length = _as_np_positions("length", length)
    # element by element (broadcast as the formula does): the largest start and the largest
    # length may belong to different positions
    if start.size and length.size and np.any(length > np.iinfo(np.int64).max - start):
        raise ValueError("start + length passes int64 (use count_int for positions this large)")
    return _count(np, start, length, n, _np_rank(n, i, dcp_rank), i)


class _Ints:
    """The formulas' ``xp`` for plain Python ints: on numpy scalars each operation costs
    microseconds, and a receiver counts a chunk's rows once per credited part."""

    @staticmethod
    def clip(x: int, lo: int, hi: int) -> int:
        return min(max(x, lo), hi)


def count_int(start: int, length: int, dcp_size: int, dcp_rank: int, interleave_size: int = 1) -> int:
    """:func:`count` on Python ints (the same formula as `count_np`, exact for any size).

    Raises:
        TypeError: an argument that is not an int. ValueError: as `check_layout_args`, or a
            negative ``start`` / ``length``.
    """
    n, i, r = check_layout_args(dcp_size, interleave_size, _check_int("dcp_rank", dcp_rank))
    start, length = _check_int("start", start), _check_int("length", length)
    if start < 0 or length < 0:
        raise ValueError(f"start and length must be >= 0, got {start=}, {length=}")
    return _count(_Ints, start, length, n, r, i)
