"""Merge numerics against the float64 oracle: float64 LSEs under x64, underflowed live shards.

- A float64 LSE (``jax_enable_x64``) must be merged in float64 whatever ``out``'s dtype: the
  compute dtype was taken from ``out`` alone, so at |lse| ~ 1e7 (float32 ulp = 1) the weights
  were off by tens of percent. x64 is enabled only inside the tests (``jax.enable_x64``).
- A live shard (finite LSE) whose weight underflows to 0 in float32 (LSE ~104 below the max)
  must still pass its NaN on (``0 * NaN = NaN``, as the oracle); only a non-finite LSE marks an
  empty shard whose NaN ``out`` is ignored. The selection on ``w > 0`` dropped it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dcp_jax.merge import (
    MERGE_FORMS,
    a2a,
    ag_ar,
    ag_rs,
    local_merge_fn,
    make_dcp_mesh,
    merge_state,
    merge_states,
    merge_states_reference,
)
from dcp_jax.merge_core import _merge_core

pytestmark = pytest.mark.needs_8_devices

FORMS = {"ag_rs": ag_rs, "ag_ar": ag_ar, "a2a": a2a}


# ---------------------------------------------------------------- float64 LSEs under x64


def _wide_lse_states(rng, n, t=3, h=4, d=5):
    out = rng.standard_normal((n, t, h, d)).astype(np.float32)
    # Shards a few units apart at 1e7: float32 rounds each LSE to a whole number there.
    lse = 1e7 + rng.uniform(-2.0, 2.0, (n, t, h))
    return out, lse


def _check_wide(o, l, ref_o, ref_l):
    assert l.dtype == np.float64, l.dtype
    # out is float32: ~1 ulp of the result; lse float64 at 1e7: ~2e-9 absolute.
    np.testing.assert_allclose(np.asarray(o, np.float64), ref_o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(l) - 1e7, ref_l - 1e7, rtol=0, atol=1e-7)


def test_tester_repro_merge_state():
    out_a, out_b = np.ones((1, 1, 1), np.float32), np.zeros((1, 1, 1), np.float32)
    lse_a, lse_b = np.array([[1e7 + 0.5]]), np.array([[1e7]])
    with jax.enable_x64(True):
        o, l = merge_state(out_a, lse_a, out_b, lse_b)
        o, l = np.asarray(o), np.asarray(l)
    ref_o, ref_l = merge_states_reference(np.stack([out_a, out_b]), np.stack([lse_a, lse_b]))
    _check_wide(o, l, ref_o, ref_l)  # was 0.5 and 1.0 (the LSEs rounded to 1e7 in float32)


@pytest.mark.parametrize("n", [2, 5])
def test_flat_forms_merge_a_float64_lse_in_float64(n):
    rng = np.random.default_rng()
    out, lse = _wide_lse_states(rng, n)
    ref_o, ref_l = merge_states_reference(out, lse)
    with jax.enable_x64(True):
        o, l = merge_states(out, lse)
        o, l = np.asarray(o), np.asarray(l)
        assert o.dtype == np.float32
        _check_wide(o, l, ref_o, ref_l)
        o_ht, l_ht = merge_states(out, np.swapaxes(lse, 1, 2), lse_layout="HT")
        _check_wide(np.asarray(o_ht), np.asarray(l_ht).T, ref_o, ref_l)
        if n == 2:
            o2, l2 = merge_state(out[0], lse[0], out[1], lse[1])
            _check_wide(np.asarray(o2), np.asarray(l2), ref_o, ref_l)


@pytest.mark.parametrize("form", MERGE_FORMS)
@pytest.mark.parametrize("n", [2, 4])
def test_collective_forms_merge_a_float64_lse_in_float64(form, n):
    rng = np.random.default_rng()
    out, lse = _wide_lse_states(rng, n, h=8)
    ref_o, ref_l = merge_states_reference(out, lse)
    with jax.enable_x64(True):
        o, l = FORMS[form](out, lse, mesh=make_dcp_mesh(n))
        _check_wide(np.asarray(o), np.asarray(l), ref_o, ref_l)


# ---------------------------------------------------------------- underflowed live shards


def _underflow_states(rng, n=4, t=4, h=8, d=3):
    """Shard 1 live but ~120 below the max (weight 0 in float32) with NaN outputs in places;
    shard 2 empty (LSE -inf / +inf / NaN per cell) with NaN outputs everywhere."""
    out = rng.standard_normal((n, t, h, d)).astype(np.float32)
    lse = rng.standard_normal((n, t, h)).astype(np.float32)
    lse[1] = lse[0] - rng.uniform(110.0, 140.0, (t, h)).astype(np.float32)
    nan_cells = rng.random((t, h)) < 0.5
    nan_cells[0, 0] = True
    out[1][nan_cells] = np.nan
    lse[2] = rng.choice(np.array([-np.inf, np.inf, np.nan], np.float32), (t, h))
    out[2] = np.nan
    return out, lse, nan_cells


def _check_underflow(o, l, out, lse, nan_cells):
    o = np.asarray(o, np.float64)
    ref_o, ref_l = merge_states_reference(out, lse)
    assert np.array_equal(np.isnan(ref_o).any(-1), nan_cells)  # the oracle's rule, spelled out
    np.testing.assert_array_equal(np.isnan(o), np.isnan(ref_o))  # was: no NaN at all
    np.testing.assert_allclose(o[~nan_cells], ref_o[~nan_cells], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(l), ref_l, rtol=1e-6, atol=1e-5)


def test_tester_repro_merge_states():
    out = np.zeros((2, 1, 1, 2), np.float32)
    out[1] = np.nan
    lse = np.array([[[0.0]], [[-120.0]]], np.float32)
    o, _ = merge_states(out, lse)
    assert np.isnan(np.asarray(o)).all()  # was [0, 0]
    lse[1] = -np.inf  # the same NaN in an EMPTY shard is still ignored
    np.testing.assert_array_equal(np.asarray(merge_states(out, lse)[0]), 0.0)


@pytest.mark.parametrize("n", [3, 20])  # unrolled sum and the reduction (> 16 shards)
def test_flat_merge_keeps_nan_of_an_underflowed_live_shard(n):
    out, lse, nan_cells = _underflow_states(np.random.default_rng(), n=n)
    o, l = merge_states(out, lse)
    _check_underflow(o, l, out, lse, nan_cells)


def test_inf_out_of_an_underflowed_live_shard_is_not_dropped():
    out, lse, _ = _underflow_states(np.random.default_rng())
    out[1] = np.where(np.isnan(out[1]), np.inf, out[1])
    o = np.asarray(merge_states(out, lse)[0])
    # The oracle's float64 weight (~e^-120) keeps inf; float32's is 0 and 0 * inf is NaN. Either
    # way not finite, where the selection made it a finite number.
    np.testing.assert_array_equal(np.isfinite(o), np.isfinite(merge_states_reference(out, lse)[0]))


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_collective_forms_keep_nan_of_an_underflowed_live_shard(form):
    out, lse, nan_cells = _underflow_states(np.random.default_rng())
    o, l = FORMS[form](out, lse, mesh=make_dcp_mesh(4))
    _check_underflow(o, l, out, lse, nan_cells)


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_propagate_nan_shares_the_rule(form):
    # propagate_nan (the attention forms' merge): -inf is empty (its NaN out ignored), a live
    # underflowed shard's NaN shows, a NaN / +inf LSE poisons the cell.
    rng = np.random.default_rng()
    out, lse, nan_cells = _underflow_states(rng)
    lse[2] = -np.inf
    lse[3, 1, 2] = np.nan
    poisoned = np.zeros_like(nan_cells)
    poisoned[1, 2] = True
    want_nan = nan_cells | poisoned
    local = local_merge_fn(form)
    f = jax.jit(jax.shard_map(
        lambda o, l: local(o[0], l[0], axis_name="dcp", propagate_nan=True),
        mesh=make_dcp_mesh(4), in_specs=(P("dcp"), P("dcp")),
        out_specs=(P(), P()) if form == "ag_ar" else (P(None, "dcp"), P(None, "dcp"))))
    results = [f(out, lse), _merge_core(jnp.asarray(out), jnp.asarray(lse), base="e",
                                        propagate_nan=True)]
    ref_o, ref_l = merge_states_reference(out, np.where(poisoned, -np.inf, lse))
    for o, l in results:
        o, l = np.asarray(o), np.asarray(l)
        np.testing.assert_array_equal(np.isnan(o).any(-1), want_nan)
        np.testing.assert_array_equal(np.isnan(l), poisoned)
        ok = ~want_nan
        np.testing.assert_allclose(o[ok], ref_o[ok], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(l[~poisoned], ref_l[~poisoned], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("lse", [[[[1e39]], [[0.0]]], [[[-1e39]], [[-1e39]]]], ids=["+1e39", "-1e39"])
@pytest.mark.parametrize("as_array", [True, False], ids=["ndarray", "list"])
def test_float64_lse_past_float32_is_refused_without_x64(lse, as_array):
    # Before: narrowed to +-inf, so 1e39 was an empty shard (out = the other shard's) and two
    # -1e39 shards gave out = 0, lse = -inf; only numpy's overflow warning told.
    out = np.random.default_rng().standard_normal((2, 1, 1, 4)).astype(np.float32)
    arg = np.asarray(lse, np.float64) if as_array else lse
    with pytest.raises(ValueError, match=r"^lse holds finite values beyond float32's range \(e.g. -?1e\+39\)"):
        merge_states(out, arg)
    with pytest.raises(ValueError, match=r"^lse_b holds finite values beyond float32's range"):
        merge_state(out[0], np.zeros((1, 1)), out[1], arg[0])
    with jax.enable_x64(True):  # float64 kept: the float64 oracle's lse (log 2 is below 1e39's ulp)
        o, l = merge_states(out, np.asarray(lse, np.float64))
        _, ref_l = merge_states_reference(out, np.asarray(lse, np.float64))
        np.testing.assert_array_equal(np.asarray(l), ref_l)
        if lse[0][0][0] > 0:  # the other shard's weight is exp(-1e39) = 0: out is shard 0's
            np.testing.assert_allclose(np.asarray(o), out[0], rtol=1e-6)


def test_float64_that_rounds_to_float32_max_is_merged_and_longdouble_is_named():
    out = np.random.default_rng().standard_normal((2, 1, 1, 4)).astype(np.float32)
    # 3.4028235e38 is past float32's max as a float64, but rounds to it (finite): merged as is.
    o, l = merge_states(out, np.array([[[3.4028235e38]], [[0.0]]]))
    assert float(l[0, 0]) == float(np.finfo(np.float32).max)
    np.testing.assert_allclose(np.asarray(o)[0, 0], out[0, 0, 0], rtol=1e-6)
    with pytest.raises(ValueError, match=r"^out holds finite values beyond float32's range .* narrow to inf:"):
        merge_states(np.full((2, 1, 1, 4), 1e39), np.zeros((2, 1, 1)))
    with pytest.raises(TypeError, match=r"^lse has dtype float128: JAX takes"):  # was JAX's opaque TypeError
        merge_states(out, np.zeros((2, 1, 1), np.longdouble))

