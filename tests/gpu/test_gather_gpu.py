"""GPU: the Pallas gather kernels bit-exact against jnp.take across the coverage of issue 4.

Run on a CUDA machine: `python -m pytest tests/gpu -q` (skipped without a GPU).
"""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
jnp = jax.numpy
cp = pytest.importorskip("cupy")

from pallas_kernels import (  # noqa: E402
    GatherConfig,
    PackSource,
    bucket_rows,
    compile_count,
    gather_rows,
    gather_rows_reference,
    pack_rows,
    word_dtype,
)
from pallas_kernels import pack as pack_mod  # noqa: E402

SENTINEL = 0x5A


def _rand_words(rng, shape, dtype):
    info = np.iinfo(dtype)
    return rng.integers(0, int(info.max) + 1, shape, dtype=np.uint64).astype(dtype)


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("n", [1, 31, 100, 257])
@pytest.mark.parametrize("schedule", ["grid", "loop"])
def test_stacked_bit_exact(backend, n, schedule):
    if backend == "mosaic" and schedule == "loop":
        pytest.skip("mosaic has one schedule")
    rng = np.random.default_rng(n)
    L, R, W = 5, 700, 288  # 1152-B rows as uint32 words
    src = jnp.asarray(_rand_words(rng, (L, R, W), np.uint32))
    idx = rng.integers(0, R, bucket_rows(n, 32)).astype(np.int32)
    P = L * n * W + 96
    pack0 = _rand_words(rng, P, np.uint32)
    cfg = GatherConfig(block_rows=32, schedule=schedule)
    out = gather_rows(src, jnp.asarray(idx), jnp.asarray(pack0), n, offset=32, config=cfg,
                      backend=backend)
    ref = gather_rows_reference(src, jnp.asarray(idx), jnp.asarray(pack0), n, offset=32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


KNOBS = [GatherConfig(block_rows=32, interleave=True),
         GatherConfig(block_rows=16, num_warps=4, layers_per_program=4, mask_loads=True),
         GatherConfig(block_rows=32, layers_fastest=True, load_eviction_policy="evict_first"),
         GatherConfig(block_rows=32, interleave=True, layers_per_program=2),
         GatherConfig(block_rows=64, interleave=True, load_eviction_policy="evict_last"),
         GatherConfig(block_rows=32, load_cache_modifier=".cg", eviction_policy="evict_last")]


@pytest.mark.parametrize("cfg", KNOBS, ids=repr)
@pytest.mark.parametrize("form", ["stacked", "list"])
def test_tuning_knobs_bit_exact(cfg, form):
    # 5 layer entries: 2 and 4 entries per program leave a masked-off entry in the last one.
    rng = np.random.default_rng(7)
    L, R, W, n = 5, 700, 288, 100
    src = jnp.asarray(_rand_words(rng, (L, R, W), np.uint32))
    idx = rng.integers(0, R, bucket_rows(n, 32)).astype(np.int32)
    pack0 = _rand_words(rng, L * n * W + 96, np.uint32)
    arg = src if form == "stacked" else [src[l] for l in range(L)]
    out = gather_rows(arg, jnp.asarray(idx), jnp.asarray(pack0), n, offset=32, config=cfg,
                      backend="triton")
    ref = gather_rows_reference(src, jnp.asarray(idx), jnp.asarray(pack0), n, offset=32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


@pytest.mark.parametrize("item_lens", [(1152,) * 4, (576,) * 3, (656, 1152, 576),
                                       (2, 6, 14), (3, 1152, 5), (1154,)])
@pytest.mark.parametrize("n", [1, 77, 300])
def test_pack_rows_cupy_mixed_item_len(item_lens, n):
    rng = np.random.default_rng(sum(item_lens) + n)
    R = 512
    host = [_rand_words(rng, (R, w), np.uint8) for w in item_lens]
    layers = [cp.asarray(a) for a in host]
    idx = rng.integers(0, R, n)
    # Word-aligned (the Pallas rule); the odd geometries get an offset off 16 bytes (the
    # kernel without the wide-store hint).
    offset = 4096 + (16 if all(w % 16 == 0 for w in item_lens)
                     else 3 * word_dtype(item_lens).itemsize)
    total = n * sum(item_lens)
    pack = cp.full(offset + total + 1000, SENTINEL, cp.uint8)
    ptr = pack.data.ptr
    assert pack_rows(layers, cp.asarray(idx), pack, offset=offset, backend="triton") == total
    got = cp.asnumpy(pack)
    expect = np.concatenate([a[idx].reshape(-1) for a in host])
    np.testing.assert_array_equal(got[offset:offset + total], expect)
    assert np.all(got[:offset] == SENTINEL) and np.all(got[offset + total:] == SENTINEL)
    assert pack.data.ptr == ptr


@pytest.mark.parametrize("item_len", [1152, 640])
def test_pack_rows_cupy_mosaic(item_len):
    rng = np.random.default_rng(item_len)
    R, n, L = 600, 123, 3
    host = [_rand_words(rng, (R, item_len), np.uint8) for _ in range(L)]
    idx = rng.integers(0, R, n)
    total = n * L * item_len
    pack = cp.full(128 + total + 512, SENTINEL, cp.uint8)
    pack_rows([cp.asarray(a) for a in host], idx, pack, offset=128, backend="mosaic",
              config=GatherConfig(block_rows=32))
    got = cp.asnumpy(pack)
    np.testing.assert_array_equal(got[128:128 + total],
                                  np.concatenate([a[idx].reshape(-1) for a in host]))
    assert np.all(got[:128] == SENTINEL) and np.all(got[128 + total:] == SENTINEL)


def test_list_equals_stacked_uint16_bf16_pattern():
    # bf16 rows carried as uint16 words (CuPy has no bf16); the bytes are what counts.
    rng = np.random.default_rng(7)
    L, R, W, n = 4, 1000, 576, 333  # 576 = 512 + 64 words
    data = _rand_words(rng, (L, R, W), np.uint16)
    idx = jnp.asarray(rng.integers(0, R, 512).astype(np.int32))
    P = L * n * W
    a = gather_rows(jnp.asarray(data), idx, jnp.zeros(P, jnp.uint16), n, backend="triton")
    b = gather_rows([jnp.asarray(x) for x in data], idx, jnp.zeros(P, jnp.uint16), n,
                    backend="triton")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bf = jax.lax.bitcast_convert_type(a.reshape(L, n, W), jnp.bfloat16)
    assert bf.dtype == jnp.bfloat16


def test_variable_n_does_not_recompile():
    rng = np.random.default_rng(3)
    L, R, W = 3, 400, 288
    src = jnp.asarray(_rand_words(rng, (L, R, W), np.uint32))
    idx = jnp.asarray(rng.integers(0, R, 256).astype(np.int32))
    P = L * 256 * W
    gather_rows(src, idx, jnp.zeros(P, jnp.uint32), 200, backend="triton")
    before = gather_rows._cache_size()
    for n in (129, 150, 255, 256):
        out = gather_rows(src, idx, jnp.zeros(P, jnp.uint32), n, backend="triton")
        ref = gather_rows_reference(src, idx, jnp.zeros(P, jnp.uint32), n)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert gather_rows._cache_size() == before


def test_word_dtype_used_for_device_views():
    assert word_dtype([1152, 576]) == np.uint32
    with pytest.raises(ValueError, match="offset=2 must be a multiple of 4 bytes"):
        word_dtype([1152], offset=2)


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_traced_offset_one_kernel_for_every_offset(backend):
    # The connector's pattern: one warm-up per row bucket, then packs at many region offsets
    # (64-byte arena) with new indices: bit-exact, and nothing compiles.
    rng = np.random.default_rng(11)
    R, item_lens = 2048, (1152,) * 4
    host = [_rand_words(rng, (R, w), np.uint8) for w in item_lens]
    layers = [cp.asarray(a) for a in host]
    cfg = GatherConfig.default() if backend == "triton" else GatherConfig(block_rows=32)
    region = 512 * sum(item_lens)
    pack = cp.full(8 * region, SENTINEL, cp.uint8)
    for n in (10, 40, 100, 200, 500):  # every bucket of n <= 512, block_rows 32 or 64
        pack_rows(layers, cp.arange(n), pack, offset=0, backend=backend, config=cfg)
    count = compile_count()
    expect = cp.asnumpy(pack)
    for k in range(40):
        n = int(rng.integers(1, 513))
        idx = rng.integers(0, R, n)
        offset = int(rng.integers(0, 7)) * region + 64 * int(rng.integers(0, 64))
        wrote = pack_rows(layers, cp.asarray(idx), pack, offset=offset, backend=backend,
                          config=cfg)
        expect[offset:offset + wrote] = np.concatenate([a[idx].reshape(-1) for a in host])
    np.testing.assert_array_equal(cp.asnumpy(pack), expect)
    assert compile_count() == count


def test_misaligned_offsets_are_refused_on_device():
    layers = [cp.zeros((16, 1152), cp.uint8)]
    pack = cp.full(8192, SENTINEL, cp.uint8)
    with pytest.raises(ValueError, match="offset=6 must be a multiple of 4 bytes"):
        pack_rows(layers, [0, 1], pack, offset=6, backend="triton")
    with pytest.raises(ValueError, match="offset=.*16 bytes for mosaic"):
        pack_rows(layers, [0, 1], pack, offset=68, backend="mosaic",
                  config=GatherConfig(block_rows=32))
    assert bool((pack == SENTINEL).all())


@pytest.mark.parametrize("holder", ["list", "source"])
def test_dropped_cupy_layers_give_their_memory_back(holder):
    import gc
    import weakref

    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    rng = np.random.default_rng(12)
    host = [_rand_words(rng, (4096, 1152), np.uint8) for _ in range(3)]
    base = pool.used_bytes()
    layers = [cp.asarray(a) for a in host]
    refs = [weakref.ref(a) for a in layers]
    src = PackSource(layers) if holder == "source" else layers
    pack = cp.full(300 * 3 * 1152, SENTINEL, cp.uint8)
    for offset in (0, 64, 1152 * 3 * 100):
        idx = rng.integers(0, 4096, 200)
        pack_rows(src, cp.asarray(idx), pack, offset=offset, backend="triton")
        got = cp.asnumpy(pack)[offset:offset + 200 * 3 * 1152]
        np.testing.assert_array_equal(got, np.concatenate([a[idx].reshape(-1) for a in host]))
    if holder == "list":
        assert pack_mod._IMPORTED_LAYERS  # the zero-copy imports are cached (weakly)
    del layers, src
    gc.collect()
    assert all(r() is None for r in refs)
    assert pool.used_bytes() <= base + pack.nbytes + (1 << 20)  # the 3 x 4.7 MB came back
