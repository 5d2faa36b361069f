"""Probe (GPU): where the host time of one fused fan-out launch and of one `pack_rows` call goes,
step by step, hot (back to back) and cold (after 0.3 s asleep, as the job's sender between
requests).

Each step of the two calls is wrapped with a perf_counter timer (the wrappers cost ~1 us each);
per case it prints the median us of every step and of the whole call. For `pack_rows` it also
compares host us per call with wall us per call back to back (async): a wall well above the
host time means something in the call waits for the device. Prints HOST_SPLIT {json}.
"""
from __future__ import annotations

import collections
import functools
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_T: dict = collections.defaultdict(float)


def _timed(owner, name: str, label: str | None = None) -> None:
    fn = getattr(owner, name)
    label = label or name

    @functools.wraps(fn)
    def wrapped(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _T[label] += time.perf_counter() - t
    setattr(owner, name, wrapped)


def _run(fn, reps: int, sleep_s: float, sync) -> dict:
    per = collections.defaultdict(list)
    for _ in range(reps):
        sync()
        if sleep_s:
            time.sleep(sleep_s)
        _T.clear()
        t = time.perf_counter()
        fn()
        per["call"].append(time.perf_counter() - t)
        for k, v in _T.items():
            per[k].append(v)
    skip = min(3, reps // 3)
    return {k: round(float(np.median(v[skip:])) * 1e6, 1) for k, v in per.items()}


def main() -> None:
    import cupy as cp

    from pallas_kernels import PackSource, copier, copy_fanout, device, fanout, mapped_ring, pack, pack_rows
    from pallas_kernels import _buffer_args
    from stage_probe import job_shape

    sync = cp.cuda.runtime.deviceSynchronize
    _, _, source, copiers, jobs = job_shape()
    _timed(copier.RowCopier, "check_pair")
    _timed(copier.RowCopier, "fans_out_with")
    _timed(fanout, "_check_distinct_destinations")
    _timed(fanout, "_blocks")
    _timed(mapped_ring.MappedIndexRing, "stage_with")
    _timed(fanout, "_fanout_groups", "dispatch")
    _timed(device.Destinations, "keep")
    _timed(copier.RowCopier, "destinations")
    _timed(PackSource, "stacked_groups")
    fan = lambda: copy_fanout(jobs, checked=True)  # noqa: E731
    fan()
    sync()
    out = {"fanout_hot": _run(fan, 40, 0.0, sync), "fanout_cold": _run(fan, 15, 0.3, sync)}

    L, R, W8, n = 61, 32768, 1152, 4096
    sep = [cp.random.randint(0, 256, (R, W8), dtype=cp.uint8) for _ in range(L)]
    one = cp.random.randint(0, 256, (L, R, W8), dtype=cp.uint8)
    one_layers = [one[l] for l in range(L)]
    src_one = PackSource(one_layers)
    pk = cp.zeros(n * L * W8, cp.uint8)
    idx = np.sort(np.random.default_rng(0).choice(R, n, replace=False))
    _timed(pack, "_resolve")
    _timed(pack, "check_indices")
    _timed(pack, "check_range")
    _timed(pack, "check_word_offset")
    _timed(pack, "stage_indices")
    _timed(pack, "_gather_rows_slot_jit", "dispatch")
    _timed(pack, "kernel_sources")
    _timed(device, "destinations")
    _timed(PackSource, "device_views")
    del _buffer_args
    for name, layers in (("list", sep), ("one_buffer_list", one_layers), ("pack_source", src_one)):
        call = functools.partial(pack_rows, layers, idx, pk, sync=False)
        call()
        sync()
        out[f"pack_{name}_hot"] = _run(call, 60, 0.0, sync)
        out[f"pack_{name}_cold"] = _run(call, 10, 0.3, sync)
        sync()
        t = time.perf_counter()
        for _ in range(300):
            call()
        host = (time.perf_counter() - t) / 300
        sync()
        wall = (time.perf_counter() - t) / 300
        out[f"pack_{name}_b2b"] = dict(host_us=round(host * 1e6, 1), wall_us=round(wall * 1e6, 1))
    print("HOST_SPLIT", json.dumps(out))


if __name__ == "__main__":
    main()
