"""The row-wise `triton.jit` gather that the pack benchmarks measure ours against (GPU only).

One program copies `BLOCK_R` rows of one layer: row `j` of layer `l` goes from
`src[l, idx[j]]` to `out[l * n + j]`, a row of `W` words loaded and stored as two power-of-2
pieces (`C0 + C1 = W`). `EVICT` is Triton's eviction hint for the gathered loads ("" or
"evict_last"), so the peer can be given the same hint as ours.
"""

from __future__ import annotations

import functools


@functools.cache
def row_gather_kernel():
    """The jitted kernel; launch as `kernel[(cdiv(n, BLOCK_R), L)](src, idx, out, n, R, W=...,
    C0=..., C1=..., BLOCK_R=..., EVICT=..., num_warps=...)` on int32 torch tensors."""
    import triton
    import triton.language as tl

    @triton.jit
    def _row_gather(src_ptr, idx_ptr, out_ptr, n, R, W: tl.constexpr, C0: tl.constexpr,
                    C1: tl.constexpr, BLOCK_R: tl.constexpr, EVICT: tl.constexpr = ""):
        pid_r = tl.program_id(0)
        layer = tl.program_id(1).to(tl.int64)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        valid = rows < n
        idx = tl.load(idx_ptr + rows, mask=valid, other=0)
        src = src_ptr + layer * R * W
        dst = out_ptr + layer * n * W
        c0 = tl.arange(0, C0)
        v = tl.load(src + idx[:, None] * W + c0[None, :], mask=valid[:, None],
                    eviction_policy=EVICT)
        tl.store(dst + rows[:, None] * W + c0[None, :], v, mask=valid[:, None])
        if C1 > 0:
            c1 = C0 + tl.arange(0, C1)
            v1 = tl.load(src + idx[:, None] * W + c1[None, :], mask=valid[:, None],
                         eviction_policy=EVICT)
            tl.store(dst + rows[:, None] * W + c1[None, :], v1, mask=valid[:, None])

    return _row_gather
