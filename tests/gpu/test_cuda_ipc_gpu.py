"""GPU: CUDA IPC between two real processes (bridge.cuda_ipc), byte-exact.

A spawned exporter owns CuPy pool views at offsets inside one allocation, a CuPy array, a
`DeviceBuffer` and a JAX array, and exports their handles; this process checks and opens them,
reads the exporter's bytes, writes new ones (copies and a kernel), closes, and the exporter's own
read-back must equal what was written, with every byte outside the exported ranges untouched.
Forged handles (sizes past the allocation, random handle bytes, this process's pid) are refused
before any write and leave nothing open. JAX (XLA) buffers are VMM memory: their export is refused.
"""
import multiprocessing as mp
import os
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

sys.path.insert(0, os.path.dirname(__file__))
import _gpu_peers  # noqa: E402

from bridge import cuda_ipc  # noqa: E402
from bridge.cuda_ipc import IpcError, IpcHandle, IpcMapping, export_ipc_handles  # noqa: E402

_SHAPES = [shape for _, shape, _ in _gpu_peers.IPC_ARRAYS]
_DTYPES = [dt for _, _, dt in _gpu_peers.IPC_ARRAYS]


def _start_exporter(env=None):
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_gpu_peers.ipc_exporter, args=(there, env), daemon=True)
    proc.start()
    assert here.poll(120), "the exporter did not answer in 120 s"
    msg = here.recv()
    if msg[0] == "error":
        proc.join(5)
        pytest.fail(f"exporter failed:\n{msg[1]}")
    return here, proc, msg[1], msg[2]


def _stop(conn, proc):
    if proc.is_alive():
        conn.send(("exit",))
        conn.poll(10) and conn.recv()
        proc.join(30)


@pytest.fixture(scope="module")
def exporter():
    here, proc, payload, jax_handle = _start_exporter({"XLA_PYTHON_CLIENT_ALLOCATOR": ""})
    try:
        import msgpack
    except ImportError:  # the dicts are plain types either way; msgpack proves it where installed
        msgpack = None
    if msgpack is not None:  # the dicts cross msgpack as a control plane would carry them
        payload = [msgpack.unpackb(msgpack.packb(d), raw=False) for d in payload]
    yield here, proc, payload, jax_handle
    _stop(here, proc)


def _dump(conn) -> dict:
    conn.send(("dump",))
    assert conn.poll(60)
    kind, data = conn.recv()
    assert kind == "dump"
    return data


def test_handles_describe_the_arrays(exporter):
    _, proc, dicts, _ = exporter
    hs = [IpcHandle.from_dict(d) for d in dicts]
    assert all(h.pid == proc.pid and cuda_ipc.same_host(h) for h in hs)
    view, tail = hs[0], hs[1]
    # Two views of one pool allocation: one handle, offsets 4096 and 200000 bytes apart from it.
    assert view.handle == tail.handle and view.base == tail.base
    assert tail.offset - view.offset == _gpu_peers.TAIL_AT - _gpu_peers.VIEW_AT
    assert view.alloc_size >= _gpu_peers.BIG_BYTES
    assert [h.nbytes for h in hs] == [int(np.prod(s)) * np.dtype(d).itemsize for s, d in zip(_SHAPES, _DTYPES)]


def test_open_read_write_byte_exact(exporter):
    conn, _, dicts, _ = exporter
    init = _gpu_peers.initial_arrays()
    rng = np.random.default_rng(99)
    new = {name: rng.integers(0, np.iinfo(dt).max + 1, shape, dtype=dt) for name, shape, dt in _gpu_peers.IPC_ARRAYS}
    hs = [IpcHandle.from_dict(d) for d in dicts]
    t0 = time.perf_counter()
    m = IpcMapping(hs, _SHAPES, _DTYPES)
    open_ms = (time.perf_counter() - t0) * 1e3
    try:
        assert m.opened == len({h.handle for h in hs})
        for (name, shape, dt), a in zip(_gpu_peers.IPC_ARRAYS, m.arrays):
            assert a.shape == shape and a.dtype == dt
            np.testing.assert_array_equal(cp.asnumpy(a), init[name], err_msg=f"read {name}")
        for (name, _, _), a in zip(_gpu_peers.IPC_ARRAYS, m.arrays):
            a[...] = cp.asarray(new[name])
        u16 = m.arrays[2]
        u16 += cp.uint16(1)  # a kernel writing through the mapping too
    finally:
        m.close()
    new["u16"] = new["u16"] + np.uint16(1)
    got = _dump(conn)
    big = init["big"].copy()
    big[_gpu_peers.VIEW_AT:_gpu_peers.VIEW_AT + 65536] = new["view"]
    big[_gpu_peers.TAIL_AT:_gpu_peers.TAIL_AT + 1000] = new["tail"]
    np.testing.assert_array_equal(got["big"], big)  # the rest of the allocation untouched
    for name in ("u16", "dbuf"):
        np.testing.assert_array_equal(got[name], new[name], err_msg=name)
    np.testing.assert_array_equal(got["jax"], init["jax"])  # not exported here: untouched
    print(f"IpcMapping of {len(hs)} handles ({m.opened if not m.closed else 'closed'}): opened in {open_ms:.2f} ms")


def test_one_open_per_allocation_shared_by_mappings_and_close_idempotent(exporter):
    _, _, dicts, _ = exporter
    hs = [IpcHandle.from_dict(d) for d in dicts]
    a = IpcMapping(hs[:2])  # two handles, one allocation
    b = IpcMapping(hs[:1])
    assert a.opened == 1 and b.opened == 1
    key = (hs[0].handle, hs[0].device_id)
    assert cuda_ipc._OPENED[key][2] == 2  # one CUDA mapping, two owners
    assert a.arrays[0].data.ptr == b.arrays[0].data.ptr
    a.close()
    assert a.arrays == () and a.closed and cuda_ipc._OPENED[key][2] == 1
    a.close()  # idempotent
    assert int(b.arrays[0][0]) >= 0  # still mapped for b
    with b:
        pass
    assert key not in cuda_ipc._OPENED


def test_forged_handles_are_refused_and_leave_nothing_open(exporter):
    _, _, dicts, _ = exporter
    before = dict(cuda_ipc._OPENED)
    real = IpcHandle.from_dict(dicts[2])
    d = dict(dicts[2])
    d["alloc_size"] = real.alloc_size + (64 << 20)
    d["nbytes"] = real.alloc_size + (32 << 20)  # passes the real allocation
    with pytest.raises(IpcError, match="passes the mapped allocation"):
        IpcMapping([dicts[0], d])
    d = dict(dicts[2], handle=bytes(np.random.default_rng(1).integers(0, 256, 64, dtype=np.uint8)))
    with pytest.raises(IpcError, match="cudaIpcOpenMemHandle"):
        IpcMapping([d])
    with pytest.raises(IpcError, match="not exported here"):
        IpcMapping([dict(dicts[2], pid=os.getpid())])
    assert cuda_ipc._OPENED == before


def test_own_process_handles_view_the_memory():
    x = (cp.arange(4096) % 256).astype(cp.uint8)
    part = x[1024:2048]
    (h,) = export_ipc_handles([part])
    assert h.pid == os.getpid() and h.offset >= 1024
    with IpcMapping([h.to_dict()], [(16, 64)], [np.uint8]) as m:
        assert m.opened == 0
        assert m.arrays[0].data.ptr == part.data.ptr
        m.arrays[0][:] = 7
        cp.cuda.runtime.deviceSynchronize()
    assert int((x[1024:2048] == 7).sum()) == 1024 and int(x[1023]) == 1023 % 256


def test_export_refuses_host_memory_and_empty():
    with pytest.raises(TypeError, match=r"arrays\[0\].*host memory"):
        export_ipc_handles([np.zeros(8, np.uint8)])
    with pytest.raises(ValueError, match=r"arrays\[1\].*nothing to export"):
        export_ipc_handles([cp.zeros(8, cp.uint8), cp.zeros(0, cp.uint8)])
    with pytest.raises(ValueError, match="C-contiguous"):
        export_ipc_handles([cp.zeros((8, 8), cp.uint8)[:, ::2]])


def test_jax_arrays_are_refused_with_the_cause(exporter):
    """XLA takes VMM (cuMemCreate) memory for its buffers on jax 0.11.2 whatever
    XLA_PYTHON_CLIENT_ALLOCATOR says (default, platform, bfc, cuda_async all refused on the H200,
    2026-12-01): legacy handles cannot export it, and the export says so instead of mapping
    something else."""
    jdict = exporter[3]
    assert isinstance(jdict, str), "a JAX buffer exported: update bridge.cuda_ipc's docs and this test"
    assert jdict.startswith("IpcError: arrays[0]: cudaIpcGetMemHandle") and "VMM" in jdict


def test_exited_exporter_handle_is_refused():
    conn, proc, dicts, _ = _start_exporter()
    _stop(conn, proc)
    assert proc.exitcode == 0
    with pytest.raises(IpcError):
        IpcMapping([dicts[2]])
