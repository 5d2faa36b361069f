"""Layer entries that are views into one buffer (vLLM's CPU cache: K and V rows of every head
inside one tensor per layer): the engine registers their union once, and rows land byte-exact."""
import numpy as np

import bridge
from conftest import SENTINEL, TransferStatus
from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender
from dcp_jax.transfer.memory import CacheLayers


def _halves(buf, page_size, item):
    """Entry 0 = first half of every 2-page block, entry 1 = second half: page 2b of each."""
    flat = buf.reshape(-1)
    chunk = page_size * item
    return [flat[j * chunk:].reshape(-1, page_size, item) for j in (0, 1)]


def test_union_of_overlapping_views_is_one_region():
    buf = np.zeros((8, 2, 4, 16), np.uint8)  # 8 blocks of (K, V) x 4 tokens x 16 B
    layers = CacheLayers(KVCacheSpec(2, [16, 16], 4), _halves(buf, 4, 16))
    assert [(r.addr, r.nbytes) for r in layers.regions] == [(buf.ctypes.data, buf.nbytes)]
    assert layers.bases[1] - layers.bases[0] == 4 * 16
    # Disjoint layers stay separate regions.
    a, b = np.zeros((2, 4, 8), np.uint8), np.zeros((3, 4, 8), np.uint8)
    assert len(CacheLayers(KVCacheSpec(2, [8, 8], 4), [a, b]).regions) == 2


def test_transfer_between_shared_view_caches(engine):
    rng = np.random.default_rng(7)
    page, item, blocks = 4, 16, 8
    src_buf = rng.integers(0, 256, (blocks, 2, page, item), dtype=np.uint8)
    dst_bufs = [np.full((blocks, 2, page, item), SENTINEL, np.uint8) for _ in range(2)]
    sender = KVSender(KVCacheSpec(2, [item] * 2, page), _halves(src_buf, page, item), engine=engine,
                      mode="packed")
    recvs = [KVReceiver(KVCacheSpec(2, [item] * 2, page, 2, r), _halves(dst_bufs[r], page, item), engine=engine)
             for r in range(2)]
    try:
        L = 11  # token round-robin over 2 ranks, rank 1's last page partial
        src_blocks = [5, 2, 7]
        dst_blocks = [[3, 6], [1, 4]]
        for r, rv in enumerate(recvs):
            rv.connect(sender.address)
            rv.expect("q", np.asarray(dst_blocks[r]) * 2, L)  # block b is page 2b of both entries
        sender.send("q", np.asarray(src_blocks) * 2, 0, L)
        for rv in recvs:
            for _ in range(2000):
                if rv.poll("q").terminal:
                    break
                import time
                time.sleep(0.005)
            assert rv.poll("q") is TransferStatus.SUCCESS, rv.failure_reason("q")
        want = [np.full_like(d, SENTINEL) for d in dst_bufs]
        for t in range(L):
            r, k = t % 2, t // 2
            sb, ss = src_blocks[t // page], t % page
            db, ds = dst_blocks[r][k // page], k % page
            want[r][db, :, ds] = src_buf[sb, :, ss]  # K and V of token t
        for r in range(2):
            assert np.array_equal(dst_bufs[r], want[r])
    finally:
        for rv in recvs:
            rv.close()
        sender.close()
    assert bridge.registered_bytes() == 0
