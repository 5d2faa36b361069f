"""The connector on device memory: CuPy and JAX GPU arrays as the caller's KV, NIXL VRAM."""
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

S = None


def _cluster(kind, direction, mode, n=2, item_lens=(1152, 64), page_size=16, pages=64, **sender_kw):
    import cupy as cp
    import jax.numpy as jnp

    from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender

    rng = np.random.default_rng()
    host_src = [rng.integers(0, 256, (pages, page_size, il), dtype=np.uint8) for il in item_lens]
    wrap = (lambda a: cp.asarray(a)) if kind == "cupy" else (lambda a: jnp.asarray(a, device=_gpu()))
    src = [wrap(a) for a in host_src]
    dst = [[wrap(np.full((pages, page_size, il), 0xA5, np.uint8)) for il in item_lens] for _ in range(n)]
    sender = KVSender(KVCacheSpec(len(item_lens), item_lens, page_size), src, engine="nixl", mode=mode,
                      pack_bytes=8 << 20, **sender_kw)
    recvs = []
    for r in range(n):
        recvs.append(KVReceiver(KVCacheSpec(len(item_lens), item_lens, page_size, n, r), dst[r],
                                engine="nixl", direction=direction))
        recvs[-1].connect(sender.address)
    return sender, recvs, host_src, dst


def _gpu():
    import jax

    return [d for d in jax.devices() if d.platform == "gpu"][0]


@pytest.mark.parametrize("kind", ["cupy", "jax"])
@pytest.mark.parametrize("direction, mode", [("push", "packed"), ("pull", "packed"), ("push", "direct")])
def test_device_kv_byte_exact(kind, direction, mode):
    from bridge.nixl import nixl_available
    from dcp_jax.transfer import TransferStatus

    if not nixl_available():
        pytest.skip("NIXL (CUDA build) not installed")
    sender, recvs, host_src, dst = _cluster(kind, direction, mode)
    try:
        L, P, n = 700, 16, 2
        src_table = np.random.default_rng().permutation(64)[: -(-L // P)]
        dst_tables = [np.random.default_rng().permutation(64)[: -(-(L // n + 1) // P)] for _ in range(n)]
        for r, recv in enumerate(recvs):
            recv.expect("g", dst_tables[r], L)
        sender.send("g", src_table, 0, 300)
        sender.send("g", src_table, 300, L)
        deadline = time.monotonic() + 60
        sides = [sender] + recvs
        while not all(s.poll("g").terminal for s in sides) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert [s.poll("g") for s in sides] == [TransferStatus.SUCCESS] * 3, sender.failure_reason("g")
        for r in range(n):
            got = [np.asarray(a.get() if hasattr(a, "get") else a) for a in dst[r]]
            for t in range(L):
                if t % n != r:
                    continue
                j = t // n
                for l in range(2):
                    np.testing.assert_array_equal(got[l][dst_tables[r][j // P], j % P],
                                                  host_src[l][src_table[t // P], t % P])
        assert sender.stats["kernel_compiles"] >= 0
    finally:
        for s in recvs + [sender]:
            s.close()


def test_device_pack_compiles_once_for_every_region():
    """Many requests of many sizes through the device pack: after `KVSender.warm_up` the
    sender's kernel compile counter stays constant (the region offset is traced)."""
    from bridge.nixl import nixl_available
    from dcp_jax.transfer import TransferStatus
    from pallas_kernels import compile_log

    if not nixl_available():
        pytest.skip("NIXL (CUDA build) not installed")
    sender, recvs, _, _ = _cluster("cupy", "push", "packed", pages=256)
    rng = np.random.default_rng()
    try:
        def one(rid, L):
            src_table = rng.permutation(256)[: -(-L // 16)]
            for r, recv in enumerate(recvs):
                recv.expect(rid, rng.permutation(256)[: -(-(L // 2 + 1) // 16)], L)
            sender.send(rid, src_table, 0, L)
            deadline = time.monotonic() + 30
            while not all(s.poll(rid).terminal for s in [sender] + recvs) and time.monotonic() < deadline:
                time.sleep(0.001)
            assert [s.poll(rid) for s in [sender] + recvs] == [TransferStatus.SUCCESS] * 3
            for s in [sender] + recvs:
                s.release(rid)
        sizes = [int(x) for x in rng.integers(1, 1024, 40)]
        # A request's two windows share a round only if both ranks announced it before the
        # round began; a window alone in its round has a smaller index bucket. warm_up compiles
        # every bucket a round of up to 1,024 rows can reach, writing nothing.
        warm = sender.warm_up(max_rows=1024)
        assert warm["pack"] == [64, 128, 256, 512, 1024, 2048] and warm["fused"] == [], warm
        one("warm1", 1)  # and a request: the connection's one-time work
        before = sender.stats["kernel_compiles"]
        grew = []
        for k, L in enumerate(sizes):
            c0 = sender.stats["kernel_compiles"]
            one(f"r{k}", L)
            if sender.stats["kernel_compiles"] != c0:
                grew.append((L, sender.stats["kernel_compiles"] - c0))
        assert sender.stats["kernel_compiles"] == before, \
            f"(request rows, kernels compiled): {grew}; last traces: {compile_log()[-4:]}"
    finally:
        for s in recvs + [sender]:
            s.close()


@pytest.mark.parametrize("kind, direction, mode", [
    ("cupy", "push", "region"), ("cupy", "pull", "region"), ("jax", "push", "region"),
    ("cupy", "push", "fused"), ("cupy", "pull", "fused"), ("cupy", "push", "auto")])
def test_region_and_fused_paths_byte_exact(kind, direction, mode):
    """The few-descriptor paths on device memory: ONE descriptor per window into the rank's
    receive region (unpacked by the Pallas scatter), or none at all (the fused copy kernel into
    the rank's IPC-mapped pages); "auto" picks fused for CuPy caches on one host."""
    from bridge.nixl import nixl_available
    from dcp_jax.transfer import TransferStatus

    if not nixl_available():
        pytest.skip("NIXL (CUDA build) not installed")
    sender, recvs, host_src, dst = _cluster(kind, direction, mode)
    try:
        L, P, n = 700, 16, 2
        rng = np.random.default_rng()
        src_table = rng.permutation(64)[: -(-L // P)]
        dst_tables = [rng.permutation(64)[: -(-(L // n + 1) // P)] for _ in range(n)]
        for r, recv in enumerate(recvs):
            recv.expect("g", dst_tables[r], L)
        sender.send("g", src_table, 0, 300)
        sender.send("g", src_table, 300, L)
        deadline = time.monotonic() + 60
        sides = [sender] + recvs
        while not all(s.poll("g").terminal for s in sides) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert [s.poll("g") for s in sides] == [TransferStatus.SUCCESS] * 3, \
            [(s.poll("g"), s.failure_reason("g")) for s in sides]
        want = "fused" if mode == "auto" else mode
        st = sender.request_stats("g")
        assert [v["path"] for v in st["ranks"].values()] == [want] * n
        for r in range(n):
            rows = (L - r + n - 1) // n
            assert st["ranks"][r]["descriptors"] == (2 if want == "region" else 0)  # one per chunk
            assert recvs[r].request_stats("g")["unpacks"] == (2 if want == "region" else 0)
            got = [np.asarray(a.get() if hasattr(a, "get") else a) for a in dst[r]]
            used = set(int(p) for p in dst_tables[r][: -(-rows // P)])
            for t in range(r, L, n):
                j = t // n
                for l in range(2):
                    np.testing.assert_array_equal(got[l][dst_tables[r][j // P], j % P],
                                                  host_src[l][src_table[t // P], t % P])
            for l in range(2):  # every other page still holds the sentinel
                others = [p for p in range(64) if p not in used]
                assert (got[l][others] == 0xA5).all()
                last = dst_tables[r][(rows - 1) // P]
                assert (got[l][last, (rows - 1) % P + 1:] == 0xA5).all()
            assert recvs[r].stats["region"]["in_use_bytes"] == 0
    finally:
        for s in recvs + [sender]:
            s.close()


@pytest.mark.parametrize("windowed", [True, False], ids=["one launch", "a launch a window"])
@pytest.mark.parametrize("notify", ["round", "write"])
def test_a_round_of_warmed_windows_to_four_ranks_byte_exact(notify, windowed, monkeypatch):
    """A round whose windows fall in the bucket `warm_up` compiled for the direct windowed launch
    goes in ONE launch where that kind is on (`Packer.windows_direct`, ``DCP_JAX_DIRECT_ON=windows``);
    with it off (the default), one direct launch a window (`Packer.launches_each`). Both ways a rank hears its window landed (``region_notify``;
    "round": the ``region_ask`` says ``ctl_done`` and the rank waits on its sockets): four ranks
    in one round, byte-exact, one descriptor a rank, every range back."""
    from bridge.nixl import nixl_available
    from dcp_jax.transfer import TransferStatus
    from pallas_kernels import triton_launch

    if not nixl_available():
        pytest.skip("NIXL (CUDA build) not installed")
    kinds = triton_launch._STATE["off_kinds"]  # "windows": off by default (DCP_JAX_DIRECT_ON turns it on)
    monkeypatch.setitem(triton_launch._STATE, "off_kinds", kinds - {"windows"} if windowed else kinds | {"windows"})
    n, P, L = 4, 16, 1024
    sender, recvs, host_src, dst = _cluster("cupy", "push", "region", n=n, region_notify=notify)
    try:
        assert sender.warm_up(max_rows=L // n, round_rows=L)["pack"]
        rng = np.random.default_rng()
        src_table = rng.permutation(64)[: L // P]
        dst_tables = [rng.permutation(64)[: L // n // P] for _ in range(n)]
        for r, recv in enumerate(recvs):
            recv.expect("w", dst_tables[r], L)
        def announced():  # every rank's expect reached the sender: its windows share one round
            try:
                return len(sender.request_stats("w")["ranks"]) == n
            except KeyError:
                return False

        deadline = time.monotonic() + 30
        while not announced():
            assert time.monotonic() < deadline
            time.sleep(0.002)
        sender.send("w", src_table, 0, L)
        sides = [sender] + recvs
        while not all(s.poll("w").terminal for s in sides) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert [s.poll("w") for s in sides] == [TransferStatus.SUCCESS] * (n + 1), \
            [(s.poll("w"), s.failure_reason("w")) for s in sides]
        st = sender.request_stats("w")
        assert st["launches"] == (1 if windowed else n), st
        assert [v["descriptors"] for v in st["ranks"].values()] == [1] * n, st
        for r in range(n):
            got = [np.asarray(a.get()) for a in dst[r]]
            for t in range(r, L, n):
                j = t // n
                for l in range(2):
                    np.testing.assert_array_equal(got[l][dst_tables[r][j // P], j % P],
                                                  host_src[l][src_table[t // P], t % P])
            assert recvs[r].stats["region"]["in_use_bytes"] == 0
    finally:
        for s in recvs + [sender]:
            s.close()
