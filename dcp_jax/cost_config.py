"""The configuration of a cost report and the page tables and pack regions it plans with.

:class:`CostConfig` is one transfer configuration (geometry, prompt, prefix, chunking, page size,
M, N, I); :func:`job_page_tables` draws the send range's page tables as the main job does,
:func:`page_tables` puts them in the connector's convention (spec section 10: local rows from
token 0), and :func:`region_rows` sizes a pack region as the job does (spec section 6). The
report itself is :mod:`dcp_jax.cost`, which re-exports every name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import numpy as np

from dcp_jax._validate import check_int as _int

from dcp_jax.kv_data import DECODE_SIDE, PREFILL_SIDE, draw_page_table, pool_pages_for
from dcp_jax.layout import check_layout_args, local_len_np
from dcp_jax.transfer.schedule import SideLayout, owned_tokens

__all__ = ["CostConfig", "MODES", "PATH_MODES", "job_page_tables", "page_tables", "region_rows"]

Mode = Literal["direct", "packed", "region", "fused"]
#: The cost report's default modes (``dcp-jax plan --mode both``).
MODES: tuple[Mode, ...] = ("direct", "packed")
#: Every path the report plans (``dcp-jax plan --path``): the connector's `PLAN_MODES`.
PATH_MODES: tuple[Mode, ...] = ("direct", "packed", "region", "fused")


@dataclasses.dataclass(frozen=True)
class CostConfig:
    """One transfer configuration of the cost report.

    Attributes:
        num_layers: layer entries (registered KV buffers).
        item_lens: bytes per row of each entry (``len == num_layers``).
        prompt_tokens: request length (tokens, prefix included).
        decode_prefix_len: tokens decode already holds (multiple of ``lcm(P*N, I*N)``); the send
            range is ``[decode_prefix_len, prompt_tokens)``.
        chunk_tokens: tokens per chunk of the send range (chunked prefill); None = one chunk.
        page_size: P, tokens per page of the decode side (and of the prefill side unless
            ``prefill_page_size``).
        prefill_dcp_size: M.
        prefill_interleave_size: I_p.
        dcp_size: N.
        interleave_size: I.
        max_batch_indices: rows per engine batch (None: one batch per unit or region-full).
        pack_max_tokens: tokens the pack buffer is sized for (``N * ceil(max/N)`` rows, spec
            section 6; one window may use all of them: :func:`region_rows`); None = the main job's default
            (:func:`region_rows`: the most rows one prefill rank sends to one decode rank, so
            nothing is sliced).
        seed: seed of the page allocators (the job's ``--seed``).
        pool_slack: each page pool is this many times the pages a rank needs (the job's
            ``pool_slack``).
        prefill_page_size: tokens per page of the prefill side (the job's
            ``--prefill-page-size``); None = ``page_size``. The connector moves rows between
            the two page sizes; the prefill tables are drawn with it.

    Raises:
        ValueError, TypeError: invalid values (named).
    """

    num_layers: int
    item_lens: tuple[int, ...]
    prompt_tokens: int
    decode_prefix_len: int = 0
    chunk_tokens: int | None = None
    page_size: int = 64
    prefill_dcp_size: int = 1
    prefill_interleave_size: int = 1
    dcp_size: int = 8
    interleave_size: int = 1
    max_batch_indices: int | None = None
    pack_max_tokens: int | None = None
    seed: int = 0
    pool_slack: float = 1.25
    prefill_page_size: int | None = None

    def __post_init__(self) -> None:
        _int("num_layers", self.num_layers, minimum=1)
        lens = tuple(int(x) for x in self.item_lens)
        if len(lens) != self.num_layers:
            raise ValueError(f"item_lens needs one entry per layer: len(item_lens)={len(lens)}, num_layers={self.num_layers}")
        if min(lens) < 1:
            raise ValueError(f"item_lens must be >= 1 byte, got min {min(lens)}")
        object.__setattr__(self, "item_lens", lens)
        _int("prompt_tokens", self.prompt_tokens, minimum=0)
        _int("decode_prefix_len", self.decode_prefix_len, minimum=0)
        if self.decode_prefix_len > self.prompt_tokens:
            raise ValueError(
                f"decode_prefix_len must be <= prompt_tokens, got {self.decode_prefix_len=}, {self.prompt_tokens=}"
            )
        if self.chunk_tokens is not None:
            _int("chunk_tokens", self.chunk_tokens, minimum=1)
        if self.max_batch_indices is not None:
            _int("max_batch_indices", self.max_batch_indices, minimum=1)
        if self.pack_max_tokens is not None:
            _int("pack_max_tokens", self.pack_max_tokens, minimum=0)
        _int("page_size", self.page_size, minimum=1)
        if self.prefill_page_size is not None:
            _int("prefill_page_size", self.prefill_page_size, minimum=1)
        _int("prefill_dcp_size", self.prefill_dcp_size, minimum=1)
        _int("prefill_interleave_size", self.prefill_interleave_size, minimum=1)
        check_layout_args(self.dcp_size, self.interleave_size)
        align = math.lcm(self.page_size * self.dcp_size, self.interleave_size * self.dcp_size)
        if self.decode_prefix_len % align:
            raise ValueError(f"decode_prefix_len={self.decode_prefix_len} must be a multiple of {align} "
                             f"(lcm(page_size*dcp_size, interleave_size*dcp_size))")
        _int("seed", self.seed, minimum=-(1 << 63))  # any int, as the job's --seed
        if isinstance(self.pool_slack, bool) or not isinstance(self.pool_slack, (int, float)) \
                or not self.pool_slack >= 1.0:
            raise ValueError(f"pool_slack={self.pool_slack!r} must be a number >= 1.0")

    @property
    def src_page_size(self) -> int:
        """Tokens per page of the prefill side: ``prefill_page_size``, else ``page_size``."""
        return self.page_size if self.prefill_page_size is None else self.prefill_page_size

    @property
    def send_tokens(self) -> int:
        """Tokens moved: ``prompt_tokens - decode_prefix_len``."""
        return self.prompt_tokens - self.decode_prefix_len

    def chunks(self) -> list[tuple[int, int]]:
        """``(chunk_start, num_tokens)`` of each chunk of the send range, in order."""
        step = self.chunk_tokens or max(self.send_tokens, 1)
        return [
            (a, min(step, self.prompt_tokens - a)) for a in range(self.decode_prefix_len, self.prompt_tokens, step)
        ]


    def layouts(self) -> tuple[list[SideLayout], list[SideLayout]]:
        """``(prefill, decode)`` :class:`SideLayout` of every rank (the prefill side's page size is
        :attr:`src_page_size`)."""
        return ([SideLayout(self.prefill_dcp_size, k, self.prefill_interleave_size, self.src_page_size)
                 for k in range(self.prefill_dcp_size)],
                [SideLayout(self.dcp_size, d, self.interleave_size, self.page_size) for d in range(self.dcp_size)])


def _rows(tokens: int, size: int, inter: int) -> list[int]:
    """Rows each rank of a group holds of tokens ``[0, tokens)``."""
    return local_len_np(tokens, size, np.arange(size), inter).tolist()


def job_page_tables(config: CostConfig) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The page tables the main job (``dcp-jax transfer``) draws, for the *send range* only.

    Every rank pops ``ceil(rows / page size)`` pages (a prefill rank's pages hold
    ``src_page_size`` tokens, a decode rank's ``page_size``) from its own seeded, shuffled free list
    (:func:`dcp_jax.kv_data.draw_page_table`) for its rows of ``[decode_prefix_len,
    prompt_tokens)``: a prefill rank from a pool of ``pool_pages_for(its pages, pool_slack)``
    pages, keyed ``(seed, PREFILL_SIDE, rank)``; a decode rank from a pool sized for the largest
    decode share, keyed ``(seed, DECODE_SIDE, rank, 0)`` (request 0). The tables do not depend on
    the geometry or the chunking. :func:`page_tables` turns them into the connector's convention.

    Args:
        config: the configuration (sizes, prefix, seed, ``pool_slack``).

    Returns:
        ``(src_tables, dst_tables)``: one i64[pages] table per prefill rank and per decode rank
        (empty tables when nothing is sent).
    """
    cfg, p, ps = config, config.page_size, config.src_page_size
    if cfg.send_tokens == 0:
        empty = np.zeros(0, np.int64)
        return [empty] * cfg.prefill_dcp_size, [empty] * cfg.dcp_size
    send_s = [a - b for a, b in zip(_rows(cfg.prompt_tokens, cfg.prefill_dcp_size, cfg.prefill_interleave_size),
                                     _rows(cfg.decode_prefix_len, cfg.prefill_dcp_size, cfg.prefill_interleave_size))]
    send_d = [a - b for a, b in zip(_rows(cfg.prompt_tokens, cfg.dcp_size, cfg.interleave_size),
                                     _rows(cfg.decode_prefix_len, cfg.dcp_size, cfg.interleave_size))]
    src = [draw_page_table(r, ps, pool_pages_for(-(-r // ps), cfg.pool_slack), cfg.seed, PREFILL_SIDE, k)
           for k, r in enumerate(send_s)]
    pool = pool_pages_for(-(-max(send_d) // p), cfg.pool_slack)
    return src, [draw_page_table(r, p, pool, cfg.seed, DECODE_SIDE, d, 0) for d, r in enumerate(send_d)]


def page_tables(config: CostConfig) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The default tables of :func:`cost_report`, in the connector's convention (section 10).

    Each table covers its rank's local rows from token 0: the prefix's rows sit on pages past
    the drawn pool (never read), then come the job's send-range pages (:func:`job_page_tables`),
    so the counts are the job's. Where a prefill rank's prefix rows do not fill whole pages of
    its page size (M > 1 with a prefix that is not a multiple of ``P * M``, or a prefill page
    size the prefix is not a multiple of), the job's layout has no section-10
    form: that rank's table is drawn for all its rows ``[0, prompt_tokens)`` instead (same seed
    and pool rule).

    Returns:
        ``(src_tables, dst_tables)``: ``prefill_dcp_size`` and ``dcp_size`` i64 page tables.
    """
    cfg = config
    src, dst = job_page_tables(cfg)
    # Prefix pages get ids past every drawn id: distinct from the send range's, never read.
    pool = 1 + max([int(t.max()) for t in (*src, *dst) if t.size] + [-1])
    out = []
    for tables, size, inter, side, p in (
            (src, cfg.prefill_dcp_size, cfg.prefill_interleave_size, PREFILL_SIDE, cfg.src_page_size),
            (dst, cfg.dcp_size, cfg.interleave_size, DECODE_SIDE, cfg.page_size)):
        prefix, total = _rows(cfg.decode_prefix_len, size, inter), _rows(cfg.prompt_tokens, size, inter)
        full = []
        for k, t in enumerate(tables):
            if prefix[k] % p == 0:
                full.append(np.concatenate([np.arange(pool, pool + prefix[k] // p), t]).astype(np.int64))
            else:
                full.append(draw_page_table(total[k], p, pool_pages_for(-(-total[k] // p), cfg.pool_slack),
                                            cfg.seed, side, k))
        out.append(full)
    return out[0], out[1]


def region_rows(config: CostConfig, prefill_rank: int) -> int:
    """Rows of one destination rank's pack region on prefill rank ``prefill_rank`` (the job's rule).

    The most rows the prefill rank sends to any one decode rank over the send range, and never
    fewer than ``ceil(its rows / N)`` (spec section 6), so the default pack never slices;
    ``pack_max_tokens`` overrides it with the rows of the whole buffer, ``N * ceil(pack_max_tokens
    / N)``: `KVSender` packs windows into one shared arena (`transfer.arena.PackArena`) rather
    than spec section 6's fixed region per rank, and a window may take all of it (smaller values
    force sliced packing, 0 the direct fallback).

    Raises:
        ValueError: ``prefill_rank`` out of range.
    """
    cfg, n = config, config.dcp_size
    srcs, dsts = cfg.layouts()
    if _int("prefill_rank", prefill_rank, minimum=0) >= len(srcs):
        raise ValueError(f"prefill_rank={prefill_rank} must be < prefill_dcp_size={len(srcs)}")
    if cfg.pack_max_tokens is not None:  # the connector's arena: one window may fill the whole buffer
        return n * -(-cfg.pack_max_tokens // n)
    a, b = cfg.decode_prefix_len, cfg.prompt_tokens
    shares = [owned_tokens(a, b, dst=d, src=srcs[prefill_rank]).size for d in dsts]
    return max(-(-sum(shares) // n), max(shares))
