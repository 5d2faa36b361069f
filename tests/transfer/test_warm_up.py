"""`KVSender.warm_up` in a live connection, on the CPU: the compiles run outside the sender's lock
(heartbeats and rounds go on while they take long), and a round's pack launch stays within the
largest bucket compiled (the windows past it go out in the next round, every byte still lands)."""

import time

import numpy as np

import pallas_kernels
from conftest import Cluster, TransferStatus

S = TransferStatus


def test_a_slow_warm_up_keeps_the_connections(engine, monkeypatch):
    # A GPU compiles ~0.5 s per bucket and a sender may have 20: longer than peer_timeout_s.
    calls = []

    def slow(*args, **kw):
        calls.append(time.monotonic())
        time.sleep(3.0)
        return []

    monkeypatch.setattr(pallas_kernels, "warm_pack_windows", slow)
    c = Cluster(engine, dcp_size=2, mode="packed", peer_timeout_s=2.0, heartbeat_s=0.5)
    try:
        assert c.sender.warm_up() == {"pack": [], "fused": []} and len(calls) == 1
        assert len(c.sender._conns) == 2  # nobody was dropped as silent meanwhile
        src, dst = c.tables(13)
        c.expect("a", dst, 13)
        c.sender.send("a", src, 0, 13)
        assert c.wait("a") == [S.SUCCESS] * 3, c.reasons("a")
        assert c.check_bytes(src, dst, 13) == 13
    finally:
        c.close()


def test_rounds_stay_within_the_warmed_bucket(engine):
    # As after a warm-up whose largest pack bucket is 64 index rows (block rows of 64: one
    # window per launch): many requests queued at once still all land, round after round.
    c = Cluster(engine, dcp_size=2, mode="packed", pages=256)
    try:
        c.sender._index_cap["pack"] = c.sender._index_block
        reqs = []
        for k in range(6):
            src, dst = c.tables(9 + k)
            c.expect(f"r{k}", dst, 9 + k)
            reqs.append((f"r{k}", src, dst, 9 + k))
        for rid, src, _, n in reqs:
            c.sender.send(rid, src, 0, n)
        for rid, src, dst, n in reqs:
            assert c.wait(rid) == [S.SUCCESS] * 3, c.reasons(rid)
            assert c.check_bytes(src, dst, n) == n
    finally:
        c.close()
