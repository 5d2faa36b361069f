"""The decode-side jitted scatter: a wire block placed into a device (JAX) cache in one call, for
layouts where descriptors cannot land rows directly (``tpu_gqa``, ``hnd`` with several heads,
``tpu_mla`` with padded lanes: `dcp_jax.hetero.layouts.run_descriptors` counts one per token).

The engine lands the stream's wire block in a receive buffer; `place_wire_jax` writes it into the
cache with one ``.at[].set`` over element indices computed on the host from the same
`dcp_jax.hetero.layouts.segments` the numpy adapter uses (so the two agree by construction and
the tests check it against `place_from_wire` byte for byte). The index array is traced: one
compile per (cache shape, block size).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dcp_jax.hetero.layouts import CacheGeometry, cache_shape, segments

__all__ = ["wire_element_index", "place_wire_jax"]


def wire_element_index(geom: CacheGeometry, pages, slots, head0: int = 0, num_heads: int | None = None
                       ) -> np.ndarray:
    """int32/int64 ``[wire elements]``: the flat cache element each wire element goes to (wire order:
    plane, token, segment)."""
    off, seg = segments(geom, pages, slots, head0, num_heads)
    isz = geom.itemsize
    start = np.ascontiguousarray(off.transpose(1, 0, 2)).reshape(-1) // isz
    idx = (start[:, None] + np.arange(seg // isz, dtype=np.int64)).reshape(-1)
    return idx.astype(np.int32) if idx.size and idx.max() < 2**31 else idx


@jax.jit
def _place(flat, wire, idx):
    return flat.at[idx].set(wire, indices_are_sorted=False, unique_indices=True)


def place_wire_jax(geom: CacheGeometry, cache: jax.Array, wire, pages, slots, head0: int = 0,
                   num_heads: int | None = None) -> jax.Array:
    """``cache`` with the wire block placed (a new array; JAX arrays are immutable).

    Args:
        geom: the decode cache's geometry; cache: a JAX array of `cache_shape(geom)` whose itemsize
            is ``geom.itemsize`` (uint16 for bf16 bytes, or the real dtype).
        wire: uint8 ``[wire bytes]`` (numpy or JAX), in the wire order of `gather_to_wire`.
        pages, slots, head0, num_heads: as `dcp_jax.hetero.layouts.place_from_wire`.

    Raises:
        ValueError: a cache of another shape or itemsize, or a wire block of the wrong size (named).
    """
    shape = cache_shape(geom)
    if tuple(cache.shape) != shape or jnp.dtype(cache.dtype).itemsize != geom.itemsize:
        raise ValueError(f"cache must have shape {shape} and itemsize {geom.itemsize}, got {cache.shape} {cache.dtype}")
    idx = wire_element_index(geom, pages, slots, head0, num_heads)
    wire = jnp.asarray(wire)
    if wire.dtype != jnp.uint8 or wire.size != idx.size * geom.itemsize:
        raise ValueError(f"wire must be {idx.size * geom.itemsize} uint8 bytes, got {wire.size} of dtype {wire.dtype}")
    elems = wire if geom.itemsize == 1 else jax.lax.bitcast_convert_type(wire.reshape(-1, geom.itemsize), cache.dtype)
    return _place(cache.reshape(-1), elems.astype(cache.dtype), jnp.asarray(idx)).reshape(shape)
