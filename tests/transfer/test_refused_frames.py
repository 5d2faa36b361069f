"""A control frame `protocol.decode` refuses (a faulty or hostile peer's) that names a request
of this side: the request fails at once on both sides, the reason naming the frame's kind and
the field (`protocol.refusal`), instead of both sides waiting out ``timeout_s`` for what the
frame was to bring. Garbage, another version, or a frame naming no request: only dropped and
counted. Real engines on the host; the bad frames are the real frames with one field broken."""
import time

import msgpack
import pytest

from conftest import Cluster, TransferStatus, announced, arena_free, region_free, wait_for
from dcp_jax.transfer import protocol as proto

S = TransferStatus


def _frame(kind="region_ask", **over):
    m = msgpack.unpackb(proto.encode(kind, "r1", 3, lo=0, nbytes=8, ctl_done=False, chunk=0, part=0, nparts=1,
                                     start=0, stop=4, nrows=2))
    m.update(over)
    return msgpack.packb(m)


def _refusal(frame):
    try:
        proto.decode(frame)
    except proto.ProtocolError as exc:
        return proto.refusal(frame, exc)
    raise AssertionError("decode took the frame")


def test_refusal_names_the_request_kind_and_field():
    got = _refusal(_frame(ctl_done=1))
    assert got == {"k": "_refused", "rid": "r1", "inc": 3, "what": "region_ask",
                   "reason": "region_ask.ctl_done must be a bool", "window": [0, 0]}
    assert _refusal(_frame(part=-1))["window"] is None  # a window it cannot name
    assert _refusal(_frame(chunk=True))["window"] is None
    assert "nbytes" in _refusal(_frame(nbytes=0))["reason"]  # below the field's bound
    assert "missing fields ['lo']" in _refusal(msgpack.packb({k: v for k, v in msgpack.unpackb(_frame()).items()
                                                             if k != "lo"}))["reason"]


@pytest.mark.parametrize("over", [dict(v=proto.PROTOCOL_VERSION - 1, ctl_done=1), dict(rid="", ctl_done=1),
                                  dict(rid="x" * 257, ctl_done=1), dict(rid=7, ctl_done=1),
                                  dict(inc=-1), dict(inc=True, ctl_done=1), dict(inc=2 ** 63),
                                  dict(k="nonsense"), dict(k=5)])
def test_refusal_is_none_for_a_frame_that_names_no_request_of_this_version(over):
    assert _refusal(_frame(**over)) is None


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01\x02", msgpack.packb("text"), b"\xdf" + b"\xff" * 4])
def test_refusal_is_none_for_garbage(data):
    assert _refusal(data) is None


def test_refusal_is_none_for_kinds_about_no_request():
    m = msgpack.unpackb(proto.encode("bye", "", 0, reason="r", drained=True))
    m["drained"] = 1
    assert _refusal(msgpack.packb(m)) is None


def _sent_and_failed_at_once(c, rid: str, L: int = 16):
    """Expects and sends `rid` (L tokens) over the cluster; the sender must end it FAILED within
    3 s (its ``timeout_s`` is 20 s). Returns the (src, dst) page tables."""
    src, dst = c.tables(L)
    c.expect(rid, dst, L)
    t0 = time.monotonic()
    c.sender.send(rid, src, 0, L)
    assert c.sender.wait(rid, 5) == S.FAILED
    assert time.monotonic() - t0 < 3
    return src, dst


def _corrupt(frame: bytes, kind: str, **over) -> bytes:
    m = msgpack.unpackb(frame)
    if m.get("k") == kind:
        m.update(over)
        return msgpack.packb(m)
    return frame


def test_a_region_ask_the_rank_refuses_fails_the_request_on_both_sides_at_once(engine):
    """The sender's ``region_ask`` carries ``ctl_done=1`` (not a bool): rank 0 refuses it and the
    request FAILS there and at the sender within a second, both reasons naming the frame and the
    field (``timeout_s`` is 20 s). The rank that got good frames ends too (FAILED, or SUCCESS if
    its own window landed first); no range of a receive region stays held."""
    c = Cluster(engine, dcp_size=2, mode="region", receiver_kw=dict(region_bytes=4 << 20))
    try:
        rank0 = c.sender  # the sender's frames to rank 0's connection only
        tell = rank0._tell
        ident0 = None

        def corrupting(ident, frame):
            return tell(ident, _corrupt(frame, "region_ask", ctl_done=1) if ident == ident0 else frame)

        L = 16
        src, dst = c.tables(L)
        c.expect("bad", dst, L)
        assert wait_for(lambda: len(c.sender._conns) == 2)
        ident0 = next(i for i, conn in c.sender._conns.items() if conn.spec.dcp_rank == 0)
        rank0._tell = corrupting
        t0 = time.monotonic()
        c.sender.send("bad", src, 0, L)
        assert c.receivers[0].wait("bad", 5) == S.FAILED
        assert c.sender.wait("bad", 5) == S.FAILED
        assert time.monotonic() - t0 < 3
        for why in (c.receivers[0].failure_reason("bad"), c.sender.failure_reason("bad")):
            assert "region_ask" in why and "ctl_done must be a bool" in why, why
        # Rank 1's own window may have landed before the failure reached it: then it is SUCCESS.
        assert c.receivers[1].wait("bad", 5) in (S.FAILED, S.SUCCESS)
        assert c.receivers[0].stats["rejected_messages"] >= 1  # still dropped and counted
        for r in c.receivers:
            r.release("bad")
        assert all(wait_for(lambda r=r: region_free(r)) for r in c.receivers)
    finally:
        c.close()


def test_a_region_grant_the_sender_refuses_fails_the_request_at_once(engine):
    """Rank 1 answers with a ``region_grant`` whose ``nbytes`` is 0 (below the field's bound):
    the sender refuses it and fails the request at once, naming it; rank 1 hears it too."""
    c = Cluster(engine, dcp_size=2, mode="region", receiver_kw=dict(region_bytes=4 << 20))
    try:
        r1 = c.receivers[1]
        send = r1._send

        def corrupting(link, frame):
            return send(link, _corrupt(frame, "region_grant", nbytes=0))

        r1._send = corrupting
        _sent_and_failed_at_once(c, "g")
        why = c.sender.failure_reason("g")
        assert "decode rank 1" in why and "region_grant" in why and "nbytes" in why, why
        assert r1.wait("g", 5) == S.FAILED
        assert "region_grant" in r1.failure_reason("g"), r1.failure_reason("g")
        assert c.sender.stats["rejected_messages"] >= 1
    finally:
        c.close()


def test_a_refused_frame_for_a_request_that_is_not_live_is_only_counted(engine):
    """A refused frame naming an id nobody knows ends nothing and is counted dropped."""
    c = Cluster(engine, dcp_size=1, mode="packed")
    try:
        recv = c.receivers[0]
        link = next(iter(recv._links))
        before = recv._counts["dropped_messages"]
        with recv._lock:
            recv._on_message(link, _refusal(_frame(ctl_done=1)))
        assert recv._counts["dropped_messages"] == before + 1
        src, dst = c.tables(8)
        c.expect("ok", dst, 8)
        c.sender.send("ok", src, 0, 8)
        assert c.wait("ok") == [S.SUCCESS] * 2, c.reasons("ok")
        assert c.check_bytes(src, dst, 8) == 8
    finally:
        c.close()


def test_a_malformed_frame_naming_a_request_from_a_stranger_is_counted_unanswered(engine):
    """A refused frame from a peer that never handshaked: counted (``rejected_messages``),
    no answer, no request started or ended (as any malformed frame of a stranger)."""
    import zmq

    c = Cluster(engine, dcp_size=1, mode="packed")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(c.sender.address)
        before = c.sender.stats["rejected_messages"]
        sock.send(_frame(ctl_done=1))
        assert wait_for(lambda: c.sender.stats["rejected_messages"] == before + 1)
        assert not sock.poll(500)  # no hello_nack, nothing
        with pytest.raises(KeyError):
            c.sender.poll("r1")
    finally:
        sock.close(0)
        c.close()


def test_a_refused_pull_ready_lets_the_senders_pack_region_go(engine):
    """A pull's ``pull_ready`` with a negative ``src_addr``: the rank refuses it, answers
    ``pull_done(ok=False)`` for its window (no READ starts), and the request fails on every side
    at once; the sender's pack arena is whole again and the request drained."""
    c = Cluster(engine, dcp_size=2, mode="packed", direction="pull")
    try:
        tell = c.sender._tell
        c.sender._tell = lambda ident, frame: tell(ident, _corrupt(frame, "pull_ready", src_addr=-1))
        src, dst = _sent_and_failed_at_once(c, "p")
        assert "malformed pull_ready frame" in c.sender.failure_reason("p"), c.sender.failure_reason("p")
        assert [r.wait("p", 5) for r in c.receivers] == [S.FAILED] * 2
        assert wait_for(lambda: c.sender.is_drained("p"))
        assert wait_for(lambda: arena_free(c.sender)), c.sender.stats["arena"]
        assert c.check_bytes(src, dst, 0) == 0
    finally:
        c.close()


def test_an_expect_the_sender_refuses_is_answered_at_once(engine):
    """Rank 0's announcement carries ``dcp_rank=-1``: the sender refuses it and tells the rank
    at once (failed, naming the field), instead of the rank waiting out ``timeout_s``. Rank 1's
    good announcement of the same id is not touched by it."""
    c = Cluster(engine, dcp_size=2, mode="packed")
    try:
        link = next(iter(c.receivers[0]._links))
        send = link.client.send
        link.client.send = lambda frame: send(_corrupt(frame, "expect", dcp_rank=-1))
        L = 16
        src, dst = c.tables(L)
        t0 = time.monotonic()
        c.expect("x", dst, L)
        assert c.receivers[0].wait("x", 5) == S.FAILED
        assert time.monotonic() - t0 < 3
        why = c.receivers[0].failure_reason("x")
        assert "malformed expect frame" in why and "dcp_rank" in why, why
        assert wait_for(lambda: c.sender.stats["rejected_messages"] >= 1)
        assert c.receivers[1].poll("x") is S.WAITING  # its announcement stands
    finally:
        c.close()


def test_a_malformed_expect_cannot_fail_a_request_of_another_incarnation(engine):
    """A rank that announces request "y" again with a malformed frame of another incarnation
    while "y" is live at the sender: only that announcement is answered (failed); the live
    request goes on and succeeds byte-exact on every rank."""
    from dcp_jax.transfer import protocol as proto

    c = Cluster(engine, dcp_size=2, mode="packed")
    try:
        L = 16
        src, dst = c.tables(L)
        c.expect("y", dst, L)
        assert wait_for(lambda: len(announced(c.sender, "y")) == 2)
        r0 = c.receivers[0]
        link = next(iter(r0._links))
        inc = r0._requests["y"].inc
        bad = msgpack.unpackb(proto.encode("expect", "y", inc + 7, num_tokens=L, prefix_tokens=0,
                                           page_table=proto.pack_i64([0]), dcp_rank=0))
        bad["dcp_rank"] = -1
        before = c.sender.stats["rejected_messages"]
        with r0._lock:  # off the worker thread: queued for it (the socket is the worker's)
            r0._send(link, msgpack.packb(bad))
        assert wait_for(lambda: c.sender.stats["rejected_messages"] == before + 1)
        c.sender.send("y", src, 0, L)
        assert c.wait("y") == [S.SUCCESS] * 3, c.reasons("y")
        assert c.check_bytes(src, dst, L) == L
    finally:
        c.close()


def test_a_refused_pull_done_that_names_its_window_lets_the_region_go(engine):
    """A rank's ``pull_done`` with ``ok=1`` (not a bool): the sender refuses it, but the frame
    names its window and any pull_done says the read is over: the request fails at once and the
    sender's pack region comes back (released, drained)."""
    c = Cluster(engine, dcp_size=2, mode="packed", direction="pull")
    try:
        r0 = c.receivers[0]
        send = r0._send
        r0._send = lambda link, frame: send(link, _corrupt(frame, "pull_done", ok=1))
        L = 16
        src, dst = c.tables(L)
        c.expect("q", dst, L)
        c.sender.send("q", src, 0, L)
        assert c.sender.wait("q", 5) == S.FAILED
        assert "malformed pull_done frame" in c.sender.failure_reason("q"), c.sender.failure_reason("q")
        c.sender.release("q")
        assert wait_for(lambda: arena_free(c.sender)), c.sender.stats["arena"]
    finally:
        c.close()
