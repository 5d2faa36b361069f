"""The region path with its ``done`` notices held by the sender (`_sender_region.REGION_HOLD`, the
issue-13 diagnostic for one GPU shared by both sides): writes go without the engine's
notification, each rank hears ``done`` over the control plane once no region write of the sender
is in flight or waiting. Real engines on the host; the bytes against the sender's rows, no
receive-region range left held, and every ``done`` told after the last write completed."""
import pytest

from conftest import Cluster, TransferStatus, region_free, wait_for
from dcp_jax.transfer import _sender_region

S = TransferStatus


def test_held_notices_land_byte_exact_after_every_write(engine, monkeypatch):
    monkeypatch.setattr(_sender_region, "REGION_HOLD", True)
    c = Cluster(engine, dcp_size=3, mode="region", receiver_kw=dict(region_bytes=64 << 20))
    try:
        L = 37
        src, dst = c.tables(L)
        c.expect("h", dst, L)
        for a, b in [(0, 10), (10, 11), (11, L)]:
            c.sender.send("h", src, a, b)
        assert c.wait("h") == [S.SUCCESS] * 4, c.reasons("h")
        assert c.check_bytes(src, dst, L) == L
        assert all(c.sentinel_pages(r, dst[r]) for r in range(3))
        st = c.sender.request_stats("h")
        at = {k: [t for e, _, t in st["timeline"] if e == k] for k in ("complete", "noted")}
        writes = sum(v["descriptors"] for v in st["ranks"].values())  # one per window with rows
        assert len(at["noted"]) == writes > 0  # every write's notice told by the sender
        assert min(at["noted"]) >= min(at["complete"])  # none before a write had completed
        assert all(wait_for(lambda r=r: region_free(r)) for r in c.receivers)
    finally:
        c.close()


def test_a_done_frame_on_a_connection_that_is_not_region_is_dropped(engine):
    """A peer's ``done`` control frame only counts on a region connection (for a window this
    rank granted): on a packed connection it is dropped, and the request still completes."""
    from dcp_jax.transfer import protocol as proto

    c = Cluster(engine, dcp_size=2, mode="packed")
    try:
        src, dst = c.tables(8)
        c.expect("p", dst, 8)
        recv = c.receivers[0]
        link = next(iter(recv._links))
        before = recv._counts["dropped_messages"]
        with recv._lock:
            recv._on_message(link, proto.decode(proto.encode("done", "p", 0, chunk=0, part=0, nparts=1, start=0,
                                                             stop=8, nrows=4)))
        assert recv._counts["dropped_messages"] == before + 1
        c.sender.send("p", src, 0, 8)
        assert c.wait("p") == [S.SUCCESS] * 3, c.reasons("p")
        assert c.check_bytes(src, dst, 8) == 8
    finally:
        c.close()
