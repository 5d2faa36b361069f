"""Summary of `cupti_hook`'s device timelines: what the GPU ran in each job process, per request.

    python benchmarks/gpu/cupti_summary.py DIR [--gap-ms 20] [--json OUT]

Reads every ``gpu_<role>_<pid>.json`` in DIR (`benchmarks/gpu/cupti_hook`), splits the device
activity of all processes into requests (bursts separated by at least ``--gap-ms`` of no GPU
activity anywhere) and prints, per request, each process's kernels and copies as
``[start_ms, end_ms]`` after the request's first device activity (``t0``, `time.monotonic()`:
the job report's ``first_byte_at`` is on the same clock), then the union of busy time
and the idle gaps of the GPU as a whole. Prints CUPTI_SUMMARY {json} last.
"""
from __future__ import annotations

import argparse
import glob
import json
import os


def _short(cat: str, name: str) -> str:
    if cat == "gpu_memcpy":
        return "memcpy" + ("DtoD" if "DtoD" in name else name.split(" ")[1] if " " in name else "")
    if cat == "gpu_memset":
        return "memset"
    return name.split("(")[0][:40]


def _union(spans: list) -> tuple[float, list]:
    busy, gaps, end = 0.0, [], None
    for a, b in sorted(spans):
        if end is None or a > end:
            if end is not None:
                gaps.append([round(end, 3), round(a, 3)])
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy, gaps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    procs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(a.dir, "gpu_*.json")))]
    events = sorted(((e[2], e[3], p["role"], e[0], e[1]) for p in procs for e in p["events"]), key=lambda x: x[0])
    for p in procs:
        print(f"{p['role']}: {len(p['events'])} device events, marker drift {p['drift_s'] * 1e6:.1f} us")
    bursts, cur, last_end = [], [], None
    for ev in events:
        if cur and ev[0] - last_end > a.gap_ms * 1e-3:
            bursts.append(cur)
            cur = []
        cur.append(ev)
        last_end = ev[1] if last_end is None or not cur[:-1] else max(last_end, ev[1])
    if cur:
        bursts.append(cur)
    out = []
    for k, b in enumerate(bursts):
        t0 = b[0][0]
        rows: dict[str, list] = {}
        for s, e, role, cat, name in b:
            rows.setdefault(role, []).append([_short(cat, name), round((s - t0) * 1e3, 3), round((e - t0) * 1e3, 3)])
        busy, gaps = _union([((s - t0) * 1e3, (e - t0) * 1e3) for s, e, *_ in b])
        span = (max(e for _, e, *_ in b) - t0) * 1e3
        out.append(dict(burst=k, t0=t0, span_ms=round(span, 3), busy_ms=round(busy, 3), gaps_ms=gaps, processes=rows))
        print(f"== burst {k}: span {span:.3f} ms, GPU busy {busy:.3f} ms, idle gaps {gaps[:12]}")
        for role in sorted(rows, key=lambda r: (not r.startswith("prefill"), r)):
            evs = rows[role]
            shown = evs if len(evs) <= 8 else evs[:4] + [["...", len(evs) - 8, ""]] + evs[-4:]
            print(f"   {role}: {shown}")
    if a.json:
        json.dump(out, open(a.json, "w"))
    print("CUPTI_SUMMARY " + json.dumps([dict(burst=o["burst"], span_ms=o["span_ms"], busy_ms=o["busy_ms"]) for o in out]))


if __name__ == "__main__":
    main()
