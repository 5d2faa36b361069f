"""Probe (GPU): does the fused fan-out kernel's time depend on WHICH rows it copies?

In the main job (32,768 tokens, DCP8, H100) the fan-out kernel takes ~1.78 ms, in the job and
when the same launch is replayed after the request (`flag_hook`, DCP_DIRECT_REPLAY), against
~1.58 ms in `direct_launch_probe.py`, whose rows are a random permutation. Same bytes, same
kernel, same process: only the index pattern differs. This times the library's `copy_fanout`
(direct launch, CUDA events around the kernel on its stream) on the job's buffer geometry with
these row patterns, each checked byte for byte:

- ``random``: source rows a random permutation of the pool, destination rows random;
- ``job``: the job's tables: the prefill's shuffled pages of 64 rows, rank k holds tokens
  k, k+8, ... (interleave 1), each rank's rows dense in its own shuffled pages;
- ``job_src_random_dst``: the job's source rows, random destination rows;
- ``random_src_job_dst``: random source rows, the job's destination rows;
- ``contiguous``: pages in order on both sides (the job's pattern without the shuffles);
- ``job_rank_major``: the job's rows, but rank k's tokens are k*4096 .. (interleave 4096);
- ``job_idle_<s>``: the job's rows, each launch after <s> seconds with the GPU idle (as a
  request comes in the job, after the last one's checks): the device's clocks after an idle spell;
- ``nixl_job`` and ``nixl_job_idle_0.3``: the same once every buffer is registered with a NIXL
  engine (UCX, VRAM), as the job's sender and receivers register theirs.

Prints one JSON line ``PATTERN_PROBE`` (median kernel us and GB/s, read + written counted once
as in the suite's ceiling: bytes copied / time).
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

L, W, P, D, TOKENS = 61, 1152, 64, 8, 32768


def main() -> None:
    import cupy as cp

    from pallas_kernels import PackSource, RowCopier, copy_fanout
    from pallas_kernels import triton_launch as tl

    n = TOKENS // D
    src_pages = -(-TOKENS // P) * 5 // 4 + 1  # the job's pool_slack of 1.25, plus one
    dst_pages = -(-n // P) * 5 // 4 + 1
    src_buf = cp.random.randint(0, 256, (L, src_pages * P, W), dtype=cp.uint8)
    dst_bufs = [cp.zeros((L, dst_pages * P, W), cp.uint8) for _ in range(D)]
    source = PackSource([src_buf[l] for l in range(L)])
    copiers = [RowCopier(source, [b[l] for l in range(L)]) for b in dst_bufs]
    rng = np.random.default_rng(11)

    def paged(table, rows):  # rows of a page table's pages, row j -> page j // P, slot j % P
        return table[rows // P] * P + rows % P

    def tokens_of(k, rank_major):
        return np.arange(k * n, (k + 1) * n) if rank_major else np.arange(k, TOKENS, D)

    def pattern(name):
        src_table = rng.permutation(src_pages)[:TOKENS // P]
        jobs = []
        for k, c in enumerate(copiers):
            dst_table = rng.permutation(dst_pages)[:n // P]
            toks = tokens_of(k, name == "job_rank_major")
            job_src, job_dst = paged(src_table, toks), paged(dst_table, np.arange(n))
            rand_src = rng.permutation(src_pages * P)[:n] if k == 0 else None
            rand_dst = rng.permutation(dst_pages * P)[:n]
            if name == "random":
                s, d = None, rand_dst
            elif name == "job_src_random_dst":
                s, d = job_src, rand_dst
            elif name == "random_src_job_dst":
                s, d = None, job_dst
            elif name == "contiguous":
                s, d = toks, np.arange(n)
            else:
                s, d = job_src, job_dst
            jobs.append([c, s, d])
        if any(j[1] is None for j in jobs):  # random source rows: one permutation split over the ranks
            perm = rng.permutation(src_pages * P)[:TOKENS]
            for k, j in enumerate(jobs):
                if j[1] is None:
                    j[1] = perm[k * n:(k + 1) * n]
        return [(c, np.asarray(s, np.int64), np.asarray(d, np.int64)) for c, s, d in jobs]

    events: list = []
    orig = tl.enqueue

    def enqueue(device_id, size, fill, launches, on_phase=None):
        stream = tl.stream_for(device_id)
        ev = [cp.cuda.Event(), cp.cuda.Event()]
        events.append(ev)
        return orig(device_id, size, fill, [lambda b, s: ev[0].record(stream), *launches,
                                            lambda b, s: ev[1].record(stream)], on_phase)

    tl.enqueue = enqueue
    out = {}
    gb = L * TOKENS * W / 1e9
    names = ["random", "job", "job_src_random_dst", "random_src_job_dst", "contiguous", "job_rank_major",
             "job_idle_0.05", "job_idle_0.3", "job_idle_1.0", "nixl_job", "nixl_job_idle_0.3"]
    engine = None
    for name in names:
        try:
            if name.startswith("nixl") and engine is None:
                from bridge import MemoryRegion
                from bridge.nixl import NixlEngine

                engine = NixlEngine("pattern-probe")
                engine.register([MemoryRegion(int(b.data.ptr), int(b.nbytes), "VRAM", 0) for b in [src_buf, *dst_bufs]])
            idle = float(name.rsplit("_", 1)[1]) if "_idle_" in name else 0.0
            jobs = pattern("job" if idle or name.startswith("nixl") else name)
            times = []
            for rep in range(8):
                if idle:
                    time.sleep(idle)
                events.clear()
                copy_fanout(jobs, checked=True)
                tl.synchronize()
                if not events:
                    raise RuntimeError("no direct launch (direct launches off?)")
                if rep:  # the first one may compile or touch memory first
                    times.append(sum(cp.cuda.get_elapsed_time(a, b) for a, b in events) * 1e3)
            cp.cuda.runtime.deviceSynchronize()
            ok = all(bool((dst_bufs[k][:, cp.asarray(d)] == src_buf[:, cp.asarray(s)]).all())
                     for k, (_, s, d) in enumerate(jobs))
            med = float(np.median(times))
            out[name] = dict(kernel_us=round(med, 1), min_us=round(min(times), 1), gbps=round(gb / med * 1e6, 1), ok=ok)
            for b in dst_bufs:
                b.fill(0)
        except Exception as exc:  # noqa: BLE001 - a probe: report and go on
            out[name] = dict(error=f"{type(exc).__name__}: {exc}"[:400])
        print(name, out[name], flush=True)
    print("PATTERN_PROBE", json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
