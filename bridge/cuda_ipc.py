"""CUDA IPC between processes of one host: export device arrays, open a peer's, write into them.

    # receiver (owns the memory)                 # sender (writes into it)
    handles = export_ipc_handles(kv_layers)      hs = [IpcHandle.from_dict(d) for d in msg]
    send([h.to_dict() for h in handles])         with IpcMapping(hs, shapes, dtypes) as m:
    ...keep kv_layers alive...                       m.arrays[0][rows] = ...  # CuPy arrays

Handles are legacy ``cudaIpcGetMemHandle`` handles of the *allocation* holding each array: a CuPy
pool block or an XLA buffer lives inside a larger ``cudaMalloc``/``cuMemAlloc`` allocation, whose
base ``cuMemGetAddressRange`` finds; the handle then carries the array's offset inside it. Legacy
handles open in about 0.2 ms and cost nothing to export (measured on an H200 for the project's
platform notes; README, "On the GPU"); ``cuMemCreate`` (VMM) and ``cudaMallocAsync`` pool memory cannot be
exported this way and is refused by CUDA (an `IpcError`). That includes JAX arrays on jax 0.11.2:
XLA's GPU buffers are VMM memory under every ``XLA_PYTHON_CLIENT_ALLOCATOR`` (default, platform,
bfc, cuda_async; measured on the H200, 2026-12-01), so IPC-shared KV must be CuPy (or other
``cudaMalloc``) memory, viewed from JAX by DLPack if needed.

Safety: a handle dict is a peer's message. `IpcHandle.from_dict` (`bridge.ipc_handle`) checks every field's type and
range before anything uses it, `IpcMapping` refuses handles of another host and checks each
array's extent against the size of the allocation that CUDA actually mapped, so a message can
never make this process touch memory outside what the peer exported.

Lifetimes: the exporter must keep its arrays (and so their allocations) alive, unchanged in place,
until every peer has closed its mapping: a freed and reused block would be written by the peer.
One `IpcMapping` owns the handles it opened and releases them at `close` (an allocation opened by
several mappings of this process is opened once and closed with the last of them).
"""
from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bridge.errors import BridgeError
from bridge.ipc_handle import IPC_HANDLE_BYTES, IpcHandle, host_info, same_host

__all__ = ["IPC_HANDLE_BYTES", "IpcError", "IpcHandle", "IpcMapping", "allocation_range", "export_ipc_handles",
           "host_info", "same_host"]


class IpcError(BridgeError):
    """CUDA refused an IPC operation (export, open, close), or CuPy / the driver is missing."""


# ---- CUDA access (CuPy's runtime bindings; the driver for cuMemGetAddressRange) ---------------------
_CUDA_MEMORY_TYPE_DEVICE = 2  # cudaMemoryTypeDevice in cudaPointerAttributes.type
_DRIVER = None


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise IpcError("CUDA IPC needs CuPy (pip install 'dcp-jax[gpu]')") from e
    return cupy


def _address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the allocation holding device address `ptr` (the current context's)."""
    global _DRIVER
    if _DRIVER is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise IpcError("CUDA IPC needs the CUDA driver (libcuda.so.1)") from e
        fn = lib.cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        fn.restype = ctypes.c_int
        _DRIVER = fn
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = _DRIVER(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise IpcError(f"cuMemGetAddressRange({ptr:#x}) failed with CUresult {rc}")
    return int(base.value), int(size.value)


def allocation_range(ptr: int, device_id: int = 0) -> tuple[int, int]:
    """(base, size) in bytes of the CUDA allocation holding device address `ptr` on `device_id`
    (``cuMemGetAddressRange``): a CuPy pool block or XLA buffer sits inside a larger one.

    Raises:
        IpcError: `ptr` is no device allocation of that device, or CuPy / the driver is missing.
    """
    with _cupy().cuda.Device(int(device_id)):
        return _address_range(int(ptr))


def _device_pointer(a: Any, i: int) -> tuple[int, int, int]:
    """(ptr, nbytes, device_id) of a contiguous device array: CuPy, JAX, `__cuda_array_interface__`,
    or an object with addr / nbytes / mem_type="VRAM" / device_id (`bridge.buffers.DeviceBuffer`)."""
    name = f"arrays[{i}]"
    if isinstance(a, np.ndarray):
        raise TypeError(f"{name} is a numpy array in host memory: CUDA IPC exports device memory only")
    if hasattr(a, "unsafe_buffer_pointer") and hasattr(a, "devices"):  # jax.Array
        devs = list(a.devices())
        if len(devs) != 1 or devs[0].platform != "gpu":
            raise TypeError(f"{name} is a JAX array on {devs}: it must live on exactly one GPU")
        hw = getattr(devs[0], "local_hardware_id", None)
        return int(a.unsafe_buffer_pointer()), int(a.nbytes), int(devs[0].id if hw is None else hw)
    if hasattr(a, "__cuda_array_interface__"):  # CuPy, torch, numba
        cai = a.__cuda_array_interface__
        shape, dt = tuple(cai["shape"]), np.dtype(cai["typestr"])
        strides = cai.get("strides")
        if strides is not None and tuple(strides) != _c_strides(shape, dt.itemsize):
            raise ValueError(f"{name} is not C-contiguous (strides {strides}): export a contiguous array")
        dev = a.device.id if hasattr(a, "device") and hasattr(a.device, "id") else _cupy().cuda.runtime.getDevice()
        return int(cai["data"][0]), int(np.prod(shape, dtype=np.int64)) * dt.itemsize, int(dev)
    if getattr(a, "mem_type", None) == "VRAM" and hasattr(a, "addr") and hasattr(a, "nbytes"):
        return int(a.addr), int(a.nbytes), int(getattr(a, "device_id", 0))
    raise TypeError(f"{name} of type {type(a).__name__} is not a device array (CuPy, JAX on GPU, "
                    f"__cuda_array_interface__ or a VRAM buffer)")


def _c_strides(shape: tuple, itemsize: int) -> tuple:
    out, s = [], itemsize
    for n in reversed(shape):
        out.append(s)
        s *= n
    return tuple(reversed(out))


# Allocations this process exported, by handle bytes: a mapping in this same process (CUDA refuses
# to open one's own handle) uses the base address directly, but only for a handle found here.
_EXPORTED: dict[bytes, tuple[int, int, int]] = {}  # handle -> (base, alloc_size, device_id)
# Allocations this process opened, by (handle, device): [ptr, mapped size, refcount].
_OPENED: dict[tuple[bytes, int], list[int]] = {}
_LOCK = threading.Lock()


def export_ipc_handles(arrays: Sequence[Any]) -> list[IpcHandle]:
    """IPC handles of device arrays, one per array, in order (arrays sharing an allocation share
    its handle, with their own offsets).

    Args:
        arrays: contiguous device arrays with nbytes > 0: CuPy, JAX arrays on one GPU, anything
            with ``__cuda_array_interface__``, or `bridge.buffers.DeviceBuffer`.

    Returns:
        `IpcHandle` per array; send ``h.to_dict()`` to the peer. Keep the arrays alive (and do not
        donate JAX ones) until every peer has closed its mapping.

    Raises:
        TypeError: an entry is host memory or no device array.
        ValueError: an entry is empty or not contiguous; arrays is empty.
        IpcError: CUDA refused (memory from ``cuMemCreate`` or a ``cudaMallocAsync`` pool, e.g.
            any JAX array on jax 0.11.2; managed memory), or CuPy / the driver is missing.
    """
    if isinstance(arrays, (str, bytes)) or not isinstance(arrays, Sequence) or not arrays:
        raise ValueError("arrays must be a non-empty sequence of device arrays")
    found = [_device_pointer(a, i) for i, a in enumerate(arrays)]
    for i, (_, n, _) in enumerate(found):
        if n <= 0:
            raise ValueError(f"arrays[{i}] has nbytes={n}: nothing to export")
    cp = _cupy()
    rt = cp.cuda.runtime
    me, pid = host_info(), os.getpid()
    by_base: dict[tuple[int, int], bytes] = {}
    out = []
    for i, (ptr, n, dev) in enumerate(found):
        with cp.cuda.Device(dev):
            attrs = rt.pointerGetAttributes(ptr)
            if attrs.type != _CUDA_MEMORY_TYPE_DEVICE or attrs.device != dev:
                raise IpcError(f"arrays[{i}] at {ptr:#x} is not device memory of GPU {dev} "
                               f"(cudaPointerAttributes type={attrs.type}, device={attrs.device})")
            base, size = _address_range(ptr)
            key = (base, dev)
            if key not in by_base:
                try:
                    by_base[key] = bytes(rt.ipcGetMemHandle(base))
                except rt.CUDARuntimeError as e:
                    raise IpcError(f"arrays[{i}]: cudaIpcGetMemHandle on its allocation {base:#x} "
                                   f"({size} bytes) failed: {e} (VMM or async-pool memory cannot be "
                                   f"exported with legacy handles)") from e
        handle = by_base[key]
        with _LOCK:
            _EXPORTED[handle] = (base, size, dev)
        out.append(IpcHandle(handle, dev, base, size, ptr - base, n, pid, me))
    return out


def _release(key: tuple[bytes, int], rt) -> None:
    with _LOCK:
        entry = _OPENED[key]
        entry[2] -= 1
        if entry[2] > 0:
            return
        del _OPENED[key]
    with _cupy().cuda.Device(key[1]):
        rt.ipcCloseMemHandle(entry[0])


class IpcMapping:
    """A peer's exported arrays, mapped into this process as CuPy arrays (`arrays`).

    Args:
        handles: `IpcHandle`s (or their dicts, checked by `IpcHandle.from_dict`), e.g. one per KV
            layer entry of a peer.
        shapes: per handle, the array shape to expose (default: ``(nbytes,)``); its bytes must fit
            in the handle's ``nbytes``.
        dtypes: per handle, the dtype (default uint8; CuPy has no bfloat16: use uint16). The
            handle's offset must be a multiple of its itemsize.

    Each distinct allocation is opened once (``cudaIpcOpenMemHandle``, peer access enabled
    lazily), whatever the number of handles in it; a handle of this very process is viewed at its
    exported address without opening (CUDA does not open one's own handles), and only if this
    process did export it.

    Raises:
        ValueError: bad handle dicts, a count mismatch, a shape/dtype not fitting its handle, a
            device this process does not see, or a handle exported on another host.
        IpcError: CUDA refused to open a handle (the exporter exited or freed it, another host,
            no peer access), or the mapped allocation is smaller than the handle claims. Nothing
            stays opened after an error.
    """

    def __init__(self, handles: Sequence[Any], shapes: Sequence[Sequence[int]] | None = None,
                 dtypes: Sequence[Any] | None = None):
        if isinstance(handles, (str, bytes, Mapping)) or not isinstance(handles, Sequence) or not handles:
            raise ValueError("handles must be a non-empty sequence of IpcHandle or their dicts")
        hs = [h if isinstance(h, IpcHandle) else IpcHandle.from_dict(h) for h in handles]
        n = len(hs)
        shapes = [(h.nbytes,) for h in hs] if shapes is None else list(shapes)
        dtypes = [np.uint8] * n if dtypes is None else list(dtypes)
        if len(shapes) != n or len(dtypes) != n:
            raise ValueError(f"{n} handles need {n} shapes and dtypes, got {len(shapes)} and {len(dtypes)}")
        self._layout = []
        for i, (h, shape, dtype) in enumerate(zip(hs, shapes, dtypes)):
            dt = np.dtype(dtype)
            if dt.hasobject or dt.itemsize == 0:
                raise ValueError(f"dtypes[{i}]={dt} cannot view device memory")
            if not isinstance(shape, Sequence) or not all(
                    isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 0 for s in shape):
                raise ValueError(f"shapes[{i}]={shape!r} must be a sequence of non-negative ints")
            shape = tuple(int(s) for s in shape)
            need = int(np.prod(shape, dtype=object)) * dt.itemsize
            if need > h.nbytes:
                raise ValueError(f"shapes[{i}]={shape} of {dt} is {need} bytes, more than the handle's "
                                 f"nbytes={h.nbytes}")
            if h.offset % dt.itemsize:
                raise ValueError(f"handles[{i}].offset={h.offset} is not a multiple of dtypes[{i}]={dt}'s "
                                 f"itemsize {dt.itemsize}")
            if not same_host(h.host):
                raise ValueError(f"handles[{i}] was exported on host {h.host.get('hostname')!r} (boot "
                                 f"{h.host.get('boot_id')!r}), not this one: CUDA IPC works within one host")
            self._layout.append((h, shape, dt))
        self.handles = tuple(hs)
        self._keys: list[tuple[bytes, int]] = []  # opened by this mapping, released at close
        self._closed = False
        self.arrays: tuple = ()
        cp = _cupy()
        ndev = cp.cuda.runtime.getDeviceCount()
        for i, h in enumerate(hs):
            if h.device_id >= ndev:
                raise ValueError(f"handles[{i}].device_id={h.device_id}: this process sees {ndev} GPU(s)")
        try:
            self.arrays = tuple(self._view(i, h, shape, dt, cp) for i, (h, shape, dt) in enumerate(self._layout))
        except BaseException:
            self._release_all()
            raise

    def _view(self, i: int, h: IpcHandle, shape: tuple, dt: np.dtype, cp):
        ptr, size = self._open(i, h, cp)
        if h.offset + h.nbytes > size:
            raise IpcError(f"handles[{i}]: offset={h.offset} + nbytes={h.nbytes} passes the mapped "
                           f"allocation of {size} bytes")
        mem = cp.cuda.UnownedMemory(ptr + h.offset, h.nbytes, self, device_id=h.device_id)
        return cp.ndarray(shape, dt, cp.cuda.MemoryPointer(mem, 0))

    def _open(self, i: int, h: IpcHandle, cp) -> tuple[int, int]:
        if h.pid == os.getpid():
            with _LOCK:
                mine = _EXPORTED.get(h.handle)
            if mine != (h.base, h.alloc_size, h.device_id):
                raise IpcError(f"handles[{i}] names this process (pid {h.pid}) but was not exported here")
            return h.base, h.alloc_size
        key = (h.handle, h.device_id)
        rt = cp.cuda.runtime
        with _LOCK:
            entry = _OPENED.get(key)
            if entry is not None and key not in self._keys:
                entry[2] += 1
                self._keys.append(key)
            if entry is not None:
                return entry[0], entry[1]
            # Opened under the lock: another mapping of this process may want the same allocation.
            with cp.cuda.Device(h.device_id):
                try:
                    ptr = int(rt.ipcOpenMemHandle(h.handle))  # flags: lazy peer access
                except rt.CUDARuntimeError as e:
                    raise IpcError(f"handles[{i}]: cudaIpcOpenMemHandle failed: {e} (exporter pid "
                                   f"{h.pid} gone, memory freed, or not shareable here)") from e
                try:
                    base, size = _address_range(ptr)
                except IpcError:
                    rt.ipcCloseMemHandle(ptr)
                    raise
            if base != ptr:  # the handle maps a whole allocation: anything else is not understood
                rt.ipcCloseMemHandle(ptr)
                raise IpcError(f"handles[{i}]: mapped at {ptr:#x} inside an allocation at {base:#x}")
            _OPENED[key] = [ptr, size, 1]
            self._keys.append(key)
            return ptr, size

    @property
    def opened(self) -> int:
        """Distinct allocations this mapping holds open (0 once closed, or for own handles)."""
        return len(self._keys)

    @property
    def closed(self) -> bool:
        return self._closed

    def _release_all(self) -> list[str]:
        errors = []
        rt = _cupy().cuda.runtime if self._keys else None
        while self._keys:
            key = self._keys.pop()
            try:
                _release(key, rt)
            except Exception as e:  # noqa: BLE001 - release the others, report after
                errors.append(f"{type(e).__name__}: {e}")
        return errors

    def close(self) -> None:
        """Waits for this process's work on the mapped devices (so no queued kernel still writes
        through the mapping), then closes every handle it opened. Idempotent; the arrays must not
        be used afterwards (`arrays` becomes empty).

        Raises:
            IpcError: CUDA refused to close a handle (all others are still closed).
        """
        if self._closed:
            return
        self._closed = True
        self.arrays = ()
        if self._keys:
            cp = _cupy()
            for dev in sorted({k[1] for k in self._keys}):
                with cp.cuda.Device(dev):
                    cp.cuda.runtime.deviceSynchronize()
        errors = self._release_all()
        if errors:
            raise IpcError("closing the IPC mapping: " + "; ".join(errors))

    def __enter__(self) -> "IpcMapping":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.arrays)} arrays, {self.opened} allocations open"
        return f"IpcMapping({state})"
