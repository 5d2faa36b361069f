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

from pallas_kernels.mapped_ring import claim_slot, fill_padded, fill_slot, slot_layout

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


def address(a) -> int:
    """Address of a numpy or CuPy array's first byte."""
    return int(a.ctypes.data) if isinstance(a, np.ndarray) else int(a.data.ptr)


def one_buffer(arrays) -> bool:
    """True when C-contiguous `arrays` (numpy or CuPy) lie back to back in memory, each
    starting where the one before ends: then one flat buffer holds them all, and a kernel can
    take it as ONE argument (`scatter._unpack_flat_jit`) instead of one per array."""
    if len(arrays) < 2 or not all(a.flags.c_contiguous and a.size for a in arrays):
        return False
    addrs = [address(a) for a in arrays]
    return all(addrs[k + 1] == addrs[k] + arrays[k].nbytes for k in range(len(arrays) - 1))


#: Words one stacked view may hold: the kernels' per-layer offsets into it stay int32.
MAX_STACKED_WORDS = 2**31 - 1


def _stack_layout(arrays, word):
    """(R, W): rows and words per row of layers of one shape u8[R, W * word size] that lie back
    to back (`one_buffer`); None otherwise."""
    if not one_buffer(arrays):
        return None
    shape = tuple(arrays[0].shape)
    ws = np.dtype(word).itemsize
    if len(shape) != 2 or shape[1] % ws or any(tuple(a.shape) != shape for a in arrays):
        return None
    return shape[0], shape[1] // ws


def _stack_view(arrays, word, owner, rows: int, width: int):
    """The zero-copy JAX u-word[len(arrays), rows, width] view from `arrays[0]`'s address (None
    when the import would copy)."""
    import cupy as cp

    a0 = arrays[0]
    nbytes = len(arrays) * rows * width * np.dtype(word).itemsize
    mem = cp.cuda.UnownedMemory(a0.data.ptr, nbytes, owner, a0.device.id)
    view = jax.dlpack.from_dlpack(cp.ndarray((len(arrays), rows, width), word, cp.cuda.MemoryPointer(mem, 0)))
    return view if view.unsafe_buffer_pointer() == a0.data.ptr else None


def stacked_words(arrays, word, owner=None):
    """A zero-copy JAX u-word[L, R, W] view over CuPy sources of one shape u8[R, W * word
    size] that lie back to back (`one_buffer`: a layer-major KV cache): the kernels take it as
    ONE argument in place of L (measured on an H200: a 61-argument jitted dispatch costs ~60 us
    of host time more than a few-argument one). None when they do not, or when the view would
    pass 2**31 - 1 words (its layer offsets are then not provably int32-safe): the caller
    passes the layers one by one. `owner`: kept alive by the view (None: the view owns nothing).
    """
    lay = _stack_layout(arrays, word)
    if lay is None or len(arrays) * lay[0] * lay[1] > MAX_STACKED_WORDS:
        return None
    return _stack_view(arrays, word, owner, *lay)


def layer_groups(num_layers: int, layer_words: int, limit: int = MAX_STACKED_WORDS) -> list[tuple[int, int]]:
    """[(first layer, layers)] splitting `num_layers` layers of `layer_words` words each into
    consecutive groups of at most `limit` words, as even as they can be (61 layers of a 128k
    token DeepSeek-V3 cache: 2 groups of 31 and 30); [] when there are no layers or one layer
    alone passes `limit`.

    Raises:
        TypeError: an argument that is not an int (Python or numpy; bool refused).
        ValueError: `num_layers` < 0, `layer_words` < 1 or `limit` < 1.
    """
    for name, v, lo in (("num_layers", num_layers, 0), ("layer_words", layer_words, 1), ("limit", limit, 1)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < lo:
            raise ValueError(f"{name}={v} must be >= {lo}")
    num_layers, layer_words, limit = int(num_layers), int(layer_words), int(limit)
    per = limit // layer_words
    if per < 1 or num_layers < 1:
        return []
    g = -(-num_layers // per)
    base, extra = divmod(num_layers, g)
    out, first = [], 0
    for j in range(g):
        n = base + (j < extra)
        out.append((first, n))
        first += n
    return out


def stacked_groups(arrays, word, owner=None):
    """Zero-copy stacked views (`stacked_words`) of layers that lie back to back, split into
    consecutive groups of at most `MAX_STACKED_WORDS` words (`layer_groups`): a tuple of
    u-word[L_j, R, W] views, one when the whole stack fits; None where `stacked_words` would
    give None for another reason (not one buffer, shapes differ, a layer alone too large)."""
    lay = _stack_layout(arrays, word)
    groups = layer_groups(len(arrays), lay[0] * lay[1]) if lay is not None else []
    if not groups:
        return None
    views = tuple(_stack_view(arrays[f:f + n], word, owner, *lay) for f, n in groups)
    return None if any(v is None for v in views) else views


def _flat_words(arrays, word):
    """A zero-copy JAX u-word[total] view over CuPy `arrays` that lie back to back."""
    import cupy as cp

    a0, total = arrays[0], sum(int(a.nbytes) for a in arrays)
    mem = cp.cuda.UnownedMemory(a0.data.ptr, total, None, a0.device.id)
    words = cp.ndarray((total // np.dtype(word).itemsize,), word, cp.cuda.MemoryPointer(mem, 0))
    view = jax.dlpack.from_dlpack(words)
    return view if view.unsafe_buffer_pointer() == a0.data.ptr else None


def _remember(cache, key, arrays, value) -> None:
    # The lock is bound here: a callback run at interpreter exit finds the module's globals gone.
    def evict(_ref, key=key, value=value, lock=_LOCK):
        with lock:
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


def source_arg(arrays, word):
    """Cached non-owning source views for a copy kernel: ONE stacked u-word[L, R, W] view when
    the arrays lie back to back with one shape (`stacked_words`), else `source_views`' list."""
    key = ("stacked",) + _key(arrays, word)
    hit = _lookup(_SOURCES, key, arrays)
    if hit is None:
        hit = (stacked_words(arrays, word),)
        _remember(_SOURCES, key, arrays, hit)
    return hit[0] if hit[0] is not None else source_views(arrays, word)


class Destinations:
    """JAX handles over CuPy destination arrays, passed from each call's outputs to the next.

    Use `with dests.donate() as handles: outs = kernel(..., handles); dests.keep(outs)`; the
    lock makes concurrent callers on the same buffers take turns.
    """

    def __init__(self, arrays, word, nbytes=None, flat=False):
        self.ptrs = [int(a.data.ptr) for a in arrays]
        if flat:  # arrays lie back to back (`one_buffer`): one word array over all of them
            self.ptrs = self.ptrs[:1]
            span = _flat_words(arrays, word)
            if span is None:
                raise ValueError("destinations must be importable without a copy (the kernel "
                                 "writes into them in place)")
            arrays = ()
            self.handles = [span]
        handles = [] if not flat else self.handles
        for l, a in enumerate(arrays):
            h = _import(a, word, None if nbytes is None else nbytes[l])
            if h is None:
                raise ValueError(f"destination {l} must be C-contiguous and importable without a "
                                 "copy (the kernel writes into it in place)")
            handles.append(h)
        self.handles = handles
        self.verified = False
        self.lock = threading.Lock()
        # The CuPy stream the last fan-out into these went on when `triton_launch` launched it
        # (None: JAX's stream); a flag bump after it goes there.
        self.direct = None
        self.jax_last = False  # the last launch into these went through JAX (`keep`)
        self.calls = 0  # kernels enqueued on these destinations through an IndexRing
        self.done = 0  # of which known to have finished
        self.rings: dict = {}

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
        self.jax_last = True


def destinations(arrays, word, nbytes=None, flat=False) -> Destinations:
    """The cached `Destinations` of these CuPy arrays (made on first use); `flat`: one handle
    over arrays that lie back to back in memory (`one_buffer`)."""
    key = _key(arrays, word) + (None if nbytes is None else tuple(nbytes), flat)
    dests = _lookup(_DESTS, key, arrays)
    if dests is None or dests.handles is None:
        dests = Destinations(arrays, word, nbytes, flat)
        _remember(_DESTS, key, arrays, dests)
    return dests


def destinations_of(array) -> list[Destinations]:
    """Every cached `Destinations` that writes into `array` (by identity), whatever its word."""
    with _LOCK:
        entries = list(_DESTS.values())
    return [d for refs, d in entries if d.handles is not None and any(r() is array for r in refs)]


def forget(arrays, word, nbytes=None, flat=False) -> None:
    """Drop the cached destinations of `arrays` (after a failed call consumed the handles)."""
    key = _key(arrays, word) + (None if nbytes is None else tuple(nbytes), flat)
    with _LOCK:
        _DESTS.pop(key, None)


def clear() -> None:
    """Forget every cached view and destination handle."""
    with _LOCK:
        _SOURCES.clear()
        _DESTS.clear()




class IndexRing:
    """Device slots for a call's row indices and metadata, imported into JAX once.

    A host (numpy) index array passed to a jitted call is copied to the device by PJRT, which
    waits for the kernel in flight before it returns (measured on an H200: about 170 us per
    call, more than the per-rank kernel). Here each call writes its indices into the next of
    `slots` device buffers with one asynchronous copy from pinned memory on a CuPy stream of its
    own (waited for on the host: a few microseconds), and passes the slot's persistent JAX
    views. A slot is rewritten only after the kernel that last read it has finished: the
    destination's handle (every call on it runs in order on JAX's stream) is waited for once
    every `slots` calls, not per call.

    Layout of a slot: `k` index vectors of `m` int32 (m a power of 2, a multiple of 64 words,
    so every view is 256-byte aligned), then the int32 metadata (`meta_len` words).
    """

    def __init__(self, m: int, k: int, meta_len: int = 3, slots: int = 16):
        import cupy as cp

        self.m, self.k, self.slots = m, k, slots
        stride, size = slot_layout(m, k, meta_len)
        self.bufs = [cp.zeros(size, cp.int32) for _ in range(slots)]
        self.views = []
        for b in self.bufs:
            idx = [jax.dlpack.from_dlpack(b[j * stride:j * stride + m]) for j in range(k)]
            meta = jax.dlpack.from_dlpack(b[k * stride:k * stride + meta_len])
            self.views.append((idx, meta))
        mem = cp.cuda.alloc_pinned_memory(size * 4)
        self.host = np.frombuffer(mem, np.int32, size)
        self._pinned = mem
        self.stride, self.meta_len = stride, meta_len
        self.stream = cp.cuda.Stream(non_blocking=True)
        # Raw pointers for the upload: CuPy's `ndarray.set` checks and wraps on every call.
        self._ptrs = [int(b.data.ptr) for b in self.bufs]
        self._host_ptr, self._nbytes = int(self.host.ctypes.data), size * 4
        self.last_use = [-1] * slots
        self.next = 0

    def stage(self, vectors, meta, dests: "Destinations"):
        """Write `vectors` (k numpy int arrays, each <= m long, zero-padded) and `meta` into the
        next slot; returns its JAX views (list of k i32[m], i32[meta_len])."""
        return self.stage_with(fill_padded(vectors, meta), dests)

    def stage_with(self, fill, dests: "Destinations"):
        """As `stage`, the slot's pinned host words written by ``fill(segs, meta)`` in place
        (k i32[m] views and the i32[meta_len] view: no intermediate arrays; words it leaves
        keep older values)."""
        s = claim_slot(self, dests)  # waits, once per `slots` calls at most, for a slot still read
        fill_slot(fill, self.host, self)
        _upload(self._ptrs[s], self._host_ptr, self._nbytes, self.stream.ptr)
        return self.views[s]


def _upload(dst_ptr: int, host_ptr: int, nbytes: int, stream_ptr: int) -> None:
    """Copies `nbytes` of pinned host memory to the device on `stream_ptr` and waits for it."""
    import cupy as cp

    rt = cp.cuda.runtime
    rt.memcpyAsync(dst_ptr, host_ptr, nbytes, rt.memcpyHostToDevice, stream_ptr)
    rt.streamSynchronize(stream_ptr)


def index_ring(dests: "Destinations", m: int, k: int, meta_len: int = 3) -> IndexRing:
    """The `IndexRing` of a destination set for `k` index vectors of bucket `m` and
    `meta_len` metadata words (made once)."""
    rings = dests.rings
    ring = rings.get((m, k, meta_len))
    if ring is None:
        ring = rings[(m, k, meta_len)] = IndexRing(m, k, meta_len)
    return ring


__all__ = ["Destinations", "IndexRing", "MAX_STACKED_WORDS", "address", "clear", "destinations", "forget",
           "index_ring", "layer_groups", "one_buffer", "source_arg", "source_views",
           "stacked_groups", "stacked_words"]
