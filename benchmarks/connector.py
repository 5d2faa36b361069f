"""Connector benchmark: requests/s and per-request latency of `KVSender` / `KVReceiver`.

    python benchmarks/connector.py [--quick] [--out benchmarks/results/connector_cpu]

One sender process and two receiver processes (multiprocessing spawn, DCP1 -> DCP2, token
round-robin), real engines on loopback, host memory, numpy KV caches. For each engine (NIXL,
Mooncake) and direction (push: the sender WRITEs; pull: each receiver READs) it runs, in the
same three processes:

- concurrency 1, 8 and 64: N requests of random length (uniform 1..--max-tokens tokens, the same
  seeded lengths for every engine and direction), at most C in flight on the sender;
- a 1-page request (``page_size`` tokens) at concurrency 1, beside the raw engine's own latency
  for one page-sized descriptor (``page_size x item_len`` bytes: one layer's page), measured
  right after it between the same two processes (the sender's and decode rank 0's) with fresh
  `bridge.make_engine` engines: `register`, `add_peer`, then `transfer_batch` + `wait` of that one
  descriptor, WRITE and READ, median of --raw-iters after 20 warm-up transfers.

The whole default run takes about 2.5 minutes on the 2-core machine; ``--quick`` (128 requests
per cell, 20 at concurrency 1, 30 1-page, 200 raw) about 1.5 minutes.

Latency of a request is from ``sender.send()`` (its one chunk) to the moment its last decode rank
completed it (the receiver's `expect` time + `request_latency()`; ``time.perf_counter`` is one
system-wide monotonic clock on Linux, so times of different processes compare). Each receiver
announces (`expect`) up to 2C requests ahead, into disjoint page slots, so a request is normally
expected before it is sent. requests/s = N / (last completion - first send). Every request's
rows carry a header (cell, request, token, layer in the first 16 bytes of every row of every
layer), checked by its receiver after SUCCESS: misrouted rows fail the cell.

Beside this CLI (the parent: `Group`, `run`, the tables): the sender's and receivers' processes,
the row headers and the raw engine in `connector_processes.py`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.connector_processes import (  # noqa: E402, F401 - those Group and run do not use: kept importable here
    DCP_SIZE, ENGINE_ENV, POLL_S, Geometry, _parent_alive, _reuse_drained, _rows, headers_ok, raw_initiator,
    raw_target, receiver_main, recv_cell, send_cell, sender_main, write_headers)


# ---- the parent ---------------------------------------------------------------------------------
class Group:
    """One sender and DCP_SIZE receivers of one engine and direction."""

    def __init__(self, ctx, engine, direction, geo):
        self.geo, self.procs = geo, []
        a, b = ctx.Pipe()
        self._spawn(ctx, sender_main, b, engine, geo)
        self.sender = a
        address = a.recv()
        self.receivers = []
        for r in range(DCP_SIZE):
            a, b = ctx.Pipe()
            self._spawn(ctx, receiver_main, b, engine, direction, r, address, geo)
            self.receivers.append(a)
        for a in self.receivers:
            assert a.recv() == "connected"

    def _spawn(self, ctx, fn, *args):
        p = ctx.Process(target=fn, args=args, daemon=True)
        p.start()
        self.procs.append(p)

    def cell(self, cell, c, lengths):
        for a in self.receivers:
            a.send(("cell", cell, c, lengths))
        for a in self.receivers:
            assert a.recv() == "started"
        self.sender.send(("cell", cell, c, lengths))
        sent = self.sender.recv()
        got = [a.recv() for a in self.receivers]
        t_send = np.asarray(sent["t_send"])
        t_done = np.max([g["t_done"] for g in got], axis=0)
        lat = t_done - t_send
        statuses = [sent["status"]] + [g["status"] for g in got]
        ok = sum(all(s[k] == "SUCCESS" for s in statuses) for k in range(len(lengths)))
        bad = [s[k] for s in statuses for k in range(len(lengths)) if s[k] != "SUCCESS"][:3]
        wall = float(t_done.max() - t_send.min())
        nbytes = int(np.sum(lengths)) * self.geo.layers * self.geo.item_len
        return dict(requests=len(lengths), succeeded=int(ok),
                    verified=int(min(g["verified"] for g in got)), concurrency=c,
                    tokens_mean=float(np.mean(lengths)), requests_per_s=len(lengths) / wall,
                    p50_ms=1e3 * float(np.median(lat)), p99_ms=1e3 * float(np.quantile(lat, 0.99)),
                    max_ms=1e3 * float(lat.max()), over_1s=int((lat > 1).sum()),
                    gbps=nbytes / wall / 1e9, wall_s=wall, kernel_compiles=sent["kernel_compiles"],
                    sender_p50_ms=sent["sender_p50_ms"],
                    failures=bad)

    def raw(self, nbytes, iters):
        self.receivers[0].send(("raw_target", nbytes))
        info, addr = self.receivers[0].recv()
        self.sender.send(("raw", info, addr, nbytes, iters))
        out = self.sender.recv()
        self.receivers[0].send(("raw_close",))
        self.receivers[0].recv()
        return out

    def close(self):
        for a in [self.sender] + self.receivers:
            try:
                a.send(("close",))
                if a.poll(30):
                    a.recv()
            except (OSError, EOFError):  # that process is gone already
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.terminate()


def run(args) -> dict:
    geo = Geometry(args.layers, args.item_len, args.page_size, args.max_tokens, max(args.concurrency))
    os.environ.update(ENGINE_ENV)
    ctx = mp.get_context("spawn")
    rng = np.random.default_rng(args.seed)
    cells = [(k, c, rng.integers(1, args.max_tokens + 1, args.requests_c1 if c == 1 else args.requests))
             for k, c in enumerate(args.concurrency)]
    one_page = np.full(args.one_page_requests, args.page_size)
    rows, raws = [], {}
    load0, t_start = os.getloadavg(), time.perf_counter()
    for engine in args.engines:
        for direction in args.directions:
            t0 = time.perf_counter()
            g = Group(ctx, engine, direction, geo)
            try:
                g.cell(99, 1, one_page[:5])  # warm-up (kernel compiles, first connections)
                for k, c, lengths in cells:
                    rows.append(dict(engine=engine, direction=direction, size="random", **g.cell(k, c, lengths)))
                rows.append(dict(engine=engine, direction=direction, size="1 page",
                                 **g.cell(len(cells), 1, one_page)))
                # the raw engine between the same two processes, right after the 1-page cell
                rows[-1]["raw_engine"] = raws[f"{engine} {direction}"] = g.raw(args.page_size * args.item_len,
                                                                               args.raw_iters)
            finally:
                g.close()
            print(f"{engine} {direction}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=dict(note=f"{os.cpu_count()}-core CPU, loopback, host memory", platform=platform.platform(),
                     cpu=_cpu_model(), loadavg_start=load0, loadavg_end=os.getloadavg()),
        versions=_versions(),
        config=dict(layers=args.layers, item_len=args.item_len, page_size=args.page_size, dcp_size=DCP_SIZE,
                    interleave_size=1, max_tokens=args.max_tokens, lengths="uniform random 1..max_tokens (seeded)",
                    requests=args.requests, requests_c1=args.requests_c1,
                    one_page_requests=args.one_page_requests, raw_iters=args.raw_iters,
                    raw_descriptor_bytes=args.page_size * args.item_len, seed=args.seed, quick=args.quick,
                    sender_mode="auto (packed: I=1 is not a multiple of the page size)"),
        rows=rows, raw_engine=raws, elapsed_s=time.perf_counter() - t_start)


def _cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _versions():
    out = dict(python=platform.python_version(), numpy=np.__version__)
    for name, dist in (("jax", "jax"), ("nixl", "nixl-cu12"), ("nixl", "nixl"),
                       ("mooncake", "mooncake-transfer-engine-non-cuda"), ("mooncake", "mooncake-transfer-engine"),
                       ("pyzmq", "pyzmq"), ("msgpack", "msgpack")):
        if name not in out:
            try:
                out[name] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
    try:
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,  # noqa: E731
                                        cwd=Path(__file__).parent).stdout.strip()
        out["dcp_jax_commit"] = git("rev-parse", "--short", "HEAD")
        if git("status", "--porcelain", "--", "dcp_jax/transfer", "bridge", "pallas_kernels"):
            out["dcp_jax_commit"] += " + uncommitted library changes"
    except OSError:
        pass
    return out


# ---- output -------------------------------------------------------------------------------------
COLUMNS = ("engine", "direction", "requests", "C", "N", "req/s", "p50 ms", "p99 ms", "GB/s", "ok",
           "raw 1-page WRITE / READ p50 ms")


def _cells(r):
    raw = r.get("raw_engine")
    size = f"1..{r['_max']} tok" if r["size"] == "random" else f"1 page ({r['_page']} tok)"
    ok = f"{r['succeeded']}/{r['requests']}" + ("" if r["verified"] == r["requests"] else f" ({r['verified']} hdr)")
    return (r["engine"], r["direction"], size, str(r["concurrency"]), str(r["requests"]),
            f"{r['requests_per_s']:,.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['gbps']:.3f}", ok,
            "" if raw is None else f"{raw['WRITE']['p50_ms']:.3f} / {raw['READ']['p50_ms']:.3f}")


def _annotated(result):
    c = result["config"]
    return [dict(r, _max=c["max_tokens"], _page=c["page_size"]) for r in result["rows"]]


def title(result):
    c = result["config"]
    return (f"KVSender -> {c['dcp_size']} KVReceivers: {c['layers']} layers x {c['item_len']} B, "
            f"page {c['page_size']}, DCP1 -> DCP{c['dcp_size']} (I=1)")


def table(result):
    from rich.table import Table

    t = Table(title=title(result))
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in ("engine", "direction", "requests") else "right")
    for r in _annotated(result):
        t.add_row(*_cells(r))
    return t


def markdown(result) -> str:
    c, m, v = result["config"], result["machine"], result["versions"]
    lines = [f"# Connector benchmark: {title(result)}", "",
             f"Date {result['date']}; machine: {m['note']} ({m['cpu']}, {m['platform']}); load average "
             f"{m['loadavg_start'][0]:.1f} at start, {m['loadavg_end'][0]:.1f} at end.",
             "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".", "",
             f"One sender process and {c['dcp_size']} receiver processes (spawn); requests of 1..{c['max_tokens']} "
             f"tokens (uniform random, seeded, one chunk each), {c['requests']} per cell ({c['requests_c1']} at "
             f"C = 1); {c['one_page_requests']} 1-page requests at C = 1. "
             "Latency: `send()` to the last decode rank's completion. C = requests in flight on the sender. "
             f"Raw engine: one {c['raw_descriptor_bytes']:,}-byte descriptor (`transfer_batch` + `wait`), "
             f"median of {c['raw_iters']}, between the same processes." + (" Quick run." if c["quick"] else ""), "",
             "The machine is shared: other sessions' test runs load the same 2 cores (the load averages "
             "above), so absolute numbers are noisy; the rows of one run were measured under the same load.", "",
             f"Run: `python benchmarks/connector.py{' --quick' if c['quick'] else ''} --out ...`, "
             f"{result.get('elapsed_s', 0):.0f} s.",
             "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * 3 + "---:|" * (len(COLUMNS) - 3)]
    for r in _annotated(result):
        lines.append("| " + " | ".join(_cells(r)) + " |")
    lines.append("")
    for r in result["rows"]:
        if r["size"] == "1 page":
            raw = r["raw_engine"]["READ" if r["direction"] == "pull" else "WRITE"]["p50_ms"]
            sp = r["sender_p50_ms"]
            lines.append(f"- {r['engine']} {r['direction']}: a 1-page request takes {r['p50_ms']:.2f} ms (p50), "
                         f"{r['p50_ms'] / raw:.0f}x the engine's own single {('READ' if r['direction'] == 'pull' else 'WRITE')} "
                         f"of one page ({raw:.3f} ms); on the sender (p50s, `request_stats`): plan {sp['plan']:.2f} ms, "
                         f"pack {sp['pack']:.2f} ms, first submit to sender SUCCESS {sp['first_submit_to_done']:.2f} ms.")
    lines.append("- The gap between a 1-page request and one raw transfer is the connector's own work: the "
                 "sender's plan and pack (above), the control messages (expect, done / pull_ready, pull_done) and "
                 "the workers' polling of engine completions, which wake no socket (a 20 us to 2 ms backoff in "
                 "`dcp_jax/transfer/_worker.py`), on 2 cores shared by 3 processes.")
    for r in result["rows"]:
        if r.get("over_1s"):
            lines.append(f"- {r['engine']} {r['direction']} C = {r['concurrency']} ({r['size']}): {r['over_1s']} "
                         f"request(s) over 1 s, the slowest {r['max_ms'] / 1e3:.1f} s.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", default=["nixl", "mooncake"], choices=["nixl", "mooncake"])
    ap.add_argument("--directions", nargs="+", default=["push", "pull"], choices=["push", "pull"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--requests", type=int, default=200, help="requests per cell at C > 1")
    ap.add_argument("--requests-c1", type=int, default=50, help="requests per cell at C = 1")
    ap.add_argument("--one-page-requests", type=int, default=100)
    ap.add_argument("--raw-iters", type=int, default=500)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--item-len", type=int, default=1152)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="128 requests per cell, 20 at C = 1, 30 1-page, 200 raw")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.requests_c1, args.one_page_requests, args.raw_iters = 128, 20, 30, 200
    result = run(args)
    from rich.console import Console

    Console(width=160).print(table(result))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(result))
        print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}", file=sys.stderr)
    return 0 if all(r["succeeded"] == r["verified"] == r["requests"] for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
