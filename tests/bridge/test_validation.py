"""Descriptor validation before anything is sent, on both engines, plus the pure range checks."""
import pickle
import re
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _peer_worker as pw
from bridge import (
    BridgeError,
    DescriptorError,
    MemoryRegion,
    PeerError,
    PeerInfo,
    RegistrationError,
    TransferError,
    TransferTimeout,
    as_region,
    make_engine,
    validate_descriptors,
)
from bridge.base import RegionTable


# ---------------------------------------------------------------------------------------------
# Pure checks (no engine)
# ---------------------------------------------------------------------------------------------
def _brute_locate(regions, addrs, lens):
    out = []
    for a, n in zip(addrs, lens):
        hit = [i for i, r in enumerate(regions) if r.addr <= a and a + n <= r.end]
        out.append(hit)
    return out


@settings(max_examples=150, deadline=None)
@given(
    regions=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 120)), min_size=0, max_size=8),
    queries=st.lists(st.tuples(st.integers(0, 600), st.integers(1, 150)), min_size=1, max_size=40),
)
def test_region_table_matches_brute_force(regions, queries):
    """Overlapping and nested regions included: a range is accepted iff one region holds it whole."""
    regs = [MemoryRegion(a, n) for a, n in regions]
    table = RegionTable(regs)
    addrs = np.array([q[0] for q in queries], np.int64)
    lens = np.array([q[1] for q in queries], np.int64)
    got = table.locate(addrs, lens)
    for g, hits in zip(got, _brute_locate(regs, addrs, lens)):
        if hits:
            assert g in hits
        else:
            assert g == -1


@settings(max_examples=150, deadline=None)
@given(
    regions=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 120)), min_size=0, max_size=8),
    remote=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 120)), min_size=0, max_size=4),
    desc=st.tuples(st.integers(-5, 600), st.integers(-5, 600), st.integers(-3, 150)),
)
def test_one_descriptor_path_answers_as_the_vectorised_one(regions, remote, desc):
    """A one-descriptor batch (a region write) is checked with Python integers (`locate_one`):
    the same region indices as `locate`, and the same DescriptorError where a check fails."""
    lt, rt = RegionTable([MemoryRegion(a, n) for a, n in regions]), RegionTable([MemoryRegion(a, n) for a, n in remote])
    la, ra, n = desc
    if la >= 0 and n > 0:
        want = lt.locate(np.array([la], np.int64), np.array([n], np.int64))[0]
        assert lt.locate_one(la, n) == want
    one = np.array([desc], np.int64)
    two = np.array([desc, desc], np.int64)  # the vectorised path (two rows), as the reference
    try:
        ref = validate_descriptors(two, lt, rt)
    except DescriptorError as exc:
        with pytest.raises(DescriptorError) as got:
            validate_descriptors(one, lt, rt)
        digits = re.compile(r"\d+")  # counts differ (1 vs 2 rows); the check that failed does not
        assert digits.sub("N", str(got.value)) == digits.sub("N", str(exc))
        return
    d, li, ri = validate_descriptors(one, lt, rt)
    assert d.tolist() == [list(desc)] and li.tolist() == ref[1][:1].tolist() and ri.tolist() == ref[2][:1].tolist()
    assert li.dtype == ri.dtype == np.int64


def test_adjacent_regions_do_not_merge():
    """A range spanning two back-to-back registrations is refused (each engine needs one region)."""
    table = RegionTable([MemoryRegion(1000, 100), MemoryRegion(1100, 100)])
    got = table.locate(np.array([1000, 1100, 1050], np.int64), np.array([100, 100, 100], np.int64))
    assert got.tolist() == [0, 1, -1]


def test_250k_descriptors_validate_fast():
    """The token round-robin worst case of one (chunk, rank): 249,856 descriptors."""
    rng = np.random.default_rng(0)
    item = 1152
    local = [MemoryRegion(0x10_0000_0000 + k * (1 << 30), 4096 * item) for k in range(61)]
    remote = [MemoryRegion(0x20_0000_0000 + k * (1 << 30), 4096 * item) for k in range(61)]
    n = 249_856
    layer = rng.integers(0, 61, n)
    descs = np.stack([
        np.array([r.addr for r in local])[layer] + rng.integers(0, 4096, n) * item,
        np.array([r.addr for r in remote])[layer] + rng.integers(0, 4096, n) * item,
        np.full(n, item)], axis=1).astype(np.int64)
    lt, rt = RegionTable(local), RegionTable(remote)
    validate_descriptors(descs, lt, rt)  # warm up
    t0 = time.perf_counter()
    d, li, ri = validate_descriptors(descs, lt, rt)
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.5, f"validation of {n} descriptors took {elapsed:.3f} s"
    np.testing.assert_array_equal(li, layer)
    np.testing.assert_array_equal(ri, layer)
    descs[n // 2, 2] = 4097 * item  # one overrun anywhere is caught and located
    with pytest.raises(DescriptorError, match=f"1 of {n} local ranges.*row {n // 2}"):
        validate_descriptors(descs, lt, rt)


def test_memory_region_rejects_bad_fields():
    with pytest.raises(ValueError, match="nbytes"):
        MemoryRegion(4096, 0)
    with pytest.raises(ValueError, match="addr"):
        MemoryRegion(-1, 8)
    with pytest.raises(ValueError, match="mem_type"):
        MemoryRegion(4096, 8, "HBM")
    with pytest.raises(ValueError, match="device_id"):
        MemoryRegion(4096, 8, "VRAM", -1)
    with pytest.raises(TypeError, match="nbytes"):
        MemoryRegion(4096, 8.0)
    with pytest.raises(TypeError, match="obj"):
        as_region("not a buffer")
    with pytest.raises(TypeError, match="C-contiguous"):
        as_region(np.zeros((4, 4), np.uint8)[:, ::2])
    arr = np.zeros(100, np.uint8)
    assert as_region(arr) == MemoryRegion(arr.ctypes.data, 100, "DRAM", 0)


def test_peer_info_and_errors_pickle():
    info = PeerInfo("nixl", "p", "", b"\x00md", (MemoryRegion(4096, 64),))
    assert pickle.loads(pickle.dumps(info)) == info
    err = TransferTimeout("late", peer="p", num_descriptors=5, engine_message="PROC", dcp_rank=2, chunk=1)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is TransferTimeout and (back.peer, back.dcp_rank, back.chunk) == ("p", 2, 1)
    assert "dcp_rank=2" in str(back) and "chunk=1" in str(back) and "PROC" in str(back)
    ctx = TransferError("x", peer="p", num_descriptors=1).with_context(dcp_rank=7, chunk=3)
    assert (ctx.dcp_rank, ctx.chunk) == (7, 3)
    assert issubclass(DescriptorError, ValueError)


def test_make_engine_rejects_unknown_kind():
    with pytest.raises(ValueError, match="engine="):
        make_engine("rdma-pigeon", "x")


# ---------------------------------------------------------------------------------------------
# On each engine: nothing is sent for a bad batch
# ---------------------------------------------------------------------------------------------
def _good(p, n=16):
    descs, _, _ = pw.scattered_descs(p.src.ctypes.data, p.dst.ctypes.data, n, pw.ITEM, seed=2)
    return descs


def _assert_nothing_sent(p):
    assert p.ini.counters.batches == 0 and p.ini.counters.engine_calls == 0
    assert p.ini.outstanding == 0
    assert not p.dst.any()


@pytest.mark.timeout(30)
def test_local_range_outside_registration_is_refused(two_connected_engines):
    p = two_connected_engines
    p.fill(seed=1)
    descs = _good(p)
    descs[3, 0] = p.src.ctypes.data + p.src.nbytes - 100  # overruns the registered end
    with pytest.raises(DescriptorError, match="local ranges.*row 3"):
        p.ini.transfer_batch(p.peer, descs)
    _assert_nothing_sent(p)


def test_huge_length_cannot_wrap_past_the_region_check():
    # addr + nbytes would wrap int64 and look "inside" the region; the check must not add them.
    a, b = 0x10000, 0x20000
    local, remote = RegionTable([MemoryRegion(a, 4096)]), RegionTable([MemoryRegion(b, 4096)])
    huge = np.iinfo(np.int64).max - a + 100
    assert (local.locate(np.array([a + 10]), np.array([huge])) == -1).all()
    assert (remote.locate(np.array([b + 10]), np.array([np.iinfo(np.int64).max - b])) == -1).all()
    with pytest.raises(DescriptorError, match="local ranges"):
        validate_descriptors(np.array([[a + 10, b, huge]], np.int64), local, remote)


def test_huge_length_is_refused_before_sending(two_connected_engines):
    p = two_connected_engines
    descs = _good(p)
    descs[0, 2] = np.iinfo(np.int64).max - min(int(descs[0, 0]), int(descs[0, 1])) + 16
    with pytest.raises(DescriptorError):
        p.ini.transfer_batch(p.peer, descs)
    _assert_nothing_sent(p)


@pytest.mark.timeout(30)
def test_unregistered_local_buffer_is_refused(two_connected_engines):
    """Mooncake's TCP transport would read this memory and send it; the bridge refuses first."""
    p = two_connected_engines
    p.fill(seed=2)
    secret = np.full(pw.ITEM * 4, 0xAB, np.uint8)  # never registered
    descs = _good(p, 4)
    descs[:, 0] = secret.ctypes.data + np.arange(4) * pw.ITEM
    with pytest.raises(DescriptorError, match="4 of 4 local ranges"):
        p.ini.transfer_batch(p.peer, descs)
    _assert_nothing_sent(p)


@pytest.mark.timeout(30)
def test_remote_range_outside_peer_regions_is_refused(two_connected_engines):
    p = two_connected_engines
    p.fill(seed=3)
    descs = _good(p)
    descs[-1, 1] = p.dst.ctypes.data - pw.ITEM  # just before the peer's region
    with pytest.raises(DescriptorError, match="remote ranges.*advertised"):
        p.ini.transfer_batch(p.peer, descs)
    _assert_nothing_sent(p)


@pytest.mark.timeout(30)
def test_malformed_batches_are_refused(two_connected_engines):
    p = two_connected_engines
    p.fill(seed=4)
    descs = _good(p)
    zero = descs.copy()
    zero[5, 2] = 0
    with pytest.raises(DescriptorError, match="nbytes <= 0.*row 5"):
        p.ini.transfer_batch(p.peer, zero)
    neg = descs.copy()
    neg[0, 2] = -8
    with pytest.raises(DescriptorError, match="nbytes <= 0"):
        p.ini.transfer_batch(p.peer, neg)
    with pytest.raises(DescriptorError, match="shape"):
        p.ini.transfer_batch(p.peer, descs[:, :2])
    with pytest.raises(TypeError, match="dtype"):
        p.ini.transfer_batch(p.peer, descs.astype(np.float64))
    with pytest.raises(TypeError, match="numpy"):
        p.ini.transfer_batch(p.peer, descs.tolist())
    with pytest.raises(TypeError, match="notif"):
        p.ini.transfer_batch(p.peer, descs, notif="text")
    _assert_nothing_sent(p)


@pytest.mark.timeout(30)
def test_unknown_peer_and_wrong_engine_kind_are_refused(two_connected_engines):
    p = two_connected_engines
    p.fill(seed=5)
    with pytest.raises(PeerError, match="not a known peer"):
        p.ini.transfer_batch("nobody", _good(p))
    with pytest.raises(PeerError, match="not a known peer"):
        p.ini.remove_peer("nobody")
    other = "mooncake" if p.kind == "nixl" else "nixl"
    with pytest.raises(PeerError, match="engine"):
        p.ini.add_peer(PeerInfo(other, "x", "127.0.0.1:1", b"", ()))
    with pytest.raises(TypeError, match="PeerInfo"):
        p.ini.add_peer({"name": "x"})
    _assert_nothing_sent(p)


@pytest.mark.timeout(30)
def test_overlapping_registration_is_refused(two_connected_engines):
    p = two_connected_engines
    inner = MemoryRegion(p.src.ctypes.data + 64, 128)
    with pytest.raises(RegistrationError, match="overlaps"):
        p.ini.register([inner])
    with pytest.raises(RegistrationError, match="not registered"):
        p.ini.deregister([inner])
    assert len(p.ini.regions) == 1


@pytest.mark.timeout(30)
def test_transfer_to_deregistered_region_is_refused(two_connected_engines):
    """NIXL would still write through stale metadata; Mooncake's peer would reject it late. With
    the peer's refreshed PeerInfo the bridge refuses before sending."""
    p = two_connected_engines
    p.fill(seed=6)
    extra = np.zeros(32 * pw.ITEM, np.uint8)
    p.tgt.register([extra])
    p.ini.add_peer(p.tgt.peer_info())
    rows = np.arange(32)
    descs = np.stack([p.src.ctypes.data + rows * pw.ITEM, extra.ctypes.data + rows * pw.ITEM,
                      np.full(32, pw.ITEM)], axis=1).astype(np.int64)
    p.ini.wait(p.ini.transfer_batch(p.peer, descs), timeout_s=10)
    np.testing.assert_array_equal(extra, p.src[: extra.size])
    p.tgt.deregister([extra])
    extra[:] = 0
    p.ini.add_peer(p.tgt.peer_info())  # the refresh the peer sends after deregistering
    p.ini.reset_counters()
    with pytest.raises(DescriptorError, match="32 of 32 remote ranges"):
        p.ini.transfer_batch(p.peer, descs)
    assert not extra.any()
    _assert_nothing_sent(p)
    # the still-registered region keeps working
    p.ini.wait(p.ini.transfer_batch(p.peer, _good(p)), timeout_s=10)


@pytest.mark.timeout(30)
def test_wait_arguments_are_checked(two_connected_engines):
    p = two_connected_engines
    p.fill(seed=7)
    h = p.ini.transfer_batch(p.peer, _good(p, 4))
    with pytest.raises(ValueError, match="timeout_s"):
        p.ini.wait(h, timeout_s=0)
    with pytest.raises(TypeError, match="handle"):
        p.ini.wait("handle")
    p.ini.wait(h, timeout_s=10)
    with pytest.raises(BridgeError, match="already waited"):
        p.ini.wait(h)
    with pytest.raises(ValueError, match="notif"):
        p.ini.transfer_batch(p.peer, _good(p, 4), notif=b"")


def test_make_engine_auto_prefers_nixl():
    from bridge import available_engines

    avail = available_engines()
    assert avail, "CI installs at least one engine"
    with make_engine("auto", "auto-pick") as eng:
        assert eng.kind == avail[0]
        assert eng.peer_info().engine == avail[0]
