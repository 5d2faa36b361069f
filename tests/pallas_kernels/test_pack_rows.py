"""CPU: `pallas_kernels.pack_rows` on host buffers, byte-exact, touching no other byte."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.buffers import HostBuffer
from pallas_kernels import GatherConfig, pack_rows, pack_windows, word_dtype

SENTINEL = 0xA5


def _brute_force(layers, idx, size, offset):
    """Byte-by-byte reference of the layer-major pack (spec section 6)."""
    out = np.full(size, SENTINEL, np.uint8)
    pos = offset
    for a in layers:
        for r in idx:
            for b in a[r]:
                out[pos] = b
                pos += 1
    return out


def _layers(rng, rows, item_lens):
    return [rng.integers(0, 256, (rows, w), dtype=np.uint8) for w in item_lens]


@pytest.mark.parametrize("item_lens", [(1152, 1152), (576,), (656, 1152, 576), (3, 2, 5)],
                         ids=lambda x: "-".join(map(str, x)))
@pytest.mark.parametrize("backend", ["numpy", "interpret"])
def test_bit_exact_and_no_other_byte(item_lens, backend):
    rng = np.random.default_rng(sum(item_lens))
    layers = _layers(rng, 60, item_lens)
    idx = rng.integers(0, 60, 23)
    offset = 1000 + (sum(item_lens) % 7)
    if backend != "numpy":  # the Pallas paths take word-aligned offsets only
        offset -= offset % word_dtype(item_lens).itemsize
    buf = HostBuffer(offset + 23 * sum(item_lens) + 500, fill=SENTINEL)
    wrote = pack_rows(layers, idx, buf.array, offset=offset, backend=backend,
                      config=GatherConfig(block_rows=16))
    assert wrote == 23 * sum(item_lens)
    np.testing.assert_array_equal(buf.array, _brute_force(layers, idx, buf.nbytes, offset))


@settings(max_examples=25, deadline=None)
@given(item_lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       rows=st.integers(1, 30), n=st.integers(0, 25), offset=st.integers(0, 50),
       slack=st.integers(0, 20), seed=st.integers(0, 2**16),
       threads=st.sampled_from([None, 1, 2, 3, 7]))
def test_property_matches_brute_force(item_lens, rows, n, offset, slack, seed, threads):
    rng = np.random.default_rng(seed)
    layers = _layers(rng, rows, item_lens)
    idx = rng.integers(0, rows, n)
    size = offset + n * sum(item_lens) + slack
    pack = np.full(max(size, 1), SENTINEL, np.uint8)
    assert pack_rows(layers, idx, pack, offset=offset, threads=threads) == n * sum(item_lens)
    np.testing.assert_array_equal(pack, _brute_force(layers, idx, pack.size, offset))


def test_exact_fit_and_region_per_rank():
    rng = np.random.default_rng(1)
    layers = _layers(rng, 100, (1152, 576))
    ranks, per_rank = 4, 10
    region = per_rank * (1152 + 576)
    pack = np.full(ranks * region, SENTINEL, np.uint8)
    for r in range(ranks):
        idx = np.arange(r, 100, 8)[:per_rank]
        pack_rows(layers, idx, pack, offset=r * region)
        exp = np.concatenate([layers[0][idx].ravel(), layers[1][idx].ravel()])
        np.testing.assert_array_equal(pack[r * region:(r + 1) * region], exp)


@pytest.mark.parametrize("threads", [None, 1, 2, 5])
def test_threaded_host_gather_equals_fancy_indexing(threads):
    # Over HOST_THREADS_MIN_BYTES, so threads=None splits too; 3 layer entries of different
    # widths, rows not a multiple of any worker count, poisoned bytes on both sides.
    rng = np.random.default_rng(11)
    layers = _layers(rng, 3000, (1152, 576, 656))
    idx = rng.integers(0, 3000, 4099)
    offset, total = 77, 4099 * (1152 + 576 + 656)
    pack = np.full(offset + total + 64, SENTINEL, np.uint8)
    assert pack_rows(layers, idx, pack, offset=offset, threads=threads) == total
    exp = np.concatenate([a[idx].ravel() for a in layers])
    np.testing.assert_array_equal(pack[offset:offset + total], exp)
    assert np.all(pack[:offset] == SENTINEL) and np.all(pack[offset + total:] == SENTINEL)


def test_worker_pool_is_made_again_in_a_forked_child(monkeypatch):
    # A forked child inherits the parent's pool object but none of its threads: the pool is
    # tagged with its pid, so the child (another pid) makes its own instead of waiting on dead
    # threads.
    from pallas_kernels import gather

    layers = _layers(np.random.default_rng(6), 50, (16, 8))
    idx = np.arange(40)
    pack_rows(layers, idx, np.zeros(960, np.uint8), threads=2)
    parent_pool = gather._host_pool(2)
    monkeypatch.setattr(gather.os, "getpid", lambda: -12345)  # as seen from a child
    child_pool = gather._host_pool(2)
    assert child_pool is not parent_pool and gather._HOST_POOL["pid"] == -12345
    pack = np.zeros(960, np.uint8)
    pack_rows(layers, idx, pack, threads=2)
    np.testing.assert_array_equal(pack, np.concatenate([a[idx].ravel() for a in layers]))


def test_one_bounded_pool_whatever_threads_are_asked_for():
    # Many different counts used to leave a pool each (hundreds of idle threads).
    import threading

    from pallas_kernels import gather

    rng = np.random.default_rng(12)
    layers = _layers(rng, 200, (32, 16))
    idx = rng.integers(0, 200, 150)
    exp = np.concatenate([a[idx].ravel() for a in layers])
    for threads in (2, 3, 5, 9, 17, 33, 64, 4):
        pack = np.zeros(150 * 48, np.uint8)
        pack_rows(layers, idx, pack, threads=threads)
        np.testing.assert_array_equal(pack, exp)
    assert gather._HOST_POOL["workers"] <= gather.HOST_MAX_THREADS_ARG
    time.sleep(0.2)  # replaced pools' threads exit once idle
    alive = [t for t in threading.enumerate() if t.name.startswith("pack_rows")]
    assert len(alive) <= gather.HOST_MAX_THREADS_ARG + 4  # the live pool, plus stragglers


def test_empty_indices_write_nothing():
    layers = _layers(np.random.default_rng(2), 10, (8,))
    pack = np.full(64, SENTINEL, np.uint8)
    assert pack_rows(layers, [], pack, offset=64) == 0
    assert np.all(pack == SENTINEL)


def test_non_contiguous_layer_views():
    rng = np.random.default_rng(3)
    base = rng.integers(0, 256, (40, 64), dtype=np.uint8)
    layers = [base[::2, :32], base[1::2, 32:]]  # strided views, as a sub-buffer would be
    idx = np.array([0, 19, 5, 5])
    pack = np.full(4 * 64 + 8, SENTINEL, np.uint8)
    pack_rows(layers, idx, pack, offset=4)
    np.testing.assert_array_equal(pack, _brute_force(layers, idx, pack.size, 4))


@pytest.mark.parametrize("layers, indices, pack, kwargs, exc, match", [
    ("ok", [0, -1], 200, {}, ValueError, "indices must be >= 0"),
    ("ok", [0, 10], 200, {}, ValueError, "indices must be < num_rows=10"),
    ("ok", [0, 1], 200, {"offset": 190}, ValueError, "pack region overflow"),
    ("ok", [0, 1], 200, {"offset": -1}, ValueError, "offset"),
    ("ok", [[0, 1]], 200, {}, ValueError, "indices must be 1-D"),
    ("ok", [0.5], 200, {}, TypeError, "indices dtype"),
    ("ok", [0], "2d", {}, ValueError, "pack must be a 1-D uint8"),
    ("ok", [0], "u16", {}, ValueError, "pack must be a 1-D uint8"),
    ([], [0], 200, {}, ValueError, "layers must be a non-empty"),
    ("1d", [0], 200, {}, ValueError, "layers\\[0\\] must be 2-D"),
    ("f32", [0], 200, {}, TypeError, "layers\\[0\\] dtype"),
    ("ok", [0], 200, {"backend": "cuda"}, ValueError, "backend.*'numpy'"),
    ("ok", [0], 200, {"offset": True}, ValueError, "offset"),
    ("ok", [0], "readonly", {}, ValueError, "pack must be writeable"),
    ("ok", [0], 200, {"threads": 0}, ValueError, "threads"),
    ("ok", [0], 200, {"threads": True}, ValueError, "threads"),
    ("ok", [0], 200, {"threads": 1.5}, ValueError, "threads"),
    ("ok", [0], 200, {"threads": 65}, ValueError, "threads"),
])
def test_bad_inputs(layers, indices, pack, kwargs, exc, match):
    ok = [np.zeros((10, 8), np.uint8), np.zeros((12, 4), np.uint8)]
    layers = {"ok": ok, "1d": [np.zeros(10, np.uint8)],
              "f32": [np.zeros((10, 8), np.float32)]}.get(layers, layers) \
        if isinstance(layers, str) else layers
    readonly = np.full(200, SENTINEL, np.uint8)
    readonly.flags.writeable = False
    pack = {"2d": np.zeros((10, 20), np.uint8), "u16": np.zeros(200, np.uint16),
            "readonly": readonly}.get(pack) \
        if isinstance(pack, str) else np.full(pack, SENTINEL, np.uint8)
    before = pack.copy()
    with pytest.raises(exc, match=match):
        pack_rows(layers, indices, pack, **kwargs)
    np.testing.assert_array_equal(pack, before)  # nothing written on error


def test_pack_and_config_of_the_wrong_kind_are_type_errors():
    import jax.numpy as jnp

    layers = _layers(np.random.default_rng(8), 10, (8,))
    for pack in ([0] * 80, jnp.zeros(80, jnp.uint8), bytearray(80)):
        with pytest.raises(TypeError, match="pack must be a numpy or CuPy"):
            pack_rows(layers, [1, 2], pack)
    with pytest.raises(TypeError, match="config must be a GatherConfig"):
        pack_rows(layers, [1, 2], np.zeros(80, np.uint8), config="fast")
    with pytest.raises(TypeError, match="layers\\[0\\] must be a numpy or CuPy"):
        pack_rows([[[1, 2], [3, 4]]], [1], np.zeros(80, np.uint8))


def test_layers_strided_in_the_last_axis_work_in_interpret_mode():
    # Every other byte of a wider buffer: the word view needs a contiguous copy first.
    rng = np.random.default_rng(9)
    base = rng.integers(0, 256, (30, 64), dtype=np.uint8)
    layers = [base[:, ::2], base[:, 1::2]]
    idx = rng.integers(0, 30, 11)
    for backend in ("numpy", "interpret"):
        pack = np.full(11 * 64 + 16, SENTINEL, np.uint8)
        pack_rows(layers, idx, pack, offset=8, backend=backend, config=GatherConfig(block_rows=16))
        np.testing.assert_array_equal(pack, _brute_force(layers, idx, pack.size, 8))


def test_numpy_pack_with_cupy_layers_is_refused():
    class FakeCupy:  # only its module name matters to the kind check
        __module__ = "cupy._core.core"
        ndim, dtype, shape = 2, np.dtype(np.uint8), (4, 4)

    with pytest.raises(TypeError, match="both be numpy or both CuPy"):
        pack_rows([FakeCupy()], [0], np.zeros(64, np.uint8))


def test_threaded_packs_and_unpacks_run_inline_once_python_stopped_its_executors(monkeypatch):
    # At interpreter exit Python stops its executors before atexit hooks run; a connector closed
    # there may still pack or unpack: the worker split then runs on the calling thread.
    import concurrent.futures.thread as cf_thread

    from pallas_kernels import unpack_rows

    rng = np.random.default_rng(116)
    layers = [rng.integers(0, 256, (64, w), dtype=np.uint8) for w in (48, 16)]
    idx = rng.permutation(64)[:40]
    monkeypatch.setattr(cf_thread, "_shutdown", True)
    pack = np.zeros(40 * 64, np.uint8)
    assert pack_rows(layers, idx, pack, threads=4) == 40 * 64
    assert pack.tobytes() == b"".join(a[idx].tobytes() for a in layers)
    back = [np.zeros_like(a) for a in layers]
    unpack_rows(pack, back, idx, threads=4)
    assert all((b[idx] == a[idx]).all() for a, b in zip(layers, back))


@pytest.mark.parametrize("sync", [0, 1, "no", None])
def test_sync_must_be_a_bool_and_nothing_is_written(sync):
    # Before (fresh-user trial): sync=0 was taken (copy_fanout refuses a non-bool `checked`).
    layers = [np.arange(40, dtype=np.uint8).reshape(5, 8)]
    pack = np.full(32, 0xA5, np.uint8)
    with pytest.raises(TypeError, match="sync must be a bool"):
        pack_rows(layers, [1, 2], pack, sync=sync)
    with pytest.raises(TypeError, match="sync must be a bool"):  # pack_windows took any value
        pack_windows(layers, [([1, 2], 0)], pack, sync=sync)
    assert (pack == 0xA5).all()
    assert pack_rows(layers, [1, 2], pack, sync=np.bool_(False)) == 16 and (pack[:16] == layers[0][1:3].ravel()).all()
