"""CPU: the rules a long-running caller relies on (a KV connector packing for many requests).

- the region offset is traced: one kernel serves every offset, bit-exact (interpret mode);
- offsets are checked: negative, misaligned or past int32 word indices raise, naming `offset`;
- `compile_count()` stays put after one warm-up per row bucket;
- no module cache keeps a caller's KV arrays alive, and a recycled id is checked afresh;
- `PackSource` owns the checks and releases the layers with itself.
"""

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    MAX_PACK_WORDS,
    GatherConfig,
    PackSource,
    bucket_rows,
    compile_count,
    gather_rows,
    gather_rows_reference,
    pack_rows,
    word_dtype,
)
from pallas_kernels import pack as pack_mod

SENTINEL = 0x3C
CFG = GatherConfig(block_rows=16)


def _words(rng, shape, dtype):
    return rng.integers(0, int(np.iinfo(dtype).max) + 1, shape, dtype=np.uint64).astype(dtype)


def _layers(rng, rows, item_lens):
    return [rng.integers(0, 256, (rows, w), dtype=np.uint8) for w in item_lens]


def _expected(layers, idx, size, offset):
    out = np.full(size, SENTINEL, np.uint8)
    region = np.concatenate([a[idx].reshape(-1) for a in layers])
    out[offset:offset + region.size] = region
    return out


# --------------------------------------------------------------------------- traced offset


@pytest.mark.parametrize("form", ["stacked", "list"])
def test_traced_offset_bit_exact_at_many_offsets_one_compile(form):
    rng = np.random.default_rng(100)
    L, R, n = 3, 70, 21
    widths = (12, 12, 12) if form == "stacked" else (12, 5, 33)
    data = [_words(rng, (R, w), np.uint16) for w in widths]
    src = jnp.asarray(np.stack(data)) if form == "stacked" else [jnp.asarray(a) for a in data]
    P = n * sum(widths) + 400
    offsets = [0, 1, 3, 64, 129, 255, 400]  # 400: the region ends exactly at the pack's end
    gather_rows(src, jnp.zeros(32, jnp.int32), jnp.zeros(P, jnp.uint16), n, offset=7,
                config=CFG, backend="interpret")  # warm-up
    count, size = compile_count(), gather_rows._cache_size()
    for off in offsets:
        idx = jnp.asarray(rng.integers(0, R, 32).astype(np.int32))  # new values each time
        pack = _words(rng, P, np.uint16)
        out = gather_rows(src, idx, jnp.asarray(pack), n, offset=off, config=CFG,
                          backend="interpret")
        ref = gather_rows_reference(src, idx, jnp.asarray(pack), n, offset=off)
        assert np.asarray(out).tobytes() == np.asarray(ref).tobytes(), off
    assert compile_count() == count and gather_rows._cache_size() == size


def test_offset_traced_inside_an_outer_jit():
    # The offset may be a tracer: the caller's own jitted step computes it.
    rng = np.random.default_rng(101)
    L, R, W, n = 2, 40, 8, 13
    src = jnp.asarray(_words(rng, (L, R, W), np.uint32))
    P = L * n * W + 50
    step = jax.jit(functools.partial(gather_rows, config=CFG, backend="interpret"),
                   donate_argnums=2)
    for off in (0, 9, 50):
        idx = jnp.asarray(rng.integers(0, R, 16).astype(np.int32))
        pack = _words(rng, P, np.uint32)
        out = step(src, idx, jnp.asarray(pack), jnp.int32(n), offset=jnp.int32(off))
        ref = gather_rows_reference(src, idx, jnp.asarray(pack), n, offset=off)
        assert np.asarray(out).tobytes() == np.asarray(ref).tobytes()
    assert step._cache_size() == 1


def test_traced_offset_past_the_pack_clamps_and_negative_writes_nothing():
    rng = np.random.default_rng(102)
    L, R, W = 2, 10, 4
    src = jnp.asarray(_words(rng, (L, R, W), np.uint32))
    idx = jnp.asarray(np.arange(16, dtype=np.int32))
    P = 100
    step = jax.jit(lambda p, off: gather_rows(src, idx, p, 16, offset=off, config=CFG,
                                              backend="interpret"))
    pack = _words(rng, P, np.uint32)
    # Room for (100 - 60) // 8 = 5 rows at word 60: rows past them are dropped, not overrun.
    out = np.asarray(step(jnp.asarray(pack), jnp.int32(60)))
    ref = np.asarray(gather_rows_reference(src, idx, jnp.asarray(pack), 5, offset=60))
    assert out.tobytes() == ref.tobytes()
    for off in (-1, -(2**31), P, P + 7):  # nothing fits, or a negative offset: no write
        assert np.asarray(step(jnp.asarray(pack), jnp.int32(off))).tobytes() == pack.tobytes()


def test_traced_offset_off_its_promised_alignment_writes_nothing():
    rng = np.random.default_rng(113)
    src = jnp.asarray(_words(rng, (2, 20, 8), np.uint32))
    idx = jnp.asarray(rng.integers(0, 20, 16).astype(np.int32))
    step = jax.jit(lambda p, off: gather_rows(src, idx, p, 10, offset=off, config=CFG,
                                              backend="interpret", offset_align=4))
    pack = _words(rng, 400, np.uint32)
    for off in (8, 36):  # multiples of 4 words: written
        ref = gather_rows_reference(src, idx, jnp.asarray(pack), 10, offset=off)
        assert np.asarray(step(jnp.asarray(pack), jnp.int32(off))).tobytes() == \
            np.asarray(ref).tobytes()
    for off in (2, 37):  # broken promise: nothing, rather than a shifted region
        assert np.asarray(step(jnp.asarray(pack), jnp.int32(off))).tobytes() == pack.tobytes()


@pytest.mark.parametrize("offset, match", [
    (-1, "offset=-1 must be a non-negative int"),
    (MAX_PACK_WORDS + 1, "offset=4294967296 words must be <= 4294967295"),
    (2**40, "offset=1099511627776 words must be <= 4294967295"),
    (True, "offset=True must be a non-negative int"),
    (1.0, "offset=1.0 must be a non-negative int"),
    (6, "offset=6 words must be a multiple of offset_align=4"),
])
def test_gather_rows_offset_errors_name_offset(offset, match):
    src, idx = jnp.zeros((2, 8, 4), jnp.uint32), jnp.zeros(8, jnp.int32)
    pack = jnp.zeros(64, jnp.uint32)
    with pytest.raises(ValueError, match=match):
        gather_rows(src, idx, pack, offset=offset, backend="interpret", offset_align=4)


def test_gather_rows_offset_and_align_type_errors():
    src, idx = jnp.zeros((2, 8, 4), jnp.uint32), jnp.zeros(8, jnp.int32)
    pack = jnp.zeros(64, jnp.uint32)
    with pytest.raises(TypeError, match="offset dtype float32"):
        gather_rows(src, idx, pack, offset=jnp.float32(1), backend="interpret")
    with pytest.raises(ValueError, match="offset must be a scalar"):
        gather_rows(src, idx, pack, offset=jnp.zeros(2, jnp.int32), backend="interpret")
    for bad in (0, 3, 32, True):
        with pytest.raises(ValueError, match="offset_align"):
            gather_rows(src, idx, pack, backend="interpret", offset_align=bad)


# --------------------------------------------------------------------------- pack_rows offsets


@pytest.mark.parametrize("item_lens, offset, word", [
    ((1152, 576), 1026, "uint32"),  # 2 mod 4
    ((1152,), 3, "uint32"),
    ((6, 2), 1, "uint16"),
])
def test_pack_rows_misaligned_offset_names_offset_and_writes_nothing(item_lens, offset, word):
    rng = np.random.default_rng(103)
    layers = _layers(rng, 20, item_lens)
    pack = np.full(offset + 5 * sum(item_lens) + 64, SENTINEL, np.uint8)
    with pytest.raises(ValueError, match=f"offset={offset} must be a multiple of .*\\({word}\\)"):
        pack_rows(layers, [1, 2, 3, 4, 5], pack, offset=offset, backend="interpret")
    assert np.all(pack == SENTINEL)
    # The host path takes any byte offset.
    pack_rows(layers, [1, 2, 3, 4, 5], pack, offset=offset, backend="numpy")
    np.testing.assert_array_equal(pack, _expected(layers, [1, 2, 3, 4, 5], pack.size, offset))


def test_pack_rows_region_past_int32_words_names_offset():
    # uint8 words: a 2 GiB pack (untouched virtual memory) reaches word 2**31 - 1.
    layers = [np.zeros((4, 3), np.uint8)]
    pack = np.empty(2**31 + 64, np.uint8)
    with pytest.raises(ValueError, match="offset=2147483640 \\+ 9 B ends past word 2147483647"):
        pack_rows(layers, [0, 1, 2], pack, offset=2**31 - 8, backend="interpret")
    del pack


def test_pack_rows_pallas_bit_exact_at_aligned_offsets_and_odd_pack_sizes():
    # Word-aligned offsets at every residue of 16 bytes, packs whose size is not a whole
    # number of words: the kernel sees one pack shape, the region lands exactly.
    rng = np.random.default_rng(104)
    item_lens = (1152, 576, 64)  # uint32 words
    size = 8 * sum(item_lens) + 203
    for offset in (0, 4, 8, 12, 64, 132, 200):
        layers = _layers(rng, 30, item_lens)
        idx = rng.integers(0, 30, 8)
        pack = np.full(size, SENTINEL, np.uint8)
        pack_rows(layers, idx, pack, offset=offset, backend="interpret", config=CFG)
        assert pack.tobytes() == _expected(layers, idx, size, offset).tobytes(), offset


# --------------------------------------------------------------------------- compile counter


def test_compile_count_unchanged_across_offsets_and_indices_after_warm_up():
    rng = np.random.default_rng(105)
    R, item_lens = 300, (1152, 576, 1152)
    layers = _layers(rng, R, item_lens)
    region = 64 * sum(item_lens)
    pack = np.full(40 * region, SENTINEL, np.uint8)
    buckets = {bucket_rows(n, CFG.block_rows) for n in (5, 20, 40)}  # 16, 32, 64 rows
    assert len(buckets) == 3
    for n in (5, 20, 40):  # one warm-up per row bucket
        pack_rows(layers, np.arange(n), pack, offset=0, backend="interpret", config=CFG)
    count = compile_count()
    expect = pack.copy()
    for call in range(30):
        n = int(rng.integers(1, 65))
        idx = rng.integers(0, R, n)
        offset = int(rng.integers(0, 39)) * region + 64 * int(rng.integers(0, 100))
        wrote = pack_rows(layers, idx, pack, offset=offset, backend="interpret", config=CFG)
        region_bytes = np.concatenate([a[idx].reshape(-1) for a in layers])
        expect[offset:offset + wrote] = region_bytes
        assert pack.tobytes() == expect.tobytes(), (call, n, offset)
    assert compile_count() == count


def test_compile_count_counts_traces_and_word_aligned_offsets_add_one_kernel_per_bucket():
    rng = np.random.default_rng(106)
    layers = _layers(rng, 50, (96, 32))  # uint32 words; not in any other test's geometry
    pack = np.full(20 * 128 * 10, SENTINEL, np.uint8)
    before = compile_count()
    pack_rows(layers, np.arange(10), pack, offset=0, backend="interpret", config=CFG)
    assert compile_count() == before + 1  # a new kernel was traced
    for offset in (16, 48, 640, 1600):  # 16-byte multiples: the hinted kernel
        pack_rows(layers, np.arange(10), pack, offset=offset, backend="interpret", config=CFG)
    assert compile_count() == before + 1
    for offset in (4, 36, 1604, 8):  # word- but not 16-byte-aligned: one unhinted kernel
        pack_rows(layers, rng.integers(0, 50, 10), pack, offset=offset, backend="interpret",
                  config=CFG)
    assert compile_count() == before + 2


def test_numpy_host_path_compiles_nothing():
    rng = np.random.default_rng(107)
    layers = _layers(rng, 40, (24, 8))
    pack = np.zeros(4096, np.uint8)
    before = compile_count()
    for offset in (0, 1, 333, 1000):
        pack_rows(layers, rng.integers(0, 40, 9), pack, offset=offset)
    assert compile_count() == before


# --------------------------------------------------------------------------- weak caches


def _cache_keys_holding(arr):
    return [k for k in pack_mod._CHECKED_LAYERS if id(arr) in k[1]]


@pytest.mark.parametrize("backend", ["numpy", "interpret"])
def test_dropped_layers_are_freed_and_evicted(backend):
    rng = np.random.default_rng(108)
    layers = _layers(rng, 64, (256, 128))
    refs = [weakref.ref(a) for a in layers]
    idx = rng.integers(0, 64, 16)
    pack = np.full(16 * 384, SENTINEL, np.uint8)
    for _ in range(3):  # cached after the first call
        pack_rows(layers, idx, pack, backend=backend, config=CFG)
    assert pack.tobytes() == _expected(layers, idx, pack.size, 0).tobytes()
    assert _cache_keys_holding(layers[0])
    key_ids = tuple(map(id, layers))
    del layers
    gc.collect()
    assert all(r() is None for r in refs), "a module cache kept the caller's KV arrays alive"
    assert not [k for k in pack_mod._CHECKED_LAYERS if k[1] == key_ids]  # evicted at death
    assert not [k for k in pack_mod._IMPORTED_LAYERS if k[1] == key_ids]


def test_recycled_ids_are_checked_afresh(monkeypatch):
    # Deterministic: every array gets the same id, as if CPython had recycled a dead one's.
    monkeypatch.setattr(pack_mod, "id", lambda obj: 12345, raising=False)
    rng = np.random.default_rng(109)
    wide = _layers(rng, 8, (16,))
    pack_rows(wide, [0, 1], np.zeros(64, np.uint8))
    assert (False, (12345,)) in pack_mod._CHECKED_LAYERS
    del wide
    gc.collect()
    assert (False, (12345,)) not in pack_mod._CHECKED_LAYERS  # evicted when it died
    narrow = _layers(rng, 8, (4,))  # same "id", another width: 4-byte rows, not 16
    pack = np.full(12, SENTINEL, np.uint8)
    assert pack_rows(narrow, [3, 5], pack) == 8
    assert pack.tobytes() == (np.concatenate([narrow[0][3], narrow[0][5]]).tobytes()
                              + bytes([SENTINEL] * 4))
    with pytest.raises(ValueError, match="indices must be < num_rows=8"):
        pack_rows(narrow, [8], pack)


def test_a_really_recycled_id_is_checked_afresh():
    # The same with CPython's own id reuse: keep allocating until a new array lands in the
    # dead one's slot (at once, usually).
    rng = np.random.default_rng(114)
    old = np.zeros((8, 16), np.uint8)
    pack_rows([old], [0, 1], np.zeros(64, np.uint8))
    old_id = id(old)
    del old
    kept, new = [], None
    for _ in range(5000):
        cand = np.empty((8, 4), np.uint8)
        if id(cand) == old_id:
            new = cand
            break
        kept.append(cand)
    del kept
    if new is None:
        pytest.skip("no new array got the dead one's id here")
    new[...] = rng.integers(0, 256, new.shape, dtype=np.uint8)
    pack = np.full(8, SENTINEL, np.uint8)
    assert pack_rows([new], [3, 5], pack) == 8
    assert pack.tobytes() == np.concatenate([new[3], new[5]]).tobytes()


def test_stale_entry_under_a_reused_key_is_not_trusted():
    # Even an entry that somehow survived under these ids (here planted by hand) is used only
    # if its weak references give back these very arrays: otherwise the layers are re-checked.
    rng = np.random.default_rng(110)
    wide = _layers(rng, 10, (32,))
    pack_rows(wide, [0], np.zeros(32, np.uint8))
    stale = pack_mod._CHECKED_LAYERS[(False, tuple(map(id, wide)))]
    narrow = _layers(rng, 10, (4,))
    pack_mod._CHECKED_LAYERS[(False, tuple(map(id, narrow)))] = stale
    pack = np.full(12, SENTINEL, np.uint8)
    assert pack_rows(narrow, [2, 7], pack) == 8  # 2 rows x 4 B, not 2 x 32
    assert pack.tobytes() == (np.concatenate([narrow[0][2], narrow[0][7]]).tobytes()
                              + bytes([SENTINEL] * 4))
    with pytest.raises(ValueError, match="layers\\[0\\] must be 2-D"):
        bad = [np.zeros(10, np.uint8)]
        pack_mod._CHECKED_LAYERS[(False, tuple(map(id, bad)))] = stale
        pack_rows(bad, [0], np.zeros(64, np.uint8))


def test_a_layer_list_changed_in_place_is_checked_afresh():
    # The last list's entry is reused without rebuilding its key (`_LAST_CHECKED`): only while
    # every item is still the very array it was checked with.
    rng = np.random.default_rng(115)
    layers = _layers(rng, 10, (32,))
    pack = np.full(64, SENTINEL, np.uint8)
    assert pack_rows(layers, [0, 9], pack) == 64
    assert pack.tobytes() == np.concatenate([layers[0][0], layers[0][9]]).tobytes()
    layers[0] = _layers(rng, 6, (4,))[0]  # same list object, another array: 6 rows of 4 B
    pack = np.full(12, SENTINEL, np.uint8)
    assert pack_rows(layers, [2, 5], pack) == 8
    assert pack.tobytes() == np.concatenate([layers[0][2], layers[0][5]]).tobytes() + bytes([SENTINEL] * 4)
    with pytest.raises(ValueError, match="indices must be < num_rows=6"):
        pack_rows(layers, [9], pack)


def test_layers_that_cannot_be_weakly_referenced_are_checked_every_call(monkeypatch):
    def no_weakref(obj, callback=None):
        raise TypeError(f"cannot create weak reference to {type(obj).__name__!r} object")

    monkeypatch.setattr(pack_mod.weakref, "ref", no_weakref)
    rng = np.random.default_rng(111)
    layers = _layers(rng, 12, (8, 4))
    before = dict(pack_mod._CHECKED_LAYERS)
    for _ in range(2):
        pack = np.full(3 * 12, SENTINEL, np.uint8)
        pack_rows(layers, [1, 2, 11], pack)
        assert pack.tobytes() == _expected(layers, [1, 2, 11], pack.size, 0).tobytes()
    assert pack_mod._CHECKED_LAYERS == before  # nothing cached


# --------------------------------------------------------------------------- PackSource


@pytest.mark.parametrize("backend", ["numpy", "interpret"])
def test_pack_source_packs_like_the_list_and_releases_the_layers(backend):
    rng = np.random.default_rng(112)
    layers = _layers(rng, 40, (64, 16, 64))
    source = PackSource(layers)
    assert source.item_lens == (64, 16, 64) and source.num_rows == 40
    assert source.word == np.uint32 and not source.on_device
    refs = [weakref.ref(a) for a in layers]
    cached = len(pack_mod._CHECKED_LAYERS)
    for offset in (0, 16, 1024):
        idx = rng.integers(0, 40, 11)
        a = np.full(11 * 144 + 1024, SENTINEL, np.uint8)
        b = a.copy()
        pack_rows(source, idx, a, offset=offset, backend=backend, config=CFG)
        pack_rows(list(source.layers), idx, b, offset=offset, backend="numpy")
        assert a.tobytes() == b.tobytes()
    assert len(pack_mod._CHECKED_LAYERS) <= cached + 1  # the list call only
    del layers, source
    gc.collect()
    assert all(r() is None for r in refs)


def test_pack_source_errors():
    with pytest.raises(ValueError, match="layers must be a non-empty"):
        PackSource([])
    with pytest.raises(ValueError, match="layers\\[1\\] must be 2-D"):
        PackSource([np.zeros((4, 4), np.uint8), np.zeros(4, np.uint8)])
    with pytest.raises(TypeError, match="layers\\[0\\] dtype float32"):
        PackSource([np.zeros((4, 4), np.float32)])

    class FakeCupy:  # only its module name matters to the kind check
        __module__ = "cupy._core.core"
        ndim, dtype, shape = 2, np.dtype(np.uint8), (4, 4)

    with pytest.raises(TypeError, match="layers\\[1\\] and layers\\[0\\] must both be numpy"):
        PackSource([np.zeros((4, 4), np.uint8), FakeCupy()])
    source = PackSource([np.zeros((4, 4), np.uint8)])
    with pytest.raises(ValueError, match="indices must be < num_rows=4"):
        pack_rows(source, [4], np.zeros(64, np.uint8))
    with pytest.raises(ValueError, match="offset=2 must be a multiple of 4 bytes"):
        pack_rows(source, [0], np.zeros(64, np.uint8), offset=2, backend="interpret")
    assert "1 numpy layers" in repr(source) and word_dtype(source.item_lens) == np.uint32


def test_gather_module_still_exports_the_host_contract():
    from pallas_kernels import gather
    from pallas_kernels.gather import PackSource as P2
    from pallas_kernels.gather import clear_import_cache, pack_rows as p2

    assert p2 is pack_rows and P2 is PackSource and gather._host_pool is pack_mod._host_pool
    clear_import_cache()
    assert not pack_mod._CHECKED_LAYERS and not pack_mod._IMPORTED_LAYERS
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        gather.nope  # noqa: B018
