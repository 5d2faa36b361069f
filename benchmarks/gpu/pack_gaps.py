"""Probe (GPU): what the device does per `pack_rows` call back to back, per source kind.

`benchmarks/pack.py` finds wall / kernel 1.2-1.4 for a layer list but up to 2.6 for a
`PackSource` of the same (one-buffer) layers, with the same kernel time. Here 60 async calls
back to back per kind under torch.profiler (CUPTI): per call, the device ops (names, us) and
the device idle time between calls, with the host us per call beside. Prints PACK_GAPS {json}.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    import cupy as cp
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pallas_kernels import PackSource, pack_rows

    L, R, W8, n, reps = 61, 32768, 1152, 4096, 60
    sync = cp.cuda.runtime.deviceSynchronize
    sep = [cp.random.randint(0, 256, (R, W8), dtype=cp.uint8) for _ in range(L)]
    one = cp.random.randint(0, 256, (L, R, W8), dtype=cp.uint8)
    kinds = {"list": sep, "one_buffer_list": [one[l] for l in range(L)],
             "pack_source": PackSource([one[l] for l in range(L)])}
    pk = cp.zeros(n * L * W8, cp.uint8)
    idx = np.sort(np.random.default_rng(0).choice(R, n, replace=False))
    out = {}
    for name, layers in kinds.items():
        for _ in range(3):
            pack_rows(layers, idx, pk, sync=False)
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(reps):
                pack_rows(layers, idx, pk, sync=False)
            host = (time.perf_counter() - t) / reps
            sync()
            wall = (time.perf_counter() - t) / reps
        evs = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
        busy = sum(e.time_range.end - e.time_range.start for e in evs)
        span = evs[-1].time_range.end - evs[0].time_range.start if evs else 0.0
        names: dict = {}
        for e in evs:
            d = names.setdefault(e.name[:48], [0, 0.0])
            d[0] += 1
            d[1] += e.time_range.end - e.time_range.start
        out[name] = dict(host_us=round(host * 1e6, 1), wall_us=round(wall * 1e6, 1),
                         device_busy_us_per_call=round(busy / reps, 1),
                         device_span_us_per_call=round(span / reps, 1),
                         ops_per_call={k: [round(c / reps, 2), round(s / max(c, 1), 1)] for k, (c, s) in names.items()})
    print("PACK_GAPS", json.dumps(out))


if __name__ == "__main__":
    main()
