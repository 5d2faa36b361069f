"""Late writes after a silent drop: a SIGSTOPped push sender, resumed after its receiver dropped it.

The receiver drops a sender it has not heard from for ``peer_timeout_s``, fails its requests and
(the sender being gone as far as it knows) lets their pages be reused. A sender that was only
*stopped* (SIGSTOP, a long GC pause, a VM stall) resumes with windows still queued and the
receiver's old pings still unread in its socket: it must not post one more write into those pages.
What the test measures: after the receiver's drop its pages are wiped back to the sentinel (reused,
as far as the test can tell), the sender resumes, and no byte of any page (guard pages included)
changes afterwards.
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
            stopped = time.monotonic()
            r = recv.call("wait", "a", 15.0)
            assert r[0] == "FAILED" and "silent" in r[1], r
            assert recv.call("wait_drained", "a", 5.0)  # the receiver counts the sender as gone
            landed = recv.call("stats")["bytes"] - warm
            assert landed < n * ROW, "the request completed before the stop: nothing to test"
            time.sleep(0.5)  # writes posted before the stop that were going to land have landed
            recv.call("release", "a")
            recv.call("clear", list(range(pages)))  # the pages are reused: back to the sentinel
            time.sleep(max(0.0, 2 * peer_timeout_s - (time.monotonic() - stopped)))
            os.kill(sender.proc.pid, signal.SIGCONT)
            s = sender.call("wait", "a", 15.0)
            assert s[0] == "FAILED", s
            time.sleep(1.5)  # anything the resumed sender posts lands within this
            foreign = recv.call("foreign_rows", [])
            print("LATE", engine, "foreign rows", foreign, "sender", s, "landed before", landed // ROW,
                  {k: v for k, v in sender.call("stats").items() if k in ("stalls", "connections", "batches")})
            # Nothing was posted after the resume. What the engine had taken before the stop may
            # still land (NIXL measured: one 32-row window, 64 rows of 2 layers, in some runs): at
            # most the pack arena's worth, the windows in flight. That residue needs the receiver to
            # hold a dropped live sender's pages until it reconnects (README, "not met").
            assert foreign <= 32 * len(ITEM_LENS), f"the resumed sender wrote {foreign} rows into pages given back"
            st = sender.call("stats")
            # The resumed worker dropped the connection before posting anything: it saw its own
            # stall, or (stopped inside a round, past that check) the receiver silent.
            assert st["connections"] == 0 and ("stalled" in s[1] or "silent" in s[1]), (s, st)
            assert sender.call("wait_drained", "a", 10.0)
            # Both sides come back: the receiver connects again and the next request is byte-exact.
            sender.call("release", "a")
            assert wait_for(lambda: sender.call("stats")["connections"] == 0, 10.0)
            recv.call("connect", sender.hello)
            roundtrip(sender, recv, "after", 60, src_pages=pages)
            assert sender.call("stats")["worker_errors"] == 0
        finally:
            try:
                os.kill(sender.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            for a in (recv, sender):
                a.close()
