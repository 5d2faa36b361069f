"""Decode-side page tables of one request and the placement of prefill rows into them.

Rank r of a DCP-N group stores its tokens densely (local index ``j = local_index(t)`` at row
``page_table[r][j // P] * P + j % P``, spec section 3) in pages of its own, drawn at random from
its pool by a seeded allocator so that page ids are not the identity. `place_rows` is the
in-process placement (what a correct transfer must produce), used where no connector runs.
"""
from __future__ import annotations

import numpy as np

from dcp_jax import layout

__all__ = ["RequestPages", "request_pages", "place_rows"]


class RequestPages:
    """Page tables of one request on every decode rank.

    Attributes:
      tables: i32[N, max_pages]: row r is rank r's page table, covering every token the request
        will hold (prompt and generated ones).
      num_pages: pages of each rank's pool (``max_pages`` plus spares that stay unused).
      page_size, dcp_size, interleave_size: the layout.
    """

    def __init__(self, tables: np.ndarray, num_pages: int, page_size: int, dcp_size: int, interleave_size: int):
        self.tables, self.num_pages = tables, num_pages
        self.page_size, self.dcp_size, self.interleave_size = page_size, dcp_size, interleave_size

    @property
    def max_pages(self) -> int:
        return int(self.tables.shape[1])

    def rank_table(self, r: int, num_tokens: int) -> np.ndarray:
        """Rank r's pages holding its rows of tokens ``[0, num_tokens)`` (what `expect` gets)."""
        rows = int(layout.local_len_np(num_tokens, self.dcp_size, r, self.interleave_size))
        return self.tables[r, : -(-rows // self.page_size)].copy()


def request_pages(total_tokens: int, *, dcp_size: int, page_size: int, interleave_size: int = 1,
                  spare_pages: int = 2, seed: int = 0) -> RequestPages:
    """Draws every rank's pages for a request of ``total_tokens`` tokens.

    Raises:
      ValueError: ``total_tokens`` or ``page_size`` not positive, bad layout ints.
    """
    n, i, _ = layout.check_layout_args(dcp_size, interleave_size)
    for name, v in (("total_tokens", total_tokens), ("page_size", page_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int")
    most = max(int(layout.local_len_np(total_tokens, n, r, i)) for r in range(n))
    max_pages = max(1, -(-most // page_size))
    num_pages = max_pages + spare_pages
    rng = np.random.default_rng(seed)
    tables = np.stack([rng.permutation(num_pages)[:max_pages] for _ in range(n)]).astype(np.int32)
    return RequestPages(tables, num_pages, page_size, n, i)


def place_rows(rows: np.ndarray, num_tokens: int, pages: RequestPages, fill=0.0) -> np.ndarray:
    """Per-rank paged caches holding tokens ``[0, num_tokens)`` of ``rows [S, ...]`` (S >= num_tokens).

    Returns:
      ``[N, num_pages, P, ...]`` in rows' dtype; every other row holds ``fill``.
    """
    n, p = pages.dcp_size, pages.page_size
    cache = np.full((n, pages.num_pages, p) + rows.shape[1:], fill, dtype=rows.dtype)
    t = np.arange(num_tokens)
    own = layout.owner_np(t, n, pages.interleave_size)
    j = layout.local_index_np(t, n, pages.interleave_size)
    cache[own, pages.tables[own, j // p], j % p] = rows[:num_tokens]
    return cache
