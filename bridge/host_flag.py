"""A completion flag in shared host memory: "the copy has ended", seen by another process of the host
with a plain memory read.

The fused path's sender enqueues one kernel that writes every decode rank's pages through their
IPC-mapped memory. Telling the ranks only after the sender's host wait put ~0.5 ms of wait and
~0.5 ms of message and wake-up after the copy's end (H200 timelines, 2026-12-02). With a flag the
sender says ``fused_done(seq=k)`` right after the launch, and a tiny jitted kernel, enqueued after
the copy and taking the copy's output as an argument, writes k into a page of pinned host memory
that every rank reads; each rank credits its rows once it reads a value at or past k:

    # sender (writes the pages)                    # receiver (owns the pages)
    flag = SharedFlag.create(device=True)          seen = OpenedFlag(name_from_hello_ack)
    send(flag.name)              # once, handshake  ...
    outs = kernel(...)                             on fused_done(gated=True, seq=k):
    k = flag.bump_after(outs[0]) # no host wait        while not seen.done(k): poll again soon
    send(fused_done(seq=k))                            rows landed

Why a kernel and not a CUDA IPC event: an event recorded on another stream after a DLPack stream
wait (``jax.Array.__dlpack__(stream=)``) completed 0.7-2.8 ms after the launch of a 9.21 GB copy
that needs >= 4.4 ms (H200, 2026-12-02): an output whose definition event XLA's dispatch had not
recorded yet orders nothing. An argument of a jitted call is always waited for by XLA, so the bump
runs after the copy on the device, whatever the host's threads do.

The page: a file under /dev/shm (``dcp_jax_flag_<pid>_<hex>``, 4,096 bytes, mode 0600) that the
writer creates, maps, registers with CUDA (``cudaHostRegisterPortable | cudaHostRegisterMapped``)
and unlinks at `close`; readers read it by name (``pread``: see `OpenedFlag`). Word 0 holds the
last sequence number (uint32, serial-number arithmetic: k is done when ``(value - k) mod 2**32 <
2**31``, RFC 1982). The device writes it through a zero-copy JAX view of the mapped pointer (a
DLPack capsule of device type kDLCUDA). On the host (no device) `bump_after` stores the number
directly after the caller's synchronous copy. A peer's name is checked against that pattern
before anything opens it; the file must be a regular file of the page's size. A sender that
crashes leaves its page behind (4 KiB; remove ``/dev/shm/dcp_jax_flag_<its pid>_*``). The page
is its writer's user's (mode 0600): ranks of another user are refused at the handshake.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import re
import secrets
import stat
import sys
import threading
from typing import Any

import numpy as np

from bridge.dlpack_pointer import PointerTensor
from bridge.errors import BridgeError

__all__ = ["FLAG_BYTES", "FlagError", "OpenedFlag", "SharedFlag", "check_flag_name", "seq_done"]

#: Bytes of a flag page (one page; the flag is its first uint32 word).
FLAG_BYTES = 4096
_DIR = "/dev/shm"
_NAME = re.compile(r"dcp_jax_flag_[0-9]{1,10}_[0-9a-f]{16}")
_MOD = 1 << 32
_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


class FlagError(BridgeError):
    """A flag page could not be made, mapped, registered or opened."""


def check_flag_name(name: Any) -> str:
    """A peer's flag name, checked (``dcp_jax_flag_<pid>_<16 hex>``); ValueError otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"a flag name is 'dcp_jax_flag_<pid>_<16 hex digits>', got {name!r:.80}")
    return name


def seq_done(value: int, seq: int) -> bool:
    """Whether a flag holding `value` has reached sequence number `seq` (both uint32; RFC 1982
    serial-number order, so the counter may wrap)."""
    return (int(value) - int(seq)) % _MOD < (_MOD >> 1)


# `bump_on_stream`: store the number, then make it visible to the host's readers.
_SET_SRC = r"""
extern "C" __global__ void dcp_flag_set(unsigned long long flag, unsigned int value) {
    *reinterpret_cast<volatile unsigned int*>(flag) = value;
    __threadfence_system();
}
"""


def _bump_fn():
    import jax
    import jax.numpy as jnp

    # keep_unused: `dep` is never read, but XLA must wait for it (the copy's output) before this runs.
    return jax.jit(lambda flag, dep: flag + jnp.uint32(1), donate_argnums=0, keep_unused=True)


class SharedFlag:
    """The writer's flag page (see the module text). Make one with `create`.

    Attributes:
        name: the page's name for a peer (``hello_ack``); path: its file.
        seq: the last number bumped (uint32; 0 before any).

    Owns the file, its mapping, its CUDA registration and the JAX view; `close` releases them
    (idempotent; waits for the last bump first). Thread-safe: one bump at a time.
    """

    def __init__(self, path: str, mm: mmap.mmap, words: np.ndarray):
        self.path, self.name = path, os.path.basename(path)
        self._mm, self._words = mm, words
        self.seq = 0
        self._lock = threading.Lock()
        self._view = self._bump = self._tensor = None
        self._registered: int | None = None
        self._set_kernel = None  # `bump_on_stream`'s kernel (compiled on first use)
        self._streams: set = set()  # the streams `bump_on_stream` enqueued on
        self.route = "host"

    @classmethod
    def create(cls, *, device: bool = False, device_id: int | None = None) -> "SharedFlag":
        """A new flag page, value 0.

        Args:
            device: bumped by a kernel on the GPU (`bump_after` takes JAX arrays) rather than by
                the host (it takes anything: the caller's copy is synchronous).
            device_id: CUDA device (None: CuPy's current one).

        Raises:
            FlagError: no /dev/shm, or (device) no CuPy, CUDA refused to register the page, or
                JAX would not view it without a copy.
        """
        path = os.path.join(_DIR, f"dcp_jax_flag_{os.getpid()}_{secrets.token_hex(8)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise FlagError(f"cannot create the flag page {path}: {exc}") from exc
        try:
            os.ftruncate(fd, FLAG_BYTES)
            mm = mmap.mmap(fd, FLAG_BYTES)
        except OSError as exc:
            os.unlink(path)
            raise FlagError(f"cannot map the flag page {path}: {exc}") from exc
        finally:
            os.close(fd)
        flag = cls(path, mm, np.frombuffer(mm, np.uint32, 1))
        if device:
            try:
                flag._attach_device(device_id)
            except BaseException:
                flag.close()
                raise
        return flag

    def _attach_device(self, device_id: int | None) -> None:
        try:
            import cupy as cp
            import jax
        except ImportError as exc:
            raise FlagError("a device flag needs CuPy and JAX (pip install 'dcp-jax[gpu]')") from exc
        rt = cp.cuda.runtime
        host = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        dev = rt.getDevice() if device_id is None else int(device_id)
        try:
            with cp.cuda.Device(dev):
                rt.hostRegister(host, FLAG_BYTES, _HOST_REGISTER_PORTABLE_MAPPED)
                self._registered = host
                dptr = int(rt.pointerGetAttributes(host).devicePointer)  # cudaHostGetDevicePointer's answer
        except Exception as exc:  # noqa: BLE001 - CuPy raises its CUDARuntimeError
            raise FlagError(f"cannot register the flag page with CUDA: {type(exc).__name__}: {exc}") from exc
        self._tensor = PointerTensor(dptr, dev)
        try:
            view = jax.dlpack.from_dlpack(self._tensor)
        except Exception as exc:  # noqa: BLE001 - XLA refused the pointer
            raise FlagError(f"JAX cannot view the mapped flag page: {type(exc).__name__}: {exc}") from exc
        if view.unsafe_buffer_pointer() != dptr or view.dtype != np.uint32:
            raise FlagError("JAX copied the mapped flag page instead of viewing it")
        self._view, self._bump, self.route = view, _bump_fn(), "device"
        try:  # `bump_on_stream`'s kernel, built now (NVRTC) rather than in a request's first round
            kernel = cp.RawKernel(_SET_SRC, "dcp_flag_set")
            with cp.cuda.Device(dev):
                kernel.compile()
            self._set_kernel = kernel
        except Exception:  # noqa: BLE001 - built on first use instead (or refused there)
            pass

    def bump_after(self, dep: Any = None) -> int:
        """Enqueues "flag = seq + 1" after whatever produced `dep`; returns that number.

        Args:
            dep: device: a JAX array on this flag's device (the copy's output: the bump runs
                once its producer has ended); host: ignored (the caller's copy has returned).

        Raises:
            RuntimeError: `close()`d. FlagError: the device bump could not be enqueued (the
                flag then stays behind: tell the ranks after a host wait instead).
        """
        with self._lock:
            if self._mm is None:
                raise RuntimeError("this SharedFlag is closed")
            nxt = (self.seq + 1) % _MOD
            if self._bump is None:
                self._words[0] = nxt
            else:
                try:
                    self._view = self._bump(self._view, dep)
                except Exception as exc:  # noqa: BLE001 - XLA refused: the caller waits on the host
                    raise FlagError(f"cannot enqueue the flag bump: {type(exc).__name__}: {exc}") from exc
            self.seq = nxt
            return nxt

    def bump_on_stream(self, stream: Any) -> int:
        """Enqueues "flag = seq + 1" on a CUDA stream, after what it already holds (the fused
        fan-out launched without JAX, `pallas_kernels.triton_launch`); returns that number. A
        one-thread kernel stores the number into the mapped page and fences it to the system.

        Args:
            stream: a CuPy stream on this flag's device.

        Raises:
            RuntimeError: `close()`d. FlagError: a host flag, or CUDA refused the kernel (the flag
                then stays behind: tell the ranks after a host wait instead).
        """
        with self._lock:
            if self._mm is None:
                raise RuntimeError("this SharedFlag is closed")
            if self._tensor is None:
                raise FlagError("a host flag is bumped by bump_after, not on a stream")
            nxt = (self.seq + 1) % _MOD
            try:
                import cupy as cp

                with cp.cuda.Device(self._tensor.device_id):  # the page's device, whatever is current
                    if self._set_kernel is None:
                        self._set_kernel = cp.RawKernel(_SET_SRC, "dcp_flag_set")
                    self._set_kernel((1,), (1,), (np.uint64(self._tensor.ptr), np.uint32(nxt)), stream=stream)
            except Exception as exc:  # noqa: BLE001 - CuPy raises its own CUDA errors
                raise FlagError(f"cannot enqueue the flag bump: {type(exc).__name__}: {exc}") from exc
            self._streams.add(stream)
            self.seq = nxt
            return nxt

    def value(self) -> int:
        """The page's word as it is now (host read)."""
        with self._lock:
            if self._mm is None:
                raise RuntimeError("this SharedFlag is closed")
            return int(self._words[0])

    def synchronize(self) -> None:
        """Host wait for the last device bump (tests, `close`)."""
        with self._lock:
            if self._view is not None:
                self._view.block_until_ready()
            for stream in self._streams:  # bumps enqueued by `bump_on_stream`
                stream.synchronize()

    def describe(self) -> dict:
        return dict(name=self.name, route=self.route, seq=self.seq)

    def close(self) -> None:
        """Waits for the last bump, then unregisters, unmaps and unlinks the page (idempotent).
        Readers keep reading it through their open file until they close it."""
        try:
            self.synchronize()
        except Exception:  # noqa: BLE001 - a failed context: release what can be released
            pass
        with self._lock:
            for stream in self._streams:  # a bump enqueued between the wait above and this lock
                try:
                    stream.synchronize()
                except Exception:  # noqa: BLE001 - a failed context: release what can be released
                    pass
            mm, self._mm = self._mm, None
            self._view = self._bump = None
            if mm is None:
                return
            if self._registered is not None:
                try:
                    import cupy as cp

                    cp.cuda.runtime.hostUnregister(self._registered)
                except Exception:  # noqa: BLE001 - a context already torn down
                    pass
                self._registered = None
            self._words = None
            try:
                mm.close()
            except BufferError:  # a numpy view still refers to it: the mapping goes with the process
                pass
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    @property
    def closed(self) -> bool:
        return self._mm is None

    def __enter__(self) -> "SharedFlag":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class OpenedFlag:
    """A peer's `SharedFlag`, read in this process by name.

    Args:
        name: the peer's ``SharedFlag.name`` (a peer's message: checked by `check_flag_name`).

    Reads go through ``pread`` of the page's file, not a mapping: tmpfs serves the very pages
    the writer mapped (and the device writes), so a read sees the last bump; and a page its
    owner shrank answers short instead of raising SIGBUS in this process (a mapped read would).

    Raises:
        ValueError: a name of another form. FlagError: no such page on this host (another host,
            another /dev/shm), not a regular file (a FIFO, a link, a directory: opened without
            blocking and refused), not a flag page's size, or not readable by this user.
    """

    def __init__(self, name: Any):
        path = os.path.join(_DIR, check_flag_name(name))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise FlagError(f"cannot open the peer's flag page {path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FlagError(f"the peer's flag page {path} is not a regular file")
            if st.st_size != FLAG_BYTES:
                raise FlagError(f"the peer's flag page {path} holds {st.st_size} bytes, not {FLAG_BYTES}")
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._lock = threading.Lock()
        self.name = name

    def value(self) -> int:
        """The peer's last number, as this process reads it now.

        Raises:
            RuntimeError: `close()`d. FlagError: the page shrank (its owner truncated it).
        """
        with self._lock:
            if self._fd is None:
                raise RuntimeError("this OpenedFlag is closed")
            word = os.pread(self._fd, 4, 0)
        if len(word) != 4:
            raise FlagError(f"the peer's flag page {self.name} shrank to {len(word)} bytes")
        return int.from_bytes(word, sys.byteorder)

    def done(self, seq: int) -> bool:
        """Whether the peer's flag has reached `seq` (`seq_done`).

        Raises:
            RuntimeError: `close()`d. FlagError: as `value`.
        """
        return seq_done(self.value(), seq)

    def close(self) -> None:
        """Closes the page's file (idempotent)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self._fd is None

    def __enter__(self) -> "OpenedFlag":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
