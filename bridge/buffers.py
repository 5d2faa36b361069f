"""Registered buffers: host memory (numpy) and device memory (CuPy), with DLPack import into JAX.

A transfer engine registers a buffer once by `(addr, nbytes, mem_type, device_id)`; the buffer
must then stay put for as long as it is registered. These classes own one allocation each and
expose exactly what the engines (`bridge.base.as_region`) and the pack kernel need:

- ``.addr``: int, address of byte 0;
- ``.nbytes``: int, size in bytes;
- ``.array``: the uint8 view (numpy for `HostBuffer`, CuPy for `DeviceBuffer`);
- ``.mem_type``: ``"DRAM"`` or ``"VRAM"``; ``.device_id``: CUDA device ordinal (0 for host);
- ``as_jax(dtype=None, *, offset=0, nbytes=None)``: a JAX array over (part of) the buffer.

Host buffers are 64-byte aligned: numpy -> JAX DLPack import is zero-copy only then (JAX on
CPU copies silently otherwise). A CPU import is a read-only view in practice: donating it to a
jitted call does not write back (XLA allocates a new buffer), so the CPU pack path writes with
numpy (`pallas_kernels.pack_rows`).

Device buffers are CuPy allocations. `as_jax` imports them by DLPack, zero-copy; a jitted
Pallas call with `input_output_aliases` and donation then writes into the CuPy memory (the
imported handle is consumed: import again for the next call). CuPy has no bfloat16: take the
integer view (uint16) and `jax.lax.bitcast_convert_type` in JAX.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

HOST_ALIGN_BYTES = 64  # numpy -> JAX DLPack is zero-copy only for 64-B aligned pointers
MEM_TYPES = ("DRAM", "VRAM")


def _check_nbytes(nbytes: Any) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"nbytes must be an int (bytes), got {type(nbytes).__name__}")
    if nbytes <= 0:
        raise ValueError(f"{nbytes=} must be > 0 (bytes)")
    return int(nbytes)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_fill(fill: Any) -> int | None:
    if fill is None:
        return None
    if not _is_int(fill):
        raise TypeError(f"{fill=} must be None or an int byte value 0..255")
    if not 0 <= fill <= 255:
        raise ValueError(f"{fill=} must be None or an int byte value 0..255")
    return int(fill)


def _view_range(total: int, offset: int, nbytes: int | None, itemsize: int) -> tuple[int, int]:
    if not _is_int(offset):
        raise TypeError(f"{offset=} must be a non-negative int (bytes)")
    if offset < 0:
        raise ValueError(f"{offset=} must be a non-negative int (bytes)")
    if nbytes is not None and not _is_int(nbytes):
        raise TypeError(f"{nbytes=} must be None or an int (bytes)")
    nbytes = total - offset if nbytes is None else int(nbytes)
    if nbytes < 0 or offset + nbytes > total:
        raise ValueError(f"{offset=} + {nbytes=} exceeds the buffer of {total} bytes")
    if offset % itemsize or nbytes % itemsize:
        raise ValueError(f"{offset=} and {nbytes=} must be multiples of the itemsize {itemsize}")
    return int(offset), nbytes


class ArrayBuffer:
    """What every buffer here shares over ``self.array``, the 1-D uint8 array (numpy or CuPy) of
    its one allocation: ``nbytes``, ``view`` and the DLPack import behind ``as_jax``."""

    array: Any

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return int(self.array.nbytes)

    def view(self, dtype=np.uint8, shape=None, *, offset: int = 0):
        """A view of bytes `[offset, offset + prod(shape) * itemsize)` (no copy): numpy over host
        memory, CuPy over device memory.

        Raises:
            ValueError: range outside the buffer or misaligned for `dtype`.
        """
        dt = np.dtype(dtype)
        count = None if shape is None else int(np.prod(shape)) * dt.itemsize
        offset, count = _view_range(self.nbytes, offset, count, dt.itemsize)
        out = self.array[offset:offset + count].view(dt)
        return out if shape is None else out.reshape(shape)

    def _import_jax(self, dtype, offset: int, nbytes: int | None):
        import jax

        dt = np.dtype(np.uint8 if dtype is None else dtype)
        offset, nbytes = _view_range(self.nbytes, offset, nbytes, dt.itemsize)
        return jax.dlpack.from_dlpack(self.array[offset:offset + nbytes].view(dt))


class HostArrayBuffer(ArrayBuffer):
    """A buffer over host memory that numpy holds as ``self.array`` (DRAM, device 0)."""

    mem_type = "DRAM"
    device_id = 0

    @property
    def addr(self) -> int:
        """Address of byte 0."""
        return int(self.array.ctypes.data)


class HostBuffer(HostArrayBuffer):
    """A 64-byte-aligned host (DRAM) allocation, viewed as uint8.

    Args:
        nbytes: size in bytes (> 0).
        fill: optional byte value (0..255) written to every byte; otherwise the memory is
            zeroed.

    Raises:
        ValueError: `nbytes` not positive or `fill` outside 0..255.
        TypeError: `nbytes` not an int.
    """

    def __init__(self, nbytes: int, *, fill: int | None = None):
        nbytes = _check_nbytes(nbytes)
        fill = _check_fill(fill)
        # Anonymous, page-aligned (so 64-byte aligned) memory with transparent huge pages asked
        # for: multi-GB pack buffers then take a fraction of the page faults on first touch and
        # of the page walks in engine copies (measured: a 2.3 GB first pack 4.9 s -> under 1 s).
        self._raw = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._raw.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # no THP here: ordinary pages
            pass
        self.array: np.ndarray = np.frombuffer(self._raw, dtype=np.uint8, count=nbytes)
        if fill is not None:
            self.array.fill(fill)

    def as_jax(self, dtype=None, *, offset: int = 0, nbytes: int | None = None):
        """Import bytes `[offset, offset + nbytes)` into JAX by DLPack (zero-copy if aligned).

        Args:
            dtype: element dtype of the view (default uint8); CPU JAX without x64 converts
                64-bit types.
            offset, nbytes: byte range (default: the whole buffer).

        Returns:
            A 1-D `jax.Array` on the CPU device sharing this memory when `offset` keeps the
            pointer 64-byte aligned.
        """
        return self._import_jax(dtype, offset, nbytes)

    def __repr__(self) -> str:
        return f"HostBuffer(addr=0x{self.addr:x}, nbytes={self.nbytes:,})"


class DeviceBuffer(ArrayBuffer):
    """A CuPy device (VRAM) allocation, viewed as uint8, importable into JAX without a copy.

    Args:
        nbytes: size in bytes (> 0).
        device_id: CUDA device ordinal.
        fill: optional byte value written to every byte; otherwise zeroed.

    Raises:
        ImportError: CuPy is not installed (install the ``gpu`` extra).
        ValueError: bad `nbytes`, `device_id` or `fill`.
    """

    mem_type = "VRAM"

    def __init__(self, nbytes: int, *, device_id: int = 0, fill: int | None = None):
        nbytes = _check_nbytes(nbytes)
        fill = _check_fill(fill)  # before allocating device memory
        try:
            import cupy as cp
        except ImportError as e:  # pragma: no cover - CPU machines
            raise ImportError("DeviceBuffer needs CuPy (pip install 'dcp-jax[gpu]')") from e
        if not isinstance(device_id, (int, np.integer)) or device_id < 0:
            raise ValueError(f"{device_id=} must be a non-negative int")
        self.device_id = int(device_id)
        with cp.cuda.Device(self.device_id):
            self.array = cp.zeros(nbytes, cp.uint8)
            if fill is not None:
                self.array.fill(fill)
            cp.cuda.runtime.deviceSynchronize()

    @property
    def addr(self) -> int:
        """Device address of byte 0."""
        return int(self.array.data.ptr)

    def as_jax(self, dtype=None, *, offset: int = 0, nbytes: int | None = None):
        """Import bytes `[offset, offset + nbytes)` into JAX by DLPack, zero-copy.

        Donating the result to a jitted call with `input_output_aliases` writes into this
        memory and consumes the handle: call `as_jax` again for the next call.

        Args:
            dtype: integer element dtype (CuPy has no bfloat16: use uint16 and bitcast in JAX).
            offset, nbytes: byte range (default: the whole buffer).

        Returns:
            A 1-D `jax.Array` on the GPU whose data pointer is `addr + offset`.

        Raises:
            ValueError: range outside the buffer or misaligned for `dtype`.
        """
        return self._import_jax(dtype, offset, nbytes)

    def __repr__(self) -> str:
        return (f"DeviceBuffer(addr=0x{self.addr:x}, nbytes={self.nbytes:,}, "
                f"device_id={self.device_id})")


__all__ = ["ArrayBuffer", "DeviceBuffer", "HOST_ALIGN_BYTES", "HostArrayBuffer", "HostBuffer", "MEM_TYPES"]
