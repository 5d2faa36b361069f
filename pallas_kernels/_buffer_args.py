"""Argument checks of the host contracts (`pack_rows`, `pack_windows`, `unpack_rows`,
`copy_rows`): numpy / CuPy layer buffers, index arrays and pack byte offsets.

Every check raises TypeError or ValueError naming the argument. The jitted kernels' own
checks (traced shapes, int32 metadata) are in `pallas_kernels._args`.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import numpy as np

from pallas_kernels.config import addressable_words


def is_cupy(a) -> bool:
    """True for a CuPy array (judged by its type's module: CuPy need not be installed)."""
    return type(a).__module__.split(".")[0] == "cupy"


def check_layers(layers, on_device: bool, other: str) -> tuple[tuple[int, ...], int]:
    """(item_lens, min rows) of layer buffers that must all be of `on_device`'s kind.

    Raises:
        TypeError: not a numpy/CuPy array, a kind other than `other`'s, or not uint8.
        ValueError: not 2-D.
    """
    for l, a in enumerate(layers):
        if not (isinstance(a, np.ndarray) or is_cupy(a)):
            raise TypeError(f"layers[{l}] must be a numpy or CuPy uint8 array, got "
                            f"{type(a).__name__}")
        if is_cupy(a) != on_device:
            raise TypeError(f"layers[{l}] and {other} must both be numpy or both CuPy arrays")
        if a.ndim != 2:
            raise ValueError(f"layers[{l}] must be 2-D [num_rows, kv_item_len], got {a.shape}")
        if a.dtype != np.uint8:
            raise TypeError(f"layers[{l}] dtype {a.dtype} must be uint8 (view rows as bytes)")
    return tuple(int(a.shape[1]) for a in layers), min(int(a.shape[0]) for a in layers)


def check_bool(value: Any, name: str) -> None:
    """A flag such as ``checked`` or ``sync`` must be a real bool: ``"no"`` or ``0`` would be
    read by truth value (``checked="no"`` skipping the index checks on a GPU).

    Raises:
        TypeError: naming ``name`` and the type given.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def as_1d(values: Any, name: str) -> np.ndarray:
    """``values`` (a sequence or array) as a 1-D numpy array, an empty one as int64 (an empty
    list would be float64). The dtype is the caller's to check.

    Raises:
        TypeError: not a sequence or array at all (None, a number, a string, a generator:
            numpy makes a 0-d array of those).
        ValueError: not 1-D (names ``name`` and the shape).
    """
    try:
        a = np.asarray(values)
    except ValueError as exc:  # ragged nested lists: numpy's message names no argument
        raise ValueError(f"{name} must be a 1-D sequence of ints ({exc})") from None
    if a.ndim == 0:
        raise TypeError(f"{name} must be a sequence or 1-D array of ints, got {type(values).__name__}")
    if a.size == 0:
        a = a.astype(np.int64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    return a


def check_still_writeable(layers, name: str) -> None:
    """Host destination layers checked writeable when an object was made can be made read-only
    since (``a.setflags(write=False)``): checked again before every write, so a call writes all
    of its layers or none (numpy's own error named no argument, after the first layers).

    Raises:
        ValueError: ``{name}[l]`` is read-only now.
    """
    for l, a in enumerate(layers):
        if isinstance(a, np.ndarray) and not a.flags.writeable:  # (JAX / CuPy layers: no such flag)
            raise ValueError(f"{name}[{l}] is read-only now (it was writeable when this object was made): "
                             "nothing was written")


def check_offset(offset: Any) -> int:
    """A region's byte offset inside a pack, as an int.

    Raises:
        ValueError: not a non-negative int (a bool or a float included; names ``offset``).
    """
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
        raise ValueError(f"{offset=} must be a non-negative int (bytes)")
    return int(offset)


def check_fits(offset: int, n: int, item_lens, pack_bytes: int) -> int:
    """The bytes of a layer-major region of ``n`` rows at byte ``offset``: ``n * sum(item_lens)``.

    Raises:
        ValueError: the region ends past the pack's ``pack_bytes`` (nothing is written then).
    """
    row = sum(item_lens)
    total = n * row
    if offset + total > pack_bytes:
        raise ValueError(f"pack region overflow: {offset=} + {n} rows x {row} B = "
                         f"{offset + total} B > pack of {pack_bytes} B")
    return total


def check_indices(values, name: str, *, device_ok: bool):
    """1-D integer row indices: the CuPy array itself when ``device_ok``, else a numpy array.

    Raises:
        TypeError: a CuPy array where the buffers are numpy (host) arrays, or not integers.
        ValueError: not 1-D.
    """
    if type(values) is np.ndarray and values.ndim == 1 and values.dtype.kind in "iu":
        return values  # the common case, on every call of a hot path: nothing to convert
    if device_ok and is_cupy(values):
        idx = values
        if idx.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {idx.shape}")
    else:
        if is_cupy(values):
            raise TypeError(f"{name} is a CuPy array but the layers are numpy (host) arrays")
        idx = as_1d(values, name)
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"{name} dtype {idx.dtype} must be an integer type")
    return idx


def check_range(idx, name: str, num_rows: int, layers_name: str | None = None, *,
                unique: bool = False) -> None:
    """Every index in [0, num_rows), and (`unique`) no index twice. CuPy: one sync.

    Raises:
        ValueError: an index out of range (the message names `name`, and `layers_name` when
            given) or, with `unique`, repeated.
    """
    if idx.shape[0] == 0:
        return
    if is_cupy(idx):
        import cupy as cp

        parts = [idx.min(), idx.max()]
        if unique:
            s = cp.sort(idx)
            parts.append((s[1:] == s[:-1]).any().astype(idx.dtype) if s.size > 1
                         else cp.zeros((), idx.dtype))
        vals = [int(v) for v in cp.stack(parts).get()]  # one sync
        lo, hi, dup = vals[0], vals[1], (vals[2] if unique else 0)
    else:
        lo, hi = int(idx.min()), int(idx.max())
        dup = 0
        if unique and idx.shape[0] > 1:
            s = np.sort(idx)
            dup = int(np.any(s[1:] == s[:-1]))
    if lo < 0:
        raise ValueError(f"{name} must be >= 0, got min {lo}")
    if hi >= num_rows:
        of = "" if layers_name is None else f" of {layers_name}"
        raise ValueError(f"{name} must be < num_rows={num_rows} of every layer{of}, got max {hi}")
    if dup:
        raise ValueError(f"{name} must be unique (destination rows): a row written twice would "
                         "hold one of the candidates, unspecified which")


def check_word_offset(offset: int, total: int, word: np.dtype, item_lens, device_pack,
                      pack_bytes: int, backend: str) -> None:
    """The Pallas paths' rules: word-aligned offset and address, region end addressable.

    Raises:
        ValueError: ``offset`` (bytes) off the word, the region ending past the last word the
            kernel addresses, or a device pack whose address is off the word.
    """
    ws = word.itemsize
    if offset % ws:
        raise ValueError(f"{offset=} must be a multiple of {ws} bytes on the Pallas paths: the "
                         f"word ({word.name}) of rows of {list(item_lens)} B "
                         "(backend='numpy' takes any offset)")
    limit = addressable_words(pack_bytes // ws, ws, backend)
    if (offset + total) // ws > limit:
        raise ValueError(f"{offset=} + {total} B ends past word {limit} of {word.name}, the last "
                         f"one the kernel addresses in a pack of {pack_bytes} B (uint32 word "
                         "indices; int32 offsets below 4 GiB and for mosaic)")
    if device_pack is not None and device_pack.data.ptr % ws:
        raise ValueError(f"pack address {device_pack.data.ptr:#x} must be a multiple of {ws} "
                         f"bytes (the {word.name} word)")


def _extent(a) -> tuple[int, int]:
    """[start, end) byte addresses an array's elements may touch (numpy or CuPy)."""
    if is_cupy(a):
        ptr = int(a.data.ptr)
    else:
        ptr = int(a.__array_interface__["data"][0])
    lo = hi = ptr
    for n, s in zip(a.shape, a.strides):
        if n == 0:
            return ptr, ptr
        if s >= 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    return lo, hi + a.itemsize


def _check_disjoint(srcs, src_name: str, dsts, dst_name: str) -> None:
    """No destination layer may share memory with a source (layer or pack): sorted extents and
    a bisection per destination, O(L log L); strided numpy views whose extents interleave are
    resolved exactly by `np.shares_memory`."""
    spans = sorted((*_extent(a), l) for l, a in enumerate(srcs) if a.size)
    starts = [s[0] for s in spans]
    reach = []  # reach[k]: the largest end among spans[:k + 1]
    for s0, s1, _ in spans:
        reach.append(max(s1, reach[-1]) if reach else s1)
    for k, d in enumerate(dsts):
        if not d.size:
            continue
        d0, d1 = _extent(d)
        hi = bisect.bisect_left(starts, d1)  # spans starting before d1
        j = hi - 1
        while j >= 0 and reach[j] > d0:
            s0, s1, l = spans[j]
            if s1 > d0 and not (isinstance(d, np.ndarray) and
                                not np.shares_memory(d, srcs[l], max_work=1000)):
                where = "" if src_name == "pack" else f"[{l}]"
                what = dst_name if dst_name == "pack" else f"{dst_name}[{k}]"
                raise ValueError(f"{what} shares memory with {src_name}{where}: "
                                 "sources and destinations must be disjoint")
            j -= 1


def overlapping_spans(spans):
    """Pairs (i, j) of [start, end, i] spans whose extents overlap (a sort and a sweep over the
    spans still open; O(n log n + pairs))."""
    active, out = [], []
    for s0, s1, j in sorted(spans):
        active = [(e, i) for e, i in active if e > s0]
        out += [(i, j) for _, i in active]
        active.append((s1, j))
    return out


def _rows_self_overlap(a) -> bool:
    """Whether a 2-D view addresses one byte from two (row, column) places (a stride-0 or
    overlapping `as_strided` view): byte i*s0 + j*s1 repeats iff a nonzero (di, dj) with
    |di| < rows, |dj| < cols solves di*s0 + dj*s1 = 0, whose smallest solution is
    (s1/g, -s0/g) for g = gcd(s0, s1)."""
    (r, c), (s0, s1) = a.shape, a.strides
    if r == 0 or c == 0:
        return False
    if s0 == 0 or s1 == 0:
        return (r > 1 and s0 == 0) or (c > 1 and s1 == 0)
    g = math.gcd(s0, s1)
    return abs(s1 // g) < r and abs(s0 // g) < c


def _check_no_overlap(layers, name: str) -> None:
    """No two entries of one destination list may share memory: a row would be written twice,
    the last write winning in an order a device does not keep. Overlapping extents
    (`overlapping_spans`) of strided numpy views are resolved exactly by `np.shares_memory`."""
    for l, a in enumerate(layers):
        if _rows_self_overlap(a):
            raise ValueError(f"{name}[{l}] (shape {a.shape}, strides {a.strides}) addresses some "
                             "byte twice: a destination's rows and columns must not overlap")
    spans = [(*_extent(a), l) for l, a in enumerate(layers) if a.size]
    for i, j in overlapping_spans(spans):
        x, y = layers[i], layers[j]
        if isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and \
                not np.shares_memory(x, y, max_work=1000):
            continue
        i, j = sorted((i, j))
        raise ValueError(f"{name}[{i}] and {name}[{j}] share memory: each destination layer "
                         "must be its own memory")
