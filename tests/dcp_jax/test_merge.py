"""Flat LSE merge (`merge_states`, `merge_state`): spec examples, edge cases, properties."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_jax.merge import merge_state, merge_states, merge_states_reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
# Hypothesis: small fixed shapes (few recompiles), no deadline (first call compiles).
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _random_states(seed, n, t=3, h=4, d=5, *, spread=6.0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    out = rng.standard_normal((n, t, h, d)).astype(dtype)
    lse = (rng.standard_normal((n, t, h)) * spread).astype(np.float32)
    return out, lse


# ---------------------------------------------------------------- spec public examples


def test_spec_example_natural_log():
    o, l = merge_states([[[[2.0, 4.0]]], [[[6.0, 8.0]]]], [[[1.0]], [[2.0]]])
    e = math.e
    w1, w2 = e / (e + e**2), e**2 / (e + e**2)
    np.testing.assert_allclose(np.asarray(o)[0, 0], [2 * w1 + 6 * w2, 4 * w1 + 8 * w2], rtol=1e-6)
    np.testing.assert_allclose(float(l[0, 0]), math.log(e + e**2), rtol=1e-6)


def test_spec_example_base2():
    o, l = merge_states([[[[1.0, 2.0]]], [[[3.0, 4.0]]]], [[[1.0]], [[2.0]]], base="2")
    np.testing.assert_allclose(np.asarray(o)[0, 0], [1 / 3 + 2, 2 / 3 + 8 / 3], rtol=1e-6)
    np.testing.assert_allclose(float(l[0, 0]), math.log2(6), rtol=1e-6)


def test_base2_input_merged_as_natural_log_gives_a_different_answer():
    # The classic bug: FlashInfer (base 2) partials merged with the natural-log formula.
    out, lse_e = _random_states(0, 4)
    lse_2 = lse_e * np.float32(math.log2(math.e))
    right_o, right_l = merge_states(out, lse_2, base="2")
    wrong_o, _ = merge_states(out, lse_2, base="e")
    ref_o, ref_l = merge_states_reference(out, lse_e)
    np.testing.assert_allclose(np.asarray(right_o), ref_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(right_l), ref_l * math.log2(math.e), rtol=1e-5)
    assert np.abs(np.asarray(wrong_o) - ref_o).max() > 1e-2


# ---------------------------------------------------------------- random vs float64 oracle


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_matches_float64_reference(n, dtype):
    out, lse = _random_states(10 + n, n, t=4, h=6, d=8)
    out = jnp.asarray(out, dtype=dtype)
    o, l = merge_states(out, lse)
    assert o.dtype == dtype and l.dtype == jnp.float32
    assert o.shape == (4, 6, 8) and l.shape == (4, 6)
    ref_o, ref_l = merge_states_reference(np.asarray(out, np.float64), lse)
    np.testing.assert_allclose(np.asarray(o, np.float64), ref_o, rtol=TOL[dtype], atol=TOL[dtype])
    np.testing.assert_allclose(np.asarray(l), ref_l, rtol=1e-6, atol=1e-5)


def test_huge_lse_does_not_overflow():
    out, lse = _random_states(1, 3)
    lse = lse + np.float32(3e4)  # exp(3e4) overflows float32 without the max pivot
    o, l = merge_states(out, lse)
    ref_o, ref_l = merge_states_reference(out, lse)
    assert np.isfinite(np.asarray(o)).all()
    np.testing.assert_allclose(np.asarray(o), ref_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(l), ref_l, rtol=1e-6)


def test_head_major_layout_is_the_transpose():
    out, lse = _random_states(2, 4)
    o_th, l_th = merge_states(out, lse)
    o_ht, l_ht = merge_states(out, np.swapaxes(lse, 1, 2), lse_layout="HT")
    assert l_ht.shape == (4, 3)
    np.testing.assert_array_equal(np.asarray(o_ht), np.asarray(o_th))
    np.testing.assert_array_equal(np.asarray(l_ht), np.asarray(l_th).T)


def test_two_way_matches_n_way():
    out, lse = _random_states(3, 2, spread=20.0)
    o2, l2 = merge_state(out[0], lse[0], out[1], lse[1])
    on, ln = merge_states(out, lse)
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(on))
    np.testing.assert_array_equal(np.asarray(l2), np.asarray(ln))
    o2h, l2h = merge_state(out[0], lse[0].T, out[1], lse[1].T, base="2", lse_layout="HT")
    onh, lnh = merge_states(out, lse, base="2")
    np.testing.assert_array_equal(np.asarray(o2h), np.asarray(onh))
    np.testing.assert_array_equal(np.asarray(l2h), np.asarray(lnh).T)


def test_works_under_jit():
    out, lse = _random_states(4, 3)
    o, l = jax.jit(lambda a, b: merge_states(a, b, base="2"))(out, lse)
    ro, rl = merge_states_reference(out, lse, base="2")
    np.testing.assert_allclose(np.asarray(o), ro, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(l), rl, rtol=1e-6)


# ---------------------------------------------------------------- empty shards


@pytest.mark.parametrize("empty_lse", [-np.inf, np.inf, np.nan], ids=["-inf", "+inf", "nan"])
def test_empty_shard_with_nan_output_contributes_zero(empty_lse):
    out, lse = _random_states(5, 4)
    out_poison, lse_poison = out.copy(), lse.copy()
    out_poison[1] = np.nan
    lse_poison[1] = empty_lse
    o, l = merge_states(out_poison, lse_poison)
    ro, rl = merge_states(np.delete(out, 1, axis=0), np.delete(lse, 1, axis=0))
    assert not np.isnan(np.asarray(o)).any()
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(l), np.asarray(rl), rtol=1e-6)


@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_all_empty_gives_zero_and_minus_inf(dtype, base):
    out = jnp.full((3, 2, 4, 5), jnp.nan, dtype=dtype)
    lse = np.array([-np.inf, np.inf, np.nan], np.float32)[:, None, None] * np.ones((3, 2, 4), np.float32)
    o, l = merge_states(out, lse, base=base)
    assert o.dtype == dtype
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.zeros((2, 4, 5), np.float32))
    assert np.all(np.asarray(l) == -np.inf)


def test_mixed_empty_per_token_and_head():
    out, lse = _random_states(6, 3)
    lse[:, 0, 0] = -np.inf  # (t=0, h=0) empty everywhere
    lse[0, 1, :] = np.nan  # shard 0 empty for token 1
    lse[2, 2, 3] = np.inf
    out[np.broadcast_to(~np.isfinite(lse)[..., None], out.shape)] = np.nan
    o, l = merge_states(out, lse)
    ro, rl = merge_states_reference(out, lse)
    assert not np.isnan(np.asarray(o)).any()
    np.testing.assert_allclose(np.asarray(o), ro, rtol=1e-5, atol=1e-6)
    assert np.asarray(l)[0, 0] == -np.inf and np.all(np.asarray(o)[0, 0] == 0)
    np.testing.assert_allclose(np.asarray(l), rl, rtol=1e-6)


def test_single_shard_cleans_empty_entries():
    out, lse = _random_states(7, 1)
    lse[0, 0, 1] = -np.inf
    out[0, 0, 1] = np.nan
    o, l = merge_states(out, lse)
    np.testing.assert_array_equal(np.asarray(o)[0, 1], 0.0)
    np.testing.assert_allclose(np.asarray(o)[1:], out[0, 1:], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l)[1:], lse[0, 1:], rtol=1e-6)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"base": "10"}, ValueError, "base"),
        ({"base": 10}, ValueError, "base"),
        ({"lse_layout": "XY"}, ValueError, "lse_layout"),
    ],
)
def test_bad_knobs(kwargs, exc, match):
    out, lse = _random_states(8, 2)
    with pytest.raises(exc, match=match):
        merge_states(out, lse, **kwargs)


def test_base_accepts_int_2():
    out, lse = _random_states(8, 2)
    np.testing.assert_array_equal(np.asarray(merge_states(out, lse, base=2)[0]),
                                  np.asarray(merge_states(out, lse, base="2")[0]))


def test_bad_shapes_and_dtypes():
    out, lse = _random_states(9, 2)
    with pytest.raises(ValueError, match="out"):
        merge_states(out[0], lse)
    with pytest.raises(ValueError, match="lse"):
        merge_states(out, lse[0])
    with pytest.raises(ValueError, match="lse.shape"):
        merge_states(out, lse[:, :, :2])
    with pytest.raises(ValueError, match="lse.shape"):
        merge_states(out, np.swapaxes(lse, 1, 2))  # head-major without saying so
    with pytest.raises(ValueError, match="at least one"):
        merge_states(out[:0], lse[:0])
    with pytest.raises(TypeError, match="out"):
        merge_states(out.astype(np.int32), lse)
    with pytest.raises(TypeError, match="lse"):
        merge_states(out, lse.astype(np.int32))
    with pytest.raises(TypeError, match="out"):
        merge_states("abc", lse)
    with pytest.raises(ValueError, match="out_a and out_b"):
        merge_state(out[0], lse[0], out[1, :, :2], lse[1])
    with pytest.raises(ValueError, match="out_a and out_b"):
        merge_state(out[0], lse[0], out[1].astype(np.float16), lse[1])
    with pytest.raises(ValueError, match="lse_a and lse_b"):
        merge_state(out[0], lse[0], out[1], lse[1, :2])


# ---------------------------------------------------------------- hypothesis properties

_N = 5  # fixed shapes keep recompilation out of the property loop


@st.composite
def _states(draw, n=_N):
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.sampled_from([0.5, 5.0, 50.0]))
    out, lse = _random_states(seed, n, t=2, h=3, d=4, spread=spread)
    empties = draw(st.lists(st.sampled_from([None, -np.inf, np.inf, np.nan]), min_size=n, max_size=n))
    for r, e in enumerate(empties):
        if e is not None:
            lse[r] = e
            out[r] = np.nan
    return out, lse


@PROPS
@given(_states(), st.permutations(range(_N)))
def test_prop_shard_order_invariant(states, perm):
    out, lse = states
    o1, l1 = merge_states(out, lse)
    o2, l2 = merge_states(out[list(perm)], lse[list(perm)])
    np.testing.assert_allclose(np.asarray(o2), np.asarray(o1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=1e-6, atol=1e-6)


@st.composite
def _tree(draw, leaves):
    """A random binary merge tree over the given leaf ids."""
    if len(leaves) == 1:
        return leaves[0]
    k = draw(st.integers(1, len(leaves) - 1))
    return (draw(_tree(leaves[:k])), draw(_tree(leaves[k:])))


def _merge_tree(tree, out, lse):
    if isinstance(tree, int):
        return jnp.asarray(out[tree]), jnp.asarray(lse[tree])
    oa, la = _merge_tree(tree[0], out, lse)
    ob, lb = _merge_tree(tree[1], out, lse)
    return merge_state(oa, la, ob, lb)


@PROPS
@given(_states(), st.permutations(range(_N)).flatmap(lambda p: _tree(list(p))))
def test_prop_tree_order_equals_flat(states, tree):
    out, lse = states
    o_flat, l_flat = merge_states(out, lse)
    o_tree, l_tree = _merge_tree(tree, out, lse)
    np.testing.assert_allclose(np.asarray(o_tree), np.asarray(o_flat), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(l_tree), np.asarray(l_flat), rtol=1e-6, atol=1e-5)


@PROPS
@given(_states(n=_N - 1), st.integers(0, _N - 1), st.sampled_from([-np.inf, np.inf, np.nan]),
       st.sampled_from([np.nan, np.inf, 1e30]))
def test_prop_empty_shard_is_identity(states, pos, empty_lse, garbage):
    out, lse = states
    out_e = np.insert(out, pos, np.float32(garbage), axis=0)
    lse_e = np.insert(lse, pos, np.float32(empty_lse), axis=0)
    o1, l1 = merge_states(out, lse)
    o2, l2 = merge_states(out_e, lse_e)
    np.testing.assert_allclose(np.asarray(o2), np.asarray(o1), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.isneginf(np.asarray(l2)), np.isneginf(np.asarray(l1)))
    np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=1e-6, atol=1e-6)  # lse near 0


@PROPS
@given(_states())
def test_prop_nan_in_empty_shard_never_leaks(states):
    out, lse = states
    o, l = merge_states(out, lse)
    assert not np.isnan(np.asarray(o)).any()
    assert not np.isnan(np.asarray(l)).any() and not np.isposinf(np.asarray(l)).any()
    ro, rl = merge_states_reference(out, lse)
    np.testing.assert_allclose(np.asarray(o), ro, rtol=1e-5, atol=1e-5)


def test_docstring_examples_run():
    import doctest

    import dcp_jax.merge as merge_mod

    res = doctest.testmod(merge_mod)
    assert res.attempted > 0 and res.failed == 0


def test_merge_state_keeps_a_float64_lse_wide_like_merge_states():
    # Before: merge_state narrowed the LSEs to float32 before the weights, so two LSEs 1e-6 apart
    # at 1e6 merged to 1e6 + 0.6875 where merge_states (and the float64 reference) give ln 2.
    rng = np.random.default_rng()
    o = rng.standard_normal((2, 3, 2, 4))
    l = 1e6 + rng.uniform(0, 4e-6, (2, 3, 2))
    with jax.enable_x64(True):
        o2, l2 = merge_state(o[0], l[0], o[1], l[1])
        on, ln = merge_states(o, l)
        assert l2.dtype == np.float64 and o2.dtype == np.float64
        np.testing.assert_array_equal(np.asarray(l2), np.asarray(ln))
        np.testing.assert_array_equal(np.asarray(o2), np.asarray(on))
    ref_o, ref_l = merge_states_reference(o, l)
    np.testing.assert_allclose(np.asarray(l2) - 1e6, ref_l - 1e6, rtol=0, atol=1e-9)
    np.testing.assert_allclose(np.asarray(o2), ref_o, rtol=1e-9, atol=1e-9)  # float64 at 1e6: ~2e-10 per lse
