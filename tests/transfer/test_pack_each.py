"""A round packed window by window (`SenderPack._pack_each`, what a GPU sender does when every
window's bucket was compiled for the direct launch): each window's ``region_ask`` goes out, then
its pack, then the next window's ask; each window has a ticket of its own, so it is posted once
its own pack ended. Here on the host (`Packer.launches_each` forced on: host packs end inside the
call), with real engines: byte-exact, one launch a window, a window whose pack fails ends only
its request, every region back."""
import pytest

from conftest import Cluster, TransferStatus, announced, arena_free, region_free, wait_for
from dcp_jax.transfer.staging import Packer

S = TransferStatus


@pytest.fixture
def each(monkeypatch):
    """Forces the window-by-window round and records its asks and packs in order."""
    log = []
    monkeypatch.setattr(Packer, "launches_each", lambda self, windows: True)
    call = Packer.__call__

    def packing(self, idx, offset, *, sync=True):
        log.append(("pack", int(offset)))
        return call(self, idx, offset, sync=sync)

    monkeypatch.setattr(Packer, "__call__", packing)
    from dcp_jax.transfer._sender_region import SenderRegion

    ask = SenderRegion._ask_region

    def asking(self, u):
        log.append(("ask", u.target.conn.spec.dcp_rank))
        return ask(self, u)

    monkeypatch.setattr(SenderRegion, "_ask_region", asking)
    return log


@pytest.mark.parametrize("notify", ["round", "write"])
def test_each_window_is_asked_then_packed_byte_exact(engine, each, notify):
    c = Cluster(engine, dcp_size=3, mode="region", receiver_kw=dict(region_bytes=64 << 20), region_notify=notify)
    try:
        L = 40
        src, dst = c.tables(L)
        c.expect("e", dst, L)
        assert wait_for(lambda: announced(c.sender, "e") == {0, 1, 2})  # one round: a window to each rank
        c.sender.send("e", src, 0, L)
        assert c.wait("e") == [S.SUCCESS] * 4, c.reasons("e")
        assert c.check_bytes(src, dst, L) == L
        assert all(c.sentinel_pages(r, dst[r]) for r in range(3))
        assert [k for k, _ in each] == ["ask", "pack"] * 3, each  # ask, pack; ask, pack; ...
        assert sorted(r for k, r in each if k == "ask") == [0, 1, 2]
        st = c.sender.request_stats("e")
        assert st["launches"] == 3 and st["pack_seconds"] > 0
        assert all(wait_for(lambda r=r: region_free(r)) for r in c.receivers)
        assert arena_free(c.sender)
    finally:
        c.close()


def test_a_window_whose_pack_fails_ends_its_request_and_the_next_one_goes(engine, each, monkeypatch):
    c = Cluster(engine, dcp_size=2, mode="region", receiver_kw=dict(region_bytes=64 << 20))
    try:
        packing = Packer.__call__
        fail = {"left": 1}

        def second_fails(self, idx, offset, *, sync=True):
            if sum(k == "pack" for k, _ in each) == 1 and fail["left"]:  # the round's second window
                fail["left"] = 0
                raise RuntimeError("pack launch failed")
            return packing(self, idx, offset, sync=sync)

        monkeypatch.setattr(Packer, "__call__", second_fails)
        L = 24
        src, dst = c.tables(L)
        c.expect("f", dst, L)
        assert wait_for(lambda: announced(c.sender, "f") == {0, 1})
        c.sender.send("f", src, 0, L)
        assert c.sender.wait("f", 10) == S.FAILED
        assert "pack launch failed" in c.sender.failure_reason("f")
        assert all(wait_for(lambda r=r: r.poll("f").terminal) for r in c.receivers)
        assert wait_for(lambda: arena_free(c.sender)) and all(wait_for(lambda r=r: region_free(r)) for r in c.receivers)
        src2, dst2 = c.tables(L)
        c.expect("g", dst2, L)
        assert wait_for(lambda: announced(c.sender, "g") == {0, 1})
        c.sender.send("g", src2, 0, L)
        assert c.wait("g") == [S.SUCCESS] * 3, c.reasons("g")
        assert c.check_bytes(src2, dst2, L) == L
    finally:
        c.close()
