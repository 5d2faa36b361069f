"""`profile_e2e`: `benchmarks/pack.py --profile-e2e`, the median time of each step of `pack_rows`
on CuPy buffers (per-rank pack), GPU only.

Moved out of `benchmarks/pack.py`, which imports it from here.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.pack_geometries import make_indices


def profile_e2e(L=61, R=32768, item=1152, n=4096, reps=50):
    """Median milliseconds of each step of `pack_rows` on CuPy buffers (per-rank pack)."""
    import cupy as cp
    import jax

    from pallas_kernels import GatherConfig, bucket_rows, gather_rows, pack_rows

    rs = cp.random.RandomState(0)
    layers = [rs.randint(0, 256, size=(R, item), dtype=cp.int32).astype(cp.uint8)
              for _ in range(L)]
    idx_np = make_indices("rank-pages", n, R)
    idx_cp = cp.asarray(idx_np)
    pack = cp.zeros(L * n * item, cp.uint8)
    words = pack.view(cp.uint32)

    def med(fn):
        fn()
        cp.cuda.runtime.deviceSynchronize()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            cp.cuda.runtime.deviceSynchronize()
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts))

    srcs = [jax.dlpack.from_dlpack(a.view(cp.uint32)) for a in layers]
    m = bucket_rows(n)
    idx_pad = jax.numpy.zeros(m, jax.numpy.int32).at[:n].set(jax.numpy.asarray(idx_np))
    n_dev = jax.numpy.asarray(n, jax.numpy.int32)
    cfg = GatherConfig()
    out = {}
    out["pack_rows cupy idx"] = med(lambda: pack_rows(layers, idx_cp, pack, config=cfg))
    out["pack_rows numpy idx"] = med(lambda: pack_rows(layers, idx_np, pack, config=cfg))
    out["import pack (dlpack)"] = med(lambda: jax.dlpack.from_dlpack(words))
    out["idx min/max sync"] = med(lambda: cp.stack([idx_cp.min(), idx_cp.max()]).get())

    def kernel_only():
        gather_rows(srcs, idx_pad, jax.dlpack.from_dlpack(words), n_dev,
                    config=cfg).block_until_ready()
    out["import + kernel + sync"] = med(kernel_only)
    state = {"p": jax.numpy.zeros(L * n * item // 4, jax.numpy.uint32)}

    def chained():
        state["p"] = gather_rows(srcs, idx_pad, state["p"], n_dev, config=cfg)
        state["p"].block_until_ready()
    out["kernel + sync (jax-owned pack)"] = med(chained)

    def chained_pyint():
        state["p"] = gather_rows(srcs, idx_pad, state["p"], n, config=cfg)
        state["p"].block_until_ready()
    out["kernel + sync, n as python int"] = med(chained_pyint)
    for k, v in out.items():
        print(f"  {k:<36} {v:8.3f} ms", flush=True)
    return out
