"""The row-copy core every Triton-form kernel shares: one program copies `block_rows` rows of a
few layer entries, each from a *source side* to a *destination side*.

Sides:

- `IndexedRows`: rows of a layer buffer `[R, W]` (or layer `l` of a stacked `[L, R, W]`) picked
  by an index vector: the gather side of `pack_rows` (loads), the scatter side of `unpack_rows`
  (stores), both sides of `copy_rows`;
- `RegionRows`: rows `j` of one layer entry's block inside a flat, layer-major pack region, at
  word `base + j * width`: the store side of `pack_rows`, the load side of `unpack_rows`.

Every row is moved in power-of-2 pieces (`pow2_chunks`: Triton's loads and stores need them).

64-bit safety: region addresses are **uint32** word indices (`region_base`, `region_address`,
`region_rows`). The Triton lowering zero-extends an index to a 64-bit byte offset when the
array exceeds 2**32 bytes, so a pack of up to 2**32 - 1 words (16 GiB of uint32 words) is
addressed exactly; an int32 address would wrap negative at word 2**31. Row indices into layer
buffers stay int32 (rows < 2**31), the lowering multiplies them by the row pitch in 64 bits.
"""

from __future__ import annotations

import collections
import threading

import jax
import jax.numpy as jnp

from pallas_kernels.config import pow2_chunks

U32 = jnp.uint32


# --------------------------------------------------------------------------- address arithmetic


def region_rows(meta_rows, meta_ok, offset, *, pack_words: int, total_width: int,
                max_rows: int):
    """Rows `n` a region may hold: the asked count clamped to [0, max_rows] and to the room
    left between `offset` and word `pack_words` (so no store passes the pack), 0 if not ok.

    Args:
        meta_rows: int32 scalar, the rows asked for.
        meta_ok: int32 scalar, nonzero if the offset is valid.
        offset: uint32 scalar, the region's first word.
        pack_words: addressable words of the pack (static, <= 2**32 - 1).
        total_width: words per row summed over the layer entries (static, > 0).
        max_rows: padded index count (static).

    Returns:
        n as a uint32 scalar.
    """
    pw = U32(pack_words)
    room = jnp.where(offset <= pw, (pw - offset) // U32(total_width), U32(0))
    asked = jnp.maximum(meta_rows, 0).astype(U32)
    n = jnp.minimum(asked, jnp.minimum(room, U32(max_rows)))
    return jnp.where(meta_ok != 0, n, U32(0))


def region_base(offset, n, prefix: int):
    """First word of a layer entry's block: `offset + n * prefix` (uint32; n * prefix never
    exceeds the pack, `region_rows` saw to it)."""
    return offset + n * U32(prefix)


def region_address(base, rows, width: int, off: int, size: int):
    """uint32 word indices `[len(rows), size]` of piece `[off, off + size)` of rows `rows`
    (int32 or uint32) of the block starting at `base`."""
    r = rows.astype(U32)
    return base + r[:, None] * U32(width) + (U32(off) + jnp.arange(size, dtype=U32))[None, :]


def offset_units_to_words(units, align: int):
    """The kernel's offset argument (an int32 word count in units of `align`, bit pattern of a
    uint32) as a uint32 word index."""
    return jax.lax.bitcast_convert_type(units, U32) * U32(align)


# --------------------------------------------------------------------------- sides


class IndexedRows:
    """Rows `idx` of a layer ref (or of layer `layer` of a stacked ref).

    `mask` ([block_rows] bool) limits loads or stores to the live rows (None: all rows, their
    indices being clamped in range); `evict` / `cache`: Triton hints.
    """

    def __init__(self, ref, idx, *, layer=None, mask=None, evict=None, cache=None):
        self.ref, self.idx, self.layer = ref, idx, layer
        self.mask, self.evict, self.cache = mask, evict, cache

    def _at(self, off: int, size: int):
        # All-array indexers ([rows, 1] x [1, size]): the masked paths of interpret mode do not
        # take a slice next to an array index.
        r2 = self.idx[:, None]
        c2 = (off + jnp.arange(size, dtype=jnp.int32))[None, :]
        return self.ref.at[r2, c2] if self.layer is None else self.ref.at[self.layer, r2, c2]

    def _mask(self, size: int):
        if self.mask is None:
            return None
        return jnp.broadcast_to(self.mask[:, None], (self.idx.shape[0], size))

    def load(self, off: int, size: int):
        if self.evict is None and self.mask is None and self.cache is None:
            cols = pl_ds(off, size)
            return self.ref[self.idx, cols] if self.layer is None else \
                self.ref[self.layer, self.idx, cols]
        from jax.experimental.pallas import triton as pltriton

        return pltriton.load(self._at(off, size), mask=self._mask(size),
                             eviction_policy=self.evict, cache_modifier=self.cache)

    def store(self, off: int, v) -> None:
        from jax.experimental.pallas import triton as pltriton

        pltriton.store(self._at(off, v.shape[1]), v, mask=self._mask(v.shape[1]),
                       eviction_policy=self.evict)


class RegionRows:
    """Rows `rows` of one layer entry's block at uint32 word `base` of a flat pack ref."""

    def __init__(self, ref, base, rows, width: int, *, mask, evict=None, cache=None):
        self.ref, self.base, self.rows, self.width = ref, base, rows, width
        self.mask, self.evict, self.cache = mask, evict, cache

    def _mask(self, size: int):
        return jnp.broadcast_to(self.mask[:, None], (self.rows.shape[0], size))

    def load(self, off: int, size: int):
        from jax.experimental.pallas import triton as pltriton

        flat = region_address(self.base, self.rows, self.width, off, size)
        return pltriton.load(self.ref.at[flat], mask=self._mask(size),
                             eviction_policy=self.evict, cache_modifier=self.cache)

    def store(self, off: int, v) -> None:
        from jax.experimental.pallas import triton as pltriton

        flat = region_address(self.base, self.rows, self.width, off, v.shape[1])
        pltriton.store(self.ref.at[flat], v, mask=self._mask(v.shape[1]),
                       eviction_policy=self.evict)


def pl_ds(off: int, size: int):
    from jax.experimental import pallas as pl

    return pl.ds(off, size)


def copy_block(jobs, *, interleave: bool) -> None:
    """Copy every job's rows: jobs are (source side, destination side, width in words).

    Without `interleave` every piece of every job is loaded before the first store (more bytes
    in flight); with it each piece is stored right after its load (fewer live registers).
    """
    if interleave:
        for src, dst, width in jobs:
            for off, size in pow2_chunks(width):
                dst.store(off, src.load(off, size))
        return
    loaded = [[src.load(off, size) for off, size in pow2_chunks(width)] for src, _, width in jobs]
    for (_, dst, width), vals in zip(jobs, loaded):
        for (off, _), v in zip(pow2_chunks(width), vals):
            dst.store(off, v)


# --------------------------------------------------------------------------- compile bookkeeping


def patch_cache_modifiers() -> None:
    """Let JAX 0.11's Triton lowering find the dotted cache modifiers it accepts.

    Its load rule admits ``".ca"``/``".cg"`` and then indexes a table keyed ``"ca"``/``"cg"``
    (KeyError). Adding the dotted keys is a no-op on versions whose table already has them.
    """
    from jax._src.pallas.triton import lowering

    table = getattr(lowering, "_STR_TO_CACHE_MODIFIER", None)
    if isinstance(table, dict):
        for key in ("ca", "cg"):
            if key in table:
                table.setdefault("." + key, table[key])


_KERNEL_TRACES = [0]
_KERNEL_TRACES_LOCK = threading.Lock()
_KERNEL_TRACE_LOG: "collections.deque[str]" = collections.deque(maxlen=32)


def count_kernel_trace(what: str = "") -> None:
    """Called by every kernel builder, in the Python body that runs only while tracing;
    ``what`` (kernel and static shapes) goes to `compile_log`."""
    with _KERNEL_TRACES_LOCK:
        _KERNEL_TRACES[0] += 1
        _KERNEL_TRACE_LOG.append(f"#{_KERNEL_TRACES[0]} {threading.current_thread().name}: {what}")


def compile_log() -> list[str]:
    """The last 32 kernel traces counted by `compile_count`, oldest first: ``"#count thread:
    kernel (shapes)"``, to name what recompiled when a serving loop's count moves."""
    with _KERNEL_TRACES_LOCK:
        return list(_KERNEL_TRACE_LOG)


def compile_count() -> int:
    """Row-copy kernels (gather, scatter, copy; Triton/interpret `pallas_call` or Mosaic GPU)
    and the ``xla`` pack backend's jitted gathers traced in this process.

    Each trace that builds a kernel adds one; a call that hits the jit cache adds nothing.
    After one warm-up call per row bucket, a serving loop should leave it unchanged: offsets,
    row counts and index values are traced.

    Returns:
        The count since the module was imported (an int >= 0).
    """
    return _KERNEL_TRACES[0]


# Modules the first lowering of each backend imports lazily. The Mosaic interpreters (imported
# by pallas_call's interpret lowering) register a JAX config flag that is part of the tracing
# context: were they imported during the first trace, every kernel traced before would be
# traced, and compiled, once more on its next call. Importing them first keeps the count exact.
_LOWERING_MODULES = {
    "interpret": ("jax._src.pallas.mosaic.interpret.interpret_pallas_call",
                  "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call"),
    "triton": ("jax.experimental.pallas.triton",),
    "mosaic": ("jax.experimental.pallas.mosaic_gpu",),
}
_PRELOADED: set[str] = set()


def preload_lowering(backend: str) -> None:
    """Import `backend`'s lowering modules once, before its first trace (missing ones skipped)."""
    import importlib

    if backend in _PRELOADED:
        return
    for name in _LOWERING_MODULES.get(backend, ()):
        try:
            importlib.import_module(name)
        except ImportError:  # another JAX version: its pallas_call skips them too
            pass
    _PRELOADED.add(backend)
