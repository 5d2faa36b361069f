"""Layout adapters: byte-exact round trips through every adapter pair, the wire format against
sglang's pack rows, descriptor counts against the exact contiguity of the byte offsets."""
from __future__ import annotations

import itertools
import pathlib
import sys

import numpy as np
import pytest

from dcp_jax.hetero import (GQA_LAYOUTS, MLA_LAYOUTS, CacheGeometry, cache_shape, gather_to_wire, place_from_wire,
                            run_descriptors, segments)

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from hetero_reference import cell  # noqa: E402

PAIRS = list(itertools.product(MLA_LAYOUTS, MLA_LAYOUTS)) + list(itertools.product(GQA_LAYOUTS, GQA_LAYOUTS))


def _cache(rng, geom: CacheGeometry) -> np.ndarray:
    dtype = {2: np.uint16, 1: np.uint8, 4: np.uint32}[geom.itemsize]
    return rng.integers(0, np.iinfo(dtype).max, size=cache_shape(geom), dtype=dtype)


def _rows(rng, geom: CacheGeometry, n: int):
    cells = rng.choice(geom.num_pages * geom.page_size, size=n, replace=False)
    return cells // geom.page_size, cells % geom.page_size


@pytest.mark.parametrize("src_layout, dst_layout", PAIRS)
def test_round_trip_every_adapter_pair(src_layout, dst_layout):
    rng = np.random.default_rng(hash((src_layout, dst_layout)) % 2**32)
    mla = src_layout in MLA_LAYOUTS
    for trial, (n, dtype) in enumerate(itertools.product((1, 7, 13, 32), ("bfloat16", "float8_e4m3fn") if mla
                                                           else ("bfloat16",))):
        heads, hd = (1, 72 if trial % 2 else 128) if mla else (4, 8)
        sg = CacheGeometry(src_layout, 5, 16, heads, hd, dtype)
        dg = CacheGeometry(dst_layout, 3, 32, heads, hd, dtype)
        src, dst = _cache(rng, sg), _cache(rng, dg)
        before = dst.copy()
        h0, nh = (0, 1) if mla else (trial % 3, 1 + trial % 2)
        sp, ss = _rows(rng, sg, n)
        dp, ds = _rows(rng, dg, n)
        wire = gather_to_wire(sg, src, sp, ss, h0, nh)
        place_from_wire(dg, dst, wire, dp, ds, h0, nh)
        assert np.array_equal(gather_to_wire(dg, dst, dp, ds, h0, nh), wire)
        touched = np.zeros(dst.shape, bool)
        for i, plane, h in itertools.product(range(n), range(1 if mla else 2), range(h0, h0 + nh)):
            assert np.array_equal(cell(dst_layout, dst, dp[i], ds[i], plane, h, hd),
                                  cell(src_layout, src, sp[i], ss[i], plane, h, hd))
            cell(dst_layout, touched, dp[i], ds[i], plane, h, hd)[...] = True
        # Nothing else changed (TPU MLA lane padding and the odd token's row-mate included).
        assert np.array_equal(dst[~touched], before[~touched])


def test_wire_is_sglang_pack_rows_and_kv_planes():
    rng = np.random.default_rng(0)
    g = CacheGeometry("sglang_mla", 4, 16, 1, 576)
    cache = _cache(rng, g)
    rows = np.array([5, 6, 40, 17, 63])
    wire = gather_to_wire(g, cache, rows // 16, rows % 16)
    assert wire.tobytes() == cache.reshape(-1, 576)[rows].tobytes()   # n rows of item_len = 1152 B
    g = CacheGeometry("nhd", 4, 16, 4, 8)
    cache = _cache(rng, g)
    wire = gather_to_wire(g, cache, rows // 16, rows % 16, 1, 2)
    k, v = (cache[p].reshape(64, 4, 8)[rows, 1:3] for p in (0, 1))
    assert wire.tobytes() == k.tobytes() + v.tobytes()


def test_tpu_mla_two_tokens_per_row_odd_count():
    g = CacheGeometry("tpu_mla", 2, 4, 1, 576)
    assert cache_shape(g) == (2, 2, 2, 640)
    cache = np.zeros(cache_shape(g), np.uint16)
    wire = np.arange(3 * 576, dtype=np.uint16).view(np.uint8)
    place_from_wire(g, cache, wire, [1, 1, 1], [0, 1, 2])
    assert np.array_equal(cache[1, 0, 1, :576], np.arange(576, 1152)) and cache[1, 1, 1].max() == 0
    assert cache[1, :, :, 576:].max() == 0 and cache[0].max() == 0
    assert cache_shape(CacheGeometry("tpu_mla", 2, 16, 1, 576, "float8_e4m3fn")) == (2, 4, 4, 640)


@pytest.mark.parametrize("layout", MLA_LAYOUTS + GQA_LAYOUTS)
def test_run_descriptors_match_exact_contiguity(layout):
    rng = np.random.default_rng(1)
    mla = layout in MLA_LAYOUTS
    for hd in ((64, 128) if mla else (8,)):
        g = CacheGeometry(layout, 3, 16, 1 if mla else 4, hd)
        for _ in range(40):
            run_len = int(rng.integers(1, 17))
            s0 = int(rng.integers(0, 17 - run_len))
            h0 = 0 if mla else int(rng.integers(0, 4))
            nh = 1 if mla else int(rng.integers(1, 5 - h0))
            off, seg = segments(g, np.full(run_len, 1), np.arange(s0, s0 + run_len), h0, nh)
            exact = 0
            for plane in range(off.shape[1]):       # descriptors never span the K and V planes
                o = off[:, plane, :].reshape(-1)
                exact += 1 + int((np.diff(o) != seg).sum())
            assert int(run_descriptors(g, [run_len], nh)[0]) == exact, (layout, hd, run_len, s0, h0, nh)


def test_bad_inputs_named():
    g = CacheGeometry("nhd", 2, 4, 2, 8)
    cache = np.zeros(cache_shape(g), np.uint16)
    with pytest.raises(ValueError, match="cache must have shape"):
        gather_to_wire(g, cache[:, :1], [0], [0])
    with pytest.raises(ValueError, match="slots must lie in"):
        gather_to_wire(g, cache, [0], [4])
    with pytest.raises(ValueError, match="pages must lie in"):
        gather_to_wire(g, cache, [2], [0])
    with pytest.raises(ValueError, match="head range"):
        gather_to_wire(g, cache, [0], [0], 1, 2)
    with pytest.raises(ValueError, match="wire must be 64 uint8 bytes"):
        place_from_wire(g, cache, np.zeros(63, np.uint8), [0], [0])
    with pytest.raises(ValueError, match="pages and slots must have equal length"):
        gather_to_wire(g, cache, [0, 1], [0])
    with pytest.raises(TypeError, match="cache must be a numpy array"):
        gather_to_wire(g, cache.tolist(), [0], [0])
    with pytest.raises(ValueError, match="page_size=1 must be a multiple of 2"):
        CacheGeometry("tpu_mla", 2, 1, 1, 576)
    with pytest.raises(ValueError, match="num_heads must be 1"):
        CacheGeometry("sglang_mla", 2, 16, 2, 576)
    with pytest.raises(ValueError, match="layout must be one of"):
        CacheGeometry("vllm", 2, 16, 1, 576)
    with pytest.raises(ValueError, match="dtype must be one of"):
        CacheGeometry("nhd", 2, 16, 1, 8, "int4")
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        CacheGeometry("nhd", 2, 0, 1, 8)
