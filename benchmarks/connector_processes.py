"""The connector benchmark's processes: the sender's and the receivers' loops, the row headers they
write and check, and the raw engine measured beside them.

`benchmarks/connector.py` (the parent: `Group`, `run`, the tables) spawns one `sender_main` and
`DCP_SIZE` `receiver_main` processes per engine and direction and drives them over one pipe each;
`Geometry` is the cache shape all of them share.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np

ENGINE_ENV = dict(UCX_NET_DEVICES="lo", UCX_LOG_LEVEL="fatal", NIXL_LOG_LEVEL="WARN", MC_LOG_LEVEL="ERROR")
POLL_S = 2e-4  # the benchmark's own poll interval (slot recycling only; latencies come from the library)
DCP_SIZE = 2


class Geometry:
    def __init__(self, layers, item_len, page_size, max_tokens, max_concurrency):
        self.layers, self.item_len, self.page_size = layers, item_len, page_size
        self.max_tokens, self.max_c = max_tokens, max_concurrency
        self.src_pages_per_req = -(-max_tokens // page_size)
        self.dst_pages_per_req = -(-(-(-max_tokens // DCP_SIZE)) // page_size)

    def spec(self, rank=0, size=1):
        from dcp_jax.transfer import KVCacheSpec

        return KVCacheSpec(self.layers, [self.item_len] * self.layers, self.page_size, size, rank)

    def cache(self, slots, pages_per_slot):
        return [np.zeros((slots * pages_per_slot, self.page_size, self.item_len), np.uint8)
                for _ in range(self.layers)]


# ---- the header every row carries -------------------------------------------------------------
def _rows(table, local, page_size):
    return table[local // page_size] * page_size + local % page_size


def write_headers(cache, table, cell, i, n, page_size):
    t = np.arange(n)
    rows = _rows(table, t, page_size)
    for layer, c in enumerate(cache):
        hdr = c.reshape(c.shape[0] * page_size, -1).view(np.int32)
        hdr[rows, :4] = np.stack([np.full(n, cell), np.full(n, i), t, np.full(n, layer)], axis=1)


def headers_ok(cache, table, cell, i, n, rank, page_size):
    t = np.arange(rank, n, DCP_SIZE)  # the tokens this rank owns (I = 1), local row t // N
    rows = _rows(table, t // DCP_SIZE, page_size)
    for layer, c in enumerate(cache):
        got = c.reshape(c.shape[0] * page_size, -1).view(np.int32)[rows, :4]
        want = np.stack([np.full(len(t), cell), np.full(len(t), i), t, np.full(len(t), layer)], axis=1)
        if not np.array_equal(got, want):
            return False
    return True


# ---- processes ----------------------------------------------------------------------------------
def sender_main(conn, engine, geo: Geometry):
    os.environ.update(ENGINE_ENV)
    from dcp_jax.transfer import KVSender

    slots = geo.max_c
    cache = geo.cache(slots, geo.src_pages_per_req)
    sender = KVSender(geo.spec(), cache, engine=engine, timeout_s=120, peer_timeout_s=60)
    conn.send(sender.address)
    while True:
        cmd = conn.recv()
        if cmd[0] == "cell":
            _, cell, c, lengths = cmd
            conn.send(send_cell(sender, cache, geo, cell, c, lengths))
        elif cmd[0] == "raw":
            conn.send(raw_initiator(engine, *cmd[1:]))
        elif cmd[0] == "close":
            sender.close()
            conn.send("closed")
            return


def send_cell(sender, cache, geo, cell, c, lengths):
    n_req, i = len(lengths), 0
    free, live, draining = list(range(c)), {}, {}
    t_send, status, parts = [0.0] * n_req, [""] * n_req, []
    while i < n_req or live or draining:
        _reuse_drained(sender, draining, free)
        if i < n_req and free:
            slot, n = free.pop(), int(lengths[i])
            table = slot * geo.src_pages_per_req + np.arange(-(-n // geo.page_size))
            write_headers(cache, table, cell, i, n, geo.page_size)  # the "prefill" wrote these rows
            rid = f"c{cell}-{i}"
            t_send[i] = time.perf_counter()
            sender.send(rid, table, 0, n)
            live[rid] = (i, slot)
            i += 1
            continue
        done = [rid for rid in live if sender.poll(rid).terminal]
        for rid in done:
            k, slot = live.pop(rid)
            status[k] = sender.poll(rid).name
            if status[k] != "SUCCESS":
                status[k] += ": " + sender.failure_reason(rid)
            else:
                rs = sender.request_stats(rid)
                parts.append((rs["plan_seconds"], rs["pack_seconds"], rs["transfer_seconds"] or 0.0))
            draining[rid] = slot
        if not done:
            _parent_alive()
            time.sleep(POLL_S)
    st = sender.stats
    plan, pack, xfer = (1e3 * float(np.median(x)) for x in zip(*parts)) if parts else (0.0, 0.0, 0.0)
    return dict(t_send=t_send, status=status, kernel_compiles=st["kernel_compiles"],
                sender_p50_ms=dict(plan=plan, pack=pack, first_submit_to_done=xfer),
                descriptors=st["descriptors"], dropped=st["dropped_messages"])


def receiver_main(conn, engine, direction, rank, address, geo: Geometry):
    os.environ.update(ENGINE_ENV)
    from dcp_jax.transfer import KVReceiver

    slots = 2 * geo.max_c
    cache = geo.cache(slots, geo.dst_pages_per_req)
    recv = KVReceiver(geo.spec(rank, DCP_SIZE), cache, engine=engine, direction=direction,
                      timeout_s=120, peer_timeout_s=60)
    recv.connect(address)
    conn.send("connected")
    raw = None
    while True:
        cmd = conn.recv()
        if cmd[0] == "cell":
            _, cell, c, lengths = cmd
            conn.send(recv_cell(recv, cache, geo, rank, cell, c, lengths, conn))
        elif cmd[0] == "raw_target":
            raw = raw_target(engine, cmd[1])
            conn.send(raw[1])
        elif cmd[0] == "raw_close":
            raw[0][0].close()  # the raw engine (its buffer goes with it)
            conn.send("closed")
        elif cmd[0] == "close":
            recv.close()
            conn.send("closed")
            return


def recv_cell(recv, cache, geo, rank, cell, c, lengths, conn):
    n_req, i, started = len(lengths), 0, False
    free, live, draining = list(range(2 * c)), {}, {}
    t_done, status, verified = [0.0] * n_req, [""] * n_req, 0
    while i < n_req or live or draining:
        _reuse_drained(recv, draining, free)
        if i < n_req and free:  # announce the next request into a free slot of pages
            slot, n = free.pop(), int(lengths[i])
            rows = len(range(rank, n, DCP_SIZE))
            table = slot * geo.dst_pages_per_req + np.arange(-(-rows // geo.page_size))
            rid = f"c{cell}-{i}"
            t_expect = time.perf_counter()
            recv.expect(rid, table, n)
            live[rid] = (i, slot, table, t_expect)
            i += 1
            continue
        if not started:
            conn.send("started")  # the first window is announced: the sender may start
            started = True
        done = [rid for rid in live if recv.poll(rid).terminal]
        for rid in done:
            k, slot, table, t_expect = live.pop(rid)
            status[k] = recv.poll(rid).name
            t_done[k] = t_expect + recv.request_latency(rid)
            if status[k] == "SUCCESS":
                verified += headers_ok(cache, table, cell, k, int(lengths[k]), rank, geo.page_size)
            else:
                status[k] += ": " + recv.failure_reason(rid)
            draining[rid] = slot
        if not done:
            _parent_alive()
            time.sleep(POLL_S)
    if not started:
        conn.send("started")
    return dict(t_done=t_done, status=status, verified=verified)


def _reuse_drained(side, draining, free):
    """Releases finished requests whose pages nothing writes or reads any more; frees their slots."""
    for rid in [r for r in draining if side.is_drained(r)]:
        side.release(rid)
        free.append(draining.pop(rid))


def _parent_alive():
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():  # the benchmark's process died: do not linger
        os._exit(3)


def raw_target(engine, nbytes):
    from bridge import make_engine

    buf = np.zeros(nbytes, np.uint8)
    eng = make_engine(engine, f"raw-target-{os.getpid()}")
    eng.register([buf])
    return (eng, buf), (eng.peer_info(), int(buf.ctypes.data))


def raw_initiator(engine, info, remote_addr, nbytes, iters):
    """Median seconds of one `transfer_batch` + `wait` of one nbytes descriptor, WRITE and READ."""
    from bridge import make_engine

    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    out = {}
    with make_engine(engine, f"raw-init-{os.getpid()}") as eng:
        eng.register([buf])
        peer = eng.add_peer(info)
        descs = np.array([[buf.ctypes.data, remote_addr, nbytes]], np.int64)
        for op in ("WRITE", "READ"):
            times = []
            for k in range(iters + 20):  # 20 warm-up transfers
                t0 = time.perf_counter()
                eng.wait(eng.transfer_batch(peer, descs, op=op), timeout_s=30)
                if k >= 20:
                    times.append(time.perf_counter() - t0)
            out[op] = dict(p50_ms=1e3 * float(np.median(times)), p99_ms=1e3 * float(np.quantile(times, 0.99)),
                           iters=iters)
    return out
