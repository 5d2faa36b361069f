"""Runs and ``(src_addr, dst_addr, length)`` descriptors (spec section 5).

:func:`group_runs` finds the maximal runs of a plan's rows; :func:`build_descriptors` turns runs
into descriptors of every layer entry in one array; :func:`packed_src_bases` and
:func:`build_packed_descriptors` do the same for rows gathered into a pack region (layer-major,
spec section 6). Moved out of :mod:`dcp_jax.plan`, which re-exports every name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dcp_jax._validate import check_int as _int

from dcp_jax.packing import layer_offsets
from dcp_jax.send_range import _I64_MAX, _as_int64, _int_array

if TYPE_CHECKING:  # annotation only: dcp_jax.token_plan imports this module
    from dcp_jax.token_plan import TokenTransferPlan

__all__ = ["group_runs", "build_descriptors", "packed_src_bases", "build_packed_descriptors"]


# --------------------------------------------------------------------------------------------
# Runs and descriptors (spec section 5).
# --------------------------------------------------------------------------------------------


def group_runs(src_indices, dst_indices) -> np.ndarray:
    """Maximal runs where both source and destination rows step by +1.

    Args:
        src_indices: int ``[n]`` source rows.
        dst_indices: int ``[n]`` destination rows.

    Returns:
        int64 ``[k, 3]`` of ``(src_start, dst_start, length)`` in order; ``[0, 3]`` for n = 0.

    Raises:
        ValueError: lengths differ, arrays are not 1-D, or a row is negative.
        TypeError: non-integer arrays.

    Example:
        >>> group_runs([0, 1, 2, 5, 6], [10, 11, 20, 21, 22]).tolist()
        [[0, 10, 2], [2, 20, 1], [5, 21, 2]]
    """
    src = _int_array("src_indices", src_indices)
    dst = _int_array("dst_indices", dst_indices)
    if src.shape != dst.shape:
        raise ValueError(f"src_indices and dst_indices must have equal length, got {src.shape} and {dst.shape}")
    if src.size == 0:
        return np.zeros((0, 3), np.int64)
    for name, arr in (("src_indices", src), ("dst_indices", dst)):
        if arr.min() < 0:  # rows are buffer offsets; a negative one is a planning bug
            bad = int(np.flatnonzero(arr < 0)[0])
            raise ValueError(f"{name} must hold rows >= 0, got {name}[{bad}]={int(arr[bad])}")
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [src.size]]))
    return np.stack([src[starts], dst[starts], lengths], axis=1).astype(np.int64)


def _per_entry(name: str, value: Any, num: int | None) -> np.ndarray:
    arr = _int_array(name, np.atleast_1d(np.asarray(value)))
    if num is not None and arr.size == 1 and num != 1:
        arr = np.full(num, arr[0], np.int64)
    return arr


def build_descriptors(runs, src_bases, dst_bases, item_lens) -> np.ndarray:
    """Descriptors ``(src_addr, dst_addr, length_bytes)`` of every run of every layer entry.

    For entry ``l`` and run ``(s0, d0, n)``: ``(src_base[l] + s0*item_len[l], dst_base[l] +
    d0*item_len[l], n*item_len[l])``. Layer-major: all runs of entry 0, then entry 1, ... All of
    them form one engine batch.

    Args:
        runs: int64 ``[k, 3]`` from :func:`group_runs` (rows).
        src_bases: int ``[L]`` source buffer base addresses (bytes) per layer entry.
        dst_bases: int ``[L]`` destination buffer base addresses (bytes) per layer entry.
        item_lens: int ``[L]`` bytes per row per entry (a single int is broadcast to L).

    Returns:
        int64 ``[L * k, 3]``.

    Raises:
        ValueError: shapes disagree, negative bases, non-positive ``item_lens``, runs not
            ``[k, 3]``, a run with a negative start or a length < 1, or a descriptor whose
            end (``base + (start + n) * item_len``) passes int64 (the message names the run,
            entry and base). The check costs O(k + L) beside the O(L * k) result.
        TypeError: non-integer arguments.
    """
    runs_arr = np.asarray(runs)
    if runs_arr.size == 0:
        runs_arr = np.zeros((0, 3), np.int64)
    if runs_arr.ndim != 2 or runs_arr.shape[1] != 3:
        raise ValueError(f"runs must have shape [k, 3], got {runs_arr.shape}")
    if not np.issubdtype(runs_arr.dtype, np.integer):
        raise TypeError(f"runs must be integers, got dtype {runs_arr.dtype}")
    runs_arr = _as_int64("runs", runs_arr)
    src_b = _per_entry("src_bases", src_bases, None)
    num = src_b.size
    dst_b = _per_entry("dst_bases", dst_bases, None)
    given = np.size(item_lens)  # as given: a single value broadcasts, so report what the caller passed
    lens = _per_entry("item_lens", item_lens, num)
    if not (dst_b.size == num and lens.size == num):
        raise ValueError(
            f"src_bases, dst_bases and item_lens need one entry per layer entry (item_lens may be one value), "
            f"got {num}, {dst_b.size}, {given}"
        )
    if num:  # whole-array min / max: the cheapest numpy reductions (this is a per-chunk path)
        for name, arr in (("src_bases", src_b), ("dst_bases", dst_b)):
            if arr.min() < 0:
                bad = int(np.argmax(arr < 0))
                raise ValueError(f"{name} must be >= 0 addresses, got {name}[{bad}]={int(arr[bad])}")
        if lens.min() <= 0:
            raise ValueError(f"item_lens must be > 0 bytes, got min item_lens={int(lens.min())}")
        if runs_arr.shape[0]:
            _check_runs(runs_arr, src_b, dst_b, lens)
    out = np.empty((num, runs_arr.shape[0], 3), np.int64)
    out[:, :, 0] = src_b[:, None] + runs_arr[None, :, 0] * lens[:, None]
    out[:, :, 1] = dst_b[:, None] + runs_arr[None, :, 1] * lens[:, None]
    out[:, :, 2] = runs_arr[None, :, 2] * lens[:, None]
    return out.reshape(-1, 3)


def _check_runs(runs: np.ndarray, src_b: np.ndarray, dst_b: np.ndarray, lens: np.ndarray) -> None:
    """Starts >= 0, lengths >= 1, and every descriptor's end ``base + (start + n) * item_len``
    within int64, checked without overflowing.

    Hot path (a sender builds descriptors per chunk): whole-array or one-column min / max only (an
    ``axis=0`` reduction of a ``[k, 3]`` array costs ~30x more), and the bound ``end <= 2 * max(runs)``
    in Python ints; only a table near the limit takes the exact per-run check.
    """
    lo = int(runs.min())
    if lo < 1 and (lo < 0 or int(runs[:, 2].min()) < 1):
        for col, what, least in ((0, "src_start", 0), (1, "dst_start", 0), (2, "length", 1)):
            if runs[:, col].min() < least:
                bad = int(np.argmax(runs[:, col] < least))
                raise ValueError(f"runs must hold {what} >= {least}, got runs[{bad}]={runs[bad].tolist()}")
    top = int(max(src_b.max(), dst_b.max())) + 2 * int(runs.max()) * int(lens.max())
    if top <= _I64_MAX:
        return
    ends = runs[:, :2] + runs[:, 2:]  # two non-negative int64s wrap negative iff past int64
    if ends.min() < 0:
        bad = int(np.argmax((ends < 0).any(axis=1)))
        raise ValueError(f"runs[{bad}]={runs[bad].tolist()} ends past int64 rows")
    end_rows = ends.max(axis=0)
    for col, name, bases in ((0, "src_bases", src_b), (1, "dst_bases", dst_b)):
        over = (_I64_MAX - bases) // lens < end_rows[col]
        if over.any():
            l, k = int(np.argmax(over)), int(np.argmax(ends[:, col]))
            end = int(bases[l]) + int(end_rows[col]) * int(lens[l])
            raise ValueError(f"runs[{k}]={runs[k].tolist()} with {name}[{l}]={int(bases[l])} and "
                             f"item_lens[{l}]={int(lens[l])} ends at byte {end}, past int64")


def packed_src_bases(region_addr: int, num_rows: int, item_lens) -> np.ndarray:
    """Source base of each layer entry inside a pack region: ``region_addr + off_l``.

    ``off_l = sum_{k<l} num_rows * item_len[k]`` (layer-major pack, spec section 6).

    Returns:
        int64 ``[L]`` addresses (bytes).
    """
    region_addr = _int("region_addr", region_addr, minimum=0)
    return region_addr + layer_offsets(num_rows, item_lens)


def build_packed_descriptors(plan: TokenTransferPlan, region_addr: int, dst_bases, item_lens) -> np.ndarray:
    """Descriptors of a plan whose rows were gathered into a pack region (rows ``0..n-1``).

    Args:
        plan: the (window of the) plan that was packed.
        region_addr: address of the pack region (bytes).
        dst_bases: int ``[L]`` destination base addresses (bytes).
        item_lens: int ``[L]`` bytes per row per entry.

    Returns:
        int64 ``[L * k, 3]``, ``k = len(plan.packed_runs)``; the source side of entry ``l``
        stays inside ``[region_addr + off_l, region_addr + off_l + n*item_len[l])``.
    """
    lens = _per_entry("item_lens", item_lens, np.atleast_1d(np.asarray(dst_bases)).size)
    return build_descriptors(plan.packed_runs, packed_src_bases(region_addr, plan.num_rows, lens), dst_bases, lens)
