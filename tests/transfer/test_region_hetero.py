"""Issue 15 at the connector: what two sides may differ in (page sizes), and what is refused (dtype).

Rows move as bytes, so both sides must agree on what the bytes are: the dtype is checked against
the caller's arrays at construction and between the sides at the handshake, with both names.
"""
import time

import numpy as np
import pytest

from conftest import SENTINEL, Cluster, TransferStatus

S = TransferStatus
from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender
from dcp_jax.transfer.memory import CacheLayers
from dcp_jax.transfer.spec import HandshakeError, check_compatible


def test_layer_dtype_must_be_the_spec_dtype():
    spec = KVCacheSpec(1, [32], 4, dtype="float8_e4m3fn")
    with pytest.raises(TypeError, match=r"kv_layers\[0\] has dtype float16, spec.dtype='float8_e4m3fn'"):
        CacheLayers(spec, [np.zeros((2, 4, 16), np.float16)])
    with pytest.raises(TypeError, match="dtype float32"):
        CacheLayers(KVCacheSpec(1, [32], 4), [np.zeros((2, 4, 8), np.float32)])  # default bfloat16
    # Declared right, or given as raw integer views of the bytes: accepted.
    assert CacheLayers(KVCacheSpec(1, [32], 4, dtype="float16"), [np.zeros((2, 4, 16), np.float16)]).kind == "numpy"
    for raw in (np.uint8, np.uint16, np.int8):
        n = 32 // np.dtype(raw).itemsize
        CacheLayers(spec, [np.zeros((2, 4, n), raw)])


def test_jax_bfloat16_layers_match_a_bfloat16_spec():
    import jax.numpy as jnp

    layers = [jnp.zeros((2, 4, 16), jnp.bfloat16)]
    assert CacheLayers(KVCacheSpec(1, [32], 4), layers).kind == "jax-cpu"
    with pytest.raises(TypeError, match="dtype bfloat16, spec.dtype='float16'"):
        CacheLayers(KVCacheSpec(1, [32], 4, dtype="float16"), layers)


def test_dtype_mismatch_names_both_dtypes():
    p = KVCacheSpec(1, [32], 4, dtype="bfloat16")
    d = KVCacheSpec(1, [32], 4, dtype="float8_e4m3fn")
    with pytest.raises(HandshakeError) as e:
        check_compatible(p, d)
    assert e.value.field == "dtype" and (e.value.ours, e.value.theirs) == ("bfloat16", "float8_e4m3fn")
    assert "'bfloat16'" in str(e.value) and "'float8_e4m3fn'" in str(e.value) and "never converts" in str(e.value)


def test_dtype_mismatch_is_refused_at_the_handshake(engine):
    c = Cluster(engine, dcp_size=1, connect=False)
    try:
        spec = KVCacheSpec(2, (48, 16), 4, dtype="float8_e4m3fn")
        with KVReceiver(spec, [np.zeros((4, 4, il), np.uint8) for il in (48, 16)], engine=engine) as recv:
            with pytest.raises(HandshakeError, match="never converts") as e:
                recv.connect(c.sender.address)
            assert (e.value.field, e.value.ours, e.value.theirs) == ("dtype", "float8_e4m3fn", "bfloat16")
    finally:
        c.close()



def test_sender_refuses_layers_of_another_dtype(engine):
    with pytest.raises(TypeError, match="spec.dtype"):
        KVSender(KVCacheSpec(1, [32], 4), [np.zeros((4, 4, 8), np.float32)], engine=engine)


@pytest.mark.parametrize("src_page, dst_page, mode, direction", [
    (4, 16, "packed", "push"), (16, 4, "region", "pull"), (3, 5, "direct", "push"), (8, 2, "region", "push")])
def test_page_sizes_may_differ_between_the_sides(engine, src_page, dst_page, mode, direction):
    # The schedule maps every token through each side's own page table and page size: rows land
    # byte-exact whatever the two page sizes (issue 15), in every path.
    rng = np.random.default_rng(7)
    n, inter, L, item_lens = 2, 2, 45, (48, 16)
    src_pages = -(-L // src_page) + 3
    src = [rng.integers(0, 256, (src_pages, src_page, il), dtype=np.uint8) for il in item_lens]
    sender = KVSender(KVCacheSpec(2, item_lens, src_page), src, engine=engine, mode=mode)
    recvs, dst, tables = [], [], []
    try:
        for r in range(n):
            rows = sum(1 for t in range(L) if (t // inter) % n == r)
            pages = -(-rows // dst_page) + 3
            dst.append([np.full((pages, dst_page, il), SENTINEL, np.uint8) for il in item_lens])
            recvs.append(KVReceiver(KVCacheSpec(2, item_lens, dst_page, n, r, inter), dst[r], engine=engine,
                                    direction=direction, region_bytes=1 << 20))
            recvs[-1].connect(sender.address)
            tables.append(rng.permutation(pages)[: -(-rows // dst_page)])
        src_table = rng.permutation(src_pages)[: -(-L // src_page)]
        for r, recv in enumerate(recvs):
            recv.expect("p", tables[r], L)
        sender.send("p", src_table, 0, 20)
        sender.send("p", src_table, 20, L)
        deadline = time.monotonic() + 10
        sides = [sender] + recvs
        while not all(s.poll("p").terminal for s in sides) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert [s.poll("p") for s in sides] == [S.SUCCESS] * 3, [s.failure_reason("p") for s in sides]
        written = [np.zeros(a.shape[:2], bool) for a in (d[0] for d in dst)]
        for t in range(L):
            r, j = (t // inter) % n, (t // (inter * n)) * inter + t % inter
            page, slot = tables[r][j // dst_page], j % dst_page
            written[r][page, slot] = True
            for l in range(2):
                np.testing.assert_array_equal(dst[r][l][page, slot], src[l][src_table[t // src_page], t % src_page])
        for r in range(n):  # every other row still holds the sentinel
            assert all((dst[r][l][~written[r]] == SENTINEL).all() for l in range(2))
        assert {v["path"] for v in sender.request_stats("p")["ranks"].values()} == {mode}
    finally:
        for s in recvs + [sender]:
            s.close()


def test_heads_are_recorded_checked_and_must_agree(engine):
    s = KVCacheSpec(2, (4096, 4096), 16, num_kv_heads=8, head_dim=128, layout="nhd", tp_size=2, tp_rank=1)
    assert KVCacheSpec.from_dict(s.to_dict()) == s
    assert KVCacheSpec(1, [1152], 64).head_dim is None  # MLA: the latent row is the head
    for bad, err in ((dict(num_kv_heads=0), ValueError), (dict(head_dim=0), ValueError), (dict(head_dim=2.0), TypeError)):
        with pytest.raises(err, match=next(iter(bad))):
            KVCacheSpec(1, [16], 4, **bad)
    c = Cluster(engine, dcp_size=1, connect=False)
    try:
        spec = KVCacheSpec(2, (48, 16), 4, num_kv_heads=2)
        with KVReceiver(spec, [np.zeros((4, 4, il), np.uint8) for il in (48, 16)], engine=engine) as recv:
            with pytest.raises(HandshakeError, match="different models") as e:
                recv.connect(c.sender.address)
            assert (e.value.field, e.value.ours, e.value.theirs) == ("num_kv_heads", 2, 1)
    finally:
        c.close()
