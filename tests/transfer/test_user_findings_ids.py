"""Request ids reused, found by a fresh-user trial (2026-12-04), each on both engines:

- a decode rank cancels its announcement of an id's next use while the prefill still holds the
  old request: the parked announcement was replayed at the prefill's release, and the id's next
  use then wrote into pages the rank had given to another request (which was SUCCESS);
- a rank that announced an aborted request late (and was told how it ended) had its next use of
  the id answered with the old ending;
- a `send` of a chunk its ranks already hold (inside their prefix) raised after the request
  went SUCCESS;
- ids that cannot go into a notification (over 256 UTF-8 bytes) or onto the wire (a lone
  surrogate) were accepted and then failed late, one of them leaving a receiver that could not close;
- `KVSender(pack_bytes=np.int64(...))` was refused while other sizes take numpy ints.
"""
import time

import numpy as np
import pytest

import bridge
from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender, TransferStatus

S = TransferStatus
P, W = 4, 64  # tokens per page, bytes per row


def _page_bytes(pages):
    """A prefill cache whose page p holds the byte 10 + p everywhere (which page landed shows)."""
    return [np.stack([np.full((P, W), 10 + p, np.uint8) for p in range(pages)])]


def _wait_drained(side, rid, limit=20.0):
    deadline = time.monotonic() + limit
    while not side.is_drained(rid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert side.is_drained(rid)


def _until(pred, limit=5.0):
    deadline = time.monotonic() + limit
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.01)
    return pred()


@pytest.mark.parametrize("cancel", ["abort", "timeout"])
def test_a_cancelled_announcement_of_an_ids_next_use_is_not_replayed(engine, cancel):
    dst = [np.zeros((8, P, W), np.uint8)]
    rs = dict(timeout_s=1.0) if cancel == "timeout" else {}
    with KVSender(KVCacheSpec(1, [W], P), _page_bytes(8), engine=engine, timeout_s=30) as s, \
            KVReceiver(KVCacheSpec(1, [W], P), dst, engine=engine, **rs) as r:
        r.connect(s.address)
        r.expect("X", [0], 4)
        s.send("X", [0], 0, 4)
        assert (s.wait("X", 5), r.wait("X", 5)) == (S.SUCCESS, S.SUCCESS)
        r.release("X")
        r.expect("X", [1], 4)  # the id's next use, parked on the sender: the prefill holds X
        time.sleep(0.2)  # (it reaches the sender before the cancel either way: one ordered socket)
        if cancel == "abort":
            r.abort("X", "client went away")
        else:
            assert r.wait("X", 10) is S.FAILED  # the rank's own timeout_s
        _wait_drained(r, "X")
        r.release("X")
        r.expect("Y", [1], 4)  # page 1 now serves Y
        s.send("Y", [5], 0, 4)
        assert (s.wait("Y", 5), r.wait("Y", 5)) == (S.SUCCESS, S.SUCCESS)
        s.release("X")  # the prefill is done with the first X: before, the cancelled one came back
        r.expect("X", [2], 4)
        s.send("X", [7], 0, 4)
        assert (s.wait("X", 5), r.wait("X", 5)) == (S.SUCCESS, S.SUCCESS), r.failure_reason("X")
        assert (dst[0][1] == 15).all(), "Y's page was overwritten"
        assert (dst[0][2] == 17).all() and (dst[0][3:] == 0).all() and (dst[0][0] == 10).all()


@pytest.mark.parametrize("announce_first", [False, True])
def test_a_rank_told_of_an_aborted_request_gets_the_ids_next_use(engine, announce_first):
    n = 2
    src = [np.random.default_rng().integers(0, 256, (16, P, W), dtype=np.uint8)]
    dst = [[np.zeros((16, P, W), np.uint8)] for _ in range(n)]
    with KVSender(KVCacheSpec(1, [W], P), src, engine=engine, timeout_s=5) as s:
        rs = [KVReceiver(KVCacheSpec(1, [W], P, n, k), dst[k], engine=engine, timeout_s=5) for k in range(n)]
        try:
            for r in rs:
                r.connect(s.address)
            s.send("req", [0, 1, 2, 3], 0, 8)
            s.abort("req", "client disconnected")
            for r in rs:  # announced after the prefill's abort: told how it ended
                r.expect("req", [0, 1], 16)
            for r in rs:
                assert r.wait("req", 5) is S.ABORTED and "client disconnected" in r.failure_reason("req")
                _wait_drained(r, "req")
                r.release("req")
            if not announce_first:
                s.release("req")
            for r in rs:  # the id's next use, on other pages
                r.expect("req", [2, 3], 16)
            if announce_first:
                time.sleep(0.2)  # parked until the prefill releases the old one
                s.release("req")
            s.send("req", [4, 5, 6, 7], 0, 16)
            assert s.wait("req", 8) is S.SUCCESS, s.failure_reason("req")
            rows = src[0][4:8].reshape(-1, W)  # tokens 0..15
            for k, r in enumerate(rs):
                assert r.wait("req", 5) is S.SUCCESS, r.failure_reason("req")
                assert np.array_equal(dst[k][0][2:4].reshape(-1, W), rows[k::n])
                assert (dst[k][0][[0, 1]] == 0).all() and (dst[k][0][4:] == 0).all()
        finally:
            for r in rs:
                r.close()


def test_send_of_a_chunk_the_ranks_hold_after_success_does_nothing(engine):
    n = 2
    src = [np.random.default_rng().integers(0, 256, (8, P, W), dtype=np.uint8)]
    dst = [[np.zeros((8, P, W), np.uint8)] for _ in range(n)]
    with KVSender(KVCacheSpec(1, [W], P), src, engine=engine) as s:
        rs = [KVReceiver(KVCacheSpec(1, [W], P, n, k), dst[k], engine=engine) for k in range(n)]
        try:
            for r in rs:
                r.connect(s.address)
            s.send("req", [0, 1, 2], 0, 4)  # the first chunk, before the ranks announced
            for r in rs:  # every rank holds all 10 tokens: a full prefix hit
                r.expect("req", [0, 1], 10, prefix_tokens=10)
            assert s.wait("req", 5) is S.SUCCESS
            assert s.send("req", [0, 1, 2], 4, 10) is None  # the next chunk: nothing to do
            with pytest.raises(ValueError, match="is SUCCESS; release"):  # a range sent before
                s.send("req", [0, 1, 2], 0, 4)
            with pytest.raises(ValueError, match="is SUCCESS; release"):  # past the ranks' tokens
                s.send("req", [0, 1, 2], 10, 12)
            assert all(r.wait("req", 5) is S.SUCCESS for r in rs)
            assert all((d[0] == 0).all() for d in dst)  # nothing was written
        finally:
            for r in rs:
                r.close()


def test_ids_that_cannot_travel_are_refused_naming_the_argument(engine):
    with KVSender(KVCacheSpec(1, [W], P), _page_bytes(4), engine=engine) as s, \
            KVReceiver(KVCacheSpec(1, [W], P), [np.zeros((4, P, W), np.uint8)], engine=engine) as r:
        r.connect(s.address)
        longest = "\N{GRINNING FACE}" * 64  # 256 bytes in UTF-8: the limit
        for bad, match in (("\N{GRINNING FACE}" * 65, "at most 256 bytes in UTF-8, got 260"),
                           ("req-\udc80", "not valid UTF-8"), ("", "1..256"), ("a" * 257, "1..256")):
            for call in (lambda: r.expect(bad, [0], 4), lambda: s.send(bad, [0], 0, 4)):
                with pytest.raises(ValueError, match=f"request_id.*{match}|{match}.*request_id|request_id must"):
                    call()
        assert r.stats["live_requests"] == 0 and s.stats["live_requests"] == 0
        r.expect(longest, [1], 4)
        s.send(longest, [2], 0, 4)
        assert (s.wait(longest, 5), r.wait(longest, 5)) == (S.SUCCESS, S.SUCCESS)  # its done fits
        # A reason text with a lone surrogate travels escaped; the abort is not lost to it.
        r.expect("s", [3], 4)
        assert _until(lambda: s.stats["requests"] == 2)  # the sender heard of it
        assert r.abort("s", "bad \udc80 reason") is True
        assert s.wait("s", 5) is S.ABORTED and "bad \\udc80 reason" in s.failure_reason("s")
    with pytest.raises(ValueError, match="group"):
        KVReceiver(KVCacheSpec(1, [W], P), [np.zeros((4, P, W), np.uint8)], engine=engine, group="g-\udc80")
    assert bridge.registered_bytes() == 0


def test_sender_sizes_take_numpy_ints(engine):
    spec = KVCacheSpec(1, [W], P)
    with KVSender(spec, _page_bytes(4), engine=engine, pack_bytes=np.int64(4096),
                  max_batch_indices=np.int32(8)) as s:
        assert s.max_batch_indices == 8 and type(s.max_batch_indices) is int
    with pytest.raises(ValueError, match="pack_bytes"):
        KVSender(spec, _page_bytes(4), engine=engine, pack_bytes=np.int64(W - 1))
    for bad in (1.5e6, 4096.0, True):  # a float or a bool is the wrong type, whatever its value
        with pytest.raises(TypeError, match="pack_bytes"):
            KVSender(spec, _page_bytes(4), engine=engine, pack_bytes=bad)
    for bad in (8.0, True):
        with pytest.raises(TypeError, match="max_batch_indices"):
            KVSender(spec, _page_bytes(4), engine=engine, max_batch_indices=bad)


def _group(engine, m, n, src, dst, timeout_s=4):
    """``m`` senders (prefill DCP ranks) and ``n`` receivers, every receiver connected to all."""
    ss = [KVSender(KVCacheSpec(1, [W], P, m, k), src[k], engine=engine, timeout_s=timeout_s) for k in range(m)]
    rs = [KVReceiver(KVCacheSpec(1, [W], P, n, k), dst[k], engine=engine, timeout_s=timeout_s) for k in range(n)]
    for r in rs:
        for s in ss:
            r.connect(s.address)
    return ss, rs


def test_one_prefill_ranks_abort_reaches_the_others_and_frees_the_pages(engine):
    """Second trial (2026-12-04): prefill DCP 2; rank 0 aborts, rank 1 finishes its part. Before:
    the decode ranks did not tell prefill rank 1, which never said drained: the released pages
    stayed held (30 s and more); the id's next use, announced while rank 1 still held the old
    one live, was dropped as a duplicate and failed."""
    src = [[np.full((8, P, W), 10 + m, np.uint8)] for m in range(2)]
    dst = [[np.zeros((8, P, W), np.uint8)] for _ in range(2)]
    ss, rs = _group(engine, 2, 2, src, dst)
    try:
        for r in rs:
            r.expect("X", [0, 1], 16)
        time.sleep(0.2)
        ss[1].send("X", [2], 0, 8)  # prefill rank 1: its first chunk only
        ss[0].abort("X", "prefill rank 0 cancelled")
        assert all(r.wait("X", 5) is S.ABORTED for r in rs)
        assert ss[1].wait("X", 5) is S.ABORTED and "prefill rank 0 cancelled" in ss[1].failure_reason("X")
        for r in rs:
            _wait_drained(r, "X", 5.0)  # (before: after timeout_s, and never once released)
            r.release("X")
            r.expect("X", [2, 3], 16)  # the id's next use
        time.sleep(0.2)
        for s in ss:
            s.release("X")
        kv = [np.random.default_rng().integers(0, 256, (8, P, W), dtype=np.uint8) for _ in range(2)]
        for m, s in enumerate(ss):
            src[m][0][4:6] = kv[m][4:6]
            s.send("X", [4, 5], 0, 16)
        assert [s.wait("X", 8) for s in ss] == [S.SUCCESS] * 2, [s.failure_reason("X") for s in ss]
        assert [r.wait("X", 8) for r in rs] == [S.SUCCESS] * 2
        for k in range(2):  # token t: prefill rank t % 2 (its local row t // 2); decode rank t % 2
            want = np.stack([kv[t % 2][4:6].reshape(-1, W)[t // 2] for t in range(k, 16, 2)])
            assert np.array_equal(dst[k][0][2:4].reshape(-1, W), want)
            assert (dst[k][0][4:] == 0).all()  # (pages 0, 1 were the first use's: its chunk may have landed)
    finally:
        for x in rs + ss:
            x.close()


def test_an_older_uses_ending_is_not_answered_after_a_later_use(engine):
    """Second trial: use 1 ended ABORTED, use 2 SUCCESS (started by announcements), both
    released; use 3's first announcement came from a rank use 1's record did not list. Before:
    that rank was told use 1's ending, and the sender's use 3 FAILED."""
    dst = [[np.zeros((8, P, W), np.uint8)] for _ in range(2)]
    ss, (r0, r1) = _group(engine, 1, 2, [_page_bytes(8)], dst, timeout_s=10)
    s = ss[0]
    try:
        r0.expect("X", [0], 8)
        time.sleep(0.1)
        r0.abort("X", "use 1")
        s.send("X", [0, 1], 0, 8)
        assert s.wait("X", 5) is S.ABORTED
        _wait_drained(r0, "X")
        r0.release("X"), s.release("X")
        # Use 2: rank 0 first. (Rank 1 never announced use 1: were its announcement to reach the
        # sender first, it would be told use 1's ending, as documented for timeout_s after the release.)
        r0.expect("X", [1], 8)
        time.sleep(0.2)
        r1.expect("X", [1], 8)
        time.sleep(0.2)
        s.send("X", [2, 3], 0, 8)
        assert [x.wait("X", 5) for x in (s, r0, r1)] == [S.SUCCESS] * 3
        for x in (s, r0, r1):
            x.release("X")
        r1.expect("X", [2], 8)  # use 3: rank 1 first
        time.sleep(0.2)
        r0.expect("X", [2], 8)
        s.send("X", [4, 5], 0, 8)
        assert [x.wait("X", 8) for x in (s, r0, r1)] == [S.SUCCESS] * 3, r1.failure_reason("X")
        for k in range(2):  # rank k: tokens k, k+2, k+4, k+6 (prefill pages 4, 5: bytes 14, 15) in page 2
            assert np.array_equal(dst[k][0][2], np.repeat(np.array([14, 14, 15, 15], np.uint8), W).reshape(P, W))
    finally:
        for x in (r0, r1, s):
            x.close()


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_cancel_that_crosses_a_release_does_not_take_the_ids_next_use(engine, direction):
    """Second trial: use A of X done; prefill rank 0 keeps it while the ranks announce use B
    (parked there); prefill rank 1 aborts B; prefill rank 0 releases A while the ranks' word of
    B's end may still be on the way. Before: B came back at prefill rank 0 from its parked
    announcements, and use C's announcements were taken for late ones of B (told its ending)
    or dropped: C failed (7 of 24 runs), or its rows went to B's page (push, before the forwarding)."""
    src = [[np.stack([np.full((P, W), 16 * m + p, np.uint8) for p in range(8)])] for m in range(2)]
    dst = [[np.zeros((8, P, W), np.uint8)] for _ in range(2)]
    ss = [KVSender(KVCacheSpec(1, [W], P, 2, m), src[m], engine=engine, timeout_s=3) for m in range(2)]
    rs = [KVReceiver(KVCacheSpec(1, [W], P, 2, k), dst[k], engine=engine, timeout_s=3, direction=direction)
          for k in range(2)]
    try:
        for r in rs:
            for s in ss:
                r.connect(s.address)
        for page in (0,):  # use A
            for r in rs:
                r.expect("X", [page], 8)
        for s in ss:
            s.send("X", [1], 0, 8)
        assert [x.wait("X", 5) for x in ss + rs] == [S.SUCCESS] * 4
        for r in rs:
            r.release("X")
        ss[1].release("X")  # prefill rank 0 keeps use A a while
        for r in rs:  # use B
            r.expect("X", [2], 8)
        time.sleep(0.3)
        ss[1].abort("X", "client went away")
        assert [r.wait("X", 5) for r in rs] == [S.ABORTED] * 2
        for r in rs:
            r.release("X")
        ss[1].release("X")
        ss[0].release("X")
        time.sleep(0.2)
        for r in rs:  # use C
            r.expect("X", [4], 8)
        time.sleep(0.2)
        for s in ss:
            s.send("X", [4], 0, 8)
        assert [s.wait("X", 6) for s in ss] == [S.SUCCESS] * 2, [s.failure_reason("X") for s in ss]
        assert [r.wait("X", 6) for r in rs] == [S.SUCCESS] * 2, [r.failure_reason("X") for r in rs]
        for k in range(2):  # decode rank k's tokens are prefill rank k's (t % 2): page 4 holds 16k + 4
            assert (dst[k][0][4] == 16 * k + 4).all() and (dst[k][0][[3, 5, 6, 7]] == 0).all()
    finally:
        for x in rs + ss:
            x.close()
