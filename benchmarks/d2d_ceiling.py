"""The device-to-device ceiling: one process copying the main job's bytes on one GPU.

    python benchmarks/d2d_ceiling.py --json out/d2d_ceiling.json --md out/d2d_ceiling.md

The bytes are those of `dcp-jax transfer` (the model's KV for ``--prompt-tokens`` tokens,
`dcp_jax.geometry.ModelGeometry.request_bytes`: 2.30 GB for DeepSeek-V3 at 32,768 tokens). Rows:

- ``cudaMemcpyAsync`` of all of it in one call on one stream: the figure every transfer path is
  compared against (a transfer cannot beat the device copying its own memory);
- the same bytes as ``--ranks`` equal copies, one per stream (as when each decode rank's share is
  written separately).

With ``--peer SRC,DST[,DST...]`` (GPU ordinals) it also measures the peer-to-peer ceiling, the
NVLink figure of a multi-GPU host: ``cudaMemcpyPeerAsync`` of the same bytes from a buffer on GPU
SRC into one on the first DST that is not SRC (peer access enabled where
``cudaDeviceCanAccessPeer`` allows; the row says whether it was), and with several DSTs the bytes split evenly over them, one stream each,
all at once (the prefill GPU writing to every decode GPU). Each destination is checked word-exact
against the pattern regenerated on its own GPU. ``--peer 0,0`` on a one-GPU host is the rehearsal
(a same-device copy through the peer API).

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


def _fan_out_seconds(cp, streams, copies) -> float:
    """CUDA-event seconds of ``copies[k](streams[k])`` for every k at once, on the current device:
    every stream starts after one event on the null stream, which waits for them all before the
    stop event."""
    main = cp.cuda.Stream.null
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    main.synchronize()
    start.record(main)
    for s, issue in zip(streams, copies):
        s.wait_event(start)
        issue(s)
        ev = cp.cuda.Event()
        ev.record(s)
        main.wait_event(ev)
    stop.record(main)
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3


def _time_copy(cp, dst, src, streams, repeats):
    """Median CUDA-event seconds of copying src into dst, split evenly over `streams`."""
    n = src.nbytes
    parts = len(streams)
    edges = [n * k // parts for k in range(parts + 1)]
    rt = cp.cuda.runtime
    copies = [lambda s, lo=lo, hi=hi: rt.memcpyAsync(dst.data.ptr + lo, src.data.ptr + lo, hi - lo,
                                                     rt.memcpyDeviceToDevice, s.ptr)
              for lo, hi in zip(edges, edges[1:])]
    times = []
    for rep in range(repeats + 1):  # the first one warms up
        dst.fill(0xA5)
        seconds = _fan_out_seconds(cp, streams, copies)
        if rep:
            times.append(seconds)
        # word-exact check of every repeat (uint64 view: 8x fewer elements to compare)
        if not bool(cp.array_equal(dst.view(cp.uint64), src.view(cp.uint64))):
            raise AssertionError("device copy is not exact")
    return float(np.median(times)), times


_GOLDEN = 0x9E3779B97F4A7C15


def _pattern(cp, lo_word: int, hi_word: int):
    """Words lo..hi-1 of the source pattern (a golden-ratio hash of the index: distinct everywhere)."""
    return cp.arange(lo_word, hi_word, dtype=cp.uint64) * cp.uint64(_GOLDEN)


def parse_peer(text: str) -> tuple[int, list[int]]:
    """``"0,1"`` / ``"0,1,2,3"`` -> (source GPU, destination GPUs).

    Raises:
        ValueError: not at least two non-negative ints, or a destination named twice (names --peer).
    """
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--peer={text!r} must be SRC,DST[,DST...] GPU numbers") from None
    if len(ids) < 2 or min(ids) < 0 or len(set(ids[1:])) != len(ids) - 1:
        raise ValueError(f"--peer={text!r} must be SRC,DST[,DST...]: GPU numbers >= 0, destinations distinct")
    return ids[0], ids[1:]


def _time_peer(cp, n_words: int, src_dev: int, dst_devs: list[int], repeats: int) -> tuple[float, list, dict]:
    """Median CUDA-event seconds of copying n_words * 8 bytes from GPU src_dev into dst_devs (split
    evenly, one stream each, concurrently), every repeat checked word-exact on each destination."""
    rt = cp.cuda.runtime
    peer = {}
    for d in dst_devs:
        peer[d] = d == src_dev or bool(rt.deviceCanAccessPeer(src_dev, d))
        if d != src_dev and peer[d]:
            with cp.cuda.Device(src_dev):
                try:
                    rt.deviceEnablePeerAccess(d)
                except rt.CUDARuntimeError as e:  # already enabled by an earlier row
                    if "PeerAccessAlreadyEnabled" not in str(e):
                        raise
    edges = [n_words * k // len(dst_devs) for k in range(len(dst_devs) + 1)]
    with cp.cuda.Device(src_dev):
        src = _pattern(cp, 0, n_words)
        streams = [cp.cuda.Stream(non_blocking=True) for _ in dst_devs]
    dsts = []
    for d, lo, hi in zip(dst_devs, edges, edges[1:]):
        with cp.cuda.Device(d):
            dsts.append(cp.empty(hi - lo, cp.uint64))
    copies = [lambda s, d=d, dst=dst, lo=lo, hi=hi: rt.memcpyPeerAsync(dst.data.ptr, d, src.data.ptr + 8 * lo,
                                                                       src_dev, 8 * (hi - lo), s.ptr)
              for d, dst, lo, hi in zip(dst_devs, dsts, edges, edges[1:])]
    times = []
    for rep in range(repeats + 1):  # the first one warms up
        for d, dst in zip(dst_devs, dsts):
            with cp.cuda.Device(d):
                dst.view(cp.uint8).fill(0xA5)
                cp.cuda.Device(d).synchronize()
        with cp.cuda.Device(src_dev):
            seconds = _fan_out_seconds(cp, streams, copies)
        if rep:
            times.append(seconds)
        for d, dst, lo, hi in zip(dst_devs, dsts, edges, edges[1:]):
            with cp.cuda.Device(d):
                if not bool(cp.array_equal(dst, _pattern(cp, lo, hi))):
                    raise AssertionError(f"peer copy GPU {src_dev} -> GPU {d} is not exact")
    del src, dsts, copies  # copies holds the destinations too: all must go before the pool frees them
    for d in {src_dev, *dst_devs}:
        with cp.cuda.Device(d):
            cp.get_default_memory_pool().free_all_blocks()
    return float(np.median(times)), times, peer


def peer_rows(cp, geo, tokens: int, src: int, dsts: list[int], repeats: int) -> list[dict]:
    """The --peer rows for one request size: SRC -> the first DST other than SRC (the NVLink pair;
    SRC itself when it is the only one), whole; then SRC -> all DSTS split, if several."""
    n_words = geo.request_bytes(tokens) // 8
    pair = next((d for d in dsts if d != src), dsts[0])
    rows = []
    for targets in ([pair], dsts) if len(dsts) > 1 else ([pair],):
        med, all_s, peer = _time_peer(cp, n_words, src, targets, repeats)
        what = (f"cudaMemcpyPeerAsync GPU {src} -> GPU {targets[0]}" if len(targets) == 1 else
                f"cudaMemcpyPeerAsync GPU {src} -> GPUs {','.join(map(str, targets))}, 1/{len(targets)} each at once")
        rows.append({"what": what, "model": geo.name, "prompt_tokens": tokens, "bytes": 8 * n_words,
                     "seconds_median": med, "seconds": all_s, "gbps": 8 * n_words / med / 1e9, "exact": True,
                     "peer": {"src": src, "dst": targets, "peer_access": [peer[d] for d in targets],
                              "same_device": targets == [src]}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-v3", help="geometry name (dcp_jax.geometry)")
    ap.add_argument("--prompt-tokens", type=int, action="append", default=None,
                    help="tokens whose KV is copied (repeatable; default 32768)")
    ap.add_argument("--ranks", type=int, default=8, help="streams of the split copy row")
    ap.add_argument("--repeats", type=int, default=5, help="timed copies per row (median)")
    ap.add_argument("--peer", default=None, help="also the peer-to-peer rows: SRC,DST[,DST...] GPU numbers")
    ap.add_argument("--json", default=None, help="write results JSON here")
    ap.add_argument("--md", default=None, help="write a markdown table here")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.ranks < 1:
        ap.error("--repeats and --ranks must be >= 1")
    try:
        peer = parse_peer(args.peer) if args.peer else None
    except ValueError as e:
        ap.error(str(e))
    import cupy as cp

    ndev = cp.cuda.runtime.getDeviceCount()
    if peer and max(peer[0], *peer[1]) >= ndev:
        ap.error(f"--peer={args.peer}: this host shows {ndev} GPU(s)")

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
        if peer:
            rows += peer_rows(cp, geo, tokens, peer[0], peer[1], args.repeats)
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
