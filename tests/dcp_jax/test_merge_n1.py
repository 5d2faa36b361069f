"""N = 1 on a mesh: the collective forms return the inputs unchanged (spec section 7), unlike
merge_states, which normalises empty shards at every N; the docs say so where they are read."""

import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax import merge
from dcp_jax.merge import MERGE_FORMS, make_dcp_mesh, merge_states_reference

pytestmark = pytest.mark.needs_8_devices

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _with_empty_entries(seed, n, t=4, h=4, d=3):
    rng = np.random.default_rng(seed)
    out = rng.standard_normal((n, t, h, d)).astype(np.float32)
    lse = rng.standard_normal((n, t, h)).astype(np.float32)
    out[0, 1] = np.nan  # shard 0 is empty at token 1: +inf, NaN, -inf LSEs over its heads
    lse[0, 1, :3] = [np.inf, np.nan, -np.inf]
    return out, lse


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_n1_returns_inputs_unchanged_where_merge_states_normalises(form):
    out, lse = _with_empty_entries(1500, 1)
    o, l = getattr(merge, form)(out, lse, mesh=make_dcp_mesh(1))
    np.testing.assert_array_equal(np.asarray(o), out[0])  # NaN out and +inf/NaN lse kept
    np.testing.assert_array_equal(np.asarray(l), lse[0])
    so, sl = merge.merge_states(out, lse)  # the flat form normalises the same single shard
    ref_o, ref_l = merge_states_reference(out, lse)
    assert np.all(np.asarray(so)[1, :3] == 0) and np.all(np.asarray(sl)[1, :3] == -np.inf)
    np.testing.assert_allclose(np.asarray(so, np.float64), ref_o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sl, np.float64), ref_l, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_n1_keeps_the_lse_dtype_n2_gives_float32(form):
    rng = np.random.default_rng(1501)
    f = getattr(merge, form)
    out = jnp.asarray(rng.standard_normal((2, 3, 4, 2)), jnp.bfloat16)
    lse = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.bfloat16)
    assert f(out[:1], lse[:1], mesh=make_dcp_mesh(1))[1].dtype == jnp.bfloat16
    assert f(out, lse, mesh=make_dcp_mesh(2))[1].dtype == jnp.float32


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_n2_drops_the_same_empty_entries(form):
    out, lse = _with_empty_entries(1502, 2)
    o, l = getattr(merge, form)(out, lse, mesh=make_dcp_mesh(2))
    ref_o, ref_l = merge_states_reference(out, lse)
    np.testing.assert_allclose(np.asarray(o, np.float64), ref_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(l, np.float64), ref_l, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(o)[1, :3], out[1, 1, :3], rtol=1e-6)  # shard 1 alone


@pytest.mark.parametrize("name", ["ag_rs", "ag_ar", "a2a", "merge_ag_rs", "merge_ag_ar", "merge_a2a"])
def test_each_collective_docstring_states_the_n1_exception(name):
    doc = " ".join(getattr(merge, name).__doc__.split())
    assert "N = 1" in doc and "unchanged" in doc.lower() and "normalisation" in doc, doc


def test_module_and_readme_state_the_n1_exception():
    mod = " ".join(merge.__doc__.split())
    assert re.search(r"N = 1.*return the inputs unchanged.*N >= 2", mod), mod
    text = " ".join(README.read_text().split())
    para = text[text.index("The merge computes in float32"):text.index("## Disaggregated generation")]
    assert re.search(r"one-device axis \(N = 1\) return `\(out\[0\], lse\[0\]\)` unchanged", para)
    assert "no empty-shard normalisation" in para and "from N = 2 on" in para
