"""Probe (GPU): what one region write costs NIXL to post, and how 8 of them end, by posting style.

    python benchmarks/gpu/nixl_post_probe.py [--mb 288] [--ranks 8] [--reps 7]

One process holds a pack buffer of ranks x MB on the GPU; a spawned process holds one agent per
decode rank, each with a receive region of MB. Every round WRITEs each rank's slice with one
descriptor and a notification, then spins on ``check_xfer_state`` until all are DONE. Styles:
  fresh     get_xfer_descs + initialize_xfer + transfer per write (what bridge.nixl does today)
  prepped   prep_xfer_dlist once per rank; make_prepped_xfer + transfer per write
  repost    the handles of the first round posted again (transfer(h, notif)) every round
  threads4  fresh, the 8 posts split over 4 threads
Prints, per style, the median over rounds of: host us per post (each call), the posting's end and
the last DONE (ms after the first post), and GB/s of the round (first post -> last DONE).
The last round of every style is byte-checked on the receiving side.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time

import numpy as np


def _xp(host: bool):
    """(array module, NIXL memory type, device sync) for device or host (--host: a CPU smoke run)."""
    if host:
        return np, "DRAM", lambda: None
    import cupy as cp

    return cp, "VRAM", cp.cuda.Device(0).synchronize


def _ptr(b) -> int:
    return b.ctypes.data if isinstance(b, np.ndarray) else b.data.ptr


def _target(conn, ranks: int, nbytes: int, host: bool) -> None:
    cp, mem, sync = _xp(host)

    from bridge.nixl_agent import agent_config, create_agent

    agents, bufs, mds = [], [], []
    for r in range(ranks):
        a = create_agent(f"dst{r}", agent_config(["UCX"], shared_lock=True), 1000)
        b = cp.zeros(nbytes, cp.uint8)
        a.register_memory([(_ptr(b), nbytes, 0, "")], mem)
        agents.append(a), bufs.append(b), mds.append(bytes(a.get_agent_metadata()))
    conn.send(([_ptr(b) for b in bufs], mds))
    while True:
        cmd = conn.recv()
        if cmd[0] == "add":
            for a in agents:
                a.add_remote_agent(cmd[1])
            conn.send("ok")
        elif cmd[0] == "check":  # rank r's region must equal the value pattern (seed)
            seed = cmd[1]
            sync()
            bad = [r for r, b in enumerate(bufs)
                   if not bool((b[:: 4096] == cp.uint8((seed + r) % 251)).all())]
            conn.send(bad)
        else:
            conn.send("bye")
            return


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=288)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    ap.add_argument("--host", action="store_true", help="host memory (a CPU smoke run of the probe)")
    a = ap.parse_args()
    cp, mem, sync = _xp(a.host)

    from bridge.nixl_agent import agent_config, create_agent

    nbytes, R = a.mb << 20, a.ranks
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_target, args=(child, R, nbytes, a.host), daemon=True)
    p.start()
    dst_addrs, mds = parent.recv()
    agent = create_agent("src", agent_config(["UCX"], shared_lock=True), 1000)
    pack = cp.zeros(R * nbytes, cp.uint8)
    agent.register_memory([(_ptr(pack), R * nbytes, 0, "")], mem)
    names = [agent.add_remote_agent(m) for m in mds]
    names = [n.decode() if isinstance(n, bytes) else n for n in names]
    parent.send(("add", bytes(agent.get_agent_metadata())))
    parent.recv()
    src = [_ptr(pack) + r * nbytes for r in range(R)]

    def descs(r):
        ld = agent.get_xfer_descs(np.array([[src[r], nbytes, 0]], np.int64), mem)
        rd = agent.get_xfer_descs(np.array([[dst_addrs[r], nbytes, 0]], np.int64), mem)
        return ld, rd

    prepped = []
    for r in range(R):
        lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(src[r], nbytes, 0)], mem)
        rp = agent.prep_xfer_dlist(names[r], [(dst_addrs[r], nbytes, 0)], mem)
        prepped.append((lp, rp))
    kept = {}

    def post(style, r, notif):
        if style == "prepped":
            lp, rp = prepped[r]
            h = agent.make_prepped_xfer("WRITE", lp, [0], rp, [0], notif)
            return h, agent.transfer(h)
        if style == "repost" and r in kept:
            return kept[r], agent.transfer(kept[r], notif)
        ld, rd = descs(r)
        h = agent.initialize_xfer("WRITE", ld, rd, names[r], notif)
        st = agent.transfer(h)
        if style == "repost":
            kept[r] = h
        return h, st

    out = {}
    for style in ("fresh", "prepped", "repost", "threads4"):
        rounds = []
        for rep in range(a.reps + 1):  # round 0 warms (connects, maps)
            seed = rep * 7 + len(out)
            for r in range(R):
                pack[r * nbytes:(r + 1) * nbytes].fill((seed + r) % 251)
            sync()
            handles, post_us = [None] * R, [0.0] * R
            t0 = time.perf_counter()

            def run(rs):
                for r in rs:
                    tp = time.perf_counter()
                    handles[r] = post(style if style != "threads4" else "fresh", r, f"{style}-{rep}-{r}".encode())[0]
                    post_us[r] = (time.perf_counter() - tp) * 1e6
            if style == "threads4":
                ts = [threading.Thread(target=run, args=(list(range(i, R, 4)),)) for i in range(4)]
                [t.start() for t in ts]
                [t.join() for t in ts]
            else:
                run(range(R))
            t_posted = time.perf_counter()
            pending = set(range(R))
            while pending:
                for r in list(pending):
                    st = agent.check_xfer_state(handles[r])
                    if st == "DONE":
                        pending.discard(r)
                    elif st == "ERR":
                        raise RuntimeError(f"{style}: ERR for rank {r}")
            t_done = time.perf_counter()
            if style != "repost":
                for h in handles:
                    agent.release_xfer_handle(h)
            if rep:
                rounds.append(dict(post_us=statistics.median(post_us), posted_ms=(t_posted - t0) * 1e3,
                                   done_ms=(t_done - t0) * 1e3, gbps=R * nbytes / (t_done - t0) / 1e9))
        parent.send(("check", seed))
        bad = parent.recv()
        med = {k: round(statistics.median(x[k] for x in rounds), 3) for k in rounds[0]}
        med["byte_check_failed_ranks"] = bad
        out[style] = med
        print("NIXLPOST", style, json.dumps(med), flush=True)
    for h in kept.values():
        agent.release_xfer_handle(h)
    parent.send(("quit",))
    parent.recv()
    if a.json:
        json.dump(dict(mb=a.mb, ranks=R, reps=a.reps, styles=out), open(a.json, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
