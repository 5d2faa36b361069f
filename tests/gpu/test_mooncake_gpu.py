"""GPU: Mooncake's CUDA build moving VRAM between two processes over nvlink_intra, byte-exact.

Both sides register CuPy ranges that start *inside* their pool allocations, the case where
Mooncake's own IPC handle would be opened at the allocation's base: the adapter registers the
whole allocation, so each byte must land at its own offset and nothing outside the descriptors
may change. Skipped unless `mooncake-transfer-engine-cuda13` is installed (scripts/gpu_suite.sh
unpacks .whl/mooncake_cu13_site.tgz).
"""
import multiprocessing as mp
import os
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from bridge import MemoryRegion, PeerInfo, make_engine  # noqa: E402
from bridge.mooncake import mooncake_supports_cuda  # noqa: E402

if not mooncake_supports_cuda():
    pytest.skip("needs Mooncake's CUDA build (mooncake-transfer-engine-cuda13; scripts/gpu_suite.sh "
                "unpacks .whl/mooncake_cu13_site.tgz)", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
import _gpu_peers  # noqa: E402

NBYTES, AT = 256 << 20, 1 << 20  # 256 MiB region starting 1 MiB into the target's allocation


@pytest.fixture(scope="module")
def pair():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_gpu_peers.mooncake_target, args=(there, NBYTES, AT), daemon=True)
    proc.start()
    assert here.poll(120), "the Mooncake target did not answer in 120 s"
    msg = here.recv()
    if msg[0] == "error":
        proc.join(5)
        pytest.fail(f"target failed:\n{msg[1]}")
    _, info, protocol = msg
    assert protocol == "nvlink_intra"
    src_whole = cp.asarray(np.random.default_rng(3).integers(0, 256, NBYTES + 2 * AT, dtype=np.uint8))
    src_addr = int(src_whole.data.ptr) + AT + 4096  # inside the allocation, not at its base
    eng = make_engine("mooncake", "mc-init")
    eng.register([MemoryRegion(src_addr, NBYTES - 8192, "VRAM", 0)])
    assert eng.protocol == "nvlink_intra"
    peer = eng.add_peer(PeerInfo.from_dict(info))
    cp.cuda.runtime.deviceSynchronize()
    yield eng, peer, here, info, src_whole, src_addr
    eng.close()
    here.send(("exit",))
    here.poll(30) and here.recv()
    proc.join(30)


def _roundtrip(pair, descs, tag):
    eng, peer, conn, _, _, _ = pair
    t0 = time.perf_counter()
    eng.wait(eng.transfer_batch(peer, descs, notif=tag), timeout_s=60)
    seconds = time.perf_counter() - t0
    conn.send(("wait", "mc-init", tag, 60.0))
    assert conn.poll(90)
    kind, data = conn.recv()
    assert kind == "bytes", data
    return data, seconds


def test_scattered_vram_write_lands_byte_exact(pair):
    eng, _, _, info, src_whole, src_addr = pair
    dst = PeerInfo.from_dict(info).regions[0].addr  # = target allocation base + AT
    src_host = cp.asnumpy(src_whole)
    rng = np.random.default_rng(8)
    # 64 runs of odd sizes at odd offsets, disjoint on both sides, in another order at the target
    sizes = rng.integers(1, 64 << 10, 64)
    src_off = np.cumsum(np.concatenate([[0], sizes[:-1] + 7]))
    dst_off = 11 + rng.permutation(64) * ((64 << 10) + 13)  # shuffled slots, each holds a run
    descs = np.stack([src_addr + src_off, dst + dst_off, sizes], axis=1).astype(np.int64)
    got, _ = _roundtrip(pair, descs, b"scattered")
    want = np.full(NBYTES + 2 * AT, 0x5A, np.uint8)
    s0 = src_addr - int(src_whole.data.ptr)
    for so, do, n in zip(src_off, dst_off, sizes):
        want[AT + do:AT + do + n] = src_host[s0 + so:s0 + so + n]
    np.testing.assert_array_equal(got, want)


def test_one_descriptor_write_and_rate(pair):
    eng, _, _, info, src_whole, src_addr = pair
    dst = PeerInfo.from_dict(info).regions[0].addr
    n = NBYTES - 8192
    descs = np.array([[src_addr, dst, n]], np.int64)
    _roundtrip(pair, descs, b"warm")
    got, seconds = _roundtrip(pair, descs, b"big")
    s0 = src_addr - int(src_whole.data.ptr)
    np.testing.assert_array_equal(got[AT:AT + n], cp.asnumpy(src_whole[s0:s0 + n]))
    assert np.all(got[:AT] == 0x5A) and np.all(got[AT + n:] == 0x5A)
    print(f"Mooncake nvlink_intra, 1 descriptor of {n / 1e6:.0f} MB incl. notification: "
          f"{seconds * 1e3:.2f} ms, {n / seconds / 1e9:.1f} GB/s")


def test_host_memory_refused_on_nvlink_engine(pair):
    eng = pair[0]
    buf = np.zeros(4096, np.uint8)
    with pytest.raises(Exception, match="device memory only"):
        eng.register([buf])
