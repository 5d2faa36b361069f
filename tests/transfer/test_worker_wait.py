"""The worker's sub-millisecond waits between engine polls (`Worker._wait_fraction`) end when a
control message arrives, not when the sleep would have: a peer's ``region_ask`` / ``region_grant``
is answered without waiting out the backoff. Real zmq sockets; generous bounds (loaded CI host)."""

import threading
import time
import uuid

import zmq

from dcp_jax.transfer._worker import Worker
from dcp_jax.transfer.control import zmq_context

LONG_S = 0.6  # far longer than any real fraction (< 1 ms): an early return is unmistakable


def _pair():
    addr = f"inproc://worker-wait-{uuid.uuid4().hex}"
    rx = zmq_context().socket(zmq.PULL)
    rx.setsockopt(zmq.LINGER, 0)
    rx.bind(addr)
    tx = zmq_context().socket(zmq.PUSH)
    tx.setsockopt(zmq.LINGER, 0)
    tx.connect(addr)
    return rx, tx


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_the_wait_ends_on_a_control_message_queued_before_or_arriving_during_it():
    rx, tx = _pair()
    w = Worker("wait-test", lambda: 0, rx)  # never started: this thread owns the sockets
    try:
        assert _timed(lambda: w._wait_fraction(0.05)) >= 0.04  # nothing arrives: the whole wait
        tx.send(b"ask")
        assert _timed(lambda: w._wait_fraction(LONG_S)) < LONG_S / 3  # queued already: no wait
        assert rx.recv() == b"ask"
        later = threading.Timer(0.05, lambda: tx.send(b"grant"))
        later.start()
        took = _timed(lambda: w._wait_fraction(LONG_S))
        later.join()
        assert 0.03 < took < LONG_S / 2, took  # woken by the message, not the timeout
        assert rx.recv() == b"grant"
        w.wake()  # the worker's own wake socket counts too
        assert _timed(lambda: w._wait_fraction(LONG_S)) < LONG_S / 3
    finally:
        w.stop(1.0)
        rx.close(0)
        tx.close(0)
