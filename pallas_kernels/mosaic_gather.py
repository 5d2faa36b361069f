"""Mosaic GPU form of the pack gather (`plgpu.kernel`, JAX >= 0.11).

Hopper has no TMA gather (the `tile::gather4` form is Blackwell-only), so each program copies
its `block_rows` source rows one by one into shared memory with plain bulk copies
(`cp.async.bulk`, `oob_mode=PROMISE_IN_BOUNDS`: the indices are clamped in range by the
caller), waits on one barrier, then stores each row to the flat pack with bulk copies of at
most 256 elements (the TMA box limit), under `pl.when(row < n)` so ragged tails write nothing.

Constraints (checked, `ValueError` otherwise): every row is a multiple of 128 bytes (a bulk
copy moves a multiple of the warpgroup size: 1152 B rows qualify, 576 B FP8 rows do not), the
offset and every layer entry's region start are 16-byte aligned (`num_rows` and `offset` are
traced values, so the region start of entry l is offset + n * sum_{k<l} W_k: pass widths whose
bytes are multiples of 16; a concrete offset is checked, a traced one is the caller's promise);
`block_rows * max(W) * itemsize` fits in shared memory.

Called through `pallas_kernels.gather.gather_rows(..., backend="mosaic")`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# H200: 227 KiB of shared memory per block; keep headroom for the barrier and indices.
_SMEM_LIMIT_BYTES = 200 * 1024
_TMA_MAX_ELEMS = 256
_COPY_QUANTUM_BYTES = 128  # a bulk copy moves a multiple of the warpgroup size (128 B)
_META_WORDS = _COPY_QUANTUM_BYTES // 4


def _store_chunks(width: int, itemsize: int) -> tuple[tuple[int, int], ...]:
    """Pieces of <= 256 elements, each a multiple of 16 bytes, covering a row."""
    step = _TMA_MAX_ELEMS
    chunks, off = [], 0
    while off < width:
        size = min(step, width - off)
        chunks.append((off, size))
        off += size
    for _, size in chunks:
        if (size * itemsize) % 16:
            raise ValueError(f"row piece of {size * itemsize} bytes is not a multiple of 16")
    return tuple(chunks)


def _mosaic_kernel(meta_gmem, idx_gmem, *refs, widths, stacked, block_rows):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_layers = len(widths)
    n_src = 1 if stacked else num_layers
    srcs = refs[:n_src]
    out_gmem = refs[n_src]  # the pack, a mutable ref written in place
    buf, idx_smem, meta_smem, bar_one, bar_rows = refs[n_src + 1:]
    i = jax.lax.axis_index("rb")
    layer = jax.lax.axis_index("layer")
    plgpu.copy_gmem_to_smem(idx_gmem.at[pl.ds(i * block_rows, block_rows)], idx_smem, bar_one)
    plgpu.barrier_wait(bar_one)
    plgpu.copy_gmem_to_smem(meta_gmem, meta_smem, bar_one)
    plgpu.barrier_wait(bar_one)
    n = meta_smem[0]
    offset = meta_smem[1]
    prefix = np.concatenate([[0], np.cumsum(widths)]).astype(int)

    def one_layer(src, width, base, stacked_layer):
        # Loops, not Python unrolling: an unrolled block of 61 layers x 32 rows lowered to 6 MB
        # of MLIR and did not finish compiling on the H200 in 95 s.
        def load(j, carry):
            r = idx_smem[j]
            row = src.at[stacked_layer, pl.ds(r, 1)] if stacked_layer is not None else \
                src.at[pl.ds(r, 1)]
            plgpu.copy_gmem_to_smem(row, buf.at[pl.ds(j, 1), pl.ds(0, width)], bar_rows,
                                    oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
            return carry

        jax.lax.fori_loop(0, block_rows, load, None)
        plgpu.barrier_wait(bar_rows)  # one arrival per row copy
        plgpu.commit_smem()

        def store(j, carry):
            row = i * block_rows + j

            @pl.when(row < n)  # ragged tail: rows past n store nothing
            def _():
                start = base + row * width
                for off, size in _store_chunks(width, buf.dtype.itemsize):
                    plgpu.copy_smem_to_gmem(buf.at[j, pl.ds(off, size)],
                                            out_gmem.at[pl.ds(start + off, size)])
            return carry

        jax.lax.fori_loop(0, block_rows, store, None)
        plgpu.wait_smem_to_gmem(0)

    if stacked:
        one_layer(srcs[0], widths[0], offset + n * widths[0] * layer, layer)
    else:
        for l in range(num_layers):
            @pl.when(layer == l)
            def _(l=l):
                one_layer(srcs[l], widths[l], offset + n * int(prefix[l]), None)


def gather_rows_mosaic(src, idx, pack, n, *, offset, widths, config, interpret=False):
    """Mosaic GPU kernel behind `gather_rows(backend="mosaic")` (same contract).

    Args:
        src: [L, R, W] or a list of [R_l, W_l] arrays of the pack dtype.
        idx: i32[m], already clamped in range.
        pack: 1-D words, aliased to the output.
        n: i32 scalar, rows to gather (already clamped to the pack).
        offset: word offset, an int or an i32 scalar (traced: one kernel for every offset).
        widths: words per row of each entry (static).
        config: `GatherConfig` (block_rows used).
        interpret: run under Mosaic GPU interpret mode (`plgpu.InterpretGPUParams`, CPU tests).

    Raises:
        ValueError: rows or a concrete offset not 16-byte multiples, or the block exceeds
            shared memory.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.row_copy import count_kernel_trace as _count_kernel_trace

    stacked = not isinstance(src, (list, tuple))
    itemsize = np.dtype(pack.dtype).itemsize
    for w in widths:
        if (w * itemsize) % _COPY_QUANTUM_BYTES:
            raise ValueError(f"mosaic copies whole rows of a multiple of 128 bytes; a row of "
                             f"{w * itemsize} B is not (use backend='triton')")
        _store_chunks(w, itemsize)
    if isinstance(offset, (int, np.integer)) and (offset * itemsize) % 16:
        raise ValueError(f"offset of {offset * itemsize} bytes must be a multiple of 16 for mosaic")
    br = config.block_rows
    if br * 4 % _COPY_QUANTUM_BYTES:
        raise ValueError(f"mosaic needs block_rows a multiple of 32 (index copy), got {br=}")
    smem = br * max(widths) * itemsize
    if smem > _SMEM_LIMIT_BYTES:
        raise ValueError(f"block of {smem} bytes exceeds shared memory: lower {br=}")
    m = int(idx.shape[0])
    m_pad = -(-m // br) * br
    if m_pad != m:
        idx = jnp.pad(idx, (0, m_pad - m))
    L = len(widths)
    # Bulk copies move multiples of 128 bytes: pad the (n, offset) pair to 32 words.
    meta = jnp.zeros((_META_WORDS,), jnp.int32).at[0].set(n).at[1].set(offset)
    srcs = [src] if stacked else list(src)
    _count_kernel_trace(f"gather_mosaic idx={tuple(idx.shape)} widths={tuple(widths)} stacked={stacked}")
    kernel = plgpu.kernel(
        functools.partial(_mosaic_kernel, widths=tuple(widths), stacked=stacked, block_rows=br),
        out_type=(),
        grid=(m_pad // br, L),
        grid_names=("rb", "layer"),
        scratch_types=[
            plgpu.SMEM((br, max(widths)), pack.dtype),
            plgpu.SMEM((br,), jnp.int32),
            plgpu.SMEM((_META_WORDS,), jnp.int32),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=br),
        ],
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane),
        kernel_name=f"kv_gather_mosaic_{br=}_{L=}",
        **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}),
    )
    # In-place on 0.11+: the pack becomes a mutable ref that the kernel writes.
    ref = jax.new_ref(pack)
    kernel(meta, idx, *srcs, ref)
    return ref[...]
