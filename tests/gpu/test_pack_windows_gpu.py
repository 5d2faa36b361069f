"""GPU: the one-launch forms of issue 13 on CuPy buffers, byte-exact against the per-call forms.

- `pack_windows` (every window of a sender round in one kernel launch) against `pack_rows` once
  per window, with a sentinel everywhere else in the pack;
- `unpack_rows` into layers that are back-to-back views of one buffer (the one-destination form)
  against the same rows unpacked into separate layers.

Run on a CUDA machine: `python -m pytest tests/gpu -q` (skipped without a GPU). Not yet run on a
GPU: its bodies passed on the CPU with numpy buffers and the interpret backend standing in for
CuPy and Triton (2026-12-02).
"""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from pallas_kernels import pack_rows, pack_windows, synchronize, unpack_rows  # noqa: E402

SENTINEL = 0xA5


def _layers(rows, item_lens, seed):
    rs = cp.random.RandomState(seed)
    return [rs.randint(0, 256, (rows, w), dtype=cp.int32).astype(cp.uint8) for w in item_lens]


@pytest.mark.parametrize("item_lens", [(1152,) * 4, (656, 1152, 576), (6, 10)], ids=str)
@pytest.mark.parametrize("counts", [(1, 77, 300), (0, 129, 0, 31)], ids=str)
def test_pack_windows_equals_pack_rows_per_window(item_lens, counts):
    rows = 512
    layers = _layers(rows, item_lens, sum(counts))
    rng = np.random.default_rng(len(item_lens) + sum(counts))
    row_bytes = sum(item_lens)
    align = 64 if all(w % 16 == 0 for w in item_lens) else 2
    windows, pos = [], 256
    for n in counts:  # regions in order, with gaps a sentinel must survive in
        windows.append((rng.integers(0, rows, n).astype(np.int32), pos))
        pos += -(-(n * row_bytes + 96) // align) * align
    pack = cp.full(pos + 512, SENTINEL, cp.uint8)
    ptr = pack.data.ptr
    assert pack_windows(layers, windows, pack, backend="triton") == sum(counts) * row_bytes
    ref = cp.full(pos + 512, SENTINEL, cp.uint8)
    for idx, off in windows:
        pack_rows(layers, idx, ref, offset=off, backend="triton")
    synchronize([pack, ref])
    assert pack.data.ptr == ptr  # written in place
    np.testing.assert_array_equal(cp.asnumpy(pack), cp.asnumpy(ref))


@pytest.mark.parametrize("item_lens", [(1152, 1152, 576), (6, 10)], ids=str)
def test_unpack_into_one_buffer_equals_separate_layers(item_lens):
    rows, n, offset = 300, 257, 64
    src = _layers(rows, item_lens, 5)
    idx = np.random.default_rng(5).permutation(rows)[:n]
    pack = cp.full(offset + n * sum(item_lens) + 64, SENTINEL, cp.uint8)
    pack_rows(src, idx, pack, offset=offset)
    buf = cp.full(rows * sum(item_lens), 0x5A, cp.uint8)
    one, pos = [], 0
    for w in item_lens:  # back-to-back views of one buffer: the one-destination form
        one.append(buf[pos:pos + rows * w].reshape(rows, w))
        pos += rows * w
    separate = [cp.full((rows, w), 0x5A, cp.uint8) for w in item_lens]
    unpack_rows(pack, one, idx, offset=offset)
    unpack_rows(pack, separate, idx, offset=offset)
    synchronize(one + separate)
    for a, b in zip(one, separate):
        assert bool(cp.array_equal(a, b))
    rest = np.setdiff1d(np.arange(rows), idx)
    assert all(bool((a[cp.asarray(rest)] == 0x5A).all()) for a in one)  # no other row touched
