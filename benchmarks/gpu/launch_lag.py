"""Probe (GPU): when the fused fan-out's kernel starts on the device, counted from the host call.

`copy_fanout` in the main job's shape (`stage_probe.job_shape`) under torch.profiler (CUPTI:
the same clock for the host ranges and the device kernels), hot (back to back) and cold (after
0.3 s asleep, as the job's sender between requests). Per case, medians in us from the host
call's start: the call's return, every launch API call seen (XLA launches through the driver),
the first and the fan-out kernel's start and end on the device. Tells whether the time between
the host's "launched" and the copy's end is the kernel or a lag before it.
Prints LAUNCH_LAG {json}.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _case(fan, sync, reps: int, sleep_s: float) -> dict:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for r in range(reps):
            sync()
            if sleep_s:
                time.sleep(sleep_s)
            with record_function(f"call{r}"):
                fan()
        sync()
    evs = list(prof.events())
    calls = sorted((e for e in evs if e.name.startswith("call") and e.device_type == DeviceType.CPU),
                   key=lambda e: e.time_range.start)
    gpu = sorted((e for e in evs if e.device_type == DeviceType.CUDA and not e.name.startswith("call")),
                 key=lambda e: e.time_range.start)
    launches = sorted((e for e in evs if e.device_type == DeviceType.CPU and "aunch" in e.name),
                      key=lambda e: e.time_range.start)
    rows = []
    for k, c in enumerate(calls):
        t0 = c.time_range.start
        t1 = calls[k + 1].time_range.start if k + 1 < len(calls) else float("inf")
        mine = [g for g in gpu if t0 <= g.time_range.start < t1]
        ls = [e for e in launches if t0 <= e.time_range.start < t1]
        fan_k = [g for g in mine if "fanout" in g.name]
        rows.append(dict(
            ret=c.time_range.end - t0,
            launch_api=[(e.name[:24], round(e.time_range.start - t0, 1)) for e in ls][:6],
            first_gpu=(mine[0].time_range.start - t0) if mine else None,
            kernel_start=(fan_k[0].time_range.start - t0) if fan_k else None,
            kernel_us=(fan_k[0].time_range.end - fan_k[0].time_range.start) if fan_k else None,
            gpu_names=[g.name[:40] for g in mine][:4]))
    rows = rows[min(2, len(rows) // 3):]
    med = lambda key: round(float(np.median([r[key] for r in rows if r[key] is not None])), 1) \
        if any(r[key] is not None for r in rows) else None  # noqa: E731
    del torch
    return dict(ret_us=med("ret"), first_gpu_us=med("first_gpu"), kernel_start_us=med("kernel_start"),
                kernel_us=med("kernel_us"), sample=rows[-1])


def main() -> None:
    import cupy as cp

    from pallas_kernels import copy_fanout
    from stage_probe import child_processes, job_shape

    sync = cp.cuda.runtime.deviceSynchronize
    _, _, _, _, jobs = job_shape()
    fan = lambda: copy_fanout(jobs, checked=True)  # noqa: E731
    fan()
    sync()
    out = {"hot": _case(fan, sync, 12, 0.0), "cold": _case(fan, sync, 10, 0.3),
           "cold_3s": _case(fan, sync, 4, 3.0)}
    # Between calls, 16 GiB of other memory written (as the job's decode ranks fill and verify
    # their caches between requests): the copy's TLB and cache state cold.
    other = cp.zeros(16 << 30, cp.uint8)

    def touch_other():
        other.fill(1)
        sync()
    out["after_16g_elsewhere"] = _case(fan, touch_other, 8, 0.0)
    other = None  # freed before the next cases
    # Eight other processes holding a CUDA context on this GPU (as the job's decode ranks do),
    # idle on the device: does the copy slow down?
    code = ("import cupy, time; a = cupy.zeros(1 << 20); cupy.cuda.runtime.deviceSynchronize(); "
            "print('up', flush=True); time.sleep(60)")
    with child_processes(code, 8):
        out["hot_8_contexts"] = _case(fan, sync, 12, 0.0)
        out["cold_8_contexts"] = _case(fan, sync, 6, 0.3)
    print("LAUNCH_LAG", json.dumps(out))


if __name__ == "__main__":
    main()
