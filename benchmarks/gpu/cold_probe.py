"""Probe (GPU): what makes the fused launch's jitted dispatch slow after an idle spell.

Back to back, the fan-out's dispatch (indices already on the device) costs ~0.1-0.25 ms of host
time on the H200 host; after the process was idle for 0.3 s, sleeping or spinning, ~0.6 ms
(`stage_probe.py`). Here, after 0.3 s of sleep, something is done, 1 ms passes (a sender's
planning), then the dispatch is timed:

- ``nothing``: the idle case;
- ``jit_same_thread``: a tiny jitted call dispatched (not waited for) on this thread;
- ``jit_other_thread``: the same from another thread;
- ``cuda_query``: a CUDA stream query through CuPy (the driver, not JAX);
- ``hot``: no sleep at all (back to back).

Prints one JSON line: median host us of the timed dispatch per case, and of the nudge itself.
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

    from pallas_kernels import fanout as fo
    from stage_probe import job_shape

    _, _, source, copiers, jobs = job_shape()
    windows = [(k, s_, d_) for k, (_, s_, d_) in enumerate(jobs)]
    cfg = copiers[0].config
    sidx, didx, table = (jnp.asarray(a) for a in fo._layout(windows, cfg.block_rows))
    src = source.stacked_groups()[0]
    dests = [c.destinations() for c in copiers]
    static = dict(first_layer=0, dst_rows=tuple(c.uniform_rows for c in copiers), config=cfg, backend="triton")

    def real():
        outs = fo._fanout_jit(src, sidx, tuple(d.handles[0] for d in dests), didx, table, **static)
        for d, o in zip(dests, outs):
            d.keep([o])

    tiny = jax.jit(lambda x: x + 1)
    one = jnp.ones(8, jnp.int32)
    tiny(one).block_until_ready()
    stream = cp.cuda.Stream(non_blocking=True)

    def nudge_other():
        t = threading.Thread(target=lambda: tiny(one))
        t.start()
        return t

    nudges = {"nothing": lambda: None, "jit_same_thread": lambda: tiny(one),
              "jit_other_thread": nudge_other, "cuda_query": lambda: stream.done}
    real()
    out = {}
    for name, nudge in list(nudges.items()) + [("hot", None)]:
        ts, ns = [], []
        for _ in range(9):
            cp.cuda.runtime.deviceSynchronize()
            jax.block_until_ready([d.handles[0] for d in dests])
            if nudge is not None:
                time.sleep(0.3)
                t = time.perf_counter()
                nudge()
                ns.append(time.perf_counter() - t)
                end = time.perf_counter() + 1e-3
                while time.perf_counter() < end:
                    pass
            t = time.perf_counter()
            real()
            ts.append(time.perf_counter() - t)
        out[name] = dict(dispatch_us=float(np.median(ts[2:]) * 1e6),
                         nudge_us=float(np.median(ns[2:]) * 1e6) if ns else 0.0)
        print(name, out[name], flush=True)
    print("COLD_PROBE", json.dumps(out))


if __name__ == "__main__":
    main()
