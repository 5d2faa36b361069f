"""CPU: `RowUnpacker` (unpack_rows prepared once) against a brute-force per-row reference and
against `unpack_rows`; its refusals (each naming the argument)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import GatherConfig, RowUnpacker, pack_rows, unpack_rows


def _layers(rng, rows, item_lens):
    return [rng.integers(0, 256, (rows, w), dtype=np.uint8) for w in item_lens]


def _brute(pack, offset, idx, layers):
    """Entry l's n rows start at offset + n * sum(w_k, k < l) (layer-major), row j of them goes
    to row idx[j] of layer l."""
    out = [a.copy() for a in layers]
    pos, n = offset, len(idx)
    for a in out:
        w = a.shape[1]
        for j, r in enumerate(idx):
            a[r] = pack[pos + j * w:pos + (j + 1) * w]
        pos += n * w
    return out


@settings(max_examples=25, deadline=None)
@given(item_lens=st.lists(st.integers(1, 40), min_size=1, max_size=4), rows=st.integers(1, 30),
       data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_unpacker_host_matches_brute_force_over_many_calls(item_lens, rows, data, seed):
    rng = np.random.default_rng(seed)
    layers = _layers(rng, rows, item_lens)
    pack = rng.integers(0, 256, rows * sum(item_lens) * 2 + 7, dtype=np.uint8)
    unpacker = RowUnpacker(pack, layers)
    want = [a.copy() for a in layers]
    for _ in range(3):  # one unpacker, fresh windows at fresh offsets
        n = data.draw(st.integers(0, rows))
        idx = rng.permutation(rows)[:n]
        offset = data.draw(st.integers(0, pack.size - n * sum(item_lens)))
        want = _brute(pack, offset, idx, want)
        assert unpacker.unpack(idx, offset=offset) == n
    for a, b in zip(layers, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("one_buffer", [False, True], ids=["layer list", "one buffer"])
def test_unpacker_interpret_equals_unpack_rows_and_inverts_pack_rows(one_buffer):
    """The Pallas kernel body on the CPU: a region `pack_rows` wrote at a word offset comes back
    into fresh rows; `unpack_rows` writes the same bytes."""
    rng = np.random.default_rng()
    L, R, W, n = 3, 29, 12, 11
    src = _layers(rng, R, [W] * L)
    if one_buffer:  # a layer-major cache: the flat destination form
        buf = np.zeros(L * R * W, np.uint8)
        dst = [buf[l * R * W:(l + 1) * R * W].reshape(R, W) for l in range(L)]
    else:
        dst = [np.zeros((R, W), np.uint8) for _ in range(L)]
    again = [np.zeros((R, W), np.uint8) for _ in range(L)]
    sidx, didx = rng.permutation(R)[:n], rng.permutation(R)[:n]
    offset = 4 * 5  # a word multiple
    region = np.zeros(offset + n * L * W + 8, np.uint8)
    pack_rows(src, sidx, region, offset=offset)
    cfg = GatherConfig(block_rows=8)
    assert RowUnpacker(region, dst, backend="interpret", config=cfg).unpack(didx, offset=offset) == n
    assert unpack_rows(region, again, didx, offset=offset) == n  # rows, as the unpacker says
    for l in range(L):
        np.testing.assert_array_equal(dst[l][didx], src[l][sidx])
        np.testing.assert_array_equal(dst[l], again[l])
        untouched = np.setdiff1d(np.arange(R), didx)
        assert not dst[l][untouched].any()


def test_unpacker_hand_case():
    # One layer of 2-byte rows, three rows; the region's two rows (offset 1) go to rows 2, 0.
    layer = np.zeros((3, 2), np.uint8)
    pack = np.array([9, 1, 2, 3, 4], np.uint8)
    RowUnpacker(pack, [layer]).unpack([2, 0], offset=1)
    np.testing.assert_array_equal(layer, [[3, 4], [0, 0], [1, 2]])


def test_unpacker_refusals_name_the_argument():
    rng = np.random.default_rng()
    layers = _layers(rng, 4, [8, 8])
    pack = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="layers must be a non-empty list"):
        RowUnpacker(pack, [])
    with pytest.raises(TypeError, match="pack must be a numpy"):
        RowUnpacker(list(pack), layers)
    with pytest.raises(ValueError, match="pack must be a 1-D"):
        RowUnpacker(pack.reshape(8, 8), layers)
    with pytest.raises(ValueError, match="pack"):  # the region is a view of a layer's bytes
        RowUnpacker(layers[0].reshape(-1), layers)
    shared = np.zeros((8, 8), np.uint8)
    with pytest.raises(ValueError, match="layers"):
        RowUnpacker(pack, [shared[:4], shared[2:6]])
    ro = layers[0].copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        RowUnpacker(pack, [ro])
    with pytest.raises(TypeError, match="config"):
        RowUnpacker(pack, layers, config={"block_rows": 8})
    u = RowUnpacker(pack, layers)
    with pytest.raises(ValueError, match="offset"):
        u.unpack([0], offset=-1)
    with pytest.raises(ValueError, match="overflow"):
        u.unpack([0, 1, 2, 3], offset=8)  # 4 rows x 16 B = 64 B from byte 8 pass the 64-byte pack
    with pytest.raises(ValueError, match="indices"):
        u.unpack([1, 1])
    with pytest.raises(ValueError, match="indices"):
        u.unpack([4])
    with pytest.raises(TypeError, match="checked"):
        u.unpack([0], checked="yes")
    before = [a.copy() for a in layers]
    u.close()
    with pytest.raises(RuntimeError, match="closed"):
        u.unpack([0])
    for a, b in zip(layers, before):  # nothing written by any refused call
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="multiple of 4"):
        RowUnpacker(pack, layers, backend="interpret").unpack([0], offset=2)


@pytest.mark.parametrize("backend", ["numpy", "interpret"])
def test_rows_of_zero_bytes_are_refused_by_every_entry_point(backend):
    # Before: unpack_rows on numpy took them (and wrote nothing); interpret named `item_lens`.
    from pallas_kernels import copy_rows

    pack, empty = np.zeros(64, np.uint8), np.zeros((10, 0), np.uint8)
    full = np.zeros((10, 8), np.uint8)
    with pytest.raises(ValueError, match=r"layers\[1\] has rows of 0 bytes"):
        unpack_rows(pack, [full, empty], [0], backend=backend)
    with pytest.raises(ValueError, match=r"layers\[0\] has rows of 0 bytes"):
        RowUnpacker(pack, [empty], backend=backend)
    with pytest.raises(ValueError, match=r"dst_layers\[0\] has rows of 0 bytes"):
        copy_rows([full], [0], [empty], [0], backend=backend)


@pytest.mark.parametrize("indices", [None, "1", 3, (i for i in range(2))], ids=["None", "str", "int", "generator"])
def test_indices_that_are_no_sequence_raise_type_error(indices):
    layers = [np.zeros((4, 8), np.uint8)]
    with pytest.raises(TypeError, match="indices must be a sequence or 1-D array of ints"):
        RowUnpacker(np.zeros(64, np.uint8), layers).unpack(indices)
    with pytest.raises(TypeError, match="indices must be a sequence or 1-D array of ints"):
        unpack_rows(np.zeros(64, np.uint8), layers, indices)


def test_close_while_another_thread_unpacks_gives_the_closed_error_or_a_whole_unpack():
    """`close()` waits for an `unpack` in progress on another thread: that one completes (its
    rows all written), every later call raises RuntimeError "closed" (a fresh-user trial got
    TypeError 'NoneType' object is not iterable in ~30 % of such races)."""
    import threading

    rng = np.random.default_rng()
    item_lens, rows = (24, 40), 200
    for _ in range(20):
        layers = _layers(rng, rows, item_lens)
        pack = rng.integers(0, 256, 64 * sum(item_lens), dtype=np.uint8)
        un = RowUnpacker(pack, layers)
        idx = rng.permutation(rows)[:64]
        errors, calls = [], [0]

        def loop():
            while True:
                try:
                    un.unpack(idx)
                    calls[0] += 1
                except Exception as exc:  # noqa: BLE001 - the test classifies it
                    errors.append(exc)
                    return

        t = threading.Thread(target=loop)
        t.start()
        un.close()
        t.join(10)
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "closed" in str(errors[0]), errors
        if calls[0]:
            want = _brute(pack, 0, idx, [a.copy() for a in layers])
            assert all(np.array_equal(a, b) for a, b in zip(layers, want))


def test_warm_on_host_layers_compiles_nothing_and_checks_max_rows():
    rng = np.random.default_rng()
    layers = _layers(rng, 6, [8, 16])
    before = [a.copy() for a in layers]
    u = RowUnpacker(np.zeros(6 * 24, np.uint8), layers)
    assert u.warm(4) == [] and u.warm(10 ** 6, every_bucket=True) == []  # host: numpy, nothing compiles
    assert u.warm(np.int64(3)) == u.warm(np.array(3)) == []
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_rows"):
            u.warm(bad)
    for bad in (True, 2.0, "4", None):
        with pytest.raises(TypeError, match="max_rows"):
            u.warm(bad)
    with pytest.raises(TypeError, match="every_bucket"):
        u.warm(4, every_bucket="yes")
    u.close()
    with pytest.raises(RuntimeError, match="closed"):
        u.warm(1)
    for a, b in zip(layers, before):
        np.testing.assert_array_equal(a, b)
