"""Checkable KV bytes: determinism, sensitivity to every byte, allocator page tables, verification."""
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_jax.kv_data import (
    SENTINEL_BYTE,
    allocate_pages,
    fill_rows,
    page_rows,
    row_hashes,
    row_pattern,
    rows_checksum,
    verify_rows,
)


def _splitmix_ref(x: int) -> int:
    """Pure-Python SplitMix64 finaliser (Steele et al. 2014) as the reference."""
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_row_hash_matches_python_reference():
    seed, layer = 1234, 7
    key = _splitmix_ref(seed ^ (layer << 40))
    tokens = np.array([0, 1, 2, 32767, 10**9])
    want = [_splitmix_ref(int(t) ^ key) for t in tokens]
    assert row_hashes(tokens, layer, seed).tolist() == want


@pytest.mark.parametrize("item_len", [1, 7, 8, 576, 1152])
def test_pattern_deterministic_and_shaped(item_len):
    t = np.random.default_rng(0).integers(0, 1 << 20, 50)
    a = row_pattern(t, 3, item_len, seed=5)
    assert a.shape == (50, item_len) and a.dtype == np.uint8 and a.flags.c_contiguous
    np.testing.assert_array_equal(a, row_pattern(t, 3, item_len, seed=5))
    # Rows of one token are the same whatever batch they are generated in.
    np.testing.assert_array_equal(a[7], row_pattern(t[7:8], 3, item_len, seed=5)[0])


def test_rows_differ_across_tokens_layers_seeds_and_words():
    t = np.arange(4096)
    a = row_pattern(t, 0, 1152, seed=0)
    words = a.view(np.uint64)
    # Every row is distinct, and every 8-byte word within a row is distinct.
    assert len(np.unique(words[:, 0])) == 4096
    assert all(len(np.unique(r)) == 144 for r in words[:64])
    assert not np.array_equal(a, row_pattern(t, 1, 1152, seed=0))
    assert not np.array_equal(a, row_pattern(t, 0, 1152, seed=1))
    # Practically never the sentinel.
    assert (words != np.uint64(int.from_bytes(bytes([SENTINEL_BYTE]) * 8, "little"))).all()


def test_pattern_bad_args():
    with pytest.raises(ValueError, match="item_len"):
        row_pattern(np.arange(3), 0, 0, 0)
    with pytest.raises(ValueError, match="layer"):
        row_pattern(np.arange(3), -1, 8, 0)


def test_allocate_pages_is_shuffled_subset_of_pool():
    rng = np.random.default_rng(42)
    p = allocate_pages(100, 160, rng)
    assert p.dtype == np.int64 and len(set(p.tolist())) == 100
    assert p.min() >= 0 and p.max() < 160
    assert not np.array_equal(p, np.arange(100))  # not 0..n-1
    np.testing.assert_array_equal(p, allocate_pages(100, 160, np.random.default_rng(42)))
    with pytest.raises(ValueError, match="pool_pages"):
        allocate_pages(10, 5, rng)
    with pytest.raises(ValueError, match="num_pages"):
        allocate_pages(-1, 5, rng)


def test_page_rows_matches_spec_formula():
    # dcp.md section 3: local index j lives at dst_pages[j // P] * P + j % P.
    pages = np.array([30, 47])
    assert page_rows(pages, np.arange(8), 4).tolist() == [120, 121, 122, 123, 188, 189, 190, 191]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), item_len=st.integers(1, 70), seed=st.integers(0, 2**63),
       layer=st.integers(0, 60), flip=st.integers(0, 10**6))
def test_any_single_bit_flip_is_detected(n, item_len, seed, layer, flip):
    pool = np.full((n + 9, item_len), SENTINEL_BYTE, np.uint8)
    rows = np.random.default_rng(seed % 1000).permutation(n + 9)[:n]
    tokens = np.arange(n) * 3 + 11
    fill_rows(pool, rows, tokens, layer, seed)
    # verify_rows numbers layer entries by position: put the flipped one at index `layer`.
    layers = [np.full_like(pool, SENTINEL_BYTE) for _ in range(layer)] + [pool]
    for i in range(layer):
        fill_rows(layers[i], rows, tokens, i, seed)
    res = verify_rows(layers, rows, tokens, seed)
    assert res["ok"], res
    flat = pool.reshape(-1)
    pos = flip % flat.size
    flat[pos] ^= np.uint8(1 << (flip % 8))
    res = verify_rows(layers, rows, tokens, seed)
    assert not res["ok"] and res["first_bad"][0] == layer
    assert res["bad_rows"] + res["bad_sentinel_rows"] == 1


def test_verify_flags_misplaced_row_and_checksum():
    pool = np.full((16, 24), SENTINEL_BYTE, np.uint8)
    rows = np.array([3, 9, 4])
    tokens = np.array([100, 101, 102])
    fill_rows(pool, rows, tokens, 0, 9)
    assert verify_rows([pool], rows, tokens, 9)["ok"]
    assert rows_checksum(pool, rows) == zlib.crc32(pool[[3, 9, 4]].tobytes())
    # Swap two received rows: both are wrong now.
    swapped = pool.copy()
    swapped[[3, 9]] = swapped[[9, 3]]
    res = verify_rows([swapped], rows, tokens, 9)
    assert res["bad_rows"] == 2 and res["first_bad"] == (0, 3)
    assert rows_checksum(swapped, rows) != rows_checksum(pool, rows)
    with pytest.raises(ValueError, match="len"):
        fill_rows(pool, rows[:2], tokens, 0, 9)
