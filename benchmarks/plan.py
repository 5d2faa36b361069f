"""Plan benchmark: host time of `plan_rank_chunk`, one (chunk, decode rank) unit, per page size.

    python benchmarks/plan.py [--tokens 32768] [--dcp-size 8] [--json benchmarks/results/plan_cpu.json]

One request of --tokens tokens in one chunk, prefill DCP1 -> decode DCP-N (token round-robin),
random permutation page tables on both sides. For each page size and mode it times the plan of
every decode rank and reports the median per-rank time of two ways to call it, side by side in
one run:

- ``checked``: ``check_tables=True`` (the public default: both whole tables validated each call);
- ``sender``: ``check_tables=False``, what `KVSender` calls for every chunk of a request whose
  tables it validated once at ``send`` / ``expect``.

Host-only (numpy); absolute times depend on the machine and its load, the ratio less so.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from dcp_jax.transfer.schedule import PLAN_MODES, SideLayout, plan_rank_chunk


def per_rank_us(tokens: int, n: int, page_size: int, mode: str, check: bool, reps: int, seed: int) -> float:
    """Median microseconds of one rank's `plan_rank_chunk`, over ``reps`` rounds of all ``n`` ranks."""
    rng = np.random.default_rng(seed)
    src = SideLayout(1, 0, 1, page_size)
    src_table = rng.permutation(-(-tokens // page_size))
    dst_tables = [rng.permutation(-(-tokens // n // page_size) + 1) for _ in range(n)]
    times = []
    for _ in range(reps):
        for r in range(n):
            t0 = time.perf_counter()
            plan_rank_chunk(0, 0, tokens, src=src, dst=SideLayout(n, r, 1, page_size), src_page_table=src_table,
                            dst_page_table=dst_tables[r], mode=mode, check_tables=check)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--dcp-size", type=int, default=8)
    ap.add_argument("--page-sizes", default="1,16,64")
    ap.add_argument("--modes", default="packed,fused")
    ap.add_argument("--reps", type=int, default=20, help="rounds of all ranks per cell")
    ap.add_argument("--json", type=Path, help="write all rows as JSON here")
    args = ap.parse_args()
    modes = args.modes.split(",")
    for m in modes:
        if m not in PLAN_MODES:
            raise SystemExit(f"--modes: {m!r} is not one of {PLAN_MODES}")
    rows = []
    print(f"plan_rank_chunk per decode rank, {args.tokens} tokens, DCP1 -> DCP{args.dcp_size}, medians (us)")
    print(f"{'page_size':>9} {'mode':>7} {'checked':>10} {'sender':>10} {'ratio':>7}")
    for p in (int(x) for x in args.page_sizes.split(",")):
        for mode in modes:
            checked, sender = (per_rank_us(args.tokens, args.dcp_size, p, mode, c, args.reps, seed=p)
                               for c in (True, False))
            rows.append({"page_size": p, "mode": mode, "checked_us": checked, "sender_us": sender,
                         "ratio": checked / sender})
            print(f"{p:>9} {mode:>7} {checked:>10.1f} {sender:>10.1f} {checked / sender:>7.2f}")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "python": platform.python_version(),
                "numpy": np.__version__, "tokens": args.tokens, "dcp_size": args.dcp_size, "reps": args.reps}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
