"""The fused fan-out's Pallas kernel, launched without JAX's dispatch (Triton's own launcher).

Why: the fused path's whole request at 32,768 tokens is one ~1.1-1.6 ms kernel (H200 / H100)
plus the host time before it is enqueued. Through JAX, `copy_fanout` cost 850 us of host time
after the sender idled 0.3 s (495 us back to back), most of it the jitted dispatch; the SAME
kernel launched here cost 256 us cold (38 us back to back), indices staged included, and the
kernel ended 590 us sooner (`benchmarks/gpu/direct_launch_probe.py`, H100, 2026-12-05).

How: JAX lowers the fan-out's ``pallas_call`` as it would for XLA (`fanout_kernel._fanout_jit`,
traced on shapes only), and the Triton module its Triton lowering builds
(``lower_jaxpr_to_triton_module``, what JAX hands XLA as the custom call's IR) is captured and
compiled by the ``triton`` package (the one torch brings; compiled once per shape, then from
Triton's cache) for the device's compute capability. A launch stages the indices into a pinned
slot, copies them to a device slot and launches the kernel on this module's CuPy stream, with raw
device pointers in the ``pallas_call``'s argument order: its operands (table, source rows,
destination rows, source, the destinations) then its outputs (the destinations again: aliased).
Completion: `synchronize` or the stream (`stream_for`), on which a flag bump may follow
(`bridge.host_flag.SharedFlag.bump_on_stream`).

Ordering: the kernel runs on this module's stream, not JAX's, so the source's rows must be
written before `copy_fanout` is called (as for the JAX launch of CuPy sources); each index slot is
rewritten only after the launch that last read it has finished (an event per slot).

Used by `pallas_kernels.fanout` when `enabled()`: a CUDA GPU, the ``triton`` package, and
``DCP_JAX_DIRECT_LAUNCH`` not "0". Anything that fails here (capture, compile, first launch) turns
it off for the process with one warning, and the JAX launch serves.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import warnings

import numpy as np

__all__ = ["FanoutPlan", "capture_triton_modules", "compile_module", "enabled", "launch_fanout",
           "stream_for", "synchronize", "disable"]

logger = logging.getLogger(__name__)

_LOCK = threading.RLock()
_STATE = {"off": os.environ.get("DCP_JAX_DIRECT_LAUNCH", "1") == "0", "why": ""}
_KERNELS: dict = {}   # compile key -> (CompiledKernel, grid)
_STREAMS: dict = {}   # device id -> cupy Stream
_SLOTS: dict = {}     # device id -> _SlotRing
_SLOTS_PER_DEVICE = 4


def enabled(backend: str) -> bool:
    """Whether `copy_fanout` launches its kernel here: `backend` "triton" (a CUDA GPU), the
    ``triton`` package importable, not turned off (``DCP_JAX_DIRECT_LAUNCH=0`` or `disable`)."""
    if _STATE["off"] or backend != "triton":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        disable("the triton package is not installed")
        return False
    return True


def disable(why: str) -> None:
    """Turns direct launches off for this process (the JAX launch serves); logs `why` once."""
    with _LOCK:
        if not _STATE["off"]:
            logger.warning("fan-out: launching through JAX from now on (%s)", why)
        _STATE["off"], _STATE["why"] = True, why


@contextlib.contextmanager
def capture_triton_modules():
    """Within the block, every Pallas Triton lowering's module is appended to the yielded list
    as (MLIR text of the Triton module, grid tuple). Patches JAX's private
    ``jax._src.pallas.triton.pallas_call_registration.lowering.lower_jaxpr_to_triton_module``
    (jax 0.11) and restores it after; other threads' lowerings in the block are captured too."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    got: list = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = orig(*args, **kwargs)
        got.append((result.module.operation.get_asm(), tuple(int(g) for g in result.grid)))
        return result

    with _LOCK:
        reg.lowering.lower_jaxpr_to_triton_module = capture
        try:
            yield got
        finally:
            reg.lowering.lower_jaxpr_to_triton_module = orig


def compile_module(text: str, *, num_warps: int, num_stages: int, target=None):
    """Compiles a captured Triton module (MLIR text) with the ``triton`` package.

    Args:
        text: the module (`capture_triton_modules`).
        num_warps, num_stages: as the ``pallas_call``'s Triton compiler parameters.
        target: a ``triton.backends.compiler.GPUTarget``; None: the current CuPy device's
            (``cuda``, its compute capability, warp size 32).

    Returns:
        The ``triton.compiler.CompiledKernel`` (its ``asm`` holds the PTX and cubin).
    """
    import triton
    from triton.backends.compiler import GPUTarget

    if target is None:
        import cupy as cp

        target = GPUTarget("cuda", int(cp.cuda.Device().compute_capability), 32)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")  # IRSource picks the parser by the suffix
        with open(path, "w") as f:
            f.write(text)
        return triton.compile(path, target=target, options=dict(num_warps=num_warps, num_stages=num_stages))


def _fanout_kernel(src_shape, word, first_layer, dst_rows, dst_words, m, table_len, config, device_id):
    """(CompiledKernel, grid) of the fan-out for these static shapes, loaded on `device_id`
    (compiled once per process; Triton's own cache keeps the binary across processes)."""
    key = (src_shape, word, first_layer, dst_rows, dst_words, m, table_len, config, device_id)
    hit = _KERNELS.get(key)
    if hit is not None:
        return hit
    with _LOCK:
        if key in _KERNELS:
            return _KERNELS[key]
        import jax

        from pallas_kernels.fanout_kernel import _fanout_jit

        sds = jax.ShapeDtypeStruct
        with capture_triton_modules() as got, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Pallas' Triton lowering (0.11)
            _fanout_jit.trace(sds(src_shape, word), sds((m,), np.int32),
                              tuple(sds((w,), word) for w in dst_words), sds((m,), np.int32),
                              sds((table_len,), np.int32), first_layer=first_layer, dst_rows=dst_rows,
                              config=config, backend="triton").lower()
        mods = [g for g in got if "kv_copy_fanout" in g[0]]
        if len(mods) != 1:
            raise RuntimeError(f"expected one fan-out Triton module at lowering, captured {len(mods)}")
        text, grid = mods[0]
        import cupy as cp
        import torch  # Triton's CUDA driver asks torch for the current device when it loads a kernel
        from triton.backends.compiler import GPUTarget

        cc = int(cp.cuda.Device(device_id).compute_capability)
        kernel = compile_module(text, num_warps=config.num_warps, num_stages=config.num_stages,
                                target=GPUTarget("cuda", cc, 32))
        with torch.cuda.device(device_id):
            kernel._init_handles()  # loads the binary on this device (a later launch only reuses it)
        _KERNELS[key] = (kernel, (grid + (1, 1))[:3])
        return _KERNELS[key]


class _SlotRing:
    """Index slots of one device: pinned host words, a device copy, the event of the launch that
    last read it (a slot is rewritten only once that launch ended)."""

    def __init__(self):
        self.slots: list = [None] * _SLOTS_PER_DEVICE
        self.next = 0
        # True once `synchronize` saw every launch end and none came since: a claim then skips
        # its event wait (a driver call that costs tens of microseconds on a host that idled).
        self.clean = True
        # Held from a slot's claim to its event's record: launches of two sources (each under its
        # own ring lock in `fanout`) on one device never share a slot.
        self.lock = threading.Lock()

    def claim(self, size: int):
        import cupy as cp

        k = self.next
        self.next = (k + 1) % len(self.slots)
        slot = self.slots[k]
        if slot is not None and not self.clean:
            slot[2].synchronize()  # the launch that last read it has run
        self.clean = False
        if slot is None or slot[0].size < size:
            mem = cp.cuda.alloc_pinned_memory(size * 4)
            slot = (np.frombuffer(mem, np.int32, size), cp.empty(size, cp.int32), cp.cuda.Event(), mem)
            self.slots[k] = slot
        return slot


def stream_for(device_id: int):
    """This module's CuPy stream on `device_id` (made once; non-blocking)."""
    import cupy as cp

    s = _STREAMS.get(device_id)
    if s is None:
        with _LOCK, cp.cuda.Device(device_id):
            s = _STREAMS.setdefault(device_id, cp.cuda.Stream(non_blocking=True))
    return s


def synchronize() -> None:
    """Waits until every launch (and what followed it on the streams) has finished."""
    for dev, s in list(_STREAMS.items()):
        ring = _SLOTS.get(dev)
        if ring is None:
            s.synchronize()
            continue
        with ring.lock:  # no launch between the wait and the mark
            s.synchronize()
            ring.clean = True


class FanoutPlan:
    """What the fan-out of one set of copiers needs besides its indices, read once (a JAX
    attribute read or pointer query costs tens of microseconds on a host that has idled).

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

    def kernels_for(self, m: int, table_len: int) -> list:
        got = self.kernels.get((m, table_len))
        if got is None:
            got = self.kernels[(m, table_len)] = [
                _fanout_kernel(sh, self.word, f, self.dst_rows, self.dst_words, m, table_len, self.config,
                               self.device_id) for sh, f in zip(self.src_shapes, self.first_layers)]
        return got


def launch_fanout(plan: FanoutPlan, m: int, table_len: int, fill, on_phase=None):
    """Enqueues the fan-out on `stream_for(plan.device_id)`: one launch per source layer group.

    Args:
        plan: the copiers' `FanoutPlan`.
        m, table_len: index bucket rows and table words (`fanout._blocks`); fill: ``fill((sv, dv),
            meta)`` writes the indices and the table (as for `mapped_ring.stage_indices`).
        on_phase: as `copy_fanout` (``"staged"`` once the indices are enqueued to the device).

    Returns:
        The stream it went on.

    Raises:
        Whatever Triton, CuPy or JAX raise (the caller falls back to the JAX launch).
    """
    import cupy as cp

    from pallas_kernels.mapped_ring import slot_layout

    stride, size = slot_layout(m, 2, table_len)
    kernels = plan.kernels_for(m, table_len)
    with cp.cuda.Device(plan.device_id):
        ring = _SLOTS.get(plan.device_id) or _SLOTS.setdefault(plan.device_id, _SlotRing())
        with ring.lock:
            stream = _launch_in_slot(ring.claim(size), plan, kernels, m, stride, table_len, fill, on_phase)
    return stream


def _launch_in_slot(slot, plan, kernels, m, stride, table_len, fill, on_phase):
    """Fills `slot` (pinned words, device words, event), copies it to the device and launches
    the kernels after it on the plan's stream, then records the slot's event there."""
    import cupy as cp

    host, dev, done, _ = slot
    fill((host[:m], host[stride:stride + m]), host[2 * stride:2 * stride + table_len])
    stream = stream_for(plan.device_id)
    nbytes = (2 * stride + table_len) * 4
    cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes,
                                cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
    if on_phase is not None:
        on_phase("staged")
    base, dst_ptrs = int(dev.data.ptr), plan.dst_ptrs
    for (kernel, grid), src in zip(kernels, plan.src_ptrs):
        kernel[grid](base + 8 * stride, base, base + 4 * stride, src, *dst_ptrs, *dst_ptrs, stream=stream.ptr)
    done.record(stream)
    return stream
