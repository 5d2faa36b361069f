"""The device-to-device ceiling: one process copying the main job's bytes on one GPU.

    python benchmarks/d2d_ceiling.py --json out/d2d_ceiling.json --md out/d2d_ceiling.md

The bytes are those of `dcp-jax transfer` (the model's KV for ``--prompt-tokens`` tokens,
`dcp_jax.geometry.ModelGeometry.request_bytes`: 2.30 GB for DeepSeek-V3 at 32,768 tokens). Rows:

- ``cudaMemcpyAsync`` of all of it in one call on one stream: the figure every transfer path is
  compared against (a transfer cannot beat the device copying its own memory);
- the same bytes as ``--ranks`` equal copies, one per stream (as when each decode rank's share is
  written separately).

GB/s is payload bytes / seconds (the bytes moved once, as the transfer paths count them; the
memory traffic is twice that). Seconds are CUDA-event time of one copy, median of ``--repeats``
after a warm-up; every repeat's destination is poisoned first and checked word-exact after.
Needs CuPy and a CUDA GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def _time_copy(cp, dst, src, streams, repeats):
    """Median CUDA-event seconds of copying src into dst, split evenly over `streams`."""
    n = src.nbytes
    parts = len(streams)
    edges = [n * k // parts for k in range(parts + 1)]
    main = cp.cuda.Stream.null
    times = []
    for rep in range(repeats + 1):  # the first one warms up
        dst.fill(0xA5)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        main.synchronize()
        start.record(main)
        for s, lo, hi in zip(streams, edges, edges[1:]):
            s.wait_event(start)
            cp.cuda.runtime.memcpyAsync(dst.data.ptr + lo, src.data.ptr + lo, hi - lo,
                                        cp.cuda.runtime.memcpyDeviceToDevice, s.ptr)
            ev = cp.cuda.Event()
            ev.record(s)
            main.wait_event(ev)
        stop.record(main)
        stop.synchronize()
        if rep:
            times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
        # word-exact check of every repeat (uint64 view: 8x fewer elements to compare)
        if not bool(cp.array_equal(dst.view(cp.uint64), src.view(cp.uint64))):
            raise AssertionError("device copy is not exact")
    return float(np.median(times)), times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-v3", help="geometry name (dcp_jax.geometry)")
    ap.add_argument("--prompt-tokens", type=int, action="append", default=None,
                    help="tokens whose KV is copied (repeatable; default 32768)")
    ap.add_argument("--ranks", type=int, default=8, help="streams of the split copy row")
    ap.add_argument("--repeats", type=int, default=5, help="timed copies per row (median)")
    ap.add_argument("--json", default=None, help="write results JSON here")
    ap.add_argument("--md", default=None, help="write a markdown table here")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.ranks < 1:
        ap.error("--repeats and --ranks must be >= 1")
    import cupy as cp

    from dcp_jax.geometry import get_geometry

    geo = get_geometry(args.model)
    dev = cp.cuda.Device(0)
    props = cp.cuda.runtime.getDeviceProperties(0)
    device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    rows = []
    for tokens in args.prompt_tokens or [32768]:
        n = geo.request_bytes(tokens)
        n -= n % 8  # the uint64 check view
        with dev:
            # distinct words everywhere (a golden-ratio hash of the index), no large temporaries
            src = (cp.arange(n // 8, dtype=cp.uint64) * cp.uint64(0x9E3779B97F4A7C15)).view(cp.uint8)
            dst = cp.empty_like(src)
            one = [cp.cuda.Stream(non_blocking=True)]
            many = [cp.cuda.Stream(non_blocking=True) for _ in range(args.ranks)]
            for label, streams in (("cudaMemcpyAsync, 1 stream", one),
                                   (f"cudaMemcpyAsync, {args.ranks} streams of 1/{args.ranks}", many)):
                med, all_s = _time_copy(cp, dst, src, streams, args.repeats)
                rows.append({"what": label, "model": geo.name, "prompt_tokens": tokens, "bytes": n,
                             "seconds_median": med, "seconds": all_s, "gbps": n / med / 1e9, "exact": True})
            del src, dst
            cp.get_default_memory_pool().free_all_blocks()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device, "python": platform.python_version(), "cupy": cp.__version__,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(), "repeats": args.repeats}
    lines = [f"# Device-to-device ceiling ({meta['date']}, {device}, cupy {meta['cupy']})", "",
             "| what | tokens | GB moved | seconds (median) | GB/s | exact |", "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['prompt_tokens']:,} | {r['bytes'] / 1e9:.2f} | "
                     f"{r['seconds_median']:.5f} | {r['gbps']:,.0f} | {'yes' if r['exact'] else 'NO'} |")
    text = "\n".join(lines)
    print(text)
    out = {"meta": meta, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    print(json.dumps({"ceiling_gbps": {f"{r['prompt_tokens']}": r["gbps"] for r in rows if "1 stream" in r["what"]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
