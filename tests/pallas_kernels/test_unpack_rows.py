"""CPU: `unpack_rows` / `copy_rows` against brute-force per-row references, and their refusals."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import copy_rows, pack_rows, synchronize, unpack_rows

SENTINEL = 0x5A


def _layers(rng, rows, item_lens, fill=None):
    if fill is not None:
        return [np.full((rows, w), fill, np.uint8) for w in item_lens]
    return [rng.integers(0, 256, (rows, w), dtype=np.uint8) for w in item_lens]


def _unpack_brute(pack, layers, idx, offset):
    """Byte by byte: row j of entry l's block goes to layers[l][idx[j]]."""
    out = [a.copy() for a in layers]
    pos = offset
    for a in out:
        w = a.shape[1]
        for r in idx:
            for b in range(w):
                a[r, b] = pack[pos]
                pos += 1
    return out


def _copy_brute(srcs, sidx, dsts, didx):
    out = [d.copy() for d in dsts]
    for s, d in zip(srcs, out):
        for i, j in zip(sidx, didx):
            for b in range(s.shape[1]):
                d[j, b] = s[i, b]
    return out


def test_unpack_hand_case():
    # Two layer entries of 2 and 3 bytes, rows 3 and 0 written, offset 1.
    pack = np.arange(20, dtype=np.uint8)
    layers = [np.zeros((4, 2), np.uint8), np.zeros((4, 3), np.uint8)]
    unpack_rows(pack, layers, [3, 0], offset=1)
    np.testing.assert_array_equal(layers[0], [[3, 4], [0, 0], [0, 0], [1, 2]])
    np.testing.assert_array_equal(layers[1], [[8, 9, 10], [0, 0, 0], [0, 0, 0], [5, 6, 7]])


def test_copy_hand_case():
    src = [np.arange(12, dtype=np.uint8).reshape(4, 3)]
    dst = [np.zeros((3, 3), np.uint8)]
    copy_rows(src, [3, 3, 1], dst, [0, 2, 1])  # a repeated source row is fine
    np.testing.assert_array_equal(dst[0], [[9, 10, 11], [3, 4, 5], [9, 10, 11]])


@pytest.mark.parametrize("item_lens", [(1152, 576), (3, 2, 5), (656,)], ids=str)
def test_unpack_inverts_pack(item_lens):
    rng = np.random.default_rng(len(item_lens))
    src = _layers(rng, 50, item_lens)
    idx = rng.permutation(50)[:17]  # unique, unsorted
    offset = 64 + 3
    pack = np.full(offset + 17 * sum(item_lens) + 9, SENTINEL, np.uint8)
    pack_rows(src, idx, pack, offset=offset)
    dst = _layers(rng, 50, item_lens, fill=SENTINEL)
    unpack_rows(pack, dst, idx, offset=offset)
    for s, d in zip(src, dst):
        np.testing.assert_array_equal(d[idx], s[idx])
        rest = np.setdiff1d(np.arange(50), idx)
        assert (d[rest] == SENTINEL).all()


@settings(max_examples=25, deadline=None)
@given(item_lens=st.lists(st.integers(1, 24), min_size=1, max_size=4),
       rows=st.integers(1, 30), data=st.data(), offset=st.integers(0, 40),
       slack=st.integers(0, 10), threads=st.sampled_from([None, 1, 2, 3]),
       seed=st.integers(0, 2**16))
def test_unpack_property(item_lens, rows, data, offset, slack, threads, seed):
    rng = np.random.default_rng(seed)
    idx = np.array(data.draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=rows)),
                   np.int64)
    pack = rng.integers(0, 256, offset + len(idx) * sum(item_lens) + slack, dtype=np.uint8)
    layers = _layers(rng, rows, item_lens)
    want = _unpack_brute(pack, layers, idx, offset)
    before = pack.copy()
    unpack_rows(pack, layers, idx, offset=offset, threads=threads)
    for a, b in zip(layers, want):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(pack, before)  # the region is only read


@settings(max_examples=25, deadline=None)
@given(item_lens=st.lists(st.integers(1, 24), min_size=1, max_size=4),
       src_rows=st.integers(1, 30), dst_rows=st.integers(1, 30), data=st.data(),
       threads=st.sampled_from([None, 1, 2, 5]), seed=st.integers(0, 2**16))
def test_copy_property(item_lens, src_rows, dst_rows, data, threads, seed):
    rng = np.random.default_rng(seed)
    didx = np.array(data.draw(st.lists(st.integers(0, dst_rows - 1), unique=True,
                                       max_size=dst_rows)), np.int64)
    # Sources: repeats and any order.
    sidx = rng.integers(0, src_rows, len(didx))
    srcs = _layers(rng, src_rows, item_lens)
    dsts = _layers(rng, dst_rows, item_lens)
    want = _copy_brute(srcs, sidx, dsts, didx)
    copy_rows(srcs, sidx, dsts, didx, threads=threads)
    for a, b in zip(dsts, want):
        np.testing.assert_array_equal(a, b)


def test_threaded_large_matches_fancy_indexing():
    # Past HOST_THREADS_MIN_BYTES, so threads=None splits the work.
    rng = np.random.default_rng(7)
    srcs = _layers(rng, 4096, (1152, 576, 1152))
    dsts = _layers(rng, 8192, (1152, 576, 1152), fill=SENTINEL)
    sidx = rng.integers(0, 4096, 3001)
    didx = rng.permutation(8192)[:3001]
    copy_rows(srcs, sidx, dsts, didx)
    for s, d in zip(srcs, dsts):
        np.testing.assert_array_equal(d[didx], s[sidx])
    pack = np.empty(3001 * (1152 * 2 + 576), np.uint8)
    pack_rows(srcs, sidx, pack)
    back = _layers(rng, 8192, (1152, 576, 1152), fill=0)
    unpack_rows(pack, back, didx)
    for d, b in zip(dsts, back):
        np.testing.assert_array_equal(d[didx], b[didx])


def test_empty_is_a_no_op():
    layers = [np.full((4, 3), SENTINEL, np.uint8)]
    unpack_rows(np.zeros(0, np.uint8), layers, [])
    copy_rows([np.zeros((2, 3), np.uint8)], [], layers, np.array([], np.int32))
    assert (layers[0] == SENTINEL).all()


def test_strided_destination_written_in_place():
    base = np.zeros((6, 8), np.uint8)
    dst = base[:, 2:6]  # not C-contiguous: rows of 4 bytes inside rows of 8
    src = [np.arange(16, dtype=np.uint8).reshape(4, 4)]
    copy_rows(src, [1, 2], [dst], [5, 0])
    np.testing.assert_array_equal(base[5, 2:6], [4, 5, 6, 7])
    np.testing.assert_array_equal(base[0, 2:6], [8, 9, 10, 11])
    assert base[:, :2].sum() == 0 and base[:, 6:].sum() == 0


def test_synchronize_host_is_a_no_op():
    synchronize([np.zeros(3, np.uint8)])
    synchronize(np.zeros(3, np.uint8))


# --------------------------------------------------------------------------- refusals


def _ok():
    return np.zeros(64, np.uint8), [np.zeros((8, 4), np.uint8), np.zeros((8, 2), np.uint8)]


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(indices=[0, 8]), ValueError, r"indices must be < num_rows=8"),
    (dict(indices=[-1]), ValueError, r"indices must be >= 0"),
    (dict(indices=[1, 1]), ValueError, r"indices must be unique"),
    (dict(indices=[[1]]), ValueError, r"indices must be 1-D"),
    (dict(indices=[0.5]), TypeError, r"indices dtype float64"),
    (dict(offset=-1), ValueError, r"offset=-1"),
    (dict(offset=True), ValueError, r"offset=True"),
    (dict(offset=60), ValueError, r"pack region overflow: offset=60 \+ 2 rows x 6 B"),
    (dict(backend="triton?"), ValueError, r"backend='triton\?' must be one of"),
    (dict(backend="cupy"), ValueError, r"needs CuPy"),
    (dict(threads=0), ValueError, r"threads=0"),
])
def test_unpack_refusals(kwargs, exc, match):
    pack, layers = _ok()
    args = dict(indices=[0, 1]) | kwargs
    idx = args.pop("indices")
    with pytest.raises(exc, match=match):
        unpack_rows(pack, layers, idx, **args)
    assert all((a == 0).all() for a in layers)  # nothing written before the refusal


def test_unpack_refuses_bad_buffers():
    pack, layers = _ok()
    ro = np.zeros((8, 4), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"layers\[0\] is read-only"):
        unpack_rows(pack, [ro], [0])
    with pytest.raises(TypeError, match=r"layers\[1\] dtype float32"):
        unpack_rows(pack, [layers[0], np.zeros((8, 2), np.float32)], [0])
    with pytest.raises(ValueError, match=r"layers\[0\] must be 2-D"):
        unpack_rows(pack, [np.zeros(8, np.uint8)], [0])
    with pytest.raises(ValueError, match=r"layers must be a non-empty list"):
        unpack_rows(pack, [], [0])
    with pytest.raises(ValueError, match=r"pack must be a 1-D uint8"):
        unpack_rows(pack.reshape(8, 8), layers, [0])
    with pytest.raises(TypeError, match=r"pack must be a numpy"):
        unpack_rows(b"\0" * 64, layers, [0])
    with pytest.raises(ValueError, match=r"pack must be C-contiguous"):
        unpack_rows(np.zeros(128, np.uint8)[::2], layers, [0])
    with pytest.raises(ValueError, match=r"layers\[0\] shares memory with pack"):
        unpack_rows(pack, [pack[:32].reshape(8, 4)], [0])


def test_copy_refusals():
    src = [np.zeros((8, 4), np.uint8), np.zeros((8, 2), np.uint8)]
    dst = [np.ones((5, 4), np.uint8), np.ones((5, 2), np.uint8)]
    cases = [
        (dict(src_indices=[8]), ValueError, r"src_indices must be < num_rows=8 .* src_layers"),
        (dict(dst_indices=[5]), ValueError, r"dst_indices must be < num_rows=5 .* dst_layers"),
        (dict(dst_indices=[-2]), ValueError, r"dst_indices must be >= 0"),
        (dict(src_indices=[0, 1], dst_indices=[2, 2]), ValueError, r"dst_indices must be unique"),
        (dict(src_indices=[0, 1]), ValueError, r"same length"),
        (dict(dst_layers=[dst[0]]), ValueError, r"dst_layers has 1 layer entries, src_layers 2"),
        (dict(dst_layers=[dst[0], np.ones((5, 3), np.uint8)]), ValueError,
         r"item_len mismatch at layer 1: src_layers\[1\] rows are 2 B, dst_layers\[1\] rows 3 B"),
        (dict(dst_layers=[dst[0], src[1]]), ValueError,
         r"dst_layers\[1\] shares memory with src_layers\[1\]"),
        (dict(src_layers=[]), ValueError, r"src_layers must be a non-empty list"),
        (dict(backend="cupy"), ValueError, r"needs CuPy"),
    ]
    for kwargs, exc, match in cases:
        args = dict(src_layers=src, src_indices=[3], dst_layers=dst, dst_indices=[4]) | kwargs
        with pytest.raises(exc, match=match):
            copy_rows(args.pop("src_layers"), args.pop("src_indices"), args.pop("dst_layers"),
                      args.pop("dst_indices"), **args)
        assert all((a == 1).all() for a in dst), kwargs
    ro = np.ones((5, 4), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"dst_layers\[0\] is read-only"):
        copy_rows(src[:1], [0], [ro], [0])


def test_interleaved_views_are_disjoint():
    # Even and odd rows of one buffer: overlapping extents, no shared byte.
    buf = np.zeros((8, 4), np.uint8)
    buf[::2] = 7
    copy_rows([buf[::2]], [0, 1], [buf[1::2]], [2, 3])
    assert (buf[5] == 7).all() and (buf[7] == 7).all() and (buf[1] == 0).all()


# --------------------------------------------------------------------------- Pallas (interpret)


@pytest.mark.parametrize("item_lens, offset", [((1152, 576), 64), ((12, 20, 8), 4),
                                               ((3, 5), 7), ((2, 6), 2)], ids=str)
def test_unpack_interpret_matches_brute_force(item_lens, offset):
    from pallas_kernels import GatherConfig

    rng = np.random.default_rng(sum(item_lens))
    idx = rng.permutation(40)[:21]  # unique, unsorted; 21 rows: a ragged last block of 16
    pack = rng.integers(0, 256, offset + 21 * sum(item_lens) + 13, dtype=np.uint8)
    layers = _layers(rng, 40, item_lens)
    want = _unpack_brute(pack, layers, idx, offset)
    unpack_rows(pack, layers, idx, offset=offset, backend="interpret",
                config=GatherConfig(block_rows=16))
    for a, b in zip(layers, want):
        np.testing.assert_array_equal(a, b)


def _one_buffer_layers(rng, rows, item_lens):
    """Layers as back-to-back views of one layer-major buffer (a connector's KV cache)."""
    buf = rng.integers(0, 256, rows * sum(item_lens), dtype=np.uint8)
    out, pos = [], 0
    for w in item_lens:
        out.append(buf[pos:pos + rows * w].reshape(rows, w))
        pos += rows * w
    return out


@pytest.mark.parametrize("item_lens, offset", [((1152, 576), 64), ((12, 20, 8), 4),
                                               ((2, 6), 2)], ids=str)
def test_unpack_one_buffer_form_matches_brute_force(item_lens, offset):
    # Layers back to back in one buffer take the flat-destination kernel (one argument and
    # one output for all layers), byte-exact like the per-layer one; no other row changes.
    from pallas_kernels import GatherConfig
    from pallas_kernels.unpack_device import flat_layers

    rng = np.random.default_rng(len(item_lens) + offset)
    layers = _one_buffer_layers(rng, 40, item_lens)
    ws = 4 if all(w % 4 == 0 for w in item_lens) else 2
    assert flat_layers(layers, ws) == tuple((40, w // ws) for w in item_lens)
    # 29 rows in blocks of 16: a partial last block whose live rows include row 0. The
    # interpreter emulates a masked store by writing old bytes back, so masked lanes must not
    # share a live row's index (they once pointed at row 0 and undid its new bytes).
    idx = np.insert(1 + rng.permutation(39)[:28], 20, 0)
    pack = rng.integers(0, 256, offset + 29 * sum(item_lens) + 13, dtype=np.uint8)
    want = _unpack_brute(pack, layers, idx, offset)
    separate = [a.copy() for a in layers]  # the same rows through the per-layer form
    unpack_rows(pack, layers, idx, offset=offset, backend="interpret",
                config=GatherConfig(block_rows=16))
    unpack_rows(pack, separate, idx, offset=offset, backend="interpret",
                config=GatherConfig(block_rows=16))
    for a, c, b in zip(layers, separate, want):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, b)


def test_flat_form_only_for_back_to_back_layers():
    from pallas_kernels.unpack_device import flat_layers

    buf = np.zeros(3 * 64, np.uint8)
    assert flat_layers([buf[:64].reshape(8, 8), buf[64:128].reshape(8, 8)], 4) == ((8, 2),) * 2
    # A gap, the wrong order, or one layer: one argument per layer.
    assert flat_layers([buf[:64].reshape(8, 8), buf[128:].reshape(8, 8)], 4) is None
    assert flat_layers([buf[64:128].reshape(8, 8), buf[:64].reshape(8, 8)], 4) is None
    assert flat_layers([buf[:64].reshape(8, 8)], 4) is None


@pytest.mark.parametrize("interleave", [False, True])
def test_copy_interpret_matches_brute_force(interleave):
    from pallas_kernels import GatherConfig

    rng = np.random.default_rng(3)
    item_lens = (288, 64, 12)
    srcs = _layers(rng, 50, item_lens)
    dsts = _layers(rng, 30, item_lens)
    sidx = np.r_[rng.integers(0, 50, 18), 7, 7]  # repeats
    didx = rng.permutation(30)[:20]
    want = _copy_brute(srcs, sidx, dsts, didx)
    copy_rows(srcs, sidx, dsts, didx, backend="interpret",
              config=GatherConfig(block_rows=8, interleave=interleave))
    for a, b in zip(dsts, want):
        np.testing.assert_array_equal(a, b)


def test_interpret_refusals():
    pack, layers = _ok()
    with pytest.raises(ValueError, match=r"offset=2 must be a multiple of 4 bytes on the Pallas"):
        unpack_rows(pack, [np.zeros((8, 4), np.uint8)], [0], offset=2, backend="interpret")
    with pytest.raises(ValueError, match=r"backend='triton' needs CuPy"):
        unpack_rows(pack, layers, [0], backend="triton")
    with pytest.raises(ValueError, match=r"backend='cupy' needs CuPy"):
        copy_rows(layers, [0], [np.zeros((8, 4), np.uint8), np.zeros((8, 2), np.uint8)], [0],
                  backend="cupy")


@pytest.mark.parametrize("item_lens", [(288, 64, 12), (12, 20, 8), (2, 6)], ids=str)
def test_copy_one_buffer_form_matches_brute_force(item_lens):
    # Destination layers back to back in one buffer (the fused path's IPC-mapped decode cache)
    # take the flat-destination copy kernel, byte-exact like the per-layer one.
    from pallas_kernels import GatherConfig

    rng = np.random.default_rng(sum(item_lens))
    srcs = _layers(rng, 50, item_lens)
    dsts = _one_buffer_layers(rng, 40, item_lens)
    # 29 rows in blocks of 16: a partial last block whose live rows include destination row 0
    # (masked lanes must not share a live row's index in the interpreter, nor, in the flat
    # form, spill into the next layer's row 0 over a live write).
    didx = np.insert(1 + rng.permutation(39)[:28], 20, 0)
    sidx = np.r_[rng.integers(0, 50, 27), 7, 7]  # repeats
    want = _copy_brute(srcs, sidx, dsts, didx)
    separate = [a.copy() for a in dsts]
    for dst in (dsts, separate):
        copy_rows(srcs, sidx, dst, didx, backend="interpret", config=GatherConfig(block_rows=16))
    for a, c, b in zip(dsts, separate, want):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, b)


def test_copy_flat_form_only_for_back_to_back_layers():
    # Which jitted entry ran: the flat one for views of one buffer, the per-layer one otherwise
    # (a gap between the layers). Geometries unused elsewhere, so each call traces anew.
    from pallas_kernels import GatherConfig
    from pallas_kernels.scatter import _copy_flat_jit, _copy_jit

    rng = np.random.default_rng(5)
    item_lens = (20, 36)
    srcs = _layers(rng, 9, item_lens)
    buf = rng.integers(0, 256, 11 * 56 + 8, dtype=np.uint8)
    joined = [buf[:220].reshape(11, 20), buf[220:616].reshape(11, 36)]
    gap = [buf[:220].reshape(11, 20), buf[228:624].reshape(11, 36)]
    cfg = GatherConfig(block_rows=8)
    for dsts, flat in ((joined, True), (gap, False)):
        before = (_copy_flat_jit._cache_size(), _copy_jit._cache_size())
        want = _copy_brute(srcs, [4, 0, 8], dsts, [10, 3, 0])
        copy_rows(srcs, [4, 0, 8], dsts, [10, 3, 0], backend="interpret", config=cfg)
        grew = (_copy_flat_jit._cache_size() - before[0], _copy_jit._cache_size() - before[1])
        assert grew == ((1, 0) if flat else (0, 1)), (flat, grew)
        for a, b in zip(dsts, want):
            np.testing.assert_array_equal(a, b)


@settings(max_examples=12, deadline=None)
@given(item_lens=st.lists(st.sampled_from([4, 8, 12, 20]), min_size=2, max_size=3),
       dst_rows=st.integers(1, 24), data=st.data(), seed=st.integers(0, 2**16))
def test_copy_one_buffer_property(item_lens, dst_rows, data, seed):
    from pallas_kernels import GatherConfig

    rng = np.random.default_rng(seed)
    didx = np.array(data.draw(st.lists(st.integers(0, dst_rows - 1), unique=True, min_size=1,
                                       max_size=dst_rows)), np.int64)
    sidx = rng.integers(0, 16, len(didx))  # any order, repeats
    srcs = _layers(rng, 16, item_lens)
    dsts = _one_buffer_layers(rng, dst_rows, item_lens)
    want = _copy_brute(srcs, sidx, dsts, didx)
    copy_rows(srcs, sidx, dsts, didx, backend="interpret", config=GatherConfig(block_rows=8))
    for a, b in zip(dsts, want):
        np.testing.assert_array_equal(a, b)


def test_flags_must_be_bools_and_ragged_indices_are_named():
    # Before: unpack_rows / copy_rows read checked="yes" or 1 by truth value (RowUnpacker,
    # RowCopier and pack_rows(sync=) refused them), and ragged indices raised numpy's message.
    layers = [np.zeros((4, 8), np.uint8)]
    pack = np.arange(8, dtype=np.uint8)
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match=f"checked must be a bool, got {type(bad).__name__}"):
            unpack_rows(pack, layers, [1], checked=bad)
        with pytest.raises(TypeError, match="checked must be a bool"):
            copy_rows([pack.reshape(1, 8)], [0], layers, [1], checked=bad)
    assert not layers[0].any()
    with pytest.raises(ValueError, match=r"indices must be a 1-D sequence of ints"):
        unpack_rows(pack, layers, [[1], [2, 3]])
    with pytest.raises(ValueError, match=r"dst_indices must be a 1-D sequence of ints"):
        copy_rows([pack.reshape(1, 8)], [0], layers, [[1], [2, 3]])
    assert unpack_rows(pack, layers, [2], checked=np.bool_(True)) == 1  # rows written
    assert layers[0][2].tolist() == list(range(8))
