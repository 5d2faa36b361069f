"""Late writes after a silent drop: a SIGSTOPped push sender, resumed after its receiver dropped it.

The receiver drops a sender it has not heard from for ``peer_timeout_s`` and fails its requests.
A sender that was only *stopped* (SIGSTOP, a long pause, a VM stall) resumes with windows still
queued, and the engine may still move a window it had taken before the stop (measured on NIXL
before the fix: 64 rows landed after the pages had been wiped). What holds now: the resumed sender
posts nothing more (it sees its own stall and drops every connection); the receiver keeps the
dropped sender "in doubt" (its requests not drained) until it reconnects, which the sender answers
only once no write of the old connection is in flight; after that, no byte of any page (guard
pages included) changes.
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
ROW = sum(ITEM_LENS)


def test_resumed_sender_writes_nothing_into_pages_its_receiver_gave_back(engine):
    peer_timeout_s = 2.0
    n = 4096  # 1,024 pages; a 2 KiB arena holds one 32-row window: ~128 windows, one at a time
    pages = pages_for(n)
    with Hosts(2) as h:
        sender = Agent(h, 0, "sender", engine=engine, host=h.addr(0, 1), mode="packed", pack_bytes=32 * ROW,
                       timeout_s=20.0, peer_timeout_s=peer_timeout_s, pages=pages, **GEO)
        recv = Agent(h, 1, "receiver", engine=engine, host=h.addr(1), pages=pages, timeout_s=20.0,
                     peer_timeout_s=peer_timeout_s, **GEO)
        try:
            recv.call("connect", sender.hello)
            roundtrip(sender, recv, "warm", 40, src_pages=pages)
            warm = recv.call("stats")["bytes"]
            recv.call("expect", "a", np.arange(pages), n)
            assert wait_for(lambda: sender.call("stats")["live_requests"] == 1, 5.0)
            sender.call("send", "a", np.arange(pages), 0, n)
            # A few windows landed (the transfer is under way), most are still to come.
            assert wait_for(lambda: recv.call("stats")["bytes"] >= warm + 4 * 32 * ROW, 10.0, every=0.002)
            os.kill(sender.proc.pid, signal.SIGSTOP)  # windows in flight and many still queued
            r = recv.call("wait", "a", 15.0)
            assert r[0] == "FAILED" and "silent" in r[1], r
            landed = recv.call("stats")["bytes"] - warm
            assert landed < n * ROW, "the request completed before the stop: nothing to test"
            # A sender dropped as silent may only be stopped: its pages stay held ("in doubt").
            time.sleep(2 * peer_timeout_s)
            assert not recv.call("is_drained", "a")
            os.kill(sender.proc.pid, signal.SIGCONT)
            s = sender.call("wait", "a", 15.0)
            st = sender.call("stats")
            # The resumed worker dropped the connection before posting anything: it saw its own
            # stall, or (stopped inside a round, past that check) the receiver silent.
            assert st["connections"] == 0 and ("stalled" in s[1] or "silent" in s[1]), (s, st)
            # The receiver connects again: the sender answers once no write of the old connection
            # is in flight, and only then are the old request's pages given back.
            recv.call("connect", sender.hello)
            assert recv.call("is_drained", "a")
            assert sender.call("wait_drained", "a", 10.0)
            recv.call("release", "a")
            sender.call("release", "a")
            recv.call("clear", list(range(pages)))  # the pages are reused: back to the sentinel
            time.sleep(1.5)  # a late write of the old connection would land within this
            foreign = recv.call("foreign_rows", [])
            print("LATE", engine, "foreign rows", foreign, "sender", s, "landed before", landed // ROW,
                  {k: v for k, v in st.items() if k in ("stalls", "held_hellos", "batches")})
            assert foreign == 0, f"{foreign} rows written into pages given back after the drop"
            roundtrip(sender, recv, "after", 60, src_pages=pages)
            assert sender.call("stats")["worker_errors"] == 0
        finally:
            try:
                os.kill(sender.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            for a in (recv, sender):
                a.close()
