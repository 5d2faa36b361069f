"""What each Pallas kernel's launch without JAX needs (`pallas_kernels.triton_launch`): a plan per
set of buffers, read once (a JAX pointer or device query costs tens of microseconds on a host
that has idled), and the kernel's pointer arguments in its ``pallas_call``'s order: operands,
then the aliased outputs again.

- `FanoutPlan`: `copy_fanout`'s kernel (`fanout_kernel._fanout_call`): table, source rows,
  destination rows, one stacked source group, D flat destinations; then the D destinations.
- `GatherPlan`: `pack_rows`' kernel (`gather._gather_rows_jit` on the Triton backend): meta
  (rows, offset units, ok), indices, the sources (one stacked view or one per layer), the pack;
  then the pack. And `pack_windows`' windowed kernel (`windows._gather_windows_jit`): the same,
  its meta the block table.
- `UnpackPlan`: `RowUnpacker`'s kernel into a layer-major cache (`scatter._unpack_flat_jit`):
  meta (rows, offset units, ok), destination rows, the receive region, the flat cache; then the
  cache.

Both stage their indices in one slot of `triton_launch.enqueue` laid out as `mapped_ring`'s
(`slot_layout`: index vectors on 256-byte lines, then the metadata).
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

from pallas_kernels import triton_launch
from pallas_kernels.mapped_ring import slot_layout

__all__ = ["FanoutPlan", "GatherPlan", "UnpackPlan", "clear_plans", "pack_rows_direct", "pack_windows_direct"]


def _fresh_jit(fn, **static):
    """``jax.jit`` of `fn` with its static arguments bound in a NEW callable: JAX caches a
    function's traces and lowerings by the callable, so the jitted entry point would not lower
    (and `triton_launch.capture_triton_modules` would capture nothing) for shapes it has lowered
    before (the JAX launch, another device)."""
    import functools

    import jax

    return jax.jit(functools.partial(fn, **static))


def _sds(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(tuple(int(x) for x in shape), dtype)


class FanoutPlan:
    """The fan-out of one set of copiers.

    Args:
        srcs: the stacked source groups (JAX u-word[L_j, R, W] views: pointer, shape, dtype read).
        dst_ptrs: the D flat destinations' device addresses; dst_words: their sizes in words.
        dst_rows: rows per destination layer; config: the copiers' `GatherConfig`.
    """

    __slots__ = ("src_ptrs", "src_shapes", "word", "first_layers", "dst_ptrs", "dst_words", "dst_rows",
                 "config", "device_id", "kernels")

    def __init__(self, srcs, dst_ptrs, dst_words, dst_rows, config):
        self.src_ptrs = [int(s.unsafe_buffer_pointer()) for s in srcs]
        self.src_shapes = [tuple(int(x) for x in s.shape) for s in srcs]
        self.word = np.dtype(srcs[0].dtype)
        self.first_layers = np.cumsum([0] + [sh[0] for sh in self.src_shapes[:-1]]).tolist()
        self.dst_ptrs, self.dst_words = [int(p) for p in dst_ptrs], tuple(int(w) for w in dst_words)
        self.dst_rows, self.config = tuple(dst_rows), config
        self.device_id = next(iter(srcs[0].devices())).id
        self.kernels: dict = {}  # (m, table_len) -> [(CompiledKernel, grid)] per group

    def _kernel(self, shape, first, m, table_len):
        from pallas_kernels.fanout_kernel import _fanout_call

        def trace():
            fn = _fresh_jit(_fanout_call, first_layer=first, dst_rows=self.dst_rows, config=self.config,
                            backend="triton")
            fn.trace(_sds(shape, self.word), _sds((m,), np.int32), tuple(_sds((w,), self.word) for w in self.dst_words),
                     _sds((m,), np.int32), _sds((table_len,), np.int32)).lower()

        key = ("fanout", shape, self.word, first, self.dst_rows, self.dst_words, m, table_len, self.config,
               self.device_id)
        return triton_launch.kernel_for(key, trace, "kv_copy_fanout", self.config, self.device_id)

    def launch(self, m: int, table_len: int, fill, on_phase=None):
        """Enqueues the fan-out, one launch per source group; ``fill((sv, dv), meta)`` writes
        the indices and the table (as for `mapped_ring.stage_indices`). Returns the stream."""
        kernels = self.kernels.get((m, table_len))
        if kernels is None:
            kernels = self.kernels[(m, table_len)] = [
                self._kernel(sh, f, m, table_len) for sh, f in zip(self.src_shapes, self.first_layers)]
        stride, size = slot_layout(m, 2, table_len)
        dst = self.dst_ptrs

        def fill_slot(host):
            fill((host[:m], host[stride:stride + m]), host[2 * stride:2 * stride + table_len])

        def launcher(kernel, grid, src):
            def launch(base, stream):
                kernel[grid](base + 8 * stride, base, base + 4 * stride, src, *dst, *dst, stream=stream)
            return launch

        return triton_launch.enqueue(self.device_id, size, fill_slot,
                                     [launcher(k, g, s) for (k, g), s in zip(kernels, self.src_ptrs)], on_phase)


def _enqueue_indexed(plan, idx: np.ndarray, m: int, meta, offset_align: int, ptrs: tuple):
    """One launch of a `GatherPlan` / `UnpackPlan` kernel for the bucket `m` (compiled on first
    use, kept in ``plan.kernels``): the host indices `idx` zero-padded to `m` and ``meta`` in one
    index slot, the kernel's arguments (meta, indices, then `ptrs`). Returns the stream."""
    got = plan.kernels.get((m, offset_align))
    if got is None:
        got = plan.kernels[(m, offset_align)] = plan._kernel(m, offset_align)
    kernel, grid = got
    stride, size = slot_layout(m, 1, 3)
    n = len(idx)

    def fill_slot(host):
        host[:n] = idx
        host[n:m] = 0
        host[stride:stride + 3] = meta

    def launch(base, stream):
        kernel[grid](base + 4 * stride, base, *ptrs, stream=stream)

    return triton_launch.enqueue(plan.device_id, size, fill_slot, [launch])


class GatherPlan:
    """`pack_rows` of one source form into one pack buffer.

    Args:
        srcs: what the kernel reads (`pack_source.kernel_sources`: one stacked JAX view, or one
            view per layer; pointers, shapes and dtype read); pack_ptr: the pack's device address;
        pack_words: its size in words (as the JAX path's handle); config: `GatherConfig`.
    """

    __slots__ = ("src_ptrs", "src_shapes", "word", "pack_ptr", "pack_words", "config", "device_id", "kernels")

    def __init__(self, srcs, pack_ptr, pack_words, config):
        srcs = srcs if isinstance(srcs, (list, tuple)) else [srcs]
        self.src_ptrs = [int(s.unsafe_buffer_pointer()) for s in srcs]
        self.src_shapes = [tuple(int(x) for x in s.shape) for s in srcs]
        self.word = np.dtype(srcs[0].dtype)
        self.pack_ptr, self.pack_words, self.config = int(pack_ptr), int(pack_words), config
        self.device_id = next(iter(srcs[0].devices())).id
        self.kernels: dict = {}  # (m, offset_align) -> (CompiledKernel, grid)

    def _kernel(self, m, offset_align):
        from pallas_kernels.gather import _gather_rows_jit

        one = len(self.src_shapes) == 1 and len(self.src_shapes[0]) == 3  # a stacked view

        def trace():
            srcs = _sds(self.src_shapes[0], self.word) if one else [_sds(s, self.word) for s in self.src_shapes]
            fn = _fresh_jit(_gather_rows_jit.__wrapped__, config=self.config, backend="triton",
                            offset_align=offset_align)
            fn.trace(srcs, _sds((m,), np.int32), _sds((self.pack_words,), self.word), _sds((3,), np.int32)).lower()

        key = ("gather", tuple(self.src_shapes), self.word, self.pack_words, m, offset_align, self.config,
               self.device_id)
        return triton_launch.kernel_for(key, trace, "kv_gather_", self.config, self.device_id)

    def launch(self, idx: np.ndarray, m: int, meta, offset_align: int):
        """Enqueues the gather of the host indices `idx` (int, n <= m; zero-padded to the bucket
        `m`) with ``meta = (n, offset units, ok)``. Returns the stream."""
        return _enqueue_indexed(self, idx, m, meta, offset_align, (*self.src_ptrs, self.pack_ptr, self.pack_ptr))

    def _windows_kernel(self, m, table_len, offset_align):
        from pallas_kernels.windows import _gather_windows_jit

        one = len(self.src_shapes) == 1 and len(self.src_shapes[0]) == 3

        def trace():
            srcs = _sds(self.src_shapes[0], self.word) if one else [_sds(s, self.word) for s in self.src_shapes]
            fn = _fresh_jit(_gather_windows_jit.__wrapped__, config=self.config, backend="triton",
                            offset_align=offset_align)
            fn.trace(srcs, _sds((m,), np.int32), _sds((self.pack_words,), self.word),
                     _sds((table_len,), np.int32)).lower()

        return triton_launch.kernel_for(self._windows_key(m, table_len, offset_align), trace, "kv_gather_windows",
                                        self.config, self.device_id)

    def has_windows(self, m: int, table_len: int, offset_align: int) -> bool:
        """Whether the windowed kernel of this bucket is compiled (here or for another plan of
        the same shapes): launching it costs no compile."""
        return ("windows", m, table_len, offset_align) in self.kernels or triton_launch.compiled(
            self._windows_key(m, table_len, offset_align))

    def _windows_key(self, m, table_len, offset_align):
        return ("gather_windows", tuple(self.src_shapes), self.word, self.pack_words, m, table_len, offset_align,
                self.config, self.device_id)

    def launch_windows(self, padded: np.ndarray, blocks: np.ndarray, offset_align: int):
        """Enqueues `pallas_kernels.pack_windows`' windowed kernel (compiled on first use):
        `padded` (i32[m], every window's rows from its start, `windows.window_blocks`) and its
        block table `blocks` (i32[4 * m // block_rows]) in one index slot. Returns the stream."""
        m, table_len = int(padded.shape[0]), int(blocks.shape[0])
        got = self.kernels.get(("windows", m, table_len, offset_align))
        if got is None:
            got = self.kernels[("windows", m, table_len, offset_align)] = self._windows_kernel(
                m, table_len, offset_align)
        kernel, grid = got
        stride, size = slot_layout(m, 1, table_len)
        ptrs = (*self.src_ptrs, self.pack_ptr, self.pack_ptr)

        def fill_slot(host):
            host[:m] = padded
            host[stride:stride + table_len] = blocks

        def launch(base, stream):
            kernel[grid](base + 4 * stride, base, *ptrs, stream=stream)

        return triton_launch.enqueue(self.device_id, size, fill_slot, [launch])


class UnpackPlan:
    """`RowUnpacker.unpack` of one receive region into one layer-major cache (one flat
    destination), without JAX's dispatch: the region path's decode rank pays it once per window
    (through JAX ~0.5-0.8 ms of host time a call in the 32k job on an H200, against a ~0.15 ms
    kernel; `docs/gpu_log.md`).

    Args:
        src: the region's JAX word view (`device.source_views`: pointer, size, dtype read);
        dst_ptr: the cache's device address; dst_words: its size in words; layers: the static
            (rows, width in words) of each layer (`unpack_device.flat_layers`); config:
            `GatherConfig`.
    """

    __slots__ = ("src_ptr", "src_words", "word", "dst_ptr", "dst_words", "layers", "config", "device_id",
                 "kernels")

    def __init__(self, src, dst_ptr, dst_words, layers, config):
        self.src_ptr, self.src_words = int(src.unsafe_buffer_pointer()), int(src.shape[0])
        self.word = np.dtype(src.dtype)
        self.dst_ptr, self.dst_words = int(dst_ptr), int(dst_words)
        self.layers, self.config = tuple(tuple(int(x) for x in l) for l in layers), config
        self.device_id = next(iter(src.devices())).id
        self.kernels: dict = {}  # (m, offset_align) -> (CompiledKernel, grid)

    def _kernel(self, m, offset_align):
        from pallas_kernels.scatter import _unpack_flat_jit

        def trace():
            fn = _fresh_jit(_unpack_flat_jit.__wrapped__, layers=self.layers, config=self.config, backend="triton",
                            offset_align=offset_align)
            fn.trace(_sds((self.src_words,), self.word), _sds((m,), np.int32), _sds((self.dst_words,), self.word),
                     _sds((3,), np.int32)).lower()

        key = ("unpack", self.src_words, self.word, self.dst_words, self.layers, m, offset_align, self.config,
               self.device_id)
        return triton_launch.kernel_for(key, trace, "kv_unpack_flat", self.config, self.device_id)

    def launch(self, idx: np.ndarray, m: int, meta, offset_align: int):
        """Enqueues the unpack into the host rows `idx` (int, n <= m; zero-padded to the bucket
        `m`, the padding masked by ``meta = (n, offset units, ok)``). Returns the stream."""
        return _enqueue_indexed(self, idx, m, meta, offset_align, (self.src_ptr, self.dst_ptr, self.dst_ptr))


_GATHER_PLANS: list = []  # (owner, weak ref to the pack's Destinations, config, GatherPlan), newest last
_GATHER_LOCK = threading.Lock()


def _same_owner(a, b) -> bool:
    if isinstance(a, weakref.ref) and isinstance(b, weakref.ref):
        return a() is not None and a() is b()
    return a is b


def pack_rows_direct(owner, views, srcs, dests, idx, m, meta, align, config, sync) -> bool:
    """`pack_rows` through `triton_launch` (the same kernel without JAX's dispatch; the pack's
    lock held; `pack._pack_rows_device`). Its `GatherPlan` (pointers and shapes only) is kept
    for the last 8 (owner, pack, config): `owner` is a weak reference to the `PackSource`, or
    the layer list's check token (`pack._CheckedLayers.token`), so no buffer is held alive.
    Only sources that are cached views apply (`views` itself, or a list of them without a
    per-call copy, whose addresses stay put). False where it does not apply (the JAX path
    serves) or cannot launch (then off for the process, with one warning)."""
    if isinstance(views, list) and any(v is None for v in views):
        return False  # a layer is copied per call: its address changes
    return _launch("gather", dests, sync, lambda: _gather_plan(owner, srcs, dests, config).launch(idx, m, meta, align))


def pack_windows_direct(owner, views, srcs, dests, padded, blocks, align, config, sync, compile) -> bool:
    """`pallas_kernels.pack_windows` of host indices through `triton_launch` (kind
    ``"windows"``; the pack's lock held; `pack_windows._device_windows`): ONE launch for every
    window of a round, where `pack_rows_direct` per window costs each its own host time (~0.2 ms
    a launch on an H200, more than its 0.14 ms kernel, 2026-12-07). The same `GatherPlan` as
    `pack_rows_direct` (owner, pack, config). Without `compile`, only a bucket whose kernel is
    compiled launches (`warm_pack_windows_direct`): a Triton compile takes seconds, the JAX
    launch's jitted kernel comes from JAX's caches. False where it does not apply or cannot
    launch (then off for the process, with one warning), as `pack_rows_direct`."""
    if isinstance(views, list) and any(v is None for v in views):
        return False
    try:
        plan = _gather_plan(owner, srcs, dests, config)
    except Exception as exc:  # noqa: BLE001 - as a failed launch: the JAX launch serves
        triton_launch.disable(f"{type(exc).__name__}: {exc}", "windows")
        return False
    if not compile and not plan.has_windows(int(padded.shape[0]), int(blocks.shape[0]), align):
        return False
    return _launch("windows", dests, sync, lambda: plan.launch_windows(padded, blocks, align))


def _gather_plan(owner, srcs, dests, config) -> GatherPlan:
    """The kept `GatherPlan` of (owner, pack, config), made if none is."""
    with _GATHER_LOCK:
        plan = next((p for o, ref, cfg, p in reversed(_GATHER_PLANS)
                     if ref() is dests and cfg == config and _same_owner(o, owner)), None)
        if plan is None:
            plan = GatherPlan(srcs, dests.ptrs[0], dests.handles[0].shape[0], config)
            del _GATHER_PLANS[:-7]
            _GATHER_PLANS.append((owner, weakref.ref(dests), config, plan))
    return plan


def _launch(kind, dests, sync, launch) -> bool:
    """One direct launch of `kind` (`triton_launch.launch_into`); waits for it with `sync`."""
    stream = triton_launch.launch_into(kind, [dests], launch)
    if stream is None:
        return False
    if sync:
        stream.synchronize()
    return True


def clear_plans() -> None:
    """Forgets every kept `GatherPlan` (`pack.clear_import_cache` calls it)."""
    with _GATHER_LOCK:
        _GATHER_PLANS.clear()
