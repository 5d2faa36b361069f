"""Host contract of the windowed gather: `pack_windows`, every window of a round in one call.

The same bytes as `pack_rows` once per window, in place, with the checks, index staging and
kernel dispatch paid once: numpy buffers are gathered on the host (one thread-pool run over all
windows), CuPy buffers by ONE launch of the windowed Pallas kernel (`pallas_kernels.windows`),
without JAX's dispatch where it can (`triton_launch`, kind "windows", off unless
``DCP_JAX_DIRECT_ON=windows``).
"""

from __future__ import annotations

import weakref

import numpy as np

from pallas_kernels import device, triton_launch
from pallas_kernels.config import BACKENDS, GatherConfig, bucket_rows, buckets_up_to, select_backend
from pallas_kernels.host import _region_units, _run_units, check_threads, host_threads
from pallas_kernels._buffer_args import check_bool, check_indices, check_range, check_word_offset
from pallas_kernels.pack import (
    _cached_device_views,
    _offset_align,
    _resolve,
    kernel_sources,
    pack_rows,
)
from pallas_kernels.row_copy import preload_lowering
from pallas_kernels.triton_plans import pack_windows_direct
from pallas_kernels.mapped_ring import fill_padded, stage_indices
from pallas_kernels.windows import _check_offsets, _gather_windows_jit, _gather_windows_slot_jit, gather_windows, \
    window_blocks

__all__ = ["pack_windows", "warm_pack_windows", "warm_pack_windows_direct"]


def pack_windows(layers, windows, pack, *, backend: str = "auto",
                 config: GatherConfig | None = None, threads: int | None = None,
                 sync: bool = True) -> int:
    """`pack_rows(layers, indices_w, pack, offset=offset_w)` for every window w, in one call.

    Window w's region is bytes `[offset_w, offset_w + n_w * sum(kv_item_len))` of `pack`,
    layer-major as in `pack_rows`; the result is byte-identical to calling `pack_rows` per
    window, and no byte outside the regions changes. CuPy buffers: one launch of the windowed
    kernel for all windows (one index staging, one dispatch); with `sync` the call returns once
    the bytes are there, else once the kernel is enqueued (`pallas_kernels.synchronize(pack)`
    before an engine reads them). numpy buffers: `np.take` into the pack, all windows' (layer,
    row range) units dealt to one thread-pool run. Backend "mosaic" has no windowed kernel: it
    packs window by window (`pack_rows`).

    Args:
        layers: a `PackSource` or a sequence of u8[num_rows_l, kv_item_len_l] arrays, as
            `pack_rows`.
        windows: non-empty sequence of (indices, offset) pairs: int[n_w] source rows (numpy,
            CuPy or a sequence) and the byte offset of the window's region. Empty windows
            (n_w = 0) write nothing.
        pack: u8[size] (numpy or CuPy), C-contiguous: the registered pack buffer.
        backend, config, threads, sync: as `pack_rows` (offsets obey its alignment rules).

    Returns:
        Bytes written, `sum_w n_w * sum(kv_item_len)`.

    Raises:
        ValueError: `windows` empty or not (indices, offset) pairs; a window's indices not 1-D
            or out of range, its offset negative or misaligned, its region past the end of
            `pack` (each names `windows[w]`); two regions that overlap (naming both); and
            the errors of `pack_rows` for `layers`, `pack`, `backend`, `threads`.
        TypeError: non-integer indices (naming `windows[w]`), and as `pack_rows`.
        RuntimeError: the device kernel did not write in place.
    """
    source, key, entry, layers, on_device = _resolve(layers, pack, config)
    item_lens, num_rows, word = entry.item_lens, entry.num_rows, entry.word
    check_threads(threads)
    check_bool(sync, "sync")
    if backend not in ("numpy",) + BACKENDS:
        raise ValueError(f"{backend=} must be one of {('numpy',) + BACKENDS}")
    if backend == "auto":
        backend = "numpy" if not on_device else select_backend("auto")
    if backend == "numpy" and on_device:
        raise ValueError("backend='numpy' needs numpy (host) buffers")
    wins = _check_windows(windows, on_device, sum(item_lens), num_rows, pack.nbytes)
    for w, (idx, off) in enumerate(wins):
        if backend != "numpy" and len(idx):
            try:
                check_word_offset(off, len(idx) * sum(item_lens), word, item_lens,
                                  pack if on_device else None, pack.nbytes, backend)
            except ValueError as exc:
                raise ValueError(f"windows[{w}]: {exc}") from None
    total = sum(len(idx) for idx, _ in wins) * sum(item_lens)
    live = [(idx, off) for idx, off in wins if len(idx)]
    if not live:
        return 0
    if backend == "numpy":
        _host_windows(layers, live, pack, item_lens, threads)
        return total
    config = GatherConfig.default() if config is None else config
    if backend == "mosaic":
        for idx, off in live:
            pack_rows(source or layers, idx, pack, offset=off, backend=backend, config=config,
                      sync=False)
        if sync:
            _sync_pack(pack)
        return total
    align = min(_offset_align(off, word) for _, off in live)
    ws = word.itemsize
    units = _check_offsets([off // ws for _, off in live], align, backend, ws)
    starts, blocks, m = window_blocks([len(i) for i, _ in live], units, config.block_rows)
    if on_device:
        views = source.device_views() if source is not None else \
            _cached_device_views(layers, key, entry)
        srcs = kernel_sources(layers, views, word)
        if all(isinstance(i, np.ndarray) for i, _ in live):
            padded = _padded_indices(live, starts, m)
        else:
            import cupy as cp

            padded = _padded_indices(live, starts, m, cp)
        owner = weakref.ref(source) if source is not None else entry.token
        _device_windows(srcs, padded, blocks, m, pack, word, backend, config, align, sync, owner, views)
    else:
        _interpret_windows(layers, live, starts, blocks, m, pack, word, backend, config, align)
    return total


def warm_pack_windows(layers, pack, max_rows: int, *, backend: str = "auto",
                      config: GatherConfig | None = None, offset: int = 0) -> list[int]:
    """Compiles the windowed pack kernel `pack_windows` launches for this source and pack, for
    every index bucket up to `bucket_rows(max_rows)`, writing nothing: each launch's block
    table marks every row block empty. A serving loop calls it before its first request: a
    round whose windows first reach a bucket otherwise compiles it then (~0.5 s on an H200).

    Args:
        layers: as `pack_windows` (a `PackSource` or a list of layers).
        pack: the pack buffer `pack_windows` will write (numpy or CuPy).
        max_rows: the most index rows one call will have (>= 1): the sum over its windows of
            each window's rows rounded up to `config.block_rows`. More than a call can have
            (`block_rows` per row the pack holds: windows of one row each) is clamped to that.
        backend: as `pack_windows`: "auto" (numpy: the host gather, nothing to compile; CuPy:
            `select_backend`), "interpret" or "triton".
        config: as `pack_windows`.
        offset: a byte offset its windows will use: the kernel compiled depends on the
            offsets' 16-byte alignment (`ALIGN_HINT_BYTES`), not on their values; the
            connector's regions are 64-byte aligned (0 stands for them).

    Returns:
        The index buckets compiled or found compiled (row counts, ascending); [] where
        `pack_windows` compiles nothing (numpy buffers on the host gather, "mosaic", which packs
        window by window through `pack_rows`, or a pack too small for one row).

    Raises:
        ValueError, TypeError: as `pack_windows` for `layers`, `pack`, `config`; `max_rows`
            not an int >= 1; `offset` negative or not a multiple of the word size.
    """
    source, key, entry, layers, on_device = _warm_args(layers, pack, config, max_rows, offset)
    if backend not in ("numpy",) + BACKENDS:
        raise ValueError(f"{backend=} must be one of {('numpy',) + BACKENDS}")
    if backend == "auto":
        backend = "numpy" if not on_device else select_backend("auto")
    if backend in ("numpy", "mosaic"):
        return []
    config = GatherConfig.default() if config is None else config
    br, word = config.block_rows, entry.word
    max_rows = _launch_rows(pack, entry, max_rows, br)
    if not max_rows:
        return []  # no window fits: pack_windows never launches here
    align = _offset_align(int(offset), word)
    if on_device:
        views = source.device_views() if source is not None else _cached_device_views(layers, key, entry)
        srcs = kernel_sources(layers, views, word)
        owner = weakref.ref(source) if source is not None else entry.token
    else:
        import jax.numpy as jnp

        srcs = [jnp.asarray(np.ascontiguousarray(a).view(word)) for a in layers]
        words = jnp.asarray(pack[:pack.nbytes // word.itemsize * word.itemsize].view(word))
    out = buckets_up_to(max_rows, br)
    for m in out:
        empty = np.zeros(4 * (m // br), np.int32)  # ok = 0 in every block: no store
        if on_device:
            _device_windows(srcs, np.zeros(m, np.int32), empty, m, pack, word, backend, config, align,
                            False, owner, views)
        else:  # the interpreter's result is dropped: the pack is not touched at all
            words = gather_windows(srcs, jnp.zeros(m, jnp.int32), words, jnp.asarray(empty),
                                   config=config, backend=backend, offset_align=align)  # donated
    if on_device:
        _sync_pack(pack)
    return out


def warm_pack_windows_direct(layers, pack, max_rows: int, *, config: GatherConfig | None = None,
                             offset: int = 0) -> list[int]:
    """Compiles `pack_windows`' windowed kernel for its launch without JAX's dispatch
    (`pallas_kernels.triton_launch`) for the ONE index bucket of `max_rows` rows, writing
    nothing. `pack_windows` launches a call that way only where its bucket is compiled (a
    Triton compile takes seconds: ~3-7 s a shape, H100), else through JAX (`warm_pack_windows`).
    The kind is off unless ``DCP_JAX_DIRECT_ON=windows`` (`triton_launch.DEFAULT_OFF`: not yet
    measured faster than a direct launch a window); off, this compiles nothing and returns [].
    A sender compiles the bucket of its rounds: one launch then packs a round's windows (a
    direct launch costs ~0.2 ms of host time on an H200, 2026-12-07, so eight windows launched
    one by one cost 1.6 ms, more than their 1.1 ms of kernels).

    Args:
        layers, pack, config, offset: as `warm_pack_windows`.
        max_rows: the index rows of the launches to come (>= 1): the sum over a call's windows
            of each window's rows rounded up to `config.block_rows`; clamped to what the pack
            holds, as `warm_pack_windows`.

    Returns:
        [the bucket compiled], or [] where no direct launch applies (host buffers, a backend
        other than "triton", direct launches off or failed, a layer copied per call, a pack
        too small for one row).

    Raises:
        ValueError, TypeError: as `warm_pack_windows`.
    """
    source, key, entry, layers, on_device = _warm_args(layers, pack, config, max_rows, offset)
    if not on_device or select_backend("auto") != "triton" or not triton_launch.enabled("triton", "windows"):
        return []
    config = GatherConfig.default() if config is None else config
    br, word = config.block_rows, entry.word
    rows = _launch_rows(pack, entry, max_rows, br)
    if not rows:
        return []
    m = bucket_rows(rows, br)
    views = source.device_views() if source is not None else _cached_device_views(layers, key, entry)
    srcs = kernel_sources(layers, views, word)
    owner = weakref.ref(source) if source is not None else entry.token
    nbytes = pack.nbytes // word.itemsize * word.itemsize
    dests = device.destinations([pack], word, [nbytes])
    with dests.lock:  # ok = 0 in every block: nothing written
        done = pack_windows_direct(owner, views, srcs, dests, np.zeros(m, np.int32), np.zeros(4 * (m // br), np.int32),
                                   _offset_align(int(offset), word), config, True, True)
    return [m] if done else []


def _launch_rows(pack, entry, max_rows, block_rows) -> int:
    """`max_rows` clamped to the index rows one launch into `pack` can have: one-row windows,
    each taking a whole row block, as many as the pack holds rows. 0: no row fits."""
    fits = pack.nbytes // sum(entry.item_lens)
    return min(int(max_rows), fits * block_rows)


def _warm_args(layers, pack, config, max_rows, offset):
    """The warm-ups' checks: `_resolve`'s, then `max_rows` and `offset`."""
    source, key, entry, layers, on_device = _resolve(layers, pack, config)
    if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)) or max_rows < 1:
        raise ValueError(f"max_rows={max_rows!r} must be an int >= 1")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0 \
            or offset % entry.word.itemsize:
        raise ValueError(f"offset={offset!r} must be a non-negative multiple of "
                         f"{entry.word.itemsize} bytes")
    return source, key, entry, layers, on_device


def _check_windows(windows, on_device, row_bytes, num_rows, pack_bytes):
    """[(indices, offset)] checked: shapes, bounds, regions inside the pack, no overlap."""
    if not isinstance(windows, (list, tuple)) or not windows:
        raise ValueError("windows must be a non-empty list of (indices, offset) pairs")
    out = []
    for w, win in enumerate(windows):
        if not isinstance(win, (list, tuple)) or len(win) != 2:
            raise ValueError(f"windows[{w}] must be an (indices, offset) pair, got {win!r:.80}")
        indices, off = win
        if isinstance(off, bool) or not isinstance(off, (int, np.integer)) or off < 0:
            raise ValueError(f"windows[{w}] offset={off!r} must be a non-negative int (bytes)")
        idx = check_indices(indices, f"windows[{w}] indices", device_ok=on_device)
        off, n = int(off), int(idx.shape[0])
        if off + n * row_bytes > pack_bytes:
            raise ValueError(f"windows[{w}] region overflow: offset={off} + {n} rows x "
                             f"{row_bytes} B = {off + n * row_bytes} B > pack of {pack_bytes} B")
        check_range(idx, f"windows[{w}] indices", num_rows)
        out.append((idx, off))
    spans = sorted((off, off + len(idx) * row_bytes, w) for w, (idx, off) in enumerate(out)
                   if len(idx))
    for (a0, a1, wa), (b0, b1, wb) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"windows[{wa}] bytes [{a0}, {a1}) and windows[{wb}] bytes "
                             f"[{b0}, {b1}) overlap")
    return out


def _host_windows(layers, live, pack, item_lens, threads) -> None:
    """numpy: every window's (layer, row range) units in one pool run (as `pack_host`)."""
    row_bytes = sum(item_lens)
    workers = host_threads(threads, sum(len(i) for i, _ in live) * row_bytes)
    units = []
    for idx, off in live:
        units += [(a, r0, r1, w, start, idx) for a, r0, r1, w, start in
                  _region_units(layers, item_lens, len(idx), workers, off)[1]]

    def take(batch):
        for a, r0, r1, w, start, idx in batch:
            np.take(a, idx[r0:r1], axis=0,
                    out=pack[start:start + (r1 - r0) * w].reshape(r1 - r0, w), mode="clip")

    _run_units(units, take, workers)


def _padded_indices(live, starts, m, xp=np):
    out = xp.zeros(m, xp.int32)
    for (idx, _), s in zip(live, starts):
        out[int(s):int(s) + len(idx)] = idx
    return out


def _interpret_windows(layers, live, starts, blocks, m, pack, word, backend, config, align):
    """numpy buffers through the windowed kernel (interpret on CPU); regions copied back."""
    import jax.numpy as jnp

    ws = word.itemsize
    srcs = [jnp.asarray(np.ascontiguousarray(a).view(word)) for a in layers]
    words = pack[:pack.nbytes // ws * ws].view(word)
    out = gather_windows(srcs, jnp.asarray(_padded_indices(live, starts, m)), jnp.asarray(words),
                         jnp.asarray(blocks), config=config, backend=backend, offset_align=align)
    res = np.asarray(out).view(np.uint8)
    row_bytes = sum(int(a.shape[1]) for a in layers)
    for idx, off in live:
        end = off + len(idx) * row_bytes
        pack[off:end] = res[off:end]


def _device_windows(srcs, padded, blocks, m, pack, word, backend, config, align, sync, owner, views):
    """CuPy buffers: one staged index slot (`padded`: i32[m], numpy or CuPy), one windowed
    kernel into the pack in place: launched directly (`triton_plans.pack_windows_direct`) for
    host indices where its kernel is compiled (`warm_pack_windows_direct`), else through JAX.
    ``owner``, ``views``: the source's, as `pack_rows` passes them."""
    ws = word.itemsize
    nbytes = pack.nbytes // ws * ws
    dests = device.destinations([pack], word, [nbytes])
    with dests.lock:
        try:
            slot = None
            if isinstance(padded, np.ndarray) and triton_launch.enabled(backend, "windows") and \
                    pack_windows_direct(owner, views, srcs, dests, padded, blocks, align, config, sync, False):
                return
            triton_launch.after_direct([dests])  # the JAX launch lands after a direct one
            if isinstance(padded, np.ndarray):
                slot, staged = stage_indices(dests, m, 1, len(blocks), fill_padded([padded], blocks), backend)
                if staged is not None:
                    (idx_v,), meta_v = staged
            else:
                import cupy as cp
                import jax

                idx_v = jax.dlpack.from_dlpack(padded)
                meta_v = jax.dlpack.from_dlpack(cp.asarray(blocks))
            preload_lowering(backend)
            static = dict(config=config, backend=backend, offset_align=align)
            if slot is not None:  # a mapped slot: no upload, read by the call
                out = _gather_windows_slot_jit(srcs, slot, dests.handles[0], m=m, table_len=len(blocks), **static)
            else:
                out = _gather_windows_jit(srcs, idx_v, dests.handles[0], meta_v, **static)
            dests.keep([out])
        except Exception:
            device.forget([pack], word, [nbytes])  # the donated handle may be gone
            raise
    if sync:
        out.block_until_ready()


def _sync_pack(pack) -> None:
    from pallas_kernels.unpack import synchronize

    synchronize([pack])
