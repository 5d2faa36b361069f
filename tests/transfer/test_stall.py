"""A sender whose worker stood still drops exactly the connections whose receivers may have
dropped it meanwhile, by each receiver's own ``peer_timeout_s`` (real engines)."""
import time

from conftest import Cluster, TransferStatus
from dcp_jax.transfer import KVReceiver

S = TransferStatus


def _ranks(sender, rid):
    try:
        return sender.request_stats(rid)["ranks"]
    except KeyError:  # not announced yet
        return {}


def test_a_stall_drops_only_the_receivers_with_a_shorter_peer_timeout(engine):
    # Before: the limit came from the sender's own peer_timeout_s (9.25 s here), so a stop of
    # 1.7 s went unnoticed although rank 1 (peer_timeout_s 2 s, heartbeat 0.5 s: limit 1.25 s)
    # may have dropped it and reused its pages, and the sender went on posting into them.
    c = Cluster(engine, dcp_size=2, peer_timeout_s=10.0, connect=False)
    try:
        c.receivers[0].connect(c.sender.address)
        spec = c.receivers[1].spec
        c.receivers[1].close()
        c.receivers[1] = KVReceiver(spec, c.dst[1], engine=engine, timeout_s=20, peer_timeout_s=2.0)
        c.receivers[1].connect(c.sender.address)
        src, dst = c.tables(24)
        c.expect("a", dst, 24)
        deadline = time.monotonic() + 5  # both announcements arrived (before the stop)
        while len(_ranks(c.sender, "a")) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with c.sender._lock:  # the worker stands still (as under SIGSTOP) for 1.7 s: 1.25 < 1.7 < 2.0
            time.sleep(1.7)
        deadline = time.monotonic() + 5
        while c.sender.stats["connections"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        st = c.sender.stats
        assert (st["stalls"], st["connections"]) == (1, 1), st
        assert c.sender.poll("a") is S.FAILED
        assert "may have dropped it as silent" in c.sender.failure_reason("a")
        assert c.receivers[0].stats["connections"] == 1  # the long-timeout rank keeps its link
        # Rank 1 heard the bye: it connects again, and a new request lands on both, byte-exact.
        deadline = time.monotonic() + 5
        while c.receivers[1].stats["connections"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.receivers[1].poll("a") is S.FAILED, c.reasons("a")
        c.receivers[1].connect(c.sender.address)
        c.round_trip("b", 40)
    finally:
        c.close()
