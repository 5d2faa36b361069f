"""Defects a first-time user found (2026-12-02), each checked on real engines: a decode rank
connected to part of the prefill group, an empty prefix chunk pulled after the request ended,
pages of a released request written late, two receiver layers on one buffer, two senders of one
prefill position, a pull's sender timeline without its posts and completions, integers beyond
int64 refused without naming the argument."""
import contextlib
import time

import numpy as np
import pytest

from conftest import SENTINEL, Cluster, TransferStatus
from dcp_jax.transfer import HandshakeError, KVCacheSpec, KVReceiver, KVSender
from dcp_jax.transfer.memory import CacheLayers

ITEMS = (48, 16)


@contextlib.contextmanager
def cluster(engine, **kw):
    c = Cluster(engine, **kw)
    try:
        yield c
    finally:
        c.close()


def test_expect_refuses_a_rank_not_connected_to_the_whole_prefill_group():
    # Two prefill DCP ranks; the decode rank connected to rank 0 only. Before: SUCCESS with
    # every token of prefill rank 1 left as sentinel bytes.
    src = [np.zeros((16, 4, il), np.uint8) for il in ITEMS]
    dst = [np.full((16, 4, il), SENTINEL, np.uint8) for il in ITEMS]
    with KVSender(KVCacheSpec(2, ITEMS, 4, 2, 0), src, engine="nixl") as s0, \
            KVSender(KVCacheSpec(2, ITEMS, 4, 2, 1), [a.copy() for a in src], engine="nixl") as s1, \
            KVReceiver(KVCacheSpec(2, ITEMS, 4), dst, engine="nixl") as r:
        r.connect(s0.address)
        with pytest.raises(RuntimeError,
                           match=r"dcp_rank\(s\) \[0\] of a prefill DCP group of 2: dcp_rank\(s\) \[1\] not connected"):
            r.expect("q", np.arange(4), 16)
        r.connect(s1.address)
        r.expect("q", np.arange(4), 16)  # the whole group: accepted


def test_an_empty_prefix_chunk_pulled_after_success_leaves_the_request_successful(engine):
    # Pull, prefix 16 tokens: the chunk [0, 16) holds no row to move. Sent after the other chunk,
    # its pull_ready often reached ranks that had already completed and got ok=False, failing
    # the sender's request (1-3 times in 20 before the fix): 12 requests, each must succeed.
    with cluster(engine, direction="pull", page_size=4, pages=256, seed=3) as c:
        n, prefix = 48, 16
        for i in range(12):
            rid = f"q{i}"
            src, dst = c.tables(n)
            c.expect(rid, dst, n, prefix_tokens=prefix)
            c.sender.send(rid, src, prefix, n)
            try:
                c.sender.send(rid, src, 0, prefix)  # the empty prefix chunk, last
            except ValueError as exc:  # the sender already completed: nothing was owed (documented)
                assert "is SUCCESS" in str(exc)
            assert c.wait(rid) == [TransferStatus.SUCCESS] * 3, c.reasons(rid)


def test_released_pages_stay_held_until_the_sender_drained(engine):
    with cluster(engine, page_size=4, seed=5) as c:
        src, dst = c.tables(32)
        c.expect("big", dst, 32)
        r0 = c.receivers[0]
        # The sender's worker handles messages under its lock: holding it keeps the sender from
        # answering the abort with "drained" before the second expect (under CI load it did).
        with c.sender._lock:
            r0.release("big")  # live: aborted; the sender has not said "drained" yet
            with pytest.raises(ValueError, match=r"page \d+ belongs to request big \(released, not drained yet\): "
                                                 r"a sender's write may still land there") as exc:
                r0.expect("new", dst[0], 32)
            assert "release that one first" not in str(exc.value)  # it is released already
        deadline = time.monotonic() + 10
        while True:  # the sender learns of the abort and answers "drained": the pages are free
            try:
                r0.expect("new", dst[0], 32)
                break
            except ValueError:
                assert time.monotonic() < deadline, "released pages never freed"
                time.sleep(0.01)


def test_two_receiver_layers_on_one_buffer_are_refused():
    a = np.zeros((4, 4, 16), np.uint8)
    spec = KVCacheSpec(2, (16, 16), 4)
    with pytest.raises(ValueError, match=r"kv_layers\[0\] and kv_layers\[1\] start 0 B apart, less than a page"):
        CacheLayers(spec, [a, a], writable=True)
    CacheLayers(spec, [a, a])  # a sender only reads: aliasing is harmless there
    # Views less than a page apart (a fresh user's [big[0:n], big[64:64+n]]): before, accepted and
    # one layer silently overwritten by the other on a SUCCESS.
    big = np.zeros(4 * 64 + 16 * 4 * 4, np.uint8)
    views = [big[:256].reshape(4, 4, 16), big[16:272].reshape(4, 4, 16)]
    with pytest.raises(ValueError, match=r"start 16 B apart, less than a page \(64 B\)"):
        CacheLayers(spec, views, writable=True)
    # Overlapping views with pages of different sizes cannot be told apart: refused.
    spec2 = KVCacheSpec(2, (16, 32), 4)
    wide = np.zeros(4096, np.uint8)
    with pytest.raises(ValueError, match=r"overlap in memory with pages of 64 and 128 B"):
        CacheLayers(spec2, [wide[:256].reshape(4, 4, 16), wide[64:576].reshape(4, 4, 32)], writable=True)


def test_page_interleaved_receiver_views_land_and_clashing_pages_are_refused(engine):
    """Two entries viewing one buffer one page apart (vLLM's CPU cache, one entry per head's K or V):
    entry 1's page p is entry 0's page p + 1. Even pages never clash: byte-exact; pages p and p + 1
    in one request would write the same bytes through both entries: refused naming them."""
    spec = KVCacheSpec(2, (16, 16), 4)
    big = np.full(9 * 64, SENTINEL, np.uint8)  # 9 pages of 64 B: entry 0 = pages 0-7, entry 1 = 1-8
    dst = [big[:512].reshape(8, 4, 16), big[64:576].reshape(8, 4, 16)]
    rng = np.random.default_rng(3)
    src = [rng.integers(0, 256, (8, 4, 16), dtype=np.uint8) for _ in range(2)]
    with KVSender(spec, src, engine=engine) as s, KVReceiver(spec, dst, engine=engine) as r:
        r.connect(s.address)
        with pytest.raises(ValueError, match=r"page_table: page 3 of kv_layers\[0\] and page 2 of kv_layers\[1\] "
                                             r"are the same bytes"):
            r.expect("clash", np.array([2, 3]), 8)
        # Across requests too (a second fresh user): page 3 of entry 0 is page 2 of entry 1, written by "A".
        r.expect("A", np.array([6]), 4)
        with pytest.raises(ValueError, match=r"page 7 of kv_layers\[0\] and page 6 of kv_layers\[1\] are the same "
                                             r"bytes .*; request 'A', still held"):
            r.expect("B", np.array([7]), 4)
        with pytest.raises(ValueError, match=r"page 6 of kv_layers\[0\] and page 5 of kv_layers\[1\] .*request 'A'"):
            r.expect("B", np.array([5]), 4)
        r.release("A")
        want = big.copy()
        r.expect("even", np.array([0, 2]), 8)  # entry 0 writes buffer pages 0, 2; entry 1 pages 1, 3
        s.send("even", np.array([5, 6]), 0, 8)
        deadline = time.monotonic() + 10
        while not (r.poll("even").terminal and s.poll("even").terminal) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert (r.poll("even"), s.poll("even")) == (TransferStatus.SUCCESS,) * 2, r.failure_reason("even")
        for layer in range(2):
            for j, (sp, dp) in enumerate(((5, 0), (6, 2))):
                want[64 * (dp + layer): 64 * (dp + layer + 1)] = src[layer][sp].reshape(-1)
        np.testing.assert_array_equal(big, want)


def _landed(r, sender, rid, n):
    """One request of ``n`` tokens from ``sender`` to the single rank ``r``: SUCCESS, byte-exact."""
    r.expect(rid, np.arange(4), n)
    sender.send(rid, np.arange(4), 0, n)
    deadline = time.monotonic() + 10
    while not (r.poll(rid).terminal and sender.poll(rid).terminal) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert (r.poll(rid), sender.poll(rid)) == (TransferStatus.SUCCESS,) * 2, r.failure_reason(rid)


def test_a_chunk_sent_after_a_decode_rank_aborted_is_dropped_not_raised(engine):
    # Before: the prefill's next send raised "ABORTED; release() it before reusing the id" for
    # the same request's next chunk: a decode-side cancel became an exception in its loop.
    src = [np.zeros((16, 4, il), np.uint8) for il in ITEMS]
    dst = [np.full((16, 4, il), SENTINEL, np.uint8) for il in ITEMS]
    spec = KVCacheSpec(2, ITEMS, 4)
    with KVSender(spec, src, engine=engine) as s, KVReceiver(spec, dst, engine=engine) as r:
        r.connect(s.address)
        r.expect("w", np.arange(4), 16)
        s.send("w", np.arange(4), 0, 8)
        r.abort("w", "client went away")
        deadline = time.monotonic() + 10
        while s.poll("w") is not TransferStatus.ABORTED and time.monotonic() < deadline:
            time.sleep(0.002)
        assert s.poll("w") is TransferStatus.ABORTED and "client went away" in s.failure_reason("w")
        assert s.send("w", np.arange(4), 8, 16) is None  # the next chunk: dropped, no exception
        assert s.poll("w") is TransferStatus.ABORTED
        for layer in range(2):  # nothing of the dropped chunk reached the pages
            assert (dst[layer][2:] == SENTINEL).all()
        s.release("w"), r.release("w")
        with pytest.raises(KeyError):  # released: the id is free again
            s.poll("w")


def test_requests_the_prefill_never_sent_are_forgotten_after_timeout_s(engine):
    # Before: every id a decode rank announced and then released stayed held by the sender
    # (ABORTED), with no way for the prefill, which never knew the id, to release it.
    src = [np.zeros((16, 4, il), np.uint8) for il in ITEMS]
    dst = [np.full((16, 4, il), SENTINEL, np.uint8) for il in ITEMS]
    spec = KVCacheSpec(2, ITEMS, 4)
    with KVSender(spec, src, engine=engine, timeout_s=0.5) as s, KVReceiver(spec, dst, engine=engine) as r:
        r.connect(s.address)
        for i in range(3):
            r.expect(f"c{i}", np.arange(4 * i, 4 * i + 4), 16)
            r.release(f"c{i}")  # the decode side cancels before the prefill sends
        s.send("kept", np.arange(4), 0, 16)  # sent to, never announced: FAILED, but held (known id)
        deadline = time.monotonic() + 10
        while s.stats["requests"] < 4 and time.monotonic() < deadline:  # the announcements arrived
            time.sleep(0.01)
        while s.stats["live_requests"] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.stats["live_requests"] == 1
        assert s.poll("kept") in (TransferStatus.WAITING, TransferStatus.FAILED)  # its own id: held until release
        # Dropped, but for timeout_s more a caller that knew the id still gets its answer (before:
        # KeyError at once, so a poll then a release raced the drop) and may release it.
        assert s.poll("c1") is TransferStatus.ABORTED and "released" in s.failure_reason("c1")
        assert s.wait("c2", 0) is TransferStatus.ABORTED and s.request_stats("c2")["status"] == "aborted"
        s.release("c1")
        with pytest.raises(KeyError):
            s.poll("c1")  # released: gone at once
        # Each id is forgotten timeout_s after ITS drop: c2's release reached the sender after
        # c0's, so under load it can still be known when c0 is gone (seen once on 2 cores).
        for rid in ("c0", "c2"):
            while time.monotonic() < deadline:
                try:
                    s.poll(rid)
                except KeyError:
                    break
                time.sleep(0.05)
        with pytest.raises(KeyError):
            s.poll("c0")  # timeout_s after the drop: unknown
        with pytest.raises(KeyError):
            s.release("c2")  # a forgotten id cannot be released


def test_a_full_prefix_hit_the_prefill_never_sent_is_forgotten_after_timeout_s(engine):
    # Before: a request every rank announced as a full prefix hit ended SUCCESS on the sender
    # with nothing to send and was held forever: a router that skips the prefill on a full hit
    # leaked one record per hit.
    src = [np.zeros((16, 4, il), np.uint8) for il in ITEMS]
    dst = [np.full((16, 4, il), SENTINEL, np.uint8) for il in ITEMS]
    spec = KVCacheSpec(2, ITEMS, 4)
    with KVSender(spec, src, engine=engine, timeout_s=0.5) as s, KVReceiver(spec, dst, engine=engine) as r:
        r.connect(s.address)
        r.expect("hit", np.arange(4), 16, prefix_tokens=16)
        assert r.wait("hit", 5) is TransferStatus.SUCCESS
        deadline = time.monotonic() + 10
        while s.stats["requests"] == 0 and time.monotonic() < deadline:  # its announcement arrived
            time.sleep(0.01)
        assert s.poll("hit") is TransferStatus.SUCCESS
        while s.stats["live_requests"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.stats["live_requests"] == 0, s.stats
        assert s.poll("hit") is TransferStatus.SUCCESS  # dropped; its answer kept for timeout_s more
        # The id used again meanwhile: a new request, not the dropped record.
        r.release("hit")
        r.expect("hit", np.arange(4), 16)
        s.send("hit", np.arange(4), 0, 16)
        assert s.wait("hit", 5) is TransferStatus.SUCCESS and r.wait("hit", 5) is TransferStatus.SUCCESS
        assert s.request_stats("hit")["ranks"][0]["rows"] == 16
        s.release("hit")
        with pytest.raises(KeyError):
            s.poll("hit")


def test_a_second_sender_of_one_prefill_position_is_refused_until_the_first_is_dropped(engine):
    # Before: both accepted; every request was announced to both and each wrote the same rows.
    rng = np.random.default_rng(7)
    src = [[rng.integers(0, 256, (16, 4, il), dtype=np.uint8) for il in ITEMS] for _ in range(2)]
    dst = [np.full((16, 4, il), SENTINEL, np.uint8) for il in ITEMS]
    spec = KVCacheSpec(2, ITEMS, 4)
    with KVSender(spec, src[0], engine=engine) as s0, KVSender(spec, src[1], engine=engine) as s1, \
            KVReceiver(spec, dst, engine=engine, peer_timeout_s=1.0, heartbeat_s=0.2) as r:
        r.connect(s0.address)
        with pytest.raises(HandshakeError, match=r"\(position\).*prefill dcp_rank 0, tp_rank 0, the position of "
                                                 r"the live sender at 'tcp://"):
            r.connect(s1.address)
        assert r.stats["connections"] == 1
        _landed(r, s0, "a", 16)  # the first link works on
        for layer in range(2):  # 16 tokens on pages 0-3 of both sides, the rest still the sentinel
            np.testing.assert_array_equal(dst[layer][:4], src[0][layer][:4])
            assert (dst[layer][4:] == SENTINEL).all()
        r.release("a"), s0.release("a")
        # The first sender goes away: its bye comes after its engine's close (Mooncake's took
        # about 1 s, at times holding the GIL so no ping left meanwhile), so this 1 s limit may
        # drop it as silent first.
        s0.close()
        deadline = time.monotonic() + 10
        while r.stats["connections"] and time.monotonic() < deadline:
            time.sleep(0.05)
        # Connected once: expect() says why no sender is left, not "before connect()".
        with pytest.raises(RuntimeError, match=r"no connected sender: the last link was dropped \(prefill "
                                               r"sender tcp://\S+ (ended the connection: sender closed|silent for 1 s)\); connect\(\) again"):
            r.expect("c", np.arange(4), 16)
        r.connect(s1.address)  # the same position, a new sender: accepted now
        _landed(r, s1, "b", 16)
        for layer in range(2):
            np.testing.assert_array_equal(dst[layer][:4], src[1][layer][:4])


def test_a_pull_timeline_has_a_post_and_a_complete_per_window(engine):
    # Before: a pulling rank's windows left no sender event at all (post / complete were marked
    # only where the engine posts a WRITE).
    with cluster(engine, direction="pull", page_size=4, seed=11) as c:
        src, dst = c.tables(40)
        c.expect("t", dst, 40)
        c.sender.send("t", src, 0, 20)
        c.sender.send("t", src, 20, 40)
        assert c.wait("t") == [TransferStatus.SUCCESS] * 3, c.reasons("t")
        assert c.check_bytes(src, dst, 40) == 40
        st = c.sender.request_stats("t")
        for rank in range(2):
            ev = [(e, t) for e, r, t in st["timeline"] if r == rank]
            posts, done = [t for e, t in ev if e == "post"], [t for e, t in ev if e == "complete"]
            # Two chunks of 10 rows per rank, each one window: two pull_ready, two pull_done.
            assert len(posts) == len(done) == st["ranks"][rank]["batches"] == 2, ev
            assert sorted(posts)[0] <= sorted(done)[0] and sorted(posts)[1] <= sorted(done)[1]
        for r, recv in enumerate(c.receivers):  # a receiver's events name itself
            assert {x[1] for x in recv.request_stats("t")["timeline"]} == {r}


def test_integers_beyond_int64_are_refused_naming_the_argument():
    # Before: "length must be integers, got dtype object" (num_tokens, stop), a page-id dtype
    # complaint (object, float64), or a uint64 id wrapped to a negative one.
    with cluster("nixl", dcp_size=1, page_size=4, seed=13) as c:
        r, s, huge = c.receivers[0], c.sender, 2 ** 70
        for kw, name in ((dict(num_tokens=huge), "num_tokens"),
                         (dict(num_tokens=8, prefix_tokens=huge), "prefix_tokens")):
            with pytest.raises(ValueError, match=rf"{name}={huge} must be an int in \[0, 2\*\*62\]"):
                r.expect("q", np.arange(2), **kw)
        for table, k, v in (([0, huge], 1, huge), ([0, 2 ** 64 - 1], 1, 2 ** 64 - 1), ([-huge, 1], 0, -huge),
                            (np.array([2 ** 63, 1], np.uint64), 0, 2 ** 63)):
            with pytest.raises(ValueError, match=rf"page_table\[{k}\]={v} does not fit int64"):
                r.expect("q", table, 8)
            with pytest.raises(ValueError, match=rf"page_table\[{k}\]={v} does not fit int64"):
                s.send("q", table, 0, 8)
        for start, stop, name in ((0, huge, "stop"), (2 ** 63, huge, "start")):
            with pytest.raises(ValueError, match=rf"{name}={[start, stop][name == 'stop']} must be an int in"):
                s.send("q", np.arange(2), start, stop)
        r.expect("q", np.arange(2), 8)  # the same request with sane values goes through
        s.send("q", np.arange(2), 0, 8)
        assert c.wait("q") == [TransferStatus.SUCCESS] * 2, c.reasons("q")
        assert c.check_bytes(np.arange(2), [np.arange(2)], 8) == 8


def test_sender_options_a_fresh_user_got_unnamed_errors_for(engine):
    spec = KVCacheSpec(2, (16, 16), 4)
    kv = [np.zeros((4, 4, 16), np.uint8) for _ in range(2)]
    # Before: a bare "OSError: [Errno 12] Cannot allocate memory".
    with pytest.raises(MemoryError, match=r"pack_bytes=1,125,899,906,842,624: cannot allocate the pack buffer"):
        KVSender(spec, kv, engine=engine, pack_bytes=2**50)
    # Before: True was taken for 1.
    with pytest.raises(TypeError, match=r"max_batch_indices must be an int, got bool \(max_batch_indices=True\)"):
        KVSender(spec, kv, engine=engine, max_batch_indices=True)
    # Before: "NixlEngine.__init__() got an unexpected keyword argument 'foo'" (whose argument?).
    for side in (lambda: KVSender(spec, kv, engine=engine, engine_options={"foo": 1}),
                 lambda: KVReceiver(spec, kv, engine=engine, engine_options={"foo": 1})):
        with pytest.raises(TypeError, match=r"engine_options=\{'foo': 1\}: .*unexpected keyword argument 'foo'"):
            side()
    with pytest.raises(TypeError, match=r"engine_options must be a dict or None, got list"):
        KVReceiver(spec, kv, engine=engine, engine_options=["foo"])


def test_receive_region_too_large_to_allocate_is_named(engine):
    spec = KVCacheSpec(2, (16, 16), 4)
    kv = [np.zeros((4, 4, 16), np.uint8) for _ in range(2)]
    # Before: a bare "OSError: [Errno 12] Cannot allocate memory" from the region's buffer.
    with pytest.raises(MemoryError, match=r"region_bytes=1,125,899,906,842,624: cannot allocate the receive region"):
        KVReceiver(spec, kv, engine=engine, region_bytes=1 << 50)
    # Nothing was left half open: the same pages serve a receiver with a sane region.
    r = KVReceiver(spec, kv, engine=engine, region_bytes=1 << 12)
    try:
        assert r.stats["region"]["capacity"] == 1 << 12
    finally:
        r.close()


def test_senders_of_another_prefill_group_layout_are_refused(engine):
    # A second fresh user: prefill ranks declaring different interleaves (or DCP sizes) were all
    # linked; every side ended SUCCESS with some decode rows never written and others written twice.
    kv = [np.zeros((8, 4, 16), np.uint8) for _ in range(2)]
    dspec = KVCacheSpec(2, (16, 16), 4)
    s0 = KVSender(KVCacheSpec(2, (16, 16), 4, dcp_size=2, dcp_rank=0), kv, engine=engine)
    odd = [KVSender(KVCacheSpec(2, (16, 16), 4, dcp_size=2, dcp_rank=1, interleave_size=4), kv, engine=engine),
           KVSender(KVCacheSpec(2, (16, 16), 4, dcp_size=3, dcp_rank=1), kv, engine=engine)]
    good = KVSender(KVCacheSpec(2, (16, 16), 4, dcp_size=2, dcp_rank=1), kv, engine=engine)
    try:
        with KVReceiver(dspec, [np.zeros((8, 4, 16), np.uint8) for _ in range(2)], engine=engine) as r:
            r.connect(s0.address)
            for s, field in zip(odd, ("interleave_size", "dcp_size")):
                with pytest.raises(HandshakeError, match="another prefill group layout") as info:
                    r.connect(s.address)
                assert info.value.field == field
            r.connect(good.address)  # the group's own layout: linked
            r.expect("q", np.arange(2), 8)
    finally:
        for s in (s0, good, *odd):
            s.close()


def test_receive_region_under_one_token_is_refused_not_dropped(engine):
    # Before: region_bytes=20 (under the 32-byte token) became "no region" without a word, and a
    # region-mode sender was refused with "a receive region of 0 bytes".
    spec = KVCacheSpec(2, (16, 16), 4)
    kv = [np.zeros((4, 4, 16), np.uint8) for _ in range(2)]
    with pytest.raises(ValueError, match=r"region_bytes=20 is less than one token's 32 bytes"):
        KVReceiver(spec, kv, engine=engine, region_bytes=20)
    for ok in (0, 32):  # none, and exactly one token
        with KVReceiver(spec, kv, engine=engine, region_bytes=ok) as r:
            assert r.stats["region"]["capacity"] == ok


@pytest.mark.parametrize("announce_first", [False, True])
@pytest.mark.parametrize("mode", ["region", "packed"])
def test_a_late_chunk_of_a_released_request_never_passes_for_the_reused_id(engine, mode, announce_first):
    """The fresh-user trial of 2026-12-04: a scheduler sent a chunk of a request it had released
    (the id then names a new request), and reused the id for another prompt. Before, both sides
    ended SUCCESS with rows 20-39 from the released request's pages. Now (the id was released
    less than timeout_s before the late chunk) the new prompt's first send moves a page the late
    chunk gave: it raises, the request FAILS on both sides, and the new prompt, sent again after
    a release, lands byte-exact. Whether the late chunk or the rank's announcement of the next use
    reaches the sender first."""
    kw = dict(receiver_kw=dict(region_bytes=4 * 64)) if mode == "region" else {}  # 4 tokens: windows reuse it
    with cluster(engine, dcp_size=1, mode=mode, seed=11, **kw) as c:
        r0 = c.receivers[0]
        old_src, old_dst = c.tables(40)
        c.expect("z", old_dst, 40)
        c.sender.send("z", old_src, 0, 20)
        c.sender.release("z")  # the scheduler dropped it; one of its chunks is still on its way
        assert c.wait("z", sides=[r0]) == [TransferStatus.ABORTED]
        r0.release("z")
        new_src, new_dst = c.tables(40)
        if announce_first:  # the rank's announcement of the id's next use starts the request here
            c.expect("z", new_dst, 40)
            deadline = time.monotonic() + 10
            while True:
                try:
                    c.sender.poll("z")
                    break
                except KeyError:
                    assert time.monotonic() < deadline, "the announcement never reached the sender"
                    time.sleep(0.005)
        c.sender.send("z", old_src, 20, 40)  # the late chunk (without an announcement: a new request here)
        if not announce_first:
            c.expect("z", new_dst, 40)
        with pytest.raises(ValueError, match=r"page_table\[5\]=\d+ but an earlier send of request_id='z' "
                                             r"gave page \d+ for tokens it sent: a request's pages do not move"):
            c.sender.send("z", new_src, 0, 20)
        assert c.wait("z") == [TransferStatus.FAILED] * 2, c.reasons("z")
        assert "pages do not move" in c.sender.failure_reason("z")
        c.sender.release("z")
        r0.release("z")
        fresh_dst = c.tables(40)[1]  # the failed request's pages may still be held: fresh ones
        c.expect("z", fresh_dst, 40)
        c.sender.send("z", new_src, 0, 20)
        c.sender.send("z", new_src, 20, 40)
        assert c.wait("z") == [TransferStatus.SUCCESS] * 2, c.reasons("z")
        assert c.check_bytes(new_src, fresh_dst, 40) == 40


def test_a_reused_id_with_a_zero_padded_first_table_succeeds(engine):
    """The second fresh-user trial: right after a release, the id's next request sent its first
    chunk with a fixed-width, zero-padded table row (vLLM's block-table convention) and the real
    pages later: the moved-page check compared the padding and FAILED it (timing-dependent). It
    compares only the pages that hold rows an earlier chunk sent."""
    with cluster(engine, dcp_size=1, seed=12) as c:
        c.round_trip("z", 16)
        c.sender.release("z")
        c.receivers[0].release("z")
        src, dst = c.tables(16)
        c.expect("z", dst, 16)
        padded = np.array([src[0], src[1], 0, 0], np.int64)  # pages for tokens [0, 8), then padding
        c.sender.send("z", padded, 0, 8)
        c.sender.send("z", src, 8, 16)
        assert c.wait("z") == [TransferStatus.SUCCESS] * 2, c.reasons("z")
        assert c.check_bytes(src, dst, 16) == 16
