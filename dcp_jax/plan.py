"""Transfer plans, runs and descriptors for moving KV rows prefill -> decode under DCP.

A *plan* says, for one (request chunk, source rank, destination rank), which source rows go to
which destination rows, in token order (spec sections 3-5). Rows are token slots of a KV
buffer: page id ``p`` covers rows ``p*P .. p*P+P-1``. Plans are numpy int64 and vectorised;
value checks (alignment, page counts, negative ids) raise ``ValueError`` naming the argument.

- :func:`build_token_transfer_plan`: prefill DCP1 -> decode DCP-N, one destination rank
  (spec section 4, the public API).
- :func:`build_mxn_transfer_plans`: prefill DCP-M -> decode DCP-N, each side with its own
  interleave size; one plan per (source rank, destination rank) pair that has rows.
- :func:`sglang_virtual_dst_pages`, :func:`virtual_page_rows`: sglang's shared table of
  virtual pages of ``P*N`` slots (spec section 3).
- :func:`group_runs`, :func:`build_descriptors`, :func:`build_packed_descriptors`: runs and
  ``(src_addr, dst_addr, length)`` descriptors, all layer entries of a plan in one array.
- :func:`split_windows`: ``max_batch_indices`` windows, one engine batch per window.

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

import dataclasses
import functools
import math
from typing import Any, Sequence, overload

import numpy as np

from dcp_jax._validate import check_int as _int

from dcp_jax.layout import check_layout_args, local_index_np, local_len_np, owner_np
from dcp_jax.packing import layer_offsets

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
    return arr.astype(np.int64, copy=False)


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
            f"too few {name}: {required} pages of {page_size} tokens are required for local row "
            f"{int(j.max())}, got {len(pages)}"
        )
    return pages[j // page_size] * page_size + j % page_size


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
                        f"too few pages in {name}[{k}]: {required} pages of {page_size} tokens are required"
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


# --------------------------------------------------------------------------------------------
# sglang's virtual pages (spec section 3).
# --------------------------------------------------------------------------------------------


def _check_virtual(page_size: Any, dcp_size: Any, interleave_size: Any) -> tuple[int, int, int]:
    page_size = _int("page_size", page_size, minimum=1)
    n, i, _ = check_layout_args(dcp_size, interleave_size)
    if page_size % i:
        # A virtual page of P*N slots gives every rank exactly P of them only if I divides P.
        raise ValueError(
            f"virtual pages need interleave_size to divide page_size, got {interleave_size=}, {page_size=}"
        )
    return page_size, n, i


def sglang_virtual_dst_pages(
    virtual_pages,
    *,
    page_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave_size: int = 1,
    decode_prefix_len: int = 0,
) -> np.ndarray:
    """Rank ``dcp_rank``'s page table for the send range under sglang's virtual-page convention.

    sglang's allocator hands out *virtual pages* of ``P*N`` token slots; virtual page ``q`` is
    physical page ``q`` on every rank, so one table serves all ranks. The table covers the
    request from position 0; the send range starts at ``decode_prefix_len`` (a multiple of
    ``P*N``), i.e. at virtual page ``decode_prefix_len // (P*N)``. The result is the
    ``dst_pages`` argument of :func:`build_token_transfer_plan` (the same for every rank).

    Args:
        virtual_pages: int ``[num_virtual_pages]`` the request's virtual page ids, >= 0.
        page_size: P (tokens per physical page; a virtual page has ``P*N`` slots).
        dcp_size: N.
        dcp_rank: r (validated; every rank gets the same table).
        interleave_size: I; must divide P.
        decode_prefix_len: tokens decode already holds, a multiple of ``P*N``.

    Returns:
        int64 ``[num_virtual_pages - decode_prefix_len // (P*N)]`` physical page ids.

    Raises:
        ValueError: negative ids, I not dividing P, misaligned ``decode_prefix_len``, bad sizes,
            or a table shorter than the prefix.
    """
    page_size, n, i = _check_virtual(page_size, dcp_size, interleave_size)
    check_layout_args(n, i, dcp_rank)
    decode_prefix_len = _check_prefix(decode_prefix_len, page_size, n, i)
    pages = _pages("virtual_pages", virtual_pages, page_size)
    skip = decode_prefix_len // (page_size * n)
    if skip > pages.size:
        raise ValueError(
            f"virtual_pages has {pages.size} pages but decode_prefix_len={decode_prefix_len} already spans {skip}"
        )
    return pages[skip:].copy()


def virtual_page_rows(
    virtual_slots, *, page_size: int, dcp_size: int, interleave_size: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Rank and physical row of sglang virtual slots ``q*P*N + i`` (``0 <= i < P*N``).

    The slot's position in its virtual page, ``i``, decides ownership as a token position would
    (virtual pages start at multiples of ``P*N`` tokens): rank ``owner(i)``, physical row
    ``q*P + local_index(i)``. With ``I = 1``: rank ``i % N``, row ``q*P + i // N``.

    Args:
        virtual_slots: int ``[n]`` virtual slot addresses (>= 0).
        page_size: P.
        dcp_size: N.
        interleave_size: I; must divide P.

    Returns:
        ``(ranks, rows)``, int64 ``[n]`` each.

    Raises:
        ValueError: negative slots, I not dividing P, bad sizes.

    Example:
        >>> virtual_page_rows([2 * 8 + 5], page_size=4, dcp_size=2)
        (array([1]), array([10]))
    """
    page_size, n, i = _check_virtual(page_size, dcp_size, interleave_size)
    slots = _int_array("virtual_slots", np.atleast_1d(np.asarray(virtual_slots)))
    if slots.size and slots.min() < 0:
        raise ValueError(f"virtual_slots must be >= 0, got min {int(slots.min())}")
    q, within = np.divmod(slots, page_size * n)
    return owner_np(within, n, i), q * page_size + local_index_np(within, n, i)


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
            ``[k, 3]``.
    """
    runs_arr = np.asarray(runs)
    if runs_arr.size == 0:
        runs_arr = np.zeros((0, 3), np.int64)
    if runs_arr.ndim != 2 or runs_arr.shape[1] != 3:
        raise ValueError(f"runs must have shape [k, 3], got {runs_arr.shape}")
    if not np.issubdtype(runs_arr.dtype, np.integer):
        raise TypeError(f"runs must be integers, got dtype {runs_arr.dtype}")
    runs_arr = runs_arr.astype(np.int64, copy=False)
    src_b = _per_entry("src_bases", src_bases, None)
    num = src_b.size
    dst_b = _per_entry("dst_bases", dst_bases, None)
    lens = _per_entry("item_lens", item_lens, num)
    if not (dst_b.size == num and lens.size == num):
        raise ValueError(
            f"src_bases, dst_bases and item_lens need one entry per layer entry, got {num}, {dst_b.size}, {lens.size}"
        )
    if (src_b < 0).any() or (dst_b < 0).any():
        raise ValueError("src_bases and dst_bases must be >= 0 addresses")
    if (lens <= 0).any():
        raise ValueError(f"item_lens must be > 0 bytes, got min item_lens={int(lens.min())}")
    out = np.empty((num, runs_arr.shape[0], 3), np.int64)
    out[:, :, 0] = src_b[:, None] + runs_arr[None, :, 0] * lens[:, None]
    out[:, :, 1] = dst_b[:, None] + runs_arr[None, :, 1] * lens[:, None]
    out[:, :, 2] = runs_arr[None, :, 2] * lens[:, None]
    return out.reshape(-1, 3)


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
