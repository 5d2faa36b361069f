"""Probe (GPU): does a background keep-warm dispatch remove the fused launch's cold cost?

After an idle spell the fan-out's host time grows from ~0.1-0.25 ms to ~0.4-0.6 ms
(`cold_probe.py`: JAX's own dispatch pays it, whichever call comes first). A serving loop that
dispatches every few milliseconds would not pay it; the main job's sender idles between
requests. Here, after 0.3 s without a fan-out, the public `copy_fanout(jobs, checked=True)` of
the main job's 32,768-token round is timed (host us, and us until its kernel ended) while
another thread of the process:

- ``idle``: does nothing;
- ``jit_every_{P}ms``: dispatches a tiny jitted call every P ms (not waited for);
- ``sleep_every_0.5ms``: wakes every 0.5 ms without touching JAX (a control);
- ``hot``: no idle spell at all (back to back).

Prints one JSON line (``WARM_PROBE``): per case the median host us, median us to the kernel's
end, and the background thread's calls per second.
"""
from __future__ import annotations

import json
import threading
import time

import numpy as np


def main() -> None:
    import cupy as cp
    import jax
    import jax.numpy as jnp

    from pallas_kernels import copy_fanout
    from stage_probe import job_shape

    _, dst_bufs, _, copiers, jobs = job_shape()
    tiny = jax.jit(lambda x: x + 1)
    one = jnp.ones(8, jnp.int32)
    tiny(one).block_until_ready()
    copy_fanout(jobs, checked=True)
    cp.cuda.runtime.deviceSynchronize()

    def background(period_s, use_jax, stop, count):
        while not stop.is_set():
            if use_jax:
                tiny(one)
            count[0] += 1
            time.sleep(period_s)

    cases = [("idle", None, False), ("jit_every_0.5ms", 5e-4, True), ("jit_every_2ms", 2e-3, True),
             ("jit_every_10ms", 1e-2, True), ("sleep_every_0.5ms", 5e-4, False), ("hot", None, False)]
    out = {}
    for name, period, use_jax in cases:
        stop, count = threading.Event(), [0]
        th = None
        if period is not None:
            th = threading.Thread(target=background, args=(period, use_jax, stop, count), daemon=True)
            th.start()
        host, done = [], []
        t_start = time.perf_counter()
        for _ in range(11):
            cp.cuda.runtime.deviceSynchronize()
            if name != "hot":
                time.sleep(0.3)
            t = time.perf_counter()
            copy_fanout(jobs, checked=True)
            t1 = time.perf_counter()
            cp.cuda.runtime.deviceSynchronize()
            t2 = time.perf_counter()
            host.append(t1 - t)
            done.append(t2 - t)
        elapsed = time.perf_counter() - t_start
        stop.set()
        if th is not None:
            th.join(1.0)
        out[name] = dict(host_us=float(np.median(host[2:]) * 1e6), done_us=float(np.median(done[2:]) * 1e6),
                         host_us_all=[round(h * 1e6, 1) for h in host],
                         background_calls_per_s=round(count[0] / elapsed, 1))
        print(name, {k: v for k, v in out[name].items() if k != "host_us_all"}, flush=True)
    print("WARM_PROBE", json.dumps(out))


if __name__ == "__main__":
    main()
