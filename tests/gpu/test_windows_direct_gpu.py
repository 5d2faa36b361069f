"""GPU: `pack_windows` launched without JAX's dispatch (`triton_launch`, kind "windows", off unless
``DCP_JAX_DIRECT_ON=windows``): one launch for every window of a round, only where
`warm_pack_windows_direct` compiled its bucket.

Byte-exact against CuPy fancy indexing at mixed offsets; no byte outside the windows changes;
a call in a bucket not compiled goes through JAX (and compiles no Triton kernel); JAX and direct
launches into one region land in call order; the sender's `Packer` packs a round of several
windows in ONE launch once `warm_up` compiled its bucket.

Run on a CUDA machine: `python -m pytest tests/gpu -q` (skipped without a GPU).
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
cp = pytest.importorskip("cupy")
pytest.importorskip("triton")

from pallas_kernels import (GatherConfig, PackSource, pack_windows, synchronize, triton_launch,  # noqa: E402
                            warm_pack_windows_direct)
from pallas_kernels import device  # noqa: E402
from pallas_kernels.windows import windows_bucket  # noqa: E402

if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (JAX sees none)", allow_module_level=True)

L, ITEM, R = 5, 1152, 900
ROW = L * ITEM


def _layers(seed):
    buf = cp.random.RandomState(seed).randint(0, 256, L * R * ITEM, dtype=cp.int32).astype(cp.uint8)
    return [buf[l * R * ITEM:(l + 1) * R * ITEM].reshape(R, ITEM) for l in range(L)]


def _packed(layers, idx):
    return np.concatenate([cp.asnumpy(a[cp.asarray(idx)]).reshape(-1) for a in layers])


def _dests(pack):
    return device.destinations([pack], np.dtype(np.uint32), [pack.nbytes // 4 * 4])


@pytest.fixture(autouse=True)
def _windows_on(monkeypatch):
    """The kind is off by default (`triton_launch.DEFAULT_OFF`): on for these tests, as
    ``DCP_JAX_DIRECT_ON=windows`` turns it on."""
    monkeypatch.setitem(triton_launch._STATE, "off_kinds", triton_launch._STATE["off_kinds"] - {"windows"})


def _need_direct():
    if triton_launch._STATE["off"] or "windows" in triton_launch._STATE["off_kinds"]:
        pytest.fail(f"direct launches are off in this process: {triton_launch._STATE['why']}")


def test_warmed_bucket_launches_directly_byte_exact_and_writes_nothing_else():
    _need_direct()
    layers = _layers(21)
    source = PackSource(layers)
    pack = cp.full(8 * 200 * ROW, 0xEE, cp.uint8)
    br = GatherConfig.default().block_rows
    rng = np.random.default_rng()
    sizes = [200, 1, 133, 64, 0, 199]
    offsets = [0, 200 * ROW, 201 * ROW + 64, 400 * ROW, 600 * ROW, 601 * ROW + 4096]
    m = windows_bucket(sizes, br)
    assert warm_pack_windows_direct(source, pack, m) == [m]
    synchronize([pack])
    assert int((pack != 0xEE).sum()) == 0  # the warm-up's launch wrote nothing
    compiled = len(triton_launch._KERNELS)
    want = np.full(pack.size, 0xEE, np.uint8)
    for trial in range(3):
        windows = [(rng.integers(0, R, n), off) for n, off in zip(sizes, offsets)]
        dests = _dests(pack)
        dests.direct = None
        assert pack_windows(source, windows, pack, sync=False) == sum(sizes) * ROW
        assert dests.direct is not None, "not launched by triton_launch"
        for idx, off in windows:
            want[off:off + len(idx) * ROW] = _packed(layers, idx) if len(idx) else []
    synchronize([pack])
    np.testing.assert_array_equal(cp.asnumpy(pack), want)
    assert len(triton_launch._KERNELS) == compiled  # the warmed bucket: no compile in the calls


def test_a_bucket_not_compiled_goes_through_jax_and_compiles_no_triton_kernel():
    _need_direct()
    layers = _layers(22)
    source = PackSource(layers)
    pack = cp.full(4 * 300 * ROW, 0xEE, cp.uint8)
    rng = np.random.default_rng()
    windows = [(rng.integers(0, R, 300), 0), (rng.integers(0, R, 300), 2 * 300 * ROW)]  # bucket 1024
    assert 1024 not in warm_pack_windows_direct(source, pack, 64)
    compiled = len(triton_launch._KERNELS)
    dests = _dests(pack)
    dests.direct = None
    pack_windows(source, windows, pack, sync=True)
    assert dests.direct is None and len(triton_launch._KERNELS) == compiled
    got = cp.asnumpy(pack)
    for idx, off in windows:
        np.testing.assert_array_equal(got[off:off + len(idx) * ROW], _packed(layers, idx))
    assert int((pack[300 * ROW:2 * 300 * ROW] != 0xEE).sum()) == 0


def test_direct_then_jax_then_direct_into_one_region_the_last_lands():
    """Host indices of a warmed bucket go direct, device (CuPy) indices through JAX: three
    windowed packs of the same regions, no synchronisation between them."""
    _need_direct()
    layers = _layers(23)
    source = PackSource(layers)
    n = 400
    pack = cp.zeros(2 * n * ROW, cp.uint8)
    br = GatherConfig.default().block_rows
    assert warm_pack_windows_direct(source, pack, windows_bucket([n, n], br))
    rng = np.random.default_rng()
    for round_ in range(3):
        a, b, c = ([rng.integers(0, R, n), rng.integers(0, R, n)] for _ in range(3))
        pack_windows(source, [(a[0], 0), (a[1], n * ROW)], pack, sync=False)                           # direct
        pack_windows(source, [(cp.asarray(b[0]), 0), (cp.asarray(b[1]), n * ROW)], pack, sync=False)   # JAX
        pack_windows(source, [(c[0], 0), (c[1], n * ROW)], pack, sync=False)                           # direct
        synchronize([pack])
        got = cp.asnumpy(pack)
        np.testing.assert_array_equal(got[:n * ROW], _packed(layers, c[0]), err_msg=str(round_))
        np.testing.assert_array_equal(got[n * ROW:], _packed(layers, c[1]), err_msg=str(round_))


def test_the_senders_packer_packs_a_warmed_round_in_one_launch():
    """`Packer.warm_up(max_rows, window_rows=)` compiles the round's bucket; a round of eight
    windows in it is then ONE launch (`pack_windows` returns 1), byte-exact; with the "windows"
    kind off (the default) the same round goes out one direct launch a window (8)."""
    from dcp_jax.transfer.staging import Packer

    _need_direct()
    layers = _layers(24)
    n, k = 100, 8
    pack = cp.full(k * n * ROW + 4096, 0xEE, cp.uint8)
    packer = Packer(layers, PackSource(layers), pack)
    br = GatherConfig.default().block_rows
    packer.warm_up(windows_bucket([n] * k, br), window_rows=n)
    rng = np.random.default_rng()
    windows = [(rng.integers(0, R, n - w), w * n * ROW) for w in range(k)]
    assert packer.windows_direct(windows)
    compiled = len(triton_launch._KERNELS)
    assert packer.pack_windows(windows, sync=True) == 1
    assert len(triton_launch._KERNELS) == compiled
    got = cp.asnumpy(pack)
    for idx, off in windows:
        np.testing.assert_array_equal(got[off:off + len(idx) * ROW], _packed(layers, idx))
    triton_launch._STATE["off_kinds"] = triton_launch._STATE["off_kinds"] | {"windows"}  # (the fixture restores it)
    assert not packer.windows_direct(windows)
    windows = [(rng.integers(0, R, n), w * n * ROW) for w in range(k)]
    assert packer.pack_windows(windows, sync=True) == k
    got = cp.asnumpy(pack)
    for idx, off in windows:
        np.testing.assert_array_equal(got[off:off + len(idx) * ROW], _packed(layers, idx))
