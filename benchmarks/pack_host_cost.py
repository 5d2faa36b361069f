"""Where the host time of a per-rank `pack_rows` call on CuPy buffers goes (issue 13 item 4).

Per-call host microseconds, back-to-back calls without synchronising (the kernel is short, so
the host is what the wall clock measures), for the public call and for its pieces: the jitted
kernel entry with host or device indices, a compiled executable, the stacked (one source
buffer) form, an empty jitted function of as many arguments, and the Python work before the
dispatch. Prints a table and writes JSON (`--json`).

Both modes also time one sender round and one receiver unpack, before/after (issue 13):
`pack_rows` once per window against ONE `pack_windows` call for `--windows` windows, and
`unpack_rows` into separate layer arrays (one kernel argument and output per layer) against
layers that are views of one buffer (the flat-destination kernel), and the same two forms for
the fused path's `copy_rows` (plus, in `--cpu`, its jitted entry alone: host time to enqueue
with 61 donated destinations against one). `--cpu`: those rows only,
on numpy buffers through the interpret backend at a small geometry (the JAX dispatch on a CPU
stands in for the host part; the kernel itself is interpreted, so compare forms, not sizes).
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
    ap.add_argument("--windows", type=int, default=8, help="windows per sender round")
    ap.add_argument("--cpu", action="store_true", help="numpy buffers, interpret backend")
    args = ap.parse_args(argv)
    if args.cpu:
        return cpu_main(args)
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

    # The pieces of pack_rows' device path: the index staging alone, and the jitted entry
    # called with the staged slot's views (DLPack imports of CuPy memory) without staging.
    ring = device.index_ring(dests, m, 1)
    out["IndexRing.stage alone"] = per_call(lambda: ring.stage([idx], (n, 0, 1), dests))
    (ring_idx,), ring_meta = ring.stage([idx], (n, 0, 1), dests)
    out["jit entry, IndexRing views (no staging)"] = per_call(
        lambda: cupy_views_call(ring_idx, ring_meta))
    one = cp.concatenate([a.reshape(-1) for a in layers])
    layers_one = [one[l * R * item:(l + 1) * R * item].reshape(R, item) for l in range(L)]
    out["pack_rows async, one-buffer layers (stacked source)"] = per_call(
        lambda: pack_rows(layers_one, idx, pack, config=cfg, sync=False))

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
    out.update(round_rows(cp, layers, args.windows, 1 << 14, args.layers * item * 2 ** 16,
                          "auto", lambda: synchronize([pack]) or cp.cuda.runtime.deviceSynchronize(),
                          per_call))
    out.update(fused_round_rows(cp, layers_one, args.windows, n // args.windows, per_call))
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


def round_rows(xp, layers, windows, rows, pack_bytes, backend, sync, per_call, config=None):
    """Before/after rows: a sender round of `windows` windows of `rows // windows` rows, and a
    receiver unpack of one window into separate layers and into one buffer's views."""
    from pallas_kernels import copy_rows, pack_rows, pack_windows, unpack_rows

    R, item = int(layers[0].shape[0]), int(layers[0].shape[1])
    per = rows // windows
    rng = np.random.default_rng(1)
    stride = -(-per * item * len(layers) // 64) * 64
    wins = [(rng.integers(0, R, per).astype(np.int64), w * stride) for w in range(windows)]
    pack = xp.zeros(max(pack_bytes, windows * stride), xp.uint8)
    out = {}

    def per_window():
        for idx, off in wins:
            pack_rows(layers, idx, pack, offset=off, backend=backend, config=config, sync=False)
        sync()

    def one_call():
        pack_windows(layers, wins, pack, backend=backend, config=config, sync=False)
        sync()
    out[f"round: {windows} x pack_rows + sync"] = per_call(per_window)
    out[f"round: 1 pack_windows ({windows} windows) + sync"] = per_call(one_call)
    dst_sep = [xp.zeros((R, item), xp.uint8) for _ in layers]
    buf = xp.zeros(R * item * len(layers), xp.uint8)
    dst_one = [buf[l * R * item:(l + 1) * R * item].reshape(R, item) for l in range(len(layers))]
    idx = rng.permutation(R)[:per].astype(np.int64)
    for name, dst in ((f"unpack: {len(layers)} separate layers", dst_sep),
                      (f"unpack: {len(layers)} layers of one buffer", dst_one)):
        out[name + " + sync"] = per_call(lambda d=dst: (unpack_rows(
            pack, d, idx, offset=0, backend=backend, config=config), sync()))
    # The fused path's copy (one per decode rank per round): into separate layers, and into
    # layers of one buffer (the flat-destination kernel, `scatter._copy_flat_jit`).
    sidx = rng.integers(0, R, per).astype(np.int64)
    for name, dst in ((f"copy: {len(layers)} separate layers", dst_sep),
                      (f"copy: {len(layers)} layers of one buffer", dst_one)):
        out[name + " + sync"] = per_call(lambda d=dst: (copy_rows(
            layers, sidx, d, idx, backend=backend, config=config), sync()))
    return out


def fused_round_rows(cp, layers_one, ranks, rows, per_call):
    """The fused path's round on the GPU: `ranks` decode caches (flat, one allocation each),
    `rows` rows each, by one `RowCopier.copy` per rank against ONE `copy_fanout` launch."""
    from pallas_kernels import PackSource, RowCopier, copy_fanout, synchronize

    L, (R, item) = len(layers_one), layers_one[0].shape
    source = PackSource(layers_one)
    D = 2 * rows
    rng = np.random.default_rng(5)
    dsts, jobs = [], []
    for _ in range(ranks):
        buf = cp.zeros(L * D * item, cp.uint8)
        dst = [buf[l * D * item:(l + 1) * D * item].reshape(D, item) for l in range(L)]
        dsts.append(dst)
        jobs.append((RowCopier(source, dst), rng.integers(0, R, rows), rng.permutation(D)[:rows]))
    last = [d[0] for d in dsts]

    def per_rank():
        for c, s_, d_ in jobs:
            c.copy(s_, d_, checked=True)
        synchronize(last)

    def one_launch():
        copy_fanout(jobs, checked=True)
        synchronize(last)
    return {f"fused round: {ranks} x RowCopier.copy + sync": per_call(per_rank),
            f"fused round: 1 copy_fanout ({ranks} ranks) + sync": per_call(one_launch)}


def copy_entry_rows(layers, rows, config, reps=50):
    """Host cost of the jitted copy entry itself, JAX arrays already on the device, donated
    outputs threaded to the next call: `_copy_jit` with one destination per layer against
    `_copy_flat_jit` with one flat destination. host: the calls returned; wall: after waiting
    for the last. On a CPU the interpreted kernel runs mostly inside the call, so the entry is
    also timed with 0-row index vectors: the same donated arguments and aliased outputs, no
    kernel (the dispatch cost alone)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import bucket_rows
    from pallas_kernels.row_copy import preload_lowering
    from pallas_kernels.scatter import _copy_flat_jit, _copy_jit

    L, (R, item) = len(layers), layers[0].shape
    W = item // 4
    rng = np.random.default_rng(2)
    m = bucket_rows(rows, config.block_rows)
    pad = np.zeros((2, m), np.int32)
    pad[0, :rows], pad[1, :rows] = rng.integers(0, R, rows), rng.permutation(R)[:rows]
    src = tuple(jnp.asarray(np.ascontiguousarray(a).view(np.uint32)) for a in layers)
    meta = jnp.asarray([rows, 0, 1], jnp.int32)
    kw = dict(config=config, backend="interpret")
    preload_lowering("interpret")
    st = {"sep": tuple(jnp.zeros((R, W), jnp.uint32) for _ in range(L)),
          "one": jnp.zeros(L * R * W, jnp.uint32)}
    out = {}
    for label, k in (("", m), (", 0 rows (dispatch only)", 0)):
        si, di = jnp.asarray(pad[0, :k]), jnp.asarray(pad[1, :k])

        def sep(si=si, di=di):
            st["sep"] = _copy_jit(src, si, st["sep"], di, meta, **kw)

        def one(si=si, di=di):
            st["one"] = _copy_flat_jit(src, si, st["one"], di, meta, layers=((R, W),) * L, **kw)
        for name, fn, key in ((f"copy jit entry: {L} destinations{label}", sep, "sep"),
                              (f"copy jit entry: 1 flat destination{label}", one, "one")):
            fn()
            jax.block_until_ready(st[key])
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            host = (time.perf_counter() - t0) / reps * 1e6
            jax.block_until_ready(st[key])
            out[name] = {"host_us": host, "wall_us": (time.perf_counter() - t0) / reps * 1e6}
    return out


def cpu_main(args):
    """`--cpu`: the round rows on numpy buffers, interpret backend (see the module docstring)."""
    from pallas_kernels import GatherConfig

    L, R, item = args.layers, 256, 64
    rng = np.random.default_rng(0)
    layers = [rng.integers(0, 256, (R, item), dtype=np.uint8) for _ in range(L)]

    def per_call(fn, reps=20):
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        us = (time.perf_counter() - t0) / reps * 1e6
        return {"host_us": us, "wall_us": us}
    out = round_rows(np, layers, args.windows, 8 * args.windows, 0, "interpret", lambda: None,
                     per_call, GatherConfig(block_rows=8))
    out.update(copy_entry_rows(layers, 8, GatherConfig(block_rows=8), reps=200))
    for k, v in out.items():
        print(f"{k:<60} host {v['host_us']:10.1f} us   wall {v['wall_us']:10.1f} us", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"mode": "cpu-interpret", "per_call": out},
                                              indent=1))


if __name__ == "__main__":
    main()
