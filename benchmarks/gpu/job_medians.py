"""Prints each job JSON's runs: median whole / transfer GB/s, the requests' whole GB/s, and the
first/last mark of each timeline entry (ms). Used by region_ab.sh and region_arms.sh.

    python benchmarks/gpu/job_medians.py OUT/ab_*.json
"""
import json
import os
import sys

for f in sorted(sys.argv[1:]):
    for r in json.load(open(f))["runs"]:
        gb = r["bytes"] / 1e9
        each = sorted(round(gb / q["request_seconds"], 1) for q in r.get("repeats", []))  # --requests 1: none
        tl = {k: v[:2] for k, v in (r.get("timeline_ms") or {}).items()}
        print(f"{os.path.basename(f)}: whole {gb / r['request_seconds']:.1f} transfer {gb / r['transfer_seconds']:.1f} "
              f"GB/s verified={r['verified']} each={each}\n   {tl}")
