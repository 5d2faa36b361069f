"""CPU: every pack backend equals the one reference gather, byte for byte, on one case matrix.

Kernel backends run in their interpret forms (`tpu-interpret`, `gpu-triton-interpret`,
`gpu-mosaic-interpret`); a backend that cannot take a geometry must refuse it with a
ValueError saying why (checked too). Slow-ish: gpu-mosaic-interpret (about 1 s per case).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import registry
from pallas_kernels.registry import pack_region, reference_region

SENTINEL = 0xA5
ROWS = 96

# name -> (item_lens in bytes, indices maker, byte offset, page_size)
CASES = {
    # DeepSeek-V3 MLA: 576 bf16 = 1152 B per token per layer; unsorted with duplicates.
    "mla-1152": ((1152, 1152, 1152), lambda r: r.integers(0, ROWS, 21), 64, None),
    # GQA: K and V entries of 2 kv heads x 128 dims bf16 = 512 B, two layers.
    "gqa-512": ((512, 512, 512, 512), lambda r: r.permutation(ROWS)[:17], 128, None),
    # FP8 MLA rows: 576 B (fp8 latent + rope) and DeepSeek-V3.2's 656 B.
    "fp8-576": ((576,), lambda r: r.integers(0, ROWS, 13), 36, None),
    "fp8-656-mixed": ((656, 1152), lambda r: r.integers(0, ROWS, 9), 16, None),
    # Odd widths: a uint8 word (3, 5 B) and a uint16 word (6, 10 B); odd offset for uint8.
    "odd-3-5": ((3, 5), lambda r: r.integers(0, ROWS, 11), 7, None),
    "odd-6-10": ((6, 10), lambda r: r.integers(0, ROWS, 11), 2, None),
    "empty": ((1152,), lambda r: np.zeros(0, np.int64), 0, None),
    "duplicates-sorted-desc": ((1152,), lambda r: np.array([5, 5, 5, 90, 3, 3, 0, 95][::-1]),
                               0, None),
    # Block round-robin: whole pages (pages 4, 1, 4 of 16 rows): the tpu page path.
    "pages-16": ((1152, 576), lambda r: (np.array([4, 1, 4])[:, None] * 16
                                         + np.arange(16)).reshape(-1), 32, 16),
}

# Backends that run on this CPU machine, by array kind they are fed here.
NUMPY_BACKENDS = ("host", "xla", "tpu-interpret", "gpu-triton-interpret", "gpu-mosaic-interpret")
JAX_BACKENDS = ("xla", "tpu-interpret", "gpu-triton-interpret")


def _case(name):
    item_lens, make_idx, offset, page_size = CASES[name]
    rng = np.random.default_rng(sum(item_lens) + len(name))
    layers = [rng.integers(0, 256, (ROWS, w), dtype=np.uint8) for w in item_lens]
    idx = np.asarray(make_idx(rng), np.int64)
    size = offset + idx.size * sum(item_lens) + 37
    return layers, idx, np.full(size, SENTINEL, np.uint8), offset, page_size


def _run(name, backend, kind):
    layers, idx, pack, offset, page_size = _case(name)
    want = reference_region(layers, idx, pack, offset=offset)
    b = registry.get_backend(backend)
    why = b.unsupported(tuple(a.shape[1] for a in layers), offset)
    if kind == "jax":
        layers, idx, pack = [jnp.asarray(a) for a in layers], jnp.asarray(idx), jnp.asarray(pack)
    if why is not None:
        with pytest.raises(ValueError, match="cannot pack here"):
            pack_region(layers, idx, pack, offset=offset, backend=backend, page_size=page_size)
        return why
    out = pack_region(layers, idx, pack, offset=offset, backend=backend, page_size=page_size)
    if kind == "numpy":
        assert out is pack  # written in place
    np.testing.assert_array_equal(np.asarray(out), want)
    return None


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_numpy_buffers_match_reference(backend, case):
    _run(case, backend, "numpy")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", JAX_BACKENDS)
def test_jax_arrays_match_reference(backend, case):
    _run(case, backend, "jax")


def test_refusals_say_why():
    # The kernels move words: a 4-byte word cannot start at byte 2; Mosaic GPU needs 128-B rows.
    assert "multiple of 4" in registry.get_backend("tpu-interpret").unsupported((1152,), 2)
    assert "128 B" in registry.get_backend("gpu-mosaic-interpret").unsupported((576,), 0)
    assert registry.get_backend("xla").unsupported((1152,), 3) is None
    assert _run("fp8-576", "gpu-mosaic-interpret", "numpy") is not None


def test_auto_picks_by_platform():
    layers, idx, pack, offset, _ = _case("mla-1152")
    assert registry.select_pack_backend(layers, pack).name == "host"
    jl = [jnp.asarray(a) for a in layers]
    assert registry.array_platform(jl[0]) == "cpu"
    assert registry.select_pack_backend(jl, jnp.asarray(pack)).name == "xla"
    out = pack_region(jl, idx, jnp.asarray(pack), offset=offset)
    np.testing.assert_array_equal(np.asarray(out), reference_region(layers, idx, pack,
                                                                    offset=offset))


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_every_backend_refuses_a_pack_it_cannot_write_in_place(backend):
    """A numpy pack is written in place by every backend, so every backend refuses the same
    packs (strided, read-only, aliasing a layer) before writing anything."""
    rng = np.random.default_rng()
    layers = [rng.integers(0, 256, (10, 16), dtype=np.uint8), rng.integers(0, 256, (12, 32), dtype=np.uint8)]
    before = [a.copy() for a in layers]
    strided = np.zeros(400, np.uint8)
    with pytest.raises(ValueError, match="pack must be C-contiguous"):
        pack_region(layers, [0, 3], strided[::2], backend=backend)
    readonly = np.frombuffer(bytes(200), np.uint8)
    with pytest.raises(ValueError, match="pack must be writeable"):
        pack_region(layers, [0, 3], readonly, backend=backend)
    with pytest.raises(ValueError, match="pack shares memory with layers\\[1\\]"):
        pack_region(layers, [0, 3], layers[1].reshape(-1), backend=backend)
    assert (strided == 0).all()  # nothing written anywhere
    for a, b in zip(layers, before):
        np.testing.assert_array_equal(a, b)


def test_registry_names_and_availability():
    names = registry.backend_names()
    for n in ("tpu", "tpu-interpret", "gpu-mosaic", "gpu-triton", "xla", "host"):
        assert n in names
    here = registry.available_backends()
    assert set(NUMPY_BACKENDS) <= set(here)
    # No TPU and no GPU on the CI machine: the hardware backends say so by name.
    for n in ("tpu", "gpu-triton", "gpu-mosaic"):
        assert n not in here
        with pytest.raises(ValueError, match=f"backend='{n}' cannot pack here: no "):
            pack_region(*_case("mla-1152")[:3], backend=n)


def test_bad_inputs_name_the_argument():
    layers, idx, pack, _, _ = _case("mla-1152")
    with pytest.raises(ValueError, match="backend='nope' must be 'auto' or one of"):
        pack_region(layers, idx, pack, backend="nope")
    with pytest.raises(ValueError, match="takes \\('numpy',\\) arrays, not jax"):
        pack_region([jnp.asarray(a) for a in layers], idx, jnp.asarray(pack), backend="host")
    with pytest.raises(ValueError, match="indices must be in \\[0, num_rows=96\\)"):
        pack_region(layers, [0, ROWS], pack)
    with pytest.raises(ValueError, match="indices must be in"):
        pack_region(layers, [-1], pack)
    with pytest.raises(TypeError, match="indices dtype float64"):
        pack_region(layers, np.array([1.0]), pack)
    with pytest.raises(ValueError, match="offset=-1"):
        pack_region(layers, idx, pack, offset=-1)
    with pytest.raises(ValueError, match="pack region overflow"):
        pack_region(layers, idx, pack, offset=pack.size)
    with pytest.raises(TypeError, match="layers\\[1\\] is a jax array but pack is numpy"):
        pack_region([layers[0], jnp.asarray(layers[1])], idx, pack)
    with pytest.raises(TypeError, match="layers\\[0\\] dtype uint16"):
        pack_region([layers[0].view(np.uint16)], idx, pack)
    with pytest.raises(ValueError, match="layers must be a non-empty list"):
        pack_region([], idx, pack)
    with pytest.raises(ValueError, match="pack must be a 1-D uint8"):
        pack_region(layers, idx, pack.reshape(1, -1))
    with pytest.raises(ValueError, match="page_size=0"):
        pack_region(layers, idx, pack, page_size=0)
    with pytest.raises(TypeError, match="numpy, CuPy or JAX array"):
        pack_region(layers, idx, bytearray(10))
    for bad in ("12", None, 3):  # was ValueError "must be 1-D, got shape ()" (pack_rows: TypeError)
        with pytest.raises(TypeError, match="indices must be a sequence or 1-D array of ints"):
            pack_region(layers, bad, pack)
    for bad in ("12", None):  # the reference says so too (it named no argument)
        with pytest.raises(TypeError, match="indices must be a sequence or 1-D array of ints"):
            reference_region(layers, bad, pack)
    for backend in ("host", "xla", "tpu-interpret"):  # xla took a 0-byte layer, the others refused
        with pytest.raises(ValueError, match=r"layers\[0\] has rows of 0 bytes"):
            pack_region([np.zeros((ROWS, 0), np.uint8), layers[0]], idx, pack, backend=backend)
    assert (pack == SENTINEL).all()


@settings(max_examples=12, deadline=None)
@given(item_lens=st.lists(st.sampled_from([4, 8, 12, 64, 1152]), min_size=1, max_size=3),
       rows=st.integers(1, 24), n=st.integers(0, 20), offset_words=st.integers(0, 9),
       slack=st.integers(0, 9), seed=st.integers(0, 2**16),
       backend=st.sampled_from(["host", "xla", "tpu-interpret"]))
def test_property_backends_match_reference(item_lens, rows, n, offset_words, slack, seed, backend):
    rng = np.random.default_rng(seed)
    layers = [rng.integers(0, 256, (rows, w), dtype=np.uint8) for w in item_lens]
    idx = rng.integers(0, rows, n)
    offset = 4 * offset_words  # every row here is whole uint32 words
    pack = np.full(offset + n * sum(item_lens) + slack, SENTINEL, np.uint8)
    want = reference_region(layers, idx, pack, offset=offset)
    np.testing.assert_array_equal(pack_region(layers, idx, pack, offset=offset, backend=backend),
                                  want)


def test_tpu_rows_compile_once_per_bucket():
    from pallas_kernels.backends import tpu

    layers, _, _, _, _ = _case("mla-1152")
    pack = np.full(64 + 16 * 3456, SENTINEL, np.uint8)
    pack_region(layers, np.arange(9), pack, offset=0, backend="tpu-interpret")
    before = tpu._pack_rows_jit._cache_size()
    for n, offset in ((10, 4), (16, 64), (12, 32)):  # one bucket (16 rows), new offsets and n
        idx = np.arange(n)[::-1]
        want = reference_region(layers, idx, pack, offset=offset)
        np.testing.assert_array_equal(
            pack_region(layers, idx, pack, offset=offset, backend="tpu-interpret"), want)
    assert tpu._pack_rows_jit._cache_size() == before


def test_xla_numpy_packs_compile_once_per_bucket_and_leave_the_rest_of_the_pack():
    # Before: every distinct n compiled (75, 76, ... rows: ~0.15 s each inside a request, not
    # counted by compile_count), and each call copied the whole pack buffer through JAX and
    # back (0.5 s a call for a 256 MiB pack, whatever the rows).
    from pallas_kernels import compile_count
    from pallas_kernels.backends import xla

    layers, _, _, _, _ = _case("mla-1152")
    rng = np.random.default_rng()
    assert xla.XlaBackend().warm(layers, 128) == [32, 64, 128]
    before = compile_count()
    pack = np.full(1 << 22, SENTINEL, np.uint8)
    for n, offset in ((75, 3), (76, 1000), (128, 77), (65, 0)):  # all in the 128-row bucket
        idx = rng.integers(0, layers[0].shape[0], n)
        want = reference_region(layers, idx, pack, offset=offset)  # the untouched rest too
        np.testing.assert_array_equal(pack_region(layers, idx, pack, offset=offset, backend="xla"), want)
    assert compile_count() == before


@pytest.mark.parametrize("backend", ["host", "xla", "tpu-interpret"])
def test_a_numpy_uint64_offset_near_2_64_is_refused_as_an_overflow_on_every_backend(backend):
    # Before (fresh-user trial): the raw np.uint64 reached the fit check's sum (a numpy overflow
    # warning) and, on xla / tpu-interpret, an OverflowError that named no argument.
    import warnings

    host = backend == "host"
    layers = [np.zeros((4, 8), np.uint8)] if host else [jnp.zeros((4, 8), jnp.uint8)]
    pack = np.full(64, SENTINEL, np.uint8) if host else jnp.full(64, SENTINEL, jnp.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="pack region overflow: offset=18446744073709551608"):
            pack_region(layers, [1], pack, offset=np.uint64(2**64 - 8), backend=backend)
    assert (np.asarray(pack) == SENTINEL).all()


def test_xla_views_aligned_numpy_layers_without_a_copy():
    # Before: jnp.asarray copied every layer on every call (0.2-0.3 s a call for one 512 MiB
    # layer, whatever the rows). An aligned, writeable, C-contiguous layer is now aliased; any
    # other is still copied, with the same values.
    from pallas_kernels.backends.xla import _jax_view

    raw = np.random.default_rng().integers(0, 256, 64 * 40 + 64, dtype=np.uint8)
    off = (-raw.ctypes.data) % 64
    aligned = raw[off:off + 64 * 40].reshape(40, 64)
    assert _jax_view(aligned).unsafe_buffer_pointer() == aligned.ctypes.data
    for other in (raw[off + 1:off + 1 + 64 * 39].reshape(39, 64), aligned[:, ::2]):
        view = _jax_view(other)
        assert view.unsafe_buffer_pointer() != other.ctypes.data
        np.testing.assert_array_equal(np.asarray(view), other)
    ro = aligned.copy()
    ro.setflags(write=False)
    np.testing.assert_array_equal(np.asarray(_jax_view(ro)), ro)
