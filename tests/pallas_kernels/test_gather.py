"""CPU: the Pallas gather kernel in interpret mode, bit-exact against `jnp.take`.

The same kernel body runs compiled (Triton) on a GPU; tests/gpu covers that.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    GatherConfig,
    bucket_rows,
    gather_rows,
    gather_rows_reference,
    pow2_chunks,
    select_backend,
    word_dtype,
)
from pallas_kernels import mosaic_gather

SCHEDULES = [GatherConfig(block_rows=16), GatherConfig(block_rows=16, schedule="loop"),
             GatherConfig(block_rows=8, schedule="loop", layers_per_step=2),
             # Two layer entries per program (3 entries: the last program's second is masked
             # off), pieces stored right after their loads, loads hinted evict_first.
             GatherConfig(block_rows=16, layers_per_program=2),
             GatherConfig(block_rows=16, interleave=True, load_eviction_policy="evict_first"),
             GatherConfig(block_rows=8, layers_per_program=3, interleave=True),
             # Layer axis launched fastest; tail rows read nothing (masked loads).
             GatherConfig(block_rows=16, layers_fastest=True, mask_loads=True),
             GatherConfig(block_rows=8, layers_per_program=2, layers_fastest=True,
                          mask_loads=True),
             # The tuned default's hint (evict_last loads) and the L2-only cache operator.
             GatherConfig(block_rows=16, num_warps=16, interleave=True,
                          load_eviction_policy="evict_last", load_cache_modifier=".cg")]
_ids = lambda c: (f"{c.schedule}_br={c.block_rows}_lps={c.layers_per_step}"  # noqa: E731
                  f"_lpp={c.layers_per_program}_il={int(c.interleave)}_{c.load_eviction_policy}"
                  f"_ml={int(c.mask_loads)}_lf={int(c.layers_fastest)}_{c.load_cache_modifier}")


def _words(rng, shape, dtype):
    return rng.integers(0, int(np.iinfo(dtype).max) + 1, shape, dtype=np.uint64).astype(dtype)


def _run(src, idx, pack, n, offset, cfg):
    out = gather_rows(src, jnp.asarray(idx), jnp.asarray(pack), n, offset=offset, config=cfg,
                      backend="interpret")
    ref = gather_rows_reference(src, jnp.asarray(idx), jnp.asarray(pack), n, offset=offset)
    return np.asarray(out), np.asarray(ref)


@pytest.mark.parametrize("cfg", SCHEDULES, ids=_ids)
@pytest.mark.parametrize("n", [1, 37, 64])
def test_stacked_uint16_ragged_tail(cfg, n):
    # 37 rows is not a multiple of the 16-row block: the tail block is masked.
    rng = np.random.default_rng(n)
    L, R, W = 3, 90, 36
    src = jnp.asarray(_words(rng, (L, R, W), np.uint16))
    idx = rng.integers(0, R, 64).astype(np.int32)
    pack = _words(rng, L * n * W + 29, np.uint16)
    out, ref = _run(src, idx, pack, n, 5, cfg)
    np.testing.assert_array_equal(out, ref)
    # Words outside the region keep their value (ref only writes the region).
    np.testing.assert_array_equal(out[:5], pack[:5])
    np.testing.assert_array_equal(out[5 + L * n * W:], pack[5 + L * n * W:])


def test_576_words_split_512_plus_64():
    assert pow2_chunks(576) == ((0, 512), (512, 64))
    rng = np.random.default_rng(1)
    L, R, W, n = 2, 40, 576, 21
    src = jnp.asarray(_words(rng, (L, R, W), np.uint16))  # bf16 MLA rows as uint16
    idx = rng.integers(0, R, 32).astype(np.int32)
    out, ref = _run(src, idx, _words(rng, L * n * W, np.uint16), n, 0, GatherConfig(16))
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("cfg", SCHEDULES, ids=_ids)
def test_list_mixed_item_len(cfg):
    rng = np.random.default_rng(2)
    R, n = 50, 19
    widths = (36, 5, 1, 33)  # words of uint16: 72 B, 10 B, 2 B, 66 B rows
    srcs = [jnp.asarray(_words(rng, (R, w), np.uint16)) for w in widths]
    idx = rng.integers(0, R, 32).astype(np.int32)
    pack = _words(rng, n * sum(widths) + 17, np.uint16)
    out, ref = _run(srcs, idx, pack, n, 3, cfg)
    np.testing.assert_array_equal(out, ref)


def test_list_equals_stacked_uint8():
    rng = np.random.default_rng(3)
    L, R, W, n = 3, 30, 1152, 9  # 1152-B rows as bytes: 1024 + 128
    data = _words(rng, (L, R, W), np.uint8)
    idx = jnp.asarray(rng.integers(0, R, 16).astype(np.int32))
    cfg = GatherConfig(block_rows=8)
    a = gather_rows(jnp.asarray(data), idx, jnp.zeros(L * n * W, jnp.uint8), n, config=cfg,
                    backend="interpret")
    b = gather_rows([jnp.asarray(x) for x in data], idx, jnp.zeros(L * n * W, jnp.uint8), n,
                    config=cfg, backend="interpret")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a).reshape(L, n, W), data[:, np.asarray(idx)[:n]])


def test_variable_n_reuses_one_compile():
    rng = np.random.default_rng(4)
    L, R, W = 2, 40, 8
    src = jnp.asarray(_words(rng, (L, R, W), np.uint32))
    idx = jnp.asarray(rng.integers(0, R, bucket_rows(20, 16)).astype(np.int32))
    P = L * 32 * W
    cfg = GatherConfig(block_rows=16)
    gather_rows(src, idx, jnp.zeros(P, jnp.uint32), 3, config=cfg, backend="interpret")
    size = gather_rows._cache_size()
    for n in (0, 1, 17, 20, 32):
        out = gather_rows(src, idx, jnp.zeros(P, jnp.uint32), n, config=cfg, backend="interpret")
        ref = gather_rows_reference(src, idx, jnp.zeros(P, jnp.uint32), n)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert gather_rows._cache_size() == size


def test_n_is_clamped_to_the_pack_and_indices_to_the_rows():
    rng = np.random.default_rng(5)
    L, R, W = 2, 10, 4
    src = jnp.asarray(_words(rng, (L, R, W), np.uint32))
    idx = jnp.asarray(np.arange(16, dtype=np.int32))
    P = L * 5 * W + 3  # room for 5 rows only
    pack = jnp.full(P, 7, jnp.uint32)
    out = np.asarray(gather_rows(src, idx, pack, 16, config=GatherConfig(block_rows=8),
                                 backend="interpret"))
    np.testing.assert_array_equal(out[:L * 5 * W], np.asarray(src)[:, :5].reshape(-1))
    assert np.all(out[L * 5 * W:] == 7)


def test_cpu_really_interprets():
    # The jaxpr must hold a pallas_call with interpret=True, and no Triton/Mosaic custom call.
    assert jax.default_backend() == "cpu"
    assert select_backend("auto") == "interpret"
    src = jnp.zeros((2, 8, 4), jnp.uint32)
    f = functools.partial(gather_rows, config=GatherConfig(block_rows=8), backend="auto")
    jaxpr = str(jax.make_jaxpr(lambda s, i, p: f(s, i, p, 3))(
        src, jnp.zeros(8, jnp.int32), jnp.zeros(64, jnp.uint32)))
    assert "pallas_call" in jaxpr and "interpret=True" in jaxpr
    hlo = jax.jit(lambda s, i, p: f(s, i, p, 3)).lower(
        src, jnp.zeros(8, jnp.int32), jnp.zeros(64, jnp.uint32)).as_text()
    assert "triton" not in hlo and "mosaic" not in hlo


def test_in_place_alias_and_donation():
    src = jnp.arange(2 * 8 * 4, dtype=jnp.uint32).reshape(2, 8, 4)
    lowered = jax.jit(functools.partial(gather_rows, backend="interpret"),
                      donate_argnums=(2,)).lower(src, jnp.zeros(8, jnp.int32),
                                                 jnp.zeros(64, jnp.uint32), 3)
    assert "tf.aliasing_output" in lowered.as_text()


def test_mosaic_form_in_gpu_interpret_mode():
    rng = np.random.default_rng(6)
    L, R, W, n = 2, 40, 32, 21  # 128-B rows: the bulk-copy quantum
    src = jnp.asarray(_words(rng, (L, R, W), np.uint32))
    idx = jnp.asarray(rng.integers(0, R, 32).astype(np.int32))
    pack = _words(rng, L * n * W + 64, np.uint32)
    f = jax.jit(lambda s, i, p, k: mosaic_gather.gather_rows_mosaic(
        s, i, p, k, offset=32, widths=(W,) * L, config=GatherConfig(block_rows=32),
        interpret=True), donate_argnums=2)
    out = f(src, idx, jnp.asarray(pack), jnp.int32(n))
    ref = gather_rows_reference(src, idx, jnp.asarray(pack), n, offset=32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_mosaic_rejects_rows_off_the_copy_quantum():
    with pytest.raises(ValueError, match="multiple of 128 bytes"):
        mosaic_gather.gather_rows_mosaic(
            jnp.zeros((1, 8, 36), jnp.uint32), jnp.zeros(32, jnp.int32),
            jnp.zeros(2000, jnp.uint32), jnp.int32(1), offset=0, widths=(36,),
            config=GatherConfig(block_rows=32))


def test_helpers():
    assert word_dtype([1152, 576]) == np.uint32
    # The word depends on the row lengths alone; an offset is only checked against it.
    assert word_dtype([1152, 576], offset=64) == np.uint32
    with pytest.raises(ValueError, match="offset=2 must be a multiple of 4 bytes"):
        word_dtype([1152, 576], offset=2)
    assert word_dtype([656, 3]) == np.uint8
    assert word_dtype([2]) == np.uint16
    assert bucket_rows(0) == 32 and bucket_rows(33) == 64 and bucket_rows(4096) == 4096
    assert bucket_rows(5, 16) == 16
    assert bucket_rows(0, 1) == bucket_rows(1, 1) == 1  # was 2: (0 - 1).bit_length() is 1
    assert pow2_chunks(288) == ((0, 256), (256, 32))
    assert pow2_chunks(5) == ((0, 4), (4, 1))
    assert sum(s for _, s in pow2_chunks(1153)) == 1153


@pytest.mark.parametrize("kwargs, match", [
    ({"block_rows": 24}, "block_rows"), ({"num_warps": 3}, "num_warps"),
    ({"num_stages": 0}, "num_stages"), ({"schedule": "zigzag"}, "schedule"),
    ({"eviction_policy": "evict_never"}, "eviction_policy"), ({"layers_per_step": 0}, "layers"),
    ({"layers_per_program": 0}, "layers_per_program"), ({"load_eviction_policy": "x"}, "load_eviction"),
    ({"load_cache_modifier": "cg"}, "load_cache_modifier"),
    ({"block_rows": 2**40}, "block_rows"), ({"num_warps": 2**20}, "num_warps"),
    ({"num_stages": 10**9}, "num_stages"),
    ({"load_cache_modifier": ".cs"}, "load_cache_modifier"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GatherConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"block_rows": True}, "block_rows"), ({"block_rows": 2.0}, "block_rows"),
    ({"num_stages": 1.5}, "num_stages"), ({"layers_per_step": 2.5}, "layers_per_step"),
    ({"interleave": "no"}, "interleave"), ({"mask_loads": 5}, "mask_loads"),
    ({"layers_fastest": None}, "layers_fastest"),
])
def test_config_type_errors(kwargs, match):
    with pytest.raises(TypeError, match=match):
        GatherConfig(**kwargs)


def test_default_config_is_the_tuned_one():
    d = GatherConfig.default()
    assert (d.block_rows, d.num_warps, d.interleave, d.load_eviction_policy) == (
        64, 16, True, "evict_last")
    assert bucket_rows(100, d.block_rows) == 128


def test_cache_modifier_patch_adds_dotted_keys_once():
    from jax._src.pallas.triton import lowering

    from pallas_kernels.gather import _patch_cache_modifiers

    _patch_cache_modifiers()
    _patch_cache_modifiers()  # idempotent
    table = lowering._STR_TO_CACHE_MODIFIER
    assert table[".cg"] is table["cg"] and table[".ca"] is table["ca"]


def test_bad_inputs():
    src = jnp.zeros((2, 8, 4), jnp.uint32)
    idx = jnp.zeros(8, jnp.int32)
    pack = jnp.zeros(64, jnp.uint32)
    with pytest.raises(ValueError, match="backend"):
        gather_rows(src, idx, pack, backend="cuda")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        gather_rows(src, idx, pack, backend="triton")
    with pytest.raises(TypeError, match="pack dtype"):
        gather_rows(src, idx, jnp.zeros(64, jnp.uint16), backend="interpret")
    with pytest.raises(ValueError, match="pack must be 1-D"):
        gather_rows(src, idx, jnp.zeros((8, 8), jnp.uint32), backend="interpret")
    with pytest.raises(ValueError, match="indices must be 1-D"):
        gather_rows(src, jnp.zeros((2, 4), jnp.int32), pack, backend="interpret")
    with pytest.raises(TypeError, match="indices dtype"):
        gather_rows(src, jnp.zeros(8, jnp.float32), pack, backend="interpret")
    with pytest.raises(ValueError, match="offset"):
        gather_rows(src, idx, pack, offset=-1, backend="interpret")
    with pytest.raises(ValueError, match="src must be"):
        gather_rows(jnp.zeros((8, 4), jnp.uint32), idx, pack, backend="interpret")
    with pytest.raises(TypeError, match="share one dtype"):
        gather_rows([jnp.zeros((8, 4), jnp.uint32), jnp.zeros((8, 4), jnp.uint16)], idx, pack,
                    backend="interpret")
    with pytest.raises(TypeError, match="uint32/uint16/uint8"):
        gather_rows(jnp.zeros((2, 8, 4), jnp.float32), idx, jnp.zeros(64, jnp.float32),
                    backend="interpret")
    with pytest.raises(ValueError, match="item_lens"):
        word_dtype([])


@pytest.mark.parametrize("stacked", [True, False])
def test_reference_clamps_as_the_kernel_does(stacked):
    # Before (fresh-user trial): the oracle wrapped negative indices, filled past-the-end ones
    # with 0xFFFFFFFF and raised a JAX broadcasting error for a region past the pack's end,
    # where the kernel clamps both (its docstring: "same arguments and result").
    rng = np.random.default_rng()
    for _ in range(6):
        R, W, L = int(rng.integers(2, 9)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
        if stacked:
            src = jnp.asarray(rng.integers(0, 2**32, (L, R, W), dtype=np.uint32))
        else:  # rows differ per layer: indices clamp to the smallest
            src = [jnp.asarray(rng.integers(0, 2**32, (R + k, W + k), dtype=np.uint32)) for k in range(L)]
        m = int(rng.integers(1, 12))
        idx = jnp.asarray(rng.integers(-3 * R, 3 * R, m), jnp.int32)
        pack_words = int(rng.integers(0, 4 * m * (W + L)))
        pack = jnp.asarray(rng.integers(0, 2**32, pack_words, dtype=np.uint32))
        offset = int(rng.integers(0, pack_words + 2))
        n = int(rng.integers(0, m + 3))
        want = np.asarray(gather_rows_reference(src, idx, pack, n, offset=offset))
        got = np.asarray(gather_rows(src, idx, jnp.array(pack), n, offset=offset, config=GatherConfig(block_rows=8),
                                     backend="interpret"))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("stacked", [True, False])
def test_an_empty_pack_is_returned_as_it_is(stacked):
    # Before: a zero-word pack (drawn now and then by the random test above) failed to lower in
    # interpret mode ("Slice size at index 0 in gather op is out of range").
    src = jnp.arange(2 * 5 * 3, dtype=jnp.uint32).reshape(2, 5, 3)
    src = src if stacked else [src[0], src[1]]
    pack = jnp.zeros(0, jnp.uint32)
    got = gather_rows(src, jnp.asarray([1, 4], jnp.int32), pack, 2, config=GatherConfig(block_rows=8),
                      backend="interpret")
    assert got.shape == (0,) and got.dtype == jnp.uint32
    assert gather_rows_reference(src, jnp.asarray([1, 4], jnp.int32), pack, 2).shape == (0,)


def test_small_helpers_refuse_what_their_docstrings_exclude():
    # Before (fresh-user trial): bucket_rows(5, block_rows=3) gave 8 (no multiple of 3),
    # pow2_chunks(-4) gave (), addressable_words(-1, 4) gave -1 and took an itemsize of 3.
    from pallas_kernels import addressable_words

    for br in (3, 0, -2, True, 2.0):
        with pytest.raises(ValueError, match="block_rows"):
            bucket_rows(5, block_rows=br)
    assert [bucket_rows(n, block_rows=4) for n in (0, 1, 4, 5, 9)] == [4, 4, 4, 8, 16]
    for w in (-4, True, 2.5):
        with pytest.raises(ValueError, match="width"):
            pow2_chunks(w)
    assert pow2_chunks(0) == () and pow2_chunks(5) == ((0, 4), (4, 1))
    with pytest.raises(ValueError, match="pack_words"):
        addressable_words(-1, 4)
    with pytest.raises(ValueError, match="itemsize"):
        addressable_words(100, 3)
    with pytest.raises(ValueError, match="backend"):
        addressable_words(100, 4, "tpu")
    assert addressable_words(2**31 + 5, 1) == 2**31 - 1 and addressable_words(2**31 + 5, 4) == 2**31 + 5
