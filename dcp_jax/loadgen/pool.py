"""A paged KV pool of one side of a load run: the caller's cache, a free list, sentinel checks.

The load generator plays the serving engine: it owns ``num_layers`` numpy arrays
``[num_pages, page_size, item_len]`` (registered by the connector, never copied) and hands each
request pages drawn at random from a free list. The invariant that makes stray writes visible:

* every page on the free list holds only `SENTINEL_BYTE` (pages start so, and a page goes back
  to the list only after it was refilled with it);
* `allocate` checks the pages it hands out still hold it (a write into a free page, by any
  request, is caught there), `check_all_free` checks the whole pool at the end;
* a request's own pages are checked when it finishes: its rows must hold exactly its pattern
  (`dcp_jax.kv_data.row_pattern` with the request's own seed, so another request's rows never
  match) and the rows past its last one the sentinel.

Violations are counted in pages (one page with any wrong byte in any layer counts once).
"""
from __future__ import annotations

import functools
import time

import numpy as np

from dcp_jax.kv_data import SENTINEL_BYTE, row_pattern

__all__ = ["PagePool", "owned_tokens", "local_rows_of"]


def _timed(fn):
    """Adds the call's wall time to ``self.seconds`` (the load generator's own cost)."""
    @functools.wraps(fn)
    def wrapper(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(self, *a, **kw)
        finally:
            self.seconds += time.perf_counter() - t0
    return wrapper


def owned_tokens(num_tokens: int, dcp_size: int, rank: int, interleave: int) -> np.ndarray:
    """Token positions of ``[0, num_tokens)`` rank ``rank`` owns, in token order (their local
    indices are 0, 1, ...): ``owner(t) = (t // I) % N`` (spec section 2), computed here token by
    token, independently of the library."""
    t = np.arange(num_tokens, dtype=np.int64)
    return t[(t // interleave) % dcp_size == rank]


def local_rows_of(table: np.ndarray, n: int, page_size: int) -> np.ndarray:
    """Physical rows of local indices ``0..n-1`` under ``table`` (spec section 3)."""
    j = np.arange(n, dtype=np.int64)
    return np.asarray(table, np.int64)[j // page_size] * page_size + j % page_size


class PagePool:
    """``layers``: the side's KV (uint8 numpy), all pages sentinel; ``rng``: draws page tables."""

    def __init__(self, item_lens, num_pages: int, page_size: int, rng: np.random.Generator):
        self.page_size, self.num_pages, self.rng = page_size, num_pages, rng
        self.layers = [np.full((num_pages, page_size, il), SENTINEL_BYTE, np.uint8) for il in item_lens]
        self._rows = [a.reshape(num_pages * page_size, il) for a, il in zip(self.layers, item_lens)]
        self.free = list(range(num_pages))
        self.sentinel_violations = 0
        self.bytes_verified = 0
        self.bad_rows = 0
        self.partial_rows_foreign = 0
        self.first_problem = ""
        self.seconds = 0.0

    # ---- allocation --------------------------------------------------------------------------
    @_timed
    def allocate(self, num_rows: int) -> np.ndarray:
        """Random pages for ``num_rows`` rows, popped from the free list; checks their sentinel.

        Raises:
            RuntimeError: the pool is exhausted (the run's sizing guarantees it is not).
        """
        k = -(-num_rows // self.page_size)
        if k > len(self.free):
            raise RuntimeError(f"page pool exhausted: {k} pages wanted, {len(self.free)} free")
        if k == 0:
            return np.zeros(0, np.int64)
        pos = self.rng.choice(len(self.free), size=k, replace=False)
        table = np.array([self.free[p] for p in pos], np.int64)
        for p in sorted(pos.tolist(), reverse=True):  # swap-remove
            self.free[p] = self.free[-1]
            self.free.pop()
        self._check_sentinel(table, "a free page handed out")
        return table

    @_timed
    def give_back(self, table: np.ndarray) -> None:
        """Refills the pages with the sentinel and puts them back on the free list."""
        for a in self.layers:
            a[table] = SENTINEL_BYTE
        self.free.extend(int(p) for p in table)

    # ---- checks --------------------------------------------------------------------------------
    def _note(self, msg: str) -> None:
        if not self.first_problem:
            self.first_problem = msg

    def _check_sentinel(self, pages: np.ndarray, what: str) -> int:
        if len(pages) == 0:
            return 0
        bad = np.zeros(len(pages), bool)
        for a in self.layers:
            bad |= ~(a[pages] == SENTINEL_BYTE).all(axis=(1, 2))
        n = int(bad.sum())
        if n:
            self.sentinel_violations += n
            self._note(f"{what}: page {int(pages[np.argmax(bad)])} lost its sentinel")
        return n

    @_timed
    def check_free(self) -> int:
        """End of run: every page on the free list (all of them once every request finished)
        must hold the sentinel; returns the violations found."""
        return self._check_sentinel(np.array(sorted(self.free), np.int64), "end of run, a free page")

    def _tail_sentinel(self, table: np.ndarray, n: int) -> int:
        """Rows past the ``n`` used ones in the request's last page must hold the sentinel."""
        if len(table) == 0 or n % self.page_size == 0:
            return 0
        last, used = int(table[-1]), n % self.page_size
        ok = all((a[last, used:] == SENTINEL_BYTE).all() for a in self.layers)
        if not ok:
            self.sentinel_violations += 1
            self._note(f"page {last}: rows past the request's last row lost the sentinel")
        return 0 if ok else 1

    @_timed
    def fill(self, table: np.ndarray, tokens: np.ndarray, seed: int) -> list[np.ndarray]:
        """Writes the pattern of ``tokens`` at local rows ``0..len(tokens)-1`` of ``table``;
        returns it (one array per layer) for a later `verify`."""
        rows = local_rows_of(table, len(tokens), self.page_size)
        want = [row_pattern(tokens, layer, view.shape[1], seed) for layer, view in enumerate(self._rows)]
        for view, w in zip(self._rows, want):
            view[rows] = w
        return want

    @_timed
    def verify(self, table: np.ndarray, tokens: np.ndarray, seed: int, *, count: bool = True,
               want: list[np.ndarray] | None = None) -> tuple[int, int]:
        """A finished request: its rows hold exactly its pattern (``want``, as `fill` returned
        it, or computed here), its last page's tail the sentinel. Returns ``(bad_rows,
        sentinel_violations)`` (also added to the totals); the bytes compared and matched go to
        ``bytes_verified`` when ``count``."""
        rows = local_rows_of(table, len(tokens), self.page_size)
        bad = 0
        for layer, view in enumerate(self._rows):
            if len(rows) == 0:
                break
            w = want[layer] if want is not None else row_pattern(tokens, layer, view.shape[1], seed)
            ok = (view[rows] == w).all(axis=1)
            nbad = int(len(rows) - ok.sum())
            if nbad:
                self._note(f"layer {layer}: token {int(tokens[np.argmin(ok)])} holds the wrong bytes")
            bad += nbad
            if count:
                self.bytes_verified += int(ok.sum()) * view.shape[1]
        self.bad_rows += bad
        return bad, self._tail_sentinel(table, len(tokens))

    @_timed
    def check_partial(self, table: np.ndarray, tokens: np.ndarray, seed: int) -> int:
        """An aborted/failed request, once nothing moves any more: every byte of its rows holds
        its own pattern's byte or the sentinel (whatever landed before the abort is its own, a
        cancelled write may leave a row half written); anything else is a foreign write.
        Returns the pages holding such a row (counted as sentinel violations)."""
        rows = local_rows_of(table, len(tokens), self.page_size)
        foreign = 0
        if len(rows):
            bad = np.zeros(len(rows), bool)
            for layer, view in enumerate(self._rows):  # byte by byte: a torn row is not foreign
                got = view[rows]
                bad |= ((got != row_pattern(tokens, layer, view.shape[1], seed)) & (got != SENTINEL_BYTE)).any(axis=1)
            nrows = int(bad.sum())
            if nrows:
                self.partial_rows_foreign += nrows
                foreign = len(np.unique(rows[bad] // self.page_size))
                self.sentinel_violations += foreign
                self._note(f"an aborted request's pages hold {nrows} rows of neither it nor the sentinel")
        return foreign + self._tail_sentinel(table, len(tokens))

    def counters(self) -> dict:
        return dict(sentinel_violations=self.sentinel_violations, bytes_verified=self.bytes_verified,
                    bad_rows=self.bad_rows, partial_rows_foreign=self.partial_rows_foreign,
                    free_pages=len(self.free), pool_pages=self.num_pages, first_problem=self.first_problem,
                    seconds=self.seconds)
