"""Probe (GPU): device time of the fused path's fan-out copy for the main job's shape, per
kernel configuration, beside a plain device copy of the same bytes.

The main job's fused request: one prefill rank's 32,768 tokens of DeepSeek-V3 (61 layers x
1,152 B rows, 2.30 GB) to 8 decode ranks (token t to rank t % 8, 4,096 rows each), written into
each rank's paged cache (pages of 64 rows, a random page table). Each configuration runs
`copy_fanout` back to back (the kernel, not the host, sets the pace: it takes ~1.4 ms against
~0.1 ms of dispatch) and is checked byte for byte once. Prints a table and one JSON line.
"""
from __future__ import annotations

import json
import time

import numpy as np


def main() -> None:
    import cupy as cp

    from pallas_kernels import GatherConfig, PackSource, RowCopier, copy_fanout

    L, W8, T, D, P, POOL = 61, 1152, 32768, 8, 64, 8192
    src_buf = cp.random.randint(0, 256, (L, T, W8), dtype=cp.uint8)
    dst_bufs = [cp.zeros((L, POOL, W8), cp.uint8) for _ in range(D)]
    source = PackSource([src_buf[l] for l in range(L)])
    rng = np.random.default_rng(7)
    rows = T // D
    jobs_idx = []
    for k in range(D):
        pages = rng.permutation(POOL // P)[: rows // P]
        j = np.arange(rows)
        jobs_idx.append((np.arange(k, T, D), pages[j // P] * P + j % P))
    nbytes = T * L * W8
    # The ceiling: one device copy of the same bytes (read + write), back to back.
    flat_src, flat_dst = src_buf.reshape(-1), cp.empty(nbytes, cp.uint8)
    cp.cuda.runtime.deviceSynchronize()
    t = time.perf_counter()
    for _ in range(10):
        cp.copyto(flat_dst, flat_src)
    cp.cuda.runtime.deviceSynchronize()
    ceiling_ms = (time.perf_counter() - t) / 10 * 1e3
    del flat_dst
    base = GatherConfig.default()
    configs = {
        "default": base,
        "br32": GatherConfig(block_rows=32, num_warps=8, interleave=True, load_eviction_policy="evict_last"),
        "br128": GatherConfig(block_rows=128, num_warps=16, interleave=True, load_eviction_policy="evict_last"),
        "w8": GatherConfig(block_rows=64, num_warps=8, interleave=True, load_eviction_policy="evict_last"),
        "evict_first": GatherConfig(block_rows=64, num_warps=16, interleave=True, load_eviction_policy="evict_first"),
        "no_hint": GatherConfig(block_rows=64, num_warps=16, interleave=True),
        "store_evict_first": GatherConfig(block_rows=64, num_warps=16, interleave=True,
                                          load_eviction_policy="evict_last", eviction_policy="evict_first"),
        "not_interleaved": GatherConfig(block_rows=64, num_warps=16, load_eviction_policy="evict_last"),
    }
    out = {"ceiling_ms": ceiling_ms, "gb": nbytes / 1e9, "configs": {}}
    print(f"device copy of {nbytes / 1e9:.2f} GB: {ceiling_ms:.3f} ms ({nbytes / ceiling_ms / 1e6:.0f} GB/s)")
    for name, cfg in configs.items():
        try:
            copiers = [RowCopier(source, [b[l] for l in range(L)], config=cfg) for b in dst_bufs]
            jobs = [(c, s, d) for c, (s, d) in zip(copiers, jobs_idx)]
            for b in dst_bufs:
                b.fill(0)
            copy_fanout(jobs, checked=True)  # compile + the copy checked below
            cp.cuda.runtime.deviceSynchronize()
            ok = all(bool((dst_bufs[k][:, d] == src_buf[:, s]).all()) for k, (s, d) in enumerate(jobs_idx))
            times = []
            for _ in range(3):
                cp.cuda.runtime.deviceSynchronize()
                t = time.perf_counter()
                for _ in range(10):
                    copy_fanout(jobs, checked=True)
                cp.cuda.runtime.deviceSynchronize()
                times.append((time.perf_counter() - t) / 10 * 1e3)
            ms = float(np.median(times))
            out["configs"][name] = dict(ms=ms, gbps=nbytes / ms / 1e6, of_ceiling=ceiling_ms / ms, ok=ok)
            print(f"{name:20s} {ms:7.3f} ms {nbytes / ms / 1e6:7.0f} GB/s {100 * ceiling_ms / ms:5.1f} % ok={ok}")
            for c in copiers:
                c.close()
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
            out["configs"][name] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
            print(f"{name:20s} failed: {type(exc).__name__}: {exc}"[:200])
    print("FANOUT_SWEEP", json.dumps(out))


if __name__ == "__main__":
    main()
