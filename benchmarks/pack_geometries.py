"""The cases `benchmarks/pack.py` times: its geometries (DeepSeek-V3, Kimi-K2, an FP8-MLA
geometry) and the source-row patterns of each (`make_indices`).

Moved out of `benchmarks/pack.py`, which imports both from here.
"""

from __future__ import annotations

import numpy as np


def geometries(quick: bool):
    """(name, layers, item_len bytes, rows n, src rows R, index pattern)."""
    R = 32768 if quick else 262144
    n_full = 4096 if quick else 32768
    return [
        ("deepseek-v3/32768", 61, 1152, n_full, R, "stride8"),
        ("deepseek-v3/rank-4096", 61, 1152, n_full // 8, R, "rank-pages"),
        ("kimi-k2/32768", 61, 1152, n_full, R, "shuffled-pages"),
        ("deepseek-v3-fp8/32768", 61, 576, n_full, R, "stride8"),
    ]


def make_indices(pattern: str, n: int, R: int, seed: int = 0) -> np.ndarray:
    """Source rows: stride 8 (token round-robin, DCP 8), or rank 3's tokens of a request whose
    64-token pages were drawn from a shuffled free list (what a real allocator leaves)."""
    rng = np.random.default_rng(seed)
    if pattern == "stride8":
        return (np.arange(n, dtype=np.int64) * 8).astype(np.int32)
    page = 64
    tokens = n * 8 if pattern == "rank-pages" else n
    pages = rng.permutation(R // page)[: -(-tokens // page)]
    rows = (pages[:, None] * page + np.arange(page)[None, :]).reshape(-1)[:tokens]
    if pattern == "rank-pages":
        rows = rows[3::8]
    return rows.astype(np.int32)
