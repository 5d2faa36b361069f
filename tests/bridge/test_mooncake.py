"""Mooncake adapter: real TCP transfers over loopback with DEFAULT MC_TCP_* settings."""
import math
import os

import numpy as np
import pytest

import _peer_worker as pw
from bridge import make_engine
from bridge.mooncake import MOONCAKE_MAX_BATCH_ENTRIES, MooncakeEngine


def _expected(src: np.ndarray, nbytes: int, item: int, src_rows, dst_rows) -> np.ndarray:
    out = np.zeros(nbytes, dtype=np.uint8)
    out.reshape(-1, item)[dst_rows] = src.reshape(-1, item)[src_rows]
    return out


def test_tcp_queue_settings_are_defaults():
    """The windowing tests below mean something only if nobody raised the engine's queue caps."""
    assert not [k for k in os.environ if k.startswith("MC_TCP_")]


@pytest.mark.timeout(30)
def test_one_process_scattered_write_is_byte_exact(mooncake_pair):
    p = mooncake_pair
    p.fill(seed=31)
    n = 1000
    descs, s_rows, d_rows = pw.scattered_descs(p.src.ctypes.data, p.dst.ctypes.data, n, pw.ITEM, seed=3)
    h = p.ini.transfer_batch(p.peer, descs, notif=b"mc-\x00\xff-0")
    p.ini.wait(h, timeout_s=20)
    np.testing.assert_array_equal(p.dst, _expected(p.src, p.dst.size, pw.ITEM, s_rows, d_rows))
    # arbitrary tag bytes survive Mooncake's str notification
    assert p.tgt.wait_notification(p.ini.name, b"mc-\x00\xff-0", timeout_s=10) == b"mc-\x00\xff-0"
    c = p.ini.counters
    assert (c.descriptors, c.bytes, c.batches) == (n, n * pw.ITEM, 1)
    assert c.engine_calls == 2  # one window + the notification


@pytest.mark.timeout(30)
def test_per_token_batch_over_10k_descriptors_with_default_env(mooncake_pair):
    """12,288 one-token descriptors in one batch: unwindowed, default Mooncake fails and poisons
    the peer at about 2,000 entries; the adapter's 1,024-entry windows make it succeed."""
    p = mooncake_pair
    p.fill(seed=32)
    item = 128  # one small row per token keeps the test fast; the count is what matters
    n = 12288
    descs, s_rows, d_rows = pw.scattered_descs(p.src.ctypes.data, p.dst.ctypes.data, n, item, seed=6)
    h = p.ini.transfer_batch(p.peer, descs, dcp_rank=0, chunk=0)
    p.ini.wait(h, timeout_s=25)
    expect = _expected(p.src[: n * item], n * item, item, s_rows, d_rows)
    np.testing.assert_array_equal(p.dst[: n * item], expect)
    assert not p.dst[n * item:].any()
    assert p.ini.counters.engine_calls == math.ceil(n / MOONCAKE_MAX_BATCH_ENTRIES)
    # and the peer is not poisoned: a follow-up batch still lands
    p.dst[:] = 0
    descs, s_rows, d_rows = pw.scattered_descs(p.src.ctypes.data, p.dst.ctypes.data, 64, pw.ITEM, seed=7)
    p.ini.wait(p.ini.transfer_batch(p.peer, descs), timeout_s=10)
    np.testing.assert_array_equal(p.dst, _expected(p.src, p.dst.size, pw.ITEM, s_rows, d_rows))


@pytest.mark.timeout(30)
def test_concurrent_batches_to_one_peer(mooncake_pair):
    """Several handles in flight to one peer (one per rank region) all complete, byte-exact."""
    p = mooncake_pair
    p.fill(seed=33)
    ranks, rows = 4, 512
    region = rows * pw.ITEM
    rng = np.random.default_rng(8)
    handles, expect = [], np.zeros_like(p.dst)
    for r in range(ranks):
        src_rows = rng.permutation(pw.ROWS)[:rows]
        dst_rows = rng.permutation(rows)
        descs = np.stack([p.src.ctypes.data + src_rows * pw.ITEM,
                          p.dst.ctypes.data + r * region + dst_rows * pw.ITEM,
                          np.full(rows, pw.ITEM)], axis=1).astype(np.int64)
        expect[r * region:(r + 1) * region].reshape(-1, pw.ITEM)[dst_rows] = p.src.reshape(-1, pw.ITEM)[src_rows]
        handles.append(p.ini.transfer_batch(p.peer, descs, notif=f"r{r}".encode()))
    for h in handles:
        p.ini.wait(h, timeout_s=20)
    np.testing.assert_array_equal(p.dst, expect)
    for r in range(ranks):
        p.tgt.wait_notification(p.ini.name, f"r{r}".encode(), timeout_s=10)


@pytest.mark.timeout(30)
def test_two_process_transfer_with_completion_message():
    """Real decode-side process; completion arrives as a Mooncake notification after the data."""
    nbytes = pw.ROWS * pw.ITEM
    proc, conn, info = pw.spawn_target("mooncake", "decode-0", nbytes)
    try:
        src = np.random.default_rng(41).integers(0, 256, nbytes, dtype=np.uint8)
        with make_engine("mooncake", "prefill") as eng:
            eng.register([src])
            peer = eng.add_peer(info)
            descs, s_rows, d_rows = pw.scattered_descs(src.ctypes.data, info.regions[0].addr, pw.ROWS, pw.ITEM, seed=9)
            h = eng.transfer_batch(peer, descs, notif=b"req1-chunk0-done")
            conn.send(("wait", "prefill", b"req1-chunk0-done", 20.0))
            eng.wait(h, timeout_s=20)
            assert conn.poll(25)
            status, payload = conn.recv()
            assert status == "ok", payload
            np.testing.assert_array_equal(np.frombuffer(payload, np.uint8),
                                          _expected(src, nbytes, pw.ITEM, s_rows, d_rows))
            assert eng.counters.engine_calls == math.ceil(pw.ROWS / MOONCAKE_MAX_BATCH_ENTRIES) + 1
    finally:
        pw.stop_target(proc, conn)
    assert proc.exitcode == 0


def test_window_argument_is_checked():
    for bad in (0, MOONCAKE_MAX_BATCH_ENTRIES + 1, 1.5, True):
        with pytest.raises(ValueError, match="window"):
            MooncakeEngine("w", window=bad)
