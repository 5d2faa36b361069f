"""The connector's staging on device memory: CuPy KV that a side does not register (staging="host",
or an engine that cannot register VRAM: jax-transfer under "auto"), windows gathered on the
device by each pack backend, copied through pinned host memory; byte-exact, reported per request."""
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ITEMS = (1152, 128)  # 128-B multiples: gpu-mosaic takes them too


def _run(engine, s_stage, r_stage, backend, L=700, n=2, page_size=16, pages=64):
    import cupy as cp

    from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender, TransferStatus

    rng = np.random.default_rng(14)
    host_src = [rng.integers(0, 256, (pages, page_size, il), dtype=np.uint8) for il in ITEMS]
    src = [cp.asarray(a) for a in host_src]
    dst = [[cp.full((pages, page_size, il), 0xA5, cp.uint8) for il in ITEMS] for _ in range(n)]
    sender = KVSender(KVCacheSpec(len(ITEMS), ITEMS, page_size), src, engine=engine, pack_bytes=8 << 20,
                      staging=s_stage, pack_backend=backend, timeout_s=60)
    recvs = []
    try:
        for r in range(n):
            recvs.append(KVReceiver(KVCacheSpec(len(ITEMS), ITEMS, page_size, n, r), dst[r], engine=engine,
                                    staging=r_stage, region_bytes=8 << 20, timeout_s=60))
            recvs[-1].connect(sender.address)
        src_table = rng.permutation(pages)[: -(-L // page_size)]
        dst_tables = [rng.permutation(pages)[: -(-(L // n + 1) // page_size)] for _ in range(n)]
        for r, recv in enumerate(recvs):
            recv.expect("g", dst_tables[r], L)
        cut = min(300, L // 2)  # two chunks whatever L is
        sender.send("g", src_table, 0, cut)
        sender.send("g", src_table, cut, L)
        deadline = time.monotonic() + 60
        sides = [sender] + recvs
        while not all(s.poll("g").terminal for s in sides) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert [s.poll("g") for s in sides] == [TransferStatus.SUCCESS] * 3, \
            [s.failure_reason("g") for s in sides]
        for r in range(n):
            got = [a.get() for a in dst[r]]
            for t in range(r, L, n):
                j = t // n
                for l in range(len(ITEMS)):
                    np.testing.assert_array_equal(got[l][dst_tables[r][j // page_size], j % page_size],
                                                  host_src[l][src_table[t // page_size], t % page_size])
        return sender.request_stats("g"), [rv.request_stats("g") for rv in recvs]
    finally:
        for s in recvs + [sender]:
            s.close()


def _need(engine):
    if engine == "nixl":
        from bridge.nixl import nixl_available

        if not nixl_available():
            pytest.skip("NIXL (CUDA build) not installed")


@pytest.mark.parametrize("s_stage, r_stage, backend", [
    ("host", "host", "auto"), ("host", "host", "gpu-triton"), ("host", "host", "gpu-mosaic"),
    ("host", "host", "xla"), ("host", "none", "auto"), ("none", "host", "gpu-triton"),
])
def test_staged_device_kv_through_nixl(s_stage, r_stage, backend):
    _need("nixl")
    st, rs = _run("nixl", s_stage, r_stage, backend)
    sides = dict(prefill="staged" if s_stage == "host" else "direct", decode="staged" if r_stage == "host" else "direct")
    assert all(rk["staging"] == sides for rk in st["ranks"].values())
    assert all(rk["path"] == "region" for rk in st["ranks"].values())  # a staged side's pages are not registered
    if backend != "auto":
        assert st["pack_backend"] == backend
    if s_stage == "host":
        assert st["stage_seconds"] > 0  # device -> pinned host copies happened
    if r_stage == "host":
        assert all(r["stage_seconds"] > 0 for r in rs)


def test_jax_transfer_stages_device_kv_under_auto():
    """jax-transfer registers host memory only: under staging="auto" both sides stage by themselves."""
    st, rs = _run("jax-transfer", "auto", "auto", "auto", L=300)
    assert all(rk["staging"] == dict(prefill="staged", decode="staged") for rk in st["ranks"].values())
    assert all(r["staging"] == [dict(prefill="staged", decode="staged")] for r in rs)
