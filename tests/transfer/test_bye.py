"""A side that closes says ``bye``: its peers drop the connection at once, not after
``peer_timeout_s``; a decode position is held by one live receiver at a time (real engines)."""
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import _peer
from conftest import Cluster, TransferStatus
from dcp_jax.transfer import HandshakeError, KVReceiver

S = TransferStatus
LONG = 30.0  # peer_timeout_s far beyond every bound below: only a bye can explain a quick drop


def _until(cond, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _known(side, rid):
    try:
        side.poll(rid)
        return True
    except KeyError:
        return False


def _rank0_twin(c, engine, **kw):
    """A second receiver of the cluster's group at dcp_rank 0 (its own pages)."""
    spec = c.receivers[0].spec
    kv = [np.zeros((c.pages, c.page_size, il), np.uint8) for il in c.item_lens]
    return KVReceiver(spec, kv, engine=engine, timeout_s=20, peer_timeout_s=LONG, **kw), kv


def test_a_closed_receiver_leaves_the_sender_at_once(engine):
    c = Cluster(engine, dcp_size=2, peer_timeout_s=LONG)
    try:
        src, dst = c.tables(24)
        c.expect("a", dst, 24)
        assert _until(lambda: _known(c.sender, "a"), 5)  # the announcements arrived
        t0 = time.monotonic()
        c.receivers[0].close()
        assert _until(lambda: c.sender.stats["connections"] == 1, 5), c.sender.stats
        assert c.sender.poll("a") is S.FAILED
        assert time.monotonic() - t0 < 5 < LONG
        reason = c.sender.failure_reason("a")
        assert "receiver closed" in reason and "decode rank 0" in reason, reason
    finally:
        c.close()


def test_a_closed_sender_fails_the_receivers_at_once(engine):
    c = Cluster(engine, dcp_size=2, peer_timeout_s=LONG)
    try:
        _, dst = c.tables(24)
        c.expect("a", dst, 24)
        t0 = time.monotonic()
        c.sender.close()
        for r in c.receivers:
            assert _until(lambda: r.poll("a").terminal and r.stats["connections"] == 0, 5), r.stats
            assert r.poll("a") is S.FAILED
            assert "sender closed" in r.failure_reason("a"), r.failure_reason("a")
        assert time.monotonic() - t0 < 5 < LONG
        with pytest.raises(RuntimeError, match="sender closed"):  # expect() says why it has no sender
            c.receivers[0].expect("b", dst[0], 24)
    finally:
        c.close()


def test_a_second_live_receiver_at_a_position_is_refused(engine):
    """A misconfigured twin of decode rank 0 must not take the healthy rank's place: it is
    refused once the healthy one pinged on, and a request to the group still lands byte-exact.
    The healthy ranks ping every 1.5 s (live while heard within 3 s): the twin's engine start-up
    in this process can starve their pings for a second on a busy 2-core host (CI, 2026-12-07:
    at the default 0.5 s the twin once took the place as if rank 0 were silent)."""
    c = Cluster(engine, dcp_size=2, peer_timeout_s=LONG, receiver_kw={"heartbeat_s": 1.5})
    try:
        twin, _ = _rank0_twin(c, engine)
        with twin:
            t0 = time.monotonic()
            with pytest.raises(HandshakeError, match="dcp_rank 0, tp_rank 0 is held by the live receiver") as info:
                twin.connect(c.sender.address, timeout_s=10)
            assert info.value.field == "position"
            assert time.monotonic() - t0 < 5
        assert c.sender.stats["connections"] == 2 and c.receivers[0].stats["connections"] == 1
        c.round_trip("r", 40)
    finally:
        c.close()


def test_a_restarted_receiver_takes_the_position_of_the_closed_one(engine):
    c = Cluster(engine, dcp_size=2, peer_timeout_s=LONG)
    try:
        c.receivers[0].close()
        new, kv = _rank0_twin(c, engine)
        c.receivers[0], c.dst[0] = new, kv  # the cluster closes and checks it from now on
        t0 = time.monotonic()
        new.connect(c.sender.address, timeout_s=10)
        assert time.monotonic() - t0 < 5
        c.round_trip("r", 40)
        assert c.sender.stats["connections"] == 2
    finally:
        c.close()


def test_a_killed_receiver_gives_its_position_to_a_new_one_once_silent(engine):
    """No bye from a SIGKILLed rank: its replacement waits until the old connection is quiet
    (two of its ping intervals), well inside peer_timeout_s, then takes the position."""
    c = Cluster(engine, dcp_size=1, connect=False, peer_timeout_s=LONG)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_peer.receiver_main, args=(child, engine, c.sender.address, c.item_lens, c.page_size,
                                                      "k", 40, LONG), daemon=True)
    p.start()
    try:
        assert parent.poll(60) and parent.recv() == "ready"
        assert _until(lambda: _known(c.sender, "k"), 10)  # its announcement arrived
        os.kill(p.pid, signal.SIGKILL)
        spec = c.sender_spec
        kv = [np.zeros((64, c.page_size, il), np.uint8) for il in c.item_lens]
        with KVReceiver(spec, kv, engine=engine, timeout_s=20, peer_timeout_s=LONG) as new:
            t0 = time.monotonic()
            new.connect(c.sender.address, timeout_s=10)
            assert time.monotonic() - t0 < 5 < LONG
            assert c.sender.poll("k") is S.FAILED and "reconnected" in c.sender.failure_reason("k")
            assert c.sender.stats["connections"] == 1
    finally:
        p.kill()
        c.close()


def test_peers_list_the_live_connections_on_both_sides(engine):
    c = Cluster(engine, dcp_size=2, peer_timeout_s=LONG)
    try:
        got = c.sender.peers
        assert [(p["group"], p["dcp_rank"], p["tp_rank"]) for p in got] == [("default", 0, 0), ("default", 1, 0)]
        for p, r in zip(got, c.receivers):
            assert p["name"] == r.engine.name and p["direction"] == "push" and not p["staged"]
            assert p["path"] in ("direct", "packed", "region") and 0 <= p["silent_s"] < 5
            assert (p["heartbeat_s"], p["peer_timeout_s"]) == (r.heartbeat_s, LONG)
        for r in c.receivers:
            (link,) = r.peers
            assert (link["address"], link["name"]) == (c.sender.address, c.sender.engine.name)
            assert (link["dcp_rank"], link["tp_rank"], link["direction"]) == (0, 0, "push")
            assert link["path"] == got[0]["path"] and 0 <= link["silent_s"] < 5
        c.receivers[0].close()
        assert c.receivers[0].peers == []
        assert _until(lambda: [p["dcp_rank"] for p in c.sender.peers] == [1], 5), c.sender.peers
        c.sender.close()
        assert c.sender.peers == []
        assert _until(lambda: c.receivers[1].peers == [], 5)
    finally:
        c.close()


def test_a_closed_senders_requests_are_drained_at_once(engine):
    """The sender's bye comes after its engine's close and says so (drained): the ranks may give
    the pages of its failed requests to new ones at once, not after drain_grace_s."""
    c = Cluster(engine, dcp_size=2, peer_timeout_s=LONG)
    try:
        _, dst = c.tables(24)
        c.expect("a", dst, 24)
        assert _until(lambda: _known(c.sender, "a"), 5)
        c.sender.close()
        for r in c.receivers:
            assert _until(lambda: r.poll("a").terminal and r.is_drained("a"), 5), (r.poll("a"), r.stats)
            assert r.drain_grace_s >= 2 * LONG  # the default: far beyond the wait above
    finally:
        c.close()


def test_a_receiver_closed_mid_request_holds_its_pages_for_the_grace(engine):
    """Closing this side's engine does not stop a push sender's WRITEs already posted (NIXL over
    loopback still landed rows after close), so a request live at the close is not drained
    until drain_grace_s has passed, and the receive region is freed only then."""
    c = Cluster(engine, dcp_size=2, peer_timeout_s=LONG, receiver_kw=dict(drain_grace_s=1.5))
    try:
        _, dst = c.tables(24)
        c.expect("a", dst, 24)
        c.expect("done", *c.tables(8)[1:], 8, 8)  # a full prefix hit: SUCCESS, nothing to write
        r = c.receivers[0]
        assert _until(lambda: r.poll("done") is S.SUCCESS, 5)
        region = r._region
        r.close()
        assert r.poll("a") is S.FAILED and not r.is_drained("a") and r.is_drained("done")
        assert region.buffer is not None or region.nbytes == 0  # kept while a write may land
        assert _until(lambda: r.is_drained("a"), 5)
        assert _until(lambda: region.buffer is None, 5)
    finally:
        c.close()


def test_a_rank_announcing_a_released_request_late_hears_how_it_ended(engine):
    # Before: the prefill's release forgot the id, the late announcement started a new request
    # nobody sends, and the rank waited timeout_s for it ("no progress").
    c = Cluster(engine, dcp_size=2, timeout_s=20.0, peer_timeout_s=LONG)
    try:
        src, dst = c.tables(16)
        c.sender.send("a", src, 0, 16)
        assert c.sender.abort("a", "cancelled by the router")
        c.sender.release("a")  # before either rank announced it
        c.expect("a", dst, 16)
        for r in c.receivers:
            assert r.wait("a", 5) is S.ABORTED, r.failure_reason("a")
            assert "cancelled by the router" in r.failure_reason("a")
            assert _until(lambda: r.is_drained("a"), 5)
            r.release("a")
        c.receivers[0].expect("a", dst[0], 16)  # the id's next use, announced before the prefill sends
        c.receivers[1].expect("a", dst[1], 16)
        c.sender.send("a", src, 0, 16)
        assert c.wait("a") == [S.SUCCESS] * 3, c.reasons("a")
        assert c.check_bytes(src, dst, 16) == 16
    finally:
        c.close()


def test_a_rank_that_closes_right_after_its_success_does_not_fail_the_sender(engine):
    """A rank with every row closes at once (a vLLM consumer that got its KV): its bye can come
    before the sender polled the engine's completion of its last WRITE. The sender drops the
    connection only once no WRITE to it is in flight, so the request ends SUCCESS there too."""
    for k in range(3):
        c = Cluster(engine, dcp_size=2, peer_timeout_s=LONG, mode="direct")
        try:
            src, dst = c.tables(64)
            c.expect("a", dst, 64)
            c.sender.send("a", src, 0, 64)
            for r in c.receivers:
                assert r.wait("a", 10) is S.SUCCESS, r.failure_reason("a")
                r.close()
            assert c.sender.wait("a", 10) is S.SUCCESS, c.sender.failure_reason("a")
            assert c.sender.stats["failed"] == 0
        finally:
            c.close()
