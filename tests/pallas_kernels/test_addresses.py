"""CPU: the kernels' 64-bit-safe address arithmetic at pack sizes past 2**31 words, without
allocating them: the uint32 address functions evaluated directly against Python integers, the
limits and refusals, and small interpret runs through the same kernel code."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import GatherConfig, gather_rows, gather_rows_reference, unpack_rows
from pallas_kernels._args import offset_arg
from pallas_kernels.config import MAX_PACK_WORDS, addressable_words
from pallas_kernels.pack import _check_word_offset
from pallas_kernels.row_copy import (
    offset_units_to_words,
    region_address,
    region_base,
    region_rows,
)

U32 = np.uint32


def test_addressable_words():
    # uint32 words: a pack over 4 GiB gets 64-bit offsets: every uint32 index is addressable.
    assert addressable_words(2**31 + 5, 4) == 2**31 + 5
    assert addressable_words(2**33, 4) == MAX_PACK_WORDS == 2**32 - 1
    # At most 4 GiB: the lowering's offsets are signed 32-bit.
    assert addressable_words(2**30, 4) == 2**30
    assert addressable_words(2**32, 1) == 2**31 - 1
    assert addressable_words(2**32 + 1, 1) == 2**32 - 1
    assert addressable_words(2**32, 4, "mosaic") == 2**31 - 1


@pytest.mark.parametrize("offset, n, prefix", [
    (0, 2**19, 2**12),                  # exactly 2**31: int32 would wrap to -2**31
    (2**31 - 16, 4096, 288 * 60),       # base past 2**31 (int32 would go negative)
    (2**32 - 2**24, 1024, 2**13),       # near the top
    (2**31 + 4, 32768, 288 * 30 + 144),
])
def test_region_base_and_address_exact_past_2_31(offset, n, prefix):
    exact_base = offset + n * prefix
    if exact_base >= 2**32:
        pytest.skip("beyond the uint32 range (refused before any write)")
    f = jax.jit(lambda o, k: region_base(o, k, prefix))
    base = f(jnp.uint32(offset), jnp.uint32(n))
    assert int(base) == exact_base
    rows = jnp.arange(n - 8, n, dtype=jnp.int32)
    width = 288
    addr = jax.jit(lambda b, r: region_address(b, r, width, 256, 32))(base, rows)
    want = np.array([[exact_base + r * width + 256 + c for c in range(32)]
                     for r in range(n - 8, n)], dtype=np.int64)
    if want.max() < 2**32:
        np.testing.assert_array_equal(np.asarray(addr).astype(np.int64), want)


def test_region_rows_clamps_in_uint32():
    f = jax.jit(lambda rows, ok, off: region_rows(rows, ok, off, pack_words=2**32 - 1,
                                                  total_width=1000, max_rows=2**20))
    # Offset past 2**31: the room is (2**32 - 1 - off) // 1000 rows, not negative.
    off = 2**32 - 1 - 123_456
    assert int(f(jnp.int32(10**6), jnp.int32(1), jnp.uint32(off))) == 123
    assert int(f(jnp.int32(50), jnp.int32(1), jnp.uint32(off))) == 50
    assert int(f(jnp.int32(50), jnp.int32(0), jnp.uint32(off))) == 0  # not ok: nothing
    assert int(f(jnp.int32(-5), jnp.int32(1), jnp.uint32(0))) == 0
    # An offset past the pack leaves no room at all.
    g = jax.jit(lambda off: region_rows(jnp.int32(9), jnp.int32(1), off, pack_words=100,
                                        total_width=1, max_rows=64))
    assert int(g(jnp.uint32(2**31 + 7))) == 0


def test_offset_units_round_trip_past_2_31():
    for off, align in [(2**31 + 4, 4), (2**32 - 16, 16), (2**31 + 1, 1), (12, 4)]:
        units, ok = offset_arg(off, align, "triton", 4)
        assert units.dtype == np.int32 and int(ok) == 1
        assert int(jax.jit(lambda u: offset_units_to_words(u, align))(jnp.asarray(units))) == off
    with pytest.raises(ValueError, match=r"must be <= 4294967295"):
        offset_arg(2**32, 1, "triton", 4)
    with pytest.raises(ValueError, match=r"must be <= 2147483647 .*int32"):
        offset_arg(2**31, 1, "mosaic", 4)


def test_pack_rows_limits_before_any_write():
    w = np.dtype(np.uint32)
    # A 9 GiB pack (2.25 * 2**31 words): a region ending in it passes; past 2**32 words fails.
    big = 9 << 30
    _check_word_offset(2**33, 1152 * 4096, w, [1152], None, big, "triton")
    with pytest.raises(ValueError, match=r"ends past word 4294967295"):
        _check_word_offset(2**34 - 64, 1152 * 4096, w, [1152], None, 20 << 30, "triton")
    # Mosaic keeps int32 addresses.
    with pytest.raises(ValueError, match=r"ends past word 2147483647"):
        _check_word_offset(2**33, 1152, w, [1152], None, big, "mosaic")


def test_interpret_same_code_path_high_offset_units():
    # The uint32 path with offsets given in units of 16 words, region ending exactly at the
    # pack's end (room clamps n to what fits).
    rng = np.random.default_rng(0)
    src = [jnp.asarray(rng.integers(0, 2**32, (20, w), dtype=np.uint32)) for w in (8, 4)]
    idx = np.zeros(16, np.int32)
    idx[:10] = rng.integers(0, 20, 10)
    pack = np.full(64 + 10 * 12, 7, np.uint32)
    out = gather_rows(src, jnp.asarray(idx), jnp.asarray(pack), 10, offset=64,
                      config=GatherConfig(block_rows=8), backend="interpret", offset_align=16)
    ref = gather_rows_reference(src, jnp.asarray(idx), jnp.asarray(pack), 10, offset=64)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    # Ask for more rows than fit: the clamp keeps every store inside the pack.
    out = gather_rows(src, jnp.asarray(idx), jnp.asarray(pack), 16, offset=64,
                      config=GatherConfig(block_rows=8), backend="interpret", offset_align=16)
    np.testing.assert_array_equal(np.asarray(out)[:64], 7)


def test_unpack_interpret_region_at_the_end():
    rng = np.random.default_rng(1)
    n, lens = 9, (16, 8)
    pack = rng.integers(0, 256, 32 + n * 24, dtype=np.uint8)
    layers = [np.zeros((12, w), np.uint8) for w in lens]
    idx = rng.permutation(12)[:n]
    unpack_rows(pack, layers, idx, offset=32, backend="interpret",
                config=GatherConfig(block_rows=8))
    np.testing.assert_array_equal(layers[0][idx], pack[32:32 + n * 16].reshape(n, 16))
    np.testing.assert_array_equal(layers[1][idx], pack[32 + n * 16:].reshape(n, 8))
