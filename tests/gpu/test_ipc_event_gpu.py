"""GPU: the fused path's IPC event (bridge.ipc_event) between two real processes.

A spawned rank owns zeroed CuPy layers and exports them; this process maps them, enqueues a
~1 GB row copy into them (the Pallas copy kernel, through DLPack), records its `SignalEvent`
after the kernel's output WITHOUT a host wait, and tells the rank at once. The rank polls its
`OpenedEvent` and, the moment it completed, checks every row: an event that completed before the
kernel ended would show zero rows. Also: the record leaves the host free (the event is still
pending right after it), and a closed event refuses records.
"""
import multiprocessing as mp
import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

sys.path.insert(0, os.path.dirname(__file__))
import _gpu_peers  # noqa: E402

from bridge.cuda_ipc import IpcMapping  # noqa: E402
from bridge.ipc_event import SignalEvent  # noqa: E402


@pytest.fixture(scope="module")
def waiter():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_gpu_peers.event_waiter, args=(there,), daemon=True)
    proc.start()
    assert here.poll(120), "the rank did not answer in 120 s"
    msg = here.recv()
    if msg[0] == "error":
        pytest.fail(f"rank failed:\n{msg[1]}")
    yield here, msg[1]
    if proc.is_alive():
        here.send(("exit",))
        here.poll(10) and here.recv()
        proc.join(30)


def test_a_rank_that_waits_on_the_event_sees_every_row(waiter):
    from pallas_kernels import RowCopier

    conn, handles = waiter
    L, R, W = _gpu_peers.EVENT_LAYERS, _gpu_peers.EVENT_ROWS, _gpu_peers.EVENT_WIDTH
    r = cp.arange(R, dtype=cp.int64)
    src = [cp.broadcast_to(((7 * l + r) % 251).astype(cp.uint8)[:, None], (R, W)).copy() for l in range(L)]
    cp.cuda.runtime.deviceSynchronize()
    sig = SignalEvent()
    with IpcMapping(handles, [(R, W)] * L, [np.uint8] * L) as m:
        copier = RowCopier(src, list(m.arrays))
        for trial in range(3):
            perm = np.random.default_rng().permutation(R)
            copier.copy(perm, np.arange(R), checked=True)
            sig.record_after([copier.destinations().handles[0]])
            pending = cp.cuda.runtime.eventQuery(sig._event.ptr) != 0
            conn.send(("wait", sig.handle, perm))
            assert conn.poll(60)
            kind, polls, bad = conn.recv()
            assert kind == "checked" and bad == 0, (trial, polls, bad)
            if trial:  # compiled by now: the ~1 GB copy is still running right after the record
                assert pending
        sig.synchronize()
        copier.close()
    sig.close()
    assert sig.closed
    with pytest.raises(RuntimeError, match="closed"):
        sig.record_after([])
