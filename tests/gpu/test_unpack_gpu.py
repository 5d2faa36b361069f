"""GPU: `unpack_rows` / `copy_rows` (Pallas Triton) byte-exact against CuPy references, written in
place into CuPy memory the kernel does not own (`cupy.cuda.UnownedMemory`, as IPC-mapped pages
arrive), no recompiles per call, and the fixed-cost path of `pack_rows` (handles threaded
through donation). The pack past 2**31 words lives in test_pack_64bit_gpu.py.

Run on a CUDA machine: `python -m pytest tests/gpu -q` (skipped without a GPU).
"""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
cp = pytest.importorskip("cupy")

from pallas_kernels import (  # noqa: E402
    GatherConfig,
    compile_count,
    copy_rows,
    pack_rows,
    synchronize,
    unpack_rows,
)

if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (JAX sees none)", allow_module_level=True)


def _foreign(a):
    """A CuPy array over `a`'s memory that owns nothing (what an IPC mapping gives)."""
    mem = cp.cuda.UnownedMemory(a.data.ptr, a.nbytes, a, a.device.id)
    return cp.ndarray(a.shape, a.dtype, cp.cuda.MemoryPointer(mem, 0))


def _layers(rows, item_lens, seed):
    rs = cp.random.RandomState(seed)
    return [rs.randint(0, 256, (rows, w), dtype=cp.int32).astype(cp.uint8) for w in item_lens]


@pytest.mark.parametrize("item_lens", [(1152, 1152, 576), (656,), (6, 10)], ids=str)
@pytest.mark.parametrize("n", [1, 100, 257])
def test_unpack_rows_bit_exact_in_place(item_lens, n):
    src = _layers(300, item_lens, n)
    idx = np.random.default_rng(n).permutation(300)[:n]
    offset = 64
    pack = cp.full(offset + n * sum(item_lens) + 64, 0xA5, cp.uint8)
    pack_rows(src, idx, pack, offset=offset)
    owners = [cp.full((300, w), 0x5A, cp.uint8) for w in item_lens]
    dst = [_foreign(a) for a in owners]
    ptrs = [a.data.ptr for a in owners]
    unpack_rows(pack, dst, idx, offset=offset)
    synchronize(dst)
    rest = np.setdiff1d(np.arange(300), idx)
    for s, d, o, p in zip(src, dst, owners, ptrs):
        assert o.data.ptr == p
        assert bool(cp.array_equal(o[cp.asarray(idx)], s[cp.asarray(idx)]))
        assert bool((o[cp.asarray(rest)] == 0x5A).all())  # no other row touched
    # The CuPy reference form agrees byte for byte.
    ref = [cp.full((300, w), 0x5A, cp.uint8) for w in item_lens]
    unpack_rows(pack, ref, idx, offset=offset, backend="cupy")
    for o, r in zip(owners, ref):
        assert bool(cp.array_equal(o, r))


def test_copy_rows_into_foreign_memory_one_kernel():
    item_lens = (1152,) * 8 + (576,)
    src = _layers(500, item_lens, 1)
    owners = [cp.zeros((200, w), cp.uint8) for w in item_lens]
    dst = [_foreign(a) for a in owners]
    rng = np.random.default_rng(2)
    sidx = np.r_[rng.integers(0, 500, 120), 3, 3]  # repeats are fine on the source side
    didx = rng.permutation(200)[:122]
    copy_rows(src, sidx, dst, didx)
    synchronize(dst)
    ref = [cp.zeros((200, w), cp.uint8) for w in item_lens]
    copy_rows(src, sidx, ref, didx, backend="cupy")
    for o, r in zip(owners, ref):
        assert bool(cp.array_equal(o, r))
    # Another call with other rows and a new count: same kernel (row bucket unchanged), in place.
    before = compile_count()
    copy_rows(src, sidx[:77], dst, didx[:77][::-1].copy())
    synchronize(dst)
    assert compile_count() == before
    ref2 = [r.copy() for r in ref]
    copy_rows(src, sidx[:77], ref2, didx[:77][::-1].copy(), backend="cupy")
    for o, r in zip(owners, ref2):
        assert bool(cp.array_equal(o, r))


def test_copy_rows_into_one_buffer_flat_destination():
    # The fused path's case: the decode rank's layers are back-to-back views of one allocation
    # (IPC-mapped: memory the kernel does not own). One flat donated destination, byte-exact
    # against the CuPy form, nothing outside the rows touched, host and device indices.
    from pallas_kernels.scatter import _copy_flat_jit

    item_lens = (1152,) * 6 + (576,)
    src = _layers(500, item_lens, 3)
    owner = cp.full(200 * sum(item_lens), 0x5A, cp.uint8)
    views, pos = [], 0
    for w in item_lens:
        views.append(_foreign(owner[pos:pos + 200 * w].reshape(200, w)))
        pos += 200 * w
    rng = np.random.default_rng(4)
    sidx, didx = rng.integers(0, 500, 130), np.r_[0, rng.permutation(199)[:129] + 1]
    ref = [cp.full((200, w), 0x5A, cp.uint8) for w in item_lens]
    before = _copy_flat_jit._cache_size()
    for s_i, d_i in ((sidx, didx), (cp.asarray(sidx[:50]), cp.asarray(didx[:50][::-1].copy()))):
        copy_rows(src, s_i, views, d_i)
        copy_rows(src, s_i, ref, d_i, backend="cupy")
    synchronize(views)
    assert _copy_flat_jit._cache_size() > before
    for v, r in zip(views, ref):
        assert bool(cp.array_equal(v, r))


def test_device_indices_checked_and_refused():
    src = _layers(10, (8,), 0)
    dst = [cp.zeros((10, 8), cp.uint8)]
    with pytest.raises(ValueError, match="dst_indices must be unique"):
        copy_rows(src, cp.asarray([1, 2]), dst, cp.asarray([4, 4]))
    with pytest.raises(ValueError, match="src_indices must be < num_rows=10"):
        copy_rows(src, cp.asarray([10]), dst, cp.asarray([0]))
    assert not bool(dst[0].any())


def test_pack_rows_async_handles_threaded_in_place():
    item_lens = (1152,) * 4
    src = _layers(4096, item_lens, 5)
    pack = cp.full(8 * 512 * sum(item_lens), 0xA5, cp.uint8)
    ptr = pack.data.ptr
    region = 512 * sum(item_lens)
    rng = np.random.default_rng(0)
    idxs = [rng.integers(0, 4096, 512) for _ in range(8)]
    pack_rows(src, idxs[0], pack, offset=0)  # warm-up: compile + first import
    before = compile_count()
    for r, idx in enumerate(idxs):  # eight ranks back to back, one synchronize
        pack_rows(src, idx, pack, offset=r * region, sync=False)
    synchronize([pack])
    assert compile_count() == before and pack.data.ptr == ptr
    for r, idx in enumerate(idxs):
        want = cp.concatenate([s[cp.asarray(idx)].ravel() for s in src])
        assert bool(cp.array_equal(pack[r * region:(r + 1) * region], want))


def test_config_variants_of_the_scatter():
    item_lens = (1152, 576)
    src = _layers(256, item_lens, 9)
    idx = np.random.default_rng(9).permutation(256)[:200]
    for cfg in (GatherConfig(), GatherConfig(block_rows=32, num_warps=8, interleave=True),
                GatherConfig.default()):
        dst = [cp.zeros((256, w), cp.uint8) for w in item_lens]
        copy_rows(src, idx, dst, idx, config=cfg)
        synchronize(dst)
        for s, d in zip(src, dst):
            assert bool(cp.array_equal(d[cp.asarray(idx)], s[cp.asarray(idx)]))


@pytest.mark.parametrize("one_buffer", [False, True], ids=["layer list", "one buffer"])
def test_row_unpacker_bit_exact_over_many_windows(one_buffer):
    """`RowUnpacker` (the region path's receiver): windows at several offsets of one receive
    region into one cache, byte-exact against `unpack_rows`, no other row touched, no recompile
    after the first window of a size."""
    from pallas_kernels import RowUnpacker

    L, R, W, n = 5, 600, 1152, 96
    src = _layers(R, (W,) * L, 3)
    region = cp.zeros(4 * n * L * W, cp.uint8)
    if one_buffer:
        buf = cp.full(L * R * W, 0x5A, cp.uint8)
        dst = [buf[l * R * W:(l + 1) * R * W].reshape(R, W) for l in range(L)]
    else:
        dst = [cp.full((R, W), 0x5A, cp.uint8) for _ in range(L)]
    ref = [cp.full((R, W), 0x5A, cp.uint8) for _ in range(L)]
    unpacker = RowUnpacker(region, dst)
    rng = np.random.default_rng()
    rows = rng.permutation(R)
    before = None
    for k in range(4):  # four windows, each its own rows, each at its own offset
        sidx, didx = rng.permutation(R)[:n], rows[k * n:(k + 1) * n]
        offset = k * n * L * W
        pack_rows(src, sidx, region, offset=offset)
        assert unpacker.unpack(didx, offset=offset, checked=True) == n
        unpack_rows(region, ref, didx, offset=offset)
        if k == 1:
            before = compile_count()
    synchronize(dst + ref)
    assert compile_count() == before
    for d, r in zip(dst, ref):
        assert bool(cp.array_equal(d, r))
    untouched = cp.asarray(rows[4 * n:])
    assert all(bool((d[untouched] == 0x5A).all()) for d in dst)
    unpacker.close()
