"""The scatter side of the row-copy kernels, as Pallas (Triton lowering; interpret on CPU).

Two kernels on the core of `pallas_kernels.row_copy`, one program per (row block, layer entry):

- `unpack_kernel(pack, indices, dst, n, offset=...)`: the inverse of `gather_rows`: row j of
  entry l's block of the layer-major region (words `[offset + off_l + j * W_l, ... + W_l)`,
  `off_l = n * sum_{k<l} W_k`) goes to row `indices[j]` of `dst[l]`;
- `copy_kernel(src, src_indices, dst, dst_indices, n)`: `dst[l][dst_indices[j]] =
  src[l][src_indices[j]]`, no pack in between (one kernel for all layer entries).

`dst` is a list of 2-D word arrays `[R_l, W_l]` (widths may differ), donated and aliased to the
outputs (`input_output_aliases`): imported from CuPy by DLPack, the kernel writes into the CuPy
memory, also memory another process exported by CUDA IPC. Layers that lie back to back in one
buffer can go as ONE flat word array instead (`_unpack_flat_jit`, `_copy_flat_jit`): one donated
argument and output, not one per layer. Rows `j >= n` are masked; indices are
clamped in range (the host contract `pallas_kernels.unpack` checks them and raises instead);
destination indices must be unique (a repeat leaves one of the candidates, unspecified which).
Region addresses are uint32 (`row_copy.region_address`): packs past 2**31 words are read exactly.

What compiles: one kernel per (shapes, dtypes, config, backend, offset_align); `n` and `offset`
are traced (pass indices padded to `bucket_rows(n)`), counted by `compile_count()`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels._args import is_int, layer_shapes, offset_arg, rows_arg
from pallas_kernels.config import (
    WORD_DTYPES,
    GatherConfig,
    _pow2_factor,
    addressable_words,
    select_backend,
)
from pallas_kernels.row_copy import (
    U32,
    IndexedRows,
    RegionRows,
    copy_block,
    count_kernel_trace,
    offset_units_to_words,
    patch_cache_modifiers,
    preload_lowering,
    region_base,
    region_rows,
)

_STATIC = ("config", "backend", "offset_align")


def _scatter_backend(backend: str) -> str:
    backend = select_backend(backend)
    if backend == "mosaic":
        raise ValueError("backend='mosaic' has no scatter form; use 'triton' (GPU) or 'interpret'")
    preload_lowering(backend)
    return backend


def _check_dst(dst, dtype, name="dst"):
    if not isinstance(dst, (list, tuple)) or not dst:
        raise ValueError(f"{name} must be a non-empty list of 2-D word arrays")
    stacked, shapes, dt = layer_shapes(list(dst))
    if dt not in WORD_DTYPES:
        raise TypeError(f"{name} dtype {dt} must be one of uint32/uint16/uint8")
    if dtype is not None and np.dtype(dtype) != dt:
        raise TypeError(f"{name} dtype {dt} must equal the source dtype {np.dtype(dtype)}")
    return shapes


def _check_idx(indices, name):
    if indices.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {indices.shape}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"{name} dtype {indices.dtype} must be an integer type")
    return int(indices.shape[0])


def unpack_kernel(pack, indices, dst, num_rows=None, *, offset=0,
                  config: GatherConfig = GatherConfig(), backend: str = "auto",
                  offset_align: int = 1) -> tuple:
    """Scatter a layer-major pack region into rows `indices` of every `dst` layer, in place.

    Args:
        pack: 1-D word array (uint32/uint16/uint8), read only.
        indices: int[m] destination rows (m >= n; padded with any value), unique.
        dst: list of [R_l, W_l] arrays of the pack's dtype, donated.
        num_rows: n (int or int32 scalar array, traced; default m), clamped so the region
            stays inside the addressable words of `pack`.
        offset: word offset of the region (int in [0, 2**32 - 1], multiple of `offset_align`,
            or a traced int32 scalar: a negative or misaligned one reads/writes nothing).
        config: tuning knobs (block_rows, num_warps, interleave, load/store hints).
        backend: "auto", "triton" or "interpret".
        offset_align: power of 2 in [1, 16] dividing `offset` (lets Triton prove alignment).

    Returns:
        The tuple of `dst` arrays, written (aliasing the donated inputs).

    Raises:
        ValueError / TypeError: bad shapes, dtypes, offsets, backends (as `gather_rows`).
    """
    backend = _scatter_backend(backend)
    if pack.ndim != 1:
        raise ValueError(f"pack must be 1-D, got shape {pack.shape}")
    shapes = _check_dst(dst, pack.dtype)
    m = _check_idx(indices, "indices")
    if (isinstance(offset_align, bool) or not is_int(offset_align)
            or not 1 <= offset_align <= 16 or offset_align & (offset_align - 1)):
        raise ValueError(f"{offset_align=} must be a power of 2 in [1, 16] (words)")
    n = rows_arg(num_rows, m)
    units, ok = offset_arg(offset, int(offset_align), backend, np.dtype(pack.dtype).itemsize)
    meta = np.array((n, units, ok), np.int32) if isinstance(n, np.integer) and \
        isinstance(units, np.integer) else (n, units, ok)
    del shapes
    return _unpack_jit(pack, indices, tuple(dst), meta, config=config, backend=backend,
                       offset_align=int(offset_align))


def copy_kernel(src, src_indices, dst, dst_indices, num_rows=None, *,
                config: GatherConfig = GatherConfig(), backend: str = "auto") -> tuple:
    """`dst[l][dst_indices[j]] = src[l][src_indices[j]]` for j < n, every layer entry l.

    Args:
        src: list of [R_l, W_l] word arrays, or one stacked [L, R, W] array (read only).
        src_indices: int[m] source rows (any order, repeats allowed).
        dst: list of [R'_l, W_l] arrays of the same dtype and widths, donated.
        dst_indices: int[m] destination rows, unique among the first n.
        num_rows: n (int or int32 scalar array, traced; default m).
        config, backend: as `unpack_kernel`.

    Returns:
        The tuple of `dst` arrays, written in place.

    Raises:
        ValueError: layer count or width mismatch, index lengths differ, bad shapes/backend.
        TypeError: mixed or unsupported dtypes, non-integer indices.
    """
    backend = _scatter_backend(backend)
    stacked = getattr(src, "ndim", 0) == 3
    if stacked:  # one [L, R, W] array: L sources of [R, W]
        src_shapes = [tuple(int(d) for d in src.shape[1:])] * int(src.shape[0])
    else:
        src_shapes = _check_dst(src, None, "src")
    dst_shapes = _check_dst(dst, src.dtype if stacked else src[0].dtype)
    if [w for _, w in src_shapes] != [w for _, w in dst_shapes]:
        raise ValueError(f"dst widths {[w for _, w in dst_shapes]} must equal the src widths "
                         f"{[w for _, w in src_shapes]}")
    m = _check_idx(src_indices, "src_indices")
    if _check_idx(dst_indices, "dst_indices") != m:
        raise ValueError("src_indices and dst_indices must have the same length")
    n = rows_arg(num_rows, m)
    meta = np.array((n, 0, 1), np.int32) if isinstance(n, np.integer) else \
        (n, jnp.int32(0), jnp.int32(1))
    return _copy_jit(src if stacked else tuple(src), src_indices, tuple(dst), dst_indices, meta,
                     config=config, backend=backend)


def _meta(meta):
    return jnp.stack(meta) if isinstance(meta, tuple) else meta


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("dst",))
def _unpack_jit(pack, indices, dst, meta, *, config, backend, offset_align):
    if int(indices.shape[0]) == 0:
        return dst
    return _scatter_call(_meta(meta), [pack], None, indices, dst, config=config,
                         interpret=backend == "interpret", offset_align=offset_align)


@functools.partial(jax.jit, static_argnames=_STATIC + ("layers",), donate_argnames=("dst",))
def _unpack_flat_jit(pack, indices, dst, meta, *, layers, config, backend, offset_align):
    """`_unpack_jit` into ONE flat word array holding every layer back to back (`layers`: the
    static (rows, width) of each, in order): one donated buffer and one output instead of L
    (each donated output cost ~2 us of host time on a CPU and more on a GPU)."""
    if int(indices.shape[0]) == 0:
        return dst
    return _scatter_call(_meta(meta), [pack], None, indices, dst, config=config,
                         interpret=backend == "interpret", offset_align=offset_align,
                         flat=layers)[0]


@functools.partial(jax.jit, static_argnames=("config", "backend"), donate_argnames=("dst",))
def _copy_jit(src, src_indices, dst, dst_indices, meta, *, config, backend):
    if int(dst_indices.shape[0]) == 0:
        return dst
    return _scatter_call(_meta(meta), _src_list(src), src_indices, dst_indices, dst, config=config,
                         interpret=backend == "interpret", offset_align=1)


def _src_list(src) -> list:
    """The copy kernel's sources: [stacked u-word[L, R, W]] or one [R_l, W_l] array per layer."""
    return [src] if getattr(src, "ndim", 0) == 3 else list(src)


@functools.partial(jax.jit, static_argnames=("layers", "config", "backend"),
                   donate_argnames=("dst",))
def _copy_flat_jit(src, src_indices, dst, dst_indices, meta, *, layers, config, backend):
    """`_copy_jit` into ONE flat word array holding every destination layer back to back
    (`layers`: the static (rows, width) of each, in order), as `_unpack_flat_jit`: the fused
    connector path's decode-rank cache is one IPC-mapped allocation. `src` may likewise be one
    stacked [L, R, W] array (`device.stacked_words`)."""
    if int(dst_indices.shape[0]) == 0:
        return dst
    return _scatter_call(_meta(meta), _src_list(src), src_indices, dst_indices, dst,
                         config=config, interpret=backend == "interpret", offset_align=1,
                         flat=layers)[0]


def _scatter_call(meta, srcs, src_idx, dst_idx, dst, *, config, interpret, offset_align,
                  flat=None):
    """Build and call the `pallas_call`: srcs = [pack] (unpack, src_idx None) or the src layers
    (one [R_l, W_l] array each, or one stacked [L, R, W] array); dst the layer arrays, or
    (`flat`: (rows, width) per layer) one flat word array of them all."""
    from jax.experimental.pallas import triton as pltriton

    count_kernel_trace(f"{'unpack' if src_idx is None else 'copy'} idx={tuple(dst_idx.shape)} "
                       f"src={[tuple(a.shape) for a in srcs][:2]}{'...' if len(srcs) > 2 else ''} "
                       f"dst={'flat ' + str(tuple(dst.shape)) if flat else len(dst)} "
                       f"offset_align_words={offset_align}")
    br = config.block_rows
    m = int(dst_idx.shape[0])
    m_pad = -(-m // br) * br
    idxs = [dst_idx] if src_idx is None else [src_idx, dst_idx]
    idxs = [jnp.pad(i.astype(jnp.int32), (0, m_pad - m)) for i in idxs]
    if flat is None:
        dst = list(dst)
        dst_shapes = [tuple(int(d) for d in a.shape) for a in dst]
        dst_specs = [pl.BlockSpec(s, lambda i, l: (0, 0)) for s in dst_shapes]
        bases = None
    else:
        dst, dst_shapes = [dst], [tuple(map(int, s)) for s in flat]
        dst_specs = [pl.BlockSpec((int(dst[0].shape[0]),), lambda i, l: (0,))]
        bases = tuple(int(b) for b in np.concatenate([[0], np.cumsum([r * w for r, w in
                                                                       dst_shapes])])[:-1])
    widths = tuple(w for _, w in dst_shapes)
    L = len(dst_shapes)
    grid = (m_pad // br, L)
    meta_spec = pl.BlockSpec((3,), lambda i, l: (0,))
    idx_specs = [pl.BlockSpec((br,), lambda i, l: (i,)) for _ in idxs]
    src_specs = [pl.BlockSpec(tuple(a.shape), lambda i, l, nd=a.ndim: (0,) * nd) for a in srcs]
    unpack = src_idx is None
    prefix = np.concatenate([[0], np.cumsum(widths)])
    kernel = functools.partial(
        _scatter_kernel, widths=widths, unpack=unpack, block_rows=br, max_rows=m,
        pack_words=addressable_words(int(srcs[0].shape[0]), np.dtype(srcs[0].dtype).itemsize)
        if unpack else 0,
        num_src_rows=0 if unpack else min(int(a.shape[-2]) for a in srcs),
        stacked_src=not unpack and srcs[0].ndim == 3,
        num_dst_rows=min(r for r, _ in dst_shapes), offset_align=offset_align,
        align=tuple(min(offset_align, _pow2_factor(int(p))) for p in prefix[:-1]),
        evict=config.eviction_policy, load_evict=config.load_eviction_policy,
        interleave=config.interleave, load_cache=config.load_cache_modifier,
        mask_loads=config.mask_loads, dst_bases=bases, interpret=bool(interpret))
    if config.load_cache_modifier is not None:
        patch_cache_modifiers()
    n_in = 1 + len(idxs) + len(srcs)
    n_out = len(dst)
    call = pl.pallas_call(
        kernel,
        grid=grid,
        # Aliased inputs get the outputs' BlockSpecs (an ANY-space alias crashes interpret mode).
        in_specs=[meta_spec, *idx_specs, *src_specs, *dst_specs],
        out_specs=dst_specs,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in dst],
        input_output_aliases={n_in + k: k for k in range(n_out)},
        compiler_params=None if interpret else pltriton.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=f"kv_{'unpack' if unpack else 'copy'}{'_flat' if flat else ''}_{br=}_{L=}",
    )
    return tuple(call(meta, *idxs, *srcs, *dst))


def _scatter_kernel(meta_ref, *refs, widths, unpack, block_rows, max_rows, pack_words,
                    num_src_rows, num_dst_rows, offset_align, align, evict, load_evict,
                    interleave, load_cache, mask_loads, dst_bases=None, interpret=False,
                    stacked_src=False):
    L = len(widths)
    n_idx = 1 if unpack else 2
    idx_refs = refs[:n_idx]
    srcs = refs[n_idx:n_idx + (1 if unpack or stacked_src else L)]
    outs = refs[-L:] if dst_bases is None else refs[-1:]
    i, g = pl.program_id(0), pl.program_id(1)
    rows = i * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    if unpack:
        offset = offset_units_to_words(meta_ref[1], offset_align)
        n = region_rows(meta_ref[0], meta_ref[2], offset, pack_words=pack_words,
                        total_width=sum(widths), max_rows=max_rows)
        valid = rows.astype(U32) < n
    else:
        n = jnp.minimum(jnp.maximum(meta_ref[0], 0), max_rows)
        valid = rows < n
    # Masked rows keep a clamped (in-range) index and store nothing. The interpreter emulates a
    # masked store by writing the old bytes back, so there a masked row must not share a live
    # row's index: it points one past the last row (out of range: the interpreter drops it).
    pad = num_dst_rows if interpret else 0
    didx = jnp.where(valid, jnp.clip(idx_refs[-1][...], 0, num_dst_rows - 1), pad)
    if not unpack:
        sidx = jnp.where(valid, jnp.clip(idx_refs[0][...], 0, num_src_rows - 1), 0)
    prefix = [0]
    for w in widths:
        prefix.append(prefix[-1] + w)
    for l in range(L):
        @pl.when(g == l)
        def _(l=l):
            if unpack:
                base = pl.multiple_of(region_base(offset, n, prefix[l]), align[l])
                src = RegionRows(srcs[0], base, rows, widths[l], mask=valid, evict=load_evict,
                                 cache=load_cache)
            else:
                src = IndexedRows(srcs[0] if stacked_src else srcs[l], sidx,
                                  layer=l if stacked_src else None,
                                  mask=valid if mask_loads else None, evict=load_evict,
                                  cache=load_cache)
            if dst_bases is None:
                dst = IndexedRows(outs[l], didx, mask=valid, evict=evict)
            else:  # layer l's rows at word dst_bases[l] of the flat buffer (uint32 addresses)
                dst = RegionRows(outs[0], U32(dst_bases[l]), didx, widths[l], mask=valid,
                                 evict=evict)
            copy_block([(src, dst, widths[l])], interleave=interleave)


__all__ = ["copy_kernel", "unpack_kernel"]
