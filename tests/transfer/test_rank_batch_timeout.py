"""A decode rank's own ``timeout_s`` against one long engine batch (real engines on loopback).

The sender counts an engine batch it still sees in flight as progress (within ``timeout_s`` + its
size allowance, `_sender_endings.batch_allowance`), but a rank only saw windows land: a rank with
``timeout_s=0.3`` FAILED a request whose one Mooncake direct batch (40,000 descriptors, ~1-3 s
here) was still moving, push and pull ("no progress for 0.3 s; tokens [0, 10000) have not
landed"), while the sender would have waited it out. Now the sender tells each rank, in a
``moving`` frame, which of its requests have such a batch in flight within its bound, with a lease
during which the rank counts the request as progressing. A batch past its bound, a lost ``failed``
or a frozen sender still end the rank's request FAILED within a bound; a malformed ``moving``
frame is refused and touches nothing.
"""
import threading
import time

import msgpack
import pytest

from _long_batch import (DESCRIPTORS, TEST_DESCRIPTOR_S, TIMEOUT_S, TOKENS, bound_text, long_batch_cluster,
                         needs_mooncake, ship_one_long_batch)
from bridge.nixl import nixl_available
from conftest import Cluster
from dcp_jax.transfer import TransferStatus
from dcp_jax.transfer import _sender_endings
from dcp_jax.transfer import protocol as proto

S = TransferStatus

def _ended_at(side, rid, deadline_s):
    """Polls ``side`` until ``rid`` is terminal; ``time.monotonic()`` then (None past the deadline)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if side.poll(rid).terminal:
            return time.monotonic()
        time.sleep(0.002)
    return None


@needs_mooncake
@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_rank_with_a_short_timeout_keeps_a_long_batch_and_ends_success_byte_exact(direction):
    # Before: the rank FAILED after ~0.34 s ("no progress for 0.3 s; tokens [0, 10000) have not
    # landed"), and told the sender, while the engine was still moving the one batch.
    c = long_batch_cluster(direction)
    try:
        ship_one_long_batch(c)  # a batch longer than both sides' timeout_s: SUCCESS, byte-exact
        assert c.receivers[0]._requests["long"].moving_until > 0  # the sender's word held it
    finally:
        c.close()


@needs_mooncake
@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_batch_past_its_bound_still_fails_on_the_rank_within_a_bound(monkeypatch, direction):
    # A test-only allowance (`TEST_DESCRIPTOR_S`): bound = 0.3 + 0.2 s, long before the batch
    # completes. The rank is held by the sender's word up to that bound; the sender FAILS the
    # request there and tells it (the rank's own clock would end it timeout_s later).
    monkeypatch.setattr(_sender_endings, "BATCH_DESCRIPTOR_S", TEST_DESCRIPTOR_S)
    bound = TIMEOUT_S + DESCRIPTORS * TEST_DESCRIPTOR_S
    c = long_batch_cluster(direction)
    try:
        src, dst = c.tables(TOKENS)
        c.expect("stuck", dst, TOKENS)
        t0 = time.monotonic()
        c.sender.send("stuck", src, 0, TOKENS)
        end = _ended_at(c.receivers[0], "stuck", 30)
        assert end is not None and end - t0 < bound + TIMEOUT_S + 3.0, (end and end - t0, c.reasons("stuck"))
        assert c.wait("stuck", timeout_s=30) == [S.FAILED, S.FAILED], c.reasons("stuck")
        assert bound_text(TEST_DESCRIPTOR_S) in c.sender.failure_reason("stuck"), c.reasons("stuck")
        deadline = time.monotonic() + 30
        while not (c.sender.is_drained("stuck") and c.receivers[0].is_drained("stuck")) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.sender.is_drained("stuck") and c.receivers[0].is_drained("stuck")
    finally:
        c.close()


@needs_mooncake
def test_a_lost_failed_frame_the_rank_ends_the_request_itself_when_the_lease_lapses(monkeypatch):
    # The sender FAILS the stuck batch at its bound, but its "failed" never reaches the rank: the
    # rank's own timeout_s ends the request, counted from the end of the last lease (at most that
    # bound).
    monkeypatch.setattr(_sender_endings, "BATCH_DESCRIPTOR_S", TEST_DESCRIPTOR_S)
    bound = TIMEOUT_S + DESCRIPTORS * TEST_DESCRIPTOR_S
    c = long_batch_cluster("push")
    try:
        real = c.sender._ctl.send

        def send(ident, frame):
            if proto.decode(frame)["k"] == "failed":
                return True  # lost
            return real(ident, frame)

        c.sender._ctl.send = send
        src, dst = c.tables(TOKENS)
        c.expect("lost", dst, TOKENS)
        t0 = time.monotonic()
        c.sender.send("lost", src, 0, TOKENS)
        end = _ended_at(c.receivers[0], "lost", 30)
        assert end is not None and end - t0 < bound + TIMEOUT_S + 3.0, (end and end - t0, c.reasons("lost"))
        reason = c.receivers[0].failure_reason("lost")
        assert c.receivers[0].poll("lost") is S.FAILED and reason.startswith(f"no progress for {TIMEOUT_S:g} s"), reason
        assert "its sender's last report of an engine batch in flight lapsed" in reason, reason
        # Held by the leases up to the bound, then its own timeout_s.
        assert end - t0 > bound + TIMEOUT_S - 0.1, (end - t0, reason)
        assert c.sender.poll("lost") is S.FAILED and "past its bound" in c.sender.failure_reason("lost")
    finally:
        c.close()


@needs_mooncake
def test_a_frozen_sender_still_ends_the_rank_request_after_peer_timeout_s():
    # The sender's worker stands still (its lock held) while its engine moves the batch: no ping,
    # no moving frame. The rank drops it after its peer_timeout_s and FAILS the request. (The
    # engine's own threads deliver the batch's done: 80,000 descriptors, ~2.7-6 s here, outlast
    # the 1.5 s.)
    tokens = 2 * TOKENS
    c = long_batch_cluster("push", tokens=tokens, peer_timeout_s=1.5)
    release = threading.Event()
    try:
        src, dst = c.tables(tokens)
        c.expect("frozen", dst, tokens)
        c.sender.send("frozen", src, 0, tokens)
        deadline = time.monotonic() + 10  # the batch is posted and reported once
        while c.receivers[0]._requests["frozen"].moving_until == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert c.receivers[0]._requests["frozen"].moving_until > 0, c.reasons("frozen")
        held = threading.Event()

        def freeze():
            with c.sender._lock:
                held.set()
                release.wait(10)

        threading.Thread(target=freeze, daemon=True).start()
        held.wait(5)
        t0 = time.monotonic()
        end = _ended_at(c.receivers[0], "frozen", 10)
        assert end is not None and end - t0 < 1.5 + 1.5, (end and end - t0, c.reasons("frozen"))
        assert c.receivers[0].poll("frozen") is S.FAILED, c.reasons("frozen")
        assert "silent for 1.5 s" in c.receivers[0].failure_reason("frozen"), c.reasons("frozen")
    finally:
        release.set()
        c.close()


# ---- the moving frame itself ------------------------------------------------------------------
def _raw(**fields):
    """A moving frame built by hand (not through `proto.encode`, which would refuse a bad one)."""
    msg = {"v": proto.PROTOCOL_VERSION, "k": "moving", "rid": "", "inc": 0, "reqs": [["r", 1, 1000]]}
    msg.update(fields)
    return msgpack.packb(msg, use_bin_type=True)


BAD = {
    "no entries": _raw(reqs=[]),
    "an entry of 2": _raw(reqs=[["r", 1]]),
    "an entry of 4": _raw(reqs=[["r", 1, 1000, 0]]),
    "an entry not a list": _raw(reqs=[{"r": 1}]),
    "rid not a str": _raw(reqs=[[7, 1, 1000]]),
    "rid empty": _raw(reqs=[["", 1, 1000]]),
    "rid too long": _raw(reqs=[["x" * 257, 1, 1000]]),
    "inc negative": _raw(reqs=[["r", -1, 1000]]),
    "inc a bool": _raw(reqs=[["r", True, 1000]]),
    "inc a float": _raw(reqs=[["r", 1.0, 1000]]),
    "lease negative": _raw(reqs=[["r", 1, -5]]),
    "lease past a day": _raw(reqs=[["r", 1, proto.MAX_LEASE_MS + 1]]),
    "lease a float": _raw(reqs=[["r", 1, 1.5]]),
    "too many entries": _raw(reqs=[["r", 1, 1000]] * (proto.MAX_MOVING + 1)),
    "rid set on the frame": _raw(rid="r"),
    "inc set on the frame": _raw(inc=3),
    "reqs not a list": _raw(reqs=b"r"),
    "an extra field": _raw(lease_ms=5),
}


@pytest.mark.parametrize("why", list(BAD))
def test_decode_refuses_a_malformed_moving_frame(why):
    with pytest.raises(proto.ProtocolError, match="moving"):
        proto.decode(BAD[why])


def test_decode_takes_a_well_formed_moving_frame():
    msg = proto.decode(proto.encode("moving", reqs=[["r", 1, 0], ["é" * 128, (1 << 63) - 1, proto.MAX_LEASE_MS]]))
    assert msg["reqs"] == [["r", 1, 0], ["é" * 128, (1 << 63) - 1, proto.MAX_LEASE_MS]]


def _inject(c, frame):
    """Sends a raw frame from the sender to its one rank (through the sender's own queue, under its lock)."""
    with c.sender._lock:
        c.sender._tell(next(iter(c.sender._conns)), frame)


def test_a_malformed_moving_frame_from_the_sender_is_refused_without_touching_state(engine):
    c = Cluster(engine, dcp_size=1, timeout_s=1.0, seed=4)
    c.sender.timeout_s = 60.0  # its own clock never ends these (no send): only the rank's does
    try:
        r = c.receivers[0]
        client = r._links[0].client
        src, dst = c.tables(16)
        c.expect("m", dst, 16)  # never sent: only the rank's own clock can end it
        inc = r._requests["m"].inc
        bad = [_raw(reqs=[["m", inc, 60_000, 0]]), _raw(reqs=[["m", inc, -1]]), _raw(reqs=[["m", True, 60_000]]),
               _raw(rid="m", inc=inc, reqs=[["m", inc, 60_000]]), _raw(reqs=[["m", inc, 60_000.0]])]
        # Well-formed, but not of this request: another incarnation, another id.
        stray = [proto.encode("moving", reqs=[["m", inc + 1, 60_000]]), proto.encode("moving", reqs=[["n", inc, 60_000]])]
        before = client.rejected
        for frame in bad + stray:
            _inject(c, frame)
        deadline = time.monotonic() + 5
        while client.rejected < before + len(bad) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.rejected == before + len(bad)
        assert r._requests["m"].moving_until == 0.0 and r.stats["dropped_messages"] == 0
        t0 = time.monotonic()
        end = _ended_at(r, "m", 10)
        assert end is not None and end - t0 < 1.5, c.reasons("m")
        assert r.poll("m") is S.FAILED and r.failure_reason("m").startswith("no progress for 1 s; tokens [0, 16)")
        assert "lapsed" not in r.failure_reason("m")

        # The control: a well-formed report of the live request holds it for its lease (2 s here),
        # then its timeout_s of 1 s runs and it FAILS naming the lapse.
        c.expect("h", c.tables(16)[1], 16)
        t0 = time.monotonic()
        _inject(c, proto.encode("moving", reqs=[["h", r._requests["h"].inc, 2000]]))
        end = _ended_at(r, "h", 10)
        assert end is not None and 2.9 < end - t0 < 4.0, (end and end - t0, c.reasons("h"))
        assert "its sender's last report of an engine batch in flight lapsed" in r.failure_reason("h")
    finally:
        c.close()


def test_a_rank_caps_a_lease_at_its_peer_timeout_s(engine):
    # A lease of a day counts for no longer than the rank's peer_timeout_s (3 s here; its
    # timeout_s of 0.5 s runs after it): a sender gone silent that long is dropped anyway.
    c = Cluster(engine, dcp_size=1, timeout_s=0.5, peer_timeout_s=3.0, seed=5)
    c.sender.timeout_s = 60.0
    try:
        r = c.receivers[0]
        c.expect("cap", c.tables(16)[1], 16)
        t0 = time.monotonic()
        _inject(c, proto.encode("moving", reqs=[["cap", r._requests["cap"].inc, proto.MAX_LEASE_MS]]))
        end = _ended_at(r, "cap", 10)
        assert end is not None and 3.4 < end - t0 < 5.0, (end and end - t0, c.reasons("cap"))
        assert r.poll("cap") is S.FAILED and "lapsed" in r.failure_reason("cap"), c.reasons("cap")
    finally:
        c.close()


@needs_mooncake
@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_short_request_queued_behind_a_long_batch_to_the_same_rank_ends_success(direction):
    # Found by a fresh-user trial: B (4 tokens, 16 descriptors) posted 5 ms after A's one batch
    # of 40,000 descriptors to the same rank waited its turn in the engine, and its own bound
    # (timeout_s + a few ms from its post) ran out long before A completed: FAILED on both sides
    # ("... has not completed in 0.4 s, past its bound of 0.3 s") while A ended SUCCESS.
    c = long_batch_cluster(direction, tokens=TOKENS + 4)
    try:
        sa, da = c.tables(TOKENS)
        sb, db = c.tables(4)
        c.expect("A", da, TOKENS)
        c.expect("B", db, 4)
        c.sender.send("A", sa, 0, TOKENS)
        time.sleep(0.005)
        c.sender.send("B", sb, 0, 4)
        assert c.wait("A", timeout_s=60) == [S.SUCCESS, S.SUCCESS], c.reasons("A")
        assert c.wait("B", timeout_s=60) == [S.SUCCESS, S.SUCCESS], c.reasons("B")
        at = {name: t for name, _, t in c.sender.request_stats("A")["timeline"]}
        assert at["complete"] - at["post"] > 2 * TIMEOUT_S  # B really waited behind a long batch
        assert c.check_bytes(sa, da, TOKENS) == TOKENS and c.check_bytes(sb, db, 4) == 4
    finally:
        c.close()


def _a_then_b_both_succeed(c, L: int) -> None:
    """Sends A (L tokens) then B (4 tokens) to rank 0; both end SUCCESS byte-exact, and B waited
    well past its ``timeout_s`` (queued behind A's windows for room)."""
    sa, da = c.tables(L)
    sb, db = c.tables(4)
    c.expect("A", da, L)
    c.expect("B", db, 4)
    c.sender.send("A", sa, 0, L)
    time.sleep(0.005)
    t_b = time.monotonic()
    c.sender.send("B", sb, 0, 4)
    assert c.wait("A", timeout_s=60) == [S.SUCCESS, S.SUCCESS], c.reasons("A")
    assert c.wait("B", timeout_s=60) == [S.SUCCESS, S.SUCCESS], c.reasons("B")
    assert time.monotonic() - t_b > 2 * TIMEOUT_S
    assert c.check_bytes(sa, da, L) == L and c.check_bytes(sb, db, 4) == 4


@needs_mooncake
@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_short_request_waiting_for_arena_room_behind_a_long_one_ends_success(direction):
    # Found by a fresh-user trial: packed, a pack arena of 192 kB (a rank may hold half of it):
    # B (4 tokens) queued behind A's windows (6,000 tokens, ~1 s of windows one after another)
    # got no progress while it waited for room, and FAILED on both sides at timeout_s=0.3
    # ("... have windows not yet confirmed (queued, or waiting for room)") while A moved.
    # A now has 20,000 tokens: 6,000 took only 0.57 s on a quiet machine, 9,000 0.44-0.55 s on
    # the host of 2026-12-07, too close to the check.
    L = 20000
    c = Cluster("mooncake", dcp_size=1, item_lens=(8,) * 4, page_size=1, pages=L + 20, mode="packed",
                direction=direction, timeout_s=TIMEOUT_S, pack_bytes=192064, seed=6)
    try:
        c.sender.timeout_s = TIMEOUT_S
        _a_then_b_both_succeed(c, L)
    finally:
        c.close()


@needs_mooncake
def test_a_request_queued_behind_another_lives_through_the_gaps_between_its_windows(monkeypatch):
    # Between one of A's windows giving its pack room back and A's next window leaving the queue
    # no batch to the rank is in flight. B, queued behind A past its own timeout_s, FAILED in such
    # a gap when the timeout check fell into it (a full-suite run, 2026-12-07). Here every gap is
    # made 0.15 s long (a slow host between rounds: the sender submits nothing meanwhile), shorter
    # than timeout_s (0.3 s): the queue to the rank moved within timeout_s, so B lives on.
    L = 20000
    c = Cluster("mooncake", dcp_size=1, item_lens=(8,) * 4, page_size=1, pages=L + 20, mode="packed",
                direction="push", timeout_s=TIMEOUT_S, pack_bytes=192064, seed=7)
    snd = c.sender
    real_submit, real_free = snd._submit_units, snd._free_region
    freed, gaps = [float("-inf")], [0]

    def free_region(u):
        real_free(u)
        freed[0] = time.monotonic()

    def submit_units():
        if time.monotonic() - freed[0] < 0.15:
            gaps[0] += 1
            return False
        return real_submit()

    try:
        snd.timeout_s = TIMEOUT_S
        monkeypatch.setattr(snd, "_free_region", free_region)  # the worker calls them on the instance
        monkeypatch.setattr(snd, "_submit_units", submit_units)
        _a_then_b_both_succeed(c, L)
        assert gaps[0] > 0  # the sender stood still after room came back, at least once
    finally:
        c.close()


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
def test_requests_behind_a_stuck_batch_fail_even_while_other_ranks_stay_busy(monkeypatch):
    # Found by a fresh-user trial: queued windows were kept alive by the latest bound of ANY
    # batch in flight, so while short requests kept rank 1 busy, B (waiting for rank 0's arena
    # share, held by A's hung window) never ended on either side. Now a window to a rank that
    # holds arena room waits only for that rank's own batches. The hang is simulated: the engine
    # never reports A's rank-0 batch done; D's batches are held live 0.2 s (within their bound).
    monkeypatch.setattr(_sender_endings, "BATCH_DESCRIPTOR_S", TEST_DESCRIPTOR_S)
    c = Cluster("nixl", dcp_size=2, item_lens=(8,) * 4, page_size=1, pages=8000, mode="packed",
                direction="push", timeout_s=TIMEOUT_S, pack_bytes=192128, seed=6)
    try:
        snd = c.sender
        real = snd.engine.check

        def check(h):
            for u in list(snd._inflight):
                if u.handle is h:
                    if u.req.rid == "A" and u.target.conn.spec.dcp_rank == 0:
                        return False  # hung
                    if u.req.rid.startswith("D") and time.monotonic() - u.clock < 0.2:
                        return False
            return real(h)

        snd.engine.check = check
        snd.timeout_s = TIMEOUT_S
        sa, da = c.tables(6002)  # rank 0's window: its whole arena share
        c.expect("A", da, 6002)
        sb, db = c.tables(1)
        c.expect("B", db, 1)
        snd.send("A", sa, 0, 6002)
        time.sleep(0.02)
        snd.send("B", sb, 0, 1)
        t0, k, ended = time.monotonic(), 0, None
        while time.monotonic() - t0 < 3.0:  # steady traffic over both ranks
            s, d = c.tables(4)
            c.expect(f"D{k}", d, 4)
            snd.send(f"D{k}", s, 0, 4)
            k += 1
            if ended is None and snd.poll("B").terminal and c.receivers[0].poll("B").terminal:
                ended = time.monotonic() - t0
            time.sleep(0.1)
        assert ended is not None and ended < 2.0, (ended, c.reasons("B"))
        assert snd.poll("A") is S.FAILED and snd.poll("B") is S.FAILED, c.reasons("B")
    finally:
        c.close()


@needs_mooncake
def test_a_pulling_rank_counts_its_own_long_read_as_progress(monkeypatch):
    # Found in a clean-clone CI run: a pulling rank with timeout_s=0.3 FAILED "no progress" while
    # its own READ was still moving, when the sender's ``moving`` word came late (one process, the
    # engine call holding the thread). Its own READ now holds the request for that READ's size
    # allowance, as the sender's batches do; here the sender says nothing at all.
    monkeypatch.setattr(_sender_endings.SenderEndings, "_tell_moving", lambda self, *a, **k: None)
    c = long_batch_cluster("pull")
    try:
        ship_one_long_batch(c)  # one READ longer than twice the rank's timeout_s: SUCCESS, byte-exact
        req = c.receivers[0]._requests["long"]
        assert req.moving_until == 0.0 and req.reading_until > 0.0
    finally:
        c.close()
