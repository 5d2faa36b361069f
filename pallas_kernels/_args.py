"""Argument checks of the row-copy kernels' jitted entry points (`gather_rows`, `scatter_rows`).

Shapes and dtypes are checked while tracing (`static_validate`); concrete row counts and
offsets are checked and turned into the kernels' int32 metadata (`rows_arg`, `offset_arg`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_kernels.config import MAX_PACK_WORDS, MAX_WORD_OFFSET, WORD_DTYPES

def layer_shapes(src) -> tuple[bool, list[tuple[int, int]], Any]:
    """(stacked, [(rows, width)] per layer entry, dtype); raises on bad ndim / dtype."""
    if isinstance(src, (list, tuple)):
        if not src:
            raise ValueError("src must hold at least one layer entry")
        shapes, dtypes = [], set()
        for l, a in enumerate(src):
            if a.ndim != 2:
                raise ValueError(f"src[{l}] must be 2-D [rows, width], got shape {a.shape}")
            shapes.append((int(a.shape[0]), int(a.shape[1])))
            dtypes.add(np.dtype(a.dtype))
        if len(dtypes) != 1:
            raise TypeError(f"src entries must share one dtype, got {sorted(map(str, dtypes))}")
        return False, shapes, dtypes.pop()
    if src.ndim != 3:
        raise ValueError(f"src must be [L, R, W] or a list of [R, W] arrays, got shape {src.shape}")
    L, R, W = (int(d) for d in src.shape)
    return True, [(R, W)] * L, np.dtype(src.dtype)


def static_validate(src, indices, pack):
    stacked, shapes, dtype = layer_shapes(src)
    if dtype not in WORD_DTYPES:
        raise TypeError(f"src dtype {dtype} must be one of uint32/uint16/uint8 (view rows as words)")
    if pack.ndim != 1:
        raise ValueError(f"pack must be 1-D, got shape {pack.shape}")
    if np.dtype(pack.dtype) != dtype:
        raise TypeError(f"pack dtype {pack.dtype} must equal the src dtype {dtype}")
    if indices.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {indices.shape}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"indices dtype {indices.dtype} must be an integer type")
    if shapes and min(w for _, w in shapes) <= 0:
        raise ValueError(f"every layer width must be positive, got {[w for _, w in shapes]}")
    return stacked, shapes


def is_int(x) -> bool:
    """A concrete integer: Python or numpy int (not bool) or a 0-d numpy integer array."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, (int, np.integer)):
        return True
    return isinstance(x, np.ndarray) and x.ndim == 0 and np.issubdtype(x.dtype, np.integer)


def i32_scalar(x, name: str):
    """An int32 scalar array (traced or on device) as the kernel takes it; others raise."""
    dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    if dtype is None or shape is None or isinstance(x, np.ndarray):
        raise ValueError(f"{name}={x!r} must be an int or an integer scalar array")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} dtype {dtype} must be an integer type")
    if int(np.prod(shape)) != 1:
        raise ValueError(f"{name} must be a scalar, got shape {shape}")
    if dtype != jnp.int32:
        x = x.astype(jnp.int32)
    return x.reshape(()) if shape != () else x


def rows_arg(num_rows, m: int):
    """num_rows as an int32 scalar: None -> m; a concrete int clamped to [0, m]."""
    if num_rows is None:
        return np.int32(m)
    if is_int(num_rows):
        return np.int32(min(max(int(num_rows), 0), m))
    return i32_scalar(num_rows, "num_rows")


def offset_arg(offset, offset_align: int, backend: str, itemsize: int):
    """(units, ok): the offset in units of `offset_align` words, as the kernels take it.

    `units` is an int32 scalar holding the bit pattern of a uint32 (so concrete offsets up to
    `MAX_PACK_WORDS` words fit); `ok` an int32 scalar, 0 when the kernel must write nothing.
    A concrete offset is checked against every rule (ValueError). A traced one that is
    negative or not a multiple of `offset_align` gives ok = 0.
    """
    if not is_int(offset):
        if getattr(offset, "dtype", None) is None:  # bool, float, str, ...
            raise ValueError(f"{offset=} must be a non-negative int (words) or an int32 "
                             "scalar array")
        off = i32_scalar(offset, "offset")
        ok = (off >= 0) & (off % offset_align == 0)
        return jnp.where(ok, off // offset_align, 0), ok.astype(jnp.int32)
    off = int(offset)
    if off < 0:
        raise ValueError(f"{offset=} must be a non-negative int (words)")
    limit = MAX_WORD_OFFSET if backend == "mosaic" else MAX_PACK_WORDS
    if off > limit:
        raise ValueError(f"{offset=} words must be <= {limit} (the kernel's word indices are "
                         f"{'int32' if backend == 'mosaic' else 'uint32'})")
    if off % offset_align:
        raise ValueError(f"{offset=} words must be a multiple of {offset_align=}")
    if backend == "mosaic" and (off * itemsize) % 16:
        raise ValueError(f"{offset=} words ({off * itemsize} bytes) must be a multiple of 16 "
                         "bytes for mosaic (bulk copies)")
    return np.uint32(off // offset_align).view(np.int32), np.int32(1)
