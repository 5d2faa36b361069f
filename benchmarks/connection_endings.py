"""How fast a connection's end reaches the other side, for two versions of the library side by side.

    python benchmarks/connection_endings.py [--base DIR] [--reps 3] [--peer-timeout 4]
        [--json benchmarks/results/connection_endings_cpu.json]

One sender and two decode ranks (DCP1 -> DCP2) in one process, real engines on loopback, host
memory, ``peer_timeout_s`` = --peer-timeout on every side. Cases, each on fresh objects:

- ``receiver_close``: decode rank 0 calls ``close()`` with a request announced: seconds until the
  sender no longer counts its connection (and when the request failed);
- ``sender_close``: the sender calls ``close()``: seconds until decode rank 0 no longer counts its
  link, and what a new ``expect`` does right then;
- ``twin``: a second receiver at rank 0's position connects while rank 0 is alive: what its
  ``connect`` did, and whether a request to the group then succeeded (rows byte-exact);
- ``restart``: rank 0 closes and a new receiver at its position connects at once: seconds until
  ``connect`` returned.

--base DIR (a copy of an older tree: ``git archive REV dcp_jax bridge pallas_kernels | tar x -C
DIR``) runs the same cases with that code in a second process, and the table shows both, medians
over --reps. Host-side figures: only the ratios and outcomes mean something off the GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ENV = dict(UCX_NET_DEVICES="lo", UCX_LOG_LEVEL="fatal", MC_LOG_LEVEL="ERROR")
ITEMS, PAGE, PAGES = (48, 16), 4, 32


def _wait(cond, timeout_s):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s and not cond():
        time.sleep(0.002)
    return time.perf_counter() - t0 if cond() else None


def _known(side, rid):
    try:
        side.poll(rid)
        return True
    except KeyError:
        return False


def _group(engine, pt):
    import numpy as np

    from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender

    rng = np.random.default_rng()
    src = [rng.integers(0, 256, (PAGES, PAGE, il), dtype=np.uint8) for il in ITEMS]
    sender = KVSender(KVCacheSpec(2, ITEMS, PAGE), src, engine=engine, peer_timeout_s=pt)
    recvs, dsts = [], []
    for r in range(2):
        dsts.append([np.zeros((PAGES, PAGE, il), np.uint8) for il in ITEMS])
        recvs.append(KVReceiver(KVCacheSpec(2, ITEMS, PAGE, 2, r), dsts[-1], engine=engine, peer_timeout_s=pt))
        recvs[-1].connect(sender.address)
    return sender, recvs, src, dsts


def _announce(sender, recvs, rid, tokens=16):
    import numpy as np

    for r in recvs:
        r.expect(rid, np.arange(-(-tokens // 2 // PAGE)), tokens)
    _wait(lambda: _known(sender, rid), 5)


def case(name, engine, pt):
    """One run of a case; returns a dict of its figures."""
    import numpy as np

    from dcp_jax.transfer import HandshakeError, KVCacheSpec, KVReceiver

    sender, recvs, src, dsts = _group(engine, pt)
    try:
        if name == "receiver_close":  # the request fails through its own "failed" frame in both versions
            _announce(sender, recvs, "a")
            recvs[0].close()
            failed = _wait(lambda: sender.poll("a").terminal, 3 * pt)
            s = _wait(lambda: sender.stats["connections"] == 1, 3 * pt)
            return dict(seconds=s, outcome=f"request failed after {failed:.3f} s ({sender.failure_reason('a')})")
        if name == "sender_close":
            sender.close()
            s = _wait(lambda: recvs[0].stats["connections"] == 0, 3 * pt)
            try:
                recvs[0].expect("c", np.arange(2), 16)
                outcome = "a new expect() was accepted (announced to a closed sender)"
            except RuntimeError as exc:
                outcome = f"a new expect() raised: {exc}"
            return dict(seconds=s, outcome=outcome)
        twin_kv = [np.zeros((PAGES, PAGE, il), np.uint8) for il in ITEMS]
        if name == "twin":
            with KVReceiver(KVCacheSpec(2, ITEMS, PAGE, 2, 0), twin_kv, engine=engine, peer_timeout_s=pt) as twin:
                t0 = time.perf_counter()
                try:
                    twin.connect(sender.address, timeout_s=3 * pt)
                    outcome = "connected"
                except HandshakeError as exc:
                    outcome = f"refused ({exc.field})"
                s = time.perf_counter() - t0
                _announce(sender, recvs, "b", 16)
                sender.send("b", np.arange(4), 0, 16)
                ok = _wait(lambda: all(x.poll("b").terminal for x in [sender] + recvs), 3 * pt) is not None
                status = [x.poll("b").value for x in [sender] + recvs]
                exact = all(np.array_equal(dsts[r][l][0, j], src[l][(2 * j + r) // PAGE, (2 * j + r) % PAGE])
                            for r in range(2) for l in range(2) for j in range(PAGE))
            return dict(seconds=s, outcome=outcome, group_request=status if ok else "no end",
                        rank0_rows_exact=bool(exact))
        if name == "restart":
            recvs[0].close()
            new = KVReceiver(KVCacheSpec(2, ITEMS, PAGE, 2, 0), twin_kv, engine=engine, peer_timeout_s=pt)
            recvs.append(new)
            t0 = time.perf_counter()
            try:
                new.connect(sender.address, timeout_s=3 * pt)
                return dict(seconds=time.perf_counter() - t0, outcome="connected")
            except Exception as exc:  # noqa: BLE001 - the outcome is the figure
                return dict(seconds=time.perf_counter() - t0, outcome=f"{type(exc).__name__}: {exc}"[:120])
        raise ValueError(f"unknown case {name!r}")
    finally:
        for x in recvs + [sender]:
            x.close()


CASES = ("receiver_close", "sender_close", "twin", "restart")


def run_all(engines, reps, pt):
    out = {}
    for engine in engines:
        for name in CASES:
            runs = [case(name, engine, pt) for _ in range(reps)]
            secs = [r["seconds"] for r in runs if r["seconds"] is not None]
            out[f"{engine}/{name}"] = dict(median_s=statistics.median(secs) if secs else None, runs=runs)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="an older tree (dcp_jax, bridge, pallas_kernels) to run beside this one")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peer-timeout", type=float, default=4.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    from bridge import available_engines

    engines = [e for e in ("nixl", "mooncake") if e in available_engines()]
    if a.child:
        print(json.dumps(run_all(engines, a.reps, a.peer_timeout)))
        return
    trees = {"head": str(ROOT)} | ({"base": str(Path(a.base).resolve())} if a.base else {})
    res = {}
    for label, tree in trees.items():
        env = dict(os.environ, **ENGINE_ENV, PYTHONPATH=tree)
        p = subprocess.run([sys.executable, __file__, "--child", "--reps", str(a.reps), "--peer-timeout",
                            str(a.peer_timeout)], env=env, capture_output=True, text=True, cwd=tree, check=True)
        res[label] = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"peer_timeout_s = {a.peer_timeout:g} on every side; medians of {a.reps}")
    print(f"| case | {' | '.join(trees)} |\n|---|{'---|' * len(trees)}")
    for key in res["head"]:
        cells = []
        for label in trees:
            r = res[label][key]
            first = r["runs"][0]
            what = first.get("outcome") or first.get("reason", "")
            s = "no end" if r["median_s"] is None else f"{r['median_s']:.3f} s"
            extra = f", group request {first['group_request']}, rows exact {first['rank0_rows_exact']}" \
                if "group_request" in first else ""
            cells.append(f"{s}: {what[:90]}{extra}")
        print(f"| {key} | {' | '.join(cells)} |")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d"), peer_timeout_s=a.peer_timeout,
                                                reps=a.reps, trees=trees, results=res), indent=1))


if __name__ == "__main__":
    main()
