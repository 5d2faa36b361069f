"""The send range and rank-local rows, shared by every plan builder (spec sections 3-4).

The send range is ``[decode_prefix_len, end)``: :func:`prefix_alignment` says what
``decode_prefix_len`` must be a multiple of, :func:`send_rows_per_rank` how many rows each rank
holds of the range, :func:`pages_required` how many pages that takes, and
:func:`rows_from_page_table` where a rank-local index lives in a page table. Also the argument
normalisation of the planning layer (int64 arrays, page tables). Moved out of
:mod:`dcp_jax.plan`, which re-exports every name.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dcp_jax._validate import I64_MAX as _I64_MAX
from dcp_jax._validate import as_int64 as _as_int64  # noqa: F401 - dcp_jax.descriptors imports it from here
from dcp_jax._validate import check_int as _int
from dcp_jax._validate import pages_required_text

from dcp_jax.layout import check_layout_args, local_len_np


__all__ = [
    "prefix_alignment",
    "send_rows_per_rank",
    "pages_required",
    "rows_from_page_table",
]


# --------------------------------------------------------------------------------------------
# Argument normalisation.
# --------------------------------------------------------------------------------------------


def _int_array(name: str, value: Any) -> np.ndarray:
    """A 1-D int64 array; an empty input of any dtype (e.g. ``[]``) is an empty int64 array."""
    arr = np.asarray(value)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return _as_int64(name, arr)


def _pages(name: str, value: Any, page_size: int | None = None) -> np.ndarray:
    """A page table: 1-D int64 ids, >= 0, no id twice (two token ranges on one page would
    overwrite each other), and, with ``page_size``, every row ``id * P + P - 1`` within int64."""
    arr = _int_array(name, value)
    if arr.size == 0:
        return arr
    if arr.min() < 0:
        bad = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{name} must hold page ids >= 0, got {name}[{bad}]={int(arr[bad])}")
    uniq, first, counts = np.unique(arr, return_index=True, return_counts=True)
    if (counts > 1).any():
        dup = int(uniq[np.argmax(counts > 1)])
        where = np.flatnonzero(arr == dup)[:2].tolist()
        raise ValueError(f"{name} holds page id {dup} twice (at {where}); a page table must not repeat pages")
    if page_size is not None and int(arr.max()) > np.iinfo(np.int64).max // page_size - 1:
        raise ValueError(f"{name} holds page id {int(arr.max())}, whose rows overflow int64 "
                         f"with page_size={page_size}")
    return arr


def prefix_alignment(page_size: int, dcp_size: int, interleave_size: int = 1) -> int:
    """Tokens that ``decode_prefix_len`` must be a multiple of: ``lcm(P*N, I*N)``.

    With this alignment every decode rank holds the same number of prefix tokens
    (``prefix / N``, a whole number of blocks) and that number fills whole pages, so the send
    range starts on a fresh page of every rank.

    Raises:
        TypeError, ValueError: non-positive ``page_size``, ``dcp_size`` or ``interleave_size``.
    """
    page_size = _int("page_size", page_size, minimum=1)
    n, i, _ = check_layout_args(dcp_size, interleave_size)
    return math.lcm(page_size * n, i * n)


def _check_prefix(decode_prefix_len: Any, page_size: int, n: int, i: int) -> int:
    decode_prefix_len = _int("decode_prefix_len", decode_prefix_len, minimum=0)
    align = math.lcm(page_size * n, i * n)
    if decode_prefix_len % align:
        raise ValueError(
            f"decode_prefix_len must be a multiple of lcm(page_size*dcp_size, interleave_size*dcp_size)"
            f" = lcm({page_size}*{n}, {i}*{n}) = {align} tokens, got {decode_prefix_len=}"
        )
    return decode_prefix_len


def send_rows_per_rank(
    total_tokens: int, *, dcp_size: int, interleave_size: int = 1, decode_prefix_len: int = 0
) -> list[int]:
    """Rows each rank holds of the send range ``[decode_prefix_len, total_tokens)``.

    ``local_len(total, r) - local_len(prefix, r)`` per rank: the rows its page table for the
    send range must cover (on either side; pass the prefill side's size and interleave for
    prefill tables).

    Raises:
        ValueError: negative or inverted token counts, bad sizes.
    """
    n, i, _ = check_layout_args(dcp_size, interleave_size)
    total_tokens = _int("total_tokens", total_tokens, minimum=0)
    decode_prefix_len = _int("decode_prefix_len", decode_prefix_len, minimum=0)
    if decode_prefix_len > total_tokens:
        raise ValueError(f"decode_prefix_len must be <= total_tokens, got {decode_prefix_len=}, {total_tokens=}")
    ranks = np.arange(n)
    return (local_len_np(total_tokens, n, ranks, i) - local_len_np(decode_prefix_len, n, ranks, i)).tolist()


def pages_required(num_local_rows: int, page_size: int) -> int:
    """Pages a rank needs for ``num_local_rows`` dense local rows: ``ceil(rows / P)``."""
    num_local_rows = _int("num_local_rows", num_local_rows, minimum=0)
    page_size = _int("page_size", page_size, minimum=1)
    return -(-num_local_rows // page_size)


def rows_from_page_table(local_indices, pages, page_size: int, *, name: str = "pages",
                         validated: bool = False) -> np.ndarray:
    """Rows of dense rank-local indices in a per-rank page table: ``pages[j // P] * P + j % P``.

    Args:
        local_indices: int64 ``[n]`` rank-local indices (rows of the rank's dense order), >= 0.
        pages: int64 ``[num_pages]`` the rank's page table (page ids >= 0).
        page_size: P (tokens per page).
        name: argument name used in error messages.
        validated: True when the caller validated ``pages`` once already (ids >= 0, none
            repeated, rows within int64: a sender plans every chunk of a request from tables
            it checked at ``send``/``expect``); only the table's length is checked then. The
            duplicate check sorts the table, which cost more than the lookup on every chunk.

    Returns:
        int64 ``[n]`` buffer rows.

    Raises:
        ValueError: negative or repeated page ids, or too few pages for the largest index (the
            message says how many are required).
    """
    page_size = _int("page_size", page_size, minimum=1)
    pages = _int_array(name, pages) if validated else _pages(name, pages, page_size)
    j = _int_array("local_indices", local_indices)
    if j.size == 0:
        return np.zeros(0, np.int64)
    required = int(j.max()) // page_size + 1
    if pages.size < required:
        raise ValueError(
            f"too few {name}: {pages_required_text(required, page_size)} for local row "
            f"{int(j.max())}, got {len(pages)}"
        )
    return pages[j // page_size] * page_size + j % page_size
