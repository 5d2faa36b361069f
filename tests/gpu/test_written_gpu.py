"""GPU: `pallas_kernels.written(pack)` covers the packs enqueued into that buffer and nothing
else on the device: a sender's round waits for its own pack, not for the engine's copies of
earlier rounds that run on other streams of the same process (which `synchronize` waits for).

Run on a CUDA machine: `python -m pytest tests/gpu -q` (skipped without a GPU).
"""

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
cp = pytest.importorskip("cupy")

from pallas_kernels import pack_rows, pack_windows, synchronize, written  # noqa: E402

if jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA GPU (JAX sees none)", allow_module_level=True)

SENTINEL = 0xEE
# One thread spinning on the SM clock: work on another stream that outlasts any pack here.
_SPIN = cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}""", "spin")


def _layers(rows, item_lens, seed):
    rs = cp.random.RandomState(seed)
    return [rs.randint(0, 256, (rows, w), dtype=cp.int32).astype(cp.uint8) for w in item_lens]


def _busy_stream(seconds):
    """A non-blocking stream running a spin of about `seconds`; returns (stream, event after it)."""
    rate = cp.cuda.Device().attributes["ClockRate"] * 1000  # kHz -> Hz
    s = cp.cuda.Stream(non_blocking=True)
    _SPIN((1,), (1,), (np.int64(seconds * rate),), stream=s)
    ev = cp.cuda.Event()
    ev.record(s)
    return s, ev


@pytest.mark.parametrize("form", ["windows", "rows"])
def test_written_waits_for_the_pack_only(form):
    item_lens, rows = (576, 64), 4096
    layers = _layers(rows, item_lens, 3)
    row_bytes = sum(item_lens)
    rng = np.random.default_rng(3)
    idx = [rng.integers(0, rows, n).astype(np.int32) for n in (700, 1300)]
    offs = [0, -(-700 * row_bytes // 64) * 64]
    pack = cp.full(offs[1] + 1300 * row_bytes + 64, SENTINEL, cp.uint8)
    ref = cp.full_like(pack, SENTINEL)
    for i, o in zip(idx, offs):
        pack_rows(layers, i, ref, offset=o)
    synchronize([ref])
    # Compiled before the spin starts (a first call's compile would outlast it), and a ticket
    # outlives the next call's donation of the buffer's handles.
    pack_windows(layers, list(zip(idx, offs)), pack, sync=False)
    old = written(pack)
    pack_rows(layers, idx[0], pack, offset=offs[0], sync=False)
    pack_windows(layers, list(zip(idx, offs)), pack, sync=False)
    old.wait()
    synchronize([pack])
    _, other = _busy_stream(1.0)
    t0 = time.perf_counter()
    if form == "windows":
        pack_windows(layers, list(zip(idx, offs)), pack, sync=False)
    else:
        for i, o in zip(idx, offs):
            pack_rows(layers, i, pack, offset=o, sync=False)
    ticket = written(pack)
    ticket.wait()
    took = time.perf_counter() - t0
    assert ticket.ready()
    assert not other.done, f"the spin ended first ({took:.3f} s): the test proves nothing"
    np.testing.assert_array_equal(cp.asnumpy(pack), cp.asnumpy(ref))
    other.synchronize()


def test_a_ticket_polls_until_the_pack_ends():
    layers = _layers(2048, (1024,), 4)
    idx = np.random.default_rng(4).integers(0, 2048, 2048).astype(np.int32)
    pack = cp.zeros(2048 * 1024, cp.uint8)
    pack_rows(layers, idx, pack, sync=False)
    ticket = written(pack)
    deadline = time.monotonic() + 10
    while not ticket.ready() and time.monotonic() < deadline:
        time.sleep(0.0001)
    assert ticket.ready()
    np.testing.assert_array_equal(cp.asnumpy(pack).reshape(2048, 1024), cp.asnumpy(layers[0])[idx])


def test_a_buffer_no_kernel_wrote_is_ready():
    assert written(cp.zeros(64, cp.uint8)).ready()
