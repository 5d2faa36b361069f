"""Probe (GPU): does the fused fan-out copy slower into IPC-mapped memory than into local memory?

In the main job the fan-out kernel took ~1.46 ms (CUPTI, in the prefill process) against
~1.13 ms for the same shape into this process's own buffers (`launch_lag.py`). Here, one
process: the job's fused round (`stage_probe.job_shape`: 61 layers x 32,768 rows of 1,152 B,
8 destinations of 5,120 rows, 4,096 rows each), its destinations either local CuPy buffers or
buffers of 8 child processes opened through legacy CUDA IPC handles (`bridge.cuda_ipc`, as the
connector opens a decode rank's cache). Also a plain device copy of one destination's bytes
into each kind. Prints IPC_PROBE {json}: median kernel us of each (CUPTI via torch.profiler).
IPC_MODES="jax nixl jax_nixl" adds children that first start a JAX GPU client and/or register
their buffer with NIXL, as the job's decode processes do (``ipc_strided_<mode>``); "query" children
spin on their stream's status (driver calls, no GPU work) and "tiny" children launch a one-element
kernel every ~0.2 ms while the copy runs (another process's work time-slices the GPU);
"refill" children fill their buffer (a CuPy fill kernel, then a device sync) right before each
timed copy, as the job's decode ranks fill their pools with the sentinel before every request.
H100, 2026-12-06: jax / nixl / jax_nixl children cost nothing (1,583-1,588 us against 1,585).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

L, R, W, D, ROWS, N = 61, 32768, 1152, 8, 5120, 4096

_CHILD = f"""
import json, os, sys, time, cupy as cp
sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))!r})
from bridge.cuda_ipc import export_ipc_handles
mode = os.environ.get("IPC_CHILD", "cupy")
if "jax" in mode:  # a JAX GPU client in the child first, as in the job's decode processes
    import jax.numpy as jnp
    jnp.zeros(1).block_until_ready()
buf = cp.zeros(({L}, {ROWS}, {W}), cp.uint8)
cp.cuda.runtime.deviceSynchronize()
if "nixl" in mode:  # registered with a NIXL engine (UCX, VRAM), as the job's receivers register theirs
    from bridge import MemoryRegion
    from bridge.nixl import NixlEngine
    engine = NixlEngine("ipc-child-" + str(os.getpid()))
    engine.register([MemoryRegion(int(buf.data.ptr), int(buf.nbytes), "VRAM", 0)])
h = export_ipc_handles([buf])[0].to_dict()
h["handle"] = h["handle"].hex()
print(json.dumps(h), flush=True)
end = time.monotonic() + 120
if "tiny" in mode:  # a rank that keeps launching small kernels (async dispatch, pollers on the GPU)
    x = cp.zeros(1, cp.float32)
    while time.monotonic() < end:
        x += 1
        time.sleep(0.0002)
elif "refill" in mode:  # fill on the parent's word in a shared page, as the job's ranks do per request
    import numpy as np
    page = np.memmap(os.environ["IPC_REFILL"], np.int64, "r+", shape=(64,))
    me, seen = int(os.environ["IPC_INDEX"]), 0
    while time.monotonic() < end:
        if page[0] != seen:
            seen = int(page[0])
            buf.fill(seen & 0xFF)
            cp.cuda.runtime.deviceSynchronize()
            page[1 + me] = seen
        else:
            time.sleep(0.0001)
elif "query" in mode:  # a rank that keeps asking the driver about its stream (no GPU work)
    s = cp.cuda.Stream.null
    while time.monotonic() < end:
        s.done  # cudaStreamQuery
else:
    time.sleep(120)
"""


def _kernels(fn, sync, reps=10, match="fanout", before=None):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if before is not None:
                before()
            fn()
            sync()
    ds = [e.time_range.end - e.time_range.start for e in prof.events()
          if e.device_type == DeviceType.CUDA and match in e.name]
    return round(float(np.median(ds)), 1) if ds else None


def _refill(page) -> None:
    """Asks every "refill" child to fill its buffer and waits (10 s at most) until all have."""
    import time

    page[0] += 1
    end = time.monotonic() + 10
    while not (page[1:1 + D] == page[0]).all():
        if time.monotonic() > end:
            raise TimeoutError("a refill child did not answer in 10 s")
        time.sleep(0.0001)


def round_shape():
    """The job's fused round: (src_buf u8[L, R, W], its PackSource, rows: D (src, dst) pairs)."""
    import cupy as cp

    from pallas_kernels import PackSource

    src_buf = cp.random.randint(0, 256, (L, R, W), dtype=cp.uint8)
    source = PackSource([src_buf[l] for l in range(L)])
    rng = np.random.default_rng(7)
    perm = rng.permutation(R)
    return src_buf, source, [(perm[k * N:(k + 1) * N], rng.permutation(ROWS)[:N]) for k in range(D)]


def open_children(lines) -> list:
    """`IpcMapping`s of the buffers whose handles the children printed (one JSON line each)."""
    from bridge.cuda_ipc import IpcMapping
    from bridge.ipc_handle import IpcHandle

    maps = []
    for line in lines:
        d = json.loads(line)
        d["handle"] = bytes.fromhex(d["handle"])
        maps.append(IpcMapping([IpcHandle.from_dict(d)], [(L, ROWS, W)], [np.uint8]))
    return maps


def main() -> None:
    import cupy as cp

    from pallas_kernels import RowCopier, copy_fanout
    from stage_probe import child_processes

    sync = cp.cuda.runtime.deviceSynchronize
    src_buf, source, rows = round_shape()
    strided = [(np.arange(k, R, D)[:N], np.arange(N)) for k in range(D)]  # the job's I=1 pattern

    def run(dsts, rowset):
        copiers = [RowCopier(source, [b[l] for l in range(L)]) for b in dsts]
        jobs = [(c, s, d) for c, (s, d) in zip(copiers, rowset)]
        return lambda: copy_fanout(jobs, checked=True)

    out = {}
    local = [cp.zeros((L, ROWS, W), cp.uint8) for _ in range(D)]
    out["local_random"] = _kernels(run(local, rows), sync)
    out["local_strided"] = _kernels(run(local, strided), sync)
    out["local_memcpy"] = _kernels(lambda: local[0].__setitem__(Ellipsis, local[1]), sync, match="")
    for mode in os.environ.get("IPC_MODES", "").split():  # children made as the job's are, in steps
        os.environ["IPC_CHILD"] = mode
        page_path = f"/dev/shm/ipc_probe_refill_{os.getpid()}"
        page = np.memmap(page_path, np.int64, "w+", shape=(64,))
        with child_processes(_CHILD, D, lambda i: {"IPC_REFILL": page_path, "IPC_INDEX": str(i)}) as lines:
            maps = open_children(lines)
            before = (lambda: _refill(page)) if mode == "refill" else None
            out[f"ipc_strided_{mode}"] = _kernels(run([m.arrays[0] for m in maps], strided), sync,
                                                  before=before)
            for m in maps:
                m.close()
        os.unlink(page_path)
        print(mode, out[f"ipc_strided_{mode}"], flush=True)
    os.environ["IPC_CHILD"] = "cupy"
    with child_processes(_CHILD, D) as lines:
        maps = open_children(lines)
        remote = [m.arrays[0] for m in maps]
        out["ipc_random"] = _kernels(run(remote, rows), sync)
        out["ipc_strided"] = _kernels(run(remote, strided), sync)
        # Checked before the plain copy below overwrites destination 0.
        out["ipc_strided_bytes_ok"] = all(bool((remote[k][:, cp.asarray(d)] == src_buf[:, cp.asarray(s)]).all())
                                          for k, (s, d) in enumerate(strided))
        out["ipc_memcpy"] = _kernels(lambda: remote[0].__setitem__(Ellipsis, local[1]), sync, match="")
        for m in maps:
            m.close()
    print("IPC_PROBE", json.dumps(out))


if __name__ == "__main__":
    main()
