"""The control plane's refusal log goes quiet after MAX_LOGGED_REJECTIONS per socket: a peer
sending garbage (a client pointed at some other TCP service, or a scanner) must not flood the
serving process's log, while every refusal is still counted."""
import logging
import time

import zmq

from dcp_jax.transfer.control import MAX_LOGGED_REJECTIONS, ControlServer, zmq_context


def test_garbage_frames_are_all_counted_and_only_the_first_few_logged(caplog):
    server = ControlServer("127.0.0.1", 0)
    peer = zmq_context().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    try:
        peer.connect(server.address)
        n = 5 * MAX_LOGGED_REJECTIONS
        for k in range(n):
            peer.send(b"\xc1not msgpack %d" % k)  # 0xc1 is never valid msgpack
        got, deadline = [], time.monotonic() + 10
        with caplog.at_level(logging.WARNING, logger="dcp_jax.transfer.control"):
            while server.rejected < n and time.monotonic() < deadline:
                got += server.recv()
                time.sleep(0.01)
        assert got == [] and server.rejected == n
        logged = [r for r in caplog.records if "refused a frame" in r.getMessage()]
        assert len(logged) == MAX_LOGGED_REJECTIONS <= 10
        assert "further refusals are counted, not logged" in logged[-1].getMessage()
    finally:
        peer.close(0)
        server.close()
