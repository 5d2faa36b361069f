"""One (chunk, destination rank) unit of a sender's schedule: its rows, strategy and windows
(`RankChunk`, planned by `plan_rank_chunk`), and the one engine-call rule (`batch_engine_calls`).

Rows come from `dcp_jax.transfer.schedule` (ownership and page tables: ``chunk_rows``), runs and
descriptors from :mod:`dcp_jax.plan`, pack strategies from :mod:`dcp_jax.packing`.
`dcp_jax.transfer.schedule` re-exports every public name here.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import numpy as np

from dcp_jax._validate import check_int
from dcp_jax.packing import choose_pack_strategy_for_rows, pack_bytes
from dcp_jax.plan import build_descriptors, group_runs, packed_src_bases
from dcp_jax.transfer.protocol import MAX_PULL_ROWS
from dcp_jax.transfer.schedule import SideLayout, _chunk_rows

__all__ = ["PLAN_MODES", "Strategy", "RankChunk", "plan_rank_chunk", "batch_engine_calls"]

Strategy = Literal["empty", "direct", "packed", "region", "fused"]
#: Modes `plan_rank_chunk` plans (the connector's transfer paths; ``"auto"`` is resolved per peer
#: by `dcp_jax.transfer._region.choose_path` before planning).
PLAN_MODES = ("direct", "packed", "region", "fused")


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
        max_batch_indices: rows per batch (window), None = no limit (a direct window holds at
            most `protocol.MAX_PULL_ROWS` rows either way: a pull names them in one frame).
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
    if strategy == "direct":  # a pull names a direct window's rows in one frame
        step = MAX_PULL_ROWS if step is None else min(step, MAX_PULL_ROWS)
    for a in (src_rows, dst_rows):
        a.setflags(write=False)
    return RankChunk(chunk, int(start), int(stop), dst.dcp_rank, src_rows, dst_rows, strategy,
                     _windows(n, step), fallback)
