"""CUDA IPC events: a writer's "the copy has ended" that another process of the host waits on.

The fused path's sender enqueues one kernel that writes every decode rank's pages through their
IPC-mapped memory (`bridge.cuda_ipc.IpcMapping`). Waiting for that kernel on the sender's host
and only then messaging each rank put ~0.5 ms of host wait, message and wake-up after the copy's
end (H200 timelines, 2026-12-02). With an event the sender says ``fused_done`` right after the
launch and each rank, before it counts the rows as landed, waits for the sender's event:

    # sender (writes)                               # receiver (owns the pages)
    sig = SignalEvent()                             ev = OpenedEvent(sig_handle_from_hello_ack)
    send(sig.handle)            # once, handshake   ...
    outs = kernel(...)                              on fused_done(gated=True):
    sig.record_after([outs[0]]) # no host wait          while not ev.done(): poll again soon
    send(fused_done)                                    rows landed

`record_after` makes the signal's own CuPy stream wait for each JAX array's producing kernel
through DLPack's ``stream`` argument (``jax.Array.__dlpack__(stream=...)``: the producer makes
the consumer's stream wait, without blocking the host; measured on the H200: ~50 us of host
time, the event still pending afterwards), then records the event on that stream.

Caveat (measured, unexplained): in the connector's fused path at 9.21 GB on one H200, ranks saw the
event complete 0.7-2.8 ms after the launch of a copy that needs >= 4.4 ms, so the connector does not
use the gate by default (`dcp_jax.transfer._sender_region.FUSED_EVENT_GATE`); the 1 GB two-process
test (tests/gpu/test_ipc_event_gpu.py) and the 2.30 GB job did not show it.

Conventions (CUDA runtime API): an event shared between processes is created with
``cudaEventInterprocess | cudaEventDisableTiming`` (`cudaIpcGetEventHandle` refuses others), its
handle is 64 bytes (``CUDA_IPC_HANDLE_SIZE``); ``cudaEventQuery`` answers for the last record
made before the query, so a rank that queries after the message (sent after the record) waits
for that copy or a later one, never for less. A receiver's event handle is a peer's message:
`OpenedEvent` checks its type and length before CUDA sees it.
"""
from __future__ import annotations

import threading
from typing import Any

from bridge.errors import BridgeError

__all__ = ["EVENT_HANDLE_BYTES", "IpcEventError", "OpenedEvent", "SignalEvent"]

#: Bytes of a cudaIpcEventHandle_t (CUDA_IPC_HANDLE_SIZE).
EVENT_HANDLE_BYTES = 64
_NOT_READY = 600  # cudaErrorNotReady


class IpcEventError(BridgeError):
    """CUDA refused an IPC event operation (create, export, open, query), or CuPy is missing."""


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise IpcEventError("CUDA IPC events need CuPy (pip install 'dcp-jax[gpu]')") from e
    return cupy


class SignalEvent:
    """The writer's event and the stream it is recorded on.

    Args:
        device_id: the CUDA device of the arrays it will be recorded after (None: the current
            one).

    Owns both; `close` releases them (idempotent). Thread-safe: one record at a time.

    Raises:
        IpcEventError: no CuPy, or CUDA cannot create or export an interprocess event.
    """

    def __init__(self, device_id: int | None = None):
        cp = _cupy()
        try:
            with cp.cuda.Device(device_id if device_id is not None else cp.cuda.runtime.getDevice()):
                self._stream = cp.cuda.Stream(non_blocking=True)
                self._event = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
            self.handle: bytes = bytes(cp.cuda.runtime.ipcGetEventHandle(self._event.ptr))
        except Exception as exc:  # noqa: BLE001 - CuPy raises its CUDARuntimeError
            raise IpcEventError(f"cannot create an interprocess CUDA event: {type(exc).__name__}: {exc}") from exc
        if len(self.handle) != EVENT_HANDLE_BYTES:
            raise IpcEventError(f"cudaIpcGetEventHandle gave {len(self.handle)} bytes, not {EVENT_HANDLE_BYTES}")
        self._lock = threading.Lock()
        self.records = 0

    def record_after(self, arrays) -> None:
        """Records the event once every kernel that produced `arrays` has ended, without a host
        wait.

        Args:
            arrays: JAX arrays on this device (their producers are awaited through DLPack's
                ``stream`` argument) or CuPy arrays (awaited by an event on CuPy's current
                stream, where CuPy enqueued their writes).

        Raises:
            RuntimeError: `close()`d.
            IpcEventError: an array of another kind, or CUDA refused the wait or the record.
        """
        cp = _cupy()
        with self._lock:
            if self._event is None:
                raise RuntimeError("this SignalEvent is closed")
            try:
                for a in arrays:
                    if isinstance(a, cp.ndarray):
                        self._stream.wait_event(cp.cuda.get_current_stream().record())
                    elif hasattr(a, "__dlpack__") and hasattr(a, "block_until_ready"):
                        a.__dlpack__(stream=self._stream.ptr)  # the capsule is dropped unused
                    else:
                        raise IpcEventError(f"record_after takes JAX or CuPy arrays, got {type(a).__name__}")
                self._event.record(self._stream)
            except IpcEventError:
                raise
            except Exception as exc:  # noqa: BLE001 - CUDA or XLA refused: the caller waits on the host
                raise IpcEventError(f"cannot record the event: {type(exc).__name__}: {exc}") from exc
            self.records += 1

    def synchronize(self) -> None:
        """Host wait for the last record (tests, tools)."""
        with self._lock:
            if self._event is not None:
                self._event.synchronize()

    def close(self) -> None:
        """Releases the event and the stream (idempotent). Opened copies in other processes stay
        valid until they close them (CUDA keeps the event alive)."""
        with self._lock:
            self._event = self._stream = None

    @property
    def closed(self) -> bool:
        return self._event is None


class OpenedEvent:
    """A peer's `SignalEvent`, opened in this process (current CUDA device) from its handle.

    Args:
        handle: the 64 bytes of the peer's ``SignalEvent.handle`` (a peer's message: checked).

    Raises:
        ValueError: `handle` not bytes of `EVENT_HANDLE_BYTES`.
        IpcEventError: no CuPy, or CUDA cannot open it (another host, a closed peer).
    """

    def __init__(self, handle: Any):
        if not isinstance(handle, (bytes, bytearray)) or len(handle) != EVENT_HANDLE_BYTES:
            raise ValueError(f"an IPC event handle is {EVENT_HANDLE_BYTES} bytes, got "
                             f"{type(handle).__name__} of {len(handle) if hasattr(handle, '__len__') else '?'}")
        cp = _cupy()
        try:
            self._ptr = int(cp.cuda.runtime.ipcOpenEventHandle(bytes(handle)))
        except Exception as exc:  # noqa: BLE001 - CuPy raises its CUDARuntimeError
            raise IpcEventError(f"cannot open the peer's IPC event: {type(exc).__name__}: {exc}") from exc
        self._lock = threading.Lock()

    def done(self) -> bool:
        """True once the work before the peer's last record (made before this call) has ended.

        Raises:
            RuntimeError: `close()`d. IpcEventError: CUDA reports an error (e.g. the peer's
                context failed).
        """
        cp = _cupy()
        with self._lock:
            if self._ptr is None:
                raise RuntimeError("this OpenedEvent is closed")
            try:
                st = cp.cuda.runtime.eventQuery(self._ptr)
            except Exception as exc:  # noqa: BLE001 - CuPy raises its CUDARuntimeError
                raise IpcEventError(f"cudaEventQuery: {type(exc).__name__}: {exc}") from exc
        if st == 0:
            return True
        if st == _NOT_READY:
            return False
        raise IpcEventError(f"cudaEventQuery returned status {st}")

    def close(self) -> None:
        """Releases this process's copy of the event (idempotent)."""
        cp = _cupy()
        with self._lock:
            ptr, self._ptr = self._ptr, None
        if ptr is not None:
            try:
                cp.cuda.runtime.eventDestroy(ptr)
            except Exception:  # noqa: BLE001 - a context already torn down: nothing to release
                pass

    @property
    def closed(self) -> bool:
        return self._ptr is None
