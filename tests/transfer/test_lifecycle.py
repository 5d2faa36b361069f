"""Aborts, stale messages, quarantined regions, timeouts and malformed control messages."""
import time

import msgpack
import numpy as np
import pytest
import zmq

from conftest import Cluster, TransferStatus
from dcp_jax.transfer import protocol as proto

S = TransferStatus


def test_abort_from_either_side_sticks_on_both(engine):
    c = Cluster(engine, dcp_size=2)
    try:
        src, dst = c.tables(12)
        c.expect("a", dst, 12)
        c.sender.send("a", src, 0, 4)  # first chunk only; the rest never comes
        time.sleep(0.1)
        assert c.receivers[1].abort("a", "client went away") is True
        assert c.receivers[1].abort("a") is False  # idempotent
        assert c.wait("a") == [S.ABORTED] * 3
        assert "client went away" in c.sender.failure_reason("a")
        assert c.sender.send("a", src, 4, 12) is None  # an aborted request's later chunk: dropped, no raise
        assert c.sender.poll("a") is S.ABORTED
        src2, dst2 = c.tables(6)
        c.expect("b", dst2, 6)
        c.sender.send("b", src2, 0, 2)
        assert c.sender.abort("b") is True  # ranks whose announcement comes later are told too
        assert c.wait("b") == [S.ABORTED] * 3
    finally:
        c.close()


def test_stale_notification_of_aborted_request_is_not_credited(engine):
    # Request "s" is aborted on the decode side after its first chunk left the prefill side; its
    # id is reused at once. The late "done" of the old incarnation must be dropped and counted,
    # and the new request must only finish when its own bytes landed.
    c = Cluster(engine, dcp_size=1, mode="packed")
    try:
        recv = c.receivers[0]
        src, dst = c.tables(16)
        recv.expect("s", dst[0], 16)
        old_inc = recv._requests["s"].inc
        recv.abort("s")
        recv.release("s")
        src2, dst2 = c.tables(16)
        recv.expect("s", dst2[0], 16)
        # A forged late completion of the old incarnation, through the engine's own channel.
        stale = proto.encode("done", "s", old_inc, chunk=0, part=0, nparts=1, start=0, stop=16, nrows=16)
        h = c.sender.engine.transfer_batch(c.sender._conns[next(iter(c.sender._conns))].peer,
                                           np.zeros((0, 3), np.int64), notif=stale)
        c.sender.engine.wait(h)
        deadline = time.monotonic() + 5
        while recv.stats["dropped_messages"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert recv.stats["dropped_messages"] >= 1
        assert recv.poll("s") is S.WAITING  # not credited to the new incarnation
        while c.sender.stats["aborted"] == 0 and time.monotonic() < deadline + 5:
            time.sleep(0.01)  # the sender saw the old incarnation's abort
        c.sender.release("s")  # the new incarnation's announcement waited for this
        c.sender.send("s", src2, 0, 16)
        assert c.wait("s", sides=[recv]) == [S.SUCCESS]
        c.check_bytes(src2, [dst2[0]], 16)
    finally:
        c.close()


def test_abort_while_the_engine_reads_keeps_the_region_quarantined(engine):
    # A large window in flight when the request is aborted: its pack region must not be handed
    # out again until the engine reported the batch finished.
    c = Cluster(engine, dcp_size=1, item_lens=(4096,) * 8, page_size=16, pages=600, mode="packed",
                pack_bytes=16 * 512 * 4096 * 8)
    try:
        src, dst = c.tables(16 * 512)
        c.expect("big", dst, 16 * 512)
        c.sender.send("big", src, 0, 16 * 512)
        deadline = time.monotonic() + 10
        while c.sender.poll("big") is S.WAITING and time.monotonic() < deadline:
            time.sleep(0.0005)
        c.sender.abort("big")
        arena = c.sender.stats["arena"]
        seen_quarantine = arena["quarantined_bytes"] > 0
        deadline = time.monotonic() + 20
        while c.sender.stats["arena"]["quarantined_bytes"] and time.monotonic() < deadline:
            assert c.sender.stats["arena"]["in_use_bytes"] == 0  # nothing new sits on it
            time.sleep(0.005)
        assert c.sender.stats["arena"]["quarantined_bytes"] == 0
        assert c.sender.stats["arena"]["free_bytes"] == c.sender.stats["arena"]["capacity"]
        assert c.wait("big")[0] is S.ABORTED
        # Either the abort caught the batch in flight (quarantined, then released on the
        # engine's word) or the batch had already finished; both leave the arena whole.
        assert seen_quarantine or c.sender.stats["bytes"] > 0
    finally:
        c.close()


def test_no_progress_fails_both_sides_within_timeout(engine):
    c = Cluster(engine, dcp_size=1, timeout_s=1.0)
    try:
        src, dst = c.tables(8)
        t0 = time.monotonic()
        c.expect("slow", dst, 8)
        c.sender.send("slow", src, 0, 4)  # the second half never comes
        st = c.wait("slow", timeout_s=5)
        assert st == [S.FAILED, S.FAILED]
        assert time.monotonic() - t0 < 1.0 + 1.5
        # Whichever side's clock runs out first, the reason names the tokens still missing: the
        # sender's own ("send() has not given tokens [4, 8)"), or the rank's, passed on to it.
        reason = c.sender.failure_reason("slow")
        assert "no progress" in reason and "tokens [4, 8)" in reason, reason
        assert "no progress" in c.receivers[0].failure_reason("slow")
    finally:
        c.close()


def test_a_sender_that_times_out_names_the_tokens_send_never_gave(engine):
    c = Cluster(engine, dcp_size=1, timeout_s=10.0)
    try:
        c.sender.timeout_s = 1.0  # the sender times out first, on its own clock
        src, dst = c.tables(16)
        c.expect("gap", dst, 16)
        c.sender.send("gap", src, 0, 4)
        c.sender.send("gap", src, 8, 16)  # [4, 8) is never sent
        assert c.wait("gap", timeout_s=5, sides=[c.sender]) == [S.FAILED]
        assert c.sender.failure_reason("gap") == (
            "no progress for 1 s; send() has not given tokens [4, 8) of the 16 the ranks expect")
    finally:
        c.close()


def test_a_rank_that_times_out_names_the_tokens_that_never_landed(engine):
    c = Cluster(engine, dcp_size=1, timeout_s=10.0)
    try:
        c.receivers[0].timeout_s = 1.0  # the rank times out first, on its own clock
        src, dst = c.tables(16)
        c.expect("gap", dst, 16)
        c.sender.send("gap", src, 0, 4)
        c.sender.send("gap", src, 8, 16)  # [4, 8) is never sent
        assert c.wait("gap", timeout_s=5, sides=c.receivers) == [S.FAILED]
        assert c.receivers[0].failure_reason("gap") == (
            "no progress for 1 s; tokens [4, 8) have not landed (a chunk never sent, or still moving)")
        c.sender.abort("gap")
    finally:
        c.close()


def test_a_gap_between_chunks_is_named_by_the_rank():
    from dcp_jax.transfer.requests import Coverage

    cov = Coverage()
    for a, b in [(0, 16), (32, 40), (40, 48)]:
        cov.add(a, b)
    assert cov.gaps(0, 64) == [(16, 32), (48, 64)] and cov.gaps(0, 16) == [] and cov.gaps(8, 36) == [(16, 32)]
    assert Coverage().gaps(3, 5) == [(3, 5)]


def _raw_dealer(address):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


def test_malformed_and_oversized_control_messages_are_rejected_and_counted(engine):
    c = Cluster(engine, dcp_size=1)
    try:
        raw = _raw_dealer(c.sender.address)
        bad = [b"\x00garbage", msgpack.packb({"v": 1, "k": "expect", "rid": "x"}),
               msgpack.packb({"v": 1, "k": "nonsense", "rid": "", "inc": 0}),
               msgpack.packb([1, 2, 3]), b"\x81" * 10, b"x" * (proto.MAX_CONTROL_BYTES + 1)]
        for frame in bad:
            raw.send(frame)
        deadline = time.monotonic() + 5
        while c.sender.stats["rejected_messages"] < len(bad) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.sender.stats["rejected_messages"] == len(bad)
        # A well-formed expect from a peer that never shook hands: dropped, counted.
        raw.send(proto.encode("expect", "intruder", 1, num_tokens=4, prefix_tokens=0,
                              page_table=proto.pack_i64([0]), dcp_rank=0))
        time.sleep(0.2)
        assert c.sender.stats["dropped_messages"] >= 1
        raw.close(0)
        src, dst = c.tables(10)  # the real connection survived all of it
        c.expect("ok", dst, 10)
        c.sender.send("ok", src, 0, 10)
        assert c.wait("ok") == [S.SUCCESS, S.SUCCESS]
        c.check_bytes(src, dst, 10)
    finally:
        c.close()


def test_protocol_refuses_bad_messages():
    good = proto.encode("done", "r", 3, chunk=0, part=0, nparts=2, start=0, stop=8, nrows=4)
    assert proto.decode(good)["nrows"] == 4
    with pytest.raises(proto.ProtocolError, match="part"):
        proto.encode("done", "r", 3, chunk=0, part=2, nparts=2, start=0, stop=8, nrows=4)
    with pytest.raises(proto.ProtocolError, match="stop"):
        proto.encode("done", "r", 3, chunk=0, part=0, nparts=1, start=9, stop=8, nrows=4)
    with pytest.raises(proto.ProtocolError, match="nrows"):
        proto.decode(msgpack.packb({**proto.decode(good), "nrows": -1}))
    with pytest.raises(proto.ProtocolError, match="version"):
        proto.decode(msgpack.packb({**proto.decode(good), "v": proto.PROTOCOL_VERSION + 1}))
    with pytest.raises(proto.ProtocolError, match="unexpected"):
        proto.decode(msgpack.packb({**proto.decode(good), "extra": 1}))
    with pytest.raises(proto.ProtocolError, match="exceeds"):
        proto.decode(good, max_bytes=10)
    with pytest.raises(proto.ProtocolError, match="rid"):
        proto.encode("abort", "x" * 300, 1, reason="")
    with pytest.raises(proto.ProtocolError, match="negative"):
        proto.unpack_i64(proto.pack_i64([1, -2]), "page_table")


def test_is_drained_after_abort_on_both_sides(engine):
    # After an abort, pages may be reused only once nothing can still write into them.
    c = Cluster(engine, dcp_size=2, mode="packed")
    try:
        src, dst = c.tables(40)
        c.expect("d", dst, 40)
        c.sender.send("d", src, 0, 8)
        c.receivers[0].abort("d")
        deadline = time.monotonic() + 10
        sides = [c.sender] + c.receivers
        while not all(s.is_drained("d") for s in sides) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert all(s.is_drained("d") for s in sides)
        assert [s.poll("d") for s in sides] == [S.ABORTED] * 3
        assert c.sender.request_stats("d")["inflight"] == 0
        src2, dst2 = c.tables(4)
        c.expect("live", dst2, 4)
        assert not c.receivers[0].is_drained("live")  # a live request is never drained
    finally:
        c.close()


def test_rank_that_failed_after_the_sender_succeeded_is_told_drained(engine):
    # The soak's lost request: a decode rank's timeout fired (its "done" was still queued, or was
    # lost with a broken connection) after the sender had finished. Its pages stay held until the
    # sender says "drained"; a sender that ended in SUCCESS must still answer, and answer again.
    c = Cluster(engine, dcp_size=1, mode="packed")
    try:
        recv = c.receivers[0]
        src, dst = c.tables(12)
        recv.expect("late", dst[0], 12)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the announcement reached the sender
            try:
                if c.sender.request_stats("late")["ranks"]:
                    break
            except KeyError:
                pass
            time.sleep(0.005)
        with recv._lock:  # the rank's worker is held: the sender's "done" waits unread
            c.sender.send("late", src, 0, 12)
            while c.sender.poll("late") is not S.SUCCESS and time.monotonic() < deadline:
                time.sleep(0.005)
            assert c.sender.poll("late") is S.SUCCESS
            req = recv._requests["late"]
            recv._end(req, S.FAILED, "no progress (the rank's own timeout)", "failed")
        deadline = time.monotonic() + 10
        while not recv.is_drained("late") and time.monotonic() < deadline:
            time.sleep(0.005)
        assert recv.poll("late") is S.FAILED and recv.is_drained("late")
        # A lost answer is asked for again: forget it, age the request past timeout_s.
        req.drained.clear()
        req.state.last_progress -= 2 * recv.timeout_s
        deadline = time.monotonic() + 10
        while not recv.is_drained("late") and time.monotonic() < deadline:
            time.sleep(0.005)
        assert recv.is_drained("late")
    finally:
        c.close()
