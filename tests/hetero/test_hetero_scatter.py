"""The decode-side jitted scatter equals the numpy adapter byte for byte, for every layout."""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax.hetero import CacheGeometry, cache_shape, gather_to_wire, place_from_wire
from dcp_jax.hetero.scatter import place_wire_jax


@pytest.mark.parametrize("layout, dtype", [("sglang_mla", "bfloat16"), ("tpu_mla", "bfloat16"),
                                           ("tpu_mla", "float8_e4m3fn"), ("nhd", "bfloat16"), ("hnd", "bfloat16"),
                                           ("tpu_gqa", "bfloat16")])
def test_scatter_equals_place_from_wire(layout, dtype):
    rng = np.random.default_rng(len(layout) * 31 + len(dtype))
    mla = layout in ("sglang_mla", "tpu_mla")
    np_dtype = np.uint16 if dtype == "bfloat16" else np.uint8
    for n, (h0, nh) in itertools.product((1, 7, 33), [(0, 1)] if mla else [(0, 4), (1, 2)]):
        geom = CacheGeometry(layout, 4, 16, 1 if mla else 4, 72 if mla else 8, dtype)
        cache = rng.integers(0, np.iinfo(np_dtype).max, cache_shape(geom), dtype=np.int64).astype(np_dtype)
        cells = rng.choice(geom.num_pages * geom.page_size, size=n, replace=False)
        pages, slots = cells // geom.page_size, cells % geom.page_size
        src = rng.integers(0, np.iinfo(np_dtype).max, cache_shape(geom), dtype=np.int64).astype(np_dtype)
        wire = gather_to_wire(geom, src, pages, slots, h0, nh)
        want = cache.copy()
        place_from_wire(geom, want, wire, pages, slots, h0, nh)
        got = place_wire_jax(geom, jnp.asarray(cache), wire, pages, slots, h0, nh)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_scatter_bad_input_named():
    geom = CacheGeometry("nhd", 2, 4, 2, 8, "bfloat16")
    cache = jnp.zeros(cache_shape(geom), jnp.uint16)
    with pytest.raises(ValueError, match="cache must have shape"):
        place_wire_jax(geom, jnp.zeros((3,), jnp.uint16), np.zeros(4, np.uint8), [0], [0])
    with pytest.raises(ValueError, match="wire must be 64 uint8 bytes"):
        place_wire_jax(geom, cache, np.zeros(4, np.uint8), [0], [0])
