"""op="READ" (remote -> local) on both real engines: byte-exact, notified, validated like a WRITE."""
import math
import time

import numpy as np
import pytest

import _peer_worker as pw
from bridge import DescriptorError, PeerError, TransferError
from bridge.mooncake import MOONCAKE_MAX_BATCH_ENTRIES


def _fresh_remote(p, seed: int) -> None:
    """Random bytes at the target (the READ source), zeroed initiator buffer (the destination)."""
    p.fill(seed)
    p.dst[:] = np.random.default_rng(seed + 1000).integers(0, 256, p.dst.size, dtype=np.uint8)
    p.src[:] = 0


def _read_descs(p, n: int, item: int, seed: int):
    """n scattered READ rows: local rows in order, remote rows a random permutation."""
    descs, local_rows, remote_rows = pw.scattered_descs(p.src.ctypes.data, p.dst.ctypes.data, n, item, seed)
    return descs, local_rows, remote_rows


def _expected_local(p, n: int, item: int, local_rows, remote_rows) -> np.ndarray:
    out = np.zeros_like(p.src)
    out.reshape(-1, item)[local_rows] = p.dst.reshape(-1, item)[remote_rows]
    return out


@pytest.mark.timeout(30)
def test_read_is_byte_exact_with_notification(two_connected_engines):
    """Scattered rows pulled from the peer land exactly; the peer is told after the last byte."""
    p = two_connected_engines
    _fresh_remote(p, seed=61)
    n = 700  # one Mooncake window
    descs, l_rows, r_rows = _read_descs(p, n, pw.ITEM, seed=8)
    before = p.dst.copy()
    h = p.ini.transfer_batch(p.peer, descs, op="READ", notif=b"read-\x00-7", dcp_rank=2, chunk=1)
    assert h.op == "READ" and "READ" in repr(h)
    p.ini.wait(h, timeout_s=20)
    np.testing.assert_array_equal(p.src, _expected_local(p, n, pw.ITEM, l_rows, r_rows))
    np.testing.assert_array_equal(p.dst, before)  # the source is only read
    assert p.tgt.wait_notification(p.ini.name, b"read-\x00-7", timeout_s=10) == b"read-\x00-7"
    c = p.ini.counters
    assert (c.descriptors, c.bytes, c.batches) == (n, n * pw.ITEM, 1)


@pytest.mark.timeout(30)
def test_read_polled_with_check(two_connected_engines):
    """`check` drives a READ to completion like `wait`: False (maybe), then True, handle released."""
    p = two_connected_engines
    _fresh_remote(p, seed=62)
    descs, l_rows, r_rows = _read_descs(p, pw.ROWS, pw.ITEM, seed=9)
    h = p.ini.transfer_batch(p.peer, descs, op="READ")
    for _ in range(20_000):
        if p.ini.check(h):
            break
        time.sleep(1e-3)
    assert h.released and p.ini.outstanding == 0
    np.testing.assert_array_equal(p.src, _expected_local(p, pw.ROWS, pw.ITEM, l_rows, r_rows))


@pytest.mark.timeout(30)
def test_multi_window_mooncake_read(mooncake_pair):
    """More than one window of READ entries, default MC_TCP_* settings: exact, one call per window."""
    p = mooncake_pair
    _fresh_remote(p, seed=63)
    item, n = 256, 3000  # 3 windows
    descs, l_rows, r_rows = _read_descs(p, n, item, seed=10)
    h = p.ini.transfer_batch(p.peer, descs, op="READ", notif=b"mw")
    p.ini.wait(h, timeout_s=25)
    expect = np.zeros_like(p.src)
    expect.reshape(-1, item)[l_rows] = p.dst.reshape(-1, item)[r_rows]
    np.testing.assert_array_equal(p.src, expect)
    assert p.ini.counters.engine_calls == math.ceil(n / MOONCAKE_MAX_BATCH_ENTRIES) + 1  # + notify
    p.tgt.wait_notification(p.ini.name, b"mw", timeout_s=10)


@pytest.mark.timeout(30)
def test_empty_read_with_notif_only_notifies(two_connected_engines):
    p = two_connected_engines
    _fresh_remote(p, seed=64)
    h = p.ini.transfer_batch(p.peer, np.zeros((0, 3), np.int64), op="READ", notif=b"nothing-to-read")
    p.ini.wait(h, timeout_s=10)
    assert p.tgt.wait_notification(p.ini.name, b"nothing-to-read", timeout_s=10) == b"nothing-to-read"
    assert not p.src.any()
    assert p.ini.counters.descriptors == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", ["read", "PUT", "", None, 1])
def test_unknown_op_is_refused(two_connected_engines, bad):
    p = two_connected_engines
    p.fill(seed=65)
    descs, _, _ = _read_descs(p, 4, pw.ITEM, seed=1)
    with pytest.raises(ValueError, match=r"op=.*WRITE.*READ"):
        p.ini.transfer_batch(p.peer, descs, op=bad)
    assert p.ini.counters.batches == 0 and p.ini.outstanding == 0


@pytest.mark.timeout(30)
def test_read_is_validated_like_a_write(two_connected_engines):
    """Local rows must be registered here, remote rows advertised by the peer: nothing is read."""
    p = two_connected_engines
    _fresh_remote(p, seed=66)
    descs, _, _ = _read_descs(p, 8, pw.ITEM, seed=2)
    bad_local = descs.copy()
    bad_local[2, 0] = p.src.ctypes.data + p.src.nbytes  # one past the local registration
    with pytest.raises(DescriptorError, match="local ranges.*row 2"):
        p.ini.transfer_batch(p.peer, bad_local, op="READ")
    bad_remote = descs.copy()
    bad_remote[5, 1] = p.dst.ctypes.data - 8
    with pytest.raises(DescriptorError, match="remote ranges.*row 5"):
        p.ini.transfer_batch(p.peer, bad_remote, op="READ")
    with pytest.raises(PeerError, match="not a known peer"):
        p.ini.transfer_batch("nobody", descs, op="READ")
    assert not p.src.any() and p.ini.counters.batches == 0


@pytest.mark.timeout(30)
def test_engine_reported_read_failure_names_the_peer(mooncake_pair):
    """A READ from a region the peer deregistered (stale PeerInfo here): TransferError, no bytes."""
    p = mooncake_pair
    _fresh_remote(p, seed=67)
    extra = np.full(16 * 1152, 7, np.uint8)
    p.tgt.register([extra])
    p.ini.add_peer(p.tgt.peer_info())
    p.tgt.deregister([extra])
    rows = np.arange(16)
    descs = np.stack([p.src.ctypes.data + rows * 1152, extra.ctypes.data + rows * 1152,
                      np.full(16, 1152)], axis=1).astype(np.int64)
    h = p.ini.transfer_batch(p.peer, descs, op="READ", dcp_rank=4, chunk=9)
    with pytest.raises(TransferError, match="READ") as info:
        p.ini.wait(h, timeout_s=10)
    assert (info.value.peer, info.value.num_descriptors, info.value.dcp_rank, info.value.chunk) == (p.peer, 16, 4, 9)
    assert not p.src.any()
    p.ini.add_peer(p.tgt.peer_info())  # the fixture's peer info, refreshed
