"""Hostile hellos and frames whose handling fails: each is refused or counted on its own, and
the frames read in the same batch (another receiver's announcement, an abort) and the rest of
the round still run. Real NIXL over loopback; the attacker is a bare DEALER socket.

Frames are forced into one batch by holding a side's lock: its worker blocks before (receiver)
or after (sender, on the first frame of its `recv`) reading, and the frames queue meanwhile."""
import logging
import multiprocessing as mp
import os
import time

import msgpack
import pytest
import zmq

import _peer
from bridge.nixl import nixl_available
from conftest import Cluster, TransferStatus
from dcp_jax.transfer import KVCacheSpec, check_compatible
from dcp_jax.transfer import _worker
from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer.control import _hello_of_another_version
from dcp_jax.transfer.spec import MAX_TP_SIZE
from dcp_jax.transfer.views import served_group_ranks, stream_view

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL (the engine these tests use) is not installed")
S = TransferStatus
SPEC = KVCacheSpec(2, (48, 16), 4)


def frame(kind, **fields):
    """A raw frame of this protocol version, fields as given (no schema check on the way out)."""
    return msgpack.packb({"v": proto.PROTOCOL_VERSION, "k": kind, "rid": "", "inc": 0, **fields}, use_bin_type=True)


def hello(spec=None, **over):
    """A hello that passes the schema: ``peer`` ({}) is no engine's metadata."""
    fields = dict(spec=(spec or SPEC.to_dict()), peer={}, group="g", direction="push", name="evil",
                  layer_bases=proto.pack_i64([0, 0]), region_addr=0, region_bytes=0, mem="DRAM", ipc=[],
                  host={}, heartbeat_ms=500, peer_timeout_ms=5000, staged=False, num_pages=16)
    return frame("hello", **{**fields, **over})


def attacker(address):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    time.sleep(0.2)  # connected before the first frame
    return s


def nacks(sock, count, timeout_s):
    """The first ``count`` hello_nack frames ``sock`` gets within ``timeout_s`` (fewer on timeout)."""
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < count and sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        msg = proto.decode(sock.recv())
        if msg["k"] == "hello_nack":
            out.append(msg)
    return out


def in_one_sender_batch(c, evil, *frames, then):
    """``frames`` from ``evil`` and ``then()`` (a healthy receiver's frames) in one `recv` of the
    sender: a ping first makes its worker read and then block on the lock while the rest queue."""
    with c.sender._lock:
        evil.send(frame("ping"))
        time.sleep(0.2)
        for f in frames:
            evil.send(f)
        then()
        time.sleep(0.3)


def test_a_bad_peer_hello_is_refused_and_costs_its_batch_nothing():
    c = Cluster("nixl", dcp_size=1, timeout_s=3)
    evil = attacker(c.sender.address)
    try:
        src, dst = c.tables(16)
        in_one_sender_batch(c, evil, hello(), then=lambda: c.expect("req", dst, 16))
        c.sender.send("req", src, 0, 16)
        assert c.wait("req", 10) == [S.SUCCESS] * 2, c.reasons("req")
        assert c.check_bytes(src, dst, 16) == 16
        got = nacks(evil, 2, 3)  # "connection" for the ping, then the hello's
        assert [m["field"] for m in got] == ["connection", "peer"], got
        assert "engine metadata" in got[1]["message"]
        assert c.sender.stats["worker_errors"] == 0 and c.sender.stats["handshakes_refused"] >= 1
        c.round_trip("next", 8)
    finally:
        evil.close(0)
        c.close()


def test_a_frame_whose_handling_fails_is_counted_not_the_batch_lost(caplog):
    c = Cluster("nixl", dcp_size=1, timeout_s=3)
    evil = attacker(c.sender.address)
    on_hello = c.sender._on_hello

    def failing(ident, msg):  # a handler bug, reached by the attacker's hellos only
        if msg["name"] == "evil":
            raise RuntimeError("handler bug")
        return on_hello(ident, msg)

    c.sender._on_hello = failing
    try:
        src, dst = c.tables(16)
        with caplog.at_level(logging.ERROR, logger=_worker.logger.name):
            in_one_sender_batch(c, evil, *[hello()] * 30, then=lambda: c.expect("req", dst, 16))
            c.sender.send("req", src, 0, 16)
            assert c.wait("req", 10) == [S.SUCCESS] * 2, c.reasons("req")
            got = nacks(evil, 31, 5)
        assert c.check_bytes(src, dst, 16) == 16
        assert [m["field"] for m in got] == ["connection"] + ["hello"] * 30, got
        assert "handler bug" in got[1]["message"]
        assert c.sender.stats["worker_errors"] == 30
        # Rate-limited: tracebacks for the first few, then at most a line a minute.
        logged = [r for r in caplog.records if r.name == _worker.logger.name]
        assert len(logged) <= _worker.MAX_LOGGED_ERRORS + 1, len(logged)
        c.round_trip("next", 8)
    finally:
        evil.close(0)
        c.close()


def test_a_receiver_frame_whose_handling_fails_does_not_lose_the_next_one():
    c = Cluster("nixl", dcp_size=1, timeout_s=5)
    r = c.receivers[0]
    try:
        src, dst = c.tables(16)
        c.expect("a", dst, 16)
        deadline = time.monotonic() + 5
        while "a" not in c.sender._requests and time.monotonic() < deadline:
            time.sleep(0.01)
        on_message = r._on_message

        def failing(link, msg):  # a handler bug on the sender's pings
            if msg["k"] == "ping":
                raise RuntimeError("handler bug")
            return on_message(link, msg)

        r._on_message = failing
        with r._lock:  # the worker blocks before reading: a ping (every 0.5 s), then the abort, queue
            time.sleep(0.8)
            assert c.sender.abort("a")
            time.sleep(0.3)
        assert r.wait("a", 3) is S.ABORTED, r.failure_reason("a")
        assert r.stats["worker_errors"] >= 1
    finally:
        c.close()


def _rss(pid):
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.timeout(120)
def test_a_hello_with_a_huge_tp_size_is_refused_at_once():
    # The sender runs in a child: were the bound missing, its worker would grow until killed here.
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_peer.sender_main, args=(theirs, "nixl", (48, 16), 4, 5.0), daemon=True)
    proc.start()
    evil = None
    try:
        assert ours.poll(60), "the sender did not start"
        evil = attacker(ours.recv())
        rss0, peak = _rss(proc.pid), 0
        t0 = time.monotonic()
        evil.send(hello(dict(SPEC.to_dict(), tp_size=2 ** 40)))
        while not evil.poll(20) and time.monotonic() - t0 < 2:
            peak = max(peak, _rss(proc.pid) - rss0)
            if peak > 1 << 30:
                break
        took = time.monotonic() - t0
        peak = max(peak, _rss(proc.pid) - rss0)
        assert peak < 200 << 20, f"the sender grew by {peak >> 20} MiB"
        got = nacks(evil, 1, 0.1)
        assert got and took < 2, f"no answer in {took:.1f} s"
        assert got[0]["field"] == "spec" and "tp_size" in got[0]["message"], got
        evil.send(hello())  # the sender lives on: the next hello is answered too
        assert [m["field"] for m in nacks(evil, 1, 2)] == ["peer"]
    finally:
        if evil is not None:
            evil.close(0)
        proc.kill()
        proc.join(10)


def test_tp_size_is_bounded():
    assert KVCacheSpec(1, (16,), 4, tp_size=MAX_TP_SIZE, tp_rank=MAX_TP_SIZE - 1).tp_size == MAX_TP_SIZE
    with pytest.raises(ValueError, match=f"tp_size={MAX_TP_SIZE + 1} must be <= {MAX_TP_SIZE}"):
        KVCacheSpec(1, (16,), 4, tp_size=MAX_TP_SIZE + 1)
    with pytest.raises(ValueError, match="tp_size"):
        KVCacheSpec.from_dict(dict(SPEC.to_dict(), tp_size=2 ** 40))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("heads", [1, 8, MAX_TP_SIZE])
def test_a_pair_at_the_tp_bound_is_planned_quickly(heads):
    # GQA head pieces over MAX_TP_SIZE ranks on both sides: one plan, not one per rank pair.
    kw = dict(tp_size=MAX_TP_SIZE, num_kv_heads=heads, head_dim=8)
    lens = (32, 32)  # nhd/hnd, bfloat16: K and V of one head of 8 per token on every rank here
    p = KVCacheSpec(2, lens, 16, tp_rank=0, layout="nhd", **kw)
    d = KVCacheSpec(2, lens, 16, dcp_size=4, tp_rank=MAX_TP_SIZE - 1, layout="hnd", **kw)
    t0 = time.monotonic()
    check_compatible(p, d)
    served = served_group_ranks(p, d)
    view = stream_view(p, d, 4, 4)
    assert time.monotonic() - t0 < 2
    # Rank 0 sends the heads it is the lowest holder of: decode TP ranks holding head 0.
    want = {t for t in range(MAX_TP_SIZE) if t * heads // MAX_TP_SIZE == 0}
    assert served == {t * 4 + r for t in want for r in range(4)}
    assert len(view.pieces) == (MAX_TP_SIZE - 1 in want)


def test_a_refused_frame_is_reparsed_within_the_decode_bounds():
    small = msgpack.packb({"v": 99, "k": "hello"})
    assert _hello_of_another_version(small) == 99
    bomb = msgpack.packb({"v": 99, "k": "hello", "x": [0] * ((1 << 16) + 1)})
    assert _hello_of_another_version(bomb) is None  # as `protocol.decode`: arrays <= 2**16
    assert _hello_of_another_version(b"\x00" * (proto.MAX_CONTROL_BYTES + 1)) is None


def test_a_sender_ack_with_bad_engine_metadata_is_a_handshake_error_naming_peer():
    # The receiver's side of the peer check: its `connect` raises HandshakeError("peer") (not the
    # engine's PeerError), registers nothing and tells the sender at once.
    import numpy as np

    from dcp_jax.transfer import HandshakeError, KVReceiver, KVSender

    layers = lambda fill: [np.full((16, 4, il), fill, np.uint8) for il in (48, 16)]  # noqa: E731
    s = KVSender(SPEC, layers(1), engine="nixl", timeout_s=3)
    s.engine.peer_info = _NoPeer  # the ack's "peer": {} (no engine's metadata)
    r = KVReceiver(SPEC, layers(0), engine="nixl", timeout_s=3)
    try:
        with pytest.raises(HandshakeError, match="engine metadata") as e:
            r.connect(s.address, timeout_s=5)
        assert e.value.field == "peer"
        deadline = time.monotonic() + 3
        while s.peers and time.monotonic() < deadline:  # told "bye" at once: the link goes
            time.sleep(0.02)
        assert s.peers == []
    finally:
        r.close()
        s.close()


class _NoPeer:
    def to_dict(self):
        return {}
