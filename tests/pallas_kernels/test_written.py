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


def test_wait_with_a_timeout_and_its_bad_values():
    ticket = written(np.zeros(8, np.uint8))
    assert ticket.wait(0.0) is True and ticket.wait(0.5) is True and ticket.wait() is True
    with pytest.raises(TypeError, match="timeout_s must be a number of seconds or None"):
        ticket.wait("1")
    with pytest.raises(TypeError, match="timeout_s"):
        ticket.wait(True)
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="timeout_s=.* must be >= 0"):
            ticket.wait(bad)


# Found by a fresh user's trial on 2026-12-06: the oracle and the host wait checked nothing.
def test_reference_region_names_the_bad_argument():
    from pallas_kernels import reference_region

    layers = [np.zeros((10, 4), np.uint8), np.ones((10, 2), np.uint8)]
    pack = np.zeros(60, np.uint8)
    assert reference_region(layers, np.array([9, 0]), pack)[:8].tolist() == [0] * 8
    with pytest.raises(ValueError, match=r"indices must be in \[0, 10\)"):
        reference_region(layers, np.array([10]), pack)
    with pytest.raises(ValueError, match="indices must be a 1-D integer array"):
        reference_region(layers, np.array([[1]]), pack)
    with pytest.raises(ValueError, match="pack of 3 bytes cannot hold the region"):
        reference_region(layers, np.array([1, 2]), np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="layers must be a non-empty list"):
        reference_region([], np.array([1]), pack)


def test_synchronize_waits_for_jax_arrays_and_names_junk():
    import jax.numpy as jnp

    from pallas_kernels import synchronize

    synchronize(jnp.zeros(3))
    synchronize([np.zeros(3), jnp.ones(2)])
    for bad in (5, "x", [np.zeros(2), object()]):
        with pytest.raises(TypeError, match=r"arrays\[\d\] must be a numpy, CuPy or JAX array"):
            synchronize(bad)
