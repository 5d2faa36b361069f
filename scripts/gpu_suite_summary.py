"""The GPU suite's versions and results summary (called by scripts/gpu_suite.sh).

    python scripts/gpu_suite_summary.py --versions           # prints versions (and saves them with --out)
    python scripts/gpu_suite_summary.py --out out/gpu        # writes gpu_suite_summary.md / .json

The summary collects what the suite's steps left in the output folder: the step table
(steps.tsv: name, exit status, seconds), the GPU test counts (pytest_gpu.log), the device-to-device
ceiling (d2d_ceiling.json), the pack benchmark's per-rank `pack_rows` kernel and wall time
(pack.json), the pack backends side by side (pack_backends.json: s per call, GB/s, exact or the
error), the multi-GPU rehearsal (multi_gpu/multi_gpu.json, scripts/multi_gpu_summary.py), and every
main-job run (job_*.json): engine, tokens, path, staging, descriptors per rank, transfer and
whole-request GB/s, each beside the ceiling for the same bytes, verified or not, with the
connectors' timelines (ms after the first byte); then each staged run beside the direct run of the
same engine, tokens and path.
Exit status 1 when a step failed, a backend failed or differed, or a run was not byte-exact.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import re
import sys


def versions() -> dict:
    """Versions of everything the suite uses, read in this process."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for m in ("jax", "jaxlib", "cupy", "torch", "triton", "numpy", "zmq", "msgpack"):
        try:
            mod = importlib.import_module(m)
            v = getattr(mod, "__version__", None) or ".".join(map(str, getattr(mod, "version", ())))
            out[m] = str(v)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            out[m] = f"unavailable ({type(e).__name__})"
    for dist in ("nixl-cu13", "mooncake-transfer-engine-cuda13"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "no metadata"
    try:
        from bridge.nixl import nixl_agent, nixl_available

        out["nixl"] = f"available={nixl_available()} ({getattr(nixl_agent, '__module__', None)})"
    except Exception as e:  # noqa: BLE001
        out["nixl"] = f"unavailable ({type(e).__name__}: {e})"
    try:
        from bridge.mooncake import mooncake_available, mooncake_supports_cuda

        out["mooncake"] = f"available={mooncake_available()} cuda={mooncake_supports_cuda()}"
    except Exception as e:  # noqa: BLE001
        out["mooncake"] = f"unavailable ({type(e).__name__}: {e})"
    try:
        import jax

        out["jax_devices"] = [str(d) for d in jax.devices()]
        out["device"] = next((d.device_kind for d in jax.devices() if d.platform == "gpu"), "no GPU")
    except Exception as e:  # noqa: BLE001
        out["device"] = f"unavailable ({type(e).__name__})"
    out["commit"] = os.environ.get("GIT_COMMIT", "unknown")
    return out


def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def step_rows(path: str) -> list[dict]:
    """The steps a suite script logged in ``path`` (a ``name<TAB>rc<TAB>seconds`` line each):
    ``{"step", "rc", "seconds", "status"}`` each; rc 124 / 137 is the step's time limit. Empty
    when the file is missing."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        name, rc, secs = line.split("\t")
        status = "ok" if rc == "0" else ("FAILED (time limit)" if rc in ("124", "137") else "FAILED")
        rows.append({"step": name, "rc": int(rc), "seconds": int(secs), "status": status})
    return rows


def _pytest_line(out: str) -> str:
    try:
        with open(os.path.join(out, "pytest_gpu.log")) as f:
            lines = [ln.strip() for ln in f if re.search(r"\d+ (passed|failed|error)", ln)]
        return lines[-1].strip("= ") if lines else ""
    except OSError:
        return ""


def _ceilings(d2d) -> dict[int, float]:
    """prompt tokens -> one-stream device copy GB/s."""
    if not d2d:
        return {}
    return {r["prompt_tokens"]: r["gbps"] for r in d2d["rows"] if "1 stream" in r["what"]}


def _runs(out: str, ceilings: dict[int, float]) -> list[dict]:
    rows = []
    for name in sorted(os.listdir(out)):
        if not (name.startswith("job_") and name.endswith(".json")):
            continue
        r = _load(os.path.join(out, name))
        if not r:
            continue
        cfg = r.get("config", {})
        tokens, dcp = cfg.get("prompt_tokens"), cfg.get("dcp_size") or 1
        total_bytes = cfg.get("request_bytes")
        for run in r.get("runs", []):
            nbytes = run.get("bytes") or total_bytes or 0
            desc = run.get("descriptors")
            per_rank = run.get("descriptors_per_rank")
            if per_rank is None and desc is not None:
                per_rank = desc / dcp
            ts = run.get("transfer_seconds")
            tot = run.get("request_seconds") or run.get("total_seconds")  # first byte packed -> last rank holds its rows
            ceiling = ceilings.get(tokens)
            st = run.get("staging") or {}
            mps = (r.get("mps") or {}).get("clients")  # --mps: the job's own MPS daemon's client count
            row = {"step": name[:-5] + (f" (MPS, {mps} clients)" if mps is not None else ""),
                   "engine": run.get("engine", cfg.get("engine_kind")), "tokens": tokens,
                   "path": ",".join(run["paths"]) if run.get("paths") else run.get("path") or run.get("mode"),
                   "staging": "staged" if "staged" in st.values() else "direct",
                   "pack_backend": run.get("pack_backend"), "descriptors_per_rank": per_rank,
                   "bytes": nbytes, "transfer_seconds": ts, "total_seconds": tot,
                   "transfer_gbps": nbytes / ts / 1e9 if ts else None,
                   "total_gbps": nbytes / tot / 1e9 if tot else None, "verified": run.get("verified")}
            row["total_pct_of_ceiling"] = 100 * row["total_gbps"] / ceiling if ceiling and row["total_gbps"] else None
            reps = [q["whole_gbps"] for q in run.get("repeats", []) if q.get("whole_gbps") is not None]
            row["requests"] = len(reps) or 1  # --requests N: the row is the median request's
            row["whole_gbps_range"] = [min(reps), max(reps)] if reps else None
            rows.append(row)
    return rows


def _pack_rows(pack) -> list[dict]:
    """Per geometry, the end-to-end calls (`pack_rows`, `unpack_rows`, `copy_rows`, `RowCopier`):
    kernel ms, wall ms, wall / kernel."""
    out = []
    for g in (pack or {}).get("geometries", []):
        for v in g.get("rows_out", []):
            if any(w in v.get("variant", "") for w in ("pack_rows e2e", "copy_rows e2e", "RowCopier")):
                k = v.get("ms") or v.get("kernel_ms")
                w = v.get("wall_ms")
                out.append({"geometry": g.get("geometry"), "variant": v["variant"], "kernel_ms": k, "wall_ms": w,
                            "wall_over_kernel": w / k if k and w else None})
    return out


def multi_gpu_lines(mg) -> list[str]:
    """The multi_gpu_rehearsal step's figures (scripts/multi_gpu_summary.py's multi_gpu.json), as markdown."""
    if not mg:
        return []
    pl = mg.get("placement", {})
    md = ["", f"## Several GPUs: {mg.get('kind')} (scripts/multi_gpu.sh, {_f(mg.get('prompt_tokens'), ',')} tokens)", "",
          f"Prefill on GPU {pl.get('prefill_gpus')}, decode ranks on GPU(s) {pl.get('decode_gpus')}; "
          f"peer ceiling: {mg.get('peer_ceiling_what') or 'none'} = {_f(mg.get('peer_ceiling_gbps'), ',.0f')} GB/s.", "",
          "| engine | path | transfer GB/s | % of peer ceiling | whole GB/s | rank GPUs | verified |",
          "|---|---|---:|---:|---:|---|---|"]
    md += [f"| {r['engine']} | {r['path']} | {_f(r['transfer_gbps'], ',.1f')} | {_f(r['transfer_pct_of_peer'], '.1f')} | "
           f"{_f(r['request_gbps'], ',.1f')} | {','.join(map(str, r['rank_gpus']))} | {r['verified']} |" for r in mg.get("runs", [])]
    merge = mg.get("merge") or {}
    if merge.get("rows"):
        md += ["", "| combine | mesh devices | decode step us | merge only us | equal |", "|---|---:|---:|---:|---|"]
        md += [f"| {r['combine']} | {r['devices']} | {r['step_us']:,.1f} | {r['merge_us']:,.1f} | "
               f"{r['step_equal'] and r['merge_equal']} |" for r in merge["rows"]]
        e = merge.get("emulated")
        if e:
            md.append(f"| emulated, {e['ranks']} ranks | 1 | {e['step_us']:,.1f} | - | {e['step_equal']} |")
    md.append(f"\nSeveral GPUs: {'FAILED: ' + ', '.join(mg['failed']) if mg.get('failed') else 'all passed'}")
    return md


def _pack_backends(res) -> list[dict]:
    """Per backend of benchmarks/pack_backends.py: s per call, GB/s, exact (or the error)."""
    return [dict(r) for r in (res or {}).get("backends", [])]


def _staged_vs_direct(runs: list[dict]) -> list[dict]:
    """Each staged run beside the direct run of the same engine, tokens and path."""
    out = []
    for s in runs:
        if s["staging"] != "staged":
            continue
        d = next((r for r in runs if r["staging"] == "direct" and (r["engine"], r["tokens"], r["path"]) ==
                  (s["engine"], s["tokens"], s["path"])), None)
        out.append({"engine": s["engine"], "tokens": s["tokens"], "path": s["path"],
                    "direct_gbps": d and d["total_gbps"], "staged_gbps": s["total_gbps"],
                    "staged_over_direct": s["total_gbps"] / d["total_gbps"]
                    if d and d["total_gbps"] and s["total_gbps"] else None,
                    "verified": bool(s["verified"]) and (d is None or bool(d["verified"]))})
    return out


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def summarize(out: str) -> int:
    meta = _load(os.path.join(out, "versions.json")) or {}
    steps = step_rows(os.path.join(out, "steps.tsv"))
    d2d = _load(os.path.join(out, "d2d_ceiling.json"))
    ceilings = _ceilings(d2d)
    runs = _runs(out, ceilings)
    pack = _pack_rows(_load(os.path.join(out, "pack.json")))
    backends_json = _load(os.path.join(out, "pack_backends.json"))
    backends = _pack_backends(backends_json)
    pairs = _staged_vs_direct(runs)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    device = meta.get("device", "unknown device")
    vers = ", ".join(f"{k} {v}" for k, v in meta.items() if k not in ("jax_devices", "device", "commit"))
    md = [f"# GPU suite ({date}, {device}, commit {meta.get('commit', 'unknown')})", "", f"Versions: {vers}", "",
          "| step | rc | seconds | status |", "|---|---:|---:|---|"]
    md += [f"| {s['step']} | {s['rc']} | {s['seconds']} | {s['status']} |" for s in steps]
    md += ["", f"GPU tests: {_pytest_line(out) or 'no result'}", ""]
    if d2d:
        md += ["## Device-to-device ceiling (one process)", "", "| what | tokens | GB | GB/s |", "|---|---:|---:|---:|"]
        md += [f"| {r['what']} | {r['prompt_tokens']:,} | {r['bytes'] / 1e9:.2f} | {r['gbps']:,.0f} |" for r in d2d["rows"]]
        md.append("")
    md += ["## dcp-jax transfer --device gpu (every rank byte-exact?)", "",
           "| step | engine | tokens | path | staging | descriptors/rank | GB | transfer s | transfer GB/s | whole s | "
           "whole GB/s | whole % of ceiling | requests (whole GB/s range) | verified |",
           "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in runs:
        rng = r.get("whole_gbps_range")
        reqs = f"{r.get('requests', 1)}" + (f" ({rng[0]:,.1f}-{rng[1]:,.1f})" if rng else "")
        md.append(f"| {r['step']} | {r['engine']} | {_f(r['tokens'], ',')} | {r['path']} | {r['staging']} | "
                  f"{_f(r['descriptors_per_rank'], ',.0f')} | {r['bytes'] / 1e9:.2f} | {_f(r['transfer_seconds'], '.4f')} | "
                  f"{_f(r['transfer_gbps'], ',.1f')} | {_f(r['total_seconds'], '.4f')} | {_f(r['total_gbps'], ',.1f')} | "
                  f"{_f(r['total_pct_of_ceiling'], '.1f')} | {reqs} | {r['verified']} |")
    if pack:
        md += ["", "## pack_rows on CuPy buffers (benchmarks/pack.py)", "",
               "| geometry | variant | kernel ms | wall ms | wall / kernel |", "|---|---|---:|---:|---:|"]
        md += [f"| {p['geometry']} | {p['variant']} | {_f(p['kernel_ms'], '.4f')} | {_f(p['wall_ms'], '.4f')} | "
               f"{_f(p['wall_over_kernel'], '.2f')} |" for p in pack]
    if pairs:
        md += ["", "## Staged vs direct (dcp-jax transfer, same engine, tokens and path)", "",
               "| engine | tokens | path | direct whole GB/s | staged whole GB/s | staged / direct | verified |",
               "|---|---:|---|---:|---:|---:|---|"]
        md += [f"| {p['engine']} | {_f(p['tokens'], ',')} | {p['path']} | {_f(p['direct_gbps'], ',.1f')} | "
               f"{_f(p['staged_gbps'], ',.1f')} | {_f(p['staged_over_direct'], '.2f')} | {p['verified']} |" for p in pairs]
    if backends_json:
        md += ["", f"## Pack backends (benchmarks/pack_backends.py): {backends_json.get('pack', '')}", "",
               "| backend | arrays | first call s | median s per call | min s | GB/s (read+write) | byte-exact |",
               "|---|---|---:|---:|---:|---:|---|"]
        for b in backends:
            if "error" in b:
                md.append(f"| {b['backend']} | {b.get('kind', '-')} | - | - | - | - | FAILED: {b['error']} |")
            else:
                md.append(f"| {b['backend']} | {b.get('kind', '-')} | {_f(b.get('first_call_s'), '.3f')} | "
                          f"{_f(b.get('median_s'), '.5f')} | {_f(b.get('min_s'), '.5f')} | {_f(b.get('gbps'), ',.1f')} | "
                          f"{'yes' if b.get('exact') else 'NO'} |")
    # only this run's: a folder left by an earlier suite run must not show its figures
    mg = _load(os.path.join(out, "multi_gpu", "multi_gpu.json")) if any(
        s["step"] == "multi_gpu_rehearsal" for s in steps) else None
    md += multi_gpu_lines(mg)
    failed = [s["step"] for s in steps if s["rc"] != 0] + [f"{r['step']}/{r['path']}" for r in runs if not r["verified"]]
    failed += [f"pack_backends/{b['backend']}" for b in backends if "error" in b or not b.get("exact")]
    return write_summary(out, "gpu_suite_summary", "GPU suite", md, failed, {
        "date": date, "device": device, "versions": meta, "steps": steps, "pytest": _pytest_line(out),
        "d2d_ceiling": d2d, "runs": runs, "pack_rows": pack, "multi_gpu": mg, "pack_backends": backends,
        "staged_vs_direct": pairs})


def write_summary(out: str, name: str, title: str, md: list[str], failed: list[str], data: dict) -> int:
    """Ends ``md`` with the verdict line (``title``: all steps passed, or FAILED and what), prints
    it and writes OUT/``name``.md and OUT/``name``.json (``data``, then ``failed``).

    Returns:
        The exit status: 1 if anything failed, else 0.
    """
    md = md + ["", f"{title}: {'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'}"]
    text = "\n".join(md) + "\n"
    print(text)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({**data, "failed": failed}, f, indent=1)
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", action="store_true", help="print versions (saved to OUT/versions.json with --out)")
    ap.add_argument("--out", default=None, help="the suite's output folder")
    args = ap.parse_args(argv)
    if args.versions:
        v = versions()
        for k, x in v.items():
            print(k, x)
        if args.out or os.environ.get("DCP_GPU_OUT"):
            with open(os.path.join(args.out or os.environ["DCP_GPU_OUT"], "versions.json"), "w") as f:
                json.dump(v, f, indent=1)
        return 0
    if not args.out:
        ap.error("--out or --versions is needed")
    return summarize(args.out)


if __name__ == "__main__":
    sys.exit(main())
