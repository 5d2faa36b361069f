"""Handshake refusals (one per field) and peers that die mid-request (real processes)."""
import multiprocessing as mp
import os
import signal
import time

import msgpack
import numpy as np
import pytest
import zmq

import _peer
from conftest import Cluster, TransferStatus
from dcp_jax.transfer import HandshakeError, KVCacheSpec, KVReceiver
from dcp_jax.transfer import protocol as proto

S = TransferStatus


@pytest.mark.parametrize("field, change", [
    ("num_layers", dict(num_layers=3, item_lens=(48, 16, 16))),
    ("item_lens", dict(item_lens=(48, 32))),
    ("dtype", dict(dtype="float8_e4m3fn")),
])  # layout and tp_size pairs are served (head pieces): tests/transfer/test_connector_views.py
def test_handshake_refuses_each_field(engine, field, change):
    c = Cluster(engine, dcp_size=1, connect=False)
    try:
        base = dict(num_layers=2, item_lens=(48, 16), page_size=4, dcp_size=1, dcp_rank=0)
        spec = KVCacheSpec(**{**base, **change})
        kv = [np.zeros((4, spec.page_size, il), np.uint8) for il in spec.item_lens]
        with KVReceiver(spec, kv, engine=engine) as recv:
            with pytest.raises(HandshakeError, match=field) as info:
                recv.connect(c.sender.address)
            err = info.value
            assert err.field == field
            assert err.ours == getattr(spec, field) or list(err.ours) == list(getattr(spec, field))
            assert recv.stats["connections"] == 0
        assert c.sender.stats["handshakes_refused"] == 1
    finally:
        c.close()


def test_handshake_refuses_a_group_of_two_geometries(engine):
    c = Cluster(engine, dcp_size=2, connect=True)
    try:
        spec = KVCacheSpec(2, (48, 16), 4, dcp_size=4, dcp_rank=3)  # the group already has N = 2
        with KVReceiver(spec, [np.zeros((4, 4, il), np.uint8) for il in (48, 16)], engine=engine) as recv:
            with pytest.raises(HandshakeError, match="dcp_size") as info:
                recv.connect(c.sender.address)
            assert (info.value.ours, info.value.theirs) == (4, 2)
    finally:
        c.close()


def test_handshake_refuses_another_protocol_version(engine):
    c = Cluster(engine, dcp_size=1, connect=False)
    try:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(c.sender.address)
        s.send(msgpack.packb({"v": 99, "k": "hello", "rid": "", "inc": 0}))
        assert s.poll(5000)
        reply = proto.decode(s.recv())
        assert reply["k"] == "hello_nack" and reply["field"] == "version"
        assert (reply["ours"], reply["theirs"]) == (proto.PROTOCOL_VERSION, 99)
        s.close(0)
    finally:
        c.close()


def test_connect_to_nobody_times_out():
    spec = KVCacheSpec(1, (16,), 4)
    with KVReceiver(spec, [np.zeros((2, 4, 16), np.uint8)], engine="auto") as recv:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no handshake answer"):
            recv.connect("tcp://127.0.0.1:9", timeout_s=0.5)
        assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:0", "tcp://127.0.0.1",
                                     "tcp://:5555", "127.0.0.1:5555", "tcp://127.0.0.1:http", 5555,
                                     "tcp://127.0.0.1:\u00b2", "tcp://127.0.0.1:\uff15\uff15\uff15\uff15"])
def test_connect_refuses_a_bad_address_at_once(address):
    spec = KVCacheSpec(1, (16,), 4)
    with KVReceiver(spec, [np.zeros((2, 4, 16), np.uint8)], engine="auto") as recv:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="address=.*port in 1..65535"):
            recv.connect(address, timeout_s=5)
        assert time.monotonic() - t0 < 1  # refused, not waited out


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(child,) + args, daemon=True)
    p.start()
    return p, parent


def test_receiver_killed_mid_request_fails_the_sender(engine):
    c = Cluster(engine, dcp_size=1, connect=False, peer_timeout_s=2.0)
    p, pipe = _spawn(_peer.receiver_main, engine, c.sender.address, (48, 16), 4, "k", 40, 2.0)
    try:
        assert pipe.poll(60) and pipe.recv() == "ready"
        # Let the receiver's announcement reach the sender first (on a loaded machine it can lag;
        # a request the sender never heard of only ends at timeout_s). 8 of 40 tokens cannot finish it.
        time.sleep(1.0)
        src, _ = c.tables(40)
        c.sender.send("k", src, 0, 8)
        os.kill(p.pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert c.wait("k", sides=[c.sender], timeout_s=10) == [S.FAILED]
        assert time.monotonic() - t0 < 2.0 + 1.5
        assert "silent" in c.sender.failure_reason("k") or "engine" in c.sender.failure_reason("k")
    finally:
        p.kill()
        c.close()


def test_sender_killed_mid_request_fails_the_receiver(engine):
    p, pipe = _spawn(_peer.sender_main, engine, (48, 16), 4, 2.0)
    try:
        assert pipe.poll(60)
        address = pipe.recv()
        spec = KVCacheSpec(2, (48, 16), 4)
        kv = [np.zeros((64, 4, il), np.uint8) for il in (48, 16)]
        with KVReceiver(spec, kv, engine=engine, peer_timeout_s=2.0, timeout_s=60) as recv:
            recv.connect(address)
            recv.expect("d", np.arange(10), 40)
            pipe.send(("d", 40))
            assert pipe.poll(30) and pipe.recv() == "sent"
            os.kill(p.pid, signal.SIGKILL)
            t0 = time.monotonic()
            while not recv.poll("d").terminal and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            assert recv.poll("d") is S.FAILED
            assert time.monotonic() - t0 < 2.0 + 1.5
            assert "silent" in recv.failure_reason("d")
    finally:
        p.kill()


def test_a_closed_side_counts_no_connection(engine):
    """After close(), a sender's and a receiver's own stats say 0 connections (they kept the
    count of the links they had); the peers notice the closed side by its silence."""
    c = Cluster(engine, dcp_size=2)
    try:
        assert c.sender.stats["connections"] == 2 and c.receivers[0].stats["connections"] == 1
        c.receivers[0].close()
        assert c.receivers[0].stats["connections"] == 0
        c.sender.close()
        assert c.sender.stats["connections"] == 0
    finally:
        c.close()


def test_a_handshake_error_keeps_its_detail_through_pickle():
    # Before: __reduce__ dropped the detail, so an error sent through multiprocessing lost its why.
    import pickle

    err = HandshakeError("position", None, None, "held by the live receiver 'r0'")
    back = pickle.loads(pickle.dumps(err))
    assert (back.field, back.detail, str(back)) == ("position", err.detail, str(err))


@pytest.mark.parametrize("bad", [5, ["x"], None])
def test_poll_names_a_request_id_of_the_wrong_type(engine, bad):
    c = Cluster(engine, dcp_size=1)
    try:
        for side in (c.sender, c.receivers[0]):
            with pytest.raises(TypeError, match="request_id must be a str"):
                side.poll(bad)
            with pytest.raises(KeyError):
                side.poll("never-seen")
    finally:
        c.close()


def test_a_receiver_host_that_is_not_this_machine_is_refused_at_once():
    # Before: accepted; connect() then timed out asking whether a KVSender listens there.
    spec = KVCacheSpec(1, (16,), 4)
    with pytest.raises(ValueError, match="host='10.255.255.1' is not an address of this machine"):
        KVReceiver(spec, [np.zeros((2, 4, 16), np.uint8)], engine="auto", host="10.255.255.1")
    with KVReceiver(spec, [np.zeros((2, 4, 16), np.uint8)], engine="auto", host="127.0.0.1") as recv:
        assert recv.host == "127.0.0.1"
