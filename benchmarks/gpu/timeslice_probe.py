"""Probe (GPU): what sharing one GPU between processes costs, in the region path's shape.

The region path on one H200 runs 9 processes on one GPU: the sender's 8 engine writes of 288 MB
(UCX cuda_ipc copies, in the sender's CUDA context) and each decode rank's unpack kernel (in its
own context) interleave. Without MPS, kernels of different contexts never run at once: the GPU
switches between them. This probe measures that switching without any engine:

- "alone": the main process copies 8 x 288 MB device to device on one stream; each of 8 worker
  processes, in turn, copies 288 MB inside its own memory (a stand-in for its unpack's traffic);
- "together": the same work at once: the main process's 8 copies enqueued while every worker
  enqueues its copy 0.2 ms apart (as windows land), the wall time until all have finished.

Prints TIMESLICE {json}: ms of each case and the sum of the solo times, so "together" minus
that sum is what the switching cost (negative: the work overlapped).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import time

NBYTES = 288 * 1024 * 1024
WORKERS = 8


def _worker(k: int, start, done, go_at) -> None:
    import cupy as cp

    a = cp.empty(NBYTES, cp.uint8)
    b = cp.empty(NBYTES, cp.uint8)
    b[:] = k
    a[:] = b  # warm: the copy kernel loaded before anything is timed
    cp.cuda.runtime.deviceSynchronize()
    for rnd in range(2):  # 0: alone (one at a time, timed by the worker), 1: together
        start.wait()
        target = go_at.value + k * (5e-3 if rnd == 0 else 2e-4)  # alone: 5 ms apart
        while time.monotonic() < target:
            pass
        t = time.perf_counter()
        a[:] = b
        cp.cuda.runtime.deviceSynchronize()
        done.put((rnd, k, time.perf_counter() - t, time.monotonic()))


def main() -> None:
    import cupy as cp

    ctx = mp.get_context("spawn")
    start = ctx.Barrier(WORKERS + 1)
    done = ctx.Queue()
    go_at = ctx.Value("d", 0.0)
    procs = [ctx.Process(target=_worker, args=(k, start, done, go_at), daemon=True) for k in range(WORKERS)]
    for p in procs:
        p.start()
    src = cp.empty(WORKERS * NBYTES, cp.uint8)
    dst = cp.empty(WORKERS * NBYTES, cp.uint8)
    src[:] = 7
    stream = cp.cuda.Stream(non_blocking=True)

    def copies() -> None:
        with stream:
            for k in range(WORKERS):
                cp.cuda.runtime.memcpyAsync(dst.data.ptr + k * NBYTES, src.data.ptr + k * NBYTES, NBYTES,
                                            cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
        stream.synchronize()

    for _ in range(3):
        copies()  # warm
    t = time.perf_counter()
    copies()
    main_alone = time.perf_counter() - t
    # Alone: the workers one after another (each times its own copy), far apart.
    go_at.value = time.monotonic() + 0.5
    start.wait()
    solo = sorted(done.get(timeout=60) for _ in range(WORKERS))
    time.sleep(0.5)
    # Together: the main process's copies and the workers' copies at once.
    go_at.value = time.monotonic() + 0.3
    start.wait()
    while time.monotonic() < go_at.value:
        pass
    t0 = time.monotonic()
    tp = time.perf_counter()
    copies()
    main_together = time.perf_counter() - tp
    ends = [done.get(timeout=60) for _ in range(WORKERS)]
    wall = max(max(e[3] for e in ends), t0 + main_together) - t0
    for p in procs:
        p.join(10)
    solo_ms = [round(s[2] * 1e3, 3) for s in solo]
    out = dict(main_alone_ms=round(main_alone * 1e3, 3), worker_solo_ms=solo_ms,
               sum_alone_ms=round(main_alone * 1e3 + sum(solo_ms), 3),
               main_together_ms=round(main_together * 1e3, 3),
               worker_together_ms=[round(e[2] * 1e3, 3) for e in sorted(ends)],
               together_wall_ms=round(wall * 1e3, 3))
    print("TIMESLICE", json.dumps(out))


if __name__ == "__main__":
    main()
