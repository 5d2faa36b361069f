"""Where one pack's time goes on a GPU: wall clock against kernel time, and the generated code.

    python benchmarks/pack_probe.py --json probe.json [--dump DIR] [--ncu-target]

`benchmarks/pack.py` times back-to-back calls with a host clock: each sample also carries the
latency of its first launch and its final synchronisation, which differs between launchers (a
jitted JAX call, a `triton.jit` launch, a torch op). This probe times the same variants on the
DeepSeek-V3 32,768-row pack three ways, side by side:

- wall/10 and wall/100: host clock over 10 and 100 back-to-back calls, device synchronised;
- slope: (wall over 100 calls - wall over 10 calls) / 90, the steady-state cost of one more call;
- kernel: the kernels' own durations recorded by CUPTI (torch.profiler), summed per call.

It also gathers from a source under 4 GiB, where Pallas computes gather offsets in 32 bits
(the full source is 18.4 GB: 64-bit offsets), so the offset width's share shows up. `--dump`
writes the peer's PTX and cubin (ours come from `XLA_FLAGS=--xla_dump_to`); `--ncu-target`
only runs each kernel twice, for `ncu`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from benchmarks.triton_peer import row_gather_kernel

POISON = 0xA5A5A5A5


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--dump", default=None, help="write the peer's PTX/cubin here")
    ap.add_argument("--ncu-target", action="store_true", help="run each kernel twice, no timing")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--src-rows", type=int, default=262144)
    ap.add_argument("--small-src-rows", type=int, default=40960)
    args = ap.parse_args(argv)

    import cupy as cp
    import jax
    import jax.numpy as jnp
    import torch
    import triton

    from pallas_kernels import GatherConfig, gather_rows

    L, item, n, R, Rs = 61, 1152, args.rows, args.src_rows, args.small_src_rows
    W = item // 4
    region = L * n * W
    bytes_rw = 2 * region * 4

    def sync():
        cp.cuda.runtime.deviceSynchronize()

    _row_gather = row_gather_kernel()  # the triton.jit peer

    rs = cp.random.RandomState(1)

    def layers(rows):
        return [rs.randint(0, 2**32, size=(rows, W), dtype=cp.int64).astype(cp.uint32)
                for _ in range(L)]

    big = jnp.stack([jax.dlpack.from_dlpack(a) for a in layers(R)])
    small_list = [jax.dlpack.from_dlpack(a) for a in layers(Rs)]
    small = jnp.stack(small_list)
    # stride 8 where it fits (the DCP-8 token round-robin pack); the small source holds fewer
    # rows, so both get the same random sorted rows below Rs there.
    idx_np = np.sort(np.random.default_rng(0).choice(Rs, n, replace=False)).astype(np.int32)
    idx_stride = (np.arange(n) * 8).astype(np.int32)
    idx_rand = jnp.asarray(idx_np)
    idx_s8 = jnp.asarray(idx_stride)
    n_dev = jnp.asarray(n, jnp.int32)
    C0 = 1 << (W.bit_length() - 1)

    variants = {}

    def pallas(src, idx, cfg):
        st = {"p": jnp.full((region + 1024,), POISON, jnp.uint32)}

        def step():
            st["p"] = gather_rows(src, idx, st["p"], n_dev, config=cfg, backend="triton")
        return step, lambda: st["p"], (lambda: st["p"].block_until_ready())

    def peer(src, idx, BR, nw):
        src_t = torch.from_dlpack(src).view(torch.int32)
        idx_t = torch.from_dlpack(idx)
        out_cp = cp.full(region + 1024, POISON, cp.uint32)
        out_t = torch.from_dlpack(out_cp).view(torch.int32)
        Rsrc = int(src.shape[1])

        def step():
            _row_gather[(triton.cdiv(n, BR), L)](src_t, idx_t, out_t, n, Rsrc, W=W, C0=C0,
                                                 C1=W - C0, BLOCK_R=BR, num_warps=nw)
        return step, lambda: jax.dlpack.from_dlpack(out_cp), None

    cfg_il = GatherConfig(block_rows=64, num_warps=8, interleave=True)
    cfg_def = GatherConfig()
    variants["ours stacked 64x8 il, big src, stride8"] = pallas(big, idx_s8, cfg_il)
    variants["ours stacked 32x8, big src, stride8"] = pallas(big, idx_s8, cfg_def)
    variants["peer 64x8, big src, stride8"] = peer(big, idx_s8, 64, 8)
    variants["peer 32x8, big src, stride8"] = peer(big, idx_s8, 32, 8)
    variants["ours stacked 64x8 il, big src, rand<Rs"] = pallas(big, idx_rand, cfg_il)
    variants["ours stacked 64x8 il, small src (32-bit)"] = pallas(small, idx_rand, cfg_il)
    variants["ours stacked 32x8, small src (32-bit)"] = pallas(small, idx_rand, cfg_def)
    variants["ours list 32x8, small src"] = pallas(small_list, idx_rand, cfg_def)
    variants["peer 64x8, big src, rand<Rs"] = peer(big, idx_rand, 64, 8)
    variants["peer 64x8, small src"] = peer(small, idx_rand, 64, 8)
    take = jax.jit(lambda s, i: jnp.take(s, i, axis=1))
    tk = {"o": None}

    def take_step():
        tk["o"] = take(big, idx_s8)
    variants["xla take, big src, stride8"] = (take_step, lambda: tk["o"].reshape(-1),
                                              lambda: tk["o"].block_until_ready())
    a = cp.asarray(jnp.take(big, idx_s8, axis=1).reshape(-1))
    b = cp.empty_like(a)
    at, bt = torch.from_dlpack(a).view(torch.int32), torch.from_dlpack(b).view(torch.int32)
    variants["copy torch (ceiling)"] = (lambda: bt.copy_(at), lambda: jax.dlpack.from_dlpack(b),
                                        None)

    refs = {
        "stride8": jnp.take(big, idx_s8, axis=1).reshape(-1),
        "big_rand": jnp.take(big, idx_rand, axis=1).reshape(-1),
        "small_rand": jnp.take(small, idx_rand, axis=1).reshape(-1),
    }

    def ref_for(name):
        if "stride8" in name or "ceiling" in name:
            return refs["stride8"]
        return refs["small_rand"] if "small" in name else refs["big_rand"]

    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        for BR in (32, 64):
            try:
                k = _row_gather.warmup(torch.from_dlpack(big).view(torch.int32),
                                       torch.from_dlpack(idx_s8),
                                       torch.empty(8, dtype=torch.int32, device="cuda"), n, R,
                                       W=W, C0=C0, C1=W - C0, BLOCK_R=BR, num_warps=8, grid=(1,))
                for key in ("ptx", "ttgir", "llir"):
                    with open(os.path.join(args.dump, f"peer_br{BR}.{key}"), "w") as f:
                        f.write(k.asm[key])
                with open(os.path.join(args.dump, f"peer_br{BR}.cubin"), "wb") as f:
                    f.write(k.asm["cubin"])
            except Exception as e:  # noqa: BLE001
                print(f"peer dump BR={BR}: {type(e).__name__}: {e}", flush=True)

    rows = []
    for name, (step, out, block) in variants.items():
        step()
        if block:
            block()
        sync()
        exact = bool(jnp.array_equal(jnp.asarray(out())[:region], ref_for(name)))
        if args.ncu_target:
            step()
            sync()
            print(f"{name}: exact={exact}", flush=True)
            continue

        def wall(iters, step=step, block=block):
            samples = []
            for _ in range(args.repeats):
                sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    step()
                if block:
                    block()
                sync()
                samples.append((time.perf_counter() - t0) / iters)
            return float(np.median(samples))

        w10 = wall(10)
        w100 = wall(100)
        slope = (w100 * 100 - w10 * 10) / 90
        kern = None
        try:
            from torch.profiler import ProfilerActivity, profile

            calls = 20
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    step()
                if block:
                    block()
                sync()
            ks = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
            tot_us = sum(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0) for e in ks)
            names = sorted({e.name for e in ks})
            kern = {"ms_per_call": tot_us / calls / 1e3, "kernels_per_call": len(ks) / calls,
                    "names": names[:6]}
        except Exception as e:  # noqa: BLE001
            kern = {"error": f"{type(e).__name__}: {e}"[:300]}
        row = {"variant": name, "exact": exact, "wall10_ms": w10 * 1e3, "wall100_ms": w100 * 1e3,
               "slope_ms": slope * 1e3, "kernel": kern}
        for k in ("wall10", "wall100", "slope"):
            row[k + "_gbps"] = bytes_rw / (row[k + "_ms"] / 1e3) / 1e9
        if kern.get("ms_per_call"):
            row["kernel_gbps"] = bytes_rw / (kern["ms_per_call"] / 1e3) / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)

    if rows:
        print(f"\n{'variant':<44} {'exact':>5} {'wall10':>8} {'wall100':>8} {'slope':>8} "
              f"{'kernel':>8}  (GB/s r+w; kernel = CUPTI durations)")
        for r in rows:
            print(f"{r['variant']:<44} {r['exact']!s:>5} {r['wall10_gbps']:8.0f} "
                  f"{r['wall100_gbps']:8.0f} {r['slope_gbps']:8.0f} "
                  f"{r.get('kernel_gbps', float('nan')):8.0f}  {r['kernel'].get('kernels_per_call', '')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes_rw": bytes_rw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
