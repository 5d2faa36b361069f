"""`bridge.jax_engine.JaxTransferEngine` (``make_engine("jax-transfer")``) on the CPU, real engine.

The engine-parametrized contract tests of tests/bridge (READ, handles, remove_peer, close,
deadlines, PeerInfo) run here against a jax-transfer pair: they are imported into this module,
whose `two_connected_engines` fixture overrides the conftest one. Those whose assertions are
written for NIXL's or Mooncake's cancel semantics (a cancelled running batch ends True on NIXL,
"cancelled" on Mooncake; here it depends on whether the target's pull has finished) are not
imported; `test_cancel_*` below checks this engine's rule instead.

Then what is particular to this engine: bf16 caches byte-exact through every staging kind
(sglang-jax's warning about unpinned staging), two processes, and hostile side-channel
messages refused before any memory is touched.
"""
import time

import ml_dtypes
import msgpack
import numpy as np
import pytest
import zmq

import _peer_worker as pw
import test_async
import test_close
import test_failures
from bridge import DescriptorError, MemoryRegion, PeerError, PeerInfo, RegistrationError, TransferError, make_engine
from bridge.jax_engine import PROTOCOL_VERSION, JaxTransferEngine

# Batch sizes the imported tests use to keep a batch in flight (jax-transfer moves ~300 MB/s here).
test_async._BIG.setdefault("jax-transfer", 1_000_000)  # //4 in remove_peer: 16 MB, ~0.1 s
test_close._BIG.setdefault("jax-transfer", 400_000)
test_failures._KILL_BATCH.setdefault("jax-transfer", 20_000)

from test_async import test_handle_misuse_is_refused, test_remove_peer_with_handles_outstanding  # noqa: E402,F401
from test_close import (  # noqa: E402,F401
    test_close_with_a_big_batch_in_flight, test_close_with_a_short_timeout_leaves_the_teardown_to_a_daemon,
    test_registered_bytes_follow_register_deregister_close)
from test_failures import test_deadline_raises_timeout_and_releases  # noqa: E402,F401
from test_peer_info import test_real_engine_info_round_trips  # noqa: E402,F401
from test_read import (  # noqa: E402,F401
    test_empty_read_with_notif_only_notifies, test_read_is_byte_exact_with_notification,
    test_read_is_validated_like_a_write, test_read_polled_with_check, test_unknown_op_is_refused)


@pytest.fixture(scope="module")
def two_connected_engines():
    pair = pw.Pair("jax-transfer")
    yield pair
    pair.close()


def _bf16(shape, seed):
    bits = np.random.default_rng(seed).integers(0, 2**16, shape, dtype=np.uint16)
    return ((bits & 0xBFFF) | 0x2000).astype(np.uint16).view(ml_dtypes.bfloat16)  # NaN-free


@pytest.mark.parametrize("staging", ["pinned_host", "unpinned_host", "device"])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_bf16_cache_rows_are_byte_exact_through_each_staging(staging, op):
    """sglang-jax: unpinned host staging corrupts bf16 strides in this engine. Scattered rows of
    a bf16 [pages, page_size, 576] cache (and a 640-lane padded one, sliced) arrive bit for bit."""
    a = make_engine("jax-transfer", f"bf16-a-{staging}-{op}", staging=staging)
    b = make_engine("jax-transfer", f"bf16-b-{staging}-{op}", staging=staging)
    try:
        src = _bf16((32, 16, 576), seed=1)
        dst = np.zeros((32, 16, 576), ml_dtypes.bfloat16)
        a.register([src])
        b.register([dst])
        peer = a.add_peer(b.peer_info())
        rows = np.random.default_rng(2).permutation(32 * 16)[:300]
        item = 576 * 2
        local, remote = (src, dst) if op == "WRITE" else (dst, src)
        if op == "READ":  # the READ pulls from b's buffer: b holds the data then
            dst[:] = _bf16(dst.shape, seed=3)
            src[:] = 0
            rng_rows = np.arange(300)
            descs = np.stack([src.ctypes.data + rng_rows * item, dst.ctypes.data + rows * item,
                              np.full(300, item)], axis=1)
        else:
            descs = np.stack([src.ctypes.data + rows * item, dst.ctypes.data + np.arange(300) * item,
                              np.full(300, item)], axis=1)
        a.wait(a.transfer_batch(peer, descs, op=op, notif=b"bf16"), timeout_s=30)
        flat_src, flat_dst = src.reshape(-1, 576), dst.reshape(-1, 576)
        if op == "WRITE":
            np.testing.assert_array_equal(flat_dst[:300].view(np.uint16), flat_src[rows].view(np.uint16))
            assert not flat_dst[300:].view(np.uint16).any()
        else:
            np.testing.assert_array_equal(flat_src[:300].view(np.uint16), flat_dst[rows].view(np.uint16))
        assert b.wait_notification(a.name, b"bf16", timeout_s=10) == b"bf16"
        del local, remote
    finally:
        a.close()
        b.close()


def test_two_processes_write_with_notification():
    """A spawned target process (its own JAX and transfer server) receives a scattered WRITE."""
    proc, conn, info = pw.spawn_target("jax-transfer", "jt-target", pw.ROWS * pw.ITEM)
    try:
        with make_engine("jax-transfer", "jt-initiator") as eng:
            src = np.random.default_rng(11).integers(0, 256, pw.ROWS * pw.ITEM, dtype=np.uint8)
            eng.register([src])
            peer = eng.add_peer(info)
            descs, s_rows, d_rows = pw.scattered_descs(src.ctypes.data, info.regions[0].addr, pw.ROWS, pw.ITEM, 4)
            eng.wait(eng.transfer_batch(peer, descs, notif=b"two-proc"), timeout_s=60)
            conn.send(("wait", "jt-initiator", b"two-proc", 30))
            assert conn.poll(40)
            status, data = conn.recv()
            assert status == "ok", data
            got = np.frombuffer(data, np.uint8).reshape(-1, pw.ITEM)
            np.testing.assert_array_equal(got[d_rows], src.reshape(-1, pw.ITEM)[s_rows])
    finally:
        pw.stop_target(proc, conn)


def _raw_request(session: str, msg, timeout_s: float = 10.0):
    """One raw frame to an engine's side channel; its decoded answer."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{session}")
        sock.send(msg if isinstance(msg, bytes) else msgpack.packb(msg, use_bin_type=True))
        assert sock.poll(int(timeout_s * 1000)), "no answer"
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close(0)


def test_hostile_side_channel_messages_are_refused_before_memory_is_touched():
    with make_engine("jax-transfer", "victim") as eng:
        buf = np.full(4096, 7, np.uint8)
        eng.register([buf])
        session = eng.peer_info().session
        base = {"v": PROTOCOL_VERSION, "from": "mallory", "seq": 5}
        cases = [
            (b"\x80\x04\x95 not msgpack, a pickle header", "not a msgpack map"),
            ({**base, "v": 99, "op": "read", "ranges": b""}, "version"),
            ({**base, "op": "exec"}, "op='exec' must be one of"),
            ({**base, "op": "read"}, "fields"),
            ({**base, "op": "read", "ranges": b"x" * 15}, "ranges: 15 bytes"),
            ({**base, "op": "read", "seq": -1, "ranges": b""}, "seq=-1"),
            ({**base, "op": "read", "ranges": np.array([[buf.ctypes.data, 8192]], "<i8").tobytes()},
             "outside every region registered"),
            ({**base, "op": "read", "ranges": np.array([[buf.ctypes.data - 64, 64]], "<i8").tobytes()},
             "outside every region registered"),
            ({**base, "op": "write", "uuid": 1, "notif": None, "address": "127.0.0.1:1",
              "ranges": np.array([[buf.ctypes.data + 4090, 64]], "<i8").tobytes()}, "outside every region"),
            ({**base, "op": "write", "uuid": 1, "notif": None, "address": "nowhere",
              "ranges": np.array([[buf.ctypes.data, 64]], "<i8").tobytes()}, "address"),
        ]
        for k, (msg, match) in enumerate(cases):
            ans = _raw_request(session, msg)
            assert ans["op"] == "error" and match in ans["msg"], (k, ans)
        assert eng.rejected_messages == len(cases)
        assert (buf == 7).all() and eng.notifications() == {}
        import bridge.jax_engine as je

        limit, je.MAX_SERVED_PEERS = je.MAX_SERVED_PEERS, len(eng._servers)  # white box: no room left
        try:
            ans = _raw_request(session, {**base, "from": "one-more", "op": "notify", "notif": b"x"})
            assert ans["op"] == "error" and "already serves" in ans["msg"]
        finally:
            je.MAX_SERVED_PEERS = limit
        # a legal request still works after all that
        ans = _raw_request(session, {**base, "op": "notify", "notif": b"still-alive"})
        assert ans == {"v": PROTOCOL_VERSION, "op": "written", "seq": 5}
        assert eng.notifications() == {"mallory": [b"still-alive"]}


def test_cancel_of_a_queued_batch_drops_it_and_the_engine_goes_on(two_connected_engines):
    """A batch queued behind a running one and cancelled never moves ("cancelled"); the running
    one ends True or "cancelled" (this engine: cancelled unless the target already pulled)."""
    p = two_connected_engines
    p.fill(seed=81)
    descs = pw.many_small(p.src, p.dst, 20_000, seed=3)
    running = p.ini.transfer_batch(p.peer, descs)
    queued = p.ini.transfer_batch(p.peer, descs[:64])
    p.ini.cancel(queued)
    p.ini.cancel(running)
    got_q = test_async._finish(p.ini, queued)
    got_r = test_async._finish(p.ini, running)
    assert isinstance(got_q, TransferError) and "cancelled" in str(got_q)
    assert got_r is True or "cancelled" in str(got_r), got_r
    assert p.ini.outstanding == 0
    test_async._assert_follow_up_lands(p)


def test_bad_arguments_and_peers_are_refused_by_name():
    with pytest.raises(ValueError, match="staging='hbm'"):
        JaxTransferEngine("x", staging="hbm")
    with pytest.raises(ValueError, match="timeout_s"):
        JaxTransferEngine("x", timeout_s=0)
    with pytest.raises(ValueError, match="engine='jax'"):
        make_engine("jax", "x")
    with make_engine("jax-transfer", "args") as eng:
        with pytest.raises(RegistrationError, match="host memory"):
            eng.register([MemoryRegion(1 << 40, 4096, "VRAM", 0)])
        good = eng.peer_info()
        assert good.engine == "jax-transfer" and PeerInfo.from_dict(good.to_dict()) == good
        other = PeerInfo("jax-transfer", "other", good.session, b"\x93garbage", ())
        with pytest.raises(PeerError, match="transfer server"):
            eng.add_peer(other)
        with pytest.raises(PeerError, match="session"):
            eng.add_peer(PeerInfo("jax-transfer", "other", "nohost", good.metadata, ()))
        with pytest.raises(PeerError, match="is a 'nixl' engine"):
            eng.add_peer(PeerInfo("nixl", "other", "", b"", ()))
        src = np.zeros(64, np.uint8)
        eng.register([src])
        peer = eng.add_peer(PeerInfo("jax-transfer", "far", good.session, good.metadata, good.regions))
        with pytest.raises(DescriptorError, match="remote ranges"):
            eng.transfer_batch(peer, np.array([[src.ctypes.data, 1, 64]]))


def test_an_unanswered_batch_times_out_within_the_engine_bound():
    """A peer whose side channel never answers: the batch fails after timeout_s, not later."""
    dead = zmq.Context.instance().socket(zmq.ROUTER)  # takes frames, never answers
    port = dead.bind_to_random_port("tcp://127.0.0.1")
    try:
        with JaxTransferEngine("lonely", timeout_s=1.0) as eng, JaxTransferEngine("shape") as ref:
            src = np.zeros(64, np.uint8)
            eng.register([src])
            meta = ref.peer_info().metadata
            peer = eng.add_peer(PeerInfo("jax-transfer", "mute", f"127.0.0.1:{port}", meta,
                                         (MemoryRegion(1 << 30, 64),)))
            t0 = time.monotonic()
            h = eng.transfer_batch(peer, np.array([[src.ctypes.data, 1 << 30, 64]]), op="READ")
            with pytest.raises(TransferError, match="no answer from the peer within 1 s"):
                eng.wait(h, timeout_s=10)
            assert 0.9 < time.monotonic() - t0 < 5
    finally:
        dead.close(0)


def test_cancelled_write_is_not_written_if_the_target_has_not_pulled_yet(two_connected_engines):
    """The cancel reaches the target while its pull is still running (held back here): the
    target drops the bytes instead of writing them, the handle ends "cancelled", dst untouched."""
    p = two_connected_engines
    p.fill(seed=82)
    pull = p.tgt._xfer.pull

    def slow_pull(*args, **kwargs):
        time.sleep(0.5)
        return pull(*args, **kwargs)

    p.tgt._xfer.pull = slow_pull  # white box: the target's pull of the initiator's offer
    try:
        descs, _, _ = pw.scattered_descs(p.src.ctypes.data, p.dst.ctypes.data, 256, pw.ITEM, seed=6)
        h = p.ini.transfer_batch(p.peer, descs, notif=b"never")
        time.sleep(0.1)
        p.ini.cancel(h)
        got = test_async._finish(p.ini, h)
        assert isinstance(got, TransferError) and "cancelled by the initiator" in str(got), got
        assert not p.dst.any() and p.tgt.notifications() == {}
    finally:
        del p.tgt._xfer.pull
    test_async._assert_follow_up_lands(p)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_contiguous_ranges_across_two_touching_registrations(op):
    """Two registrations that touch (halves of one buffer): ranges continuing across the seam are
    copied region by region, never merged into one range no registration holds."""
    with make_engine("jax-transfer", f"seam-a-{op}") as a, make_engine("jax-transfer", f"seam-b-{op}") as b:
        src = np.random.default_rng(9).integers(0, 256, 8192, dtype=np.uint8)
        dst = np.zeros(8192, np.uint8)
        for eng, buf in ((a, src if op == "WRITE" else dst), (b, dst if op == "WRITE" else src)):
            base = buf.ctypes.data
            eng.register([MemoryRegion(base, 4096), MemoryRegion(base + 4096, 4096)])
        peer = a.add_peer(b.peer_info())
        local, remote = (src, dst) if op == "WRITE" else (dst, src)
        rows = np.arange(0, 8192, 1024)  # 8 rows of 1 KiB, both sides contiguous across the seam
        descs = np.stack([local.ctypes.data + rows, remote.ctypes.data + rows, np.full(8, 1024)], axis=1)
        a.wait(a.transfer_batch(peer, descs, op=op), timeout_s=30)
        np.testing.assert_array_equal(dst, src)
