"""Triton form of the pack gather: the kernel body and the `pallas_call` around it.

`gather_kernel` copies one block of `block_rows` rows of every layer entry into the pack,
layer-major (the contract of `pallas_kernels.gather.gather_rows`); `gather_call` builds the
grid, the BlockSpecs and the `pallas_call` (Triton lowering, or `interpret=True` on the CPU)
and calls it. The jitted entry point `gather_rows` (`pallas_kernels.gather`) and the windowed
one `gather_windows` (`pallas_kernels.windows`, ``windowed=True``) call `gather_call` after
their argument checks; the Mosaic GPU form is `pallas_kernels.mosaic_gather`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.config import _pow2_factor, addressable_words
from pallas_kernels.row_copy import (U32, IndexedRows, RegionRows, copy_block, count_kernel_trace,
                                     offset_units_to_words, patch_cache_modifiers, region_base, region_rows)

__all__ = ["gather_call", "gather_kernel"]


def gather_kernel(
    meta_ref,  # i32[3]: rows, region offset in offset_align words (uint32 bits), ok; windowed:
    #            i32[4] of this row block: offset units, its window's rows, first row, ok
    idx_ref,  # i32[block_rows]
    *refs,  # src refs (one stacked or L list entries), pack_in [P] (aliased), out [P]
    widths: tuple[int, ...],
    stacked: bool,
    schedule: str,
    block_rows: int,
    max_rows: int,
    pack_words: int,
    num_src_rows: int,
    offset_align: int,
    align: tuple[int, ...],
    evict: str | None,
    layers_per_step: int = 1,
    layers_per_program: int = 1,
    interleave: bool = False,
    load_evict: str | None = None,
    mask_loads: bool = False,
    layers_fastest: bool = False,
    load_cache: str | None = None,
    windowed: bool = False,
):
    """One program: its row block of every layer entry it copies (on the grid schedule, of its
    layer group) into the pack region, layer-major; rows past the clamped count are masked."""
    src_refs, out_ref = refs[:-2], refs[-1]
    num_layers = len(widths)
    i = pl.program_id(1 if layers_fastest and schedule == "grid" else 0)
    # Windowed (`gather_windows`): every row block lies in one window, whose offset and row
    # count come with the block, rows counted from the window's first; else one region.
    k_rows, k_off, k_ok = (1, 0, 3) if windowed else (0, 1, 2)
    # The offset comes in units of `offset_align` words: a product with that constant lets
    # Triton's alignment analysis prove it (wide stores); a hint on a sum with a loaded
    # scalar can be lost, which cost 7 % on the 61-layer list form (H200).
    offset = offset_units_to_words(meta_ref[k_off], offset_align)
    # Clamped here, not in XLA around the call: the jitted function is the kernel alone.
    # n never takes the region past the addressable words of the pack; ok = 0 writes nothing.
    n = region_rows(meta_ref[k_rows], meta_ref[k_ok], offset, pack_words=pack_words,
                    total_width=sum(widths), max_rows=max_rows)
    first = meta_ref[2] if windowed else i * block_rows
    rows = first + jnp.arange(block_rows, dtype=jnp.int32)
    valid = rows.astype(U32) < n
    # Masked rows read row 0 and store nothing; indices are clamped so no read is out of bounds.
    idx = jnp.where(valid, jnp.clip(idx_ref[...], 0, num_src_rows - 1), 0)
    prefix = [0]
    for w in widths:
        prefix.append(prefix[-1] + w)

    def base_of(l):
        # n * prefix[l] is divisible by prefix[l]'s power-of-2 factor, the offset by
        # `offset_align`: the hint states what the products already show.
        return pl.multiple_of(region_base(offset, n, prefix[l]), align[l])

    lm = valid if mask_loads else None

    def job(src_ref, layer, width, base, lmask, smask):
        return (IndexedRows(src_ref, idx, layer=layer, mask=lmask, evict=load_evict,
                            cache=load_cache),
                RegionRows(out_ref, base, rows, width, mask=smask, evict=evict), width)

    copy = functools.partial(copy_block, interleave=interleave)
    G = layers_per_program
    if schedule == "grid":
        g = pl.program_id(0 if layers_fastest else 1)
        if stacked and G == 1:
            # The src block is already layer `g` ([R, W], L squeezed).
            base = pl.multiple_of(offset + n * U32(widths[0]) * g.astype(U32),
                                  min(align[0], _pow2_factor(widths[0])))
            copy([job(src_refs[0], None, widths[0], base, lm, valid)])
        elif stacked:
            # One program copies layers g*G .. g*G+G-1 of the whole [L, R, W] ref; past the
            # last layer, loads and stores are masked off (no memory traffic).
            W = widths[0]
            jobs = []
            for k in range(G):
                lk = g * G + k
                ok = lk < num_layers
                lc = jnp.minimum(lk, num_layers - 1)
                base = pl.multiple_of(offset + n * U32(W) * lc.astype(U32),
                                      min(align[0], _pow2_factor(W)))
                lmask = lm if num_layers % G == 0 else jnp.logical_and(valid, ok)
                jobs.append(job(src_refs[0], lc, W, base, lmask, jnp.logical_and(valid, ok)))
            copy(jobs)
        else:
            for gi in range(-(-num_layers // G)):
                @pl.when(g == gi)
                def _(gi=gi):
                    copy([job(src_refs[l], None, widths[l], base_of(l), lm, valid)
                          for l in range(gi * G, min(num_layers, gi * G + G))])
    else:
        # Issue the loads of `layers_per_step` entries before their stores, so that many row
        # gathers are in flight per program (stores would otherwise order every next load).
        for s0 in range(0, num_layers, layers_per_step):
            copy([job(src_refs[0] if stacked else src_refs[l], l if stacked else None,
                      widths[l], base_of(l), lm, valid)
                  for l in range(s0, min(num_layers, s0 + layers_per_step))])


def gather_call(src, idx, pack, meta, *, shapes, stacked, config, interpret, offset_align,
                windowed=False):
    """Build and call the Triton-form `pallas_call` (meta: i32[3], rows, offset units, ok;
    windowed: i32[4 * row blocks], see `pallas_kernels.windows`)."""
    from jax.experimental.pallas import triton as pltriton

    count_kernel_trace(f"gather{'_windows' if windowed else ''} idx={tuple(idx.shape)} shapes={tuple(shapes)} "
                       f"stacked={stacked} offset_align_words={offset_align}")
    widths = tuple(w for _, w in shapes)
    br = config.block_rows
    m = int(idx.shape[0])
    m_pad = -(-m // br) * br
    if m_pad != m:
        idx = jnp.pad(idx, (0, m_pad - m))
    num_blocks = m_pad // br
    prefix = np.concatenate([[0], np.cumsum(widths)])
    align = tuple(min(offset_align, _pow2_factor(int(p))) for p in prefix[:-1])
    P = int(pack.shape[0])
    L = len(widths)
    srcs = [src] if stacked else list(src)
    if config.schedule == "grid":
        num_groups = -(-L // config.layers_per_program)
        if config.layers_fastest:
            grid = (num_groups, num_blocks)

            def spec(block, f):  # index maps take (row block, layer group) either way
                return pl.BlockSpec(block, lambda l, i: f(i, l))
        else:
            grid = (num_blocks, num_groups)

            def spec(block, f):
                return pl.BlockSpec(block, f)
        meta_spec = spec((4,), lambda i, l: (i,)) if windowed else spec((3,), lambda i, l: (0,))
        idx_spec = spec((br,), lambda i, l: (i,))
        if stacked and config.layers_per_program > 1:
            src_specs = [spec(tuple(src.shape), lambda i, l: (0, 0, 0))]
        elif stacked:
            R, W = shapes[0]
            src_specs = [spec((None, R, W), lambda i, l: (l, 0, 0))]
        else:
            src_specs = [spec(s, lambda i, l: (0, 0)) for s in shapes]
        pack_spec = spec((P,), lambda i, l: (0,))
    else:
        grid = (num_blocks,)
        meta_spec = pl.BlockSpec((4,), lambda i: (i,)) if windowed else \
            pl.BlockSpec((3,), lambda i: (0,))
        idx_spec = pl.BlockSpec((br,), lambda i: (i,))
        if stacked:
            src_specs = [pl.BlockSpec(tuple(src.shape), lambda i: (0, 0, 0))]
        else:
            src_specs = [pl.BlockSpec(s, lambda i: (0, 0)) for s in shapes]
        pack_spec = pl.BlockSpec((P,), lambda i: (0,))
    kernel = functools.partial(
        gather_kernel, widths=widths, stacked=stacked, schedule=config.schedule,
        block_rows=br, max_rows=m, pack_words=addressable_words(P, np.dtype(pack.dtype).itemsize), offset_align=offset_align,
        num_src_rows=min(r for r, _ in shapes), align=align, evict=config.eviction_policy,
        layers_per_step=config.layers_per_step, layers_per_program=config.layers_per_program,
        interleave=config.interleave, load_evict=config.load_eviction_policy,
        mask_loads=config.mask_loads, layers_fastest=config.layers_fastest,
        load_cache=config.load_cache_modifier, windowed=windowed)
    if config.load_cache_modifier is not None:
        patch_cache_modifiers()
    n_in = 2 + len(srcs)
    call = pl.pallas_call(
        kernel,
        grid=grid,
        # The aliased pack input gets the output's BlockSpec (an ANY-space alias crashes
        # interpret mode on 0.11+ with ragged blocks; on Triton it is never read).
        in_specs=[meta_spec, idx_spec, *src_specs, pack_spec],
        out_specs=pack_spec,
        out_shape=jax.ShapeDtypeStruct(pack.shape, pack.dtype),
        input_output_aliases={n_in: 0},
        compiler_params=None if interpret else pltriton.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=f"kv_gather{'_windows' if windowed else ''}_{config.schedule}_{br=}_{L=}"
             f"_g{config.layers_per_program}",
    )
    return call(meta, idx, *srcs, pack)
