"""Host (CPU) pack gather: `pack_rows`' numpy path against the obvious alternatives.

    python benchmarks/pack_cpu.py [--json benchmarks/results/pack_cpu.json] [--repeats 7]

The embedded default of the main job packs in host memory. For DeepSeek-V3 geometry (61 layer
entries, 32,768 source rows) it times, as medians over repeats, every variant writing into one
registered-style host buffer, and checks each result byte for byte against fancy indexing:

- `pack_rows` with 1 worker thread, 2, 4, and the automatic count (one per core, capped);
- `np.take(..., out=)` per layer in a plain loop (what `pack_rows` did before threads);
- fancy indexing `pack[...] = layer[idx]` per layer (a temporary, then a second copy).

GB/s count bytes read + written (2 x the pack bytes). Times on a shared 2-core CI-class machine
are indicative only; the ratios between variants, taken in one run, are the result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from pallas_kernels import pack_rows  # noqa: E402


def geometries(quick: bool):
    """(name, layers, item_len bytes, rows n, source rows R, pattern)."""
    R = 4096 if quick else 32768
    return [("deepseek-v3/rank-4096", 61, 1152, R // 8, R, "stride8"),
            ("deepseek-v3/32768", 61, 1152, R, R, "shuffled-pages"),
            ("deepseek-v3-fp8/rank-4096", 61, 576, R // 8, R, "stride8")]


def indices(pattern, n, R, seed=0):
    rng = np.random.default_rng(seed)
    if pattern == "stride8":
        return np.arange(n, dtype=np.int64) * 8 + 3
    pages = rng.permutation(R // 64)
    return (pages[:, None] * 64 + np.arange(64)[None, :]).reshape(-1)[:n]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write results JSON here")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    args = ap.parse_args(argv)
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
            "versions": {"python": platform.python_version(), "numpy": np.__version__},
            "method": f"median over {args.repeats} calls after one warm-up; GB/s = 2 x pack bytes"}
    print(json.dumps(info), flush=True)
    results = []
    for name, L, item, n, R, pattern in geometries(args.quick):
        rng = np.random.default_rng(1)
        layers = [rng.integers(0, 256, (R, item), dtype=np.uint8) for _ in range(L)]
        idx = indices(pattern, n, R)
        total = L * n * item
        pack = np.empty(total, np.uint8)
        expect = np.concatenate([a[idx].ravel() for a in layers])

        def loop_take():
            pos = 0
            for a in layers:
                np.take(a, idx, axis=0, out=pack[pos:pos + n * item].reshape(n, item), mode="clip")
                pos += n * item

        def fancy():
            pos = 0
            for a in layers:
                pack[pos:pos + n * item].reshape(n, item)[...] = a[idx]
                pos += n * item

        variants = [("pack_rows threads=auto", lambda: pack_rows(layers, idx, pack)),
                    ("pack_rows threads=1", lambda: pack_rows(layers, idx, pack, threads=1)),
                    ("pack_rows threads=2", lambda: pack_rows(layers, idx, pack, threads=2)),
                    ("pack_rows threads=4", lambda: pack_rows(layers, idx, pack, threads=4)),
                    ("np.take loop (out=)", loop_take),
                    ("fancy index + copy", fancy)]
        rows = []
        print(f"\n== {name}: {L} x {n} rows x {item} B ({pattern}); "
              f"{2 * total / 1e9:.2f} GB r+w", flush=True)
        for label, fn in variants:
            pack.fill(0xA5)
            fn()
            exact = bool(np.array_equal(pack, expect))
            ts = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            ms = 1e3 * float(np.median(ts))
            rows.append({"variant": label, "ms": ms, "gbps": 2 * total / ms / 1e6,
                         "bit_exact": exact})
            print(f"  {label:<26} {ms:9.2f} ms {2 * total / ms / 1e6:7.2f} GB/s exact={exact}",
                  flush=True)
        base = next(r["ms"] for r in rows if r["variant"] == "np.take loop (out=)")
        for r in rows:
            r["speedup_vs_loop"] = base / r["ms"]
        results.append({"geometry": name, "layers": L, "item_len": item, "rows": n,
                        "src_rows": R, "pattern": pattern, "pack_bytes": total, "rows_out": rows})
        del layers, pack, expect
    print()
    print(f"{'geometry':<28} {'variant':<26} {'ms':>9} {'GB/s':>7} {'vs loop':>8} exact")
    for g in results:
        for r in g["rows_out"]:
            print(f"{g['geometry']:<28} {r['variant']:<26} {r['ms']:9.2f} {r['gbps']:7.2f} "
                  f"{r['speedup_vs_loop']:7.2f}x {r['bit_exact']}")
    report = {**info, "geometries": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
