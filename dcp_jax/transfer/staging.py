"""Direct or staged, per side and per peer, and the sender's pack step (issue 14, item 3).

A side is *direct* when its engine registers the memory its KV layers live in, *staged* when it
cannot (or is told not to, ``staging="host"``): then the KV stays in (unregistered) device
memory and only host memory meets the engine:

- a staged `KVSender` registers its pack buffer alone, in (pinned) host memory: each window is
  gathered on the device by the pack backend into a device scratch and copied device -> host into
  the pack region before the engine moves it (`Packer`);
- a staged `KVReceiver` registers its receive region alone, in (pinned) host memory: each window
  lands there and is copied host -> device and unpacked into the KV pages (`to_device_window`).

Each side decides for itself (`side_staged`) and says so at the handshake (``hello.staged``,
``hello_ack.staged``); `dcp_jax.transfer._region.choose_path` then picks a path this pair can
take: a staged receiver takes only ``region`` (its pages are not registered), a staged sender
only ``packed`` or ``region`` (its pages are not registered). Both sides report which, per peer,
in ``request_stats``.

On the CPU the "device" memory of JAX is host memory: a staged CPU side moves the same bytes as a
direct one (no copy is needed), only its registrations differ.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from bridge.buffers import HostArrayBuffer, HostBuffer

logger = logging.getLogger(__name__)

__all__ = ["STAGINGS", "engine_registers", "side_staged", "PinnedHostBuffer", "host_buffer", "Packer",
           "to_device_window"]

#: What ``KVSender(staging=...)`` / ``KVReceiver(staging=...)`` accept.
STAGINGS = ("auto", "none", "host")


def engine_registers(engine_kind: str, mem_type: str) -> bool:
    """Whether an engine of ``engine_kind`` can register ``mem_type`` (``"DRAM"`` / ``"VRAM"``) memory.

    Host memory: every engine. CUDA device memory: NIXL; Mooncake's CUDA build
    (`bridge.mooncake.mooncake_supports_cuda`); not ``jax-transfer`` (host memory only).
    """
    if mem_type == "DRAM":
        return True
    if engine_kind == "mooncake":
        from bridge.mooncake import mooncake_supports_cuda

        return mooncake_supports_cuda()
    return engine_kind == "nixl"


def side_staged(staging: str, engine_kind: str, mem_type: str) -> bool:
    """True when a side with KV in ``mem_type`` memory stages through host memory.

    Args:
        staging: ``"auto"`` (stage where the engine cannot register the KV), ``"none"`` (never)
            or ``"host"`` (always).
        engine_kind: the engine's resolved kind (``engine.kind``).
        mem_type: ``"DRAM"`` or ``"VRAM"`` (where the KV layers live).

    Raises:
        ValueError: unknown ``staging``; ``"none"`` with an engine that cannot register the KV.
    """
    if staging not in STAGINGS:
        raise ValueError(f"staging={staging!r} must be one of {STAGINGS}")
    if staging == "host":
        return True
    can = engine_registers(engine_kind, mem_type)
    if staging == "none" and not can:
        raise ValueError(f"staging='none': the {engine_kind} engine cannot register {mem_type} memory; "
                         "use staging='auto' or 'host'")
    return not can


class PinnedHostBuffer(HostArrayBuffer):
    """Page-locked host memory (CUDA ``cudaHostAlloc`` through CuPy), viewed as uint8: the staging
    memory of a GPU side (device <-> host copies at full PCIe / C2C speed).

    Attributes: ``array`` (u8[nbytes] numpy), ``addr``, ``nbytes``, ``mem_type`` ("DRAM"),
    ``device_id`` (0) (`bridge.buffers.HostArrayBuffer`).
    """

    def __init__(self, nbytes: int):
        import cupy as cp

        self._mem = cp.cuda.alloc_pinned_memory(max(int(nbytes), 1))
        self.array = np.frombuffer(self._mem, np.uint8, int(nbytes))


def host_buffer(nbytes: int, mem_type: str, *, fill: int | None = None) -> Any:
    """The registered host buffer of a staged side: pinned for GPU KV (``mem_type="VRAM"``),
    a `bridge.buffers.HostBuffer` for host KV."""
    if mem_type == "VRAM":
        buf = PinnedHostBuffer(nbytes)
        if fill is not None:
            buf.array.fill(fill)
        return buf
    return HostBuffer(nbytes, fill=fill)


def to_device_window(region: np.ndarray, offset: int, nbytes: int) -> Any:
    """u8[nbytes] CuPy copy of ``region[offset:offset + nbytes]`` (host -> device, synchronised)."""
    import cupy as cp

    out = cp.empty(int(nbytes), cp.uint8)
    out.set(region[offset:offset + nbytes])
    return out


def _registry_name(kind: str) -> str:
    """The registry name of what ``pack_rows(backend="auto")`` runs for row views of ``kind``."""
    if kind == "numpy":
        return "host"
    from pallas_kernels import select_backend

    return {"triton": "gpu-triton", "mosaic": "gpu-mosaic"}.get(select_backend("auto"), "gpu-triton")


class Packer:
    """The sender's pack step: gathers rows of every layer into bytes
    ``[offset, offset + n * row_bytes)`` of its registered pack buffer (spec section 6 layout).

    Args:
        rows: the sender's per-layer u8[num_rows, item_len] views (`CacheLayers.rows`: numpy on
            the host, CuPy on a GPU).
        source: their `pallas_kernels.PackSource` (the ``"auto"`` path's cached checks).
        pack: the registered pack buffer's array (u8[pack_bytes], numpy or CuPy).
        backend: ``"auto"`` (`pallas_kernels.pack_rows`'s choice: numpy ``np.take`` on the host,
            the Pallas kernel on a GPU) or a `pallas_kernels.registry` backend name (``"xla"``,
            ``"host"``, ``"gpu-triton"``, ``"gpu-mosaic"``, ``"tpu-interpret"``, ...).
        staged: the rows live in device memory the engine does not register and ``pack`` is host
            memory: device rows are gathered into a device scratch, then copied device -> host.

    Attributes:
        name: the registry name of the backend that packs (reported per request).
        stage_seconds: total seconds of device -> host staging copies.

    Raises:
        ValueError: an unknown backend, or one that cannot run here or take these rows (named
            ``pack_backend``, with why).
    """

    def __init__(self, rows: list, source: Any, pack: Any, backend: str = "auto", *, staged: bool = False):
        from pallas_kernels.registry import array_kind, get_backend

        if not isinstance(backend, str):
            raise ValueError(f"pack_backend={backend!r} must be 'auto' or a registry backend name")
        self.rows, self.source, self.pack, self.backend = rows, source, pack, backend
        self.kind = array_kind(rows[0])
        self.staged = staged and self.kind != "numpy"  # host rows: the pack buffer is the target
        self.stage_seconds = 0.0
        self._direct_buckets: frozenset = frozenset()  # one-window rounds packed by `pack_rows` (warmed)
        self._windows_buckets: frozenset = frozenset()  # rounds packed by one direct windowed launch
        self._scratch = None
        self._jax_rows = None
        if backend == "auto":
            self.name = _registry_name(self.kind)
            return
        try:
            b = get_backend(backend)
        except ValueError as exc:
            raise ValueError(f"pack_backend={backend!r}: {exc}") from None
        item_lens = tuple(int(r.shape[1]) for r in rows)
        why = b.unavailable()
        if why is None and self.kind not in b.kinds and "jax" not in b.kinds:
            why = f"it takes {b.kinds} arrays, the KV rows are {self.kind}"
        # Regions start 64-byte aligned (PackArena), anywhere in the buffer: the last one it can
        # hold is checked too (a backend that takes int32 offsets cannot serve a >= 2 GiB pack).
        last = max(0, (int(self.pack.nbytes) - 1) // 64 * 64)
        why = why or b.unsupported(item_lens, 0) or b.unsupported(item_lens, last)
        if why is not None:
            raise ValueError(f"pack_backend={backend!r} cannot pack these KV layers here: {why}")
        self.name = b.name
        self._through_jax = self.kind not in b.kinds

    def __call__(self, idx: np.ndarray, offset: int, *, sync: bool = True) -> None:
        """Packs rows ``idx`` (int64[n]) at byte ``offset`` of the pack buffer. With ``sync``
        False the default device pack is only enqueued (the caller synchronises the pack buffer
        before an engine reads it, once for several windows); staged and named backends always
        return with the bytes in place."""
        n = len(idx) * sum(int(r.shape[1]) for r in self.rows)
        if not self.staged:
            self._gather(idx, self.pack, offset, sync=sync)
            return
        self._ensure_scratch()
        self._gather(idx, self._scratch, offset)  # same offset: the kernels' alignment holds
        t0 = time.perf_counter()
        self._scratch[offset:offset + n].get(out=self.pack[offset:offset + n])
        self.stage_seconds += time.perf_counter() - t0

    def pack_windows(self, windows: list, *, sync: bool = True) -> int:
        """Packs every ``(idx, offset)`` window of a round, as ``self(idx, offset)`` each, in one
        call where the backend has one (``"auto"``: `pallas_kernels.pack_windows`, one kernel
        launch on a GPU); named backends pack window by window. Staged: one gather into the
        device scratch, then each window's bytes device -> host. Returns the pack calls it made
        (kernel launches on a device: one, or one a window for windows launched directly)."""
        if self.backend != "auto":
            for idx, offset in windows:
                self(idx, offset, sync=sync)
            return len(windows)
        from pallas_kernels import pack_windows

        if not self.staged:
            # One direct launch for all where that kind is on and its bucket compiled (a direct
            # launch costs ~0.2 ms of host time on an H200, more than one window's 0.14 ms
            # kernel; not measured faster yet: `triton_launch.DEFAULT_OFF`).
            if not self.windows_direct(windows) and self.launches_each([idx for idx, _ in windows]):
                # Windows whose bucket `warm_up` compiled for `pack_rows`' direct launch, where
                # the windowed kernel goes through JAX: one launch each (its jitted call cost
                # ~0.5 ms of host time a round in the 32k job; a direct launch ~0.17 ms).
                for idx, offset in windows:
                    self._gather(idx, self.pack, offset, sync=False)
                if sync:
                    from pallas_kernels import synchronize

                    synchronize(self.pack)
                return len(windows)
            pack_windows(self.source, windows, self.pack, sync=sync)
            return 1
        self._ensure_scratch()
        pack_windows(self.source, windows, self._scratch)  # same offsets: alignment holds
        row_bytes = sum(int(r.shape[1]) for r in self.rows)
        t0 = time.perf_counter()
        for idx, offset in windows:
            end = offset + len(idx) * row_bytes
            self._scratch[offset:end].get(out=self.pack[offset:end])
        self.stage_seconds += time.perf_counter() - t0
        return 1

    def windows_direct(self, windows: list) -> bool:
        """Whether `pallas_kernels.pack_windows` launches these ``(idx, offset)`` windows in ONE
        kernel without JAX's dispatch: the default device pack, not staged, more than one
        window, their index bucket compiled for it by `warm_up`, the kind "windows" on
        (``DCP_JAX_DIRECT_ON=windows``; off by default, `triton_launch.DEFAULT_OFF`)."""
        if len(windows) < 2 or not self._windows_buckets:
            return False
        from pallas_kernels import GatherConfig, select_backend, triton_launch
        from pallas_kernels.windows import windows_bucket

        m = windows_bucket([len(idx) for idx, _ in windows], GatherConfig.default().block_rows)
        return m in self._windows_buckets and triton_launch.enabled(select_backend("auto"), "windows")

    def launches_each(self, windows: list) -> bool:
        """Whether `pack_windows` launches each of these windows (row index arrays) directly,
        one kernel a window: the default device pack, not staged, every window's index bucket
        compiled for it by `warm_up`. Then a caller may also launch them one by one (``self(idx,
        offset, sync=False)``) and take a ticket after each."""
        return (self.backend == "auto" and not self.staged and bool(self._direct_buckets)
                and all(self._bucket(len(idx)) in self._direct_buckets for idx in windows))

    def warm_up(self, max_rows: int, window_rows: int | None = None) -> list[int]:
        """Compiles the one-launch pack of `pack_windows` for every index bucket up to
        ``max_rows`` rows, writing nothing (`pallas_kernels.warm_pack_windows`); returns the
        buckets ([] where nothing compiles: host rows; a named backend compiles what its
        `PackBackend.warm` does: the xla backend's gather buckets on numpy rows).
        ``window_rows`` (device, "auto", not staged): also the launches without JAX's dispatch:
        `pack_windows`' for the bucket of ``max_rows`` (`pallas_kernels.warm_pack_windows_direct`;
        a round of several windows in that bucket is packed in that one launch) and `pack_rows`'
        for the bucket of one window of ``window_rows`` (`pallas_kernels.warm_pack_rows`; any other
        round whose windows all fall in such buckets is packed that way, one launch a window)."""
        if self.backend != "auto":
            if self._through_jax:
                return []  # a fresh JAX pack per call: compiled per row count
            from pallas_kernels import get_backend

            return get_backend(self.backend).warm(self.rows, max_rows)
        from pallas_kernels import warm_pack_windows

        if self.staged and self._scratch is None:
            return []  # `prepare` first (under the owner's lock)
        buckets = warm_pack_windows(self.source, self._scratch if self.staged else self.pack, max_rows)
        if window_rows is not None and not self.staged and self.kind == "cupy":
            from pallas_kernels import warm_pack_rows, warm_pack_windows_direct

            try:
                self._direct_buckets = self._direct_buckets | frozenset(
                    warm_pack_rows(self.source, self.pack, window_rows))
                self._windows_buckets = self._windows_buckets | frozenset(
                    warm_pack_windows_direct(self.source, self.pack, max_rows))
            except Exception:  # noqa: BLE001 - the windowed pack serves every round
                logger.warning("warm_up: the pack's direct launches not compiled", exc_info=True)
        return buckets

    @staticmethod
    def _bucket(n: int) -> int:
        from pallas_kernels import GatherConfig, bucket_rows

        return bucket_rows(n, GatherConfig.default().block_rows)

    def prepare(self) -> None:
        """Makes what `warm_up` compiles against now (a staged pack's device scratch); call it
        where packs are serialised (the sender's lock): the scratch is made once."""
        if self.staged and self.backend == "auto":
            self._ensure_scratch()

    def _ensure_scratch(self) -> None:
        if self._scratch is None or self._scratch.size < self.pack.size:
            import cupy as cp

            self._scratch = cp.empty(self.pack.size, cp.uint8)

    def _gather(self, idx: np.ndarray, target: Any, offset: int, sync: bool = True) -> None:
        from pallas_kernels import pack_region, pack_rows

        if self.backend == "auto":
            pack_rows(self.source, idx, target, offset=offset, sync=sync)
            return
        if not self._through_jax:
            pack_region(self.rows, idx, target, offset=offset, backend=self.backend)
            _sync(target)
            return
        # A JAX-only backend (xla on a GPU) over CuPy rows: DLPack views in, a new JAX array out.
        import jax
        import jax.numpy as jnp

        if self._jax_rows is None:
            self._jax_rows = [jax.dlpack.from_dlpack(r) for r in self.rows]
        n = len(idx) * sum(int(r.shape[1]) for r in self.rows)
        out = pack_region(self._jax_rows, idx, jnp.zeros(n, jnp.uint8), offset=0, backend=self.backend)
        if isinstance(target, np.ndarray):
            target[offset:offset + n] = np.asarray(out)
            return
        import cupy as cp

        target[offset:offset + n] = cp.from_dlpack(out)
        _sync(target)


def _sync(a: Any) -> None:
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy as cp

        cp.cuda.runtime.deviceSynchronize()
