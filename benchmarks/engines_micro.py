"""Engine micro-benchmark: one WRITE batch from this process to a spawned peer, per engine.

Two shapes of the same bytes: per-token descriptors (scattered 1152-B rows, the direct path under
token round-robin) and a few large descriptors (what a pack sends). Prints one table; ``--json``
writes the rows. Byte-checks the last run of every case.

    PYTHONPATH=. .venv/bin/python benchmarks/engines_micro.py --rows 20000 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests", "bridge"))

import _peer_worker as pw  # noqa: E402  (spawnable target process, shared with the tests)
from bridge import available_engines, make_engine  # noqa: E402

ITEM = 1152  # DeepSeek-V3 MLA row, bf16 (bytes)


def _run_case(eng, peer, conn, src, dst_addr, descs, repeat: int, tag: str) -> float:
    best = float("inf")
    for i in range(repeat):
        t0 = time.perf_counter()
        h = eng.transfer_batch(peer, descs, notif=f"{tag}-{i}".encode())
        eng.wait(h, timeout_s=120)
        best = min(best, time.perf_counter() - t0)
    conn.send(("wait", eng.name, f"{tag}-{repeat - 1}".encode(), 60.0))
    status, payload = conn.recv()
    if status != "ok":
        raise RuntimeError(payload)
    got = np.frombuffer(payload, np.uint8)
    rel = descs.copy()
    rel[:, 0] -= src.ctypes.data
    rel[:, 1] -= dst_addr
    for s, d, n in rel[:: max(1, len(rel) // 512)]:  # sampled byte check of the landed rows
        if not np.array_equal(got[d:d + n], src[s:s + n]):
            raise RuntimeError(f"{tag}: bytes at remote offset {d} differ")
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20000, help="rows of 1152 B moved per case")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case (best is reported)")
    ap.add_argument("--engines", default=",".join(available_engines()))
    ap.add_argument("--json", default=None, help="write the rows to this path")
    args = ap.parse_args(argv)
    for k, v in (("UCX_NET_DEVICES", "lo"), ("UCX_LOG_LEVEL", "fatal"), ("NIXL_LOG_LEVEL", "WARN"),
                 ("MC_LOG_LEVEL", "ERROR")):
        os.environ.setdefault(k, v)
    nbytes = args.rows * ITEM
    rows = []
    for kind in [e for e in args.engines.split(",") if e]:
        proc, conn, info = pw.spawn_target(kind, f"bench-{kind}-tgt", nbytes)
        try:
            src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
            with make_engine(kind, f"bench-{kind}-ini") as eng:
                eng.register([src])
                peer = eng.add_peer(info)
                dst = info.regions[0].addr
                per_token, _, _ = pw.scattered_descs(src.ctypes.data, dst, args.rows, ITEM, seed=1)
                block = 8 << 20
                nblk = -(-nbytes // block)
                large = np.array([[src.ctypes.data + i * block, dst + i * block, min(block, nbytes - i * block)]
                                  for i in range(nblk)], np.int64)
                for name, descs in (("per-token", per_token), ("large", large)):
                    eng.reset_counters()
                    sec = _run_case(eng, peer, conn, src, dst, descs, args.repeat, f"{kind}-{name}")
                    moved = int(descs[:, 2].sum())
                    rows.append(dict(engine=kind, case=name, descriptors=len(descs), bytes=moved,
                                     seconds=sec, desc_per_s=len(descs) / sec, gb_per_s=moved / sec / 1e9,
                                     engine_calls=eng.counters.engine_calls // args.repeat))
        finally:
            pw.stop_target(proc, conn)
    print(f"{'engine':9} {'case':10} {'descriptors':>11} {'MB':>8} {'seconds':>8} {'desc/s':>10} {'GB/s':>6} {'calls':>6}")
    for r in rows:
        print(f"{r['engine']:9} {r['case']:10} {r['descriptors']:>11,} {r['bytes'] / 1e6:>8.1f} {r['seconds']:>8.4f} "
              f"{r['desc_per_s']:>10,.0f} {r['gb_per_s']:>6.2f} {r['engine_calls']:>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "rows_per_case": args.rows, "item_len": ITEM}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
