"""The results file of scripts/multi_gpu.sh: $OUT/multi_gpu.json and $OUT/multi_gpu.md.

    python scripts/multi_gpu_summary.py --out out/multi_gpu --tokens 32768

Collects what the script's steps left in ``--out``: mg_steps.tsv (name, exit status, seconds),
mg_placement.json, mg_gpus.txt / mg_topo.txt (nvidia-smi -L / topo -m), mg_peer.json
(benchmarks/d2d_ceiling.py --peer rows), mg_job_<engine>.json (dcp-jax transfer reports, with each
process's placement and the PCI bus id its device 0 has: checked by `placement_ok`) and
mg_merge.json (benchmarks/multi_gpu_merge.py). Each transfer run's GB/s is set beside the
peer-to-peer ceiling of the same bytes (GPU 0 -> the decode GPUs at once, else GPU 0 -> one).
Exit status 1 when a step failed, a run was not byte-exact or a merge not equal.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_suite_summary import _f, _load, step_rows, versions, write_summary  # noqa: E402


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def peer_ceiling(peer) -> tuple[float | None, str | None]:
    """GB/s and row name of the peer ceiling a transfer is compared with: the fan-out row (GPU 0 ->
    every decode GPU at once) if measured, else the one-pair row; (None, None) without rows."""
    rows = [r for r in (peer or {}).get("rows", []) if "peer" in r]
    if not rows:
        return None, None
    best = max(rows, key=lambda r: len(r["peer"]["dst"]))
    return best["gbps"], best["what"]


def placement_ok(placement: list[dict]) -> bool:
    """Whether the processes landed where they were placed: one PCI bus id per placed GPU number,
    a different one per GPU (each child reports the bus id of its device 0)."""
    ids: dict = {}
    for p in placement:
        ids.setdefault(p.get("gpu"), set()).add(p.get("pci_bus_id"))
    buses = [next(iter(v)) for v in ids.values() if len(v) == 1]
    return bool(ids) and None not in ids and len(buses) == len(ids) and None not in buses and len(set(buses)) == len(buses)


def _runs(out: str, ceiling: float | None) -> list[dict]:
    rows = []
    for name in sorted(os.listdir(out)):
        if not (name.startswith("mg_job_") and name.endswith(".json")):
            continue
        r = _load(os.path.join(out, name)) or {}
        for run in r.get("runs", []):
            nbytes, ts, tot = run.get("bytes") or 0, run.get("transfer_seconds"), run.get("request_seconds")
            ok = lambda x: isinstance(x, (int, float)) and x == x and x > 0  # noqa: E731 - NaN for a failed run
            row = {"engine": run.get("engine"), "path": run.get("mode"), "bytes": nbytes,
                   "transfer_seconds": ts, "request_seconds": tot,
                   "transfer_gbps": nbytes / ts / 1e9 if ok(ts) else None,
                   "request_gbps": nbytes / tot / 1e9 if ok(tot) else None,
                   "verified": bool(run.get("verified")), "failures": run.get("failures", []),
                   "rank_gpus": [x.get("gpu") for x in run.get("ranks", [])], "placement": r.get("placement", []),
                   "placement_ok": placement_ok(r.get("placement", []))}
            row["transfer_pct_of_peer"] = 100 * row["transfer_gbps"] / ceiling if ceiling and row["transfer_gbps"] else None
            rows.append(row)
    return rows


def summarize(out: str, tokens: int | None, vers: dict | None = None) -> int:
    """Writes multi_gpu.json / .md into ``out`` and prints the markdown; 1 if anything failed.
    ``vers``: versions (default: the GPU suite's versions.json under $DCP_GPU_OUT, else measured now)."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    placement = _load(os.path.join(out, "mg_placement.json")) or {}
    steps = step_rows(os.path.join(out, "mg_steps.tsv"))
    peer = _load(os.path.join(out, "mg_peer.json"))
    ceiling, ceiling_what = peer_ceiling(peer)
    runs = _runs(out, ceiling)
    merge = _load(os.path.join(out, "mg_merge.json"))
    if vers is None:
        vers = _load(os.path.join(os.environ.get("DCP_GPU_OUT", out), "versions.json")) or versions()
    gpus = placement.get("gpus")
    kind = "one-GPU rehearsal (every process on GPU 0, mesh of 1 device)" if gpus == 1 else f"{gpus} GPUs"
    machine = _read(os.path.join(out, "mg_gpus.txt")).splitlines()
    md = [f"# Several GPUs: {kind} ({date}, {vers.get('device')}, commit {vers.get('commit')})", "",
          "Machine: " + ("; ".join(machine) or "nvidia-smi -L gave nothing"), "",
          "Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items() if k not in ("jax_devices", "device", "commit")),
          "", f"Placement: prefill on GPU {placement.get('prefill_gpus')}, {placement.get('dcp_size')} decode ranks on "
          f"GPU(s) {placement.get('decode_gpus')}; GPU 0's peer access: {placement.get('peer_access_from_0')}; "
          f"fused path {'run' if placement.get('fused_allowed') else 'left out (no peer access)'}.", "",
          "| step | rc | seconds | status |", "|---|---:|---:|---|"]
    md += [f"| {s['step']} | {s['rc']} | {s['seconds']} | {s['status']} |" for s in steps]
    if peer:
        md += ["", "## Copy ceilings (benchmarks/d2d_ceiling.py --peer)", "", "| what | tokens | GB | GB/s | peer access |",
               "|---|---:|---:|---:|---|"]
        md += [f"| {r['what']} | {r['prompt_tokens']:,} | {r['bytes'] / 1e9:.2f} | {r['gbps']:,.0f} | "
               f"{r.get('peer', {}).get('peer_access', '-')} |" for r in peer["rows"]]
    md += ["", f"## dcp-jax transfer, {_f(tokens, ',')} tokens (every rank byte-exact?)", "",
           f"Ceiling: {ceiling_what or 'none measured'} = {_f(ceiling, ',.0f')} GB/s.", "",
           "| engine | path | GB | transfer s | transfer GB/s | % of peer ceiling | whole s | whole GB/s | "
           "rank GPUs | verified |", "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    md += [f"| {r['engine']} | {r['path']} | {r['bytes'] / 1e9:.2f} | {_f(r['transfer_seconds'], '.4f')} | "
           f"{_f(r['transfer_gbps'], ',.1f')} | {_f(r['transfer_pct_of_peer'], '.1f')} | "
           f"{_f(r['request_seconds'], '.4f')} | {_f(r['request_gbps'], ',.1f')} | "
           f"{','.join(str(g) for g in r['rank_gpus'])} | {r['verified']} |" for r in runs]
    if merge:
        from_merge = merge.get("meta", {})
        sh = merge.get("shape", {})
        md += ["", f"## DCP decode merge over a mesh of {from_merge.get('mesh_devices')} device(s) "
               f"(benchmarks/multi_gpu_merge.py; B={sh.get('batch')}, kv_len={sh.get('kv_len')}, "
               f"H={sh.get('heads')}, float32)", "",
               "| combine | devices | decode step us | step rel err | merge only us | merge rel err | equal |",
               "|---|---:|---:|---:|---:|---:|---|"]
        md += [f"| {r['combine']} | {r['devices']} | {r['step_us']:,.1f} | {r['step_rel_err']:.1e} | "
               f"{r['merge_us']:,.1f} | {r['merge_rel_err']:.1e} | {r['step_equal'] and r['merge_equal']} |"
               for r in merge.get("rows", [])]
        e = merge.get("emulated")
        if e:
            md.append(f"| emulated: {e['ranks']} ranks on {e['device']} | 1 | {e['step_us']:,.1f} | "
                      f"{e['step_rel_err']:.1e} | - | - | {e['step_equal']} |")
    failed = ([s["step"] for s in steps if s["rc"] != 0] + [f"{r['engine']}/{r['path']}" for r in runs if not r["verified"]]
              + [f"{r['engine']}/{r['path']}: placement not as asked" for r in runs if not r["placement_ok"]]
              + (["merge not equal"] if merge and not merge.get("all_equal") else []))
    if not steps:
        failed.append("no step ran")
    return write_summary(out, "multi_gpu", "Several GPUs", md, failed, {
        "date": date, "kind": kind, "machine": machine, "topology": _read(os.path.join(out, "mg_topo.txt")),
        "versions": vers, "prompt_tokens": tokens, "placement": placement, "steps": steps, "peer": peer,
        "peer_ceiling_gbps": ceiling, "peer_ceiling_what": ceiling_what, "runs": runs, "merge": merge})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="scripts/multi_gpu.sh's output folder")
    ap.add_argument("--tokens", type=int, default=None, help="prompt tokens of the run (for the title)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.out):
        ap.error(f"--out {args.out!r} is not a folder")
    return summarize(args.out, args.tokens)


if __name__ == "__main__":
    sys.exit(main())
