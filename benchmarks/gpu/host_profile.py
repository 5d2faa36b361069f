"""Probe (GPU): where the host time of the two hot calls goes, by cProfile.

1. `copy_fanout` of the fused round in the main job's shape (61 layers of 1,152 bytes, 8 decode
   ranks, 4,096 rows each: 2.30 GB) on CuPy buffers of one process.
2. A per-rank `pack_rows` (the same layers, 4,096 rows) with a `PackSource`.
3. A decode rank's `unpack_rows` as the region path's receiver calls it: its receive region into
   a one-buffer cache of 61 layers x 5,120 rows (`checked=True`, numpy rows); also "cold": one
   call after 0.3 s asleep (the receiver's worker waits between windows), median of 10; and the
   same through a `RowUnpacker` (what the receiver calls now).

Each is called back to back (`iters` times, device synchronised at the end), once plain (host us
per call, synchronised at the end; and before that wait: the enqueue time) and once under cProfile. Prints HOST_PROFILE {json}: us per call and the top functions
by own time (us per call), so the next trim aims at a measured line, not a guess.
"""
from __future__ import annotations

import cProfile
import json
import os
import pstats
import sys
import time

import numpy as np


def _top(prof: cProfile.Profile, calls: int, n: int = 25) -> list:
    st = pstats.Stats(prof)
    rows = []
    for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append((tt, ct, nc, f"{fn.rsplit('/', 2)[-2:]!s}:{line}:{name}"))
    rows.sort(reverse=True)
    return [dict(where=w, own_us=round(tt / calls * 1e6, 1), cum_us=round(ct / calls * 1e6, 1),
                 ncalls_per=round(nc / calls, 2)) for tt, ct, nc, w in rows[:n]]


def _measure(fn, sync, iters: int) -> dict:
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    enq = (time.perf_counter() - t) / iters * 1e6  # host time per call (the device may lag behind)
    sync()
    plain = (time.perf_counter() - t) / iters * 1e6
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    sync()
    prof.disable()
    return dict(host_us_per_call=round(plain, 1), enqueue_us_per_call=round(enq, 1), top=_top(prof, iters))


def main() -> None:
    import cupy as cp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from pallas_kernels import PackSource, RowCopier, copy_fanout, pack_rows

    L, R, W8, D, n = 61, 32768, 1152, 8, 4096
    src_buf = cp.random.randint(0, 256, (L, R, W8), dtype=cp.uint8)
    dst_bufs = [cp.zeros((L * n * 2, W8), cp.uint8) for _ in range(D)]
    source = PackSource([src_buf[l] for l in range(L)])
    copiers = [RowCopier(source, [b[l * 2 * n:(l + 1) * 2 * n] for l in range(L)]) for b in dst_bufs]
    rng = np.random.default_rng(0)
    jobs = [(c, np.sort(rng.choice(R, n, replace=False)), rng.permutation(2 * n)[:n]) for c in copiers]
    sync = cp.cuda.runtime.deviceSynchronize
    out = {"fanout": _measure(lambda: copy_fanout(jobs, checked=True), sync, 50)}
    pack = cp.zeros(n * L * W8, cp.uint8)
    idx = jobs[0][1]
    out["pack_rows"] = _measure(lambda: pack_rows(source, idx, pack, sync=False), sync, 200)
    from pallas_kernels import unpack_rows

    cache = cp.zeros((L, 5120, W8), cp.uint8)
    dst = [cache[l] for l in range(L)]
    rows = rng.permutation(5120)[:n].astype(np.int64)
    out["unpack_rows"] = _measure(lambda: unpack_rows(pack, dst, rows, checked=True), sync, 200)
    out["unpack_rows_cold_us"] = _cold(lambda: unpack_rows(pack, dst, rows, checked=True), sync)
    from pallas_kernels import RowUnpacker

    unpacker = RowUnpacker(pack, dst)
    out["row_unpacker"] = _measure(lambda: unpacker.unpack(rows, checked=True), sync, 200)
    out["row_unpacker_cold_us"] = _cold(lambda: unpacker.unpack(rows, checked=True), sync)
    print("HOST_PROFILE", json.dumps(out))


def _cold(fn, sync, reps: int = 10) -> float:
    """Median host time (us) of one call after 0.3 s asleep."""
    times = []
    for _ in range(reps):
        sync()
        time.sleep(0.3)
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    sync()
    return round(float(np.median(times)), 1)


if __name__ == "__main__":
    main()
