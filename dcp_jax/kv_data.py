"""Checkable KV bytes, allocator-like page tables and checksums for the main job.

Every row of the synthetic KV cache is a deterministic function of ``(seed, layer, token position)``,
so a decode rank can recompute what each received row must hold and verify every byte. The pattern
is built from 64-bit words: one SplitMix64 hash per row (``h(seed, layer, t)``), XOR-ed with a
per-(layer, word) constant, so rows differ in every word and a row landing at the wrong place, a
swapped word or a single flipped bit is detected. SplitMix64 is Steele, Lea and Flood's finaliser
("Fast splittable pseudorandom number generators", OOPSLA 2014); any good 64-bit mixer would do.

Destination buffers start filled with :data:`SENTINEL_BYTE`; rows a rank does not own and padding
rows of its last page must still hold it after a transfer.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import numpy as np

__all__ = [
    "SENTINEL_BYTE",
    "row_hashes",
    "row_pattern",
    "fill_rows",
    "allocate_pages",
    "PREFILL_SIDE",
    "DECODE_SIDE",
    "pool_pages_for",
    "draw_page_table",
    "page_rows",
    "rows_checksum",
    "verify_rows",
    "VerifyResult",
]

SENTINEL_BYTE = 0xA5

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic), in place on a copy."""
    z = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def row_hashes(tokens: np.ndarray, layer: int, seed: int) -> np.ndarray:
    """One 64-bit hash per token position for one layer entry.

    Args:
        tokens: int64 [n] token positions (absolute, prefix included).
        layer: Layer entry index (>= 0).
        seed: Job seed (any int; reduced mod 2**64).

    Returns:
        uint64 [n].
    """
    t = np.asarray(tokens, dtype=np.int64).astype(np.uint64)
    key = _splitmix64(np.array([(seed & 0xFFFFFFFFFFFFFFFF) ^ (layer << 40)], dtype=np.uint64))[0]
    return _splitmix64(t ^ key)


def row_pattern(tokens: np.ndarray, layer: int, item_len: int, seed: int) -> np.ndarray:
    """The bytes every row ``(layer, t)`` of the synthetic KV cache holds.

    Args:
        tokens: int64 [n] token positions.
        layer: Layer entry index (>= 0).
        item_len: Bytes per row of this layer entry (>= 1).
        seed: Job seed.

    Returns:
        uint8 [n, item_len], C-contiguous.

    Raises:
        ValueError: ``item_len`` < 1 or ``layer`` < 0.
    """
    if item_len < 1:
        raise ValueError(f"{item_len=} must be >= 1 byte")
    if layer < 0:
        raise ValueError(f"{layer=} must be >= 0")
    words = -(-item_len // 8)
    h = row_hashes(tokens, layer, seed)
    col = _splitmix64(np.arange(words, dtype=np.uint64) ^ np.uint64((layer + 1) * 0x100000001B3))
    out = h[:, None] ^ col[None, :]
    b = out.view(np.uint8).reshape(len(h), words * 8)
    if words * 8 != item_len:
        b = np.ascontiguousarray(b[:, :item_len])
    return b


def page_rows(pages: np.ndarray, local: np.ndarray, page_size: int) -> np.ndarray:
    """Physical row of local index ``j`` in a paged buffer: ``pages[j // P] * P + j % P``.

    Args:
        pages: int64 [num_pages] page table.
        local: int64 [n] dense local indices (``0 <= j < len(pages) * P``).
        page_size: Tokens per page (P).

    Returns:
        int64 [n] row indices.
    """
    pages = np.asarray(pages, dtype=np.int64)
    local = np.asarray(local, dtype=np.int64)
    return pages[local // page_size] * page_size + local % page_size


def fill_rows(layer_rows: np.ndarray, rows: np.ndarray, tokens: np.ndarray, layer: int, seed: int) -> None:
    """Write the pattern of ``tokens`` into ``layer_rows[rows]`` (in place).

    Args:
        layer_rows: uint8 [num_rows, item_len] view of one layer entry's buffer.
        rows: int64 [n] destination row indices.
        tokens: int64 [n] token positions whose pattern goes there.
        layer: Layer entry index.
        seed: Job seed.

    Raises:
        ValueError: ``rows`` and ``tokens`` differ in length, or ``layer_rows`` is not 2-D uint8.
    """
    if layer_rows.ndim != 2 or layer_rows.dtype != np.uint8:
        raise ValueError(f"layer_rows must be 2-D uint8, got {layer_rows.shape=} {layer_rows.dtype=}")
    if len(rows) != len(tokens):
        raise ValueError(f"len(rows)={len(rows)} != len(tokens)={len(tokens)}")
    layer_rows[np.asarray(rows, dtype=np.int64)] = row_pattern(tokens, layer, layer_rows.shape[1], seed)


def allocate_pages(num_pages: int, pool_pages: int, rng: np.random.Generator) -> np.ndarray:
    """Page ids as a real allocator hands them out: popped from a shuffled free list of a pool.

    Args:
        num_pages: Pages the request needs.
        pool_pages: Pages in the pool (>= num_pages).
        rng: Seeded generator (the job derives one per side and rank from ``--seed``).

    Returns:
        int64 [num_pages] distinct page ids in ``[0, pool_pages)``, in allocation order.

    Raises:
        ValueError: negative ``num_pages`` or a pool too small.
    """
    if num_pages < 0:
        raise ValueError(f"{num_pages=} must be >= 0")
    if pool_pages < num_pages:
        raise ValueError(f"{pool_pages=} must be >= {num_pages=}")
    free_list = rng.permutation(pool_pages).astype(np.int64)
    return free_list[:num_pages].copy()


PREFILL_SIDE = 1
"""Allocator key of the prefill side (see :func:`draw_page_table`)."""
DECODE_SIDE = 2
"""Allocator key of the decode side (see :func:`draw_page_table`)."""


def pool_pages_for(num_pages: int, pool_slack: float) -> int:
    """Pages of a pool serving ``num_pages``: ``max(num_pages + 1, ceil(num_pages * pool_slack) + 1)``.

    The extra page keeps ids scattered even when ``pool_slack`` is 1.

    Raises:
        ValueError: ``num_pages < 0`` or ``pool_slack < 1``.
    """
    if num_pages < 0:
        raise ValueError(f"{num_pages=} must be >= 0")
    if not pool_slack >= 1.0:
        raise ValueError(f"{pool_slack=} must be >= 1.0")
    return max(num_pages + 1, int(math.ceil(num_pages * pool_slack)) + 1)


def draw_page_table(num_rows: int, page_size: int, pool_pages: int, seed: int, side: int, rank: int,
                    *seq: int) -> np.ndarray:
    """THE page-table drawing of the main job and of the cost report (``dcp-jax plan``).

    ``ceil(num_rows / P)`` pages popped from a shuffled free list of a ``pool_pages`` pool
    (:func:`allocate_pages`), with a generator seeded by ``[seed mod 2**32, side, rank, *seq]``.
    Both commands call this, so for one configuration and seed they plan on the same tables and
    print the same counts.

    Args:
        num_rows: rows (tokens) the rank holds, >= 0.
        page_size: P, tokens per page, >= 1.
        pool_pages: pages in the rank's pool (>= the pages needed).
        seed: the job's ``--seed``.
        side: :data:`PREFILL_SIDE` or :data:`DECODE_SIDE`.
        rank: the rank on that side.
        *seq: the decode side's request sequence number (the prefill side passes none).

    Returns:
        int64 [ceil(num_rows / page_size)] distinct page ids in ``[0, pool_pages)``.

    Raises:
        ValueError: negative ``num_rows``, ``page_size < 1`` or a pool too small.
    """
    if page_size < 1:
        raise ValueError(f"{page_size=} must be >= 1")
    if num_rows < 0:
        raise ValueError(f"{num_rows=} must be >= 0")
    rng = np.random.default_rng([seed & 0xFFFFFFFF, side, rank, *seq])
    return allocate_pages(-(-num_rows // page_size), pool_pages, rng)


def rows_checksum(layer_rows: np.ndarray, rows: np.ndarray) -> int:
    """CRC-32 of the given rows of one layer entry, in row order (the ``--verify`` checksum).

    Args:
        layer_rows: uint8 [num_rows, item_len].
        rows: int64 [n] row indices (contiguous ``slice`` objects are accepted too).

    Returns:
        Unsigned 32-bit CRC (``zlib.crc32``) of the gathered bytes.
    """
    data = layer_rows[rows]
    return zlib.crc32(np.ascontiguousarray(data).data) & 0xFFFFFFFF


class VerifyResult(dict):
    """Outcome of :func:`verify_rows`: ``ok``, ``bad_rows``, ``bad_sentinel_rows``, ``first_bad``."""


def verify_rows(
    layers: Sequence[np.ndarray],
    rows: np.ndarray,
    tokens: np.ndarray,
    seed: int,
) -> VerifyResult:
    """Check a decode rank's buffers byte for byte: owned rows hold their pattern, the rest the sentinel.

    Args:
        layers: One uint8 [num_rows, item_len_l] view per layer entry (the whole registered pool).
        rows: int64 [n] rows this rank must have received (same for every layer entry).
        tokens: int64 [n] token position each of those rows must hold.
        seed: Job seed.

    Returns:
        ``VerifyResult`` with ``ok`` (bool), ``bad_rows`` (received rows that differ, summed over
        layers), ``bad_sentinel_rows`` (rows outside ``rows`` whose sentinel changed) and
        ``first_bad`` (``(layer, row)`` of the first difference, or None).
    """
    rows = np.asarray(rows, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    bad_rows = 0
    bad_sent = 0
    first_bad = None
    for layer, view in enumerate(layers):
        mask = np.ones(view.shape[0], dtype=bool)
        mask[rows] = False
        if len(rows):
            got = view[rows]
            want = row_pattern(tokens, layer, view.shape[1], seed)
            row_ok = (got == want).all(axis=1)
            nb = int(len(rows) - np.count_nonzero(row_ok))
            if nb and first_bad is None:
                first_bad = (layer, int(rows[np.argmin(row_ok)]))
            bad_rows += nb
        other = view[mask]
        sent_ok = (other == SENTINEL_BYTE).all(axis=1)
        ns = int(len(sent_ok) - np.count_nonzero(sent_ok))
        if ns and first_bad is None:
            first_bad = (layer, int(np.flatnonzero(mask)[np.argmin(sent_ok)]))
        bad_sent += ns
    return VerifyResult(ok=bad_rows == 0 and bad_sent == 0, bad_rows=bad_rows,
                        bad_sentinel_rows=bad_sent, first_bad=first_bad)
