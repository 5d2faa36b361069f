"""The send algorithm, one model of it: which rows go where, in which batches, at what cost.

A sender (prefill rank) moves tokens ``[start, stop)`` of a request to the decode ranks that own
them (spec sections 2-6 and 10). Page-table conventions (section 10), each side with its own
``(dcp_size, dcp_rank, interleave_size, page_size)`` (:class:`SideLayout`):

- sender: ``page_table[k]`` holds the rank's local rows ``[k*P_s, (k+1)*P_s)``, local row of
  token t = ``local_index_M(t)`` on prefill rank ``owner_M(t)`` (t itself when M = 1);
- receiver: ``page_table[k]`` holds its local rows ``[k*P_d, (k+1)*P_d)``, local row of token t
  = ``local_index_N(t)``, counted from token 0 (prefix included).

Ownership comes only from :mod:`dcp_jax.layout`, page -> row mapping from
:func:`dcp_jax.plan.rows_from_page_table`, runs and descriptors from :mod:`dcp_jax.plan`, pack
offsets and sizes from :mod:`dcp_jax.packing`. A :class:`TransferSchedule` lists one
:class:`RankChunk` per (chunk, destination rank), in send order, and counts descriptors, bytes,
batches, notifications and engine calls (:meth:`RankChunk.engine_calls` gives the engine rule).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import numpy as np

from dcp_jax._validate import check_int
from dcp_jax.layout import check_layout_args, count_int, local_index_np, local_len_np, owner_np
from dcp_jax.packing import choose_pack_strategy_for_rows, pack_bytes
from dcp_jax.plan import build_descriptors, group_runs, packed_src_bases, rows_from_page_table

__all__ = ["PLAN_MODES", "SideLayout", "owned_count", "owned_tokens", "token_rows", "chunk_rows", "RankChunk", "plan_rank_chunk", "batch_engine_calls",
           "ScheduleCounts", "TransferSchedule"]

Strategy = Literal["empty", "direct", "packed", "region", "fused"]
#: Modes `plan_rank_chunk` plans (the connector's transfer paths; ``"auto"`` is resolved per peer
#: by `dcp_jax.transfer._region.choose_path` before planning).
PLAN_MODES = ("direct", "packed", "region", "fused")
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


def _tokens_of_rank(side: SideLayout, start: int, stop: int) -> np.ndarray:
    """Tokens of ``[start, stop)`` owned by ``side``, from its local index range (O(owned)).

    The inverse of ``local_index`` on rank r: local index j is token
    ``(j // I) * (I*N) + r*I + j % I`` (checked against ``owner_np``/``local_index_np`` in the tests).
    """
    n, i, r = side.dcp_size, side.interleave_size, side.dcp_rank
    j0, j1 = local_len_np(np.array([start, stop], np.int64), n, r, i).tolist()
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
    for name, side in (("dst", dst), ("src", src)):
        if not (isinstance(side, SideLayout) or (side is None and name == "src")):
            raise TypeError(f"{name} must be a SideLayout, got {type(side).__name__}")
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
        TypeError, ValueError: bad ``start``/``stop`` (named).
    """
    start, stop = _range(start, stop)
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
    table = np.asarray(page_table)
    if check_table:
        rows_from_page_table(_EMPTY, table, p, name=name)  # validates the whole table once
    if table.ndim != 1 or table.size < hi:
        raise ValueError(f"{name} is too short: {hi} pages of {p} tokens are required for local row "
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
        TypeError: non-integer tokens.
        ValueError: a token the rank does not own; negative or repeated page ids; a
            ``page_table`` too short (the message says how many pages are required).
    """
    return _token_rows(tokens, side, page_table, "page_table", bool(check_table),
                       validated=bool(validated) and not check_table)


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


def _windows(n: int, step: int | None) -> tuple[tuple[int, int], ...]:
    step = step or max(n, 1)
    return tuple((a, min(a + step, n)) for a in range(0, n, step)) or ((0, 0),)


@dataclasses.dataclass(frozen=True, eq=False)
class RankChunk:
    """What one sender sends one destination rank for one chunk: rows, strategy, batches.

    Attributes:
        chunk: chunk index in the schedule.
        start, stop: the chunk's token range ``[start, stop)`` (tokens).
        dst_rank: the destination (decode) rank.
        src_rows, dst_rows: i64[n] rows of the sender's / receiver's cache, token order.
        strategy: ``"empty"`` (no rows: one empty window, only the completion goes out),
            ``"direct"`` (descriptors from the KV buffers), ``"packed"`` (each window gathered
            into a pack region first, one descriptor per destination page run per layer),
            ``"region"`` (gathered likewise, then ONE descriptor per window into the receiver's
            receive region, which the receiver unpacks into its pages) or ``"fused"`` (one
            gather-scatter kernel from the sender's pages into the receiver's IPC-mapped pages:
            no descriptor, no engine batch).
        windows: ``(lo, hi)`` row ranges into ``src_rows``/``dst_rows``, one engine batch each.
        fallback: packing was asked for but the region holds no row: sent direct.
    """

    chunk: int
    start: int
    stop: int
    dst_rank: int
    src_rows: np.ndarray
    dst_rows: np.ndarray
    strategy: Strategy
    windows: tuple[tuple[int, int], ...]
    fallback: bool = False

    num_rows = property(lambda self: int(self.src_rows.shape[0]), doc="Rows (tokens) per layer entry.")
    num_batches = property(lambda self: 0 if self.strategy in ("empty", "fused") else len(self.windows),
                           doc="Engine batches of descriptors: one per window, 0 for an empty or fused unit.")

    @functools.cached_property
    def _runs(self) -> tuple[np.ndarray, ...]:
        out = []
        if self.strategy in ("region", "fused"):  # no page runs: one or no descriptor per window
            return tuple(np.zeros((0, 3), np.int64) for _ in self.windows)
        for lo, hi in self.windows:
            src = np.arange(hi - lo, dtype=np.int64) if self.strategy == "packed" else self.src_rows[lo:hi]
            out.append(group_runs(src, self.dst_rows[lo:hi]))
        return tuple(out)

    def descriptors_per_window(self, num_layers: int) -> list[int]:
        """Descriptors of each window: runs x ``num_layers`` (direct, packed); 1 (region: the
        whole window is one contiguous pack region written or read into one contiguous receive
        region); 0 (fused, empty)."""
        num_layers = check_int("num_layers", num_layers, minimum=1)
        if self.strategy == "region":
            return [1 if hi > lo else 0 for lo, hi in self.windows]
        if self.strategy == "fused":
            return [0] * len(self.windows)
        return [int(r.shape[0]) * num_layers for r in self._runs]

    def num_descriptors(self, num_layers: int) -> int:
        """Descriptors over every window (``num_layers`` layer entries)."""
        return sum(self.descriptors_per_window(num_layers))

    def window_bytes(self, w: int, item_lens) -> int:
        """Bytes window ``w`` moves (= its pack size): ``packing.pack_bytes(rows, item_lens)``."""
        lo, hi = self.windows[w]
        return pack_bytes(hi - lo, item_lens)

    def window_descriptors(self, w: int, *, src_bases, dst_bases, item_lens, region_addr: int | None = None
                           ) -> np.ndarray:
        """i64[k, 3] ``(src_addr, dst_addr, nbytes)`` of window ``w``, layer-major.

        Direct: runs of ``(src_rows, dst_rows)`` from the KV bases. Packed: the window's rows
        sit at ``region_addr`` layer-major (entry l at ``region_addr + layer_offsets(n)[l]``,
        rows ``0..n-1``), so runs follow the destination rows only; ``src_bases`` is unused.

        Args:
            w: window index.
            src_bases, dst_bases: i64[L] address of row 0 of each layer entry (bytes).
            item_lens: i64[L] bytes per row of each entry.
            region_addr: the pack region's address (bytes); required for a packed unit.

        Raises:
            ValueError: ``region_addr`` missing for a packed unit; bad bases (as
                :func:`dcp_jax.plan.build_descriptors`).
        """
        runs = self._runs[w]
        if self.strategy in ("region", "fused"):
            raise ValueError(f"a {self.strategy} unit has no page-run descriptors (region_descriptor)")
        if self.strategy == "packed":
            if region_addr is None:
                raise ValueError("region_addr is required for the windows of a packed unit")
            lo, hi = self.windows[w]
            src_bases = packed_src_bases(region_addr, hi - lo, item_lens)
        return build_descriptors(runs, src_bases, dst_bases, item_lens)

    def region_descriptor(self, w: int, *, src_addr: int, dst_addr: int, item_lens) -> np.ndarray:
        """i64[1, 3] ``(src_addr, dst_addr, nbytes)``: window ``w`` of a region unit, the whole
        layer-major pack (``window_bytes(w)``) from the sender's pack region at ``src_addr`` to
        the receiver's receive region at ``dst_addr`` (bytes).

        Raises:
            ValueError: not a region unit, or negative addresses.
        """
        if self.strategy != "region":
            raise ValueError(f"region_descriptor is for region units, this one is {self.strategy!r}")
        src_addr = check_int("src_addr", src_addr, minimum=0)
        dst_addr = check_int("dst_addr", dst_addr, minimum=0)
        return np.array([[src_addr, dst_addr, self.window_bytes(w, item_lens)]], np.int64)

    def engine_calls(self, num_layers: int, engine_window: int | None = None) -> int:
        """Engine calls of this unit.

        NIXL (``engine_window=None``): one transfer request per batch, its notification riding
        on it; an empty unit posts a bare notification (no transfer request, 0 calls counted).
        Mooncake (``engine_window=W``): ``ceil(descriptors / W)`` submissions per batch plus
        one notification call per batch; an empty unit costs one notification-only call.
        """
        if engine_window is not None:
            check_int("engine_window", engine_window, minimum=1)
        if self.strategy == "empty":
            return batch_engine_calls(0, engine_window)
        if self.strategy == "fused":
            return 0  # the kernel is the transfer; completion rides on the control plane
        return sum(batch_engine_calls(d, engine_window) for d in self.descriptors_per_window(num_layers))

    def __repr__(self) -> str:
        return (f"RankChunk(chunk={self.chunk}, tokens=[{self.start}, {self.stop}), dst_rank={self.dst_rank}, "
                f"rows={self.num_rows:,}, strategy={self.strategy!r}{', fallback' if self.fallback else ''}, "
                f"windows={len(self.windows)}, runs={sum(r.shape[0] for r in self._runs):,})")


def batch_engine_calls(num_descriptors: int, engine_window: int | None = None) -> int:
    """Engine calls of one batch that carries a notification (the one engine-call rule).

    NIXL (``engine_window=None``): one transfer request per batch of descriptors, the
    notification riding on it; a notification-only batch (0 descriptors) is a bare
    ``send_notif``, counted as 0 calls. Mooncake (``engine_window=W``): ``ceil(n / W)``
    submissions plus one notification write; a notification-only batch costs that one write.
    """
    if engine_window is None:
        return 1 if num_descriptors else 0
    return -(-num_descriptors // engine_window) + 1


def _positive_or_none(name: str, v, minimum: int = 1) -> int | None:
    return None if v is None else check_int(name, v, minimum=minimum)


def plan_rank_chunk(chunk: int, start: int, stop: int, *, src: SideLayout, dst: SideLayout, src_page_table,
                    dst_page_table, mode: str, max_batch_indices: int | None = None,
                    max_region_rows: int | None = None, check_tables: bool = True) -> RankChunk:
    """Plans one (chunk, destination rank) unit of a sender.

    Args:
        chunk: chunk index (>= 0).
        start, stop: the chunk's tokens ``[start, stop)``.
        src, dst: sender's and receiver's layouts.
        src_page_table, dst_page_table: their page tables (section 10 conventions).
        mode: one of :data:`PLAN_MODES`: ``"direct"``, ``"packed"``, ``"region"`` or ``"fused"``.
        max_batch_indices: rows per batch (window), None = no limit.
        max_region_rows: rows the pack region holds (packed; for region: the rows both the
            sender's pack region and the receiver's receive region hold), None = no limit.
            Fewer rows than the unit has: sliced sending (one pack per window); 0: direct, with
            a logged warning (:func:`dcp_jax.packing.choose_pack_strategy_for_rows`); region
            needs >= 1.
        check_tables: validate both whole page tables (negative or repeated ids). A caller that
            validated them once per request (the sender, at ``send``/``expect``) passes False:
            the tables are then trusted (no sort, no ownership check per chunk) and only their
            lengths are checked against the pages the chunk uses.

    Returns:
        The :class:`RankChunk`; no rows gives strategy ``"empty"`` with one empty window.

    Raises:
        ValueError: bad mode, limits, ranges or page tables (named).
    """
    return _plan(chunk, start, stop, src, dst, src_page_table, dst_page_table, mode, max_batch_indices,
                 max_region_rows, bool(check_tables))


def _plan(chunk, start, stop, src, dst, src_page_table, dst_page_table, mode, max_batch_indices,
          max_region_rows, check: bool, names=("src_page_table", "dst_page_table")) -> RankChunk:
    if mode not in PLAN_MODES:
        raise ValueError(f"mode must be one of {PLAN_MODES}, got {mode=}")
    chunk = check_int("chunk", chunk, minimum=0)
    step = _positive_or_none("max_batch_indices", max_batch_indices)
    region = _positive_or_none("max_region_rows", max_region_rows, minimum=0)
    src_rows, dst_rows = _chunk_rows(start, stop, src, dst, src_page_table, dst_page_table, check, names)
    n, strategy, fallback = src_rows.size, mode, False
    if n == 0:
        strategy = "empty"
    elif mode == "region" and region is not None:
        if region < 1:
            raise ValueError(f"max_region_rows={region} must be >= 1 for the region path (a receive "
                             f"region that holds no row)")
        step = region if step is None else min(step, region)
    elif mode == "packed" and region is not None:
        if choose_pack_strategy_for_rows(n, region) == "per_row":
            strategy, fallback = "direct", True
        else:
            step = region if step is None else min(step, region)
    for a in (src_rows, dst_rows):
        a.setflags(write=False)
    return RankChunk(chunk, int(start), int(stop), dst.dcp_rank, src_rows, dst_rows, strategy,
                     _windows(n, step), fallback)


# A request's whole schedule and its totals live beside this module (re-exported here: one name
# for callers); they build on the functions above.
from dcp_jax.transfer.schedule_totals import ScheduleCounts, TransferSchedule  # noqa: E402
