"""GPU: a pack past 2**31 words (8.6 GB of uint32 words), written by `pack_rows` and read back by
`unpack_rows`, byte-exact at the top of the pack (an int32 address would have wrapped negative).

Needs about 14 GB of device memory (layers, the pack, the unpack destinations); marked slow.
"""

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

jax = pytest.importorskip("jax")
cp = pytest.importorskip("cupy")

from pallas_kernels import pack_rows, synchronize, unpack_rows  # noqa: E402

if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (JAX sees none)", allow_module_level=True)


def test_pack_and_unpack_past_2_31_words():
    free, _ = cp.cuda.runtime.memGetInfo()
    if free < 16 << 30:
        pytest.skip(f"needs 16 GiB of free device memory, {free >> 30} GiB free")
    L, R, item, n = 61, 32768, 1152, 4096
    rs = cp.random.RandomState(0)
    layers = [rs.randint(0, 2**31, (R, item // 4), dtype=cp.int32).view(cp.uint8)
              for _ in range(L)]
    region = L * n * item  # 288 MB per rank region
    words = 2**31 + 2**27  # 9.1 GB: past 2**31 uint32 words
    pack = cp.full(words * 4, 0xA5, cp.uint8)
    # Region starting past word 2**31 (byte 2**33): the upper part of the pack.
    offset = (2**31 + 2**20) * 4
    assert offset + region <= pack.nbytes
    rng = np.random.default_rng(1)
    idx = rng.permutation(R)[:n]
    pack_rows(layers, idx, pack, offset=offset)
    idx_cp = cp.asarray(idx)
    want = cp.concatenate([a[idx_cp].ravel() for a in layers])
    assert bool(cp.array_equal(pack[offset:offset + region], want))
    # Bytes around the region keep their poison; so does the low mirror where an int32 address
    # (wrapped by 2**32 words, i.e. 16 GiB) or a signed one would have landed.
    assert bool((pack[offset - 4096:offset] == 0xA5).all())
    assert bool((pack[offset + region:offset + region + 4096] == 0xA5).all())
    low = offset - 2**33  # word offset - 2**31 (a sign flip of the word index)
    assert bool((pack[low:low + region] == 0xA5).all())
    # A second rank at the very top of the pack: its last word is word words - 1.
    top = pack.nbytes - region
    pack_rows(layers, idx[::-1].copy(), pack, offset=top)
    want2 = cp.concatenate([a[idx_cp[::-1]].ravel() for a in layers])
    assert bool(cp.array_equal(pack[top:], want2))
    # unpack_rows reads it back from the top into fresh layers.
    dst = [cp.zeros((R, item), cp.uint8) for _ in range(L)]
    unpack_rows(pack, dst, idx[::-1].copy(), offset=top)
    synchronize(dst)
    for a, d in zip(layers, dst):
        assert bool(cp.array_equal(d[idx_cp], a[idx_cp]))
