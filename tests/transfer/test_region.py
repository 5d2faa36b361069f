"""The region path end to end with real engines (NIXL over UCX, Mooncake over TCP) on the host:
one descriptor per window into the decode rank's receive region, unpacked into its pages.

Every test checks the bytes against the sender's source rows (the Cluster's own oracle), the
sentinel pages around them, and that no receive-region range stays held afterwards.
"""
import time

import numpy as np
import pytest

import conftest
from conftest import Cluster, TransferStatus, region_free, wait_for
from dcp_jax.transfer import KVReceiver

S = TransferStatus


def cluster(engine, *, region_bytes=64 << 20, receiver_kw=None, **kw):
    """A `Cluster` whose receivers offer a receive region of ``region_bytes`` (host receivers
    offer none by default) and take ``receiver_kw``."""
    return Cluster(engine, receiver_kw=dict(region_bytes=region_bytes, **(receiver_kw or {})), **kw)


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_region_path_lands_byte_exact(engine, direction):
    c = cluster(engine, dcp_size=3, direction=direction, mode="region")
    try:
        L = 37  # partial last page, token round-robin: pages never stay whole (no direct path)
        src, dst = c.tables(L)
        c.expect("r0", dst, L)
        for a, b in [(0, 10), (10, 11), (11, L)]:  # chunked prefill; rank 0 owns nothing of [10, 11)
            c.sender.send("r0", src, a, b)
        assert c.wait("r0") == [S.SUCCESS] * 4, c.reasons("r0")
        assert c.check_bytes(src, dst, L) == L
        for r in range(3):
            assert c.sentinel_pages(r, dst[r])
        st = c.sender.request_stats("r0")
        assert {v["path"] for v in st["ranks"].values()} == {"region"}
        assert {v["strategy"] for v in st["ranks"].values()} == {"region"}
        for r, recv in enumerate(c.receivers):
            rs = recv.request_stats("r0")
            nonempty = sum(1 for a, b in [(0, 10), (10, 11), (11, L)] if any(t % 3 == r for t in range(a, b)))
            # ONE descriptor per (non-empty) window, each window unpacked once.
            assert st["ranks"][r]["descriptors"] == nonempty == rs["unpacks"]
            assert rs["paths"] == ["region"] and rs["unpack_seconds"] > 0
            assert rs["bytes"] == sum(1 for t in range(L) if t % 3 == r) * sum(c.item_lens)
            assert wait_for(lambda: region_free(recv))
    finally:
        c.close()


def test_region_path_into_jax_cpu_layers(engine):
    # JAX CPU arrays are immutable to JAX, but the unpack writes them in place like an engine.
    c = cluster(engine, dcp_size=2, mode="region", kind="jax")
    try:
        src, dst = c.tables(21)
        c.expect("j", dst, 21)
        c.sender.send("j", src, 0, 21)
        assert c.wait("j") == [S.SUCCESS] * 3, c.reasons("j")
        assert c.check_bytes(src, dst, 21) == 21
        assert all(c.sentinel_pages(r, dst[r]) for r in range(2))
    finally:
        c.close()


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_region_smaller_than_the_request_reuses_its_windows(engine, direction):
    # The region holds 3 rows; rank 0 gets 40 rows in one chunk: 14 windows through one region.
    row = 48 + 16
    c = cluster(engine, dcp_size=2, direction=direction, mode="region", region_bytes=3 * row, pages=64)
    try:
        L = 80
        src, dst = c.tables(L)
        c.expect("big", dst, L)
        c.sender.send("big", src, 0, L)
        assert c.wait("big") == [S.SUCCESS] * 3, c.reasons("big")
        assert c.check_bytes(src, dst, L) == L
        assert all(c.sentinel_pages(r, dst[r]) for r in range(2))
        for r, recv in enumerate(c.receivers):
            region = recv.stats["region"]
            assert region["capacity"] == 3 * row and region["high_water_bytes"] <= 3 * row
            assert recv.request_stats("big")["unpacks"] == -(-40 // 3) == region["acquires"]
            assert c.sender.request_stats("big")["ranks"][r]["descriptors"] == 14
            assert wait_for(lambda: region_free(recv))
    finally:
        c.close()


def test_region_path_with_a_prefix_hit_and_concurrent_requests(engine):
    # Three requests at once through 3-row regions (windows of several requests interleave in
    # one region, FIFO), one with a prefix the decode side already holds.
    row = 48 + 16
    c = cluster(engine, dcp_size=2, mode="region", region_bytes=3 * row, pack_bytes=4 * row, pages=96,
                interleave_size=2)
    try:
        reqs = {}
        for rid, L, prefix in (("a", 41, 0), ("b", 30, 8), ("c", 17, 0)):
            src, dst = c.tables(L)
            c.expect(rid, dst, L, prefix_tokens=prefix)
            reqs[rid] = (src, dst, L, prefix)
        for rid, (src, _, L, _) in reqs.items():
            c.sender.send(rid, src, 0, L // 2)
        for rid, (src, _, L, _) in reqs.items():
            c.sender.send(rid, src, L // 2, L)
        for rid, (src, dst, L, prefix) in reqs.items():
            assert c.wait(rid) == [S.SUCCESS] * 3, c.reasons(rid)
            assert c.check_bytes(src, dst, L, prefix_tokens=prefix) == L - prefix
        used = [np.concatenate([reqs[r][1][k] for r in reqs]) for k in range(2)]
        assert all(c.sentinel_pages(k, used[k]) for k in range(2))
        # Rank 0 of "b" owns tokens 8..9, 12..13, ...: the prefix's rows [0, 4) were never written.
        assert (np.asarray(c.dst[0][0])[reqs["b"][1][0][0], :4] == conftest.SENTINEL).all()
        assert all(wait_for(lambda: region_free(r)) for r in c.receivers)
    finally:
        c.close()


@pytest.mark.parametrize("who", ["receiver", "sender"])
def test_abort_during_a_region_transfer_leaves_no_range_held(engine, who):
    # Many small windows through a 2-row region: the abort lands while windows are granted,
    # waiting for room or being written. Afterwards nothing of the region may stay held.
    row = 48 + 16
    c = cluster(engine, dcp_size=2, mode="region", region_bytes=2 * row, pages=128)
    try:
        L = 400
        src, dst = c.tables(L)
        c.expect("a", dst, L)
        c.sender.send("a", src, 0, L)
        assert wait_for(lambda: c.receivers[0].stats["unpacks"] >= 2, 10)
        (c.receivers[0] if who == "receiver" else c.sender).abort("a")
        sides = [c.sender] + c.receivers
        assert wait_for(lambda: all(s.is_drained("a") for s in sides), 10), c.reasons("a")
        assert c.sender.poll("a") is S.ABORTED and c.receivers[0].poll("a") is S.ABORTED
        assert c.receivers[1].poll("a") in (S.ABORTED, S.SUCCESS)  # it may have had all its rows
        for recv in c.receivers:
            assert wait_for(lambda: region_free(recv)), recv.stats
        assert c.sender.stats["arena"]["in_use_bytes"] == 0
        # The receivers still work through the same region afterwards.
        src2, dst2 = c.tables(9)
        c.expect("b", dst2, 9)
        c.sender.send("b", src2, 0, 9)
        assert c.wait("b") == [S.SUCCESS] * 3, c.reasons("b")
        c.check_bytes(src2, dst2, 9)
    finally:
        c.close()


def test_timeout_during_a_region_transfer_leaves_no_range_held(engine):
    row = 48 + 16
    c = cluster(engine, dcp_size=1, mode="region", region_bytes=4 * row, timeout_s=1.0)
    try:
        src, dst = c.tables(16)
        c.expect("t", dst, 16)
        c.sender.send("t", src, 0, 10)  # [10, 16) never comes
        assert c.wait("t", timeout_s=5) == [S.FAILED, S.FAILED]
        assert "no progress" in c.receivers[0].failure_reason("t")
        assert wait_for(lambda: c.receivers[0].is_drained("t"))
        assert wait_for(lambda: region_free(c.receivers[0])), c.receivers[0].stats
        # 10 rows in windows of 4: at most 3 unpacks (fewer when the machine is slow enough for
        # the timeout to catch the first chunk still in flight: its ranges must be free all the same).
        assert c.receivers[0].request_stats("t")["unpacks"] <= 3
    finally:
        c.close()


def test_released_request_still_gives_its_ranges_back(engine):
    # release() right after an abort: the sender's "drained" then finds no request, and must
    # still free the ranges its writes could have reached.
    row = 48 + 16
    c = cluster(engine, dcp_size=1, mode="region", region_bytes=2 * row, pages=128)
    try:
        src, dst = c.tables(300)
        c.expect("x", dst, 300)
        c.sender.send("x", src, 0, 300)
        assert wait_for(lambda: c.receivers[0].stats["unpacks"] >= 1)
        c.receivers[0].release("x")
        assert wait_for(lambda: region_free(c.receivers[0])), c.receivers[0].stats
    finally:
        c.close()


def test_silent_push_sender_keeps_pages_and_ranges_held_until_the_grace(engine):
    # A sender dropped as silent may only be stopped: its engine's writes could still land. Its
    # request's pages and receive-region ranges stay held for drain_grace_s, then are given back.
    row = 48 + 16
    # peer_timeout_s well above the 0.5 s heartbeat: on a loaded machine a shorter one drops the
    # link before the first window lands.
    c = cluster(engine, dcp_size=1, mode="region", region_bytes=2 * row, pages=128, peer_timeout_s=1.5,
                receiver_kw=dict(drain_grace_s=1.5))
    try:
        recv = c.receivers[0]
        src, dst = c.tables(300)
        c.expect("s", dst, 300)
        c.sender.send("s", src, 0, 300)
        assert wait_for(lambda: recv.stats["unpacks"] >= 1)
        c.sender._worker.stop(2.0)  # the sender goes silent: no ping, no write, no drained
        assert wait_for(lambda: recv.poll("s") is S.FAILED, 8)
        t_fail = time.monotonic()
        assert "silent" in recv.failure_reason("s")
        assert not recv.is_drained("s")  # dropped, not known to be done writing
        assert wait_for(lambda: recv.is_drained("s") and region_free(recv), 8), recv.stats
        assert time.monotonic() - t_fail > 0.5  # not at once: the grace had to pass
    finally:
        c.close()


def test_region_bytes_is_checked():
    from dcp_jax.transfer import KVCacheSpec

    spec = KVCacheSpec(1, [16], 4)
    layers = [np.zeros((2, 4, 16), np.uint8)]
    with pytest.raises(ValueError, match="region_bytes=-1"):
        KVReceiver(spec, layers, region_bytes=-1)
    for huge in (2**62 + 1, 2**63, 2**70):  # past any allocator's C size: named, not an OverflowError
        with pytest.raises(ValueError, match=rf"region_bytes={huge} must be None or an int in \[0, 2\*\*62\]"):
            KVReceiver(spec, layers, region_bytes=huge)
    for bad in (1.5, True, "64"):  # not an int: a TypeError, as every int argument
        with pytest.raises(TypeError, match=rf"region_bytes must be an int, got {type(bad).__name__}"):
            KVReceiver(spec, layers, region_bytes=bad)
