"""Diagnostic: from an `nsys stats --report cuda_gpu_trace --format csv` file of the fused job
(every process's device work), each fan-out kernel's duration and the device work of any process
that ran within 0.2 ms before it or while it ran. Usage: python nsys_overlap.py trace.csv"""
import csv
import sys


def main(path: str) -> None:
    rows = list(csv.DictReader(open(path)))
    if not rows:
        print("no device work recorded")
        return
    cols = list(rows[0])
    start = next(k for k in cols if k.startswith("Start"))
    dur = next(k for k in cols if k.startswith("Duration"))
    who = [k for k in cols if k.lower().startswith(("pid", "process", "device", "ctx", "strm", "stream"))]
    print(f"{len(rows)} device ops; columns {cols}")
    for r in rows:
        if "fanout" not in r.get("Name", "") or float(r[dur]) < 100e3:
            continue
        s, d = float(r[start]), float(r[dur])
        print(f"FANOUT {d / 1e3:.1f} us {[r[k] for k in who]}")
        near = [x for x in rows if x is not r and float(x[start]) < s + d
                and float(x[start]) + float(x[dur]) > s - 200e3]
        for x in near[:15]:
            print(f"   {x.get('Name', '')[:50]} at {(float(x[start]) - s) / 1e3:+.1f} us for "
                  f"{float(x[dur]) / 1e3:.1f} us {[x[k] for k in who]}")


if __name__ == "__main__":
    main(sys.argv[1])
