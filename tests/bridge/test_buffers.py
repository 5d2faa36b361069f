"""CPU: registered host buffers (aligned, addressable, importable into JAX without a copy)."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bridge.buffers import HOST_ALIGN_BYTES, DeviceBuffer, HostBuffer


@pytest.mark.parametrize("nbytes", [1, 63, 64, 1000, 1 << 20])
def test_host_buffer_fields_and_alignment(nbytes):
    buf = HostBuffer(nbytes)
    assert buf.nbytes == nbytes and buf.array.dtype == np.uint8 and buf.array.shape == (nbytes,)
    assert buf.addr % HOST_ALIGN_BYTES == 0 and buf.addr == buf.array.ctypes.data
    assert buf.mem_type == "DRAM" and buf.device_id == 0
    assert np.all(buf.array == 0)
    assert "HostBuffer" in repr(buf) and f"{nbytes:,}" in repr(buf)


def test_fill_and_views_share_memory():
    buf = HostBuffer(4096, fill=0x5A)
    assert np.all(buf.array == 0x5A)
    v = buf.view(np.uint32, (4, 8), offset=64)
    v[1, 2] = 0x01020304
    assert buf.array[64 + 4 * 10: 64 + 4 * 11].tolist() == [4, 3, 2, 1]  # little endian
    assert buf.view().ctypes.data == buf.addr


def test_as_jax_is_zero_copy_when_aligned():
    buf = HostBuffer(1 << 16)
    buf.view(np.uint32)[:] = np.arange(1 << 14, dtype=np.uint32)
    j = buf.as_jax(np.uint32)
    assert j.unsafe_buffer_pointer() == buf.addr  # no copy: 64-B aligned pointer
    np.testing.assert_array_equal(np.asarray(j), np.arange(1 << 14, dtype=np.uint32))
    part = buf.as_jax(np.uint16, offset=128, nbytes=256)
    assert part.shape == (128,) and part.unsafe_buffer_pointer() == buf.addr + 128
    assert jnp.asarray(part).dtype == jnp.uint16 and jax.default_backend() == "cpu"


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"nbytes": 0}, ValueError, "nbytes"), ({"nbytes": -5}, ValueError, "nbytes"),
    ({"nbytes": 1.5}, TypeError, "nbytes"), ({"nbytes": True}, TypeError, "nbytes"),
    ({"nbytes": 8, "fill": 256}, ValueError, "fill"),
    ({"nbytes": 8, "fill": 1.7}, TypeError, "fill"), ({"nbytes": 8, "fill": True}, TypeError, "fill"),
    ({"nbytes": 8, "fill": "5"}, TypeError, "fill"), ({"nbytes": 8, "fill": "x"}, TypeError, "fill"),
    ({"nbytes": 8, "fill": -1}, ValueError, "fill"),
])
def test_host_buffer_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        HostBuffer(**kwargs)


def test_view_range_errors():
    buf = HostBuffer(100)
    with pytest.raises(ValueError, match="exceeds the buffer"):
        buf.view(np.uint8, (101,))
    with pytest.raises(ValueError, match="offset"):
        buf.as_jax(offset=-1)
    with pytest.raises(ValueError, match="multiples of the itemsize"):
        buf.as_jax(np.uint32, offset=2, nbytes=8)
    with pytest.raises(ValueError, match="exceeds the buffer"):
        buf.as_jax(offset=90, nbytes=20)
    with pytest.raises(TypeError, match="nbytes"):
        buf.as_jax(nbytes=1.5)  # used to truncate to 1
    with pytest.raises(TypeError, match="offset"):
        buf.view(offset=True)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy installed")
def test_device_buffer_needs_cupy():
    with pytest.raises(ImportError, match="CuPy"):
        DeviceBuffer(1024)
