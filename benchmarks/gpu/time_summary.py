"""Prints what benchmarks/gpu/time_hook recorded: per process and target, calls, median and p90 us.

    python benchmarks/gpu/time_summary.py DIR [--skip N]   (N: each target's first N calls left out;
    a target called at most 2N times loses its first call only)
"""
import argparse
import glob
import json
import os
import statistics

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--skip", type=int, default=8)
a = ap.parse_args()
for f in sorted(glob.glob(os.path.join(a.dir, "times_*.json"))):
    d = json.load(open(f))
    print(f"== {os.path.basename(f)}")
    for target, calls in d.items():
        skip = a.skip if len(calls) > 2 * a.skip else min(1, len(calls) - 1)  # few calls: the first out
        xs = sorted(c[0] * 1e6 for c in calls[skip:])
        if not xs:
            continue
        threads = sorted({c[1] for c in calls})
        p90 = xs[int(0.9 * (len(xs) - 1))]
        print(f"  {target.split(':')[1]:45} n={len(xs):4d} median {statistics.median(xs):9.1f} us  p90 {p90:9.1f}  "
              f"max {xs[-1]:9.1f}  threads {threads[:3]}")
