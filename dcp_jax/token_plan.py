"""The plan object, :class:`TokenTransferPlan`, and its windows, :func:`split_windows`.

A plan maps the source rows of one (chunk, source rank, destination rank) to destination rows in
token order and caches its runs (spec section 4); :func:`split_windows` cuts it into
``max_batch_indices`` windows, one engine batch per window (spec section 5). Moved out of
:mod:`dcp_jax.plan`, which re-exports both.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, overload

import numpy as np

from dcp_jax._validate import check_int as _int

from dcp_jax.descriptors import group_runs
from dcp_jax.send_range import _int_array

__all__ = ["TokenTransferPlan", "split_windows"]


# --------------------------------------------------------------------------------------------
# The plan object.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class TokenTransferPlan:
    """Source rows -> destination rows for one (chunk, source rank, destination rank).

    Attributes:
        src_token_indices: int64 ``[n]`` source rows (token slots of the prefill KV buffers),
            in token order.
        dst_token_indices: int64 ``[n]`` destination rows (token slots of the decode rank's KV
            buffers), in token order.
        src_rank: prefill DCP rank the rows come from (0 for DCP1).
        dst_rank: decode DCP rank the rows go to.

    The arrays are made read-only; ``runs`` and ``packed_runs`` are computed once and cached.

    Raises:
        TypeError: non-integer indices; ValueError: indices not 1-D, of different lengths, or
            negative (naming the array and the entry), or a negative rank.
    """

    src_token_indices: np.ndarray
    dst_token_indices: np.ndarray
    src_rank: int = 0
    dst_rank: int = 0

    def __post_init__(self) -> None:
        src = _int_array("src_token_indices", self.src_token_indices)
        dst = _int_array("dst_token_indices", self.dst_token_indices)
        if src.shape != dst.shape:
            raise ValueError(
                f"src_token_indices and dst_token_indices must have equal length, got {src.shape} and {dst.shape}"
            )
        for name, arr in (("src_token_indices", src), ("dst_token_indices", dst)):
            if arr.size and arr.min() < 0:  # rows index KV buffers: caught here, not at first use
                bad = int(np.flatnonzero(arr < 0)[0])
                raise ValueError(f"{name} must hold rows >= 0, got {name}[{bad}]={int(arr[bad])}")
        src = np.array(src, dtype=np.int64)  # own copy, so freezing it cannot freeze the caller's
        dst = np.array(dst, dtype=np.int64)
        src.setflags(write=False)
        dst.setflags(write=False)
        object.__setattr__(self, "src_token_indices", src)
        object.__setattr__(self, "dst_token_indices", dst)
        object.__setattr__(self, "src_rank", _int("src_rank", self.src_rank, minimum=0))
        object.__setattr__(self, "dst_rank", _int("dst_rank", self.dst_rank, minimum=0))

    @property
    def num_rows(self) -> int:
        """Rows (tokens) moved per layer entry."""
        return int(self.src_token_indices.shape[0])

    @functools.cached_property
    def runs(self) -> np.ndarray:
        """int64 ``[k, 3]`` runs ``(src_start, dst_start, length)`` of the direct transfer."""
        return group_runs(self.src_token_indices, self.dst_token_indices)

    @functools.cached_property
    def packed_runs(self) -> np.ndarray:
        """int64 ``[k, 3]`` runs when the source rows are ``0..n-1`` of a pack (only the
        destination pages break runs)."""
        return group_runs(np.arange(self.num_rows, dtype=np.int64), self.dst_token_indices)

    def num_descriptors(self, num_entries: int, *, packed: bool = False) -> int:
        """Descriptors for ``num_entries`` layer entries: runs x entries."""
        num_entries = _int("num_entries", num_entries, minimum=0)
        return num_entries * int((self.packed_runs if packed else self.runs).shape[0])

    def window(self, start: int, stop: int) -> "TokenTransferPlan":
        """The rows ``[start, stop)`` of this plan as a plan of its own (same ranks)."""
        return TokenTransferPlan(
            self.src_token_indices[start:stop], self.dst_token_indices[start:stop], self.src_rank, self.dst_rank
        )

    def __repr__(self) -> str:
        return (
            f"TokenTransferPlan(src_rank={self.src_rank}, dst_rank={self.dst_rank}, "
            f"rows={self.num_rows:,}, runs={self.runs.shape[0]:,}, packed_runs={self.packed_runs.shape[0]:,})"
        )


# --------------------------------------------------------------------------------------------
# Windows (spec section 5).
# --------------------------------------------------------------------------------------------


@overload
def split_windows(plan_or_indices: TokenTransferPlan, max_batch_indices: int | None) -> list[TokenTransferPlan]: ...
@overload
def split_windows(
    plan_or_indices: tuple[Any, Any], max_batch_indices: int | None
) -> list[tuple[np.ndarray, np.ndarray]]: ...


def split_windows(plan_or_indices, max_batch_indices):
    """Splits a plan (or ``(src, dst)`` index arrays) into windows of at most that many rows.

    One engine batch per window; the sender submits them in order and stops at the first
    failure. ``max_batch_indices=None`` means one window. An empty plan gives no window.

    Args:
        plan_or_indices: a :class:`TokenTransferPlan`, or a pair ``(src_indices, dst_indices)``
            of equal-length int arrays.
        max_batch_indices: rows per window (>= 1), or None.

    Returns:
        List of plans (same ranks), or of ``(src, dst)`` int64 pairs, covering the rows in order.

    Raises:
        ValueError: ``max_batch_indices`` < 1, or index arrays of different length.
    """
    if max_batch_indices is not None:
        max_batch_indices = _int("max_batch_indices", max_batch_indices, minimum=1)
    if isinstance(plan_or_indices, TokenTransferPlan):
        plan = plan_or_indices
        step = max_batch_indices or max(plan.num_rows, 1)
        return [plan.window(a, a + step) for a in range(0, plan.num_rows, step)]
    try:
        src, dst = plan_or_indices
    except (TypeError, ValueError):
        raise TypeError("plan_or_indices must be a TokenTransferPlan or a (src_indices, dst_indices) pair") from None
    src = _int_array("src_indices", src)
    dst = _int_array("dst_indices", dst)
    if src.shape != dst.shape:
        raise ValueError(f"src_indices and dst_indices must have equal length, got {src.shape} and {dst.shape}")
    step = max_batch_indices or max(src.size, 1)
    return [(src[a : a + step], dst[a : a + step]) for a in range(0, src.size, step)]
