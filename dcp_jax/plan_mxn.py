"""Prefill DCP-M -> decode DCP-N: :func:`build_mxn_transfer_plans`, one plan per (source rank,
destination rank) pair of a chunk, each side with its own interleave size (and page size).

Both sides index their page tables from the start of the send range (spec sections 3-5; the
chunking story is in :mod:`dcp_jax.plan`, which re-exports every name).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dcp_jax._validate import check_int as _int
from dcp_jax._validate import pages_required_text

from dcp_jax.layout import check_layout_args, local_index_np, local_len_np, owner_np
from dcp_jax.send_range import _check_prefix, _pages
from dcp_jax.token_plan import TokenTransferPlan

__all__ = ["build_mxn_transfer_plans"]


# --------------------------------------------------------------------------------------------
# Prefill DCP-M -> decode DCP-N.
# --------------------------------------------------------------------------------------------


def _page_tables(name: str, tables: Sequence[Any], expected: int, size_name: str) -> list[np.ndarray]:
    if isinstance(tables, np.ndarray) and tables.ndim == 2:
        tables = list(tables)
    tables = list(tables)
    if len(tables) != expected:
        raise ValueError(f"{name} must hold one page table per rank ({size_name}={expected}), got {len(tables)}")
    return [_pages(f"{name}[{k}]", tab) for k, tab in enumerate(tables)]


def _side_rows(
    name: str,
    t: np.ndarray,
    ranks: np.ndarray,
    tables: list[np.ndarray],
    page_size: int,
    size: int,
    inter: int,
    send_start: int,
) -> np.ndarray:
    """Rows of positions ``t`` (owned by ``ranks``) in per-rank page tables based at ``send_start``."""
    j = local_index_np(t, size, inter) - local_len_np(send_start, size, ranks, inter)
    if t.size:
        end = int(t[-1]) + 1
        first = int(t[0])
        for k in range(size):
            # Largest local index of rank k inside the chunk, if it holds any token of it.
            if local_len_np(end, size, k, inter) > local_len_np(first, size, k, inter):
                last = int(local_len_np(end, size, k, inter)) - int(local_len_np(send_start, size, k, inter)) - 1
                required = last // page_size + 1
                if tables[k].size < required:
                    raise ValueError(
                        f"too few pages in {name}[{k}]: {pages_required_text(required, page_size)}"
                        f" for local row {last}, got {tables[k].size}"
                    )
    lengths = np.array([tab.size for tab in tables], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    flat = np.concatenate(tables).astype(np.int64) if tables else np.zeros(0, np.int64)
    if t.size == 0:
        return np.zeros(0, np.int64)
    return flat[starts[ranks] + j // page_size] * page_size + j % page_size


def build_mxn_transfer_plans(
    src_page_tables: Sequence[Any],
    dst_page_tables: Sequence[Any],
    *,
    page_size: int,
    prefill_dcp_size: int,
    dcp_size: int,
    num_kv_tokens: int,
    prefill_interleave_size: int = 1,
    interleave_size: int = 1,
    decode_prefix_len: int = 0,
    chunk_start: int | None = None,
    prefill_page_size: int | None = None,
) -> dict[tuple[int, int], TokenTransferPlan]:
    """Plans of one chunk from prefill DCP-M to decode DCP-N, one per (src_rank, dst_rank).

    Prefill rank ``s`` holds the tokens ``t`` with ``(t // I_p) % M == s`` densely in its own
    pages; decode rank ``d`` receives those with ``(t // I) % N == d``. Both sides index their
    page tables from the start of the send range ``[decode_prefix_len, ...)``::

        js = local_index_p(t) - local_len_p(decode_prefix_len, s)   # prefill rank-local index
        jd = local_index(t)   - local_len(decode_prefix_len, d)     # decode rank-local index
        src_row = src_page_tables[s][js // P_p] * P_p + js % P_p
        dst_row = dst_page_tables[d][jd // P]   * P   + jd % P

    for ``t`` in the chunk ``[chunk_start, chunk_start + num_kv_tokens)``. Special cases: M = 1
    is :func:`build_token_transfer_plan` over all destination ranks; equal layouts (M = N,
    I_p = I) give only pairs ``(r, r)``, and with ``I`` a multiple of the page size their runs
    are whole pages.

    Args:
        src_page_tables: M page tables (int ``[pages_s]`` each), prefill rank s's pages for its
            tokens of the send range.
        dst_page_tables: N page tables (int ``[pages_d]`` each), decode rank d's pages for its
            tokens of the send range (spec section 3).
        page_size: P, tokens per decode page (and per prefill page unless
            ``prefill_page_size`` is given).
        prefill_dcp_size: M, prefill DCP ranks.
        dcp_size: N, decode DCP ranks.
        num_kv_tokens: tokens in this chunk (tokens), >= 0.
        prefill_interleave_size: I_p, the prefill side's ownership block (tokens).
        interleave_size: I, the decode side's ownership block (tokens).
        decode_prefix_len: tokens decode already holds; a multiple of ``lcm(P*N, I*N)``.
        chunk_start: absolute position of the chunk's first token; default
            ``decode_prefix_len``; must be >= ``decode_prefix_len``.
        prefill_page_size: tokens per prefill page; default ``page_size``.

    Returns:
        dict ``{(src_rank, dst_rank): TokenTransferPlan}`` with an entry for every pair that has
        at least one row, rows in token order; empty for an empty chunk.

    Raises:
        TypeError: non-integer arguments.
        ValueError: (naming the argument) wrong number of page tables, negative page ids, too
            few pages in a table (says how many are required), misaligned
            ``decode_prefix_len``, ``chunk_start`` before the send range, bad sizes.
    """
    page_size = _int("page_size", page_size, minimum=1)
    prefill_page_size = page_size if prefill_page_size is None else _int(
        "prefill_page_size", prefill_page_size, minimum=1
    )
    m = _int("prefill_dcp_size", prefill_dcp_size, minimum=1)
    ip = _int("prefill_interleave_size", prefill_interleave_size, minimum=1)
    n, i, _ = check_layout_args(dcp_size, interleave_size)
    decode_prefix_len = _check_prefix(decode_prefix_len, page_size, n, i)
    if chunk_start is None:
        chunk_start = decode_prefix_len
    chunk_start = _int("chunk_start", chunk_start, minimum=0)
    if chunk_start < decode_prefix_len:
        raise ValueError(
            f"chunk_start must be >= decode_prefix_len (the send range starts there), got {chunk_start=},"
            f" {decode_prefix_len=}"
        )
    num_kv_tokens = _int("num_kv_tokens", num_kv_tokens, minimum=0)
    src_tables = _page_tables("src_page_tables", src_page_tables, m, "prefill_dcp_size")
    dst_tables = _page_tables("dst_page_tables", dst_page_tables, n, "dcp_size")

    t = chunk_start + np.arange(num_kv_tokens, dtype=np.int64)
    s = owner_np(t, m, ip)
    d = owner_np(t, n, i)
    src_rows = _side_rows("src_page_tables", t, s, src_tables, prefill_page_size, m, ip, decode_prefix_len)
    dst_rows = _side_rows("dst_page_tables", t, d, dst_tables, page_size, n, i, decode_prefix_len)

    key = s * n + d
    order = np.argsort(key, kind="stable")  # stable: token order within each pair
    counts = np.bincount(key, minlength=m * n)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    plans: dict[tuple[int, int], TokenTransferPlan] = {}
    for k in np.flatnonzero(counts):
        sel = order[bounds[k] : bounds[k + 1]]
        src_rank, dst_rank = divmod(int(k), n)
        plans[(src_rank, dst_rank)] = TokenTransferPlan(src_rows[sel], dst_rows[sel], src_rank, dst_rank)
    return plans
