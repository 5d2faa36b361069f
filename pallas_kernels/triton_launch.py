"""Pallas kernels launched without JAX's dispatch (Triton's own launcher): the fused fan-out
(`copy_fanout`), `pack_rows` and `pack_windows` with host indices and `RowUnpacker.unpack` (the
region path's decode-side unpack).

Why: the fused path's whole request at 32,768 tokens is one ~1.1-1.6 ms kernel (H200 / H100)
plus the host time before it is enqueued. Through JAX, `copy_fanout` cost 850 us of host time
after the sender idled 0.3 s (495 us back to back), most of it the jitted dispatch; the SAME
kernel launched here cost 256 us cold (38 us back to back), indices staged included, and the
kernel ended 590 us sooner (`benchmarks/gpu/direct_launch_probe.py`, H100, 2026-12-05).
`pack_rows` of one rank's rows (a ~0.15-0.2 ms kernel) paid the same dispatch on every call.

How: JAX lowers the kernel's ``pallas_call`` as it would for XLA (its jitted function traced on
shapes only), and the Triton module its Triton lowering builds (``lower_jaxpr_to_triton_module``,
what JAX hands XLA as the custom call's IR) is captured and compiled by the ``triton`` package
(the one torch brings; once per shape, then from Triton's cache) for the device's compute
capability (`kernel_for`). A launch (`enqueue`) stages the indices into a pinned slot, copies them
to a device slot and launches the kernel on this module's CuPy stream with raw device pointers in
the ``pallas_call``'s argument order (`pallas_kernels.triton_plans` holds them per buffer set).
Completion: `synchronize` (which `pallas_kernels.synchronize` calls) or the stream (`stream_for`),
on which a flag bump may follow (`bridge.host_flag.SharedFlag.bump_on_stream`).

Ordering: the kernels run on this module's stream, not JAX's. The source's rows must be written
before the call (as for the JAX launch of CuPy sources); a launch into buffers JAX wrote last
waits for that kernel first (`after_jax`), and a JAX launch after a direct one waits for it
(`after_direct`), so the later copy lands last. Each index slot is rewritten only after the
launch that last read it has finished (an event per slot).

Used when `enabled()`: a CUDA GPU, the ``triton`` package, and ``DCP_JAX_DIRECT_LAUNCH`` not off
(`config.env_flag`; ``DCP_JAX_DIRECT_OFF``, a comma list of `KINDS`, turns only those off;
``DCP_JAX_DIRECT_ON`` turns on those of `DEFAULT_OFF`, which are off otherwise; a kind named by
both is an error, `_env_off_kinds`).
Anything that fails here (capture, compile, first launch) turns that kind off for the process
with one warning, and the JAX launch serves.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import threading
import warnings

import numpy as np

from pallas_kernels.config import EnvSwitchError, env_flag

__all__ = ["after_direct", "after_jax", "capture_triton_modules", "compile_module", "compiled", "disable", "enabled",
           "enqueue", "kernel_for", "launch_into", "stream_for", "synchronize"]

logger = logging.getLogger(__name__)

_LOCK = threading.RLock()
#: The kinds of direct launch (`enabled`'s `kind`).
KINDS = ("fanout", "gather", "unpack", "windows")


#: Kinds off unless ``DCP_JAX_DIRECT_ON`` names them. "windows" (a sender's round in one direct
#: launch) is not measured faster than one direct launch a window: on an H100 (2026-12-07, one
#: noisy start, one run of 6 requests each) the 32k region job read 146.3 / 160.2 GB/s whole with
#: it against 170.0 / 215.9 without (under MPS / not). On the H200, where a launch's host time
#: exceeds one window's kernel, it is still to be measured (`benchmarks/gpu/windows_ab.sh`).
DEFAULT_OFF = frozenset({"windows"})


def _off_kinds(raw: str, var: str = "DCP_JAX_DIRECT_OFF") -> set:
    """DCP_JAX_DIRECT_OFF="unpack,gather": those kinds through JAX (an A/B on one machine start);
    the same parse for ``DCP_JAX_DIRECT_ON`` (`var`), which turns on kinds of `DEFAULT_OFF`.

    Raises:
        EnvSwitchError: a name that is not one of `KINDS` (naming the variable)."""
    kinds = {k.strip().lower() for k in raw.split(",") if k.strip()}
    bad = sorted(kinds - set(KINDS))
    if bad:
        raise EnvSwitchError(f"{var}={raw!r}: {bad} not among the kinds {KINDS}")
    return kinds


def _env_off_kinds(env) -> set:
    """The kinds off in a process started with environment `env`: ``DCP_JAX_DIRECT_OFF``'s and
    those of `DEFAULT_OFF` that ``DCP_JAX_DIRECT_ON`` does not name.

    Raises:
        EnvSwitchError: a name not among `KINDS`, or a kind named by both variables (an A/B
            run must not silently measure one side twice)."""
    off = _off_kinds(env.get("DCP_JAX_DIRECT_OFF", ""))
    on = _off_kinds(env.get("DCP_JAX_DIRECT_ON", ""), "DCP_JAX_DIRECT_ON")
    if on & off:
        raise EnvSwitchError(f"DCP_JAX_DIRECT_ON and DCP_JAX_DIRECT_OFF both name {sorted(on & off)}")
    return off | (DEFAULT_OFF - on)


_STATE = {"off": not env_flag("DCP_JAX_DIRECT_LAUNCH", True), "why": "", "off_kinds": _env_off_kinds(os.environ)}
_KERNELS: dict = {}   # compile key -> (CompiledKernel, grid), oldest first
# A serving process meets a few geometries (index buckets x cache shapes); the bound only keeps a
# long-lived process that sees ever new ones from holding every module (plans keep their own).
_MAX_KERNELS = 256
_STREAMS: dict = {}   # device id -> cupy Stream
_SLOTS: dict = {}     # device id -> _SlotRing
# A sender's round launches one pack a window (eight for DCP8): with four slots the fifth launch
# waited on the host for the first kernel to end, holding the thread that reads the grants.
_SLOTS_PER_DEVICE = 16
# Words a slot holds when the ring is made (64 KiB: a 16k-row index bucket and its metadata).
_SLOT_WORDS = 1 << 14
_KERNEL = re.compile(r"^\s*tt\.func public @[\w$.]+\(.*\)\s*(attributes \{.*\}\s*)?\{\s*$", re.MULTILINE)


def enabled(backend: str, kind: str = "fanout") -> bool:
    """Whether a kernel of `kind` ("fanout": `copy_fanout`; "gather": `pack_rows` with host
    indices; "windows": `pack_windows` with host indices, one launch for all windows; "unpack":
    `RowUnpacker.unpack` into a layer-major cache) launches here: `backend` "triton" (the callers' resolved backend, which only a
    CUDA GPU gives), the ``triton`` package importable, not turned off
    (``DCP_JAX_DIRECT_LAUNCH=0``, or `disable` for this kind or all)."""
    if _STATE["off"] or backend != "triton" or kind in _STATE["off_kinds"]:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        disable("the triton package is not installed")
        return False
    return True


def disable(why: str, kind: str | None = None) -> None:
    """Turns direct launches of `kind` (None: every kind) off for this process (the JAX launch
    serves); logs `why` once per kind."""
    with _LOCK:
        if kind is None:
            if not _STATE["off"]:
                logger.warning("direct launches: through JAX from now on (%s)", why)
            _STATE["off"], _STATE["why"] = True, why
        else:
            if kind not in _STATE["off_kinds"] and not _STATE["off"]:
                logger.warning("%s: launching through JAX from now on (%s)", kind, why)
            _STATE["off_kinds"].add(kind)
            _STATE["why"] = why


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

    Raises:
        ValueError: `text` holds no kernel (malformed MLIR past that check may still crash
            Triton itself: pass what `capture_triton_modules` captured), `num_warps` not a power
            of 2 in [1, 32] or `num_stages` < 1; TypeError: `target` not a ``GPUTarget``;
            whatever Triton raises.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    # Triton 3.6 ends the process (SIGSEGV) on a module without a kernel body: accept only the
    # shape `capture_triton_modules` yields (a public tt.func with a body that returns).
    if not isinstance(text, str) or not _KERNEL.search(text) or "tt.return" not in text:
        raise ValueError("text must be a Triton module with a kernel (a public tt.func with a body), "
                         "as capture_triton_modules captures it")
    for name, v in (("num_warps", num_warps), ("num_stages", num_stages)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    if num_warps & (num_warps - 1) or num_warps > 32:
        raise ValueError(f"num_warps={num_warps} must be a power of 2 <= 32")
    if target is not None and not isinstance(target, GPUTarget):
        raise TypeError(f"target must be a triton GPUTarget, got {type(target).__name__}")
    if target is None:
        import cupy as cp

        target = GPUTarget("cuda", int(cp.cuda.Device().compute_capability), 32)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")  # IRSource picks the parser by the suffix
        with open(path, "w") as f:
            f.write(text)
        return triton.compile(path, target=target, options=dict(num_warps=num_warps, num_stages=num_stages))


def kernel_for(key, trace, tag: str, config, device_id: int):
    """(CompiledKernel, grid) of the ONE ``pallas_call`` whose Triton module's text holds `tag`
    that ``trace()`` lowers (a jitted function traced and lowered on shapes only), compiled by
    Triton for `device_id` and loaded there; cached under `key` for the process (Triton's own
    cache keeps the binary across processes).

    Raises:
        RuntimeError: not exactly one such module was captured; whatever JAX or Triton raise.
    """
    hit = _KERNELS.get(key)
    if hit is not None:
        return hit
    with _LOCK:
        if key in _KERNELS:
            return _KERNELS[key]
        with capture_triton_modules() as got, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Pallas' Triton lowering (0.11)
            trace()
        mods = [g for g in got if tag in g[0]]
        if len(mods) != 1:
            raise RuntimeError(f"expected one {tag} Triton module at lowering, captured {len(mods)}")
        text, grid = mods[0]
        import cupy as cp
        import torch  # Triton's CUDA driver asks torch for the current device when it loads a kernel
        from triton.backends.compiler import GPUTarget

        cc = int(cp.cuda.Device(device_id).compute_capability)
        kernel = compile_module(text, num_warps=config.num_warps, num_stages=config.num_stages,
                                target=GPUTarget("cuda", cc, 32))
        with torch.cuda.device(device_id):
            kernel._init_handles()  # loads the binary on this device (a later launch only reuses it)
        return _remember(key, (kernel, (grid + (1, 1))[:3]))


def compiled(key) -> bool:
    """Whether `kernel_for` holds a kernel under `key` (a launch of it compiles nothing)."""
    return key in _KERNELS


def _remember(key, got):
    """Files a compiled kernel under `key`, dropping the oldest past `_MAX_KERNELS`."""
    with _LOCK:
        while len(_KERNELS) >= _MAX_KERNELS:
            del _KERNELS[next(iter(_KERNELS))]
        _KERNELS[key] = got
    return got


class _SlotRing:
    """Index slots of one device: pinned host words, a device copy, the event of the launch that
    last read it (a slot is rewritten only once that launch ended).

    Every slot is allocated at the first claim, from ONE pinned block and ONE device block of
    `_SLOTS_PER_DEVICE` x max(size, `_SLOT_WORDS`) words, so no launch after the first pays a
    page-locked allocation (``cudaHostAlloc``) and a device one: made slot by slot, a decode rank
    (one unpack a request) met a fresh slot in each of its first 16 requests. Measured on an H100
    (2026-12-08, `benchmarks/gpu/time_region.sh`): a claim 2.8-5.0 us median in the decode ranks;
    the 32k region job read within its spread of the tree before (308.1 / 326.9 GB/s whole against
    302.8 / 337.9). A claim larger than a slot gets its own allocation."""

    def __init__(self):
        self.slots: list = [None] * _SLOTS_PER_DEVICE
        self.next = 0
        # True once `synchronize` saw every launch end and none came since: a claim then skips
        # its event wait (a driver call that costs tens of microseconds on a host that idled).
        self.clean = True
        # Held from a slot's claim to its event's record: launches of two sources (each under its
        # own ring lock in `fanout`) on one device never share a slot.
        self.lock = threading.Lock()

    def _allocate_all(self, size: int) -> None:
        import cupy as cp

        words = max(int(size), _SLOT_WORDS)
        k = len(self.slots)
        mem = cp.cuda.alloc_pinned_memory(k * words * 4)
        host = np.frombuffer(mem, np.int32, k * words)
        dev = cp.empty(k * words, cp.int32)
        for i in range(k):
            part = slice(i * words, (i + 1) * words)
            self.slots[i] = (host[part], dev[part], cp.cuda.Event(), mem)

    def claim(self, size: int):
        import cupy as cp

        if self.slots[0] is None:
            self._allocate_all(size)
        k = self.next
        self.next = (k + 1) % len(self.slots)
        slot = self.slots[k]
        if not self.clean:
            slot[2].synchronize()  # the launch that last read it has run (an unrecorded event: at once)
        self.clean = False
        if slot[0].size < size:
            mem = cp.cuda.alloc_pinned_memory(size * 4)
            slot = (np.frombuffer(mem, np.int32, size), cp.empty(size, cp.int32), slot[2], mem)
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


def after_jax(dests) -> None:
    """Before a direct launch into these `device.Destinations`: a JAX kernel that last wrote
    one of them has ended (it ran on JAX's stream, which this module's streams do not follow:
    the later copy must land last). A host wait only when the previous launch went through JAX."""
    for d in dests:
        if d.jax_last:
            d.handles[0].block_until_ready()
            d.jax_last = False


def after_direct(dests) -> None:
    """Before a JAX launch into these `device.Destinations`: the direct launch that last wrote
    one of them has ended (its stream is not JAX's); their ``direct`` is cleared."""
    for d in dests:
        if d.direct is not None:
            d.direct.synchronize()
            d.direct = None


def launch_into(kind: str, dests, launch):
    """Runs one direct launch of `kind` into these `device.Destinations`: waits for a JAX kernel
    that last wrote them (`after_jax`), calls ``launch()`` (which returns the stream it
    enqueued on) and names that stream in each one's ``direct``. Returns the stream, or None if
    anything raised: then `kind` is off for the process (one warning) and whatever it enqueued
    has ended, so the caller's JAX launch lands after it (same rows, same bytes)."""
    try:
        after_jax(dests)
        stream = launch()
    except Exception as exc:  # noqa: BLE001 - any failure: the JAX launch serves from now on
        disable(f"{type(exc).__name__}: {exc}", kind)
        synchronize()
        return None
    for d in dests:
        d.direct = stream
    return stream


def enqueue(device_id: int, size: int, fill, launches, on_phase=None):
    """One direct launch: claims an index slot of `size` int32 words on `device_id`, lets
    ``fill(words)`` write it (pinned host memory), copies it to the device and calls each
    ``launch(slot_address, stream_address)`` (Triton launches reading the device slot), all on
    `stream_for(device_id)`, then records the slot's event. ``on_phase("staged")`` once the copy
    is enqueued. Returns the stream.

    Raises:
        Whatever Triton or CuPy raise (the callers fall back to the JAX launch).
    """
    import cupy as cp

    with cp.cuda.Device(device_id):
        ring = _SLOTS.get(device_id) or _SLOTS.setdefault(device_id, _SlotRing())
        with ring.lock:
            host, dev, done, _ = ring.claim(size)
            fill(host)
            stream = stream_for(device_id)
            cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, size * 4,
                                        cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            if on_phase is not None:
                on_phase("staged")
            base = int(dev.data.ptr)
            for launch in launches:
                launch(base, stream.ptr)
            done.record(stream)
    return stream
