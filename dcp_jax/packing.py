"""Pack buffer geometry: buffer size, per-rank regions, layer-major offsets and slices.

Before sending to decode rank r, the prefill side gathers that rank's source rows of every
layer entry into a contiguous, registered pack region, layer-major (spec section 6): entry
``l`` occupies ``[off_l, off_l + n*item_len[l])`` with ``off_l = sum_{k<l} n*item_len[k]``.

- One buffer serves N ranks: ``N * ceil(max_tokens / N) * sum(item_len)`` bytes; rank r owns
  the fixed region ``[r*(size//N), (r+1)*(size//N))`` so packs for several ranks can be in
  flight at once.
- When a rank's rows do not fit its region they are sent in slices that fit (gather, send,
  wait, repeat); when not even one row fits, the caller falls back to per-row descriptors
  straight from the KV buffers, with a logged warning (:func:`choose_pack_strategy`).

:func:`pack_bytes` (``num_rows * sum(item_len)``) is the one pack-size formula: the buffer and
region sizes here and the window sizes of ``dcp_jax.transfer.schedule`` go through it.

All sizes are bytes, all counts rows (one token of one layer entry is one row). This module is
numpy/Python only: it computes geometry, the gather itself lives in ``pallas_kernels``.
"""

from __future__ import annotations

import logging
from typing import Literal, Sequence

import numpy as np

from dcp_jax._validate import check_int as _int

__all__ = [
    "PackRegionTooSmallError",
    "pack_bytes",
    "pack_buffer_size",
    "pack_region",
    "layer_offsets",
    "rows_per_region",
    "pack_slices",
    "choose_pack_strategy",
    "choose_pack_strategy_for_rows",
]

logger = logging.getLogger(__name__)

PackStrategy = Literal["packed", "sliced", "per_row"]


class PackRegionTooSmallError(ValueError):
    """The pack region cannot hold even one row of every layer entry."""


def _item_lens(item_lens: Sequence[int] | np.ndarray | int) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(item_lens))
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"item_lens must be a non-empty 1-D sequence of byte sizes, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"item_lens must be integers (bytes per row), got dtype {arr.dtype}")
    if (arr <= 0).any():
        raise ValueError(f"item_lens must be > 0 bytes, got min item_lens={int(arr.min())}")
    return arr.astype(np.int64)


def pack_bytes(num_rows: int, item_lens: Sequence[int] | np.ndarray | int) -> int:
    """Bytes of a layer-major pack of ``num_rows`` rows of every layer entry.

    ``num_rows * sum(item_len)``: THE pack-size formula; every other size in this module (and
    in ``dcp_jax.transfer.schedule``) is computed through it.

    Args:
        num_rows: rows per layer entry (rows), >= 0.
        item_lens: bytes per row of each layer entry (one int per entry, or one int for a
            single entry), each > 0.

    Returns:
        Size in bytes (Python int).

    Raises:
        TypeError, ValueError: ``num_rows`` is not a non-negative int, or ``item_lens`` is not
            a non-empty sequence of positive ints; the message names the argument.

    Example:
        >>> pack_bytes(4096, [1152] * 61)
        287834112
    """
    num_rows = _int("num_rows", num_rows, minimum=0)
    return num_rows * int(_item_lens(item_lens).sum())


def pack_buffer_size(max_tokens: int, dcp_size: int, item_lens: Sequence[int] | int) -> int:
    """Bytes of a pack buffer that serves ``dcp_size`` ranks for chunks of up to ``max_tokens``.

    ``N * ceil(max_tokens / N) * sum(item_len)``: every rank's region holds the rows of
    ``ceil(max_tokens / N)`` tokens of every layer entry (token round-robin's largest share).

    Args:
        max_tokens: largest chunk (tokens), >= 0.
        dcp_size: N, decode ranks the buffer serves, >= 1.
        item_lens: bytes per row of each layer entry (one int per entry, or one int for a
            single entry), each > 0.

    Returns:
        Buffer size in bytes (Python int).

    Raises:
        TypeError, ValueError: an argument is not a positive (non-negative for
            ``max_tokens``) int; the message names it.

    Example:
        >>> pack_buffer_size(32768, 8, [1152] * 61)
        2302672896
    """
    max_tokens = _int("max_tokens", max_tokens, minimum=0)
    dcp_size = _int("dcp_size", dcp_size, minimum=1)
    return dcp_size * pack_bytes(-(-max_tokens // dcp_size), item_lens)


def pack_region(dcp_rank: int, buffer_size: int, dcp_size: int) -> tuple[int, int]:
    """Byte region of the pack buffer that rank ``dcp_rank`` owns.

    Rank r owns ``[r * (size // N), (r + 1) * (size // N))``; any remainder of ``size % N``
    bytes at the end belongs to nobody.

    Args:
        dcp_rank: r, ``0 <= r < dcp_size``.
        buffer_size: pack buffer size (bytes), >= 0.
        dcp_size: N, >= 1.

    Returns:
        ``(offset, size)`` in bytes, offset relative to the buffer start.

    Raises:
        TypeError, ValueError: bad ints; ``dcp_rank`` out of range.
    """
    dcp_size = _int("dcp_size", dcp_size, minimum=1)
    dcp_rank = _int("dcp_rank", dcp_rank, minimum=0)
    buffer_size = _int("buffer_size", buffer_size, minimum=0)
    if dcp_rank >= dcp_size:
        raise ValueError(f"dcp_rank must satisfy 0 <= dcp_rank < dcp_size, got {dcp_rank=}, {dcp_size=}")
    size = buffer_size // dcp_size
    return dcp_rank * size, size


def layer_offsets(num_rows: int, item_lens: Sequence[int] | int) -> np.ndarray:
    """Layer-major offsets of each layer entry inside a pack of ``num_rows`` rows.

    ``off_l = sum_{k<l} num_rows * item_len[k]`` (spec section 6).

    Args:
        num_rows: rows per layer entry in the pack (rows), >= 0.
        item_lens: bytes per row of each entry, each > 0.

    Returns:
        int64 ``[len(item_lens)]`` byte offsets relative to the region start.

    Example:
        >>> layer_offsets(3, [4, 8, 2]).tolist()
        [0, 12, 36]
    """
    num_rows = _int("num_rows", num_rows, minimum=0)
    lens = _item_lens(item_lens)
    return np.concatenate([[0], np.cumsum(lens[:-1] * num_rows)]).astype(np.int64)


def rows_per_region(region_size: int, item_lens: Sequence[int] | int) -> int:
    """Rows per layer entry that fit a region: ``region_size // sum(item_len)``.

    Args:
        region_size: region size (bytes), >= 0.
        item_lens: bytes per row of each entry.

    Returns:
        Row count (rows), possibly 0.
    """
    region_size = _int("region_size", region_size, minimum=0)
    return region_size // pack_bytes(1, item_lens)


def pack_slices(num_rows: int, region_size: int, item_lens: Sequence[int] | int) -> list[tuple[int, int]]:
    """Row slices ``[start, stop)`` of a rank's rows, each of which fits its pack region.

    Used for "gather, send, wait, repeat" when a rank receives more rows than its region holds.
    Every slice but the last has ``rows_per_region`` rows; ``num_rows == 0`` gives ``[]``.

    Args:
        num_rows: rows this rank receives (rows), >= 0.
        region_size: the rank's pack region (bytes).
        item_lens: bytes per row of each entry.

    Returns:
        List of ``(start, stop)`` row ranges covering ``[0, num_rows)`` in order.

    Raises:
        PackRegionTooSmallError: (a ``ValueError``) ``num_rows > 0`` and the region cannot hold
            one row of every entry; use per-row descriptors (:func:`choose_pack_strategy`).

    Example:
        >>> pack_slices(10, 4 * 6, [2, 4])
        [(0, 4), (4, 8), (8, 10)]
    """
    num_rows = _int("num_rows", num_rows, minimum=0)
    per = rows_per_region(region_size, item_lens)
    if num_rows == 0:
        return []
    if per == 0:
        need = pack_bytes(1, item_lens)
        raise PackRegionTooSmallError(
            f"region_size={region_size} bytes holds no row; one row of every entry needs {need} bytes"
        )
    return [(s, min(s + per, num_rows)) for s in range(0, num_rows, per)]


def choose_pack_strategy(
    num_rows: int, region_size: int | None, item_lens: Sequence[int] | int
) -> PackStrategy:
    """Decides how a rank's rows are sent when packing is requested.

    - ``"packed"``: all rows fit the region; one gather, one batch.
    - ``"sliced"``: they do not, but at least one row fits; gather, send, wait, repeat over
      :func:`pack_slices`.
    - ``"per_row"``: no region (``region_size`` None) or it holds no row; fall back to
      descriptors straight from the KV buffers, and log a warning (it is the slow path).

    Args:
        num_rows: rows this rank receives (rows), >= 0.
        region_size: the rank's pack region (bytes), or None when there is no pack buffer.
        item_lens: bytes per row of each entry.

    Returns:
        One of ``"packed"``, ``"sliced"``, ``"per_row"``.
    """
    lens = _item_lens(item_lens)
    per = 0 if region_size is None else rows_per_region(region_size, lens)
    where = "missing" if region_size is None else f"of {region_size} bytes"
    return _strategy(num_rows, per, f"pack region {where} holds no row of {pack_bytes(1, lens)} bytes")


def choose_pack_strategy_for_rows(num_rows: int, region_rows: int) -> PackStrategy:
    """:func:`choose_pack_strategy` for a region given in rows (rows of every layer entry).

    The same rule: ``"packed"`` when ``num_rows <= region_rows``, ``"sliced"`` when
    ``region_rows >= 1`` holds fewer, ``"per_row"`` (with a logged warning) when
    ``region_rows == 0``.

    Args:
        num_rows: rows this rank receives (rows), >= 0.
        region_rows: rows the pack region holds (:func:`rows_per_region`), >= 0.

    Returns:
        One of ``"packed"``, ``"sliced"``, ``"per_row"``.

    Raises:
        TypeError, ValueError: negative or non-int arguments (named).
    """
    region_rows = _int("region_rows", region_rows, minimum=0)
    return _strategy(num_rows, region_rows, "pack region holds no row (region_rows=0)")


def _strategy(num_rows: int, per: int, why: str) -> PackStrategy:
    num_rows = _int("num_rows", num_rows, minimum=0)
    if per == 0:
        logger.warning("%s; sending %d rows with per-row descriptors", why, num_rows)
        return "per_row"
    return "packed" if num_rows <= per else "sliced"
