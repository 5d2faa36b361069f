"""GPU: CuPy pack buffers, DLPack import into JAX, and the Pallas kernel writing in place.

The registered address must hold the packed bytes after each of several packs, the pointer
never changes and no copy is made (pack_rows raises if XLA had to copy).
"""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
jnp = jax.numpy
cp = pytest.importorskip("cupy")

from bridge.buffers import DeviceBuffer  # noqa: E402
from pallas_kernels import GatherConfig, gather_rows, pack_rows  # noqa: E402


def test_device_buffer_fields():
    buf = DeviceBuffer(1 << 20, fill=7)
    assert buf.mem_type == "VRAM" and buf.device_id == 0
    assert buf.nbytes == 1 << 20 and buf.addr == buf.array.data.ptr
    assert int(buf.array[12345]) == 7
    j = buf.as_jax(np.uint32, offset=1024, nbytes=4096)
    assert j.shape == (1024,) and j.unsafe_buffer_pointer() == buf.addr + 1024


def test_dlpack_import_is_zero_copy_and_donation_writes_into_cupy():
    buf = DeviceBuffer(4096 * 4, fill=0)
    j = buf.as_jax(np.uint32)
    assert j.unsafe_buffer_pointer() == buf.addr
    out = jax.jit(lambda x: x.at[:10].set(jnp.uint32(99)), donate_argnums=0)(j)
    out.block_until_ready()
    assert out.unsafe_buffer_pointer() == buf.addr
    assert j.is_deleted()  # the imported handle is consumed: import again per pack
    del out
    assert np.all(cp.asnumpy(buf.view(np.uint32))[:10] == 99)


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_several_packs_in_place(backend):
    rng = np.random.default_rng(11)
    L, R, item = 6, 2048, 1152
    host = [rng.integers(0, 256, (R, item), dtype=np.uint8) for _ in range(L)]
    layers = [cp.asarray(a) for a in host]
    ranks, per_rank = 4, 300
    region = per_rank * L * item
    pack = DeviceBuffer(ranks * region + 4096, fill=0xEE)
    addr = pack.addr
    for step in range(5):
        r = step % ranks
        n = per_rank - 7 * step
        idx = rng.integers(0, R, n)
        wrote = pack_rows(layers, idx, pack.array, offset=r * region, backend=backend,
                          config=GatherConfig(block_rows=32))
        assert wrote == n * L * item
        assert pack.addr == addr and pack.array.data.ptr == addr
        got = cp.asnumpy(pack.array[r * region:r * region + wrote])
        np.testing.assert_array_equal(got, np.concatenate([a[idx].reshape(-1) for a in host]))
    assert np.all(cp.asnumpy(pack.array[ranks * region:]) == 0xEE)


def test_gather_rows_into_imported_pack_keeps_pointer():
    rng = np.random.default_rng(5)
    L, R, W, n = 3, 512, 288, 200
    src = jnp.asarray(rng.integers(0, 2**32, (L, R, W), dtype=np.uint64).astype(np.uint32))
    idx = jnp.asarray(rng.integers(0, R, 256).astype(np.int32))
    buf = DeviceBuffer(L * n * W * 4)
    for _ in range(3):
        out = gather_rows(src, idx, buf.as_jax(np.uint32), n, backend="triton")
        assert out.unsafe_buffer_pointer() == buf.addr
        del out
    got = cp.asnumpy(buf.view(np.uint32))
    np.testing.assert_array_equal(got, np.asarray(jnp.take(src, idx[:n], axis=1)).reshape(-1))
