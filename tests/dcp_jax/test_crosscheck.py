"""Our merge vs the in-project PyTorch DCP combine (vLLM / sglang conventions), via DLPack."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dcp_jax import crosscheck  # noqa: E402
from dcp_jax.crosscheck import (  # noqa: E402
    FORMS,
    crosscheck_merge,
    edge_case_inputs,
    from_torch,
    torch_ag_rs_reference,
    torch_merge_reference,
)
from dcp_jax.merge import merge_states_reference  # noqa: E402

EIGHT = len(jax.devices()) == 8
needs8 = pytest.mark.skipif(not EIGHT, reason="collective forms need 8 devices (tests/conftest.py)")


def _random(seed, n=8, t=5, h=16, d=8, spread=5.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(n, t, h, d, generator=g).to(dtype)
    lse = torch.randn(n, t, h, generator=g) * spread
    return out, lse


def _forms():
    return [pytest.param(f, marks=needs8) if f != "flat" else f for f in FORMS]


@pytest.mark.parametrize("form", _forms())
@pytest.mark.parametrize("seed, spread", [(0, 1.0), (1, 5.0), (2, 20.0)])
def test_random_float32_agrees_within_1e6(form, seed, spread):
    out, lse = _random(seed, spread=spread)
    rep = crosscheck_merge(out, lse, form=form)
    assert rep.passed(1e-6), str(rep)
    assert rep.max_rel_err <= 1e-6 and rep.nan_count == 0


@pytest.mark.parametrize("form", _forms())
def test_edge_cases_float32_agree_within_1e6(form):
    out, lse = edge_case_inputs(8, seed=3)
    rep = crosscheck_merge(out, lse, form=form)
    assert rep.passed(1e-6), str(rep)
    assert rep.lse_inf_mismatch == 0 and rep.nan_count == 0


@pytest.mark.parametrize("form", _forms())
def test_bfloat16_agrees_within_1e2(form):
    out, lse = edge_case_inputs(8, seed=4, dtype=torch.bfloat16)
    rep = crosscheck_merge(out, lse, form=form)
    assert rep.dtype == "bfloat16"
    assert rep.passed(1e-2), str(rep)


def test_base2_inputs():
    out, lse = _random(5)
    rep = crosscheck_merge(out, lse * math.log2(math.e), base="2")
    assert rep.passed(1e-6), str(rep)


def test_flat_merge_with_heads_not_divisible():
    out, lse = _random(6, n=3, h=5)
    rep = crosscheck_merge(out, lse)
    assert rep.passed(1e-6), str(rep)


def test_torch_reference_matches_float64_oracle():
    out, lse = edge_case_inputs(8, seed=7)
    ro, rl = torch_merge_reference(out, lse)
    fo, fl = merge_states_reference(out.double().numpy(), lse.double().numpy())
    np.testing.assert_allclose(ro.double().numpy(), fo, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.isneginf(rl.numpy()), np.isneginf(fl))
    fin = np.isfinite(fl)
    np.testing.assert_allclose(rl.double().numpy()[fin], fl[fin], rtol=1e-6)


def test_torch_ag_rs_slices_heads():
    out, lse = _random(8, n=4, h=8)
    parts = torch_ag_rs_reference(out, lse)
    full_o, full_l = torch_merge_reference(out, lse)
    assert len(parts) == 4
    for r, (o, l) in enumerate(parts):
        assert tuple(o.shape) == (5, 2, 8) and tuple(l.shape) == (5, 2)
        torch.testing.assert_close(o, full_o[:, 2 * r:2 * r + 2], rtol=0, atol=0)
        torch.testing.assert_close(l, full_l[:, 2 * r:2 * r + 2], rtol=0, atol=0)
    with pytest.raises(ValueError, match="H=8.*N=3"):
        torch_ag_rs_reference(out[:3], lse[:3])


def test_dlpack_view_is_zero_copy_and_handles_views():
    out, _ = _random(9)
    view = from_torch(out)
    assert view.unsafe_buffer_pointer() == out.data_ptr()
    np.testing.assert_array_equal(np.asarray(view), out.numpy())
    t = torch.randn(6, 4).t()  # non-contiguous: made contiguous, then viewed
    np.testing.assert_array_equal(np.asarray(from_torch(t)), t.numpy())
    assert crosscheck_merge(*_random(9)).zero_copy


def test_catches_a_merge_that_multiplies_by_zero(monkeypatch):
    # The classic bug: exp(-inf) * NaN = NaN leaks from an empty shard. The cross-check flags it.
    def naive_merge(out, lse, *, base="e"):
        m = jnp.max(lse, axis=0)
        w = jnp.exp(lse - m)
        return jnp.sum(w[..., None] * out, axis=0) / jnp.sum(w, axis=0)[..., None], m

    monkeypatch.setattr(crosscheck._merge, "merge_states", naive_merge)
    out, lse = edge_case_inputs(8, seed=10)
    rep = crosscheck_merge(out, lse)
    assert not rep.passed(1e-6) and rep.nan_count > 0


def test_bad_inputs():
    out, lse = _random(11)
    with pytest.raises(TypeError, match="torch.Tensor"):
        crosscheck_merge(out.numpy(), lse)
    with pytest.raises(ValueError, match="form"):
        crosscheck_merge(out, lse, form="psum")
    with pytest.raises(ValueError, match="base"):
        crosscheck_merge(out, lse, base="10")
    with pytest.raises(ValueError, match="lse.shape"):
        crosscheck_merge(out, lse[:, :, :3])
    with pytest.raises(TypeError, match="floating"):
        crosscheck_merge(out.to(torch.int32), lse)
    with pytest.raises(TypeError, match="torch.Tensor"):
        from_torch(np.zeros(3))
