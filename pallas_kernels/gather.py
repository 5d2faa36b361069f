"""Strided row gather into a pack buffer (DCP spec section 6), as a Pallas kernel.

Before sending to a decode rank, the prefill side gathers that rank's source rows of every
layer entry into a contiguous, registered pack region, layer-major:

    entry l occupies words [offset + off_l, offset + off_l + n * width[l]),
    off_l = sum_{k<l} n * width[k]

where a *word* is the element type the kernel moves (uint32, uint16 or uint8: the widest one
that divides every row length, see `word_dtype`). Row `j < n` of entry `l` is
`src[l][indices[j]]`; no other word of the pack is touched.

Forms:

- stacked: `src` is one array `[L, R, W]` (every layer entry the same width);
- list: `src` is a sequence of `[R_l, W_l]` arrays, one per layer entry (what a serving engine
  registers); widths may differ between entries.

Backends:

- ``"triton"``: `pallas_call` with the Triton lowering (explicit `pltriton.CompilerParams`).
  Every load and store has a power-of-2 element count (a 288-word row is 256 + 32).
- ``"mosaic"``: `plgpu.kernel` (Mosaic GPU), per-row bulk copies through shared memory
  (see `pallas_kernels.mosaic_gather`).
- ``"interpret"``: the Triton kernel body under `interpret=True` (CPU, CI).
- ``"auto"``: interpret on CPU; on a GPU, Triton while the JAX version still ships the Triton
  lowering (< 0.12), Mosaic GPU afterwards.

The pack is aliased to the output (`input_output_aliases`) and donated, so the call writes in
place: into the CuPy memory when the pack was imported from CuPy by DLPack.

What compiles: one kernel per (shapes and dtype of `src`, `indices` and `pack`, `config`,
`backend`, `offset_align`, and whether `num_rows`/`offset` come as ints or as arrays). The row
count and the region offset are traced int32 values: pass `indices` padded to
`bucket_rows(n)` (any values) and the true count as `num_rows`, rows `>= num_rows` are
masked; a new `offset` (words, `0 <= offset <= MAX_PACK_WORDS = 2**32 - 1`) never
recompiles. `compile_count()` says how many row-copy kernels this process has traced.

Addresses into the pack are uint32 word indices (`pallas_kernels.row_copy`): packs of 2**31
words and more are written exactly, up to `addressable_words(P, itemsize)` (2**32 - 1 words of
a pack larger than 4 GiB); the row count is clamped so no store goes past it.

Module map: knobs and geometry in `pallas_kernels.config`, the shared row-copy core (sides,
address arithmetic, trace counter) in `pallas_kernels.row_copy`, argument checks in
`pallas_kernels._args`, the scatter side (unpack, copy) in `pallas_kernels.scatter`.

`gather_rows_reference` (plain `jnp.take`) is the oracle the tests compare against. The host
contract (`pack_rows`, `PackSource`) lives in `pallas_kernels.pack`; its names are re-exported
here.
"""


from __future__ import annotations

import functools
import os  # noqa: F401  (`gather.os` stays patchable: the host pool in `pack` reads os.getpid)

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels._args import (
    i32_scalar as _i32_scalar,  # noqa: F401  (kept importable from here)
    is_int as _is_int,
    layer_shapes as _layer_shapes,  # noqa: F401
    offset_arg,
    rows_arg as _rows_arg,
    static_validate as _static_validate,
)
from pallas_kernels.config import (
    BACKENDS,
    DEFAULT_BLOCK_ROWS,  # noqa: F401
    MAX_BLOCK_ROWS,  # noqa: F401
    MAX_PACK_WORDS,
    MAX_WORD_OFFSET,
    SCHEDULES,  # noqa: F401
    WORD_DTYPES,  # noqa: F401
    GatherConfig,
    _pow2_factor,
    addressable_words,
    bucket_rows,
    pow2_chunks,
    select_backend,
    word_dtype,
)
from pallas_kernels.row_copy import (
    U32,
    IndexedRows,
    RegionRows,
    compile_count,
    copy_block,
    count_kernel_trace as _count_kernel_trace,
    offset_units_to_words,
    patch_cache_modifiers as _patch_cache_modifiers,
    preload_lowering as _preload_lowering,
    region_base,
    region_rows,
)

# Static arguments of the jitted entry point, written once.
_STATIC_ARGNAMES = ("config", "backend", "offset_align")

# --------------------------------------------------------------------------- kernel body


def _gather_kernel(
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


# --------------------------------------------------------------------------- entry point


def gather_rows(
    src,
    indices: jax.Array,
    pack: jax.Array,
    num_rows: jax.Array | int | None = None,
    *,
    offset: jax.Array | int = 0,
    config: GatherConfig = GatherConfig(),
    backend: str = "auto",
    offset_align: int = 1,
) -> jax.Array:
    """Gather rows of every layer entry into the flat pack, layer-major, in place.

    For entry l (width W_l words) and j < n: pack[offset + off_l + j*W_l : ... + W_l] =
    src[l][indices[j]], off_l = sum_{k<l} n*W_k. Words outside these ranges keep their value.
    Jitted: `num_rows` and `offset` are traced int32 scalars, so neither recompiles.

    Args:
        src: u32/u16/u8[L, R, W] (stacked) or a list of u*[R_l, W_l] arrays (one per layer
            entry; widths may differ). Rows are words of the dtype, not bytes.
        indices: int[m] source rows (m >= n; rows past n are ignored, any value). Indices are
            clamped to [0, R-1] so the kernel never reads out of bounds; `pack_rows` checks
            them and raises instead.
        pack: 1-D array of the src dtype, donated; the result aliases its memory.
        num_rows: n, rows to gather (int or int32 scalar array, traced; default m). n is
            clamped so the layer-major region never extends past the end of `pack`, nor past
            `addressable_words(len(pack), itemsize)` (word 2**32 - 1 of a pack over 4 GiB).
        offset: word offset of this region inside `pack` (int or integer scalar array,
            traced). An int must be in [0, 2**32 - 1] (`MAX_PACK_WORDS`; mosaic: 2**31 - 1)
            and a multiple of `offset_align`; a traced one (int32) is not checked, but a
            negative one, or one off `offset_align`, writes nothing.
        config: `GatherConfig` tuning knobs (static). The dataclass defaults are the plain
            32-row kernel; `GatherConfig.default()` is the tuned one (`pack_rows` uses it).
        backend: "auto", "triton", "mosaic" or "interpret" (static; see module docstring).
            "mosaic" also needs the offset to be a multiple of 16 bytes.
        offset_align: power of 2 in [1, 16] (static, words) that `offset` is a multiple of.
            The kernel takes the offset in these units, so Triton can prove the region's
            alignment and keep 16-byte stores (4 words of uint32 are enough). With 1, the
            61-layer list pack of 1152-B rows ran at 58 % of the speed on an H200.
            `pack_rows` picks it from the offset (see `pallas_kernels.pack`).

    Returns:
        The pack (same shape and dtype), written in place when the input was donated.

    Raises:
        ValueError: wrong ndim, widths, `offset` (negative, past `MAX_PACK_WORDS`, off
            `offset_align` or, for mosaic, off 16 bytes), `offset_align`, or a GPU backend
            without a GPU.
        TypeError: mixed or unsupported dtypes, or a non-integer `offset`/`num_rows` array.
    """
    backend = select_backend(backend)
    _preload_lowering(backend)
    if (isinstance(offset_align, bool) or not isinstance(offset_align, (int, np.integer))
            or not 1 <= offset_align <= 16 or offset_align & (offset_align - 1)):
        raise ValueError(f"{offset_align=} must be a power of 2 in [1, 16] (words)")
    shape = getattr(indices, "shape", ())
    m = int(shape[0]) if len(shape) else 0
    n = _rows_arg(num_rows, m)
    units, ok = offset_arg(offset, int(offset_align), backend, np.dtype(pack.dtype).itemsize)
    # Concrete values travel as one i32[3] (one host-to-device copy per call, as many as a
    # bare row count); device or traced ones as a triple, stacked in the jitted function.
    if isinstance(n, np.integer) and isinstance(units, np.integer):
        meta = np.array((n, units, ok), np.int32)
    else:
        meta = (n, units, ok)
    return _gather_rows_jit(src, indices, pack, meta, config=config, backend=backend,
                            offset_align=int(offset_align))


@functools.partial(jax.jit, static_argnames=_STATIC_ARGNAMES, donate_argnames=("pack",))
def _gather_rows_jit(src, indices, pack, meta, *, config, backend, offset_align):
    """`gather_rows` after its argument checks. meta: i32[3] or a triple of i32[] (traced):
    rows to gather, offset in units of offset_align words (uint32 bits), ok (0: write nothing)."""
    stacked, shapes = _static_validate(src, indices, pack)
    widths = tuple(w for _, w in shapes)
    m = int(indices.shape[0])
    if m == 0:
        return pack
    idx = indices if indices.dtype == jnp.int32 else indices.astype(jnp.int32)
    if isinstance(meta, tuple):
        meta = jnp.stack(meta)
    if backend == "mosaic":
        from pallas_kernels import mosaic_gather

        # The clamps of the Triton kernel, in XLA (the Mosaic kernel takes n as it is); Mosaic
        # offsets are int32 (`offset_arg` kept them below 2**31 words).
        num_rows, offset = meta[0], meta[1] * offset_align
        room = jnp.maximum(min(int(pack.shape[0]), MAX_WORD_OFFSET) - offset, 0) // sum(widths)
        n = jnp.where(meta[2] != 0, jnp.clip(num_rows, 0, jnp.minimum(room, m)), 0)
        min_rows = min(r for r, _ in shapes)
        return mosaic_gather.gather_rows_mosaic(src, jnp.clip(idx, 0, min_rows - 1), pack, n,
                                                offset=offset, widths=widths, config=config)
    return _gather_triton(src, idx, pack, meta, shapes=tuple(shapes), stacked=stacked,
                          config=config, interpret=backend == "interpret",
                          offset_align=offset_align)


gather_rows._cache_size = _gather_rows_jit._cache_size  # compiled variants (tests, tools)


def _gather_triton(src, idx, pack, meta, *, shapes, stacked, config, interpret, offset_align,
                   windowed=False):
    """Build and call the Triton-form `pallas_call` (meta: i32[3], rows, offset units, ok;
    windowed: i32[4 * row blocks], see `pallas_kernels.windows`)."""
    from jax.experimental.pallas import triton as pltriton

    _count_kernel_trace()
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
        _gather_kernel, widths=widths, stacked=stacked, schedule=config.schedule,
        block_rows=br, max_rows=m, pack_words=addressable_words(P, np.dtype(pack.dtype).itemsize), offset_align=offset_align,
        num_src_rows=min(r for r, _ in shapes), align=align, evict=config.eviction_policy,
        layers_per_step=config.layers_per_step, layers_per_program=config.layers_per_program,
        interleave=config.interleave, load_evict=config.load_eviction_policy,
        mask_loads=config.mask_loads, layers_fastest=config.layers_fastest,
        load_cache=config.load_cache_modifier, windowed=windowed)
    if config.load_cache_modifier is not None:
        _patch_cache_modifiers()
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


# --------------------------------------------------------------------------- reference


def gather_rows_reference(src, indices, pack, num_rows=None, *, offset: int = 0) -> jax.Array:
    """`gather_rows` in plain `jnp.take` (the oracle; same arguments and result).

    Args:
        src: [L, R, W] or a list of [R_l, W_l] arrays (one integer dtype).
        indices: int[m]; the first `num_rows` are used.
        pack: 1-D array of the src dtype (not modified; a new array is returned).
        num_rows: n (Python int, default m).
        offset: word offset of the region (a concrete int, unlike `gather_rows`).

    Returns:
        A copy of `pack` with the layer-major region written.

    Raises:
        ValueError: as `gather_rows` (shapes, a negative or too large `offset`).
        TypeError: as `gather_rows` (dtypes).
    """
    stacked, shapes = _static_validate(src, indices, pack)
    if not _is_int(offset):
        raise ValueError(f"{offset=} must be a concrete non-negative int (words)")
    offset_arg(offset, 1, "interpret", 1)  # the checks only
    offset = int(offset)
    n = int(indices.shape[0]) if num_rows is None else int(num_rows)
    layers = [src[l] for l in range(len(shapes))] if stacked else list(src)
    idx = jnp.asarray(indices)[:n]
    pieces = [jnp.take(jnp.asarray(a), idx, axis=0).reshape(-1) for a in layers]
    region = jnp.concatenate(pieces) if pieces else jnp.zeros((0,), pack.dtype)
    return jnp.asarray(pack).at[offset:offset + region.shape[0]].set(region)



# --------------------------------------------------------------------------- host contract

# `pack_rows` and its helpers live in `pallas_kernels.pack`; `from pallas_kernels.gather import
# pack_rows` (and the private names tests use) still works, resolved lazily (pack imports this).
_PACK_NAMES = frozenset({
    "PackSource", "pack_rows", "clear_import_cache", "HOST_MAX_THREADS", "HOST_MAX_THREADS_ARG",
    "HOST_THREADS_MIN_BYTES", "_HOST_POOL", "_host_pool", "_CHECKED_LAYERS", "_IMPORTED_LAYERS",
    "_MAX_CACHED_LAYERS", "_is_cupy"})


def __getattr__(name: str):
    if name in _PACK_NAMES:
        from pallas_kernels import pack

        return getattr(pack, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "MAX_PACK_WORDS",
    "MAX_WORD_OFFSET",
    "GatherConfig",
    "PackSource",
    "addressable_words",
    "bucket_rows",
    "clear_import_cache",
    "compile_count",
    "gather_rows",
    "gather_rows_reference",
    "pack_rows",
    "pow2_chunks",
    "select_backend",
    "word_dtype",
]
