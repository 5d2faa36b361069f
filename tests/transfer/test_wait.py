"""`KVSender.wait` / `KVReceiver.wait`: block until the request ends (woken by the worker, no
polling), or until the timeout; argument checks."""
import threading
import time

import numpy as np
import pytest

from conftest import TransferStatus
from dcp_jax.transfer.status import RequestState
from test_region import cluster

S = TransferStatus


def test_request_state_wait_wakes_at_the_terminal_move():
    st = RequestState()
    t0 = time.perf_counter()
    assert st.wait(0.05) is S.WAITING and time.perf_counter() - t0 >= 0.05  # the timeout, not earlier
    threading.Timer(0.05, lambda: (st.advance(S.TRANSFERRING), st.advance(S.FAILED, "x"))).start()
    t0 = time.perf_counter()
    assert st.wait(10.0) is S.FAILED
    assert time.perf_counter() - t0 < 5.0 and st.reason == "x"
    assert st.wait(10.0) is S.FAILED  # already ended: at once


def test_both_sides_wait_until_their_request_ended(engine):
    c = cluster(engine, dcp_size=2, mode="packed")
    try:
        src, dst = c.tables(21)
        c.expect("w", dst, 21)
        assert c.receivers[0].wait("w", 0.02) is S.WAITING  # nothing sent yet: the timeout
        ends = {}

        def waiter(name, side):
            ends[name] = side.wait("w", 30.0)

        threads = [threading.Thread(target=waiter, args=(f"r{k}", r)) for k, r in enumerate(c.receivers)]
        for t in threads:
            t.start()
        c.sender.send("w", src, 0, 21)  # the sender knows the request from here on
        threads.append(threading.Thread(target=waiter, args=("s", c.sender)))
        threads[-1].start()
        for t in threads:
            t.join(30.0)
        assert ends == {"s": S.SUCCESS, "r0": S.SUCCESS, "r1": S.SUCCESS}
        assert c.check_bytes(src, dst, 21) == 21
    finally:
        c.close()


def test_wait_refuses_bad_timeouts_and_unknown_requests(engine):
    c = cluster(engine, dcp_size=1, mode="packed")
    try:
        for side in (c.sender, c.receivers[0]):
            with pytest.raises(KeyError, match="nope"):
                side.wait("nope", 1.0)
        src, dst = c.tables(5)
        c.expect("b", dst, 5)
        assert c.receivers[0].wait("b", 0) is S.WAITING  # 0: answers at once, as poll
        assert c.receivers[0].wait("b", np.float32(0.01)) is S.WAITING  # numpy scalars are seconds too
        for bad, exc in [(-1.0, ValueError), (86401, ValueError), (True, TypeError), (float("nan"), ValueError), ("1", TypeError),
                         (None, TypeError)]:
            with pytest.raises(exc, match="timeout_s"):
                c.receivers[0].wait("b", bad)
    finally:
        c.close()
