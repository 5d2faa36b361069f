"""Device and Pallas forms of `unpack_rows` / `copy_rows` (the host contract, with its checks,
is `pallas_kernels.unpack`; these run after them).

- "triton": the Pallas scatter kernels of `pallas_kernels.scatter`, in place into C-contiguous
  CuPy layers (also over IPC-mapped memory): sources by cached non-owning DLPack views,
  destinations by handles threaded through donation (`pallas_kernels.device`); returns once
  the kernel is enqueued on JAX's stream.
- "interpret": the same kernel bodies on numpy copies (CPU tests); the written rows are copied
  back.
- Layers that lie back to back in one buffer (`device.one_buffer`: a layer-major KV cache)
  are unpacked through ONE flat destination argument (`scatter._unpack_flat_jit`) instead of
  one donated argument and output per layer: the 61-output call cost ~1 ms of host time on an
  H200 (~144 us on a CPU, against ~8 us for one output).
  `copy_pallas` does the same for the copy kernel (`scatter._copy_flat_jit`): the fused
  connector path writes into a decode rank's IPC-mapped layer-major cache once per round.
- "cupy": CuPy fancy indexing, one gather/scatter per layer on CuPy's current stream (a
  reference form, and the fallback on a JAX without the Triton lowering).
"""

from __future__ import annotations

import jax
import numpy as np

from pallas_kernels import device
from pallas_kernels._args import offset_arg
from pallas_kernels.config import (
    MAX_PACK_WORDS,
    GatherConfig,
    addressable_words,
    bucket_rows,
    word_dtype,
)
from pallas_kernels._buffer_args import is_cupy as _is_cupy
from pallas_kernels.pack import _offset_align, kernel_sources


def _is_jax(a) -> bool:
    return type(a).__module__.split(".")[0] in ("jax", "jaxlib")


def check_pallas_region(offset, total, item_lens, size, backend, pack) -> None:
    """The Pallas paths' rules: word-aligned offset and address, region end addressable."""
    word = word_dtype(item_lens)
    ws = word.itemsize
    if offset % ws:
        raise ValueError(f"{offset=} must be a multiple of {ws} bytes on the Pallas paths: the "
                         f"word ({word.name}) of rows of {list(item_lens)} B")
    limit = addressable_words(size // ws, ws)
    if (offset + total) // ws > limit:
        raise ValueError(f"{offset=} + {total} B ends past word {limit} of {word.name}, the last "
                         f"one the kernel addresses in a pack of {size} B")
    if _is_cupy(pack) and pack.data.ptr % ws:
        raise ValueError(f"pack address {pack.data.ptr:#x} must be a multiple of {ws} bytes")


def _contiguous(layers, name) -> None:
    for l, a in enumerate(layers):
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}[{l}] must be C-contiguous for the device kernel (it writes "
                             "the rows in place); use backend='cupy' for strided layers")


def _padded(idx, m):
    """int32[m] indices padded with zeros: numpy stays numpy (copied to the device inside the
    jitted call), CuPy becomes a JAX view."""
    n = int(idx.shape[0])
    if isinstance(idx, np.ndarray):
        out = np.zeros(m, np.int32)  # a new array: its copy to the device may still be pending
        out[:n] = idx
        return out
    import cupy as cp

    out = cp.zeros(m, cp.int32)
    out[:n] = idx
    return jax.dlpack.from_dlpack(out)


def flat_layers(layers, word_size: int):
    """((rows, width in words) per layer) when the layers lie back to back in one buffer
    (`device.one_buffer`) small enough for uint32 word addresses; else None (one kernel
    argument and output per layer)."""
    if not device.one_buffer(layers):
        return None
    if sum(a.nbytes for a in layers) // word_size > MAX_PACK_WORDS:
        return None
    return tuple((int(a.shape[0]), int(a.shape[1]) // word_size) for a in layers)


def _joined(layers, word):
    """A copy of back-to-back host layers as one flat word array (the interpret backend's
    stand-in for the buffer they view)."""
    return np.concatenate([a.reshape(-1) for a in layers]).view(word)


def _write_back(layers, idx, flat_out) -> None:
    """Rows `idx` of each layer from the flat kernel output of `_joined(layers)`."""
    out, pos = np.asarray(flat_out).view(np.uint8), 0
    for a in layers:
        a[idx] = out[pos:pos + a.nbytes].reshape(a.shape)[idx]
        pos += a.nbytes


def unpack_pallas(pack, layers, idx, offset, item_lens, backend, config) -> None:
    """The scatter kernel: in place into CuPy layers ("triton"), or on numpy copies whose
    rows are written back ("interpret")."""
    from pallas_kernels.scatter import unpack_kernel

    config = GatherConfig.default() if config is None else config
    word = word_dtype(item_lens)
    ws = word.itemsize
    n = int(idx.shape[0])
    m = bucket_rows(n, config.block_rows)
    kw = dict(offset=offset // ws, config=config, backend=backend,
              offset_align=_offset_align(offset, word))
    flat = flat_layers(layers, ws)
    if backend == "interpret":
        words = np.ascontiguousarray(pack[:pack.size // ws * ws]).view(word)
        if flat is not None:  # the one-buffer form, on a copy of the buffer
            from pallas_kernels.scatter import _unpack_flat_jit

            units, ok = offset_arg(kw["offset"], kw["offset_align"], backend, ws)
            _write_back(layers, idx, _unpack_flat_jit(
                words, _padded(idx, m), _joined(layers, word), np.array((n, units, ok), np.int32),
                layers=flat, config=config, backend=backend, offset_align=kw["offset_align"]))
            return
        dst = [np.ascontiguousarray(a).view(word) for a in layers]
        outs = unpack_kernel(words, _padded(idx, m), dst, n, **kw)
        for a, o in zip(layers, outs):
            a[idx] = np.asarray(o).view(np.uint8)[idx]
        return
    import cupy as cp

    _contiguous(layers, "layers")
    if _is_jax(pack):
        pack = cp.from_dlpack(pack)
    src = device.source_views([pack], word)[0]
    if src is None:
        src = jax.dlpack.from_dlpack(cp.ascontiguousarray(pack[:pack.size // ws * ws]).view(word))
    dests = device.destinations(layers, word, flat=flat is not None)
    try:
        enqueue_unpack(src, idx, dests, flat, kw["offset"], kw["offset_align"], ws, config, backend)
    except Exception:
        device.forget(layers, word, flat=flat is not None)
        raise


def enqueue_unpack(src, idx, dests, flat, offset_words, offset_align, word_size, config, backend) -> None:
    """Enqueue one device unpack kernel: rows of the region at word `offset_words` of `src` (a
    JAX word view of the receive region) into rows `idx` (n, numpy or CuPy) of `dests`
    (`device.Destinations`, one flat handle when `flat`, the layers' ((rows, words)) per
    layer). Host indices go through the destinations' index ring (one staging copy). The
    caller forgets `dests` if this raises (the donated handles may be gone)."""
    from pallas_kernels.scatter import unpack_kernel

    n = int(idx.shape[0])
    m = bucket_rows(n, config.block_rows)
    with dests.lock:
        if isinstance(idx, np.ndarray) or flat is not None:
            from pallas_kernels.row_copy import preload_lowering
            from pallas_kernels.scatter import _unpack_flat_jit, _unpack_jit

            units, ok = offset_arg(offset_words, offset_align, backend, word_size)
            if isinstance(idx, np.ndarray):  # staged in a device slot (see pack_rows)
                (iv,), mv = device.index_ring(dests, m, 1).stage([idx], (n, int(units), int(ok)), dests)
            else:
                iv, mv = _padded(idx, m), np.array((n, units, ok), np.int32)
            preload_lowering(backend)
            if flat is not None:  # one donated buffer, one output (not one per layer)
                dests.keep([_unpack_flat_jit(src, iv, dests.handles[0], mv, layers=flat, config=config,
                                             backend=backend, offset_align=offset_align)])
            else:
                dests.keep(_unpack_jit(src, iv, tuple(dests.handles), mv, config=config, backend=backend,
                                       offset_align=offset_align))
        else:
            dests.keep(unpack_kernel(src, _padded(idx, m), dests.handles, n, offset=offset_words,
                                     config=config, backend=backend, offset_align=offset_align))


def copy_pallas(srcs, sidx, dsts, didx, item_lens, backend, config) -> None:
    """The copy kernel, one `pallas_call` for all layer entries (as `unpack_pallas`); into
    destination layers that lie back to back in one buffer (the fused connector path's
    IPC-mapped decode cache) through ONE flat donated destination (`scatter._copy_flat_jit`),
    from sources that lie back to back through ONE stacked view (`device.stacked_words`)."""
    from pallas_kernels.scatter import _copy_flat_jit, copy_kernel

    config = GatherConfig.default() if config is None else config
    word = word_dtype(item_lens)
    n = int(sidx.shape[0])
    m = bucket_rows(n, config.block_rows)
    flat = flat_layers(dsts, word.itemsize)
    if backend == "interpret":
        si, di = _padded(sidx, m), _padded(didx, m)
        src = [np.ascontiguousarray(a).view(word) for a in srcs]
        if flat is not None:  # the one-buffer form, on a copy of the buffer
            _write_back(dsts, didx, _copy_flat_jit(
                tuple(src), si, _joined(dsts, word), di, np.array((n, 0, 1), np.int32),
                layers=flat, config=config, backend=backend))
            return
        dst = [np.ascontiguousarray(a).view(word) for a in dsts]
        outs = copy_kernel(src, si, dst, di, n, config=config, backend=backend)
        for a, o in zip(dsts, outs):
            a[didx] = np.asarray(o).view(np.uint8)[didx]
        return
    _contiguous(dsts, "dst_layers")
    views = device.source_arg(srcs, word)
    dests = device.destinations(dsts, word, flat=flat is not None)
    try:
        enqueue_copy(copy_sources(srcs, views, word), sidx, dests, didx, flat, config, backend)
    except Exception:
        device.forget(dsts, word, flat=flat is not None)
        raise


def copy_sources(srcs, views, word):
    """The copy kernel's source argument from `device.source_arg`'s views: `pack.kernel_sources`
    (the stacked view, or per-layer views with a non-contiguous layer copied now) as the
    kernel takes it, a tuple for the per-layer form."""
    src = kernel_sources(srcs, views, word)
    return tuple(src) if isinstance(src, list) else src


def enqueue_copy(src, sidx, dests, didx, flat, config, backend) -> None:
    """Enqueue one device copy kernel: `src` (stacked view or tuple of views) rows `sidx` into
    rows `didx` of `dests` (`device.Destinations`, one flat handle when `flat`). Host indices
    go through the destinations' index ring (one staging copy, no PJRT transfer). The caller
    forgets `dests` if this raises (the donated handles may be gone)."""
    from pallas_kernels.row_copy import preload_lowering
    from pallas_kernels.scatter import _copy_flat_jit, _copy_jit, copy_kernel

    n = int(sidx.shape[0])
    m = bucket_rows(n, config.block_rows)
    with dests.lock:
        host_idx = isinstance(sidx, np.ndarray) and isinstance(didx, np.ndarray)
        if host_idx or flat is not None:
            if host_idx:  # staged in a device slot (see pack_rows)
                (sv, dv), mv = device.index_ring(dests, m, 2).stage([sidx, didx], (n, 0, 1), dests)
            else:
                sv, dv, mv = _padded(sidx, m), _padded(didx, m), np.array((n, 0, 1), np.int32)
            preload_lowering(backend)
            if flat is not None:  # one donated buffer, one output (not one per layer)
                dests.keep([_copy_flat_jit(src, sv, dests.handles[0], dv, mv, layers=flat,
                                           config=config, backend=backend)])
            else:
                dests.keep(_copy_jit(src, sv, tuple(dests.handles), dv, mv, config=config,
                                     backend=backend))
        else:
            dests.keep(copy_kernel(src, _padded(sidx, m), dests.handles, _padded(didx, m), n,
                                   config=config, backend=backend))


def unpack_cupy(pack, layers, idx, offset, item_lens) -> None:
    """CuPy fancy-index form (one scatter kernel per layer), on CuPy's current stream."""
    import cupy as cp

    if _is_jax(pack):
        pack = cp.from_dlpack(pack)
    idx = cp.asarray(idx)
    n, pos = int(idx.shape[0]), offset
    for a, w in zip(layers, item_lens):
        a[idx] = pack[pos:pos + n * w].reshape(n, w)
        pos += n * w


def copy_cupy(srcs, sidx, dsts, didx) -> None:
    import cupy as cp

    sidx, didx = cp.asarray(sidx), cp.asarray(didx)
    for s, d in zip(srcs, dsts):
        d[didx] = s[sidx]


__all__ = ["check_pallas_region", "copy_cupy", "copy_pallas", "copy_sources", "enqueue_copy",
           "enqueue_unpack", "unpack_cupy", "unpack_pallas"]
