"""GPU: the fused path's flag page (bridge.host_flag) between two real processes.

A spawned rank owns 4 GiB of zeroed CuPy layers and exports them; this process maps them,
enqueues a row copy into them (the Pallas copy kernel, ~4 ms), enqueues the flag's bump after the
copy's output WITHOUT a host wait, and tells the rank at once. The rank spins on the page and,
the moment it reads the number, checks every row: a bump that ran before the copy ended would
show rows still zero. Also: the bump leaves the host free (the page still reads the old number
right after it), and a closed flag refuses bumps and removes its page.
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
from bridge.host_flag import SharedFlag, seq_done  # noqa: E402


@pytest.fixture(scope="module")
def waiter():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_gpu_peers.flag_waiter, args=(there,), daemon=True)
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


def test_a_rank_that_waits_on_the_flag_sees_every_row(waiter):
    from pallas_kernels import RowCopier

    conn, handles = waiter
    L, R, W = _gpu_peers.FLAG_LAYERS, _gpu_peers.FLAG_ROWS, _gpu_peers.FLAG_WIDTH
    r = cp.arange(R, dtype=cp.int64)
    src = [cp.broadcast_to(((7 * l + r) % 251).astype(cp.uint8)[:, None], (R, W)).copy() for l in range(L)]
    cp.cuda.runtime.deviceSynchronize()
    flag = SharedFlag.create(device=True)
    assert flag.route == "device"
    with IpcMapping(handles, [(R, W)] * L, [np.uint8] * L) as m:
        copier = RowCopier(src, list(m.arrays))
        for trial in range(4):
            perm = np.random.default_rng().permutation(R)
            copier.copy(perm, np.arange(R), checked=True)
            seq = flag.bump_after(copier.destinations().handles[0])
            pending = not seq_done(flag.value(), seq)
            conn.send(("wait", flag.name, seq, perm))
            assert conn.poll(60)
            kind, spins, bad = conn.recv()
            assert kind == "checked" and bad == 0, (trial, spins, bad)
            assert seq == trial + 1
            if trial:  # compiled by now: the ~4 ms copy is still running right after the bump
                assert pending
        flag.synchronize()
        assert flag.value() == 4
        copier.close()
    flag.close()
    assert flag.closed and not os.path.exists(flag.path)
    with pytest.raises(RuntimeError, match="closed"):
        flag.bump_after(None)
