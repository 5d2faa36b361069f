"""Host contract of the scatter side: `unpack_rows` out of a receive region, `copy_rows` between
two sets of KV layers (spec section 6, the inverse of `pack_rows`).

- `unpack_rows(pack, layers, indices, offset=...)` reads the layer-major region `pack_rows` writes
  (entry l's n rows at bytes `[offset + n * sum_{k<l} item_len_k, ... + n * item_len_l)`) and
  writes its row j into row `indices[j]` of `layers[l]`, in place.
- `copy_rows(src_layers, src_indices, dst_layers, dst_indices)` is the fused gather-scatter:
  `dst_layers[l][dst_indices[j]] = src_layers[l][src_indices[j]]` for every layer entry, with no
  pack in between (on the GPU one kernel for all layers; `dst_layers` may be CuPy arrays over
  IPC-mapped memory of another process).

Conventions shared by both (checked, `ValueError`/`TypeError` naming the argument):

- Layers are u8[num_rows_l, kv_item_len_l] (rows viewed as bytes), destinations writeable.
- Source indices may repeat and come in any order; **destination indices must be unique**
  (a duplicate would leave the row holding one of the candidates, unspecified which, on a
  parallel device): host (numpy) indices are checked and a duplicate raises; device (CuPy)
  indices are checked with the other index checks (one synchronisation) unless the caller
  vouches for them (`checked=True`).
- Sources and destinations must not share memory (the result would depend on the order of
  the row copies).

Completion: host forms return when the bytes are there. Device forms return once the kernel is
enqueued on the JAX stream of the destination's device; `synchronize(dst)` (or the JAX arrays'
`block_until_ready`) waits until the bytes are in the destination memory. A consumer on another
stream or in another process (IPC) must wait for that before it reads.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels import device
from pallas_kernels.config import GatherConfig, select_backend
from pallas_kernels.host import check_threads, copy_host, unpack_host
from pallas_kernels._buffer_args import (  # noqa: F401  (_extent: its old home was here)
    _check_disjoint,
    _check_no_overlap,
    _extent,
    check_bool,
    check_fits,
    check_indices,
    check_offset,
    check_range,
    is_cupy as _is_cupy,
)
from pallas_kernels.unpack_device import (
    check_pallas_region,
    copy_cupy,
    copy_pallas,
    unpack_cupy,
    unpack_pallas,
)

#: Backends of `unpack_rows` / `copy_rows`: "triton" is the Pallas kernel on a GPU,
#: "interpret" the same kernel body on the CPU (tests), "cupy" CuPy fancy indexing (one
#: kernel per layer: a reference form), "numpy" the threaded host form.
SCATTER_BACKENDS = ("auto", "numpy", "cupy", "interpret", "triton")


def _is_jax(a) -> bool:
    return type(a).__module__.split(".")[0] in ("jax", "jaxlib")


def _kind(a) -> str | None:
    if isinstance(a, np.ndarray):
        return "numpy"
    if _is_cupy(a):
        return "cupy"
    if _is_jax(a):
        return "jax"
    return None


_CHECKS: dict = {}  # (what, ids) -> (weak refs, result): checks of CuPy buffer lists


def _once(what: str, arrays, fn, *, host: bool = False):
    """`fn()` once per list of CuPy arrays (a registration), cached under weak references
    (evicted when any of them dies); numpy lists are checked on every call (their flags can
    change; `host=True` caches them too, for checks of memory ranges, which an array keeps for
    its life). A failing check raises and caches nothing."""
    if not host and not all(_is_cupy(a) for a in arrays):
        return fn()
    key = (what,) + tuple(map(id, arrays))
    hit = device._lookup(_CHECKS, key, arrays)
    if hit is not None:
        return hit[0]
    result = fn()
    device._remember(_CHECKS, key, arrays, (result,))
    return result


def _check_layer_list(layers, name: str, *, writeable: bool) -> tuple[str, tuple[int, ...], int]:
    """(kind, item_lens, min rows) of a list of u8 2-D layers of one kind (numpy or CuPy)."""
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError(f"{name} must be a non-empty list of 2-D uint8 arrays")
    kinds = set()
    for l, a in enumerate(layers):
        kind = _kind(a)
        if kind is None or (kind == "jax" and writeable):
            what = "JAX arrays are immutable" if kind == "jax" else f"got {type(a).__name__}"
            raise TypeError(f"{name}[{l}] must be a numpy or CuPy uint8 array ({what})")
        if a.ndim != 2:
            raise ValueError(f"{name}[{l}] must be 2-D [num_rows, kv_item_len], got shape {a.shape}")
        if a.dtype != np.uint8:
            raise TypeError(f"{name}[{l}] dtype {a.dtype} must be uint8 (view rows as bytes)")
        if a.shape[1] == 0:
            raise ValueError(f"{name}[{l}] has rows of 0 bytes: every layer entry needs kv_item_len > 0")
        if writeable and kind == "numpy" and not a.flags.writeable:
            raise ValueError(f"{name}[{l}] is read-only: the destination must be writeable")
        kinds.add("device" if kind in ("cupy", "jax") else "host")
    if len(kinds) != 1:
        raise TypeError(f"{name} must be all numpy (host) or all CuPy (device) arrays")
    return kinds.pop(), tuple(int(a.shape[1]) for a in layers), min(int(a.shape[0]) for a in layers)


def check_item_lens_match(s_lens, d_lens) -> None:
    """A copy's source and destination lists must have the same layer entries, row for row."""
    if len(s_lens) != len(d_lens):
        raise ValueError(f"dst_layers has {len(d_lens)} layer entries, src_layers {len(s_lens)}")
    for l, (a, b) in enumerate(zip(s_lens, d_lens)):
        if a != b:
            raise ValueError(f"item_len mismatch at layer {l}: src_layers[{l}] rows are {a} B, "
                             f"dst_layers[{l}] rows {b} B")


def _resolve(backend: str, on_device: bool) -> str:
    if backend not in SCATTER_BACKENDS:
        raise ValueError(f"{backend=} must be one of {SCATTER_BACKENDS}")
    if backend == "auto":
        if not on_device:
            return "numpy"
        # The Pallas scatter has a Triton form only (no Mosaic one): CuPy on JAX >= 0.12.
        return "triton" if select_backend("auto") == "triton" else "cupy"
    if backend == "numpy" and on_device:
        raise ValueError("backend='numpy' needs numpy (host) buffers")
    if backend in ("cupy", "triton") and not on_device:
        raise ValueError(f"backend={backend!r} needs CuPy (device) buffers")
    if backend == "interpret" and on_device:
        raise ValueError("backend='interpret' needs numpy (host) buffers")
    if backend == "triton":
        select_backend("triton")  # ValueError without a GPU
    return backend


def unpack_rows(pack, layers, indices, *, offset: int = 0, backend: str = "auto",
                threads: int | None = None, checked: bool = False,
                config: GatherConfig | None = None) -> int:
    """Write the rows of a layer-major pack region into rows `indices` of every layer, in place.

    The exact inverse of `pack_rows(layers, indices, pack, offset=offset)`: for entry l and
    j < n, `layers[l][indices[j]] = pack[offset + off_l + j * w_l : ... + w_l]`,
    `off_l = n * sum_{k<l} w_k`, `w_l = kv_item_len_l`. No other byte of `layers` changes;
    `pack` is read only.

    Args:
        pack: u8[size], 1-D, C-contiguous: the receive region's buffer (numpy for host layers;
            CuPy or a JAX GPU array for CuPy layers).
        layers: sequence of u8[num_rows_l, kv_item_len_l] arrays, writeable, all numpy or all
            CuPy, sharing one row index space.
        indices: int[n] destination rows (numpy, CuPy or a Python sequence), unique.
        offset: byte offset of the region inside `pack` (>= 0). Pallas backends ("triton",
            "interpret"): a multiple of the word size (`word_dtype(item_lens).itemsize`), the
            region ending within `addressable_words` (2**32 - 1 words of a pack over 4 GiB).
        backend: "auto" (numpy layers: "numpy"; CuPy: "triton", or "cupy" on a JAX without the
            Triton lowering), or one of `SCATTER_BACKENDS`. "triton" needs C-contiguous layers
            (written in place).
        threads: host form only: worker threads (as `pack_rows`).
        checked: device layers: skip the index range and uniqueness checks (the caller has
            done them once, e.g. for a page table it validated); the device form then never
            synchronises, and the kernel clamps unchecked indices in range (never out of
            bounds). Host layers are always checked (cheap there).
        config: Pallas tuning knobs (`GatherConfig.default()` when None).

    Returns:
        Rows unpacked (n, as `RowUnpacker.unpack`). Host: the bytes are in `layers` on return.
        Device: the copy is enqueued; call `synchronize(layers)` before another stream or
        process reads them.

    Raises:
        ValueError: empty or non-2-D `layers`, a layer of 0-byte rows, a read-only layer, non-1-D
            `indices` or `pack`, an index < 0 or >= num_rows, a duplicate index, a negative `offset`, a region past
            the end of `pack`, `pack` sharing memory with a layer, a bad `threads`/`backend`,
            a Pallas-path offset off the word size or past the addressable words, a
            "triton" layer that is not C-contiguous.
        TypeError: non-uint8 arrays, mixed numpy/CuPy, a JAX array as a layer (immutable),
            non-integer `indices`.
    """
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError("layers must be a non-empty list of 2-D uint8 arrays")
    kind, item_lens, num_rows = _once("layers", layers, lambda: _check_layer_list(
        layers, "layers", writeable=True))
    on_device = kind == "device"
    pk = _kind(pack)
    if pk is None or (pk == "numpy") == on_device:
        want = "CuPy or JAX GPU" if on_device else "numpy"
        raise TypeError(f"pack must be a {want} uint8 array like the layers, got {type(pack).__name__}")
    if pack.ndim != 1 or pack.dtype != np.uint8:
        raise ValueError(f"pack must be a 1-D uint8 array, got {pack.dtype}{list(pack.shape)}")
    if pk != "jax" and not pack.flags.c_contiguous:
        raise ValueError("pack must be C-contiguous")
    offset = check_offset(offset)
    check_threads(threads)
    check_bool(checked, "checked")
    backend = _resolve(backend, on_device)
    idx = check_indices(indices, "indices", device_ok=on_device)
    n = int(idx.shape[0])
    size = int(pack.size)
    total = check_fits(offset, n, item_lens, size)
    if backend in ("triton", "interpret"):
        check_pallas_region(offset, total, item_lens, size, backend, pack)
    if pk != "jax":
        _once("unpack-disjoint", [pack, *layers],
              lambda: _check_disjoint([pack], "pack", layers, "layers"))
    _once("layers-distinct", layers, lambda: _check_no_overlap(layers, "layers"), host=True)
    if n == 0:
        return 0
    if not checked or not on_device:  # host checks are cheap; they also keep numpy's -1 out
        check_range(idx, "indices", num_rows, "layers", unique=True)
    if backend == "numpy":
        unpack_host(pack, layers, idx, offset, item_lens, threads)
    elif backend == "cupy":
        unpack_cupy(pack, layers, idx, offset, item_lens)
    else:
        unpack_pallas(pack, layers, idx, offset, item_lens, backend, config)
    return n


def copy_rows(src_layers, src_indices, dst_layers, dst_indices, *, backend: str = "auto",
              threads: int | None = None, checked: bool = False,
              config: GatherConfig | None = None) -> int:
    """Copy rows between two sets of KV layers: `dst_layers[l][dst_indices[j]] =
    src_layers[l][src_indices[j]]` for every layer entry l and j < n, in place.

    Args:
        src_layers: sequence of u8[num_rows_src_l, kv_item_len_l] arrays (numpy or CuPy).
        src_indices: int[n] source rows, any order, repeats allowed.
        dst_layers: sequence of u8[num_rows_dst_l, kv_item_len_l] arrays of the same kind and
            item lengths as `src_layers`, writeable; on the GPU possibly CuPy arrays over
            foreign memory (`cupy.cuda.UnownedMemory`, e.g. IPC-mapped pages of another
            process), written in place.
        dst_indices: int[n] destination rows, unique.
        backend: as `unpack_rows` ("triton": one kernel for all layer entries).
        threads: host form only: worker threads (as `pack_rows`).
        checked: device layers: skip the index range/uniqueness checks (the device form then
            never synchronises; the kernel clamps indices in range). Host layers are always
            checked.
        config: Pallas tuning knobs (`GatherConfig.default()` when None).

    Returns:
        Rows copied (n, as `RowCopier.copy`). Host: the bytes are in `dst_layers` on return.
        Device: the copy is enqueued;
        `synchronize(dst_layers)` waits until they are there (do so before telling another
        process the rows have landed).

    Raises:
        ValueError: empty or non-2-D layer lists, a layer of 0-byte rows, a layer count or item_len
            mismatch between `src_layers` and `dst_layers`, a read-only destination, index lists of different
            lengths or not 1-D, an index out of range, a duplicate destination index, a
            destination sharing memory with a source or with another destination layer, a bad
            `threads`/`backend`, a "triton" destination that is not C-contiguous.
        TypeError: non-uint8 arrays, numpy mixed with CuPy, a JAX array as a destination,
            non-integer indices.
    """
    for name, lst in (("src_layers", src_layers), ("dst_layers", dst_layers)):
        if not isinstance(lst, (list, tuple)) or not lst:
            raise ValueError(f"{name} must be a non-empty list of 2-D uint8 arrays")
    skind, s_lens, s_rows = _once("src_layers", src_layers, lambda: _check_layer_list(
        src_layers, "src_layers", writeable=False))
    dkind, d_lens, d_rows = _once("dst_layers", dst_layers, lambda: _check_layer_list(
        dst_layers, "dst_layers", writeable=True))
    if skind != dkind:
        raise TypeError("src_layers and dst_layers must both be numpy (host) or both CuPy (device)")
    on_device = skind == "device"
    if any(_is_jax(a) for a in src_layers):
        raise TypeError("src_layers must be numpy or CuPy arrays (got a JAX array)")
    check_item_lens_match(s_lens, d_lens)
    check_threads(threads)
    check_bool(checked, "checked")
    backend = _resolve(backend, on_device)
    sidx = check_indices(src_indices, "src_indices", device_ok=on_device)
    didx = check_indices(dst_indices, "dst_indices", device_ok=on_device)
    if sidx.shape[0] != didx.shape[0]:
        raise ValueError(f"src_indices ({sidx.shape[0]}) and dst_indices ({didx.shape[0]}) must "
                         "have the same length")
    _once("copy-disjoint", [*src_layers, *dst_layers],
          lambda: _check_disjoint(list(src_layers), "src_layers", dst_layers, "dst_layers"))
    _once("dst-distinct", dst_layers, lambda: _check_no_overlap(dst_layers, "dst_layers"),
          host=True)
    if sidx.shape[0] == 0:
        return 0
    if not checked or not on_device:  # host checks are cheap; they also keep numpy's -1 out
        check_range(sidx, "src_indices", s_rows, "src_layers", unique=False)
        check_range(didx, "dst_indices", d_rows, "dst_layers", unique=True)
    if backend == "numpy":
        copy_host(list(src_layers), sidx, list(dst_layers), didx, s_lens, threads)
    elif backend == "cupy":
        copy_cupy(src_layers, sidx, dst_layers, didx)
    else:
        copy_pallas(list(src_layers), sidx, list(dst_layers), didx, s_lens, backend, config)
    return int(sidx.shape[0])


def synchronize(arrays=None) -> None:
    """Wait until every copy enqueued by this module on these arrays' devices has finished.

    Args:
        arrays: a sequence of arrays (or one array) the copies wrote: numpy (no-op), CuPy or
            JAX. None: every device of this process.

    Returns:
        None, once the bytes are in device memory (visible to other streams and processes).

    Raises:
        TypeError: an element of `arrays` that is not a numpy, CuPy or JAX array (named by index).
    """
    if arrays is not None and not isinstance(arrays, (list, tuple)):
        arrays = [arrays]
    kinds = [_kind(a) for a in arrays] if arrays is not None else ["cupy"]
    for k, kind in enumerate(kinds):
        if kind is None:
            raise TypeError(f"arrays[{k}] must be a numpy, CuPy or JAX array, got {type(arrays[k]).__name__}")
    if set(kinds) <= {"numpy"}:
        return
    try:
        import cupy as cp
    except ImportError:  # no CuPy: nothing of this module ran on a CUDA stream; JAX's own wait serves
        if arrays is None:
            return
        for a in arrays:
            if _is_jax(a):
                a.block_until_ready()
        return

    from pallas_kernels import triton_launch

    triton_launch.synchronize()  # fan-outs launched without JAX, on its streams
    devices = {a.device.id for a in arrays if _is_cupy(a)} if arrays is not None else None
    for dev in devices if devices is not None else range(cp.cuda.runtime.getDeviceCount()):
        with cp.cuda.Device(dev):
            cp.cuda.runtime.deviceSynchronize()
    for a in arrays or ():
        if _is_jax(a):
            a.block_until_ready()


__all__ = ["SCATTER_BACKENDS", "copy_rows", "synchronize", "unpack_rows"]
