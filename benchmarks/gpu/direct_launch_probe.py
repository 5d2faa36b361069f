"""Probe (GPU): can the fused fan-out launch without JAX's dispatch, and what does it save?

The fused path's whole request at 32k is ~2.4 ms for a ~1.13 ms kernel; ~0.5 ms of the rest is
JAX's cold jitted dispatch after the sender idles (`warm_probe.py`, `cold_probe.py`). Compared
here on the main job's shape (`stage_probe.job_shape`), each after 0.3 s idle (``cold``) and back
to back (``hot``): host us per call, us until its kernel ended, kernel us (CUDA events), and
whether every destination row is right.

- ``pallas_jax``: the library's `copy_fanout` (checks, mapped slot, jitted dispatch);
- ``pallas_triton``: the SAME Pallas kernel, its Triton module captured at JAX's lowering
  (`lower_jaxpr_to_triton_module`) and compiled by the ``triton`` package, launched by Triton's
  launcher on a CuPy stream after one ``memcpyAsync`` of the indices from pinned memory;
- ``cuda_raw``: a CUDA C row copy (NVRTC through CuPy), same staging and stream;
- ``cupy_tiny``: a trivial CuPy kernel launch (what any launch pays after idle).

Prints one JSON line ``DIRECT_PROBE``.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CUDA_SRC = r"""
extern "C" __global__ void fanout_rows(const int* __restrict__ table, const int* __restrict__ sidx,
        const int* __restrict__ didx, const uint4* __restrict__ src,
        const unsigned long long* __restrict__ dsts, const long long* __restrict__ dst_rows,
        long long R, int W16, int br) {
    const int b = blockIdx.x, l = blockIdx.y;
    const int k = table[4 * b], n = table[4 * b + 1], first = table[4 * b + 2], ok = table[4 * b + 3];
    if (!ok) return;
    uint4* dst = reinterpret_cast<uint4*>(dsts[k]);
    const long long Rk = dst_rows[k];
    const int rows = min(br, n - first);
    for (int i = threadIdx.x; i < rows * W16; i += blockDim.x) {
        const int j = i / W16, c = i - j * W16;
        const long long s = sidx[b * br + j], d = didx[b * br + j];
        dst[((long long)l * Rk + d) * W16 + c] = src[((long long)l * R + s) * W16 + c];
    }
}
"""


def _timed(fn, sync, reps, cold):
    host, done = [], []
    for _ in range(reps):
        sync()
        if cold:
            time.sleep(0.3)
        t = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t) * 1e6)
        done.append((t2 - t) * 1e6)
    return dict(host_us=round(float(np.median(host[2:])), 1), done_us=round(float(np.median(done[2:])), 1),
                host_all=[round(h, 1) for h in host])


def main() -> None:
    import cupy as cp
    import jax
    from jax._src.pallas.triton import pallas_call_registration as reg

    captured = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        r = orig(*a, **k)
        captured.append((r.module.operation.get_asm(), tuple(r.grid)))
        return r

    reg.lowering.lower_jaxpr_to_triton_module = capture

    from pallas_kernels import copy_fanout
    from pallas_kernels import fanout as fo
    from stage_probe import job_shape

    src_buf, dst_bufs, source, copiers, jobs = job_shape()
    out = {"jax": jax.__version__, "cupy": cp.__version__}
    sync = cp.cuda.runtime.deviceSynchronize

    def check() -> bool:
        sync()
        good = all(bool((dst_bufs[k][:, cp.asarray(d_)] == src_buf[:, cp.asarray(s_)]).all())
                   for k, (_, s_, d_) in enumerate(jobs))
        for b in dst_bufs:
            b.fill(0)
        sync()
        return good

    copy_fanout(jobs, checked=True)
    out["pallas_jax_ok"] = check()
    for cold in (True, False):
        out[f"pallas_jax_{'cold' if cold else 'hot'}"] = _timed(lambda: copy_fanout(jobs, checked=True), sync, 11, cold)
    print("pallas_jax", out["pallas_jax_cold"], out["pallas_jax_hot"], flush=True)

    cfg = copiers[0].config
    br = cfg.block_rows
    sidx, didx, table = fo._layout([(k, s_, d_) for k, (_, s_, d_) in enumerate(jobs)], br)
    m = int(sidx.shape[0])
    packed = np.concatenate([sidx, didx, table]).astype(np.int32)
    pinned_mem = cp.cuda.alloc_pinned_memory(packed.nbytes)
    pinned = np.frombuffer(pinned_mem, np.int32, packed.size)
    dev_idx = cp.empty(packed.size, cp.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    t_ptr = dev_idx.data.ptr + 2 * m * 4
    s_ptr, d_ptr = dev_idx.data.ptr, dev_idx.data.ptr + m * 4
    L, R, W = (int(x) for x in src_buf.shape)
    dst_ptrs = [int(b.data.ptr) for b in dst_bufs]
    n_blocks = m // br

    def stage():
        pinned[:] = packed
        cp.cuda.runtime.memcpyAsync(dev_idx.data.ptr, pinned.ctypes.data, packed.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, stream.ptr)

    def kernel_us(launch):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        ts = []
        for _ in range(7):
            e0.record(stream)
            launch()
            e1.record(stream)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
        return round(float(np.median(ts[2:])), 1)

    # --- the same Pallas kernel through Triton's own compiler and launcher ----------------------
    try:
        import triton

        out["triton"] = triton.__version__
        mods = [(asm, grid) for asm, grid in captured if "fanout" in asm]
        out["captured"] = len(captured)
        asm, grid = mods[-1]
        path = "/tmp/kv_copy_fanout.ttir"
        with open(path, "w") as f:
            f.write(asm)
        t = time.perf_counter()
        kern = triton.compile(path, options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        out["triton_compile_s"] = round(time.perf_counter() - t, 2)
        out["triton_grid"] = list(grid)
        gx, gy, gz = (list(grid) + [1, 1])[:3]
        args = [t_ptr, s_ptr, d_ptr, int(src_buf.data.ptr), *dst_ptrs, *dst_ptrs]

        def tri_launch():
            kern[(gx, gy, gz)](*args, stream=stream.ptr)

        def tri_call():
            stage()
            tri_launch()

        tri_call()
        out["pallas_triton_ok"] = check()
        out["pallas_triton_kernel_us"] = kernel_us(tri_launch)
        for cold in (True, False):
            out[f"pallas_triton_{'cold' if cold else 'hot'}"] = _timed(tri_call, sync, 11, cold)
            out[f"pallas_triton_launch_only_{'cold' if cold else 'hot'}"] = _timed(tri_launch, sync, 11, cold)
        print("pallas_triton", {k: v for k, v in out.items() if k.startswith("pallas_triton")}, flush=True)
    except Exception:
        out["pallas_triton_error"] = traceback.format_exc()[-3000:]
        print(out["pallas_triton_error"], flush=True)
        if captured:
            print(captured[-1][0][:3000], flush=True)

    # --- CUDA C through NVRTC ---------------------------------------------------------------------
    try:
        raw = cp.RawKernel(CUDA_SRC, "fanout_rows")
        dsts_dev = cp.asarray(np.array(dst_ptrs, np.uint64))
        rows_dev = cp.asarray(np.array([int(b.shape[1]) for b in dst_bufs], np.int64))
        W16 = W // 16

        def raw_launch():
            raw((n_blocks, L), (256,), (dev_idx[2 * m:], dev_idx[:m], dev_idx[m:2 * m], src_buf, dsts_dev,
                                       rows_dev, np.int64(R), np.int32(W16), np.int32(br)), stream=stream)

        def raw_call():
            stage()
            raw_launch()

        raw_call()
        out["cuda_raw_ok"] = check()
        out["cuda_raw_kernel_us"] = kernel_us(raw_launch)
        for cold in (True, False):
            out[f"cuda_raw_{'cold' if cold else 'hot'}"] = _timed(raw_call, sync, 11, cold)
        print("cuda_raw", {k: v for k, v in out.items() if k.startswith("cuda_raw")}, flush=True)
    except Exception:
        out["cuda_raw_error"] = traceback.format_exc()[-3000:]
        print(out["cuda_raw_error"], flush=True)

    tiny = cp.zeros(8, cp.int32)
    for cold in (True, False):
        out[f"cupy_tiny_{'cold' if cold else 'hot'}"] = _timed(lambda: tiny.__iadd__(1), sync, 11, cold)
    print("DIRECT_PROBE", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
