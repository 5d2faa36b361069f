"""Faults between two hosts (network namespaces), real processes, real engines over the veth.

Each test: its own namespaces, a sender process on host 0 and receiver processes on host 1 (and
2), then a fault (the link down, a process SIGKILLed or SIGSTOPped), what each side reports and
how fast, and that the next request on the same processes (or on the restarted one) lands
byte-exact with every other page still the sentinel.
"""
import os
import signal
import time

import numpy as np
import pytest

from conftest import ITEM_LENS, PAGE, pages_for, roundtrip, wait_for
from dcp_jax.netns import Hosts
from dcp_jax.netns.agents import Agent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

GEO = dict(item_lens=ITEM_LENS, page_size=PAGE)


def _pair(h, engine, *, s_kw=(), r_kw=(), on=1):
    sender = Agent(h, 0, "sender", engine=engine, host=h.addr(0, on), **GEO, **dict(s_kw))
    recv = Agent(h, on, "receiver", engine=engine, host=h.addr(on), **GEO, **dict(r_kw))
    recv.call("connect", sender.hello)
    return sender, recv


def test_link_down_mid_request_fails_both_sides_then_the_next_request_succeeds(engine):
    timeout_s = 3.0
    with Hosts(2) as h:
        # Request timeout < link outage < peer timeout: the request fails, the connection lives.
        kw = dict(timeout_s=timeout_s, peer_timeout_s=20.0)
        sender, recv = _pair(h, engine, s_kw=kw, r_kw=kw)
        roundtrip(sender, recv, "warm", 40)
        n = 160
        recv.call("expect", "cut", np.arange(pages_for(n)), n)
        sender.call("send", "cut", np.arange(pages_for(n)), 0, 80)  # the first half lands
        assert wait_for(lambda: recv.call("stats")["bytes"] > 0, 10.0)
        h.link_down(1)
        t0 = time.monotonic()
        sender.call("send", "cut", np.arange(pages_for(n)), 80, n)  # the rest cannot move
        s = sender.call("wait", "cut", 20.0)
        r = recv.call("wait", "cut", 20.0)
        took = time.monotonic() - t0
        assert (s[0], r[0]) == ("FAILED", "FAILED"), (s, r)
        assert "no progress" in s[1] and "no progress" in r[1], (s, r)
        assert took < timeout_s + 3.0, took  # within the timeout (+ the 50 ms scan, + polling)
        # Nothing was reported landed beyond what arrived: half of the rows at most.
        assert recv.call("stats")["bytes"] <= (40 + 80) * sum(ITEM_LENS)
        h.link_up(1)
        # The stuck batch ends (the engine delivers or fails it) and both sides say drained.
        assert sender.call("wait_drained", "cut", 30.0) and recv.call("wait_drained", "cut", 30.0)
        for side in (sender, recv):
            side.call("release", "cut")
        recv.call("clear", list(range(pages_for(n))))
        roundtrip(sender, recv, "after", 60)  # no restart, same connection
        assert sender.call("stats")["connections"] == 1 and recv.call("stats")["connections"] == 1
        sender.close(), recv.close()


def test_receiver_killed_and_restarted_with_the_same_name(engine):
    with Hosts(2) as h:
        kw = dict(timeout_s=10.0, peer_timeout_s=2.0)
        sender, recv = _pair(h, engine, s_kw=kw, r_kw=dict(kw, group="decode-a"))
        roundtrip(sender, recv, "before", 33)
        recv.call("expect", "r1", np.arange(10), 40)
        assert wait_for(lambda: sender.call("stats")["live_requests"] == 1, 5.0)
        recv.kill()  # SIGKILL: no goodbye, its engine metadata goes stale at the sender
        t0 = time.monotonic()
        s = sender.call("wait", "r1", 15.0)
        assert s[0] == "FAILED" and time.monotonic() - t0 < 2.0 + 2.0, s
        # The same decode rank of the same group, restarted: the sender serves its new memory.
        again = Agent(h, 1, "receiver", engine=engine, host=h.addr(1), group="decode-a", **kw, **GEO)
        again.call("connect", sender.hello)
        sender.call("release", "r1")
        roundtrip(sender, again, "r1", 40)  # the same request id, the new incarnation
        roundtrip(sender, again, "r2", 77)
        st = sender.call("stats")
        assert st["connections"] == 1 and st["handshakes"] == 2, st
        assert any("decode rank 0" in ln for ln in sender.call("logs"))
        again.close(), sender.close()


def test_sender_killed_mid_request_then_restarted(nixl_only):
    engine = nixl_only
    with Hosts(2) as h:
        kw = dict(timeout_s=10.0, peer_timeout_s=2.0)
        sender, recv = _pair(h, engine, s_kw=kw, r_kw=dict(kw, drain_grace_s=3.0))
        port = int(sender.hello.rsplit(":", 1)[1])
        recv.call("expect", "m", np.arange(10), 40)
        sender.call("send", "m", np.arange(10), 0, 20)  # one chunk of two
        sender.kill()
        t0 = time.monotonic()
        r = recv.call("wait", "m", 15.0)
        assert r[0] == "FAILED" and "silent" in r[1] and time.monotonic() - t0 < 2.0 + 2.0, r
        # A sender dropped as silent may only be stopped: its pages stay held ("in doubt") until
        # it reconnects or drain_grace_s passes (a killed one never reconnects).
        assert not recv.call("is_drained", "m")
        assert recv.call("wait_drained", "m", 3.0 + 3.0)
        recv.call("release", "m")
        recv.call("clear", list(range(10)))
        # A new sender process on the same address; the receiver connects to it again.
        again = Agent(h, 0, "sender", engine=engine, host=h.addr(0, 1), port=port, **kw, **GEO)
        assert again.hello == sender.hello
        recv.call("connect", again.hello)
        roundtrip(again, recv, "m", 40)
        assert recv.call("stats")["connections"] == 1
        recv.close(), again.close()


# The stopped rank's batch must not be able to complete while it is stopped. Over TCP (the hosts'
# UCX_TLS; CMA would write into a stopped process) the bytes need the stopped receiver, but a
# request that fits the socket buffers (~4 MiB) can still land: 8 KiB rows (128 x GEO's) make
# its request 16 MiB.
_STOPPED_GEO = dict(item_lens=tuple(128 * il for il in ITEM_LENS), page_size=PAGE)


def _stopped_setup(h, engine, mode, peer_timeout_s, chunks=1):
    # Packed mode goes through an 8 MiB arena, which the stopped rank's windows fill. The stopped
    # rank's 2,048-token request (16 MiB of rows: twice the arena) is sent in ``chunks`` calls.
    sender = Agent(h, 0, "sender", engine=engine, host=h.addr(0, 1), mode=mode, pack_bytes=8 << 20,
                   timeout_s=30.0, peer_timeout_s=peer_timeout_s, pages=512, **_STOPPED_GEO)
    slow = Agent(h, 1, "receiver", engine=engine, host=h.addr(1), group="slow", pages=512,
                 peer_timeout_s=peer_timeout_s, **_STOPPED_GEO)
    fast = Agent(h, 2, "receiver", engine=engine, host=h.addr(2), group="fast", pages=512,
                 peer_timeout_s=peer_timeout_s, **_STOPPED_GEO)
    for r in (slow, fast):
        r.call("connect", sender.hello)
    n = 2048
    slow.call("expect", "big", np.arange(pages_for(n)), n)
    assert wait_for(lambda: sender.call("stats")["live_requests"] == 1, 5.0)
    os.kill(slow.proc.pid, signal.SIGSTOP)
    step = n // chunks
    for k in range(chunks):
        sender.call("send", "big", np.arange(pages_for(n)), k * step, (k + 1) * step)
    return sender, slow, fast


def test_stopped_receiver_does_not_block_other_receivers(engine):
    # A decode rank SIGSTOPped with a request in flight: the other group's requests go through
    # meanwhile, the stopped rank's request FAILS when it is dropped as silent. (Mooncake: the
    # first batch to a peer used to open its segment, a handshake RPC under an engine-wide lock,
    # so a first batch to the stopped rank blocked every peer; `MooncakeEngine.add_peer` opens it.)
    peer_timeout_s = 3.0
    with Hosts(3) as h:
        sender, slow, fast = _stopped_setup(h, engine, "direct", peer_timeout_s)
        try:
            t0 = time.monotonic()
            for k in range(3):
                roundtrip(sender, fast, f"fast-{k}", 50, src_pages=512, timeout_s=15.0)
            took = time.monotonic() - t0
            s = sender.call("wait", "big", 20.0)
        finally:
            os.kill(slow.proc.pid, signal.SIGCONT)
        assert s[0] == "FAILED" and "silent" in s[1], s
        assert took < peer_timeout_s, took  # not held up by the stopped rank at all
        assert sender.call("stats")["worker_errors"] == 0
        for a in (fast, slow, sender):
            a.close()


def test_stopped_receiver_holds_at_most_its_share_of_the_packed_arena(nixl_only):
    engine = nixl_only
    # Packed mode: windows in flight to a stopped rank keep their pack regions (quarantined once
    # the rank is dropped: the engine never reports those batches done while the peer's process
    # is stopped). A rank already holding regions gets no more than half the arena
    # (`_sender_units.ARENA_SHARE`), so the other rank's request passes while this one is stopped.
    peer_timeout_s = 2.0
    with Hosts(3) as h:
        # 8 chunks of 2 MiB of rows (one window each)
        sender, slow, fast = _stopped_setup(h, engine, "packed", peer_timeout_s, chunks=8)
        try:
            assert wait_for(lambda: sender.call("stats")["arena"]["in_use_bytes"] > 0, 5.0)
            held = sender.call("stats")["arena"]
            assert held["in_use_bytes"] <= held["capacity"] // 2, held
            t0 = time.monotonic()
            fast.call("expect", "queued", np.arange(13), 50)
            sender.call("send", "queued", np.arange(13), 0, 50)
            s = sender.call("wait", "queued", 20.0)
            r = fast.call("wait", "queued", 20.0)
            took = time.monotonic() - t0
            assert (s[0], r[0]) == ("SUCCESS", "SUCCESS"), (s, r)
            assert sender.call("poll", "big") != "SUCCESS"
            assert took < peer_timeout_s, took  # while the slow rank is still stopped
            assert fast.call("check", np.arange(13), np.arange(13), 50, 1, 512) == dict(rows=50, bad_rows=0)
            assert fast.call("sentinel_ok", list(range(13)))
            assert sender.call("wait", "big", 15.0)[0] == "FAILED"
        finally:
            os.kill(slow.proc.pid, signal.SIGCONT)
        slow.kill()  # the stopped process dies: its connections close, the batch ends
        assert sender.call("wait_drained", "big", 10.0)
        arena = sender.call("stats")["arena"]
        assert arena["quarantined_bytes"] == 0 and arena["free_bytes"] == arena["capacity"], arena
        for a in (fast, sender):
            a.close()
