"""Probe (GPU): is the fused fan-out slower after other processes used the GPU?

In the main job the fan-out kernel took 1.455 ms (CUPTI in the prefill process, 2026-12-04; an
earlier session's sample 1.459 ms), against 1.13 ms for the same shape back to back in one
process, also into 8 other processes' IPC-mapped memory (`ipc_probe.py`). Between two timed
requests each decode process of the job fills its pool (a 360 MB memset in its own CUDA
context) and verifies it. Here, the job's round (`ipc_probe`'s shape, its destinations in 8
child processes), each launch 30 ms after the last:

- ``idle``: the children do nothing on the GPU;
- ``busy``: each child fills its 360 MB buffer every 20 ms (its own context, as the job's
  decode ranks between requests);
- ``hot``: back to back (the earlier probes' condition).

Prints CTX_PROBE {json}: the median fan-out kernel time (us, CUPTI) of each.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ipc_probe import _CHILD, D, L, open_children, round_shape  # noqa: E402

_BUSY = _CHILD.replace("time.sleep(120)", """end = time.monotonic() + 100
while time.monotonic() < end:
    buf.fill(0x5A)
    cp.cuda.runtime.deviceSynchronize()
    time.sleep(0.02)""")


def _kernels(fn, sync, reps: int, gap_s: float):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if gap_s:
                time.sleep(gap_s)
            fn()
            sync()
    ds = [e.time_range.end - e.time_range.start for e in prof.events()
          if e.device_type == DeviceType.CUDA and "fanout" in e.name]
    return dict(median_us=round(float(np.median(ds)), 1), n=len(ds),
                all_us=[round(x, 1) for x in ds]) if ds else None


def main() -> None:
    import cupy as cp

    from pallas_kernels import RowCopier, copy_fanout
    from stage_probe import child_processes

    sync = cp.cuda.runtime.deviceSynchronize
    src_buf, source, rows = round_shape()
    out = {}
    for name, child in (("idle", _CHILD), ("busy", _BUSY)):
        with child_processes(child, D) as lines:
            maps = open_children(lines)
            copiers = [RowCopier(source, [m.arrays[0][l] for l in range(L)]) for m in maps]
            jobs = [(c, s, d) for c, (s, d) in zip(copiers, rows)]
            fan = lambda: copy_fanout(jobs, checked=True)  # noqa: E731
            out[name] = _kernels(fan, sync, 12, 0.03)
            if name == "idle":
                out["hot"] = _kernels(fan, sync, 12, 0.0)
            for c in copiers:
                c.close()
            for m in maps:
                m.close()
    print("CTX_PROBE", json.dumps(out))


if __name__ == "__main__":
    main()
