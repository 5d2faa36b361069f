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

Module map: the Triton-form kernel body and its `pallas_call` in `pallas_kernels.triton_gather`
(the Mosaic GPU form in `pallas_kernels.mosaic_gather`), knobs and geometry in
`pallas_kernels.config`, the shared row-copy core (sides, address arithmetic, trace counter) in
`pallas_kernels.row_copy`, argument checks in `pallas_kernels._args`, the scatter side (unpack,
copy) in `pallas_kernels.scatter`.

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
    addressable_words,
    bucket_rows,
    pow2_chunks,
    select_backend,
    word_dtype,
)
from pallas_kernels.row_copy import (
    compile_count,
    compile_log,
    patch_cache_modifiers as _patch_cache_modifiers,  # noqa: F401  (kept importable from here)
    preload_lowering as _preload_lowering,
)
from pallas_kernels.triton_gather import gather_call

# Static arguments of the jitted entry point, written once.
_STATIC_ARGNAMES = ("config", "backend", "offset_align")

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
    if m == 0 or int(pack.shape[0]) == 0:  # nothing to read, or no room: a kernel over an empty
        return pack                         # buffer does not lower (interpret: a size-0 gather)
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
    return gather_call(src, idx, pack, meta, shapes=tuple(shapes), stacked=stacked,
                       config=config, interpret=backend == "interpret", offset_align=offset_align)


gather_rows._cache_size = _gather_rows_jit._cache_size  # compiled variants (tests, tools)


@functools.partial(jax.jit, static_argnames=_STATIC_ARGNAMES + ("m",), donate_argnames=("pack",))
def _gather_rows_slot_jit(src, slot, pack, *, m, config, backend, offset_align):
    """`_gather_rows_jit` with its indices and meta in one mapped slot (`mapped_ring`: one
    vector of m, then the 3 meta words), copied to device memory first, in this call."""
    from pallas_kernels.mapped_ring import split_slot, to_device

    (indices,), meta = split_slot(to_device(slot), m, 1, 3)
    return _gather_rows_jit(src, indices, pack, meta, config=config, backend=backend, offset_align=offset_align)


# --------------------------------------------------------------------------- reference


def gather_rows_reference(src, indices, pack, num_rows=None, *, offset: int = 0) -> jax.Array:
    """`gather_rows` in plain `jnp.take` (the oracle; same arguments and result, clamps included).

    Args:
        src: [L, R, W] or a list of [R_l, W_l] arrays (one integer dtype).
        indices: int[m]; the first n are used, each clamped to [0, min_l R_l - 1] as the
            kernel clamps them.
        pack: 1-D array of the src dtype (not modified; a new array is returned).
        num_rows: n (Python int, default m), clamped as the kernel clamps it: to [0, m] and to
            the rows the pack holds past `offset` (its `addressable_words`).
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
    m = int(indices.shape[0])
    n = m if num_rows is None else int(num_rows)
    layers = [src[l] for l in range(len(shapes))] if stacked else list(src)
    words = addressable_words(int(pack.shape[0]), np.dtype(pack.dtype).itemsize)
    room = max(words - offset, 0) // sum(w for _, w in shapes)
    n = max(0, min(n, m, room))  # the kernel's `region_rows`
    idx = jnp.clip(jnp.asarray(indices)[:n], 0, min(r for r, _ in shapes) - 1)
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
    "compile_log",
    "gather_rows",
    "gather_rows_reference",
    "pack_rows",
    "pow2_chunks",
    "select_backend",
    "word_dtype",
]
