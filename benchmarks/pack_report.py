"""What `benchmarks/pack.py` reports of a run: the issue's targets evaluated on it (`claims`),
the console table (`print_table`) and the markdown file (`markdown`).

Moved out of `benchmarks/pack.py`, which imports them from here.
"""

from __future__ import annotations

import json


def claims(results, key="gbps"):
    """The issue's targets, evaluated on this run (`key`: "gbps" kernel time, "wall_gbps")."""
    out = {}
    by = {g["geometry"]: g for g in results}
    pct = "pct_of_copy" if key == "gbps" else "wall_pct_of_copy"

    def ok(r):
        return r.get("bit_exact") and key in r

    g = by.get("deepseek-v3/32768")
    if g:
        ours = [r for r in g["rows_out"] if r.get("kind") == "ours" and ok(r)
                and "stacked" in r["variant"]]
        best = max(ours, key=lambda r: r[key]) if ours else None
        peers = [r for r in g["rows_out"] if r.get("kind") == "peer" and key in r]
        out["best_stacked"] = best and {"variant": best["variant"], "gbps": best[key]}
        out["best_peer"] = peers and {"variant": max(peers, key=lambda r: r[key])["variant"],
                                      "gbps": max(r[key] for r in peers)}
        out["best_stacked_ge_4000_gbps"] = bool(best and best[key] >= 4000)
        out["faster_than_every_peer"] = bool(best and all(best[key] > p[key] for p in peers))
        # Like with like: each form's best row (JAX-owned or CuPy pack).
        st = max((r[key] for r in ours), default=None)
        li = max((r[key] for r in g["rows_out"] if r.get("kind") == "ours" and ok(r)
                  and r["variant"].startswith("pallas-triton list")), default=None)
        if st and li:
            out["list_over_stacked"] = li / st
            out["list_within_10pct"] = li >= 0.9 * st
    g = by.get("deepseek-v3/rank-4096")
    if g:
        ours = [r for r in g["rows_out"] if r.get("kind") == "ours" and ok(r)]
        best = max(ours, key=lambda r: r[key]) if ours else None
        if best:
            out["rank4096_best"] = {"variant": best["variant"], "pct_of_copy": best[pct]}
            out["rank4096_ge_85pct_of_copy"] = best[pct] >= 85.0
    return out


def print_table(results, claims_):
    print()
    for g in results:
        print(f"{g['geometry']}: {g['layers']} x {g['rows']} x {g['item_len']} B, "
              f"{g['bytes_rw'] / 1e9:.2f} GB r+w, copy ceiling {g['copy_ceiling_gbps']:.0f} GB/s "
              f"(kernel) / {g['wall_copy_ceiling_gbps']:.0f} GB/s (wall)")
        print(f"  {'variant':<34} {'kind':<8} {'kernel ms':>9} {'GB/s':>6} {'% copy':>7} "
              f"{'wall GB/s':>9} {'wall/k':>6} exact")
        for r in sorted(g["rows_out"], key=lambda r: -r.get("gbps", 0)):
            if "gbps" not in r:
                print(f"  {r['variant']:<34} {r['kind']:<8} error: {r['error'][:60]}")
                continue
            print(f"  {r['variant']:<34} {r['kind']:<8} {r['ms']:9.4f} {r['gbps']:6.0f} "
                  f"{r['pct_of_copy']:6.1f}% {r['wall_gbps']:9.0f} "
                  f"{r.get('wall_over_kernel', 0):6.2f} {r['bit_exact']}")
        print("  end to end:", json.dumps(g.get("e2e", {}), indent=1))
    print("claims (kernel time):", json.dumps(claims_["kernel"], indent=1))
    print("claims (wall clock):", json.dumps(claims_["wall"], indent=1))


def markdown(report):
    lines = [f"# Pack kernel benchmark ({report['device']}, {report['date']})", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
             report["method"] + ".", ""]
    for g in report["geometries"]:
        lines += [f"## {g['geometry']}: {g['layers']} x {g['rows']:,} rows x {g['item_len']} B "
                  f"({g['pattern']}, from {g['src_rows']:,} rows), "
                  f"{g['bytes_rw'] / 1e9:.2f} GB read + written", "",
                  "| variant | kind | kernel ms | GB/s (r+w) | % of copy | wall GB/s | "
                  "wall / kernel | bit-exact | note |",
                  "|---|---|---:|---:|---:|---:|---:|---|---|"]
        for r in sorted(g["rows_out"], key=lambda r: -r.get("gbps", 0)):
            if "gbps" not in r:
                lines.append(f"| {r['variant']} | {r['kind']} | error | | | | | "
                             f"{r['error'][:80]} | |")
                continue
            lines.append(f"| {r['variant']} | {r['kind']} | {r['ms']:.4f} | {r['gbps']:.0f} | "
                         f"{r['pct_of_copy']:.1f} | {r['wall_gbps']:.0f} | "
                         f"{r.get('wall_over_kernel', 0):.2f} | {r['bit_exact']} | "
                         f"{r.get('note', '')} |")
        cfgs = g.get("configs") or {}
        if cfgs:
            lines += [""] + [f"- {form}: `{c}`" for form, c in cfgs.items()]
        lines.append("")
    lines += ["## Targets (issue 4)", "", "Kernel time (the claims):", "", "```",
              json.dumps(report["claims"]["kernel"], indent=1), "```", "",
              "Wall clock per call, for reference:", "", "```",
              json.dumps(report["claims"]["wall"], indent=1), "```", ""]
    return "\n".join(lines)
