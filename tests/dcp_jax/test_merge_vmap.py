"""The mesh merge forms (ag_rs, ag_ar, a2a) under jax.vmap: a leading batch axis that does not
divide by the mesh size equals a Python loop of unbatched calls and the float64 reference."""

import jax
import numpy as np
import pytest

from dcp_jax import merge
from dcp_jax.merge import MERGE_FORMS, make_dcp_mesh, merge_states_reference

pytestmark = pytest.mark.needs_8_devices

BATCH = 3  # divides by neither 2 nor 4


def _states(seed, n, t=5, h=8, d=6):
    rng = np.random.default_rng(seed)
    out = rng.standard_normal((BATCH, n, t, h, d)).astype(np.float32)
    lse = (rng.standard_normal((BATCH, n, t, h)) * 3).astype(np.float32)
    lse[1, 0, 2] = -np.inf  # an empty shard in one batch entry
    out[1, 0, 2] = np.nan
    return out, lse


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("form", MERGE_FORMS)
def test_vmap_equals_a_loop_and_the_reference(form, n):
    out, lse = _states(1000 + n, n)
    mesh = make_dcp_mesh(n)
    f = getattr(merge, form)
    got_o, got_l = jax.vmap(lambda o, l: f(o, l, mesh=mesh))(out, lse)
    assert got_o.shape == (BATCH,) + out.shape[2:] and got_l.shape == (BATCH,) + lse.shape[2:]
    for i in range(BATCH):
        loop_o, loop_l = f(out[i], lse[i], mesh=mesh)
        np.testing.assert_allclose(np.asarray(got_o[i]), np.asarray(loop_o), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got_l[i]), np.asarray(loop_l), rtol=1e-6, atol=1e-6)
        ref_o, ref_l = merge_states_reference(out[i], lse[i])
        np.testing.assert_allclose(np.asarray(got_o[i], np.float64), ref_o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got_l[i], np.float64), ref_l, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("form", MERGE_FORMS)
def test_vmap_other_axis_jit_head_major_base2(form, n):
    # Batch axis in the middle (in_axes=2), under jit, head-major LSE in base 2.
    out, lse = _states(1100 + n, n)
    lse2 = lse * np.log2(np.e)
    lse_ht = np.swapaxes(lse2, 2, 3)  # [BATCH, N, H, T]
    mesh = make_dcp_mesh(n)
    f = getattr(merge, form)
    call = lambda o, l: f(o, l, mesh=mesh, base="2", lse_layout="HT")  # noqa: E731
    got_o, got_l = jax.jit(jax.vmap(call, in_axes=(2, 2)))(np.moveaxis(out, 0, 2),
                                                           np.moveaxis(lse_ht, 0, 2))
    for i in range(BATCH):
        loop_o, loop_l = call(out[i], lse_ht[i])
        np.testing.assert_allclose(np.asarray(got_o[i]), np.asarray(loop_o), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got_l[i]), np.asarray(loop_l), rtol=1e-6, atol=1e-6)
        ref_o, ref_l = merge_states_reference(out[i], lse2[i], base="2")
        np.testing.assert_allclose(np.asarray(got_o[i], np.float64), ref_o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got_l[i], np.float64).T, ref_l, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_unbatched_lse_with_batched_out(form):
    # vmap over out only (in_axes=(0, None)): the LSE is shared by the batch entries.
    out, lse = _states(1200, 4)
    mesh = make_dcp_mesh(4)
    f = getattr(merge, form)
    got_o, got_l = jax.vmap(lambda o: f(o, lse[0], mesh=mesh))(out)
    for i in range(BATCH):
        loop_o, loop_l = f(out[i], lse[0], mesh=mesh)
        np.testing.assert_allclose(np.asarray(got_o[i]), np.asarray(loop_o), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got_l[i]), np.asarray(loop_l), rtol=1e-6, atol=1e-6)
