"""The pack benchmark's final variants of one geometry, timed in interleaved rounds.

`benchmarks/pack.py` builds the variants (``(variant, kind, config, note, make)``, ``make()``
giving ``(step, sync, final)``); `time_finals` builds and checks each, times them in interleaved
rounds (kernel time and wall clock, so drift hits all alike), checks each again after timing, and
returns the geometry's rows with GB/s and the share of the device-to-device copy ceiling.
"""

from __future__ import annotations

import numpy as np


def time_finals(finals, *, rounds: int, skip: str | None, timer, bytes_rw: int):
    """Times `finals` (see the module docstring); returns ``(rows, ceiling, wall_ceiling)``: one
    row per variant (or its error), and the copy ceiling's GB/s by kernel time and by wall clock
    (None without a timed ceiling)."""
    if skip:
        finals = [f for f in finals
                  if not any(f[0].startswith(p) for p in skip.split(","))]
    built = []
    geo_rows = []
    for variant, kind, cfg, note, make in finals:
        try:
            step, sync, final = make()
            step()
            exact = bool(final())
            built.append({"variant": variant, "kind": kind, "config": cfg, "note": note,
                          "step": step, "sync": sync, "final": final, "exact": exact,
                          "kernel": [], "wall": [], "per_call": None})
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"[:300]
            geo_rows.append({"variant": variant, "kind": kind, "error": msg})
            print(f"  {variant}: {msg}", flush=True)
    for rnd in range(rounds):
        for b in built:
            try:
                ks, b["per_call"] = timer.kernel(b["step"], b["sync"], samples=3)
                b["kernel"] += ks
                b["wall"] += timer.wall(b["step"], b["sync"], samples=1)
            except Exception as e:
                b["error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"  round {rnd + 1}/{rounds} done", flush=True)
    for b in built:
        exact = b["exact"]
        try:
            exact = exact and bool(b["final"]())  # still exact (and in place) after timing
        except Exception as e:
            b["error"] = f"final check: {type(e).__name__}: {e}"[:300]
            exact = False
        if not b["kernel"]:
            geo_rows.append({"variant": b["variant"], "kind": b["kind"],
                             "error": b.get("error", "not timed")})
            continue
        k_ms = float(np.median(b["kernel"]))
        w_ms = float(np.median(b["wall"]))
        row = {"variant": b["variant"], "kind": b["kind"], "ms": k_ms,
               "ms_min": float(np.min(b["kernel"])), "ms_max": float(np.max(b["kernel"])),
               "gbps": bytes_rw / k_ms / 1e6, "wall_ms": w_ms,
               "wall_gbps": bytes_rw / w_ms / 1e6, "kernels_per_call": b["per_call"],
               "wall_over_kernel": w_ms / k_ms,
               "bit_exact": exact, "config": b["config"], "note": b["note"]}
        geo_rows.append(row)
        print(f"  {row['variant']:<34} kernel {k_ms:7.4f} ms {row['gbps']:6.0f} GB/s | wall "
              f"{w_ms:7.4f} ms {row['wall_gbps']:6.0f} GB/s | wall/kernel "
              f"{w_ms / k_ms:5.2f} | {b['per_call']:.0f} kernel(s) exact={exact}", flush=True)
    del built, finals

    ceiling = max((r["gbps"] for r in geo_rows if r.get("kind") == "ceiling"), default=None)
    wall_ceiling = max((r["wall_gbps"] for r in geo_rows if r.get("kind") == "ceiling"),
                       default=None)
    for r in geo_rows:
        if "gbps" in r and ceiling:
            r["pct_of_copy"] = 100.0 * r["gbps"] / ceiling
            r["wall_pct_of_copy"] = 100.0 * r["wall_gbps"] / wall_ceiling
    return geo_rows, ceiling, wall_ceiling
