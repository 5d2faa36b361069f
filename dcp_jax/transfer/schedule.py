"""The send algorithm, one model of it: which rows go where, in which batches, at what cost.

A sender (prefill rank) moves tokens ``[start, stop)`` of a request to the decode ranks that own
them (spec sections 2-6 and 10). Page-table conventions (section 10), each side with its own
``(dcp_size, dcp_rank, interleave_size, page_size)`` (:class:`SideLayout`):

- sender: ``page_table[k]`` holds the rank's local rows ``[k*P_s, (k+1)*P_s)``, local row of
  token t = ``local_index_M(t)`` on prefill rank ``owner_M(t)`` (t itself when M = 1);
- receiver: ``page_table[k]`` holds its local rows ``[k*P_d, (k+1)*P_d)``, local row of token t
  = ``local_index_N(t)``, counted from token 0 (prefix included).

Ownership comes only from :mod:`dcp_jax.layout`, page -> row mapping from
:func:`dcp_jax.plan.rows_from_page_table`. One (chunk, destination rank) unit is a
:class:`RankChunk` (`dcp_jax.transfer.rank_chunk`: its windows, descriptors and engine calls);
a :class:`TransferSchedule` (`dcp_jax.transfer.schedule_totals`) lists one per (chunk,
destination rank), in send order, and counts descriptors, bytes, batches, notifications and
engine calls. Both are re-exported here.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from dcp_jax._validate import check_int, pages_required_text
from dcp_jax.layout import check_layout_args, count_int, local_index_np, local_len_np, owner_np
from dcp_jax.plan import rows_from_page_table
from dcp_jax.send_range import _int_array

__all__ = ["PLAN_MODES", "SideLayout", "owned_count", "owned_tokens", "owned_rows", "token_rows", "chunk_rows", "RankChunk", "plan_rank_chunk", "batch_engine_calls",
           "ScheduleCounts", "TransferSchedule"]

_EMPTY = np.zeros(0, np.int64)


@dataclasses.dataclass(frozen=True)
class SideLayout:
    """One side's token layout: DCP group, rank, ownership block and page size.

    Attributes:
        dcp_size: ranks of this side's DCP group (M prefill, N decode), >= 1.
        dcp_rank: this rank, ``0 <= dcp_rank < dcp_size``.
        interleave_size: tokens per ownership block (1 = token round-robin), >= 1.
        page_size: tokens per page of this side's cache, >= 1.

    Raises:
        TypeError, ValueError: a field is not an int or out of range (named).
    """

    dcp_size: int
    dcp_rank: int
    interleave_size: int
    page_size: int

    def __post_init__(self) -> None:
        n, i, r = check_layout_args(self.dcp_size, self.interleave_size, self.dcp_rank)
        for k, v in (("dcp_size", n), ("interleave_size", i), ("dcp_rank", r),
                     ("page_size", check_int("page_size", self.page_size, minimum=1))):
            object.__setattr__(self, k, v)

    @classmethod
    def of(cls, spec) -> "SideLayout":
        """The layout of a :class:`dcp_jax.transfer.spec.KVCacheSpec` (or any object with its fields)."""
        return cls(spec.dcp_size, spec.dcp_rank, spec.interleave_size, spec.page_size)

    def _owns(self, t: np.ndarray) -> np.ndarray:
        return owner_np(t, self.dcp_size, self.interleave_size) == self.dcp_rank


def _range(start, stop) -> tuple[int, int]:
    start = check_int("start", start, minimum=0)
    stop = check_int("stop", stop, minimum=0)
    for name, v in (("start", start), ("stop", stop)):
        if v > 2**62:  # token positions are int64 below; leave room for the arithmetic
            raise ValueError(f"{name}={v} must be <= 2**62 (tokens)")
    if stop < start:
        raise ValueError(f"stop must be >= start (tokens), got {start=}, {stop=}")
    return start, stop


def _check_sides(dst, src, dst_name: str = "dst") -> None:
    """TypeError naming the argument unless ``dst`` is a SideLayout and ``src`` one or None."""
    for name, side in ((dst_name, dst), ("src", src)):
        if not (isinstance(side, SideLayout) or (side is None and name == "src")):
            raise TypeError(f"{name} must be a SideLayout, got {type(side).__name__}")


def _local_range(side: SideLayout, start: int, stop: int) -> tuple[int, int]:
    """``(j0, j1)``: the local indices on ``side`` of the tokens of ``[start, stop)`` it owns are
    exactly ``range(j0, j1)`` (``local_len`` at both ends)."""
    j0, j1 = local_len_np(np.array([start, stop], np.int64), side.dcp_size, side.dcp_rank,
                          side.interleave_size).tolist()
    return j0, j1


def _tokens_of_rank(side: SideLayout, start: int, stop: int) -> np.ndarray:
    """Tokens of ``[start, stop)`` owned by ``side``, from its local index range (O(owned)).

    The inverse of ``local_index`` on rank r: local index j is token
    ``(j // I) * (I*N) + r*I + j % I`` (checked against ``owner_np``/``local_index_np`` in the tests).
    """
    n, i, r = side.dcp_size, side.interleave_size, side.dcp_rank
    j0, j1 = _local_range(side, start, stop)
    j = np.arange(j0, j1, dtype=np.int64)
    return (j // i) * (i * n) + r * i + j % i


def owned_count(start: int, stop: int, *, dst: SideLayout, src: SideLayout | None = None) -> int:
    """``len(owned_tokens(start, stop, dst=dst, src=src))``, without listing the tokens when the
    source side is one rank (`layout.count_int`: O(1)); with a larger source group it
    lists the smaller side's share, as :func:`owned_tokens` does. A receiver checks a completed
    chunk's row count with it.

    Raises:
        TypeError: ``dst`` (or a given ``src``) not a SideLayout; as :func:`owned_tokens`.
        ValueError: as :func:`owned_tokens` (``start``/``stop`` negative, past 2**62, or
            ``stop < start``).
    """
    start, stop = _range(start, stop)
    _check_sides(dst, src)
    if src is None or src.dcp_size == 1:
        return count_int(start, stop - start, dst.dcp_size, dst.dcp_rank, dst.interleave_size)
    return int(len(owned_tokens(start, stop, dst=dst, src=src)))


def owned_tokens(start: int, stop: int, *, dst: SideLayout, src: SideLayout | None = None) -> np.ndarray:
    """Tokens t of ``[start, stop)`` with ``owner_N(t) == dst.dcp_rank`` (and ``owner_M(t) ==
    src.dcp_rank`` when ``src`` is given), ascending.

    Enumerated from the local index range of one rank (the one of the larger group, whose
    share is the smaller) and filtered by the other side's owner: O(tokens that rank owns),
    never a scan of every token.

    Args:
        start, stop: token positions, ``0 <= start <= stop`` (tokens).
        dst: the destination (decode) rank's layout.
        src: the source (prefill) rank's layout, or None for all sources.

    Returns:
        i64[n] token positions.

    Raises:
        TypeError, ValueError: bad ``start``/``stop`` (named); TypeError: ``dst`` (or a given
            ``src``) not a SideLayout.
    """
    start, stop = _range(start, stop)
    _check_sides(dst, src)
    if src is None or src.dcp_size == 1:
        return _tokens_of_rank(dst, start, stop)
    # Each side owns about (stop - start) / size tokens of the range: enumerate the smaller share.
    base, other = (dst, src) if dst.dcp_size >= src.dcp_size else (src, dst)
    t = _tokens_of_rank(base, start, stop)
    return t[other._owns(t)]


def _token_rows(tokens, side: SideLayout, page_table, name: str, check_table: bool,
                validated: bool = False) -> np.ndarray:
    """`token_rows`; ``validated``: ascending tokens ``side`` owns by construction, through a
    table validated once per request (only its length is checked)."""
    t = np.asarray(tokens)
    if t.size == 0:
        if check_table:
            rows_from_page_table(_EMPTY, page_table, side.page_size, name=name)
        return _EMPTY.copy()
    if not validated:
        if not np.issubdtype(t.dtype, np.integer) or t.ndim != 1:
            raise TypeError(f"tokens must be a 1-D integer array, got dtype {t.dtype}, shape {t.shape}")
        if not side._owns(t).all():
            bad = int(t[~side._owns(t)][0])
            raise ValueError(f"tokens holds token {bad}, which dcp_rank={side.dcp_rank} does not own")
    local = local_index_np(t, side.dcp_size, side.interleave_size)
    p = side.page_size
    top = int(local[-1]) if validated else int(local.max())
    hi = top // p + 1
    table = _int_array(name, page_table)  # 1-D integers (TypeError / ValueError naming it)
    if check_table:
        rows_from_page_table(_EMPTY, table, p, name=name)  # validates the whole table once
    if table.size < hi:
        raise ValueError(f"{name} is too short: {pages_required_text(hi, p)} for local row "
                         f"{top} of dcp_rank={side.dcp_rank}, got {table.size}")
    if validated:  # the duplicate check sorts the table: on every chunk it cost more than the lookup
        return rows_from_page_table(local, table, p, name=name, validated=True)
    # Only the pages the tokens touch go to rows_from_page_table (the table was validated once).
    lo = int(local.min()) // p
    return rows_from_page_table(local - lo * p, table[lo:hi], p, name=name)


def token_rows(tokens, side: SideLayout, page_table, *, check_table: bool = True,
               validated: bool = False) -> np.ndarray:
    """Rows of ``tokens`` in ``side``'s cache: local row ``local_index(t)`` through its page table.

    Args:
        tokens: i64[n] token positions, all owned by ``side.dcp_rank``.
        side: the rank's layout.
        page_table: i64[pages] the rank's page table from its local row 0 (section 10).
        check_table: validate the whole table (ids >= 0, none repeated); False checks only the
            pages the tokens touch (for a table validated once per request).
        validated: with ``check_table=False``: the tokens are ascending and ``side``'s by
            construction (`owned_tokens`) and the table was validated once: nothing but the
            table's length is checked (the pages' duplicate check sorts them).

    Returns:
        i64[n] buffer rows (``page_table[j // P] * P + j % P``).

    Raises:
        TypeError: non-integer tokens or ``page_table``; ``side`` not a SideLayout.
        ValueError: a token the rank does not own; negative or repeated page ids; a
            ``page_table`` that is not 1-D or too short (the message says how many pages are
            required).
    """
    _check_sides(side, None, "side")
    return _token_rows(tokens, side, page_table, "page_table", bool(check_table),
                       validated=bool(validated) and not check_table)


def owned_rows(start: int, stop: int, *, dst: SideLayout, page_table, src: SideLayout | None = None) -> np.ndarray:
    """``token_rows(owned_tokens(start, stop, dst=dst, src=src), dst, page_table,
    check_table=False, validated=True)``: the rows in ``dst``'s cache of the tokens of
    ``[start, stop)`` it owns (and ``src`` holds), in token order, through a page table the
    caller validated once (a receiver's region grant: its table was checked at ``expect``).

    With a one-rank source (``src`` None or ``dcp_size == 1``) those tokens' local indices are
    one range ``[local_len(start), local_len(stop))``, so no token list is made and the rows
    come page by page (a 4,096-row grant's lookup took ~0.2 ms through the token list on a
    2-core host, 2026-12-08).

    Args:
        start, stop: token positions, ``0 <= start <= stop`` (tokens).
        dst: the rank's layout. page_table: i64[pages] its validated page table (section 10).
        src: the source rank's layout, or None for all sources.

    Returns:
        i64[n] buffer rows (``page_table[j // P] * P + j % P`` for each local index j).

    Raises:
        TypeError: ``dst`` (or a given ``src``) not a SideLayout; a ``page_table`` that is not
            integers (floats, bools, strings, None). ValueError: as `owned_tokens` for
            ``start``/``stop``; a ``page_table`` that is not 1-D, holds values past int64, or
            is too short (the message says how many pages are required).
    """
    start, stop = _range(start, stop)
    _check_sides(dst, src)
    if src is not None and src.dcp_size > 1:
        return _token_rows(owned_tokens(start, stop, dst=dst, src=src), dst, page_table, "page_table", False,
                           validated=True)
    j0, j1 = _local_range(dst, start, stop)
    if j1 <= j0:
        return _EMPTY.copy()
    p = dst.page_size
    p0, hi = j0 // p, (j1 - 1) // p + 1
    table = _int_array("page_table", page_table)  # 1-D integers (TypeError / ValueError otherwise)
    if table.size < hi:
        raise ValueError(f"page_table is too short: {pages_required_text(hi, p)} for local row "
                         f"{j1 - 1} of dcp_rank={dst.dcp_rank}, got {table.size}")
    # rows_from_page_table's formula over one range, a page at a time (5.7 against 24.4 us for
    # 4,096 rows through the per-row division on this host, 2026-12-08).
    pages = table[p0:hi]
    rows = (pages[:, None] * p + np.arange(p, dtype=np.int64)).reshape(-1)
    return rows[j0 - p0 * p:j1 - p0 * p]


def chunk_rows(start: int, stop: int, *, src: SideLayout, dst: SideLayout, src_page_table,
               dst_page_table) -> tuple[np.ndarray, np.ndarray]:
    """``(src_rows, dst_rows)``: i64[n] each, the rows of the tokens of ``[start, stop)`` that
    ``src`` sends to ``dst``, in token order.

    Raises:
        ValueError: as :func:`owned_tokens` and :func:`token_rows` (``src_page_table`` /
            ``dst_page_table`` named).
    """
    return _chunk_rows(start, stop, src, dst, src_page_table, dst_page_table, True)


def _chunk_rows(start, stop, src, dst, src_page_table, dst_page_table, check: bool,
                names=("src_page_table", "dst_page_table")):
    t = owned_tokens(start, stop, dst=dst, src=src)
    # Unchecked: the tokens are both sides' by construction and the tables were validated once
    # per request (the sender, at send / expect): ~2x faster plans at P = 64, ~30x at P = 1.
    return (_token_rows(t, src, src_page_table, names[0], check, validated=not check),
            _token_rows(t, dst, dst_page_table, names[1], check, validated=not check))


# One (chunk, rank) unit's plan, and a request's whole schedule and its totals, live beside this
# module (re-exported here: one name for callers); they build on the functions above.
from dcp_jax.transfer.rank_chunk import PLAN_MODES, RankChunk, batch_engine_calls, plan_rank_chunk  # noqa: E402
from dcp_jax.transfer.schedule_totals import ScheduleCounts, TransferSchedule  # noqa: E402
