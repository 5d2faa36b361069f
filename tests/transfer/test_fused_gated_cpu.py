"""The fused path gated on the sender's IPC event, on the CPU: the event itself is the stand-in.

On a GPU the sender records a CUDA IPC event after its copy kernel and sends ``fused_done
(gated=True)`` at once; each rank credits its rows only once its opened copy of that event
completed (`bridge.ipc_event`). Here one host object plays the sender's `SignalEvent` and every
rank's `OpenedEvent` (its ``done`` is what the test says), over the host mapping of
`test_region_fused_cpu`; the control plane, the crediting, the endings and the engines are real.
"""
import threading
import time

import numpy as np
import pytest

from conftest import TransferStatus
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._receiver_links import _open_event
from dcp_jax.transfer._sender_region import SenderRegion
from dcp_jax.transfer.spec import HandshakeError
from test_region import cluster, wait_for
from test_region_fused_cpu import fused_on_host  # noqa: F401 - the fixture

S = TransferStatus


class _HostEvent:
    """Both ends of one IPC event: the sender records, the ranks ask ``done``."""

    handle = bytes(range(64))

    def __init__(self):
        self.fired = threading.Event()
        self.records, self.record_error, self.error, self.opened, self.closed = 0, None, None, 0, 0

    def record_after(self, arrays):
        if self.record_error is not None:
            raise self.record_error
        assert arrays == []  # host copiers: complete when they return, nothing to wait on
        self.records += 1

    def done(self):
        if self.error is not None:
            raise self.error
        return self.fired.is_set()

    def close(self):
        self.closed += 1


@pytest.fixture
def event(monkeypatch, fused_on_host):  # noqa: F811 - the fixture imported above
    ev = _HostEvent()

    def handle(self):
        self._signal = ev
        return ev.handle

    def open_(h):
        assert h == ev.handle  # what the sender offered in hello_ack, unchanged
        ev.opened += 1
        return ev

    import bridge.ipc_event

    monkeypatch.setattr(SenderRegion, "_signal_handle", handle)
    monkeypatch.setattr(bridge.ipc_event, "OpenedEvent", open_)
    return ev


def _kinds(c):
    """Records (kind, gated) of every fused_done the sender sends."""
    seen, orig = [], c.sender._ctl.send

    def send(ident, frame):
        m = proto.decode(frame)
        if m["k"] == "fused_done":
            seen.append(m["gated"])
        return orig(ident, frame)

    c.sender._ctl.send = send
    return seen


def test_ranks_credit_gated_rows_only_once_the_event_completed(engine, event):
    c = cluster(engine, dcp_size=2, mode="fused", region_bytes=0)
    try:
        assert event.opened == 2
        gated = _kinds(c)
        L = 29
        src, dst = c.tables(L)
        c.expect("g", dst, L)
        c.sender.send("g", src, 0, L)
        assert wait_for(lambda: len(gated) == 2 and all(r._gated for r in c.receivers)), gated
        assert gated == [True, True] and event.records >= 1
        time.sleep(0.2)  # told, copied on the host, but the event has not completed
        assert [r.poll("g").terminal for r in c.receivers] == [False, False]
        event.fired.set()
        assert c.wait("g") == [S.SUCCESS] * 3, c.reasons("g")
        assert c.check_bytes(src, dst, L) == L
        assert all(not r._gated for r in c.receivers)
    finally:
        c.close()
    assert event.closed == 3  # each rank released its opened copy with its link, the sender its own


def test_an_event_error_fails_the_request_on_that_rank(engine, event):
    from bridge.ipc_event import IpcEventError

    c = cluster(engine, dcp_size=1, mode="fused", region_bytes=0)
    try:
        event.error = IpcEventError("cudaEventQuery returned status 700")
        src, dst = c.tables(12)
        c.expect("e", dst, 12)
        c.sender.send("e", src, 0, 12)
        assert wait_for(lambda: c.receivers[0].poll("e") is S.FAILED)
        reason = c.receivers[0].failure_reason("e")
        assert "IPC event" in reason and "status 700" in reason
        assert wait_for(lambda: c.receivers[0].is_drained("e"))
    finally:
        c.close()


def test_a_record_that_fails_tells_the_ranks_after_the_wait(engine, event):
    c = cluster(engine, dcp_size=2, mode="fused", region_bytes=0)
    try:
        event.record_error = RuntimeError("cudaEventRecord refused")
        gated = _kinds(c)
        src, dst = c.tables(17)
        c.expect("r", dst, 17)
        c.sender.send("r", src, 0, 17)
        assert c.wait("r") == [S.SUCCESS] * 3, c.reasons("r")  # the event never fired: not needed
        assert gated == [False, False]
        assert c.check_bytes(src, dst, 17) == 17
    finally:
        c.close()


def test_a_gated_fused_done_from_a_sender_without_an_event_fails(engine, fused_on_host):  # noqa: F811
    from test_region_hostile import rewrite

    c = cluster(engine, dcp_size=1, mode="fused", region_bytes=0)  # the CPU sender offers no event
    try:
        assert c.receivers[0]._links[0].event is None
        rewrite(c.sender._ctl, "send", lambda m: {**m, "gated": True} if m["k"] == "fused_done" else None)
        src, dst = c.tables(9)
        c.expect("n", dst, 9)
        c.sender.send("n", src, 0, 9)
        assert wait_for(lambda: c.receivers[0].poll("n") is S.FAILED)
        assert "offered no IPC event" in c.receivers[0].failure_reason("n")
    finally:
        c.close()


def test_hello_ack_event_is_checked_before_cuda_sees_it():
    assert _open_event({"event": b"", "path": "fused"}) is None
    with pytest.raises(HandshakeError) as e:
        _open_event({"event": bytes(64), "path": "region"})
    assert e.value.field == "event" and "region path" in str(e.value)
    with pytest.raises(HandshakeError, match="64 bytes") as e:
        _open_event({"event": bytes(10), "path": "fused"})
    assert e.value.field == "event"


def test_opened_event_refuses_bad_handles_by_argument():
    from bridge.ipc_event import EVENT_HANDLE_BYTES, IpcEventError, OpenedEvent

    assert EVENT_HANDLE_BYTES == 64
    for bad in (b"", bytes(63), bytes(65), "x" * 64, None, np.zeros(64, np.uint8)):
        with pytest.raises(ValueError, match="64 bytes"):
            OpenedEvent(bad)
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(IpcEventError, match="CuPy"):
            OpenedEvent(bytes(64))
