"""Transfer plans, runs and descriptors for moving KV rows prefill -> decode under DCP.

A *plan* says, for one (request chunk, source rank, destination rank), which source rows go to
which destination rows, in token order (spec sections 3-5). Rows are token slots of a KV
buffer: page id ``p`` covers rows ``p*P .. p*P+P-1``. Plans are numpy int64 and vectorised;
value checks (alignment, page counts, negative ids) raise ``ValueError`` naming the argument.

- :func:`build_token_transfer_plan` (here): prefill DCP1 -> decode DCP-N, one destination rank
  (spec section 4, the public API).
- :class:`TokenTransferPlan` and :func:`split_windows` (:mod:`dcp_jax.token_plan`): the plan
  object; ``max_batch_indices`` windows, one engine batch per window.
- :func:`build_mxn_transfer_plans` (:mod:`dcp_jax.plan_mxn`): prefill DCP-M -> decode DCP-N,
  each side with its own interleave size; one plan per (source rank, destination rank) pair
  that has rows.
- :func:`sglang_virtual_dst_pages`, :func:`virtual_page_rows` (:mod:`dcp_jax.virtual_pages`):
  sglang's shared table of virtual pages of ``P*N`` slots (spec section 3).
- :func:`group_runs`, :func:`build_descriptors`, :func:`build_packed_descriptors`
  (:mod:`dcp_jax.descriptors`): runs and ``(src_addr, dst_addr, length)`` descriptors, all layer
  entries of a plan in one array.
- :func:`prefix_alignment`, :func:`send_rows_per_rank`, :func:`pages_required`,
  :func:`rows_from_page_table` (:mod:`dcp_jax.send_range`): the send range and rank-local rows.

Every name stays importable from this module.

Chunking story (both plan builders): the *send range* is ``[decode_prefix_len, end)`` of the
request; the decode side already holds the prefix. Each page table given to a plan covers its
rank's tokens of the send range, densely, from the start of the send range: the rank-local
index of position ``t`` inside the send range is ``local_index(t) - local_len(decode_prefix_len,
rank)``, and it lives at row ``pages[j // P] * P + j % P``. A chunk is a token range
``[chunk_start, chunk_start + num_kv_tokens)`` inside the send range; each source rank sends the
rows of that range it holds. The DCP1 API of the spec passes only the chunk's own prefill pages
(``src_pages``) plus ``src_page_offset``, which is the same thing for a chunk that starts on a
prefill page boundary.
"""

from __future__ import annotations

import numpy as np

from dcp_jax._validate import check_int as _int

from dcp_jax.descriptors import (  # noqa: F401  (re-exported)
    _per_entry,
    build_descriptors,
    build_packed_descriptors,
    group_runs,
    packed_src_bases,
)
from dcp_jax.layout import check_layout_args, local_index_np, local_len_np, owner_np
from dcp_jax.plan_mxn import _page_tables, _side_rows, build_mxn_transfer_plans  # noqa: F401
from dcp_jax.send_range import (  # noqa: F401  (re-exported)
    _check_prefix,
    _int_array,
    _pages,
    pages_required,
    prefix_alignment,
    rows_from_page_table,
    send_rows_per_rank,
)
from dcp_jax.token_plan import TokenTransferPlan, split_windows  # noqa: F401
from dcp_jax.virtual_pages import (  # noqa: F401  (re-exported)
    _check_virtual,
    sglang_virtual_dst_pages,
    virtual_page_rows,
)

__all__ = [
    "TokenTransferPlan",
    "build_token_transfer_plan",
    "build_mxn_transfer_plans",
    "prefix_alignment",
    "rows_from_page_table",
    "pages_required",
    "send_rows_per_rank",
    "sglang_virtual_dst_pages",
    "virtual_page_rows",
    "group_runs",
    "build_descriptors",
    "packed_src_bases",
    "build_packed_descriptors",
    "split_windows",
]


# --------------------------------------------------------------------------------------------
# Prefill DCP1 -> decode DCP-N (spec section 4).
# --------------------------------------------------------------------------------------------


def build_token_transfer_plan(
    src_pages,
    dst_pages,
    *,
    page_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave_size: int = 1,
    src_page_offset: int = 0,
    decode_prefix_len: int = 0,
    num_kv_tokens: int | None = None,
) -> TokenTransferPlan:
    """Plan of one prefill chunk (DCP1) to decode rank ``dcp_rank`` (spec section 4).

    ::

        chunk_start = decode_prefix_len + src_page_offset * P
        owned       = [o in 0..num_kv_tokens-1 if owner(chunk_start + o) == r]
        src_rows    = src_pages[o // P] * P + o % P
        j           = local_index(chunk_start + o) - local_len(decode_prefix_len, r)
        dst_rows    = dst_pages[j // P] * P + j % P

    Args:
        src_pages: int ``[num_src_pages]`` the chunk's prefill page ids (P tokens each), >= 0.
        dst_pages: int ``[num_dst_pages]`` rank ``dcp_rank``'s page table for the whole send
            range ``[decode_prefix_len, ...)``, >= 0.
        page_size: P, tokens per page on both sides.
        dcp_size: N, decode DCP ranks.
        dcp_rank: r, the destination rank.
        interleave_size: I, tokens per ownership block (1 = token round-robin).
        src_page_offset: page offset of this chunk inside the send range (pages), >= 0.
        decode_prefix_len: tokens the decode side already holds; a multiple of
            ``lcm(P*N, I*N)`` (:func:`prefix_alignment`).
        num_kv_tokens: valid tokens in this chunk (the last page may be partial); default
            ``len(src_pages) * P``.

    Returns:
        :class:`TokenTransferPlan` with int64 ``src_token_indices`` / ``dst_token_indices`` in
        token order (both empty for an empty chunk), ``src_rank=0``, ``dst_rank=dcp_rank``.

    Raises:
        TypeError: a non-integer argument.
        ValueError: (naming the argument) ``decode_prefix_len`` not a multiple of
            ``lcm(P*N, I*N)``; ``num_kv_tokens`` negative or > ``len(src_pages) * P``; too few
            ``dst_pages`` (says how many are required); negative page ids; non-positive sizes;
            ``dcp_rank`` out of range; negative ``src_page_offset``.

    Example:
        >>> p = build_token_transfer_plan([10, 11], [30], page_size=4, dcp_size=2, dcp_rank=1)
        >>> p.src_token_indices.tolist(), p.dst_token_indices.tolist()
        ([41, 43, 45, 47], [120, 121, 122, 123])
    """
    page_size = _int("page_size", page_size, minimum=1)
    n, i, r = check_layout_args(dcp_size, interleave_size, dcp_rank)
    src_page_offset = _int("src_page_offset", src_page_offset, minimum=0)
    decode_prefix_len = _check_prefix(decode_prefix_len, page_size, n, i)
    src = _pages("src_pages", src_pages, page_size)
    dst = _pages("dst_pages", dst_pages, page_size)
    capacity = src.size * page_size
    if num_kv_tokens is None:
        num_kv_tokens = capacity
    num_kv_tokens = _int("num_kv_tokens", num_kv_tokens, minimum=0)
    if num_kv_tokens > capacity:
        raise ValueError(
            f"num_kv_tokens must be <= len(src_pages) * page_size = {src.size} * {page_size} = {capacity},"
            f" got {num_kv_tokens=}"
        )

    chunk_start = decode_prefix_len + src_page_offset * page_size
    t = chunk_start + np.arange(num_kv_tokens, dtype=np.int64)
    mine = owner_np(t, n, i) == r
    offsets = np.flatnonzero(mine).astype(np.int64)
    t = t[mine]
    src_rows = src[offsets // page_size] * page_size + offsets % page_size
    j = local_index_np(t, n, i) - int(local_len_np(decode_prefix_len, n, r, i))
    dst_rows = rows_from_page_table(j, dst, page_size, name="dst_pages")
    return TokenTransferPlan(src_rows, dst_rows, src_rank=0, dst_rank=r)
