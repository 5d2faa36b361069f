"""`KVSender.warm_up` in a live connection, on the CPU: the compiles run outside the sender's lock
(heartbeats and rounds go on while they take long), and a round's pack launch stays within the
largest bucket compiled (the windows past it go out in the next round, every byte still lands)."""

import time

import numpy as np
import pytest

import pallas_kernels
from conftest import Cluster, TransferStatus, announced, wait_for
from pallas_kernels.config import buckets_up_to

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
        c.round_trip("a", 13)
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


# (round_rows, bucket warm_up asks for, windows of each pack launch) for 4 ranks of 100 rows
ROUNDS = [
    (None, 256, [2, 2]),  # the bucket of one window and a row block (128 + 64): two windows a launch
    (512, 512, [4]),  # a window to each of the 4 ranks: 4 x 128, one launch
    (256, 256, [2, 2]),  # two windows a launch
    (300, 512, [2, 2]),  # the bucket compiled is 512, the round still stops at 300 rows
    (10, 128, [1, 1, 1, 1]),  # at least one window a launch, and that window's bucket compiled
]


def test_warm_up_covers_a_round_of_one_window_per_rank(engine, monkeypatch):
    # A device compiles every bucket up to what warm_up asks; the host gather compiles none, so
    # stand in for the compile and check the sender's side: by default the buckets reach the
    # bucket of one window of max_rows and a row block, each launch filling it (a 32k chunk to 8
    # ranks: four launches, measured better than one on the region path); round_rows sets a launch.
    asked = []

    def compiled(source, pack, max_rows, **kw):
        asked.append(max_rows)
        return buckets_up_to(max_rows, 64)

    n, rows = 4, 100  # 100 rows to each rank: 128 index rows each in blocks of 64
    c = Cluster(engine, dcp_size=n, mode="packed", pages=640)  # 6 requests of 100 pages
    try:
        assert c.sender._index_block == 64
        assert wait_for(lambda: len(c.sender._conns) == n)
        assert c.sender.warm_up(rows, round_rows=256) == {"pack": [], "fused": []}  # host KV
        assert _pack_launches(c, "host", rows) == [2, 2]  # round_rows bounds host rounds too
        monkeypatch.setattr(pallas_kernels, "warm_pack_windows", compiled)
        for k, (round_rows, asked_rows, launches) in enumerate(ROUNDS):
            got = c.sender.warm_up(rows, round_rows=round_rows)
            assert asked[k:] == [asked_rows] and got["pack"][-1] == asked_rows, (round_rows, asked)
            assert _pack_launches(c, f"r{k}", rows) == launches, round_rows
    finally:
        c.close()


def test_warm_up_refuses_bad_sizes():
    # The checks come before any engine work: one engine is enough.
    c = Cluster("nixl", dcp_size=1, mode="packed", connect=False)
    try:
        for kw, exc, text in [
            (dict(round_rows=0), ValueError, "round_rows=0 must be an int >= 1"),
            (dict(round_rows=2.0), TypeError, "round_rows must be an int"),
            (dict(round_rows=True), TypeError, "round_rows must be an int"),
            (dict(max_rows=-1), ValueError, "max_rows=-1 must be an int >= 1"),
        ]:
            with pytest.raises(exc, match=text):
                c.sender.warm_up(**kw)
    finally:
        c.close()


def test_warm_up_asks_no_more_than_the_pack_buffer_holds(monkeypatch):
    # max_rows=None: a window as large as the pack buffer; the round's windows share it, so the
    # ask is the buffer's rows plus a row block per rank, not dcp_size buffers.
    asked = []
    monkeypatch.setattr(pallas_kernels, "warm_pack_windows",
                        lambda source, pack, max_rows, **kw: asked.append(max_rows) or [])
    c = Cluster("nixl", dcp_size=4, mode="packed", pages=32, pack_bytes=200 * 64)  # 200 rows of 64 B
    try:
        assert wait_for(lambda: len(c.sender._conns) == 4)
        assert c.sender.warm_up() == {"pack": [], "fused": []}
        assert c.sender._max_region_rows == 200
        assert asked == [512]  # bucket_rows(200 + 4 * 64)
    finally:
        c.close()


def _pack_launches(c, rid, rows):
    """Sends one request of ``rows`` rows to each rank, once every rank announced it (so its
    windows are queued together), byte-exact; returns the windows of each pack launch."""
    n, sizes = c.dcp_size, []
    real = c.sender._packer.pack_windows
    c.sender._packer.pack_windows = lambda windows, **kw: (sizes.append(len(windows)), real(windows, **kw))[1]
    try:
        src, dst = c.tables(n * rows)
        c.expect(rid, dst, n * rows)
        assert wait_for(lambda: announced(c.sender, rid) == set(range(n)))
        c.sender.send(rid, src, 0, n * rows)
        assert c.wait(rid) == [S.SUCCESS] * (n + 1), c.reasons(rid)
        assert c.check_bytes(src, dst, n * rows) == n * rows
    finally:
        del c.sender._packer.pack_windows  # the class's method again
    assert c.sender.request_stats(rid)["launches"] == len(sizes)  # the rounds, as stats say
    return sizes


def test_a_named_xla_backend_warms_its_buckets_and_a_request_compiles_nothing(engine):
    # Before: warm_up returned [] for any named pack_backend, and the xla backend compiled each
    # new window size inside the request, uncounted by stats["kernel_compiles"].
    c = Cluster(engine, dcp_size=2, mode="packed", pages=128, pack_backend="xla")
    try:
        assert wait_for(lambda: len(c.sender._conns) == 2)
        got = c.sender.warm_up(100)
        assert got["pack"] and got["pack"][-1] >= 2 * 100, got
        before = c.sender.stats["kernel_compiles"]
        for k, n in enumerate((150, 151, 200)):  # 75, 76 and 100 rows a rank
            c.round_trip(f"r{k}", n)
        assert c.sender.stats["kernel_compiles"] == before
    finally:
        c.close()


def test_receiver_warm_up_on_host_kv_compiles_nothing_checks_its_argument_and_serves(engine):
    """`KVReceiver.warm_up`: host layers are unpacked by numpy, so nothing compiles; its
    argument is checked like the sender's; the region path serves after it."""
    from pallas_kernels import compile_count

    c = Cluster(engine, dcp_size=2, mode="region", connect=False, receiver_kw=dict(region_bytes=1 << 16))
    try:
        count = compile_count()
        for r in c.receivers:
            assert r.warm_up() == {"unpack": []} and r.warm_up(max_rows=8) == {"unpack": []}
            for bad in (0, -2):
                with pytest.raises(ValueError, match="max_rows"):
                    r.warm_up(bad)
            for bad in (True, 1.0, "8"):
                with pytest.raises(TypeError, match="max_rows"):
                    r.warm_up(bad)
            with pytest.raises(TypeError, match="every_bucket"):
                r.warm_up(8, every_bucket=1)
            r.connect(c.sender.address)
            assert r.warm_up(every_bucket=True) == {"unpack": []}  # after connect too
        assert compile_count() == count
        c.round_trip("u", 29)
    finally:
        c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.receivers[0].warm_up()
