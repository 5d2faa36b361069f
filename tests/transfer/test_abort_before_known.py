"""`KVSender.abort` of an id the sender does not know yet (no `send`, the ranks' announcements
still on the way): a fresh-user trial (2026-12-06) saw KeyError or True for the same calls,
depending on whether the announcements had reached the sender's worker. Now the id is recorded
ABORTED at once, whatever the race: ranks announcing it later are told, `send` drops its chunks,
`release` frees the id for its next use. Each on both engines."""
import time

import numpy as np
import pytest

from tests.transfer.conftest import Cluster, TransferStatus, announced, wait_for

S = TransferStatus


def test_an_abort_before_the_announcements_reach_the_sender_aborts_every_rank(engine):
    c = Cluster(engine, dcp_size=3)
    try:
        src, dst = c.tables(24)
        assert c.sender.abort("a1", reason="cancelled by the scheduler") is True  # nothing announced yet
        assert c.sender.poll("a1") is S.ABORTED and c.sender.is_drained("a1")
        assert c.sender.abort("a1") is False  # idempotent
        c.expect("a1", dst, 24)
        assert c.wait("a1", timeout_s=10) == [S.ABORTED] * 4, c.reasons("a1")
        for recv in c.receivers:
            assert "cancelled by the scheduler" in recv.failure_reason("a1")
            wait_for(lambda recv=recv: recv.is_drained("a1"))
        c.sender.send("a1", src, 0, 24)  # dropped: the request was aborted
        assert c.sender.poll("a1") is S.ABORTED
        assert all(c.sentinel_pages(r, []) for r in range(3))  # nothing was written anywhere
        stats = c.sender.stats
        assert stats["aborted"] == 1 and stats["bytes"] == 0
        # Released on both sides, the id's next use is a new request that moves its bytes.
        c.sender.release("a1")
        for recv in c.receivers:
            recv.release("a1")
        c.round_trip("a1", 24)
    finally:
        c.close()


def test_an_abort_right_after_expect_has_one_answer_whichever_side_wins(engine):
    # The trial's race, many times over: each abort returns True and every side ends ABORTED.
    c = Cluster(engine, dcp_size=2)
    try:
        for k in range(20):
            rid = f"race-{k}"
            src, dst = c.tables(8)
            c.expect(rid, dst, 8)
            assert c.sender.abort(rid) is True, (k, announced(c.sender, rid))
            assert c.wait(rid, timeout_s=10) == [S.ABORTED] * 3, c.reasons(rid)
            c.release_ranks(rid)
            c.sender.release(rid)
            c._free_src.extend(src.tolist())
            for r in range(2):
                c._free_dst[r].extend(dst[r].tolist())
        assert c.sender.stats["aborted"] == 20 and c.sender.stats["bytes"] == 0
    finally:
        c.close()


def test_abort_of_an_unknown_id_checks_the_id_and_stays_keyerror_once_closed(engine):
    c = Cluster(engine, dcp_size=1)
    try:
        with pytest.raises(TypeError, match="request_id"):
            c.sender.abort(7)
        with pytest.raises(ValueError, match="request_id"):
            c.sender.abort("")
        with pytest.raises(ValueError, match="request_id"):
            c.sender.abort("x" * 257)
        assert c.sender.stats["requests"] == 0  # nothing recorded for a refused id
    finally:
        c.close()
    with pytest.raises(KeyError, match="not known"):
        c.sender.abort("never-seen")  # a closed sender records nothing


def test_wait_checks_timeout_s_before_the_id(engine):
    # A bad timeout_s is the same ValueError for a known and an unknown id (the trial saw
    # KeyError for an unknown one).
    c = Cluster(engine, dcp_size=1)
    try:
        src, dst = c.tables(4)
        c.expect("w1", dst, 4)
        for side in (c.sender, c.receivers[0]):
            for rid in ("w1", "unknown"):
                with pytest.raises(ValueError, match="timeout_s"):
                    side.wait(rid, -1)
            with pytest.raises(KeyError, match="not known"):
                side.wait("unknown", 0)
    finally:
        c.close()


def test_an_id_aborted_before_it_was_known_is_forgotten_like_any_unsent_request(engine):
    c = Cluster(engine, dcp_size=1, timeout_s=1.0)
    try:
        assert c.sender.abort("f1") is True
        assert c.sender.stats["live_requests"] == 1
        wait_for(lambda: c.sender.stats["live_requests"] == 0, timeout_s=5)  # timeout_s after it ended
        assert c.sender.poll("f1") is S.ABORTED  # the record answers for timeout_s more
        wait_for(lambda: _unknown(c.sender, "f1"), timeout_s=5)
        c.round_trip("f1", 8)  # the id is free: its next use moves its bytes
    finally:
        c.close()


def _unknown(sender, rid):
    try:
        sender.poll(rid)
        return False
    except KeyError:
        return True


def test_a_late_abort_of_a_released_id_leaves_its_next_use_alone(engine):
    # A cancel that arrives after the request ended and was released (or a repeated one) must not
    # record the id ABORTED: the trial's next use of the id ended ABORTED on every side.
    c = Cluster(engine, dcp_size=2)
    try:
        c.round_trip("u1", 16)
        c.sender.release("u1")
        for recv in c.receivers:
            recv.release("u1")
        assert c.sender.abort("u1") is False  # its request ended (SUCCESS) and was released
        c.round_trip("u1", 16)  # the id's next use, byte-exact
        assert c.sender.stats["aborted"] == 0
    finally:
        c.close()


def test_a_chunk_of_the_aborted_use_is_dropped_after_the_ranks_announce_the_next_use(engine):
    # Aborted by the prefill before it knew the id; the ranks, told, release it and announce the
    # id's next use. A chunk the prefill loop still sends for the aborted use is dropped (it was
    # taken as the next use's first: bytes moved, then the retry's send raised and both FAILED).
    c = Cluster(engine, dcp_size=2, timeout_s=5.0)
    try:
        src, dst = c.tables(16)
        assert c.sender.abort("z1") is True
        c.expect("z1", dst, 16)
        assert c.wait("z1", timeout_s=10) == [S.ABORTED] * 3
        c.release_ranks("z1")
        src2, dst2 = c.tables(16)
        c.expect("z1", dst2, 16)  # the next use, parked behind the aborted record
        time.sleep(0.3)  # its announcements reach the sender
        c.sender.send("z1", src, 4, 8)  # a late chunk of the aborted use: dropped
        time.sleep(0.3)
        assert c.sender.poll("z1") is S.ABORTED and c.sender.stats["bytes"] == 0
        assert all(c.sentinel_pages(r, []) for r in range(2))
        c.sender.release("z1")  # now the parked next use starts; its own send moves its bytes
        c.sender.send("z1", src2, 0, 16)
        assert c.wait("z1") == [S.SUCCESS] * 3, c.reasons("z1")
        assert c.check_bytes(src2, dst2, 16) == 16
    finally:
        c.close()


def test_a_rank_announcing_after_the_unsent_record_is_dropped_is_told_how_it_ended(engine):
    # timeout_s after an unsent request ended it is dropped by itself (`_forget_unsent`); a rank
    # announcing it only then was started a new request that FAILED ("never announced") and
    # flipped the sender's poll to FAILED. As after `release`, it is told how it ended.
    c = Cluster(engine, dcp_size=2, timeout_s=1.0)
    try:
        src, dst = c.tables(8)
        assert c.sender.abort("late", reason="cancelled early") is True
        c.receivers[0].expect("late", dst[0], 8)
        assert c.wait("late", timeout_s=5, sides=[c.receivers[0]]) == [S.ABORTED]
        wait_for(lambda: c.sender.stats["live_requests"] == 0, timeout_s=5)  # dropped by itself
        c.receivers[1].expect("late", dst[1], 8)
        assert c.wait("late", timeout_s=5, sides=[c.receivers[1]]) == [S.ABORTED]
        assert "cancelled early" in c.receivers[1].failure_reason("late")
        assert c.sender.poll("late") is S.ABORTED and c.sender.stats["live_requests"] == 0
    finally:
        c.close()


def test_an_abort_after_releasing_a_dropped_record_is_a_late_cancel(engine):
    # abort -> dropped by itself (never sent) -> release -> abort again: the second abort is a
    # late cancel of a released id (False), not a new ABORTED record poisoning the next use.
    c = Cluster(engine, dcp_size=2, timeout_s=1.0)
    try:
        src, dst = c.tables(8)
        assert c.sender.abort("d1") is True
        c.expect("d1", dst, 8)
        assert c.wait("d1", timeout_s=5) == [S.ABORTED] * 3
        c.release_ranks("d1")
        wait_for(lambda: c.sender.stats["live_requests"] == 0, timeout_s=5)  # dropped by itself
        c.sender.release("d1")  # its record
        assert c.sender.abort("d1") is False
        c.round_trip("d1", 8)
    finally:
        c.close()
