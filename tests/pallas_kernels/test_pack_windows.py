"""CPU: `pallas_kernels.pack_windows` (every window of a round in one call) is byte-identical to
`pack_rows` once per window, on the host path and the windowed Pallas kernel (interpret)."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import (GatherConfig, PackSource, compile_count, compile_log, pack_rows, pack_windows,
                            warm_pack_windows)
from pallas_kernels.windows import gather_windows, gather_windows_reference, window_blocks

SENTINEL = 0xA5
SMALL = GatherConfig(block_rows=8)  # small blocks: several blocks per window, quick interpret


def _layers(rng, rows, item_lens):
    return [rng.integers(0, 256, (rows, w), dtype=np.uint8) for w in item_lens]


def _per_window(layers, windows, size, backend, config=None):
    """The reference: pack_rows once per window into a sentinel-filled pack."""
    ref = np.full(size, SENTINEL, np.uint8)
    for idx, off in windows:
        pack_rows(layers, idx, ref, offset=off, backend=backend, config=config)
    return ref


def _disjoint(rng, counts, row_bytes, align, gap_max=3):
    """Offsets (multiples of `align`) of windows laid out in a shuffled order with gaps."""
    order = rng.permutation(len(counts))
    offs, pos = [0] * len(counts), 0
    for w in order:
        pos += int(rng.integers(0, gap_max + 1)) * align
        offs[w] = pos
        pos += -(-counts[w] * row_bytes // align) * align
    return offs, pos


def test_window_blocks_by_hand():
    # Windows of 5, 0 and 9 rows, blocks of 4: 2 + 0 + 3 blocks, bucket 32 rows = 8 blocks.
    starts, blocks, m = window_blocks([5, 0, 9], [10, 20, 30], 4)
    assert starts.tolist() == [0, 8, 8] and m == 32
    assert blocks.reshape(-1, 4).tolist() == [
        [10, 5, 0, 1], [10, 5, 4, 1],
        [30, 9, 0, 1], [30, 9, 4, 1], [30, 9, 8, 1],
        [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    # Offsets of 2**31 words and more travel as uint32 bits.
    _, blocks, _ = window_blocks([1], [2**32 - 1], 4)
    assert blocks[0] == -1


def test_window_blocks_repeats_a_layout_and_keeps_shapes_apart():
    # A round of the same shape gets the kept layout, as its own (writable) copy; any other
    # count, unit or block size gets its own layout.
    a = window_blocks([5, 0, 9], [10, 20, 30], 4)
    a[1][0] = 7  # the caller's copy: the kept layout is not touched
    b = window_blocks(np.array([5, 0, 9]), (10, 20, 30), 4)
    assert b[1][0] == 10 and b[0].tolist() == [0, 8, 8] and a[2] == b[2] == 32
    assert b[1].flags.writeable and b[0] is not a[0]
    other = window_blocks([5, 1, 9], [10, 20, 30], 4)
    assert other[1].reshape(-1, 4).tolist()[2] == [20, 1, 0, 1]
    assert window_blocks([5, 0, 9], [10, 20, 31], 4)[1].reshape(-1, 4)[2].tolist() == [31, 9, 0, 1]
    assert window_blocks([5, 0, 9], [10, 20, 30], 8)[0].tolist() == [0, 8, 8]
    assert window_blocks([5, 0, 9], [10, 20, 30], 4)[1].reshape(-1, 4).tolist()[0] == [10, 5, 0, 1]


def test_window_blocks_edges_of_the_32_bit_columns_by_hand():
    # Blocks of 2, an int64 array of counts: 3 rows at the largest unit, 2**32 - 1 (bits -1),
    # in blocks 0-1; 1 row at unit 0 in block 2; 6 rows bucket to 8 (4 blocks, the last empty).
    starts, blocks, m = window_blocks(np.array([3, 1], np.int64), [2**32 - 1, 0], 2)
    assert starts.tolist() == [0, 4] and m == 8
    assert blocks.reshape(-1, 4).tolist() == [[-1, 3, 0, 1], [-1, 3, 2, 1], [0, 1, 0, 1], [0, 0, 0, 0]]


@pytest.mark.parametrize("counts, units, block_rows, err, match", [
    ([1], [1 << 33], 4, ValueError, r"units\[0\]=8589934592 must be in \[0, 4294967295\]"),  # would wrap to 0
    ([1, 1], [0, -1], 4, ValueError, r"units\[1\]=-1 must be in"),  # would be bits 0xFFFFFFFF
    ([1], [2**32], 4, ValueError, r"units\[0\]"),
    ([-1], [0], 4, ValueError, r"counts\[0\]=-1 must be in \[0, 2147483647\]"),
    ([2**31], [0], 4, ValueError, r"counts\[0\]"),  # the int32 rows column
    ([2.7], [0], 4, TypeError, r"counts\[0\]=2.7 must be an int"),  # would be truncated to 2
    ([2], [1.0], 4, TypeError, r"units\[0\]=1.0 must be an int"),
    ([True], [0], 4, TypeError, r"counts\[0\]=True must be an int"),
    (np.array([2.7]), [0], 4, TypeError, "counts must be a 1-D integer array"),
    (np.array([True]), [0], 4, TypeError, "counts must be a 1-D integer array"),
    (3, [0], 4, TypeError, "counts must be a sequence of ints"),
    ([1], [0], 0, ValueError, "block_rows=0 must be a power of 2"),  # was a ZeroDivisionError
    ([1], [0], 3, ValueError, "block_rows=3 must be a power of 2"),
    ([1], [0], -4, ValueError, "block_rows=-4 must be a power of 2"),
    ([1], [0], 4.0, TypeError, "block_rows=4.0 must be an int"),
    ([1], [0], True, TypeError, "block_rows=True must be an int"),
    ([1, 2], [0], 4, ValueError, r"counts \(2\) and units \(1\)"),
])
def test_window_blocks_refuses_what_the_table_cannot_hold(counts, units, block_rows, err, match):
    with pytest.raises(err, match=match):
        window_blocks(counts, units, block_rows)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 70), st.integers(0, 2**32 - 1)), max_size=12),
       st.sampled_from([1, 4, 16, 64]))
def test_window_blocks_match_a_block_by_block_reference(wins, br):
    counts, units = [c for c, _ in wins], [u for _, u in wins]
    starts, blocks, m = window_blocks(counts, units, br)
    rows, want, pos = [], [], 0
    for c, u in wins:  # brute force: every window from the next block, block by block
        rows.append(pos)
        for first in range(0, c, br):
            want.append([np.array(u, np.uint32).view(np.int32), c, first, 1])
            pos += br
    assert starts.tolist() == rows and m >= pos and m % br == 0
    got = blocks.reshape(-1, 4)
    assert got.shape == (m // br, 4) and blocks.dtype == np.int32
    assert got[:len(want)].tolist() == [[int(x) for x in w] for w in want]
    assert not got[len(want):].any()


@pytest.mark.parametrize("item_lens", [(1152, 1152), (576,), (656, 1152, 576), (3, 2, 5)],
                         ids=lambda x: "-".join(map(str, x)))
@pytest.mark.parametrize("backend", ["numpy", "interpret"])
def test_equals_pack_rows_per_window(item_lens, backend):
    rng = np.random.default_rng(sum(item_lens))
    layers = _layers(rng, 50, item_lens)
    counts = [7, 0, 19, 1, 8]
    align = 64 if backend != "numpy" else 1
    offs, end = _disjoint(rng, counts, sum(item_lens), align)
    windows = [(rng.integers(0, 50, n), o) for n, o in zip(counts, offs)]
    size = end + 100
    ref = _per_window(layers, windows, size, backend, SMALL)
    got = np.full(size, SENTINEL, np.uint8)
    wrote = pack_windows(layers, windows, got, backend=backend, config=SMALL)
    assert wrote == sum(counts) * sum(item_lens)
    np.testing.assert_array_equal(got, ref)


@settings(max_examples=25, deadline=None)
@given(item_lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       counts=st.lists(st.integers(0, 12), min_size=1, max_size=6),
       seed=st.integers(0, 2**16), threads=st.sampled_from([None, 1, 3]))
def test_property_host_windows_equal_per_window(item_lens, counts, seed, threads):
    rng = np.random.default_rng(seed)
    layers = _layers(rng, 16, item_lens)
    offs, end = _disjoint(rng, counts, sum(item_lens), 1, gap_max=40)
    windows = [(rng.integers(0, 16, n), o) for n, o in zip(counts, offs)]
    ref = _per_window(layers, windows, end + 7, "numpy")
    got = np.full(end + 7, SENTINEL, np.uint8)
    pack_windows(layers, windows, got, threads=threads)
    np.testing.assert_array_equal(got, ref)


@settings(max_examples=6, deadline=None)
@given(counts=st.lists(st.integers(0, 20), min_size=1, max_size=5), seed=st.integers(0, 2**16),
       align=st.sampled_from([4, 8, 64]))
def test_property_kernel_windows_equal_per_window(counts, seed, align):
    # One geometry (so one compile per bucket); random windows, word- or 16-byte-aligned.
    rng = np.random.default_rng(seed)
    layers = _layers(rng, 24, (12, 20))
    offs, end = _disjoint(rng, counts, 32, align)
    windows = [(rng.integers(0, 24, n), o) for n, o in zip(counts, offs)]
    ref = _per_window(layers, windows, end + 16, "numpy")
    got = np.full(end + 16, SENTINEL, np.uint8)
    pack_windows(PackSource(layers), windows, got, backend="interpret", config=SMALL)
    np.testing.assert_array_equal(got, ref)


def test_gather_windows_stacked_and_list_match_the_reference():
    rng = np.random.default_rng(3)
    src = jnp.asarray(rng.integers(0, 2**32, (3, 20, 6), dtype=np.uint32))
    pack = jnp.asarray(rng.integers(0, 2**32, 400, dtype=np.uint32))
    windows = [(np.array([3, 1, 4, 1, 5]), 4), (np.array([9, 2, 6, 5, 3, 5, 8, 9, 7]), 200)]
    want = np.asarray(gather_windows_reference(src, windows, pack))
    starts, blocks, m = window_blocks([5, 9], [1, 50], 8)  # offset_align 4: 4 and 200 words
    idx = np.zeros(m, np.int32)
    for (i, _), s in zip(windows, starts):
        idx[s:s + len(i)] = i
    for form in (src, [src[l] for l in range(3)]):
        got = gather_windows(form, jnp.asarray(idx), jnp.array(pack), jnp.asarray(blocks),
                             config=SMALL, backend="interpret", offset_align=4)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_no_recompile_for_other_windows_in_the_bucket():
    rng = np.random.default_rng(5)
    layers = _layers(rng, 30, (8, 8))
    pack = np.zeros(4096, np.uint8)
    first = compile_count()
    pack_windows(layers, [(np.arange(5), 0), (np.arange(9), 1024)], pack, backend="interpret",
                 config=SMALL)
    before = compile_count()
    if before > first:  # traced now (not by an earlier test): the log names the kernel and bucket
        assert compile_log()[-1].endswith("gather_windows idx=(32,) shapes=((30, 2), (30, 2)) "
                                          "stacked=False offset_align_words=4"), compile_log()[-1]
    # Other counts, offsets and window numbers, same index bucket (<= 32 rows of blocks of 8).
    for wins in ([(np.arange(3), 64), (np.arange(2), 512), (np.arange(8), 2048)],
                 [(np.arange(20), 128)]):
        ref = _per_window(layers, wins, 4096, "numpy")
        got = np.full(4096, SENTINEL, np.uint8)
        pack_windows(layers, wins, got, backend="interpret", config=SMALL)
        np.testing.assert_array_equal(got, ref)
    assert compile_count() == before


def test_empty_windows_write_nothing():
    layers = _layers(np.random.default_rng(0), 4, (8,))
    pack = np.full(64, SENTINEL, np.uint8)
    assert pack_windows(layers, [(np.zeros(0, np.int64), 0), ([], 8)], pack) == 0
    assert (pack == SENTINEL).all()


L8 = [np.zeros((10, 8), np.uint8)]
P = np.zeros(256, np.uint8)


@pytest.mark.parametrize("windows,kwargs,exc,match", [
    ([], {}, ValueError, "windows must be a non-empty"),
    ([(np.arange(2),)], {}, ValueError, r"windows\[0\] must be an \(indices, offset\) pair"),
    ([(np.arange(2), -8)], {}, ValueError, r"windows\[0\] offset=-8"),
    ([(np.arange(2), 0), (np.arange(3), 8)], {}, ValueError,
     r"windows\[0\] bytes \[0, 16\) and windows\[1\] bytes \[8, 32\) overlap"),
    ([(np.arange(3), 64), (np.arange(3), 48)], {}, ValueError,
     r"windows\[1\] bytes \[48, 72\) and windows\[0\] bytes \[64, 88\) overlap"),
    ([(np.arange(2), 0), (np.arange(2), 250)], {}, ValueError, r"windows\[1\] region overflow"),
    ([(np.array([0, 10]), 0)], {}, ValueError, r"windows\[0\] indices must be < num_rows=10"),
    ([(np.array([-1]), 0)], {}, ValueError, r"windows\[0\] indices must be >= 0"),
    ([(np.zeros((2, 2), np.int64), 0)], {}, ValueError, r"windows\[0\] indices must be 1-D"),
    ([(np.array([0.5]), 0)], {}, TypeError, r"windows\[0\] indices dtype float64"),
    ([(np.arange(2), 6)], {"backend": "interpret"}, ValueError, r"windows\[0\]: offset=6"),
    ([(np.arange(2), 0)], {"backend": "nope"}, ValueError, "backend="),
    ([(np.arange(2), 0)], {"threads": 0}, ValueError, "threads=0"),
])
def test_bad_inputs(windows, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        pack_windows(L8, windows, P.copy(), **kwargs)


def test_adjacent_windows_are_not_an_overlap():
    layers = [np.arange(80, dtype=np.uint8).reshape(10, 8)]
    windows = [(np.arange(3), 64), (np.array([9, 8]), 48)]  # bytes [64, 88) and [48, 64)
    got = np.full(96, SENTINEL, np.uint8)
    pack_windows(layers, windows, got)
    np.testing.assert_array_equal(got, _per_window(layers, windows, 96, "numpy"))
    assert got[48:56].tolist() == list(range(72, 80))  # row 9, by hand


def test_bad_layers_and_pack_are_refused_as_by_pack_rows():
    with pytest.raises(TypeError, match=r"layers\[0\] dtype float32 must be uint8"):
        pack_windows([np.zeros((4, 8), np.float32)], [(np.arange(1), 0)], P.copy())
    with pytest.raises(ValueError, match="pack must be a 1-D uint8 array"):
        pack_windows(L8, [(np.arange(1), 0)], np.zeros(64, np.int32))
    with pytest.raises(ValueError, match="pack must be writeable"):
        ro = P.copy()
        ro.flags.writeable = False
        pack_windows(L8, [(np.arange(1), 0)], ro)


def test_warm_up_compiles_every_bucket_and_writes_nothing():
    """warm_pack_windows traces the windowed kernel for each index bucket up to max_rows (empty
    row blocks: the pack is untouched); later rounds in those buckets compile nothing."""
    rng = np.random.default_rng()
    layers = _layers(rng, 40, (8, 16))
    pack = rng.integers(0, 256, 8192, dtype=np.uint8)
    before = pack.copy()
    assert warm_pack_windows(layers, pack, 40, backend="interpret", config=SMALL) == [8, 16, 32, 64]
    assert np.array_equal(pack, before)
    count = compile_count()
    for wins in ([(rng.integers(0, 40, 3), 64)],  # 8 index rows
                 [(rng.integers(0, 40, 9), 0), (rng.integers(0, 40, 2), 2048)],  # 16 + 8 -> 32
                 [(rng.integers(0, 40, 33), 0), (rng.integers(0, 40, 1), 4096)]):  # 40 + 8 -> 64
        ref = _per_window(layers, wins, 8192, "numpy")
        got = np.full(8192, SENTINEL, np.uint8)
        pack_windows(layers, wins, got, backend="interpret", config=SMALL)
        np.testing.assert_array_equal(got, ref)
    assert compile_count() == count, compile_log()[-2:]


def test_warm_up_refusals_and_host_path():
    layers = _layers(np.random.default_rng(0), 8, (8,))
    pack = np.zeros(256, np.uint8)
    assert warm_pack_windows(layers, pack, 100) == []  # numpy: the host gather compiles nothing
    for bad in (0, -1, True, 2.0, None):
        with pytest.raises(ValueError, match="max_rows"):
            warm_pack_windows(layers, pack, bad, backend="interpret", config=SMALL)
    for bad in (-4, 3, True):
        with pytest.raises(ValueError, match="offset"):
            warm_pack_windows(layers, pack, 8, backend="interpret", config=SMALL, offset=bad)
    with pytest.raises(ValueError, match="backend"):
        warm_pack_windows(layers, pack, 8, backend="cuda")
    with pytest.raises(ValueError, match="pack must be a 1-D uint8"):
        warm_pack_windows(layers, pack.view(np.uint32), 8, backend="interpret")
    # A pack too small for one row: nothing can ever launch there. A huge max_rows is clamped
    # to what a call can have (one-row windows: one row block per row the pack holds).
    assert warm_pack_windows(layers, np.zeros(4, np.uint8), 16, backend="interpret", config=SMALL) == []
    assert warm_pack_windows(layers, np.zeros(16, np.uint8), 2**70, backend="interpret", config=SMALL) == [8, 16]


def test_buckets_up_to_hand_cases():
    from pallas_kernels.config import bucket_rows, buckets_up_to

    assert buckets_up_to(1, 8) == [8]
    assert buckets_up_to(8, 8) == [8]
    assert buckets_up_to(9, 8) == [8, 16]
    assert buckets_up_to(40, 8) == [8, 16, 32, 64]
    for n in range(1, 300):  # the last is n's own bucket, every one a bucket of some count
        got = buckets_up_to(n, 64)
        assert got[-1] == bucket_rows(n, 64) and got == [bucket_rows(m, 64) for m in got]


def test_warm_direct_refusals_and_host_path():
    """`warm_pack_windows_direct` compiles nothing off a CUDA GPU (host buffers: []) and checks
    its arguments as `warm_pack_windows` does, naming them."""
    from pallas_kernels import warm_pack_windows_direct

    layers = _layers(np.random.default_rng(), 8, (8,))
    pack = np.zeros(256, np.uint8)
    assert warm_pack_windows_direct(layers, pack, 100) == []
    assert warm_pack_windows_direct(PackSource(layers), pack, 1) == []
    for bad in (0, -1, True, 2.0, None):
        with pytest.raises(ValueError, match="max_rows"):
            warm_pack_windows_direct(layers, pack, bad)
    for bad in (-4, 3, True):
        with pytest.raises(ValueError, match="offset"):
            warm_pack_windows_direct(layers, pack, 8, offset=bad)
    with pytest.raises(ValueError, match="pack must be a 1-D uint8"):
        warm_pack_windows_direct(layers, pack.view(np.uint32), 8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=9), st.sampled_from([1, 8, 64, 128]))
def test_windows_bucket_is_window_blocks_m(counts, block_rows):
    """The one formula of a windowed launch's index bucket (what a sender checks before it
    launches a round directly) is the m `window_blocks` lays out."""
    from pallas_kernels.windows import windows_bucket

    assert windows_bucket(counts, block_rows) == window_blocks(counts, [0] * len(counts), block_rows)[2]


def test_windows_bucket_hand_cases():
    from pallas_kernels.windows import windows_bucket

    assert windows_bucket([4096] * 8, 64) == 32768      # the 32k job's round: 8 windows of 4,096 rows
    assert windows_bucket([4097] + [4096] * 7, 64) == 65536  # one row past: the next bucket
    assert windows_bucket([1, 1], 64) == 128             # each window a whole block
    assert windows_bucket([0], 64) == 64                 # an empty window: one (empty) block bucket
    for bad, err, name in [(([-3, 9], 8), ValueError, "counts"), (([2.5], 8), TypeError, "counts"),
                           (("59", 8), TypeError, "counts"), (([5], 0), ValueError, "block_rows"),
                           (([5], 3), ValueError, "block_rows"), (([5], True), TypeError, "block_rows")]:
        with pytest.raises(err, match=name):
            windows_bucket(*bad)


def test_a_host_packer_packs_a_round_in_one_call_and_launches_nothing_directly():
    """The sender's `Packer` on host rows: `warm_up` compiles nothing (no direct bucket), a
    round of eight windows is one call (the thread-pool gather), byte-exact."""
    from dcp_jax.transfer.staging import Packer

    rng = np.random.default_rng()
    layers = _layers(rng, 50, (24, 8))
    pack = np.full(8 * 20 * 32 + 64, SENTINEL, np.uint8)
    packer = Packer(layers, PackSource(layers), pack)
    assert packer.warm_up(1024, window_rows=20) == []
    windows = [(rng.integers(0, 50, 20 - w), w * 20 * 32) for w in range(8)]
    assert not packer.windows_direct(windows)
    assert packer.pack_windows(windows) == 1
    np.testing.assert_array_equal(pack, _per_window(layers, windows, pack.size, "numpy"))
