"""Direct or staged per side and per peer (`dcp_jax.transfer.staging`), the pack backend as a
`KVSender` option: the rule over every pair, and byte-exact transfers through the real engines
(NIXL, Mooncake) with each side staged or direct, reported per request."""
import numpy as np
import pytest

from conftest import Cluster, TransferStatus
from dcp_jax.transfer import KVCacheSpec, KVReceiver, KVSender
from dcp_jax.transfer._region import PeerOffer, choose_path
from dcp_jax.transfer.spec import HandshakeError
from dcp_jax.transfer.staging import engine_registers, side_staged

S = TransferStatus
ROW = 64


def _path(mode, *, recv_staged=False, sender_staged=False, region=1 << 20, interleave=1):
    off = PeerOffer("DRAM", 4096 if region else 0, region, (), {}, recv_staged)
    return choose_path(mode, sender_mem="DRAM", offer=off, dst_interleave=interleave, page_size=4,
                       row_bytes=ROW, sender_staged=sender_staged)


@pytest.mark.parametrize("recv_staged, sender_staged, region, interleave, want", [
    (True, False, 1 << 20, 4, "region"),   # whole pages would go direct, but the pages are not registered
    (True, True, 1 << 20, 1, "region"),
    (False, True, 1 << 20, 4, "region"),   # a staged sender: no descriptor from its pages
    (False, True, 0, 4, "packed"),
    (False, False, 0, 4, "direct"),        # neither stages: the ordinary rule
])
def test_auto_path_when_a_side_stages(recv_staged, sender_staged, region, interleave, want):
    assert _path("auto", recv_staged=recv_staged, sender_staged=sender_staged, region=region,
                 interleave=interleave) == want


@pytest.mark.parametrize("mode, recv_staged, sender_staged, region, match", [
    ("packed", True, False, 1 << 20, "receiver stages .* takes region"),
    ("direct", True, False, 1 << 20, "receiver stages"),
    ("direct", False, True, 1 << 20, "sender stages .* takes packed or region"),
    ("fused", False, True, 1 << 20, "sender stages"),
    ("auto", True, False, 0, "offers no receive region"),
])
def test_paths_a_staged_side_cannot_take_are_refused(mode, recv_staged, sender_staged, region, match):
    with pytest.raises(HandshakeError, match=match) as e:
        _path(mode, recv_staged=recv_staged, sender_staged=sender_staged, region=region)
    assert e.value.field == "path"
    assert _path("packed", sender_staged=True, region=0) == "packed"


def test_side_staged_rule():
    assert engine_registers("jax-transfer", "DRAM") and not engine_registers("jax-transfer", "VRAM")
    assert engine_registers("nixl", "VRAM")
    assert side_staged("host", "nixl", "DRAM") and not side_staged("auto", "nixl", "DRAM")
    assert side_staged("auto", "jax-transfer", "VRAM") and not side_staged("none", "nixl", "VRAM")
    with pytest.raises(ValueError, match="staging='none'.*jax-transfer.*VRAM"):
        side_staged("none", "jax-transfer", "VRAM")
    with pytest.raises(ValueError, match="staging='disk'"):
        side_staged("disk", "nixl", "DRAM")


def _registered(side):
    return {(r.addr, r.nbytes) for r in side.engine._regions}


# (sender staging, receiver staging, pack backend, KV kind, path the connector picks)
CASES = [
    ("host", "host", "xla", "jax", "region"),
    ("host", "none", "auto", "numpy", "packed"),
    ("none", "host", "host", "numpy", "region"),
    ("none", "none", "xla", "jax", "packed"),
]


# NIXL takes every case; Mooncake (seconds per connection setup) the two staged receivers.
MATRIX = [("nixl",) + c for c in CASES] + [("mooncake",) + c for c in CASES if c[1] == "host"]


@pytest.mark.parametrize("engine, s_stage, r_stage, backend, kind, want", MATRIX)
def test_staged_and_direct_byte_exact_and_reported(engine, s_stage, r_stage, backend, kind, want):
    c = Cluster(engine, dcp_size=2, item_lens=(48, 16), page_size=4, pages=40, kind=kind, seed=14,
                staging=s_stage, pack_backend=backend, receiver_kw=dict(staging=r_stage, region_bytes=4096 if r_stage == "host" else 0))
    try:
        L = 37  # pages split (interleave 1) and a partial last page
        src, dst = c.tables(L)
        c.expect("s", dst, L)
        c.sender.send("s", src, 0, 20)  # two chunks: the second reuses the staging buffers
        c.sender.send("s", src, 20, L)
        assert c.wait("s") == [S.SUCCESS] * 3, c.reasons("s")
        assert c.check_bytes(src, dst, L) == L
        for r in range(2):
            assert c.sentinel_pages(r, dst[r])
        st = c.sender.request_stats("s")
        assert st["pack_backend"] == ("host" if backend == "auto" else backend)
        sides = dict(prefill="staged" if s_stage == "host" else "direct",
                     decode="staged" if r_stage == "host" else "direct")
        assert all(rk["path"] == want and rk["staging"] == sides for rk in st["ranks"].values())
        for recv in c.receivers:
            rs = recv.request_stats("s")
            assert rs["paths"] == [want] and rs["staging"] == [sides]
        # A staged side registers no byte of its KV: only its pack buffer / receive region.
        kv = {(int(b), 40 * 4 * il) for b, il in zip(c.sender._layers.bases, c.item_lens)}
        assert (kv <= _registered(c.sender)) == (s_stage == "none")
        rkv = {(int(b), 40 * 4 * il) for b, il in zip(c.receivers[0]._layers.bases, c.item_lens)}
        assert (rkv <= _registered(c.receivers[0])) == (r_stage == "none")
    finally:
        c.close()


def test_staged_pull_direction():
    """A staged receiver READs its windows into its receive region from the sender's pack."""
    c = Cluster("nixl", dcp_size=2, kind="jax", seed=15, direction="pull", staging="host",
                receiver_kw=dict(staging="host"))
    try:
        L = 30
        src, dst = c.tables(L)
        c.expect("p", dst, L)
        c.sender.send("p", src, 0, L)
        assert c.wait("p") == [S.SUCCESS] * 3, c.reasons("p")
        assert c.check_bytes(src, dst, L) == L
        assert all(rk["path"] == "region" for rk in c.sender.request_stats("p")["ranks"].values())
    finally:
        c.close()


def test_bad_staging_and_pack_backend_are_refused_naming_the_argument():
    engine = "nixl"
    spec = KVCacheSpec(1, (16,), 4)
    kv = [np.zeros((4, 4, 16), np.uint8)]
    with pytest.raises(ValueError, match="pack_backend='nope'"):
        KVSender(spec, kv, engine=engine, pack_backend="nope")
    with pytest.raises(ValueError, match="pack_backend='gpu-mosaic-interpret'.*128 B"):
        KVSender(spec, kv, engine=engine, pack_backend="gpu-mosaic-interpret")
    with pytest.raises(ValueError, match="mode='direct' needs the KV registered"):
        KVSender(spec, kv, engine=engine, staging="host", mode="direct")
    with pytest.raises(ValueError, match="staging='disk'"):
        KVReceiver(spec, kv, engine=engine, staging="disk")
    with pytest.raises(ValueError, match="region_bytes=0 .* staged receiver"):
        KVReceiver(spec, kv, engine=engine, staging="host", region_bytes=0)
