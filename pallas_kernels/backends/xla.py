"""The ``xla`` pack backend: `jnp.take` per layer, any platform.

Runs wherever JAX runs (CPU, TPU, CUDA, ROCm): no kernel, so no alignment rule (any byte
offset). numpy inputs are imported, gathered by XLA on the CPU with the row count padded to
`bucket_rows` (a power of 2: few shapes compile, as the kernel backends), and only the region's
bytes copied into the numpy pack: the pack itself never goes through JAX, so a call costs what
its rows do, not what the pack buffer holds. JAX inputs get a new pack (`dynamic_update_slice`
at a traced offset); there the row count is a shape, so each distinct n compiles once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.config import bucket_rows, buckets_up_to
from pallas_kernels.registry import PackBackend, int32_offset, register_backend
from pallas_kernels.row_copy import count_kernel_trace


def _rows_as_words(a):
    """u8[R, W] viewed as the widest words dividing W (uint32/uint16/uint8 [R, W/k, ...]): XLA
    gathers elements, so 4-byte words move a row in a quarter of the elements (measured on the
    CPU: a DeepSeek-V3 rank pack in 0.15 s instead of 0.29 s)."""
    r, w = a.shape
    for k, dt in ((4, jnp.uint32), (2, jnp.uint16)):
        if w % k == 0:
            return jax.lax.bitcast_convert_type(a.reshape(r, w // k, k), dt)
    return a


def _take_rows(a, idx):
    # Indices are range-checked by the registry before the call, so "clip" never clips.
    return jax.lax.bitcast_convert_type(jnp.take(_rows_as_words(a), idx, axis=0, mode="clip"),
                                        jnp.uint8).reshape(idx.shape[0], -1)


def _jax_view(a: np.ndarray):
    """A numpy layer as a JAX CPU array, without copying where JAX can alias it (C-contiguous,
    64-byte aligned, writeable: DLPack); else a copy. `jnp.asarray` always copied: 0.6 s for a
    512 MiB layer on every call, a cost that grew with the KV cache, not the rows gathered."""
    if a.flags.c_contiguous and a.flags.writeable and a.ctypes.data % 64 == 0:
        try:
            return jax.dlpack.from_dlpack(a)
        except (BufferError, TypeError, ValueError, RuntimeError):
            pass
    return jnp.asarray(a)


@jax.jit
def _gather_xla(layers, idx):
    """[u8[m, W_l]] the rows ``idx`` (i32[m]) of every layer."""
    count_kernel_trace(f"xla gather ({idx.shape[0]} rows, {len(layers)} layers)")
    return [_take_rows(a, idx) for a in layers]


@jax.jit
def _pack_xla(layers, idx, pack, offset):
    count_kernel_trace(f"xla pack ({idx.shape[0]} rows, {len(layers)} layers, pack of {pack.shape[0]} B)")
    parts = [_take_rows(a, idx).reshape(-1) for a in layers]
    return jax.lax.dynamic_update_slice(pack, jnp.concatenate(parts), (offset,))


class XlaBackend(PackBackend):
    name = "xla"
    kinds = ("numpy", "jax")

    def unsupported(self, item_lens, offset):
        return int32_offset(self.name, offset)  # dynamic_update_slice's start: int32 without x64

    def _pack(self, layers, idx, pack, offset, kind, page_size):
        n = int(idx.size)
        if n == 0:
            return pack
        if kind == "numpy":
            padded = np.zeros(bucket_rows(n), np.int32)  # row 0 repeated: read, never written out
            padded[:n] = idx
            parts = _gather_xla([_jax_view(a) for a in layers], jnp.asarray(padded))
            at = offset
            for a, part in zip(layers, parts):
                w = int(a.shape[1])
                pack[at:at + n * w] = np.asarray(part)[:n].reshape(-1)
                at += n * w
            return pack
        return _pack_xla(layers, jnp.asarray(idx.astype(np.int32)), pack, np.int32(offset))

    def warm(self, layers, max_rows):
        """numpy layers: the padded gather for every `bucket_rows` bucket up to `max_rows`. JAX
        layers compile per row count (and pack size): nothing ahead."""
        if not layers or not isinstance(layers[0], np.ndarray):
            return []
        out = buckets_up_to(max(1, int(max_rows)))
        views = [_jax_view(a) for a in layers]
        for m in out:
            jax.block_until_ready(_gather_xla(views, jnp.zeros(m, jnp.int32)))
        return out


register_backend(XlaBackend())
