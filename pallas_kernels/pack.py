"""Host contract of the pack gather: `pack_rows` into a registered pack buffer (spec section 6).

`pack_rows(layers, indices, pack, offset=...)` writes one rank's region of the registered pack:
entry l goes to bytes `[offset + off_l, offset + off_l + n * item_len_l)`, off_l =
sum_{k<l} n * item_len_k. numpy buffers are gathered on the host (`np.take` straight into the
pack, no compile); CuPy buffers by the jitted Pallas kernel of `pallas_kernels.gather`, through
DLPack, in place.

Rules for a long-running caller (a KV connector serving many requests):

- No recompiles per call: the word the kernel moves depends on the row lengths alone
  (`word_dtype`), the region offset and the row count are traced values, and the indices are
  padded to `bucket_rows(n)`. One kernel per row bucket, layer geometry, config and backend
  for 16-byte-aligned offsets (the kernel that keeps 16-byte stores), plus one more per bucket
  for offsets that are word- but not 16-byte-aligned (slower: 58 % of the speed for the
  61-layer list form on an H200). `compile_count()` counts kernel traces.
- Alignment (Pallas paths: interpret, triton, mosaic): `offset` must be a multiple of the word
  size (`word_dtype(item_lens).itemsize`: 4 bytes for 1152 B or 576 B rows), and the region's
  end must stay within `addressable_words(pack words)` (2**32 - 1 words of a pack over 4 GiB:
  addresses are uint32, so packs past 2**31 words are written exactly); mosaic needs 16 bytes
  and ends within 2**31 - 1 words. The connector's arena
  aligns regions to 64 bytes. The numpy host path takes any byte offset.
- Memory: nothing here keeps a caller's KV arrays alive. The per-call checks and DLPack imports
  of a layer list are cached under weak references to its arrays, evicted when any of them
  dies; or the caller holds a `PackSource`, which owns both and releases them with itself.

`PackSource`, the layers' DLPack word views and `kernel_sources` live in
`pallas_kernels.pack_source`; every name stays importable from this module.
"""

from __future__ import annotations

import operator
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import device, triton_launch
from pallas_kernels.config import (
    BACKENDS,
    GatherConfig,
    bucket_rows,
    select_backend,
    word_dtype,
)
from pallas_kernels._args import offset_arg
from pallas_kernels._buffer_args import _check_disjoint as check_disjoint
from pallas_kernels._buffer_args import (check_bool, check_fits, check_indices, check_layers, check_offset, check_range,
                                         check_word_offset, is_cupy)
# The names these checks had here (tests and `pallas_kernels.gather` import them from `pack`).
from pallas_kernels._buffer_args import check_word_offset as _check_word_offset  # noqa: F401
from pallas_kernels._buffer_args import is_cupy as _is_cupy  # noqa: F401
from pallas_kernels.gather import _gather_rows_jit, _gather_rows_slot_jit, gather_rows
from pallas_kernels.mapped_ring import fill_padded, stage_indices
# `PackSource` and the layers' DLPack views (names re-exported; `_pack_rows_device` reads
# `kernel_sources` here, so a wrapper set on this module's name is the one called).
from pallas_kernels.pack_source import PackSource, _copy_view, _device_views, kernel_sources  # noqa: F401
from pallas_kernels.row_copy import preload_lowering
from pallas_kernels.triton_plans import clear_plans, pack_rows_direct
from pallas_kernels.host import (  # noqa: F401  (re-exported: tests and callers use these names)
    _HOST_POOL,
    HOST_MAX_THREADS,
    HOST_MAX_THREADS_ARG,
    HOST_THREADS_MIN_BYTES,
    check_threads,
    pack_host as _pack_rows_host,
)
from pallas_kernels.host import host_pool as _host_pool  # noqa: F401

# A region offset that is a multiple of this many bytes runs the kernel compiled for that
# alignment (`gather_rows(offset_align=ALIGN_HINT_BYTES // word size)`), which keeps 16-byte
# stores; any other word-aligned offset runs a second kernel, `offset_align=1`.
ALIGN_HINT_BYTES = 16

_CHECKED_LAYERS: dict[tuple, "_CheckedLayers"] = {}  # (on_device, layer ids) -> checks
_IMPORTED_LAYERS: dict[tuple, tuple] = {}  # (on_device, layer ids) -> (token, JAX views)
_MAX_CACHED_LAYERS = 64
# The entry `_checked` returned last: a serving loop passes the same layer list every call, and
# found here its key is not rebuilt. That key takes one `id()` per layer, and `id()` is an audit
# event (CPython 3.12): with an audit hook installed (filelock's, which JAX's import brings) 61
# layers cost ~17 us per call instead of ~3 here and ~21 instead of ~2 on the H200 host (2026-12-04).
_LAST_CHECKED: list = [None]  # [(on_device, key, _CheckedLayers)]


class _CheckedLayers:
    """A cached layer check: weak references to the layers, never the layers themselves."""

    __slots__ = ("refs", "token", "item_lens", "num_rows", "word", "disjoint")

    def __init__(self, item_lens, num_rows):
        self.refs, self.token = (), object()
        self.disjoint: set = set()
        self.item_lens, self.num_rows = item_lens, num_rows
        self.word = word_dtype(item_lens)


def _evict(key, token, _ref=None) -> None:
    """Weakref callback: a layer of `key` died; forget its entries (if still this token's)."""
    entry = _CHECKED_LAYERS.get(key)
    if entry is not None and entry.token is token:
        _CHECKED_LAYERS.pop(key, None)
    last = _LAST_CHECKED[0]
    if last is not None and last[2].token is token:
        _LAST_CHECKED[0] = None
    imported = _IMPORTED_LAYERS.get(key)
    if imported is not None and imported[0] is token:
        _IMPORTED_LAYERS.pop(key, None)


def _checked(layers, on_device: bool):
    """(key or None, _CheckedLayers) for a layer list, from the weak cache or checked now.

    The key is None when a layer cannot be weakly referenced (nothing is cached then). A
    cached entry is used only if its weak references still give these very objects, so a
    recycled id can never pick up a stale entry (the callbacks evict it first anyway).
    """
    last = _LAST_CHECKED[0]
    if last is not None and last[0] == on_device and _same_layers(last[2], layers):
        return last[1], last[2]
    key = (on_device, tuple(map(id, layers)))
    entry = _CHECKED_LAYERS.get(key)
    if entry is not None and _same_layers(entry, layers):
        _LAST_CHECKED[0] = (on_device, key, entry)
        return key, entry
    entry = _CheckedLayers(*check_layers(layers, on_device, "pack"))
    try:
        callback = lambda ref, key=key, token=entry.token: _evict(key, token, ref)  # noqa: E731
        entry.refs = tuple(weakref.ref(a, callback) for a in layers)
    except TypeError:  # not weakly referenceable: check on every call
        return None, entry
    if len(_CHECKED_LAYERS) >= _MAX_CACHED_LAYERS:
        clear_import_cache()
    _CHECKED_LAYERS[key] = entry
    _LAST_CHECKED[0] = (on_device, key, entry)
    return key, entry


def _same_layers(entry, layers) -> bool:
    """Whether a cached entry's weak references still give these very layer objects."""
    refs = entry.refs
    return len(refs) == len(layers) and all(map(operator.is_, [r() for r in refs], layers))


def _cached_device_views(layers, key, entry) -> list:
    """Non-owning JAX views of a layer list, cached under its weak entry."""
    imported = _IMPORTED_LAYERS.get(key) if key is not None else None
    if imported is not None and imported[0] is entry.token:
        return imported[1]
    views = _device_views(layers, entry.word, owning=False)
    if key is not None and _CHECKED_LAYERS.get(key) is entry:
        _IMPORTED_LAYERS[key] = (entry.token, views)
    return views


def pack_rows(layers, indices, pack, *, offset: int = 0, backend: str = "auto",
              config: GatherConfig | None = None, threads: int | None = None,
              sync: bool = True) -> int:
    """Gather rows of every KV layer buffer into the registered pack buffer, in place.

    Layer-major (spec section 6): entry l goes to bytes
    `[offset + off_l, offset + off_l + n * item_len_l)`, `off_l = sum_{k<l} n * item_len_k`,
    row j of it being `layers[l][indices[j]]`. No other byte of `pack` changes.

    numpy (host memory): `np.take(..., out=view)` straight into the pack (one copy, no
    temporaries), split over worker threads by (layer, row range): `np.take` releases the GIL,
    and every thread writes its own disjoint slice of the region. CuPy (device memory): each
    layer is viewed as words and imported by DLPack (zero-copy, cached), the pack is imported
    afresh (the donated handle is consumed) and the jitted Pallas kernel writes into the CuPy
    memory; with `sync` (the default) the call returns once the bytes are there, without it
    once the kernel is enqueued (then `pallas_kernels.synchronize(pack)` before an engine reads
    the pack: back-to-back packs of several ranks then overlap their host work with the
    kernels). The offset and row count are traced: after one call per row bucket
    (`bucket_rows(n, config.block_rows)`) nothing recompiles.

    Fixed cost per device call (no synchronisation but the final one): host indices are checked
    on the host and written into a pinned slot the call copies to the device itself
    (`pallas_kernels.mapped_ring`; where the GPU cannot read such a slot, uploaded into a device
    slot of `pallas_kernels.device.IndexRing`: PJRT's own transfer of a numpy argument waits for
    the kernel in flight); the layers' views and the pack's JAX handle are made once per registration (the
    pack's handle is threaded from each call's aliased output to the next). CuPy indices are
    checked on the device, with one synchronisation.

    Args:
        layers: a `PackSource`, or a sequence of u8[num_rows_l, kv_item_len_l] arrays (numpy
            or CuPy, all of the pack's kind) sharing one row index space. A list's checks and
            imports are cached under weak references to its arrays (pass the same array
            objects each call); a `PackSource` holds them itself.
        indices: int[n] source rows (numpy, CuPy or a Python sequence).
        pack: u8[size] (numpy or CuPy), C-contiguous: the registered pack buffer.
        offset: byte offset of this rank's region inside `pack`. Pallas backends: a multiple
            of the word size (`word_dtype(item_lens).itemsize`; 16 bytes for "mosaic"), with
            the region ending within `addressable_words(len(pack) // word size)` words
            (2**32 - 1 for a pack over 4 GiB; mosaic 2**31 - 1). "numpy": any byte offset.
        backend: "auto" (numpy: "numpy"; CuPy: see `select_backend`), "numpy", "interpret",
            "triton" or "mosaic".
        config: kernel tuning (`GatherConfig.default()` when None).
        threads: host gather only: worker threads, 1..`HOST_MAX_THREADS_ARG`. None: one per
            core, at most `HOST_MAX_THREADS`, for regions of at least `HOST_THREADS_MIN_BYTES`;
            else one. The process keeps one pool, grown to the largest count asked for.
        sync: CuPy buffers only: wait until the kernel has finished before returning.

    Returns:
        Bytes written, `n * sum(kv_item_len)`.

    Raises:
        ValueError: bad ndim, empty `layers`, a `pack` that is not 1-D uint8 or shares memory
            with a layer, negative or out-of-range `indices`, a negative, misaligned or too
            large `offset`, `threads` < 1, a region that would extend past the end of `pack`,
            or a device pack whose address is not word-aligned.
        TypeError: non-uint8 layers, mixed numpy/CuPy, a `pack` that is neither a numpy nor a
            CuPy array, a `config` that is not a `GatherConfig`, non-integer `indices`, or a
            `sync` that is not a bool.
        RuntimeError: the device kernel did not write in place (a copy was made).
    """
    source, key, entry, layers, on_device = _resolve(layers, pack, config)
    item_lens, num_rows = entry.item_lens, entry.num_rows
    offset = check_offset(offset)
    check_threads(threads)
    check_bool(sync, "sync")
    idx = check_indices(indices, "indices", device_ok=on_device)
    n = int(idx.shape[0])
    total = check_fits(offset, n, item_lens, pack.nbytes)
    if backend not in ("numpy",) + BACKENDS:  # select_backend's message would omit "numpy"
        raise ValueError(f"{backend=} must be one of {('numpy',) + BACKENDS}")
    if backend == "auto":
        backend = "numpy" if not on_device else select_backend("auto")
    if backend != "numpy":
        check_word_offset(offset, total, entry.word, item_lens, pack if on_device else None,
                          pack.nbytes, backend)
    if n == 0:
        return 0
    check_range(idx, "indices", num_rows)
    if backend == "numpy":
        if on_device:
            raise ValueError("backend='numpy' needs numpy (host) buffers")
        _pack_rows_host(layers, idx, pack, offset, item_lens, threads)
        return total
    config = GatherConfig.default() if config is None else config
    if on_device:
        views = source.device_views() if source is not None else \
            _cached_device_views(layers, key, entry)
        # What a direct launch's plan is kept under: the PackSource (weakly), or the layer list's
        # check token (an object() that dies with the cache entry; holds no buffer).
        owner = weakref.ref(source) if source is not None else entry.token
        _pack_rows_device(layers, views, idx, pack, offset, entry.word, backend, config, sync, owner)
    else:
        _pack_rows_host_pallas(layers, idx, pack, offset, entry.word, backend, config)
    return total


def warm_pack_rows(layers, pack, max_rows: int, *, config: GatherConfig | None = None) -> list[int]:
    """Compiles `pack_rows`' launch without JAX's dispatch (CuPy buffers, host indices,
    `triton_launch`) for the index bucket of `max_rows` rows into `pack`, writing nothing (one
    launch whose metadata masks every row). Triton compiles a bucket in ~3-7 s on a GPU host,
    the first time on that machine (its on-disk cache serves later processes): a serving loop
    calls this before its first request so no request pays it.

    Args:
        layers: as `pack_rows` (a `PackSource`, or the same layer list each call).
        pack: the CuPy pack buffer later calls write.
        max_rows: the row count whose bucket (`bucket_rows(max_rows, config.block_rows)`) to
            compile (an int >= 1; more rows than `pack` holds count as that many); calls of
            other buckets compile theirs on first use.
        config: as `pack_rows`.

    Returns:
        [bucket] once compiled; [] where nothing launches this way (numpy buffers, a backend
        other than "triton", direct launches off, a layer copied per call).

    Raises:
        ValueError, TypeError: as `pack_rows` for `layers`, `pack`, `config`; `max_rows` not an
            int >= 1.
    """
    source, key, entry, layers, on_device = _resolve(layers, pack, config)
    if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)) or max_rows < 1:
        raise ValueError(f"max_rows={max_rows!r} must be an int >= 1")
    if not on_device or select_backend("auto") != "triton" or not triton_launch.enabled("triton", "gather"):
        return []
    config = GatherConfig.default() if config is None else config
    views = source.device_views() if source is not None else _cached_device_views(layers, key, entry)
    owner = weakref.ref(source) if source is not None else entry.token
    word = entry.word
    fits = int(pack.nbytes) // sum(entry.item_lens)  # no call packs more rows than that
    if fits < 1:
        return []
    m = bucket_rows(min(int(max_rows), fits), config.block_rows)
    dests = device.destinations([pack], word, [pack.nbytes // word.itemsize * word.itemsize])
    with dests.lock:  # n = 0 and ok = 0: every row masked, nothing written
        done = pack_rows_direct(owner, views, kernel_sources(layers, views, word), dests, np.zeros(0, np.int64), m,
                                (0, 0, 0), _offset_align(0, word), config, True)
    return [m] if done else []


def _resolve(layers, pack, config):
    """pack_rows' checks of everything but the indices and offset: (source or None, cache key,
    checked entry, the layer tuple, whether the buffers are CuPy)."""
    source = layers if isinstance(layers, PackSource) else None
    if source is None and (not isinstance(layers, (list, tuple)) or not layers):
        raise ValueError("layers must be a non-empty list of 2-D uint8 arrays")
    if not (isinstance(pack, np.ndarray) or is_cupy(pack)):
        raise TypeError(f"pack must be a numpy or CuPy uint8 array (the registered buffer), got "
                        f"{type(pack).__name__}")
    if config is not None and not isinstance(config, GatherConfig):
        raise TypeError(f"config must be a GatherConfig or None, got {type(config).__name__}")
    on_device = is_cupy(pack)
    if source is not None:
        if source.on_device != on_device:
            raise TypeError("layers (a PackSource) and pack must both be numpy or both CuPy")
        key, entry, layers = None, source, source.layers
    else:
        key, entry = _checked(layers, on_device)
    if pack.ndim != 1 or pack.dtype != np.uint8:
        raise ValueError(f"pack must be a 1-D uint8 array, got {pack.dtype}{list(pack.shape)}")
    if not pack.flags.c_contiguous:
        raise ValueError("pack must be C-contiguous")
    if not on_device and not pack.flags.writeable:
        raise ValueError("pack must be writeable (a registered buffer, not a read-only view)")
    _check_pack_disjoint(entry, layers, pack)
    return source, key, entry, layers, on_device


def _check_pack_disjoint(entry, layers, pack) -> None:
    """The pack must not share memory with a layer (the gather would read bytes it already
    overwrote, in an order threads and kernels do not keep). Checked once per pack memory range
    for a checked layer list or a `PackSource`: the layers they hold cannot move."""
    span = (device.address(pack), int(pack.nbytes))
    if span in entry.disjoint:
        return
    check_disjoint(list(layers), "layers", [pack], "pack")
    if len(entry.disjoint) >= 64:
        entry.disjoint.clear()
    entry.disjoint.add(span)


def _offset_align(offset: int, word: np.dtype) -> int:
    """`gather_rows`' static offset_align: words of `ALIGN_HINT_BYTES` if the offset has them."""
    if offset % ALIGN_HINT_BYTES == 0:
        return max(1, ALIGN_HINT_BYTES // word.itemsize)
    return 1


def _pack_rows_host_pallas(layers, idx, pack, offset, word, backend, config):
    """numpy buffers through the Pallas kernel (interpret on CPU): result copied back once.

    The pack is viewed as words up to its last whole word (the region lies inside it, being
    word-aligned), so its shape, and the kernel, do not depend on the offset.
    """
    ws = word.itemsize
    n = idx.shape[0]
    m = bucket_rows(n, config.block_rows)
    idx_pad = np.zeros(m, np.int32)
    idx_pad[:n] = idx
    # A word view needs rows contiguous in their last axis: copy strided layers once first.
    srcs = [jnp.asarray(np.ascontiguousarray(a).view(word)) for a in layers]
    words = pack[:pack.nbytes // ws * ws].view(word)
    out = gather_rows(srcs, jnp.asarray(idx_pad), jnp.asarray(words), n, offset=offset // ws,
                      config=config, backend=backend, offset_align=_offset_align(offset, word))
    total = n * sum(int(a.shape[1]) for a in layers)
    pack[offset:offset + total] = np.asarray(out).view(np.uint8)[offset:offset + total]


def _pack_rows_device(layers, views, idx, pack, offset, word, backend, config, sync, owner):
    """CuPy buffers through the jitted kernel, written into the CuPy pack in place."""
    ws = word.itemsize
    srcs = kernel_sources(layers, views, word)
    n = int(idx.shape[0])
    m = bucket_rows(n, config.block_rows)
    nbytes = pack.nbytes // ws * ws
    dests = device.destinations([pack], word, [nbytes])
    align = _offset_align(offset, word)
    with dests.lock:
        try:
            if isinstance(idx, np.ndarray):
                units, ok = offset_arg(offset // ws, align, backend, ws)
                if triton_launch.enabled(backend, "gather") and pack_rows_direct(
                        owner, views, srcs, dests, idx, m, (n, int(units), int(ok)), align, config, sync):
                    return
                triton_launch.after_direct([dests])
                # Host indices: staged in a device slot (no PJRT transfer, no wait on the
                # kernel in flight), the jitted kernel called with its persistent views.
                slot, staged = stage_indices(dests, m, 1, 3, fill_padded([idx], (n, int(units), int(ok))),
                                             backend)
                preload_lowering(backend)
                static = dict(config=config, backend=backend, offset_align=align)
                if staged is None:  # a mapped slot: no upload, read by the call
                    out = _gather_rows_slot_jit(srcs, slot, dests.handles[0], m=m, **static)
                else:
                    (idx_v,), meta_v = staged
                    out = _gather_rows_jit(srcs, idx_v, dests.handles[0], meta_v, **static)
            else:
                import cupy as cp

                triton_launch.after_direct([dests])
                idx_cp = cp.zeros(m, cp.int32)
                idx_cp[:n] = idx
                out = gather_rows(srcs, jax.dlpack.from_dlpack(idx_cp), dests.handles[0], n,
                                  offset=offset // ws, config=config, backend=backend,
                                  offset_align=align)
            dests.keep([out])
        except Exception:
            device.forget([pack], word, [nbytes])  # the donated handle may be gone
            raise
    if sync:
        out.block_until_ready()


def clear_import_cache() -> None:
    """Forget the cached layer checks and DLPack views of layer lists (`PackSource`s keep
    theirs), the JAX handles kept over destination buffers and the direct launches' plans
    (`triton_plans.clear_plans`). The caches hold no buffer alive; this only drops the
    bookkeeping early."""
    clear_plans()
    _IMPORTED_LAYERS.clear()
    _CHECKED_LAYERS.clear()
    _LAST_CHECKED[0] = None
    device.clear()


__all__ = [
    "ALIGN_HINT_BYTES",
    "HOST_MAX_THREADS",
    "HOST_MAX_THREADS_ARG",
    "HOST_THREADS_MIN_BYTES",
    "PackSource",
    "clear_import_cache",
    "pack_rows",
    "warm_pack_rows",
]
