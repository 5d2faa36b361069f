"""Pallas Mosaic TPU form of the pack gather, and the ``tpu`` / ``tpu-interpret`` backends.

Two paths, both on words (`pallas_kernels.word_dtype`: uint32 for 1152 B or 576 B rows):

- rows (`gather_rows_tpu`): the KV layers and the flat pack stay in HBM (`pl.ANY`); row j of
  layer l is one async DMA `src_l[idx[j]] -> pack[offset + n*off_l + j*W_l : +W_l]`, at most
  `window` in flight (one DMA semaphore per slot: a slot is waited on before it is reused, and
  every slot is drained before the kernel ends). The indices and (n, offset) are scalar
  prefetch (SMEM), so the row count and the offset are traced: one kernel per index bucket.
  The pack is aliased to the output: no other word is touched.
- pages (`gather_pages_tpu`, block round-robin: a rank owns whole pages): each layer is viewed
  as [num_pages, page_size, W]; a grid step copies one page through a `BlockSpec` whose index
  map reads the page id from scalar prefetch (Pallas pipelines the HBM->VMEM->HBM copies).
  It yields one [k, page_size, W] array per layer; XLA places them in the pack.

Not yet measured on a TPU. A known cost there: `pack_region` takes uint8 layers, and the
uint8 -> word view (`_as_words`, a reshape to [..., W, 4] plus a bitcast) is likely to be
materialised by XLA on TPU, whose uint8 tiles pad that minor dim of 4 to 128 lanes: a serving
cache should reach the kernel in its word dtype (`gather_rows_tpu` takes words), which the
byte-typed registry API does not offer yet.

Checked on a CPU (no TPU is lent): `interpret=True` for values, `pltpu.InterpretParams()` for
missing DMA waits (wrong bytes) and out-of-bounds reads (IndexError), `jax.export(...,
platforms=("tpu",))` under an abstract TPU mesh for the Mosaic lowering (`export_for_tpu`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import bucket_rows, word_dtype
from pallas_kernels.registry import WordBackend, int32_offset, register_backend

ROW_WINDOW = 8  # row DMAs in flight per layer loop (semaphore slots)
MIN_ROW_BUCKET = 8


def _row_kernel(idx_ref, meta_ref, *refs, widths, window, wait, drain):
    """Per-row HBM->HBM DMAs into the flat pack. `wait=False` (no slot waits) and
    `drain=False` (no final drain) are the broken variants the tests must catch."""
    from jax.experimental.pallas import tpu as pltpu

    num_layers = len(widths)
    srcs, pack, sems = refs[:num_layers], refs[num_layers + 1], refs[num_layers + 2]
    n, base = meta_ref[0], meta_ref[1]
    for l, w in enumerate(widths):
        def wait_slot(slot, l=l, w=w):
            # A wait needs a descriptor of the same size as the copy on that semaphore.
            if wait:
                pltpu.make_async_copy(srcs[l].at[0], pack.at[pl.ds(0, w)], sems.at[slot]).wait()

        def step(j, carry, l=l, w=w, base=base):
            slot = j % window

            @pl.when(j >= window)
            def _():
                wait_slot(slot)

            pltpu.make_async_copy(srcs[l].at[idx_ref[j]], pack.at[pl.ds(base + j * w, w)],
                                  sems.at[slot]).start()
            return carry

        jax.lax.fori_loop(0, n, step, 0)

        def drain_slot(j, carry, wait_slot=wait_slot):
            wait_slot(j % window)
            return carry

        if drain:
            jax.lax.fori_loop(jnp.maximum(n - window, 0), n, drain_slot, 0)
        base = base + n * w


def gather_rows_tpu(srcs, idx, pack, n, offset, *, interpret=False, window: int = ROW_WINDOW,
                    _wait: bool = True, _drain: bool = True):
    """Row path: `pack[offset + n*off_l + j*W_l ...] = srcs[l][idx[j]]` for j < n, in words.

    Args:
        srcs: list of u32/u16/u8[R_l, W_l] JAX arrays (one dtype, the pack's).
        idx: i32[m] (m >= n; entries past n are never read). Not bounds-checked here:
            `pack_region` checks them; under `InterpretParams` a bad one raises IndexError.
        pack: 1-D words, aliased to the result.
        n, offset: rows and word offset (ints or i32 scalars; traced).
        interpret: False (TPU), True, or a `pltpu.InterpretParams`.
        window: DMAs in flight.
        _wait, _drain: False only in tests (the broken variants race detection must catch).

    Returns:
        The pack with the region written (a new array unless donated by a caller's jit).
    """
    from jax.experimental.pallas import tpu as pltpu

    widths = tuple(int(s.shape[1]) for s in srcs)
    num_layers = len(widths)
    meta = jnp.stack([jnp.asarray(n, jnp.int32), jnp.asarray(offset, jnp.int32)])
    call = pl.pallas_call(
        functools.partial(_row_kernel, widths=widths, window=window, wait=_wait,
                          drain=_drain),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * (num_layers + 1),
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA((window,))]),
        out_shape=jax.ShapeDtypeStruct(pack.shape, pack.dtype),
        input_output_aliases={2 + num_layers: 0},
        interpret=interpret,
        name=f"kv_gather_tpu_rows_L{num_layers}",
    )
    return call(idx.astype(jnp.int32), meta, *srcs, pack)


def _page_kernel(pages_ref, *refs, num_layers):
    del pages_ref  # read by the index maps
    for l in range(num_layers):
        refs[num_layers + l][...] = refs[l][...]


def gather_pages_tpu(srcs, pages, *, page_size: int, interpret=False):
    """Page path: for each layer, the [k, page_size, W_l] pages `pages` of `srcs[l]`.

    Args:
        srcs: list of [R_l, W_l] word arrays, each R_l a multiple of `page_size`.
        pages: i32[k] page ids (any order, duplicates allowed).
        page_size: rows per page (the block's second-to-last dim; equal to the array's).
        interpret: as `gather_rows_tpu`.
    """
    from jax.experimental.pallas import tpu as pltpu

    views = [s.reshape(s.shape[0] // page_size, page_size, s.shape[1]) for s in srcs]
    k = int(pages.shape[0])
    num_layers = len(srcs)
    call = pl.pallas_call(
        functools.partial(_page_kernel, num_layers=num_layers),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(k,),
            in_specs=[pl.BlockSpec((None, page_size, v.shape[2]),
                                   lambda j, pg: (pg[j], 0, 0)) for v in views],
            out_specs=[pl.BlockSpec((None, page_size, v.shape[2]),
                                    lambda j, pg: (j, 0, 0)) for v in views]),
        out_shape=[jax.ShapeDtypeStruct((k, page_size, v.shape[2]), v.dtype) for v in views],
        interpret=interpret,
        name=f"kv_gather_tpu_pages_L{num_layers}",
    )
    return call(pages.astype(jnp.int32), *views)


def _as_words(a, word):
    """u8[..., W] -> word[..., W / itemsize] (a bitcast; XLA may copy on TPU)."""
    ws = np.dtype(word).itemsize
    if ws == 1:
        return a
    return jax.lax.bitcast_convert_type(a.reshape(*a.shape[:-1], a.shape[-1] // ws, ws), word)


def _as_bytes(w):
    if w.dtype == jnp.uint8:
        return w
    return jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(*w.shape[:-1], -1)


@functools.partial(jax.jit, static_argnames=("interpret", "word"))
def _pack_rows_jit(layers, idx, pack, meta, *, interpret, word):
    ws = np.dtype(word).itemsize
    full = pack.shape[0] // ws * ws
    words = _as_words(pack[:full], word)
    out = gather_rows_tpu([_as_words(a, word) for a in layers], idx, words, meta[0],
                          meta[1] // ws, interpret=interpret)
    return jnp.concatenate([_as_bytes(out), pack[full:]])


@functools.partial(jax.jit, static_argnames=("interpret", "word", "page_size"))
def _pack_pages_jit(layers, pages, pack, offset, *, interpret, word, page_size):
    outs = gather_pages_tpu([_as_words(a, word) for a in layers], pages, page_size=page_size,
                            interpret=interpret)
    region = jnp.concatenate([_as_bytes(o.reshape(-1, o.shape[-1])).reshape(-1) for o in outs])
    return jax.lax.dynamic_update_slice(pack, region, (offset,))


def whole_pages(idx: np.ndarray, page_size: int) -> np.ndarray | None:
    """Page ids if `idx` is whole, aligned pages (row p*page_size + t, t < page_size), else None."""
    if idx.size == 0 or idx.size % page_size:
        return None
    runs = idx.reshape(-1, page_size)
    first = runs[:, 0]
    if np.any(first % page_size) or np.any(runs != first[:, None] + np.arange(page_size)):
        return None
    return (first // page_size).astype(np.int32)


class TpuBackend(WordBackend):
    """``tpu`` (a TPU device) or ``tpu-interpret`` (CPU): `gather_rows_tpu` / `gather_pages_tpu`.

    `path`: "auto" (pages when `page_size` is given and the indices are whole aligned pages
    of layers whose row counts are page multiples, else rows), "rows" or "pages".
    """

    def __init__(self, interpret, name: str, path: str = "auto"):
        self.interpret, self.name, self.path = interpret, name, path
        self.kinds = ("numpy", "jax") if interpret else ("jax",)

    def unsupported(self, item_lens, offset):
        # The kernels take the offset in an int32 meta vector / scalar.
        return super().unsupported(item_lens, offset) or int32_offset(self.name, offset)

    def unavailable(self):
        if self.interpret:
            return None
        if not any(d.platform == "tpu" for d in jax.devices()):
            return "no TPU device (use tpu-interpret on a CPU)"
        return None

    def _pack(self, layers, idx, pack, offset, kind, page_size):
        item_lens = tuple(int(a.shape[1]) for a in layers)
        word = word_dtype(item_lens)
        n = int(idx.size)
        if n == 0:
            return pack
        pages = None
        if self.path != "rows" and page_size is not None and all(
                a.shape[0] % page_size == 0 for a in layers):
            pages = whole_pages(idx, page_size)
        if self.path == "pages" and pages is None:
            raise ValueError("path='pages' needs page_size and indices that are whole aligned "
                             "pages of layers with num_rows a multiple of page_size")
        jl = [jnp.asarray(a) for a in layers]
        jp = jnp.asarray(pack)
        if pages is not None:
            out = _pack_pages_jit(jl, jnp.asarray(pages), jp, np.int32(offset),
                                  interpret=self.interpret, word=word, page_size=page_size)
        else:
            m = bucket_rows(n, MIN_ROW_BUCKET)
            idx_pad = np.zeros(m, np.int32)
            idx_pad[:n] = idx
            out = _pack_rows_jit(jl, jnp.asarray(idx_pad), jp, np.array([n, offset], np.int32),
                                 interpret=self.interpret, word=word)
        if kind == "numpy":
            total = n * sum(item_lens)
            pack[offset:offset + total] = np.asarray(out[offset:offset + total])
            return pack
        return out


def export_for_tpu(fn, *args, device_kind: str = "TPU v5e"):
    """`jax.export` of `fn(*args)` (ShapeDtypeStructs) for TPU, from any machine.

    The Mosaic lowering reads the chip's sublane count, so it runs under an abstract mesh of
    `device_kind` (a private JAX API, `jax._src.mesh.AbstractDevice`, as of 0.11).

    Returns:
        The `jax.export.Exported`; its `mlir_module()` holds the `tpu_custom_call`.
    """
    from jax._src.mesh import AbstractDevice

    # Auto axes: one chip, nothing sharded (Explicit axes would type the kernel's outputs).
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=AbstractDevice(
                                         device_kind=device_kind, num_cores=1, platform="tpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(jax.jit(fn), platforms=("tpu",))(*args)


register_backend(TpuBackend(False, "tpu"))
register_backend(TpuBackend(True, "tpu-interpret"))
