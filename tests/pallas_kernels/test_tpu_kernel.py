"""CPU: the Pallas Mosaic TPU pack kernel (pallas_kernels/backends/tpu.py) without a TPU.

- `interpret=True` runs the full case matrix in test_backends.py (values);
- `pltpu.InterpretParams()` (the TPU simulator: DMAs complete on wait, every read bounds
  checked) on a few SMALL cases: exact, and it fails deliberately broken variants that
  `interpret=True` lets through (a kernel without its DMA waits or its final drain), and an
  out-of-range row index;
- `jax.export(..., platforms=("tpu",))` of both paths for every supported geometry, so
  Mosaic lowering errors show in CI.
Slow ones: the InterpretParams cases (~0.5-2 s each, kept to 64 rows or fewer).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.backends import tpu
from pallas_kernels.registry import reference_region


def _words(rng, rows, widths):
    return [jnp.asarray(rng.integers(0, 2**32, (rows, w), dtype=np.uint32)) for w in widths]


def _want(srcs, idx, size, offset):
    out = np.zeros(size, np.uint32)
    region = np.concatenate([np.asarray(s)[idx].reshape(-1) for s in srcs])
    out[offset:offset + region.size] = region
    return out


def _races_found() -> bool:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    return bool(ipc.races is not None and ipc.races.races_found)


@pytest.fixture(scope="module")
def small():
    """2 layers (288 and 144 words: 1152 B and 576 B rows), 40 rows, 16 unsorted indices
    with duplicates, region at word 20 of a pack with 9 spare words past it."""
    rng = np.random.default_rng(7)
    srcs = _words(rng, 40, (288, 144))
    idx = rng.integers(0, 40, 16).astype(np.int32)
    idx[5] = idx[6]
    size = 20 + 16 * 432 + 9
    return srcs, idx, size, _want(srcs, idx, size, 20)


def _rows(small, interpret, **kw):
    srcs, idx, size, _ = small
    return np.asarray(tpu.gather_rows_tpu(srcs, jnp.asarray(idx), jnp.zeros(size, jnp.uint32),
                                          16, 20, interpret=interpret, **kw))


def test_rows_exact_under_the_tpu_simulator_with_race_detection(small):
    out = _rows(small, pltpu.InterpretParams(detect_races=True))
    np.testing.assert_array_equal(out, small[3])
    assert not _races_found()


@pytest.mark.parametrize("broken", [{"_wait": False}, {"_drain": False}],
                         ids=["no-slot-waits", "no-final-drain"])
def test_missing_dma_waits_are_caught(small, broken):
    # interpret=True is blind: every DMA is done at once, so the broken kernel looks right...
    np.testing.assert_array_equal(_rows(small, True, **broken), small[3])
    # ...the simulator completes a DMA only when it is waited on: the unwaited rows are missing.
    out = _rows(small, pltpu.InterpretParams(detect_races=True), **broken)
    missing = np.flatnonzero(out != small[3])
    assert missing.size > 0
    if "_drain" in broken:  # exactly the last `window` rows of each layer were never waited
        assert missing.size == tpu.ROW_WINDOW * (288 + 144)


def test_out_of_range_row_is_caught(small):
    srcs, idx, size, _ = small
    bad = idx.copy()
    bad[3] = 40  # one past the last row; pack_region refuses it, the kernel does not check
    out = tpu.gather_rows_tpu(srcs, jnp.asarray(bad), jnp.zeros(size, jnp.uint32), 16, 20,
                              interpret=True)
    assert out.shape == (size,)  # interpret=True reads garbage silently
    with pytest.raises(Exception, match="Out-of-bounds read"):
        tpu.gather_rows_tpu(srcs, jnp.asarray(bad), jnp.zeros(size, jnp.uint32), 16, 20,
                            interpret=pltpu.InterpretParams()).block_until_ready()


def test_rows_traced_count_and_offset_under_the_simulator(small):
    srcs, idx, size, _ = small
    # Indices padded past n: rows >= n are never copied, and the region moves with offset.
    padded = np.concatenate([idx[:11], np.full(5, 39, np.int32)])
    out = tpu.gather_rows_tpu(srcs, jnp.asarray(padded), jnp.zeros(size, jnp.uint32),
                              jnp.int32(11), jnp.int32(3), interpret=pltpu.InterpretParams())
    np.testing.assert_array_equal(np.asarray(out), _want(srcs, idx[:11], size, 3))


def test_pages_exact_under_the_simulator():
    rng = np.random.default_rng(3)
    srcs = _words(rng, 64, (288, 128))  # 4 pages of 16 rows
    pages = np.array([2, 0, 2, 3], np.int32)
    outs = tpu.gather_pages_tpu(srcs, jnp.asarray(pages), page_size=16,
                                interpret=pltpu.InterpretParams(detect_races=True))
    for s, o in zip(srcs, outs):
        np.testing.assert_array_equal(np.asarray(o), np.asarray(s).reshape(4, 16, -1)[pages])
    assert not _races_found()


def test_backend_page_path_is_taken_and_exact():
    rng = np.random.default_rng(4)
    layers = [rng.integers(0, 256, (64, w), dtype=np.uint8) for w in (1152, 576)]
    rows = (np.array([3, 1])[:, None] * 16 + np.arange(16)).reshape(-1)
    pack = np.full(8 + rows.size * 1728, 0xA5, np.uint8)
    want = reference_region(layers, rows, pack, offset=8)
    pages_only = tpu.TpuBackend(True, "tpu-pages-test", path="pages")
    np.testing.assert_array_equal(pages_only._pack(layers, rows, pack.copy(), 8, "numpy", 16),
                                  want)
    with pytest.raises(ValueError, match="path='pages' needs page_size"):
        pages_only._pack(layers, rows[1:], pack.copy(), 8, "numpy", 16)
    assert tpu.whole_pages(rows, 16).tolist() == [3, 1]
    assert tpu.whole_pages(rows + 1, 16) is None  # not page-aligned
    assert tpu.whole_pages(rows[:-1], 16) is None  # a partial page


# ---------------------------------------------------------------- lowering for a real TPU

# (name, kv_item_len bytes per layer entry, page_size): the geometries the backend takes.
GEOMETRIES = [
    ("deepseek-v3-mla-61x1152", (1152,) * 61, 64),
    ("gqa-8x2x512", (512,) * 16, 16),
    ("fp8-mla-576", (576,) * 4, 128),
    ("fp8-656-and-1152", (656, 1152), 64),
    ("odd-u16-6-10", (6, 10), 16),
    ("odd-u8-3-5", (3, 5), 16),
]


def _sds(shape, dtype=jnp.uint8):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("name,item_lens,page_size", GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
@pytest.mark.parametrize("path", ["rows", "pages"])
def test_exports_for_tpu(name, item_lens, page_size, path):
    from pallas_kernels import word_dtype

    word = word_dtype(item_lens)
    num_rows, m = 1024 * page_size, 512  # KV of 1,024 pages; 512 rows (a bucket) gathered
    layers = [_sds((num_rows, w)) for w in item_lens]
    pack = _sds((m * sum(item_lens) + 4096,))
    if path == "rows":
        fn = functools.partial(tpu._pack_rows_jit, interpret=False, word=word)
        exp = tpu.export_for_tpu(fn, layers, _sds((m,), jnp.int32), pack, _sds((2,), jnp.int32))
    else:
        fn = functools.partial(tpu._pack_pages_jit, interpret=False, word=word,
                               page_size=page_size)
        exp = tpu.export_for_tpu(fn, layers, _sds((m // page_size,), jnp.int32), pack,
                                 _sds((), jnp.int32))
    text = exp.mlir_module()
    assert "tpu_custom_call" in text
    assert exp.platforms == ("tpu",)
    assert exp.out_avals[0].shape == pack.shape


def test_export_catches_what_interpret_mode_lets_through():
    # Why the export tests exist: a 12-row block of a 48-row array breaks Mosaic's block-shape
    # rule (second-minor dim divisible by 8, or equal to the array's). interpret=True runs it;
    # the TPU lowering refuses it. (The page path's blocks are whole pages: equal dims.)
    from jax.experimental import pallas as pl

    def copy(x):
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                              grid=(4,), in_specs=[pl.BlockSpec((12, 128), lambda j: (j, 0))],
                              out_specs=pl.BlockSpec((12, 128), lambda j: (j, 0)),
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=False)(x)

    x = jnp.arange(48 * 128, dtype=jnp.uint32).reshape(48, 128)
    with pltpu.force_tpu_interpret_mode():
        np.testing.assert_array_equal(np.asarray(copy(x)), np.asarray(x))
    with pytest.raises(Exception, match="divisible by 8"):
        tpu.export_for_tpu(copy, _sds((48, 128), jnp.uint32))
