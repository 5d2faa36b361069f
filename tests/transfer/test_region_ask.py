"""Region push: the ``region_ask`` of a window goes out as soon as its pack is enqueued (before
the round synchronises the pack), and the write is posted once BOTH the grant came and the pack
is complete. Real engines (NIXL over UCX, Mooncake over TCP) on the host; every path checks the
bytes, the engine's own counters and that no pack region (sender) or receive range (receiver)
stays held.
"""

import pytest

from conftest import Cluster, TransferStatus, arena_free, check_region_timeline, events, region_free, wait_for
from conftest import announced as _announced
from dcp_jax.transfer import _sender_units
from dcp_jax.transfer.staging import Packer

S = TransferStatus
ROW = 48 + 16


def cluster(engine, **kw):
    return Cluster(engine, mode="region", receiver_kw=dict(region_bytes=kw.pop("region_bytes", 3 * ROW)), **kw)


def test_ask_comes_before_packed_and_post_after_both(engine):
    # 3-row receive regions: each rank's rows go in several windows over two chunks.
    c = cluster(engine, dcp_size=3, pages=64)
    try:
        L = 61
        src, dst = c.tables(L)
        c.expect("o", dst, L)
        c.sender.send("o", src, 0, 30)
        c.sender.send("o", src, 30, L)
        assert c.wait("o") == [S.SUCCESS] * 4, c.reasons("o")
        assert c.check_bytes(src, dst, L) == L
        assert all(c.sentinel_pages(r, dst[r]) for r in range(3))
        st = c.sender.request_stats("o")
        windows = check_region_timeline(st["timeline"])
        assert set(windows) == {0, 1, 2}
        for r in range(3):
            # One ask, one pack, one descriptor per window; every window of every rank.
            assert windows[r] == st["ranks"][r]["descriptors"] == c.receivers[r].request_stats("o")["unpacks"] > 1
        assert c.sender.engine.counters.descriptors == sum(windows.values())
        assert all(wait_for(lambda r=r: region_free(r)) for r in c.receivers)
        assert arena_free(c.sender)
    finally:
        c.close()


def test_abort_while_the_asks_are_out_frees_every_region(engine):
    # Both ranks' workers are held (their locks), so the asks sit unanswered: the abort finds
    # every window asked, packed and never granted. Its pack regions come back at once; each
    # rank then grants the ask it reads before the abort, and gives that range back on drained.
    c = cluster(engine, dcp_size=2)
    locks = [r._lock for r in c.receivers]
    held = []
    try:
        src, dst = c.tables(24)
        c.expect("a", dst, 24)
        # Both announcements reached the sender before the ranks' workers stop.
        assert wait_for(lambda: _announced(c.sender, "a") == {0, 1})
        for lk in locks:
            lk.acquire()
            held.append(lk)
        c.sender.send("a", src, 0, 24)
        assert wait_for(lambda: {e[1] for e in events(c.sender, "a", "ask")} == {0, 1}), c.reasons("a")
        assert events(c.sender, "a", "post") == [] and not arena_free(c.sender)
        assert c.sender.request_stats("a")["inflight"] > 0
        c.sender.abort("a")
        assert c.sender.poll("a") is S.ABORTED
        assert arena_free(c.sender), c.sender.stats["arena"]  # at once: nothing reads them
        assert c.sender.request_stats("a")["inflight"] == 0 and c.sender.is_drained("a")
        while held:
            held.pop().release()
        assert wait_for(lambda: all(r.poll("a") is S.ABORTED and r.is_drained("a") for r in c.receivers)), \
            c.reasons("a")
        for recv in c.receivers:
            assert wait_for(lambda r=recv: region_free(r)), recv.stats
            assert recv.stats["region"]["acquires"] >= 1  # the ask was granted, then given back
        assert c.sender.engine.counters.descriptors == 0
        assert events(c.sender, "a", "post") == []
        # The regions serve the next request.
        src2, dst2 = c.tables(11)
        c.expect("b", dst2, 11)
        c.sender.send("b", src2, 0, 11)
        assert c.wait("b") == [S.SUCCESS] * 3, c.reasons("b")
        assert c.check_bytes(src2, dst2, 11) == 11
        assert wait_for(lambda: arena_free(c.sender)) and all(wait_for(lambda r=r: region_free(r)) for r in c.receivers)
    finally:
        while held:
            held.pop().release()
        c.close()


@pytest.mark.parametrize("where", ["sync", "enqueue"])
def test_pack_failure_fails_the_request_and_frees_both_sides(engine, where, monkeypatch):
    # "sync": the round's synchronisation reports the pack kernel failed, after the asks went
    # out (an asynchronous kernel error surfaces there). "enqueue": the pack raises at once,
    # before any ask. Either way nothing is posted, and no region stays held on either side.
    c = cluster(engine, dcp_size=2)
    try:
        src, dst = c.tables(24)
        c.expect("f", dst, 24)
        assert wait_for(lambda: _announced(c.sender, "f") == {0, 1})  # both ranks' windows in one round

        def boom(*a, **k):
            raise RuntimeError("pack kernel failed (injected)")

        if where == "sync":
            monkeypatch.setattr(_sender_units, "_sync_arrays", boom)
        else:
            monkeypatch.setattr(Packer, "pack_windows", boom)
            monkeypatch.setattr(Packer, "__call__", boom)
        c.sender.send("f", src, 0, 24)
        assert c.wait("f") == [S.FAILED] * 3, c.reasons("f")
        monkeypatch.undo()
        assert "pack kernel failed (injected)" in c.sender.failure_reason("f")
        assert all("pack kernel failed (injected)" in r.failure_reason("f") for r in c.receivers)
        asked = {e[1] for e in events(c.sender, "f", "ask")}
        assert asked == ({0, 1} if where == "sync" else set())
        assert events(c.sender, "f", "packed") == events(c.sender, "f", "post") == []
        st = c.sender.request_stats("f")
        assert st["inflight"] == 0 and all(v["descriptors"] == 0 for v in st["ranks"].values())
        assert c.sender.engine.counters.descriptors == c.sender.stats["descriptors"] == 0
        assert arena_free(c.sender), c.sender.stats["arena"]
        assert wait_for(lambda: all(r.is_drained("f") for r in c.receivers))
        for recv in c.receivers:
            assert wait_for(lambda r=recv: region_free(r)), recv.stats
            assert recv.request_stats("f")["unpacks"] == 0
        # The sender lives on: the next request lands, byte-exact.
        src2, dst2 = c.tables(13)
        c.expect("g", dst2, 13)
        c.sender.send("g", src2, 0, 13)
        assert c.wait("g") == [S.SUCCESS] * 3, c.reasons("g")
        assert c.check_bytes(src2, dst2, 13) == 13
        check_region_timeline(c.sender.request_stats("g")["timeline"])
    finally:
        c.close()
