"""CuPy buffers as JAX arrays for the row-copy kernels, without a fixed cost per call.

- **Sources** (KV layers read by `pack_rows` / `copy_rows`, receive regions read by
  `unpack_rows`) are imported by DLPack once, as views that own nothing
  (`cupy.cuda.UnownedMemory`), and cached under weak references to the CuPy arrays
  (`source_views`): the cache keeps no buffer alive and forgets an entry when any of its
  arrays dies.
- **Destinations** (the pack of `pack_rows`, the layers of `unpack_rows` / `copy_rows`, also
  CuPy arrays over IPC-mapped memory of another process) are donated to the kernel, whose
  outputs alias them. A donated handle is consumed, so the previous call's *output* (the same
  memory, pointer checked on the first call) is what the next call donates (`Destinations`):
  one DLPack import per registration, not per call.

Ordering: the kernels run on JAX's stream. CuPy work that produced a source (or a transfer
engine that wrote a receive region) must be complete before the call; the kernel's writes are
visible to other streams and processes after `pallas_kernels.synchronize` (or
`block_until_ready` on the call's result).
"""

from __future__ import annotations

import threading
import weakref

import jax
import numpy as np

_MAX_ENTRIES = 64
_SOURCES: dict[tuple, tuple] = {}  # key -> (refs, views)
_DESTS: dict[tuple, "Destinations"] = {}
_LOCK = threading.Lock()


def _key(arrays, word) -> tuple:
    return (np.dtype(word).str,) + tuple((id(a), int(a.data.ptr), int(a.nbytes)) for a in arrays)


def _unowned_words(a, word, nbytes=None):
    """A CuPy word view of `a`'s first `nbytes` bytes over memory it does not own."""
    import cupy as cp

    nbytes = a.nbytes if nbytes is None else nbytes
    mem = cp.cuda.UnownedMemory(a.data.ptr, nbytes, None, a.device.id)
    ws = np.dtype(word).itemsize
    shape = (nbytes // ws,) if a.ndim == 1 else (a.shape[0], a.shape[1] // ws)
    return cp.ndarray(shape, word, cp.cuda.MemoryPointer(mem, 0))


def _import(a, word, nbytes=None):
    """Zero-copy JAX view of C-contiguous CuPy `a` as words, or None if DLPack copied."""
    if not a.flags.c_contiguous or not a.size:
        return None
    view = jax.dlpack.from_dlpack(_unowned_words(a, word, nbytes))
    return view if view.unsafe_buffer_pointer() == a.data.ptr else None


def _remember(cache, key, arrays, value) -> None:
    def evict(_ref, key=key, value=value):
        with _LOCK:
            entry = cache.get(key)
            if entry is not None and (entry[1] if isinstance(entry, tuple) else entry) is value:
                cache.pop(key, None)

    try:
        refs = tuple(weakref.ref(a, evict) for a in arrays)
    except TypeError:  # not weakly referenceable: nothing cached
        return
    with _LOCK:
        if len(cache) >= _MAX_ENTRIES:
            cache.clear()
        cache[key] = (refs, value)


def _lookup(cache, key, arrays):
    with _LOCK:
        entry = cache.get(key)
    if entry is None:
        return None
    refs, value = entry
    if len(refs) != len(arrays) or any(r() is not a for r, a in zip(refs, arrays)):
        return None
    return value


def source_views(arrays, word) -> list:
    """Cached non-owning JAX word views of CuPy sources (None where a copy would be needed:
    the caller then copies per call, so the kernel reads the data as it is now)."""
    key = _key(arrays, word)
    views = _lookup(_SOURCES, key, arrays)
    if views is None:
        views = [_import(a, word) for a in arrays]
        _remember(_SOURCES, key, arrays, views)
    return views


class Destinations:
    """JAX handles over CuPy destination arrays, passed from each call's outputs to the next.

    Use `with dests.donate() as handles: outs = kernel(..., handles); dests.keep(outs)`; the
    lock makes concurrent callers on the same buffers take turns.
    """

    def __init__(self, arrays, word, nbytes=None):
        self.ptrs = [int(a.data.ptr) for a in arrays]
        handles = []
        for l, a in enumerate(arrays):
            h = _import(a, word, None if nbytes is None else nbytes[l])
            if h is None:
                raise ValueError(f"destination {l} must be C-contiguous and importable without a "
                                 "copy (the kernel writes into it in place)")
            handles.append(h)
        self.handles = handles
        self.verified = False
        self.lock = threading.Lock()

    def keep(self, outs) -> None:
        """Take the call's outputs as the next handles; on the first call, check that they are
        the destinations' memory (XLA did not copy)."""
        outs = list(outs)
        if not self.verified:
            bad = [l for l, (o, p) in enumerate(zip(outs, self.ptrs))
                   if o.unsafe_buffer_pointer() != p]
            if bad:
                self.handles = None
                raise RuntimeError(f"the kernel did not write destinations {bad} in place (XLA "
                                   "copied them); are they referenced elsewhere in JAX?")
            self.verified = True
        self.handles = outs


def destinations(arrays, word, nbytes=None) -> Destinations:
    """The cached `Destinations` of these CuPy arrays (made on first use)."""
    key = _key(arrays, word) + (None if nbytes is None else tuple(nbytes),)
    dests = _lookup(_DESTS, key, arrays)
    if dests is None or dests.handles is None:
        dests = Destinations(arrays, word, nbytes)
        _remember(_DESTS, key, arrays, dests)
    return dests


def forget(arrays, word, nbytes=None) -> None:
    """Drop the cached destinations of `arrays` (after a failed call consumed the handles)."""
    key = _key(arrays, word) + (None if nbytes is None else tuple(nbytes),)
    with _LOCK:
        _DESTS.pop(key, None)


def clear() -> None:
    """Forget every cached view and destination handle."""
    with _LOCK:
        _SOURCES.clear()
        _DESTS.clear()


__all__ = ["Destinations", "clear", "destinations", "forget", "source_views"]
