"""CPU: `RowCopier` (copy_rows prepared once) and the copy kernel's stacked source form, against
brute-force per-row references; the copier's refusals."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import GatherConfig, RowCopier, copy_rows


def _layers(rng, rows, item_lens):
    return [rng.integers(0, 256, (rows, w), dtype=np.uint8) for w in item_lens]


def _brute(srcs, sidx, dsts, didx):
    """Row by row: dst[l][didx[j]] = src[l][sidx[j]] (whole rows; the byte-by-byte reference of
    `copy_rows` is in test_unpack_rows.py)."""
    out = [d.copy() for d in dsts]
    for s, d in zip(srcs, out):
        for i, j in zip(sidx, didx):
            d[j] = s[i]
    return out


@settings(max_examples=25, deadline=None)
@given(item_lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       src_rows=st.integers(1, 30), dst_rows=st.integers(1, 30), data=st.data(),
       seed=st.integers(0, 2**31 - 1))
def test_copier_host_matches_brute_force_over_many_calls(item_lens, src_rows, dst_rows, data, seed):
    rng = np.random.default_rng(seed)
    srcs, dsts = _layers(rng, src_rows, item_lens), _layers(rng, dst_rows, item_lens)
    copier = RowCopier(srcs, dsts)
    want = [d.copy() for d in dsts]
    for _ in range(3):  # the same copier, fresh indices each call (repeats in the source)
        n = data.draw(st.integers(0, dst_rows))
        sidx = rng.integers(0, src_rows, n)
        didx = rng.permutation(dst_rows)[:n]
        want = _brute(srcs, sidx, want, didx)
        assert copier.copy(sidx, didx) == n
    for a, b in zip(dsts, want):
        np.testing.assert_array_equal(a, b)


def test_copier_interpret_equals_copy_rows_hand_case():
    # Two layers of 3 and 2 rows; dst rows 2, 0 take src rows 1, 1 (a repeated source row).
    srcs = [np.arange(12, dtype=np.uint8).reshape(3, 4), np.arange(100, 108, dtype=np.uint8).reshape(2, 4)]
    dsts = [np.zeros((3, 4), np.uint8), np.zeros((3, 4), np.uint8)]
    RowCopier(srcs, dsts, backend="interpret", config=GatherConfig(block_rows=8)).copy([1, 1], [2, 0])
    np.testing.assert_array_equal(dsts[0], [[4, 5, 6, 7], [0, 0, 0, 0], [4, 5, 6, 7]])
    np.testing.assert_array_equal(dsts[1], [[104, 105, 106, 107], [0] * 4, [104, 105, 106, 107]])
    again = [np.zeros((3, 4), np.uint8), np.zeros((3, 4), np.uint8)]
    assert copy_rows(srcs, [1, 1], again, [2, 0]) == 2  # rows, as RowCopier.copy says
    for a, b in zip(dsts, again):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("flat", [False, True], ids=["per-layer dst", "flat dst"])
def test_copy_kernel_stacked_source_matches_list_form(flat):
    """The fused path reads a layer-major prefill cache as ONE [L, R, W] source: the same bytes
    as the per-layer source list, into per-layer or flat destinations."""
    from pallas_kernels.scatter import _copy_flat_jit, copy_kernel

    rng = np.random.default_rng(5)
    L, R, W, D = 3, 37, 12, 29
    src = rng.integers(0, 2**32, (L, R, W), dtype=np.uint32)
    dst = [rng.integers(0, 2**32, (D, W), dtype=np.uint32) for _ in range(L)]
    n = 19  # a partial last block of 8
    sidx = np.zeros(24, np.int32)
    didx = np.zeros(24, np.int32)
    sidx[:n] = np.r_[rng.integers(0, R, n - 2), R - 1, R - 1]
    didx[:n] = rng.permutation(D)[:n]
    cfg = GatherConfig(block_rows=8)
    want = _brute(list(src), sidx[:n], dst, didx[:n])
    for source in (jnp.asarray(src), [jnp.asarray(a) for a in src]):
        if flat:
            out = _copy_flat_jit(tuple(source) if isinstance(source, list) else source,
                                 jnp.asarray(sidx),
                                 jnp.asarray(np.concatenate([d.reshape(-1) for d in dst])),
                                 jnp.asarray(didx), np.array((n, 0, 1), np.int32),
                                 layers=((D, W),) * L, config=cfg, backend="interpret")
            got = np.asarray(out).reshape(L, D, W)
        else:
            got = [np.asarray(o) for o in copy_kernel(source, jnp.asarray(sidx),
                                                       [jnp.asarray(d) for d in dst],
                                                       jnp.asarray(didx), n, config=cfg,
                                                       backend="interpret")]
        for l in range(L):
            np.testing.assert_array_equal(got[l], want[l])


def test_copier_refusals():
    rng = np.random.default_rng(1)
    srcs, dsts = _layers(rng, 8, (4, 6)), _layers(rng, 8, (4, 6))
    with pytest.raises(ValueError, match="src_layers must be a non-empty list"):
        RowCopier([], dsts)
    with pytest.raises(ValueError, match=r"item_len mismatch at layer 1: src_layers\[1\] rows are 6 B"):
        RowCopier(srcs, _layers(rng, 8, (4, 8)))
    with pytest.raises(ValueError, match="dst_layers has 1 layer entries, src_layers 2"):
        RowCopier(srcs, dsts[:1])
    with pytest.raises(ValueError, match="share"):  # a destination over a source's memory
        RowCopier(srcs, [srcs[0], dsts[1]])
    ro = dsts[0].copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"dst_layers\[0\] is read-only"):
        RowCopier(srcs, [ro, dsts[1]])
    with pytest.raises(TypeError, match="got a JAX array"):
        RowCopier([jnp.asarray(a) for a in srcs], dsts)
    with pytest.raises(ValueError, match="backend="):
        RowCopier(srcs, dsts, backend="nope")
    with pytest.raises(ValueError, match="needs CuPy"):
        RowCopier(srcs, dsts, backend="triton")
    with pytest.raises(TypeError, match="config must be a GatherConfig"):
        RowCopier(srcs, dsts, config={"block_rows": 8})
    copier = RowCopier(srcs, dsts)
    before = [d.copy() for d in dsts]
    with pytest.raises(ValueError, match=r"src_indices \(2\) and dst_indices \(1\)"):
        copier.copy([0, 1], [0])
    with pytest.raises(ValueError, match="src_indices"):
        copier.copy([8], [0])  # past the source rows
    with pytest.raises(ValueError, match="dst_indices"):
        copier.copy([0], [-1])
    with pytest.raises(ValueError, match="dst_indices"):
        copier.copy([0, 1], [3, 3])  # a duplicate destination
    with pytest.raises(TypeError, match="src_indices"):
        copier.copy([0.5], [0])
    for a, b in zip(dsts, before):  # nothing was written by a refused call
        np.testing.assert_array_equal(a, b)
    copier.close()
    copier.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        copier.copy([0], [0])
    assert "closed" in repr(copier)


def _flat_dst(rng, L, rows, W):
    return rng.integers(0, 2**32, L * rows * W, dtype=np.uint32)


@pytest.mark.parametrize("groups", [None, (2, 1), (1, 1, 1)])
def test_fanout_kernel_matches_brute_force(groups):
    """One launch for three destinations of different row counts: windows of 19, 0 and 8 rows
    (a partial block, an empty window, a window of exactly one block), repeats in the source;
    the source whole or as layer groups (how a stack past 2**31 words is read)."""
    from pallas_kernels.fanout import fanout_kernel

    rng = np.random.default_rng()
    L, R, W = 3, 40, 12
    src = rng.integers(0, 2**32, (L, R, W), dtype=np.uint32)
    rows = (30, 9, 17)
    dsts = [_flat_dst(rng, L, r, W) for r in rows]
    windows = [(0, np.r_[rng.integers(0, R, 17), 5, 5], rng.permutation(30)[:19]),
               (1, np.zeros(0, np.int64), np.zeros(0, np.int64)),
               (2, rng.integers(0, R, 8), rng.permutation(17)[:8])]
    want = [d.reshape(L, r, W).copy() for d, r in zip(dsts, rows)]
    for k, s, d in windows:
        for l in range(L):
            want[k][l][d] = src[l][s]
    arg = jnp.asarray(src) if groups is None else \
        [jnp.asarray(src[f:f + n]) for f, n in zip(np.cumsum((0,) + groups[:-1]), groups)]
    outs = fanout_kernel(arg, windows, [jnp.asarray(d) for d in dsts], config=GatherConfig(block_rows=8))
    for o, w, r in zip(outs, want, rows):
        np.testing.assert_array_equal(np.asarray(o).reshape(L, r, W), w)


def test_layer_groups_split_a_stack_under_the_word_limit():
    """Hand-computed splits: 61 layers of a 128k-token DeepSeek-V3 cache (131,072 rows x 288
    words per layer, 2.30e9 words) into 31 + 30; one group when it fits; none when one layer
    alone is too large; every group within the limit and the layers covered in order."""
    from pallas_kernels.device import MAX_STACKED_WORDS, layer_groups

    assert layer_groups(61, 131072 * 288) == [(0, 31), (31, 30)]
    assert layer_groups(61, 32768 * 288) == [(0, 61)]
    assert layer_groups(3, 10, limit=10) == [(0, 1), (1, 1), (2, 1)]
    assert layer_groups(7, 10, limit=25) == [(0, 2), (2, 2), (4, 2), (6, 1)]
    assert layer_groups(4, 11, limit=10) == [] and layer_groups(0, 5) == []
    for args, exc, match in (((-3, 10), ValueError, "num_layers=-3"), ((5, 0), ValueError, "layer_words=0"),
                             ((5, -4), ValueError, "layer_words=-4"), ((5, 10, 0), ValueError, "limit=0"),
                             ((True, 10), TypeError, "num_layers must be an int"),
                             ((5, 10.0), TypeError, "layer_words must be an int"),
                             ((5, 10, None), TypeError, "limit must be an int")):
        with pytest.raises(exc, match=match):
            layer_groups(*args)
    rng = np.random.default_rng()
    for _ in range(200):
        n, w = int(rng.integers(1, 200)), int(rng.integers(1, 1 << 30))
        gs = layer_groups(n, w)
        if w > MAX_STACKED_WORDS:
            assert gs == []
            continue
        assert [f for f, _ in gs] == list(np.cumsum([0] + [k for _, k in gs[:-1]]))
        assert sum(k for _, k in gs) == n and all(k * w <= MAX_STACKED_WORDS for _, k in gs)
        assert len(gs) == -(-n // (MAX_STACKED_WORDS // w))  # no more groups than needed


def test_copy_fanout_host_copiers_match_brute_force():
    from pallas_kernels import PackSource, copy_fanout

    rng = np.random.default_rng(12)
    srcs = _layers(rng, 20, (8, 8))
    source = PackSource(srcs)
    dsts = [_layers(rng, 10, (8, 8)) for _ in range(3)]
    copiers = [RowCopier(source, d) for d in dsts]
    jobs = [(copiers[0], [1, 2, 2], [0, 5, 9]), (copiers[1], [], []), (copiers[2], [19], [3])]
    want = [_brute(srcs, np.asarray(s, int), d, np.asarray(t, int)) for (_, s, t), d in zip(jobs, dsts)]
    assert copy_fanout(jobs) == 4
    for d, w in zip(dsts, want):
        for a, b in zip(d, w):
            np.testing.assert_array_equal(a, b)
    before = [[a.copy() for a in d] for d in dsts]
    with pytest.raises(ValueError, match="each copier may appear once"):
        copy_fanout([(copiers[0], [0], [0]), (copiers[0], [1], [1])])
    with pytest.raises(ValueError, match="dst_indices"):  # checked before anything is copied
        copy_fanout([(copiers[0], [0], [1]), (copiers[1], [0], [10])])
    for d, b in zip(dsts, before):
        for x, y in zip(d, b):
            np.testing.assert_array_equal(x, y)
    assert copy_fanout([]) == 0


def test_overlapping_memory_is_refused_before_any_write():
    from pallas_kernels import PackSource, copy_fanout, pack_rows, pack_windows

    buf = np.arange(2048, dtype=np.uint32).view(np.uint8)[:2048].copy()
    layers = [buf[:1024].reshape(64, 16)]
    before = buf.copy()
    for src in (layers, PackSource(layers)):  # a pack over the layers' own bytes
        with pytest.raises(ValueError, match=r"pack shares memory with layers\[0\]"):
            pack_rows(src, np.arange(64)[::-1].copy(), buf, threads=2)
        with pytest.raises(ValueError, match=r"pack shares memory with layers\[0\]"):
            pack_windows(src, [(np.arange(4), 0)], buf)
    np.testing.assert_array_equal(buf, before)
    rng = np.random.default_rng(2)
    srcs = _layers(rng, 8, (4, 4))
    d0 = np.zeros((8, 4), np.uint8)
    with pytest.raises(ValueError, match=r"dst_layers\[0\] and dst_layers\[1\] share memory"):
        RowCopier(srcs, [d0, d0])
    with pytest.raises(ValueError, match=r"dst_layers\[0\] and dst_layers\[1\] share memory"):
        copy_rows(srcs, [0], [d0, d0], [0])
    half = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match=r"dst_layers\[0\] and dst_layers\[1\] share memory"):
        RowCopier(srcs, [half[:32].reshape(8, 4), half[16:48].reshape(8, 4)])
    # Two copiers of one call writing one destination: refused, nothing written.
    source = PackSource(srcs)
    shared = [np.zeros((8, 4), np.uint8), np.zeros((8, 4), np.uint8)]
    a, b = RowCopier(source, shared), RowCopier(source, shared)
    with pytest.raises(ValueError, match=r"jobs\[0\] and jobs\[1\] write the same memory"):
        copy_fanout([(a, [0], [4]), (b, [1], [4])])
    assert not any(d.any() for d in shared)


def test_copy_fanout_names_the_bad_job():
    from pallas_kernels import PackSource, copy_fanout

    rng = np.random.default_rng(3)
    source = PackSource(_layers(rng, 10, (4,)))
    c0, c1 = (RowCopier(source, [np.zeros((10, 4), np.uint8)]) for _ in range(2))
    with pytest.raises(ValueError, match=r"jobs\[1\]: dst_indices"):
        copy_fanout([(c0, [0], [1]), (c1, [0], [10])])
    with pytest.raises(TypeError, match="jobs must be a list"):
        copy_fanout(None)
    with pytest.raises(TypeError, match=r"jobs\[0\] must be a \(RowCopier, src_indices, dst_indices\)"):
        copy_fanout([(c0, [0])])
    with pytest.raises(TypeError, match=r"jobs\[0\] must be"):
        copy_fanout([("x", [0], [0])])
    with pytest.raises(TypeError, match="checked must be a bool"):
        copy_fanout([(c0, [0], [0])], checked="no")
    with pytest.raises(TypeError, match="checked must be a bool"):
        c0.copy([0], [0], checked=1)
    # Host copiers check even when told the indices are checked: numpy's -1 would write the
    # last row.
    with pytest.raises(ValueError, match="dst_indices"):
        c0.copy([0], [-1], checked=True)
    with pytest.raises(ValueError, match="dst_indices"):
        copy_rows(list(source.layers), [0], [np.zeros((10, 4), np.uint8)], [-1], checked=True)
    c1.close()
    with pytest.raises(RuntimeError, match=r"jobs\[1\]: this RowCopier is closed"):
        copy_fanout([(c0, [0], [0]), (c1, [0], [0])])
    with pytest.raises(RuntimeError, match="closed"):
        c1.destinations()
    with pytest.raises(ValueError, match=r"src_layers\[0\] has rows of 0 bytes"):
        RowCopier([np.zeros((4, 0), np.uint8)], [np.zeros((4, 0), np.uint8)])


def test_fanout_kernel_refuses_bad_windows():
    from pallas_kernels.fanout import fanout_kernel

    src = jnp.zeros((2, 8, 4), jnp.uint32)
    dsts = [jnp.zeros(2 * 6 * 4, jnp.uint32)]
    cfg = GatherConfig(block_rows=8)
    for windows, match in (([(0, [1, 2], [3])], "one length"), ([(1, [0], [0])], "destination 1"),
                           ([(0, [8], [0])], "out of range"), ([(0, [0], [6])], "out of range"),
                           ([(0, [0.5], [0])], "integer")):
        with pytest.raises(ValueError, match=match):
            fanout_kernel(src, windows, dsts, config=cfg)
    with pytest.raises(ValueError, match=r"dsts\[0\] must be a flat"):
        fanout_kernel(src, [], [jnp.zeros(7, jnp.uint32)], config=cfg)
    win = [(0, [1], [2])]
    with pytest.raises(ValueError, match=">= 1 layer each"):  # a group of no layers
        fanout_kernel([src, jnp.zeros((0, 8, 4), jnp.uint32)], win, dsts, config=cfg)
    with pytest.raises(ValueError, match="1 word wide"):
        fanout_kernel(jnp.zeros((2, 8, 0), jnp.uint32), win, [jnp.zeros(0, jnp.uint32)], config=cfg)
    with pytest.raises(ValueError, match="share rows, width and dtype"):
        fanout_kernel([src, jnp.zeros((1, 8, 4), jnp.int32)], win, dsts, config=cfg)
    with pytest.raises(TypeError, match="config must be a GatherConfig"):
        fanout_kernel(src, win, dsts, config=None)
    with pytest.raises(ValueError, match="backend='bogus'"):
        fanout_kernel(src, win, dsts, config=cfg, backend="bogus")


def test_a_third_layer_inside_the_first_is_refused():
    # A and B interleave without sharing a byte; C is rows 1..3 of A, and B reaches past A: the
    # check must compare C with every layer still open, not only the farthest-reaching one.
    from pallas_kernels import PackSource, copy_fanout, unpack_rows

    v = np.zeros(16, np.uint8).reshape(4, 2, 2)
    A, B, C = v[:, 0, :], v[:, 1, :], v[1:, 0, :]
    src = [np.full((4, 2), i + 1, np.uint8) for i in range(3)]
    RowCopier(src[:2], [A, B])  # interleaved, disjoint: accepted
    with pytest.raises(ValueError, match=r"dst_layers\[0\] and dst_layers\[2\] share memory"):
        copy_rows(src, [0], [A, B, C], [0])
    with pytest.raises(ValueError, match=r"dst_layers\[0\] and dst_layers\[2\] share memory"):
        RowCopier(src, [A, B, C])
    with pytest.raises(ValueError, match=r"layers\[0\] and layers\[2\] share memory"):
        unpack_rows(np.zeros(6, np.uint8), [A, B, C], [0])
    one = PackSource([np.full((4, 2), 7, np.uint8)])
    ca, cb, cc = (RowCopier(one, [x]) for x in (A, B, C))
    with pytest.raises(ValueError, match=r"jobs\[0\] and jobs\[2\] write the same memory"):
        copy_fanout([(ca, [0], [1]), (cb, [0], [0]), (cc, [0], [0])])
    assert not v.any()


def test_fanout_kernel_refuses_malformed_windows():
    from pallas_kernels.fanout import fanout_kernel

    src = jnp.zeros((2, 8, 4), jnp.uint32)
    dsts = [jnp.zeros(2 * 6 * 4, jnp.uint32), jnp.zeros(2 * 6 * 4, jnp.uint32)]
    cfg = GatherConfig(block_rows=8)
    for windows, match in (([(True, [0], [0])], "destination True"), ([None], r"windows\[0\] must be"),
                           ([(0, [0])], r"windows\[0\] must be"), (None, "windows must be a list"),
                           ([(0, [1, 2], [3, 3])], "twice"), ([(0, [1], [3]), (0, [2], [3])], "twice")):
        with pytest.raises(ValueError, match=match):
            fanout_kernel(src, windows, dsts, config=cfg)
    assert fanout_kernel(src, [], dsts, config=cfg) == tuple(dsts)  # nothing to copy
    fanout_kernel(src, [(0, [1], [3]), (1, [2], [3])], dsts, config=cfg)  # one row per destination


def test_warm_copy_fanout_refusals_and_host_copiers():
    """Host copiers never share a launch (`copy_fanout` copies them one by one): nothing to
    compile. Bad arguments are refused by name before anything runs."""
    from pallas_kernels import PackSource, warm_copy_fanout

    rng = np.random.default_rng(5)
    source = PackSource(_layers(rng, 10, (4,)))
    dsts = [np.zeros((10, 4), np.uint8) for _ in range(2)]
    c0, c1 = (RowCopier(source, [d]) for d in dsts)
    assert warm_copy_fanout([c0, c1], 64) == []
    assert all((d == 0).all() for d in dsts)
    for bad in (0, False, 1.5):
        with pytest.raises(ValueError, match="max_rows"):
            warm_copy_fanout([c0, c1], bad)
    with pytest.raises(TypeError, match=r"copiers\[1\] must be a RowCopier, got str"):
        warm_copy_fanout([c0, "x"], 8)
    with pytest.raises(TypeError, match="copiers must be a list of RowCopier"):
        warm_copy_fanout(c0, 8)
    with pytest.raises(ValueError, match="once"):
        warm_copy_fanout([c0, c0], 8)
    with pytest.raises(ValueError, match=r"copiers\[0\] and copiers\[1\] write the same memory"):
        warm_copy_fanout([c0, RowCopier(source, [dsts[0]])], 8)
    c1.close()
    with pytest.raises(RuntimeError, match=r"copiers\[1\] is closed"):
        warm_copy_fanout([c0, c1], 8)


def test_a_destination_made_read_only_later_is_refused_before_any_write():
    # Before (fresh-user trial): layers 0 and 1 were written, then numpy's "assignment
    # destination is read-only" (no argument named); copy_fanout documented the partial write.
    from pallas_kernels import RowUnpacker, copy_fanout

    rng = np.random.default_rng()
    src = [rng.integers(0, 256, (6, n), dtype=np.uint8) for n in (8, 4, 16)]
    for make in ("copy", "fanout", "unpack"):
        dst = [np.zeros((5, n), np.uint8) for n in (8, 4, 16)]
        other = [np.zeros((5, n), np.uint8) for n in (8, 4, 16)]
        if make == "unpack":
            pack = rng.integers(0, 256, 200, dtype=np.uint8)
            obj = RowUnpacker(pack, dst)
        else:
            obj, first = RowCopier(src, dst), RowCopier(src, other)
        dst[2].setflags(write=False)
        with pytest.raises(ValueError, match=r"\[2\] is read-only now .*nothing was written"):
            if make == "copy":
                obj.copy([1, 2], [3, 4])
            elif make == "fanout":  # the writeable job listed first is not written either
                copy_fanout([(first, [0], [0]), (obj, [1, 2], [3, 4])])
            else:
                obj.unpack([1, 2])
        assert all(not a.any() for a in dst) and all(not a.any() for a in other)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5), st.integers(0, 5), st.integers(-7, 7), st.integers(-7, 7))
def test_self_overlap_rule_matches_brute_force(rows, cols, s0, s1):
    # The gcd rule against every (row, column) byte offset a view addresses.
    from pallas_kernels._buffer_args import _rows_self_overlap

    base = np.zeros(200, np.uint8)[100:]
    v = np.lib.stride_tricks.as_strided(base, (rows, cols), (s0, s1))
    offsets = [i * s0 + j * s1 for i in range(rows) for j in range(cols)]
    assert _rows_self_overlap(v) == (len(offsets) != len(set(offsets)))


def test_a_destination_that_addresses_a_byte_twice_is_refused_before_any_write():
    # A stride-0 view (every row the same bytes) or rows that overlap their neighbours: a row
    # would land twice, the last write winning in an order the device does not keep.
    from pallas_kernels import unpack_rows

    src = [np.full((4, 4), 9, np.uint8)]
    mem = np.zeros(64, np.uint8)
    stride0 = np.lib.stride_tricks.as_strided(mem, (4, 4), (0, 1))
    squeezed = np.lib.stride_tricks.as_strided(mem, (4, 4), (2, 1))  # rows overlap by 2 B
    for bad in (stride0, squeezed):
        with pytest.raises(ValueError, match=r"dst_layers\[0\] .* addresses some byte twice"):
            RowCopier(src, [bad])
        with pytest.raises(ValueError, match=r"dst_layers\[0\] .* addresses some byte twice"):
            copy_rows(src, [0], [bad], [1])
        with pytest.raises(ValueError, match=r"layers\[0\] .* addresses some byte twice"):
            unpack_rows(np.full(4, 9, np.uint8), [bad], [1])
    assert not mem.any()
    # Strided rows that skip bytes are fine: every row is written once.
    gaps = np.lib.stride_tricks.as_strided(mem, (4, 4), (8, 1))
    copy_rows(src, [0, 1], [gaps], [3, 0])
    assert gaps[[0, 3]].tolist() == [[9] * 4] * 2 and not gaps[[1, 2]].any()
