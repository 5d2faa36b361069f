"""Where the host time of a per-rank `pack_rows` call on CuPy buffers goes (issue 13 item 4).

Per-call host microseconds, back-to-back calls without synchronising (the kernel is short, so
the host is what the wall clock measures), for the public call and for its pieces: the jitted
kernel entry with host or device indices, a compiled executable, the stacked (one source
buffer) form, an empty jitted function of as many arguments, and the Python work before the
dispatch. Prints a table and writes JSON (`--json`).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--rows", type=int, default=4096)
    args = ap.parse_args(argv)
    import cupy as cp
    import jax
    import jax.numpy as jnp

    import pallas_kernels.pack as pack_mod
    from pallas_kernels import GatherConfig, bucket_rows, pack_rows, synchronize
    from pallas_kernels.gather import _gather_rows_jit

    L, n, R, item = args.layers, args.rows, 32768, 1152
    W = item // 4
    rs = cp.random.RandomState(0)
    layers = [rs.randint(0, 2**31, (R, W), dtype=cp.int32).view(cp.uint8) for _ in range(L)]
    idx = (np.random.default_rng(0).permutation(R)[:n]).astype(np.int32)
    pack = cp.zeros(L * n * item, cp.uint8)
    cfg = GatherConfig.default()
    out = {}

    def per_call(fn, reps=300):
        fn()
        cp.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host = (time.perf_counter() - t0) / reps * 1e6
        cp.cuda.runtime.deviceSynchronize()
        wall = (time.perf_counter() - t0) / reps * 1e6
        return {"host_us": host, "wall_us": wall}

    out["pack_rows async"] = per_call(lambda: pack_rows(layers, idx, pack, config=cfg, sync=False))
    out["pack_rows sync"] = per_call(lambda: pack_rows(layers, idx, pack, config=cfg))
    srcs = [jax.dlpack.from_dlpack(a.view(cp.uint32)) for a in layers]
    m = bucket_rows(n, cfg.block_rows)
    idx_pad = np.zeros(m, np.int32)
    idx_pad[:n] = idx
    meta = np.array((n, 0, 1), np.int32)
    idx_d, meta_d = jnp.asarray(idx_pad), jnp.asarray(meta)
    st = {"p": jnp.zeros(L * n * W, jnp.uint32)}
    kw = dict(config=cfg, backend="triton", offset_align=4)

    def jit_call(i, mt, s=srcs):
        st["p"] = _gather_rows_jit(s, i, st["p"], mt, **kw)
    out["jit entry, host idx+meta"] = per_call(lambda: jit_call(idx_pad, meta))
    out["jit entry, device idx+meta"] = per_call(lambda: jit_call(idx_d, meta_d))
    stacked = jnp.stack(srcs)
    out["jit entry stacked (1 source), device idx"] = per_call(lambda: jit_call(idx_d, meta_d, stacked))
    comp = _gather_rows_jit.lower(srcs, idx_d, st["p"], meta_d, **kw).compile()

    def comp_call():
        st["p"] = comp(srcs, idx_d, st["p"], meta_d)
    out["compiled, device idx+meta"] = per_call(comp_call)
    # The pack as pack_rows holds it: CuPy memory imported once, its handle threaded.
    from pallas_kernels import device

    dests = device.destinations([pack], np.dtype(np.uint32), [pack.nbytes])

    def cupy_pack_call(i, mt):
        dests.keep([_gather_rows_jit(srcs, i, dests.handles[0], mt, **kw)])
    out["jit entry, CuPy pack handle, device idx"] = per_call(lambda: cupy_pack_call(idx_d, meta_d))
    out["jit entry, CuPy pack handle, host idx"] = per_call(lambda: cupy_pack_call(idx_pad, meta))
    views = pack_mod._cached_device_views(layers, *pack_mod._checked(layers, True))

    def cupy_views_call(i, mt):
        dests.keep([_gather_rows_jit(views, i, dests.handles[0], mt, **kw)])
    out["jit entry, unowned views + CuPy pack, device idx"] = per_call(
        lambda: cupy_views_call(idx_d, meta_d))

    def idx_by_cupy():
        i = jax.dlpack.from_dlpack(cp.asarray(idx_pad))
        cupy_views_call(i, meta_d)
    out["  + idx by cp.asarray + dlpack per call"] = per_call(idx_by_cupy)
    out["  + idx by jnp.asarray per call"] = per_call(lambda: cupy_views_call(
        jnp.asarray(idx_pad), meta_d))
    empty = jax.jit(lambda s, i, p, mt: p, donate_argnums=(2,))

    def empty_call():
        st["p"] = empty(srcs, idx_d, st["p"], meta_d)
    out["empty jit, 61+3 args"] = per_call(empty_call)
    out["device_put idx"] = per_call(lambda: jax.device_put(idx_pad))
    real = pack_mod.gather_rows
    pack_mod.gather_rows = lambda *a, **k: a[2]
    try:
        out["pack_rows python only (no dispatch)"] = per_call(
            lambda: pack_rows(layers, idx, pack, config=cfg, sync=False))
    finally:
        pack_mod.gather_rows = real
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        pack_rows(layers, idx, pack, config=cfg, sync=False)
    prof.disable()
    synchronize([pack])
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    for k, v in out.items():
        print(f"{k:<44} host {v['host_us']:8.1f} us   wall {v['wall_us']:8.1f} us", flush=True)
    print(s.getvalue()[:6000])
    if args.json:
        Path(args.json).write_text(json.dumps({"per_call": out, "profile": s.getvalue()[:20000]},
                                              indent=1))


if __name__ == "__main__":
    main()
