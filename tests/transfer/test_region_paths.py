"""Which transfer path a (sender, receiver) pair takes: the rule (`choose_path`) over every kind of
offer, and, through real engines, that the handshake applies it and the reports name it."""
import numpy as np
import pytest

from conftest import TransferStatus
from dcp_jax.transfer import KVCacheSpec, KVReceiver
from dcp_jax.transfer._region import PeerOffer, choose_path, fused_refusal, host_info
from dcp_jax.transfer.spec import HandshakeError
from test_region import cluster, region_free

S = TransferStatus
HERE = host_info()
ELSEWHERE = {"hostname": "another-host", "boot_id": "0000"}
ROW = 64


def offer(mem="DRAM", region=0, ipc=(), host=None):
    return PeerOffer(mem, 4096 if region else 0, region, tuple(ipc), dict(HERE if host is None else host))


def path(mode, sender_mem, off, interleave=1, page=4):
    return choose_path(mode, sender_mem=sender_mem, offer=off, dst_interleave=interleave, page_size=page,
                       row_bytes=ROW)


FAKE_IPC = ({"handle": "x"},)  # the rule only asks whether handles were offered


@pytest.mark.parametrize("sender_mem, off, interleave, want", [
    # hosts: pages stay whole (interleave a multiple of the page) -> direct, no copy at all
    ("DRAM", offer(), 4, "direct"),
    ("DRAM", offer(region=1 << 20), 8, "direct"),
    # hosts, pages split: region when offered, else packed
    ("DRAM", offer(region=1 << 20), 1, "region"),
    ("DRAM", offer(), 1, "packed"),
    ("DRAM", offer(region=ROW - 1), 1, "packed"),  # a region below one token is no region
    # GPU to GPU on this host with IPC handles: fused, whatever else is offered
    ("VRAM", offer("VRAM", 1 << 20, FAKE_IPC), 4, "fused"),
    ("VRAM", offer("VRAM", 0, FAKE_IPC), 1, "fused"),
    # GPU, no fused (another host, or no handles): region even when pages stay whole
    ("VRAM", offer("VRAM", 1 << 20, FAKE_IPC, ELSEWHERE), 4, "region"),
    ("VRAM", offer("VRAM", 1 << 20), 4, "region"),
    ("VRAM", offer("DRAM", 1 << 20), 1, "region"),
    ("VRAM", offer("VRAM"), 4, "direct"),
    ("VRAM", offer("VRAM"), 1, "packed"),
])
def test_auto_path_rule(sender_mem, off, interleave, want):
    assert path("auto", sender_mem, off, interleave) == want


def test_explicit_paths_are_taken_or_refused_with_the_reason():
    assert path("packed", "VRAM", offer("VRAM", 1 << 20, FAKE_IPC), 4) == "packed"
    assert path("direct", "DRAM", offer(region=1 << 20), 1) == "direct"
    assert path("region", "DRAM", offer(region=ROW), 4) == "region"
    with pytest.raises(HandshakeError, match="receive region of 0 bytes") as e:
        path("region", "DRAM", offer(), 1)
    assert e.value.field == "path"
    for sender_mem, off, why in [("DRAM", offer("VRAM", 0, FAKE_IPC), "sender's KV layers are in host"),
                                 ("VRAM", offer("DRAM", 0, FAKE_IPC), "receiver's KV layers are in host"),
                                 ("VRAM", offer("VRAM"), "no CUDA IPC handles"),
                                 ("VRAM", offer("VRAM", 0, FAKE_IPC, ELSEWHERE), "another host")]:
        assert why in fused_refusal(sender_mem, off)
        with pytest.raises(HandshakeError, match=why) as e:
            path("fused", sender_mem, off)
        assert e.value.field == "path"
    with pytest.raises(ValueError, match="mode"):
        path("fastest", "DRAM", offer())


@pytest.mark.parametrize("region_bytes, interleave, want", [
    (64 << 20, 1, "region"), (0, 1, "packed"), (64 << 20, 4, "direct")])
def test_handshake_applies_the_rule_and_reports_name_the_path(engine, region_bytes, interleave, want):
    c = cluster(engine, dcp_size=2, interleave_size=interleave, region_bytes=region_bytes)
    try:
        L = 18
        src, dst = c.tables(L)
        c.expect("p", dst, L)
        c.sender.send("p", src, 0, L)
        assert c.wait("p") == [S.SUCCESS] * 3, c.reasons("p")
        assert c.check_bytes(src, dst, L) == L
        st = c.sender.request_stats("p")
        assert [v["path"] for v in st["ranks"].values()] == [want, want]
        assert {v["strategy"] for v in st["ranks"].values()} == {want}
        for recv in c.receivers:
            rs = recv.request_stats("p")
            assert rs["paths"] == [want]
            assert (rs["unpacks"] > 0) == (want == "region") and region_free(recv)
    finally:
        c.close()


def test_region_path_refused_when_the_receiver_offers_none(engine):
    c = cluster(engine, dcp_size=1, mode="region", region_bytes=0, connect=False)
    try:
        with pytest.raises(HandshakeError) as e:
            c.receivers[0].connect(c.sender.address)
        assert e.value.field == "path" and "receive region of 0 bytes" in str(e.value)
        assert c.receivers[0].stats["connections"] == 0
    finally:
        c.close()


def test_fused_path_refused_on_host_memory(engine):
    c = cluster(engine, dcp_size=1, mode="fused", connect=False)
    try:
        with pytest.raises(HandshakeError, match="host memory") as e:
            c.receivers[0].connect(c.sender.address)
        assert e.value.field == "path"
    finally:
        c.close()


def test_host_receivers_offer_no_region_by_default_and_gpu_size_is_checked(engine):
    spec = KVCacheSpec(1, [16], 4)
    r = KVReceiver(spec, [np.zeros((2, 4, 16), np.uint8)], engine=engine)
    try:
        assert r.stats["region"]["capacity"] == 0
    finally:
        r.close()
    # Smaller than one token's 16 bytes: refused by name (it was turned into "no region" without
    # a word, and a region-mode sender then read "a receive region of 0 bytes").
    with pytest.raises(ValueError, match="region_bytes=15 is less than one token's 16 bytes"):
        KVReceiver(spec, [np.zeros((2, 4, 16), np.uint8)], engine=engine, region_bytes=15)
