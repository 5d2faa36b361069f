"""`pallas_kernels.written` off the GPU: host buffers are written when a pack returns (their
ticket is ready at once); anything but a numpy or CuPy buffer is refused by name."""
import numpy as np
import pytest

from pallas_kernels import pack_windows, written


def test_a_host_pack_is_ready_when_the_call_returns():
    rng = np.random.default_rng()
    layers = [rng.integers(0, 256, (40, w), dtype=np.uint8) for w in (16, 48)]
    idx = rng.permutation(40)[:9]
    pack = np.zeros(9 * 64, np.uint8)
    pack_windows(layers, [(idx, 0)], pack, sync=False)
    ticket = written(pack)
    assert ticket.ready()
    ticket.wait()
    want = np.concatenate([layers[0][idx].ravel(), layers[1][idx].ravel()])
    np.testing.assert_array_equal(pack, want)


@pytest.mark.parametrize("bad", [[0, 1], b"pack", None, 3])
def test_anything_but_a_numpy_or_cupy_buffer_is_refused(bad):
    with pytest.raises(TypeError, match="buffer must be a numpy or CuPy array"):
        written(bad)
