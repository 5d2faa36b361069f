"""Collective LSE merges (`ag_rs`, `ag_ar`, `a2a`) under shard_map on 8 CPU devices."""

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
    merge_ag_rs,
    merge_states,
    merge_states_reference,
)

pytestmark = pytest.mark.needs_8_devices

FORMS = {"ag_rs": ag_rs, "ag_ar": ag_ar, "a2a": a2a}
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _states(seed, n, t=3, h=16, d=8, dtype=np.float32, n_empty=2):
    rng = np.random.default_rng(seed)
    out = rng.standard_normal((n, t, h, d)).astype(np.float32)
    lse = (rng.standard_normal((n, t, h)) * 5).astype(np.float32)
    # Poison: some whole ranks and some (token, head) cells are empty with NaN outputs.
    for r in rng.choice(n, size=min(n_empty, n - 1), replace=False):
        lse[r] = [-np.inf, np.inf, np.nan][r % 3]
        out[r] = np.nan
    lse[:, 0, 0] = -np.inf
    out[:, 0, 0] = np.nan
    return jnp.asarray(out, dtype=dtype), lse


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("form", MERGE_FORMS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_forms_match_float64_reference(n, form, dtype):
    out, lse = _states(n, n, dtype=dtype)
    o, l = FORMS[form](out, lse, mesh=make_dcp_mesh(n))
    assert o.dtype == dtype and o.shape == (3, 16, 8) and l.shape == (3, 16)
    ref_o, ref_l = merge_states_reference(np.asarray(out, np.float64), lse)
    o = np.asarray(o, np.float64)
    assert not np.isnan(o).any()
    np.testing.assert_allclose(o, ref_o, rtol=TOL[dtype], atol=TOL[dtype])
    np.testing.assert_array_equal(np.isneginf(np.asarray(l)), np.isneginf(ref_l))
    np.testing.assert_allclose(np.asarray(l), ref_l, rtol=1e-6, atol=1e-5)
    assert np.all(o[0, 0] == 0) and np.asarray(l)[0, 0] == -np.inf


@pytest.mark.parametrize("form", ["ag_rs", "a2a"])
def test_rank_r_holds_heads_slice_r(form):
    n, h = 8, 16
    out, lse = _states(1, n, h=h)
    o, l = FORMS[form](out, lse, mesh=make_dcp_mesh(n))
    ref_o, _ = merge_states_reference(np.asarray(out), lse)
    hs = h // n
    shards = sorted(o.addressable_shards, key=lambda s: s.device.id)
    assert len(shards) == n
    for r, s in enumerate(shards):
        assert s.data.shape == (3, hs, 8)
        assert s.index[1] == slice(r * hs, (r + 1) * hs)
        np.testing.assert_allclose(np.asarray(s.data), ref_o[:, r * hs:(r + 1) * hs], rtol=1e-5, atol=1e-5)


def test_ag_ar_is_replicated():
    out, lse = _states(2, 8)
    o, _ = ag_ar(out, lse, mesh=make_dcp_mesh(8))
    full = np.asarray(o)
    for s in o.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), full)


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_collective_equals_flat_merge(form):
    out, lse = _states(3, 8, n_empty=0)
    o_c, l_c = FORMS[form](out, lse, mesh=make_dcp_mesh(8), base="2")
    o_f, l_f = merge_states(out, lse, base="2")
    np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_f), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(l_c), np.asarray(l_f), rtol=1e-6)


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_head_major_lse(form):
    out, lse = _states(4, 4)
    o1, l1 = FORMS[form](out, lse, mesh=make_dcp_mesh(4))
    o2, l2 = FORMS[form](out, np.swapaxes(lse, 1, 2), mesh=make_dcp_mesh(4), lse_layout="HT")
    assert l2.shape == (16, 3)
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o1))
    np.testing.assert_array_equal(np.asarray(l2), np.asarray(l1).T)


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_n1_passes_through_unchanged(form):
    out, lse = _states(5, 1)
    o, l = FORMS[form](out, lse, mesh=make_dcp_mesh(1))
    np.testing.assert_array_equal(np.asarray(o), np.asarray(out[0]))  # NaN stays where it was
    np.testing.assert_array_equal(np.asarray(l), lse[0])


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_local_forms_pass_through_on_a_one_rank_axis(form):
    mesh = make_dcp_mesh(1)
    out, lse = _states(11, 1)
    spec = P(None, "dcp") if form != "ag_ar" else P()
    f = jax.jit(jax.shard_map(lambda o, l: local_merge_fn(form)(o[0], l[0]), mesh=mesh,
                              in_specs=(P("dcp"), P("dcp")), out_specs=(spec, spec)))
    o, l = f(out, lse)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(out[0]))  # NaN stays where it was
    np.testing.assert_array_equal(np.asarray(l), lse[0])


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_heads_not_divisible_raise_before_tracing(form, monkeypatch):
    out, lse = _states(6, 8, h=12)
    import dcp_jax.merge as merge_mod

    def _boom(*a, **k):  # pragma: no cover - must not be reached
        raise AssertionError("shard_map was built before the head check")

    monkeypatch.setattr(merge_mod, "_mesh_merge_fn", _boom)
    with pytest.raises(ValueError, match="H=12.*N=8"):
        FORMS[form](out, lse, mesh=make_dcp_mesh(8))


def test_mesh_errors():
    out, lse = _states(7, 4)
    with pytest.raises(ValueError, match="4 partials.*N=8"):
        ag_rs(out, lse, mesh=make_dcp_mesh(8))
    with pytest.raises(ValueError, match="axis_name"):
        ag_rs(out, lse, mesh=make_dcp_mesh(4), axis_name="tp")
    with pytest.raises(TypeError, match="mesh"):
        ag_rs(out, lse, mesh="dcp")
    with pytest.raises(ValueError, match="base"):
        ag_ar(out, lse, mesh=make_dcp_mesh(4), base="10")
    with pytest.raises(ValueError, match="dcp_size"):
        make_dcp_mesh(0)
    with pytest.raises(ValueError, match="dcp_size"):
        make_dcp_mesh(9)


def test_default_mesh_and_custom_axis_name():
    out, lse = _states(8, 8)
    o1, _ = ag_rs(out, lse)  # mesh built from the first N devices
    o2, _ = ag_rs(out, lse, mesh=make_dcp_mesh(8, axis_name="cp"), axis_name="cp")
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_inside_user_shard_map_on_2d_mesh(form):
    # A (dcp=4, tp=2) mesh: the merge runs over "dcp" only; each tp column merges its own data.
    devs = np.array(jax.devices()).reshape(4, 2)
    mesh = jax.sharding.Mesh(devs, ("dcp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    out, lse = _states(9, 4, h=8)
    out2 = jnp.stack([out, out[::-1]], axis=1)  # [4, 2, T, H, D]: tp column 1 sees reversed ranks
    lse2 = np.stack([lse, lse[::-1]], axis=1)
    local = local_merge_fn(form)
    spec = P("tp", None, "dcp") if form != "ag_ar" else P("tp")  # [tp, T, H(/N), ...]

    def body(o, l):
        res_o, res_l = local(o[0, 0], l[0, 0], axis_name="dcp")
        return res_o[None], res_l[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dcp", "tp"), P("dcp", "tp")),
                              out_specs=(spec, spec)))
    o, l = f(out2, lse2)
    ref_o, ref_l = merge_states_reference(np.asarray(out), lse)
    for col in range(2):
        np.testing.assert_allclose(np.asarray(o)[col], ref_o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(l)[col], ref_l, rtol=1e-6, atol=1e-5)


def test_local_form_rejects_bad_heads_at_trace_time():
    mesh = make_dcp_mesh(8)
    out, lse = _states(10, 8, h=12)
    f = jax.shard_map(lambda o, l: merge_ag_rs(o[0], l[0]), mesh=mesh,
                      in_specs=(P("dcp"), P("dcp")), out_specs=(P(None, "dcp"), P(None, "dcp")))
    with pytest.raises(ValueError, match="H=12"):
        jax.jit(f).trace(out, lse)
    g = jax.shard_map(lambda o, l: merge_ag_rs(o[0, 0], l[0]), mesh=mesh,
                      in_specs=(P("dcp"), P("dcp")), out_specs=(P(None, "dcp"), P(None, "dcp")))
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        jax.jit(g).trace(out, lse)
