"""Diagnostic: sums the per-call profiles that benchmarks/gpu/profile_hook wrote.

    python benchmarks/gpu/pstats_top.py DIR [--skip N] [--top K] [--target Class.method]

Per process (the pid in the file name), its first N calls are left out (the first request's, cold),
the rest summed; prints the calls counted and the top K functions by cumulative time, in
microseconds per profiled call.
"""
import argparse
import glob
import os
import pstats
import re
from collections import defaultdict

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--skip", type=int, default=8)
ap.add_argument("--top", type=int, default=25)
ap.add_argument("--target", default="", help="only the files of this Class.method (the hook's comma list)")
a = ap.parse_args()
per_pid = defaultdict(list)
for f in glob.glob(os.path.join(a.dir, f"{a.target}*.pstats")):
    m = re.search(r"_(\d+)_(\d+)\.pstats$", f)
    if m:
        per_pid[m.group(1)].append((int(m.group(2)), f))
for pid, files in sorted(per_pid.items()):
    files.sort()
    kept = [f for n, f in files if n > a.skip]
    print(f"== pid {pid}: {len(files)} calls, {len(kept)} summed")
    if not kept:
        continue
    st = pstats.Stats(*kept)
    rows = []
    for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append((ct, tt, nc, f"{os.path.basename(fn)}:{line}:{name}"))
    rows.sort(reverse=True)
    print(f"{'cum us/call':>12} {'own us/call':>12} {'ncalls':>7}  function")
    for ct, tt, nc, name in rows[:a.top]:
        print(f"{ct / len(kept) * 1e6:12.1f} {tt / len(kept) * 1e6:12.1f} {nc:7d}  {name}")
