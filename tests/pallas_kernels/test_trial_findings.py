"""Regressions from a tester's trial of the public pallas_kernels API (2026-12-06), each failing before."""
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import RowCopier, RowUnpacker
from pallas_kernels.registry import get_backend


@pytest.mark.parametrize("name", ["xla", "tpu-interpret"])
def test_backends_with_int32_offsets_refuse_offsets_past_2_31(name):
    # They raised a bare OverflowError from np.int32(offset) on a >= 2 GiB pack; `auto` picked them.
    b = get_backend(name)
    assert b.unsupported((48, 16), 2**31 - 64) is None
    why = b.unsupported((48, 16), 2**31 + 64)
    assert "offset=2147483712 must be < 2**31" in why and name in why


def test_a_packer_refuses_a_named_int32_backend_for_a_buffer_past_2_31():
    from dcp_jax.transfer.staging import Packer

    rows = [np.zeros((8, 48), np.uint8), np.zeros((8, 16), np.uint8)]
    big = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape=(2**31 + 4096,), strides=(0,))
    with pytest.raises(ValueError, match=r"pack_backend='xla' cannot .* offset=\d+ must be < 2\*\*31"):
        Packer(rows, rows, big, backend="xla")
    Packer(rows, rows, np.zeros(4096, np.uint8), backend="xla")  # a small buffer: fine


@pytest.mark.parametrize("backend", ["numpy", "interpret"])
def test_a_destination_made_read_only_since_is_refused_before_any_layer_is_written(backend):
    dst = [np.zeros((4, 8), np.uint8) for _ in range(3)]
    u = RowUnpacker(np.full(64, 7, np.uint8), dst, backend=backend)
    dst[2].setflags(write=False)
    with pytest.raises(ValueError, match=r"layers\[2\] is read-only now .* nothing was written"):
        u.unpack([1])
    assert not any(d.any() for d in dst)
    src = [np.full((4, 8), 9, np.uint8) for _ in range(3)]
    dst = [np.zeros((4, 8), np.uint8) for _ in range(3)]
    c = RowCopier(src, dst, backend=backend)
    dst[2].setflags(write=False)
    with pytest.raises(ValueError, match=r"dst_layers\[2\] is read-only now"):
        c.copy([0], [1])
    assert not any(d.any() for d in dst)


def test_bucket_rows_and_pow2_chunks_take_numpy_integers():
    assert pk.bucket_rows(np.int64(33)) == pk.bucket_rows(33) == 64
    assert pk.pow2_chunks(np.int64(288)) == ((0, 256), (256, 32))
    for bad in (3.5, None, True, "8"):
        with pytest.raises(TypeError, match="n=.* must be an int"):
            pk.bucket_rows(bad)
