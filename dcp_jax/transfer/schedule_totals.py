"""A request's whole schedule and its counts: `TransferSchedule` and `ScheduleCounts`.

`TransferSchedule.build` plans every (chunk, destination rank) unit of one sender with
:func:`dcp_jax.transfer.schedule.plan_rank_chunk`'s rules and adds up what they cost: rows,
bytes, descriptors, batches, notifications and engine calls (:func:`batch_engine_calls`). The
sender, the main job, the cost report (``dcp-jax plan``) and the benchmarks count through it.
Import both names from `dcp_jax.transfer.schedule`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from dcp_jax._validate import check_int
from dcp_jax.packing import pack_bytes
from dcp_jax.plan import rows_from_page_table
from dcp_jax.transfer.rank_chunk import RankChunk, _plan, _positive_or_none
from dcp_jax.transfer.schedule import _EMPTY, SideLayout, _range

__all__ = ["ScheduleCounts", "TransferSchedule"]


@dataclasses.dataclass(frozen=True)
class ScheduleCounts:
    """Counts of a set of units: rows (per layer entry), bytes, descriptors, batches (engine
    batches of descriptors), notifications (one per batch, one per empty unit), engine calls,
    packs (gathers), fallbacks (batches sent direct though packing was asked for) and empty units."""

    rows: int = 0
    bytes: int = 0
    descriptors: int = 0
    batches: int = 0
    notifications: int = 0
    engine_calls: int = 0
    packs: int = 0
    fallbacks: int = 0
    empty_units: int = 0

    def __add__(self, other: "ScheduleCounts") -> "ScheduleCounts":
        return ScheduleCounts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclasses.dataclass(frozen=True, eq=False)
class TransferSchedule:
    """One sender's units for a request, in send order (chunk-major, rank-minor), and their counts.

    Attributes:
        units: the :class:`RankChunk` of every (chunk, destination rank).
        num_layers: layer entries.
        item_lens: bytes per row of each entry.
        mode: one of ``schedule.PLAN_MODES`` (``"direct"``, ``"packed"``, ``"region"``, ``"fused"``).
        engine_window: None for NIXL's engine-call rule, W for Mooncake's (see
            :meth:`RankChunk.engine_calls`).
    """

    units: tuple[RankChunk, ...]
    num_layers: int
    item_lens: tuple[int, ...]
    mode: str
    engine_window: int | None = None

    @classmethod
    def build(cls, *, src_spec_layout: SideLayout, dst_layouts: Sequence[SideLayout], src_page_table,
              dst_page_tables: Sequence, chunks: Sequence[tuple[int, int]], num_layers: int,
              item_lens: Sequence[int], mode: str, max_batch_indices: int | None = None,
              max_region_rows: int | None = None, engine_window: int | None = None) -> "TransferSchedule":
        """Plans every (chunk, destination rank) unit of one sender.

        Args:
            src_spec_layout: the sender's layout.
            dst_layouts: one layout per destination rank (same dcp_size, distinct ranks).
            src_page_table: the sender's page table; dst_page_tables: one per destination rank.
            chunks: ``[(start, stop)]`` token ranges, ascending, not overlapping.
            num_layers, item_lens: layer entries and their bytes per row.
            mode, max_batch_indices, max_region_rows: as :func:`plan_rank_chunk`.
            engine_window: Mooncake's descriptors per submission, None for NIXL.

        Raises:
            TypeError, ValueError: mismatched lengths, overlapping chunks, bad values (named).
        """
        from dcp_jax.transfer.schedule import PLAN_MODES

        if mode not in PLAN_MODES:
            raise ValueError(f"mode must be one of {PLAN_MODES}, got {mode=}")
        _positive_or_none("max_batch_indices", max_batch_indices)
        _positive_or_none("max_region_rows", max_region_rows, minimum=0)
        num_layers = check_int("num_layers", num_layers, minimum=1)
        lens = tuple(check_int(f"item_lens[{k}]", v, minimum=1) for k, v in enumerate(item_lens))
        if len(lens) != num_layers:
            raise ValueError(f"item_lens has {len(lens)} entries, num_layers={num_layers}")
        engine_window = _positive_or_none("engine_window", engine_window)
        dst_layouts = list(dst_layouts)
        tables = list(dst_page_tables)
        if len(tables) != len(dst_layouts):
            raise ValueError(f"dst_page_tables needs one table per dst_layouts entry, got {len(tables)} "
                             f"for {len(dst_layouts)}")
        if len({(d.dcp_size, d.interleave_size) for d in dst_layouts}) > 1 or \
                len({d.dcp_rank for d in dst_layouts}) != len(dst_layouts):
            raise ValueError("dst_layouts must be distinct ranks of one group (one dcp_size and interleave_size)")
        prev = 0
        for k, (a, b) in enumerate(chunks):
            a, b = _range(a, b)
            if a < prev:
                raise ValueError(f"chunks must be ascending and disjoint, chunks[{k}]=({a}, {b}) starts before {prev}")
            prev = b
        # Every table is validated once here (ids >= 0, no page twice), not once per unit.
        src_table = np.asarray(src_page_table)
        rows_from_page_table(_EMPTY, src_table, src_spec_layout.page_size, name="src_page_table")
        for k, (d, t) in enumerate(zip(dst_layouts, tables)):
            tables[k] = np.asarray(t)
            rows_from_page_table(_EMPTY, tables[k], d.page_size, name=f"dst_page_tables[{k}]")
        units = tuple(
            _plan(c, a, b, src_spec_layout, d, src_table, t, mode, max_batch_indices, max_region_rows, False,
                  ("src_page_table", f"dst_page_tables[{k}]"))
            for c, (a, b) in enumerate(chunks) for k, (d, t) in enumerate(zip(dst_layouts, tables)))
        return cls(units, num_layers, lens, mode, engine_window)

    def _unit_counts(self, u: RankChunk) -> ScheduleCounts:
        b, n = u.num_batches, u.num_rows
        return ScheduleCounts(
            rows=n, bytes=pack_bytes(n, self.item_lens), descriptors=u.num_descriptors(self.num_layers), batches=b,
            notifications=b or 1, engine_calls=u.engine_calls(self.num_layers, self.engine_window),
            packs=b if u.strategy in ("packed", "region") else 0, fallbacks=b if u.fallback else 0,
            empty_units=int(u.strategy == "empty"))

    @functools.cached_property
    def per_rank(self) -> dict[int, ScheduleCounts]:
        """``{dst_rank: ScheduleCounts}`` over the chunks, ranks in first-send order."""
        out: dict[int, ScheduleCounts] = {}
        for u in self.units:
            out[u.dst_rank] = out.get(u.dst_rank, ScheduleCounts()) + self._unit_counts(u)
        return out

    @functools.cached_property
    def total(self) -> ScheduleCounts:
        """Counts over every unit."""
        return sum(self.per_rank.values(), ScheduleCounts())

    descriptors = property(lambda self: self.total.descriptors, doc="Descriptors over every unit.")
    bytes = property(lambda self: self.total.bytes, doc="Bytes over every unit.")
    batches = property(lambda self: self.total.batches, doc="Engine batches over every unit.")
    engine_calls = property(lambda self: self.total.engine_calls, doc="Engine calls over every unit.")

    def __repr__(self) -> str:
        t = self.total
        engine = "nixl" if self.engine_window is None else f"mooncake(window={self.engine_window})"
        chunks = len({u.chunk for u in self.units})
        return (f"TransferSchedule(mode={self.mode!r}, engine={engine}, units={len(self.units)} "
                f"({chunks} chunks x {len(self.per_rank)} ranks), rows={t.rows:,}, bytes={t.bytes:,}, "
                f"descriptors={t.descriptors:,}, batches={t.batches:,}, engine_calls={t.engine_calls:,}, "
                f"empty={t.empty_units})")
