"""Probe (GPU): host time of one `copy_fanout` launch hot (back to back) against cold (after the
thread slept, and after it slept while other memory was touched), split at its phases
(`on_phase`: checked, staged, then the jitted dispatch).

The main job's fused launch takes 3-5x longer inside the job than back to back in one process
(`fanout_dispatch.py`); the job's sender thread waits ~seconds between the warm-up request and the
timed one. Prints ``FANOUT_COLD {json}``: per condition the median microseconds from the call to
``checked``, to ``staged`` and to its return; `--json PATH` writes the same.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--profile", type=int, default=0, help="then cProfile this many hot calls (top 30 printed)")
    args = ap.parse_args()

    import cupy as cp

    from pallas_kernels import PackSource, RowCopier, copy_fanout, warm_copy_fanout

    # The main job's 32k fused round: 61 layers of 1,152 B rows, 8 ranks of 4,096 rows each.
    L, R, W8, D, n = 61, 32768, 1152, 8, 4096
    src_buf = cp.random.randint(0, 256, (L, R, W8), dtype=cp.uint8)
    dst_bufs = [cp.zeros((L, n + 64, W8), cp.uint8) for _ in range(D)]
    source = PackSource([src_buf[l] for l in range(L)])
    copiers = [RowCopier(source, [b[l] for l in range(L)]) for b in dst_bufs]
    warm_copy_fanout(copiers, D * n)
    rng = np.random.default_rng(2)
    perm = rng.permutation(R)
    jobs = [(c, perm[k * n:(k + 1) * n], rng.permutation(n + 64)[:n]) for k, c in enumerate(copiers)]
    junk = np.ones(64 << 20, np.uint8)

    def one(before) -> list[float]:
        cp.cuda.runtime.deviceSynchronize()
        before()
        marks = []
        t = time.perf_counter()
        copy_fanout(jobs, checked=True, on_phase=lambda _: marks.append(time.perf_counter()))
        end = time.perf_counter()
        return [(m - t) * 1e6 for m in marks] + [(end - t) * 1e6]

    def thrash():
        time.sleep(0.3)
        junk[::64] += 1  # 64 MiB touched: the caches hold other lines

    out = {}
    for name, before in (("hot", lambda: None), ("slept_0.3s", lambda: time.sleep(0.3)),
                         ("slept_thrashed", thrash), ("hot_again", lambda: None)):
        runs = [one(before) for _ in range(args.calls)]
        med = np.median(np.array(runs[2:]), axis=0)
        out[name] = dict(checked_us=float(med[0]), staged_us=float(med[1]), return_us=float(med[2]))
    cp.cuda.runtime.deviceSynchronize()
    out["ok"] = all(bool((dst_bufs[k][:, d_] == src_buf[:, s_]).all()) for k, (_, s_, d_) in enumerate(jobs))
    print("FANOUT_COLD", json.dumps(out))
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        for _ in range(args.profile):
            cp.cuda.runtime.deviceSynchronize()
            prof.enable()
            copy_fanout(jobs, checked=True)
            prof.disable()
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
