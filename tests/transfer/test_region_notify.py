"""The region path with ``KVSender(region_notify="round")`` (decode ranks on the sender's own
GPU): writes go without the engine's notification, and each rank hears ``done`` over the control
plane once every region write of its pack round has completed. Real engines on the host; the
bytes against the sender's rows, no receive-region range left held, every ``done`` told after
its round's last write completed; the option checked and set once."""
import pytest

from conftest import Cluster, TransferStatus, region_free, wait_for

S = TransferStatus


@pytest.mark.parametrize("bad", ["Round", "", None, 1])
def test_region_notify_must_be_write_or_round(bad):
    from dcp_jax.transfer import KVCacheSpec, KVSender
    import numpy as np

    spec = KVCacheSpec(num_layers=1, item_lens=(16,), page_size=4)
    with pytest.raises(ValueError, match="region_notify="):
        KVSender(spec, [np.zeros((8, 16), np.uint8)], region_notify=bad)


def test_held_notices_land_byte_exact_after_every_write_of_their_round(engine):
    c = Cluster(engine, dcp_size=3, mode="region", receiver_kw=dict(region_bytes=64 << 20), region_notify="round")
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
        assert c.sender.region_notify == "round"
        with pytest.raises(AttributeError):
            c.sender.region_notify = "write"  # set once: the writes in flight were posted by it
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


def test_close_tells_the_held_notices_of_writes_that_completed(engine):
    """A request's writes complete while another request's window of the same round still
    waits for its grant: the sender reports SUCCESS with that request's notices held; `close`
    right then tells them before its bye, so every rank ends the request SUCCESS, byte-exact."""
    import time

    c = Cluster(engine, dcp_size=2, mode="region", timeout_s=5, peer_timeout_s=2,
                receiver_kw=dict(region_bytes=1 << 20), region_notify="round")
    try:
        r1 = c.receivers[1]
        answer = r1._on_region_ask

        def late(link, msg):  # B's grant from rank 1 comes late: the round stays open
            if msg["rid"] == "B":
                time.sleep(0.004)
            return answer(link, msg)

        r1._on_region_ask = late
        L = 40
        (src_a, dst_a), (src_b, dst_b) = c.tables(L), c.tables(L)
        c.expect("A", dst_a, L)
        c.expect("B", dst_b, L)
        def announced(rid):
            try:
                return len(c.sender.request_stats(rid)["ranks"]) == 2
            except KeyError:  # no rank's announcement has reached the sender yet
                return False

        assert wait_for(lambda: announced("A") and announced("B"))
        with c.sender._lock:  # both requests' windows in one round
            c.sender.send("A", src_a, 0, L)
            c.sender.send("B", src_b, 0, L)
        assert c.sender.wait("A", 5) == S.SUCCESS
        c.sender.close()
        assert [r.wait("A", 8) for r in c.receivers] == [S.SUCCESS] * 2, [r.failure_reason("A") for r in c.receivers]
        assert c.check_bytes(src_a, dst_a, L) == L
    finally:
        c.close()


@pytest.mark.parametrize("notify", ["round", "write"])
def test_a_rank_polls_its_engine_only_for_a_done_the_engine_brings(engine, notify):
    """``region_ask.ctl_done`` says how the window's ``done`` comes: with "round" as a control
    frame, so the granting rank counts no engine notification due (its worker waits on its
    sockets, not in the engine-poll backoff); with "write" through the engine, due from the grant."""
    c = Cluster(engine, dcp_size=2, mode="region", receiver_kw=dict(region_bytes=64 << 20), region_notify=notify)
    try:
        seen = []
        for r in c.receivers:
            grant = r._grant_waiting

            def recording(r=r, grant=grant):
                busy = grant()
                seen.extend((g.ctl_done, g.req.due) for g in r._grants.values())
                return busy

            r._grant_waiting = recording
        L = 24
        src, dst = c.tables(L)
        c.expect("n", dst, L)
        c.sender.send("n", src, 0, L)
        assert c.wait("n") == [S.SUCCESS] * 3, c.reasons("n")
        assert c.check_bytes(src, dst, L) == L
        assert seen and all(ctl == (notify == "round") for ctl, _ in seen), seen
        assert all(due == (0 if notify == "round" else 1) for _, due in seen), seen
    finally:
        c.close()


@pytest.mark.parametrize("bad, want", [(1, r"region_ask\.ctl_done must be a bool"), ("yes", r"ctl_done must be a bool"),
                                       (None, r"ctl_done must be a bool"), ("drop", r"missing fields \['ctl_done'\]")])
def test_a_region_ask_without_a_bool_ctl_done_is_refused_naming_it(bad, want):
    """A peer's ``region_ask`` must say how its ``done`` comes, as a bool: anything else is refused
    by `protocol.decode` before the rank acts on it (the frame is dropped and counted)."""
    import msgpack

    from dcp_jax.transfer import protocol as proto

    m = msgpack.unpackb(proto.encode("region_ask", "r", 1, lo=0, nbytes=8, ctl_done=True, chunk=0, part=0, nparts=1,
                                     start=0, stop=4, nrows=2))
    assert proto.decode(msgpack.packb(m))["ctl_done"] is True
    if bad == "drop":
        del m["ctl_done"]
    else:
        m["ctl_done"] = bad
    with pytest.raises(proto.ProtocolError, match=want):
        proto.decode(msgpack.packb(m))


def test_a_done_frame_for_a_window_the_engine_notifies_fails_the_request_and_keeps_its_range(engine):
    """With ``region_notify="write"`` only the engine's notification follows a window's bytes: a
    ``done`` control frame for such a grant (a faulty sender's, here sent the moment the rank
    granted) fails the request at that rank, naming it, and nothing is unpacked from the range;
    the range is given back only once the sender's write can no longer land (drained). The other
    rank completes its part byte-exact."""
    from dcp_jax.transfer import protocol as proto

    c = Cluster(engine, dcp_size=2, mode="region", receiver_kw=dict(region_bytes=64 << 20), region_notify="write")
    try:
        r0 = c.receivers[0]
        grant, early = r0._grant_waiting, []

        def granting_then_faking():
            busy = grant()
            for g in list(r0._grants.values()):
                if not early:  # the first grant: its done "arrives" by the control plane at once
                    early.append(dict(g.done))
                    frame = proto.encode("done", g.req.rid, g.req.inc, **g.done)
                    r0._on_message(g.link, proto.decode(frame))
            return busy

        r0._grant_waiting = granting_then_faking
        L = 24
        src, dst = c.tables(L)
        c.expect("e", dst, L)
        c.sender.send("e", src, 0, L)
        assert r0.wait("e", 10) == S.FAILED
        assert "came as a control frame" in r0.failure_reason("e"), r0.failure_reason("e")
        assert early and r0._counts["inconsistent_messages"] >= 1
        assert c.sender.wait("e", 10) in (S.FAILED, S.SUCCESS)
        c.sender.release("e")
        assert wait_for(lambda: region_free(r0))  # held until the sender's write could no longer land
    finally:
        c.close()


def test_a_done_frame_for_a_request_that_ended_leaves_an_engine_notified_range_held(engine):
    """The same control frame after the request ended at the rank: dropped and counted, and the
    range stays held (the engine's write may still land there) until the sender says drained."""
    import types

    from dcp_jax.transfer import protocol as proto
    from dcp_jax.transfer._receiver_region import Grant

    c = Cluster(engine, dcp_size=2, mode="region", receiver_kw=dict(region_bytes=1 << 20), region_notify="write")
    try:
        r0 = c.receivers[0]
        link = next(iter(r0._links))
        with r0._lock:
            region = r0._region.acquire(("test", "gone"), 64)
            done = dict(chunk=0, part=0, nparts=1, start=0, stop=4, nrows=2)
            req = types.SimpleNamespace(rid="gone", inc=1)
            key = (id(link), "gone", 1, 0, 0)
            r0._grants[key] = Grant(region, req, link, done, None, ctl_done=False)
            before = r0._counts["dropped_messages"]
            r0._on_message(link, proto.decode(proto.encode("done", "gone", 1, **done)))
            assert key in r0._grants and r0._counts["dropped_messages"] == before + 1
            del r0._grants[key]
            r0._region.free(region)
    finally:
        c.close()


def test_a_second_done_for_a_window_that_landed_is_named_so(engine):
    """A ``done`` for a window this rank already unpacked and counted (a duplicate): the request
    fails, the reason saying the window landed already (not that it was never granted)."""
    from dcp_jax.transfer import protocol as proto

    c = Cluster(engine, dcp_size=2, mode="region", receiver_kw=dict(region_bytes=1 << 20), region_notify="round")
    try:
        r0 = c.receivers[0]
        landed, seen = r0._region_landed, []

        def recording(link, msg, by_ctl=False):
            seen.append((link, dict(msg)))
            return landed(link, msg, by_ctl)

        r0._region_landed = recording
        L = 30
        src, dst = c.tables(L)
        c.expect("d", dst, L)
        c.sender.send("d", src, 0, 10)  # the first chunk only: the request stays live
        assert wait_for(lambda: bool(seen))
        link, msg = seen[0]
        assert wait_for(lambda: r0.request_stats("d")["unpacks"] >= 1)  # unpacked and counted
        with r0._lock:
            r0._on_message(link, proto.decode(proto.encode("done", msg["rid"], msg["inc"],
                                                           **{k: msg[k] for k in proto.KINDS["done"]})))
        assert r0.wait("d", 5) == S.FAILED
        assert "landed already (a second done)" in r0.failure_reason("d"), r0.failure_reason("d")
    finally:
        c.close()
