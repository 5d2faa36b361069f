"""GPU: the fused fan-out and `pack_rows` launched without JAX's dispatch
(`pallas_kernels.triton_launch`): the same Pallas kernels, compiled by Triton from the modules JAX
lowered, on their own CuPy stream.

Byte-exact against CuPy fancy indexing over rounds of any sizes (JAX's launch too, once turned
off); the flag page bumped on that stream reads the round's number only once every row landed
(the host spins on it while the copy runs); a `RowCopier.copy` through JAX after a direct launch
into the same rows lands last (one order across the two streams).

Run on a CUDA machine: `python -m pytest tests/gpu -q` (skipped without a GPU).
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
cp = pytest.importorskip("cupy")
pytest.importorskip("triton")

from bridge.host_flag import SharedFlag, seq_done  # noqa: E402
from pallas_kernels import (PackSource, RowCopier, RowUnpacker, copy_fanout, pack_rows, synchronize,  # noqa: E402
                            triton_launch)
from pallas_kernels import device  # noqa: E402

if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (JAX sees none)", allow_module_level=True)


def _layers(rows, item, L, fill=None, seed=0):
    """L layers u8[rows, item], back to back in one allocation."""
    if fill is None:
        buf = cp.random.RandomState(seed).randint(0, 256, L * rows * item, dtype=cp.int32).astype(cp.uint8)
    else:
        buf = cp.full(L * rows * item, fill, cp.uint8)
    return [buf[l * rows * item:(l + 1) * rows * item].reshape(rows, item) for l in range(L)]


def _round(copiers, src, dsts, want, sizes, rng):
    jobs = []
    for c, d, w, n in zip(copiers, dsts, want, sizes):
        sidx = rng.integers(0, src[0].shape[0], n)
        didx = rng.permutation(d[0].shape[0])[:n]
        for s_, w_ in zip(src, w):
            w_[cp.asarray(didx)] = s_[cp.asarray(sidx)]
        jobs.append((c, sidx, didx))
    return jobs


@pytest.mark.parametrize("direct", [True, False], ids=["triton launcher", "jax dispatch"])
def test_fanout_byte_exact_over_rounds(direct, monkeypatch):
    if not direct:
        monkeypatch.setitem(triton_launch._STATE, "off", True)
    elif triton_launch._STATE["off"]:
        pytest.fail(f"direct launches are off in this process: {triton_launch._STATE['why']}")
    L, item = 6, 1152
    src = _layers(700, item, L, seed=5)
    dsts = [_layers(rows, item, L, fill=0x30 + k) for k, rows in enumerate((300, 256, 64))]
    source = PackSource(src)
    copiers = [RowCopier(source, d) for d in dsts]  # one source: one launch
    want = [[cp.array(a) for a in d] for d in dsts]
    rng = np.random.default_rng()
    for sizes in [(300, 0, 64), (1, 256, 0), (150, 100, 33)]:
        assert copy_fanout(_round(copiers, src, dsts, want, sizes, rng), checked=True) == sum(sizes)
        assert (copiers[0].destinations().direct is not None) == direct
    synchronize([d[0] for d in dsts])
    for d, w in zip(dsts, want):
        for a, b in zip(d, w):
            assert bool(cp.array_equal(a, b))
    for c in copiers:
        c.close()


def test_flag_bumped_on_the_launch_stream_reads_done_only_after_every_row():
    if triton_launch._STATE["off"]:
        pytest.fail(f"direct launches are off in this process: {triton_launch._STATE['why']}")
    L, item, R = 61, 1152, 16384  # ~1.1 GB read and written: a copy of ~1 ms
    src = _layers(R, item, L, seed=9)
    source = PackSource(src)
    dsts = [_layers(R // 2, item, L, fill=0) for _ in range(2)]
    copiers = [RowCopier(source, d) for d in dsts]
    flag = SharedFlag.create(device=True)
    pendings = []
    try:
        for trial in range(4):
            perm = np.random.default_rng().permutation(R)
            jobs = [(copiers[0], perm[:R // 2], np.arange(R // 2)), (copiers[1], perm[R // 2:], np.arange(R // 2))]
            copy_fanout(jobs, checked=True)
            stream = copiers[0].destinations().direct
            assert stream is not None
            seq = flag.bump_on_stream(stream)
            pendings.append(not seq_done(flag.value(), seq))
            while not seq_done(flag.value(), seq):  # the host sees the page as a rank would
                pass
            with cp.cuda.Stream(non_blocking=True):  # not ordered after the copy by any stream
                for k, d in enumerate(dsts):
                    rows = cp.asarray(perm[k * R // 2:(k + 1) * R // 2])
                    for l in (0, L // 2, L - 1):
                        assert bool(cp.array_equal(d[l], src[l][rows])), (trial, k, l)
            assert seq == trial + 1
            for d in dsts:
                for a in d:
                    a.fill(0)
            cp.cuda.runtime.deviceSynchronize()
        flag.synchronize()
        assert flag.value() == 4
        # Compiled after trial 0: the page read "not yet" right after the bump at least once, so
        # the waits above did wait for the copy (one host stall of ~1 ms, another xdist worker or
        # a GC pass, can let one ~0.8 ms copy end first on an H100: 5b4c865's suite).
        assert any(pendings[1:]), pendings
    finally:
        flag.close()
        for c in copiers:
            c.close()


def test_a_jax_copy_after_a_direct_launch_lands_last():
    L, item = 4, 1152
    src = _layers(4096, item, L, seed=2)
    source = PackSource(src)
    dsts = [_layers(4096, item, L, fill=0) for _ in range(2)]
    copiers = [RowCopier(source, d) for d in dsts]
    rows = np.arange(4096)
    copy_fanout([(copiers[0], rows, rows), (copiers[1], rows, rows)], checked=True)  # direct
    assert copiers[0].destinations().direct is not None or triton_launch._STATE["off"]
    rev = rows[::-1].copy()
    copiers[0].copy(rev, rows, checked=True)  # JAX's stream: must not be overtaken by the fan-out
    synchronize([d[0] for d in dsts])
    for l in range(L):
        assert bool(cp.array_equal(dsts[0][l], src[l][cp.asarray(rev)]))
        assert bool(cp.array_equal(dsts[1][l], src[l]))
    assert copiers[0].destinations().direct is None


def test_two_sources_launching_from_two_threads_never_share_an_index_slot():
    """Two senders' sources on one device, each launching from its own thread (each under its own
    source lock only): the direct launches' index slots are per device, so without the slot
    ring's lock two launches could fill the same slot. Every round of both is byte-exact."""
    import threading

    L, item, R = 3, 1152, 2048
    errors = []

    def sender(seed):
        try:
            src = _layers(R, item, L, seed=seed)
            source = PackSource(src)
            dsts = [_layers(R, item, L, fill=0) for _ in range(2)]
            copiers = [RowCopier(source, d) for d in dsts]
            rng = np.random.default_rng(seed)
            for _ in range(20):
                perm = rng.permutation(R)
                copy_fanout([(copiers[0], perm[:R // 2], np.arange(R // 2)),
                             (copiers[1], perm[R // 2:], np.arange(R // 2))], checked=True)
                synchronize([d[0] for d in dsts])
                for k, d in enumerate(dsts):
                    rows = cp.asarray(perm[k * R // 2:(k + 1) * R // 2])
                    for l in range(L):
                        if not bool(cp.array_equal(d[l][:R // 2], src[l][rows])):
                            errors.append((seed, k, l))
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(repr(exc))

    threads = [threading.Thread(target=sender, args=(s,)) for s in (11, 12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:5]


def _packed(layers, idx, offset, total):
    """The pack region `pack_rows` writes: layer-major, each layer's rows back to back."""
    parts = [cp.asnumpy(a[cp.asarray(idx)]).reshape(-1) for a in layers]
    out = np.concatenate(parts)
    assert out.size == total
    return out


@pytest.mark.parametrize("form", ["PackSource", "layer list"])
@pytest.mark.parametrize("direct", [True, False], ids=["triton launcher", "jax dispatch"])
def test_pack_rows_byte_exact_at_any_offset(form, direct, monkeypatch):
    if not direct:
        monkeypatch.setitem(triton_launch._STATE, "off", True)
    elif triton_launch._STATE["off"] or "gather" in triton_launch._STATE["off_kinds"]:
        pytest.fail(f"direct launches are off in this process: {triton_launch._STATE['why']}")
    L, item, R = 5, 1152, 600
    layers = _layers(R, item, L, seed=3) if form == "PackSource" else \
        [cp.random.RandomState(l).randint(0, 256, (R, item), dtype=cp.int32).astype(cp.uint8) for l in range(L)]
    src = PackSource(layers) if form == "PackSource" else layers
    pack = cp.full(3 * 300 * L * item + 8192, 0xEE, cp.uint8)
    rng = np.random.default_rng()
    want = np.full(pack.size, 0xEE, np.uint8)
    for n, offset in [(300, 0), (1, 300 * L * item), (257, 301 * L * item + 64), (64, 2 * 300 * L * item + 4096)]:
        idx = rng.integers(0, R, n)
        total = n * L * item
        assert pack_rows(src, idx, pack, offset=offset, sync=False) == total
        want[offset:offset + total] = _packed(layers, idx, offset, total)
        dests = device.destinations([pack], np.dtype(np.uint32), [pack.nbytes // 4 * 4])
        assert (dests.direct is not None) == direct
    synchronize([pack])
    np.testing.assert_array_equal(cp.asnumpy(pack), want)


def test_pack_rows_direct_then_jax_then_direct_into_one_region_the_last_lands():
    """Host indices go direct, device (CuPy) indices through JAX: three packs of the same region,
    no synchronisation between them; the last one's rows are what the region holds."""
    L, item, R, n = 4, 1152, 4096, 2048
    layers = _layers(R, item, L, seed=8)
    source = PackSource(layers)
    pack = cp.zeros(n * L * item, cp.uint8)
    rng = np.random.default_rng()
    for round_ in range(3):
        a, b, c = (rng.permutation(R)[:n] for _ in range(3))
        pack_rows(source, a, pack, sync=False)              # direct
        pack_rows(source, cp.asarray(b), pack, sync=False)  # JAX (device indices)
        pack_rows(source, c, pack, sync=False)              # direct again
        synchronize([pack])
        np.testing.assert_array_equal(cp.asnumpy(pack), _packed(layers, c, 0, n * L * item), err_msg=str(round_))
        pack_rows(source, cp.asarray(a), pack, sync=True)   # JAX last
        synchronize([pack])
        np.testing.assert_array_equal(cp.asnumpy(pack), _packed(layers, a, 0, n * L * item), err_msg=str(round_))


def _unpacked(want, region, idx, offset, L, item):
    """CPU reference of one window: `want` (numpy layers) rows `idx` from the region at `offset`."""
    n = len(idx)
    for l in range(L):
        rows = region[offset + l * n * item:offset + (l + 1) * n * item].reshape(n, item)
        want[l][idx] = rows


@pytest.mark.parametrize("direct", [True, False], ids=["triton launcher", "jax dispatch"])
def test_row_unpacker_byte_exact_at_any_offset(direct, monkeypatch):
    """The region path's decode-side unpack into a layer-major cache: windows of any size at any
    granted offset, no synchronisation between them, then the cache against a CPU reference."""
    if not direct:
        monkeypatch.setitem(triton_launch._STATE, "off", True)
    elif triton_launch._STATE["off"] or "unpack" in triton_launch._STATE["off_kinds"]:
        pytest.fail(f"direct launches are off in this process: {triton_launch._STATE['why']}")
    L, item, R = 5, 1152, 900
    layers = _layers(R, item, L, fill=0x11)
    region = cp.random.RandomState(4).randint(0, 256, 3 * 300 * L * item + 8192, dtype=cp.int32).astype(cp.uint8)
    host_region = cp.asnumpy(region)
    want = [np.full((R, item), 0x11, np.uint8) for _ in range(L)]
    un = RowUnpacker(region, layers)
    rng = np.random.default_rng()
    for n, offset in [(300, 0), (1, 300 * L * item), (257, 301 * L * item + 64), (64, 2 * 300 * L * item + 4096)]:
        idx = rng.permutation(R)[:n]
        assert un.unpack(idx, offset=offset, checked=True) == n
        _unpacked(want, host_region, idx, offset, L, item)
        assert (un._dests.direct is not None) == direct  # the unpacker's own destinations (not device's cache)
    synchronize(layers)
    for l in range(L):
        np.testing.assert_array_equal(cp.asnumpy(layers[l]), want[l], err_msg=f"layer {l}")
    un.close()


def test_row_unpacker_direct_then_jax_then_direct_into_the_same_rows_the_last_lands(monkeypatch):
    """Three unpacks of different windows into the SAME rows, no synchronisation between them:
    direct, JAX (direct launches off for the call), direct; the rows hold the last one's bytes."""
    L, item, R, n = 4, 1152, 4096, 2048
    layers = _layers(R, item, L, fill=0)
    region = cp.random.RandomState(9).randint(0, 256, 3 * n * L * item, dtype=cp.int32).astype(cp.uint8)
    host_region = cp.asnumpy(region)
    un = RowUnpacker(region, layers)
    idx = np.random.default_rng().permutation(R)[:n]
    for round_ in range(2):
        un.unpack(idx, offset=0, checked=True)                      # direct
        with monkeypatch.context() as m:
            m.setitem(triton_launch._STATE, "off", True)
            un.unpack(idx, offset=n * L * item, checked=True)       # JAX
        un.unpack(idx, offset=2 * n * L * item, checked=True)       # direct again
        synchronize(layers)
        want = [np.zeros((R, item), np.uint8) for _ in range(L)]
        _unpacked(want, host_region, idx, 2 * n * L * item, L, item)
        for l in range(L):
            np.testing.assert_array_equal(cp.asnumpy(layers[l])[idx], want[l][idx], err_msg=f"{round_} {l}")
    un.close()


def test_warm_pack_rows_compiles_the_bucket_writing_nothing_and_the_pack_then_compiles_nothing():
    from pallas_kernels import GatherConfig, bucket_rows, warm_pack_rows

    if triton_launch._STATE["off"] or "gather" in triton_launch._STATE["off_kinds"]:
        pytest.fail(f"direct launches are off in this process: {triton_launch._STATE['why']}")
    L, item, R, n = 5, 1152, 600, 300
    layers = _layers(R, item, L, seed=12)
    source = PackSource(layers)
    pack = cp.full(n * L * item + 4096, 0xEE, cp.uint8)
    assert warm_pack_rows(source, pack, n) == [bucket_rows(n, GatherConfig.default().block_rows)]
    synchronize([pack])
    assert int((pack != 0xEE).sum()) == 0  # every row masked: nothing written
    compiled = len(triton_launch._KERNELS)
    idx = np.random.default_rng().integers(0, R, n)
    pack_rows(source, idx, pack, offset=0, sync=True)
    assert len(triton_launch._KERNELS) == compiled  # the warmed bucket: no compile in the call
    np.testing.assert_array_equal(cp.asnumpy(pack[:n * L * item]), _packed(layers, idx, 0, n * L * item))
    assert int((pack[n * L * item:] != 0xEE).sum()) == 0


def test_the_senders_packer_packs_a_round_of_warmed_windows_directly():
    """`Packer.pack_windows` of windows whose bucket `warm_up(window_rows=)` compiled go through
    `pack_rows`' direct launch, one each (the pack's destinations name its stream), one window
    or two; a window of a bigger bucket sends the round through the windowed launch; all
    byte-exact."""
    from dcp_jax.transfer.staging import Packer

    L, item, R, n = 4, 1152, 700, 256
    layers = _layers(R, item, L, seed=13)
    pack = cp.full(3 * n * L * item, 0xEE, cp.uint8)
    packer = Packer(layers, PackSource(layers), pack)
    packer.warm_up(2 * n, window_rows=n)
    rng = np.random.default_rng()
    one = rng.integers(0, R, n)
    dests = device.destinations([pack], np.dtype(np.uint32), [pack.nbytes // 4 * 4])
    dests.direct = None
    packer.pack_windows([(one, 0)], sync=False)
    assert dests.direct is not None  # launched by triton_launch, not JAX
    two = [(rng.integers(0, R, n), n * L * item), (rng.integers(0, R, n - 5), 2 * n * L * item)]
    dests.direct = None
    packer.pack_windows(two, sync=False)
    assert dests.direct is not None
    synchronize([pack])
    got = cp.asnumpy(pack)
    np.testing.assert_array_equal(got[:n * L * item], _packed(layers, one, 0, n * L * item))
    for idx, off in two:
        total = len(idx) * L * item
        np.testing.assert_array_equal(got[off:off + total], _packed(layers, idx, off, total))
    wide = [(rng.integers(0, R, 2 * n), 0), (rng.integers(0, R, 3), 2 * n * L * item)]  # 2n rows: past the bucket
    assert packer.launches_each([one]) and packer.launches_each([idx for idx, _ in two])
    assert not packer.launches_each([idx for idx, _ in wide])
    packer.pack_windows(wide, sync=True)
    got = cp.asnumpy(pack)
    for idx, off in wide:
        total = len(idx) * L * item
        np.testing.assert_array_equal(got[off:off + total], _packed(layers, idx, off, total))


def test_row_unpacker_warm_compiles_every_bucket_writing_nothing_and_the_unpack_then_compiles_nothing():
    if triton_launch._STATE["off"] or "unpack" in triton_launch._STATE["off_kinds"]:
        pytest.fail(f"direct launches are off in this process: {triton_launch._STATE['why']}")
    L, item, R, n = 3, 1152, 800, 300
    layers = _layers(R, item, L, fill=0x5A)
    region = cp.random.RandomState(14).randint(0, 256, n * L * item + 4096, dtype=cp.int32).astype(cp.uint8)
    un = RowUnpacker(region, layers)
    assert un.warm(n) == [512]  # 300 rows' bucket
    assert un.warm(n, every_bucket=True) == [64, 128, 256, 512]  # block_rows 64 up to it
    assert un.warm(10 ** 9) == [512]  # the region holds 301 rows: the same bucket
    synchronize(layers)
    for l in range(L):
        assert int((layers[l] != 0x5A).sum()) == 0, l  # every row masked: nothing written
    compiled = len(triton_launch._KERNELS)
    idx = np.random.default_rng().permutation(R)[:n]
    un.unpack(idx, offset=64, checked=True)
    assert len(triton_launch._KERNELS) == compiled  # the warmed bucket: no compile in the call
    synchronize(layers)
    want = [np.full((R, item), 0x5A, np.uint8) for _ in range(L)]
    _unpacked(want, cp.asnumpy(region), idx, 64, L, item)
    for l in range(L):
        np.testing.assert_array_equal(cp.asnumpy(layers[l]), want[l], err_msg=f"layer {l}")
    un.close()
    with pytest.raises(RuntimeError, match="closed"):
        un.warm(1)
