"""LSE merge and DCP MLA decode attention on the GPU vs float64 references (H200 shapes).

Skipped unless a CUDA device is present (tests/conftest.py skips the ``gpu`` marker).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax.attention import (
    dcp_mla_decode,
    dcp_mla_decode_emulated,
    mla_decode_reference,
    paginate_kv,
)
from dcp_jax.merge import make_dcp_mesh, merge_state, merge_states, merge_states_reference

pytestmark = pytest.mark.gpu

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _gpu():
    return [d for d in jax.devices() if d.platform == "gpu"][0]


def _states(seed, n=8, t=16, h=128, d=512, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    out = rng.standard_normal((n, t, h, d)).astype(np.float32)
    lse = (rng.standard_normal((n, t, h)) * 8).astype(np.float32)
    lse[1] = -np.inf  # an empty rank with garbage output
    out[1] = np.nan
    if n > 2:
        lse[2, :, ::3] = np.nan
    lse[:, 0, 0] = -np.inf  # all-empty cell
    out = jnp.asarray(out, dtype)
    return jax.device_put(out, _gpu()), jax.device_put(jnp.asarray(lse), _gpu())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_merge_on_gpu_matches_float64(dtype):
    out, lse = _states(0, dtype=dtype)
    o, l = merge_states(out, lse)
    assert o.dtype == dtype and list(o.devices())[0].platform == "gpu"
    ref_o, ref_l = merge_states_reference(np.asarray(out, np.float64), np.asarray(lse))
    o = np.asarray(o, np.float64)
    assert not np.isnan(o).any()
    np.testing.assert_allclose(o, ref_o, rtol=TOL[dtype], atol=TOL[dtype])
    np.testing.assert_array_equal(np.isneginf(np.asarray(l)), np.isneginf(ref_l))
    fin = np.isfinite(ref_l)
    np.testing.assert_allclose(np.asarray(l)[fin], ref_l[fin], rtol=1e-6, atol=1e-5)
    assert np.all(o[0, 0] == 0)


def test_two_way_and_base2_on_gpu():
    out, lse = _states(1, n=2, t=8)
    o, l = merge_state(out[0], lse[0] * np.log2(np.e), out[1], lse[1] * np.log2(np.e), base="2")
    ref_o, ref_l = merge_states_reference(np.asarray(out), np.asarray(lse))
    np.testing.assert_allclose(np.asarray(o), ref_o, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("interleave, q_len", [(1, 1), (64, 1), (1, 3)])
def test_dcp_mla_decode_on_gpu(interleave, q_len, dtype):
    # DeepSeek-V3 geometry: H = 128, latent 512 + rope 64, N = 8 ranks emulated on one GPU.
    rng = np.random.default_rng(interleave + q_len)
    n, h, dl, dr, page = 8, 128, 512, 64, 64
    kv_lens = np.array([0, 5, 1000, 2049])
    kv = jnp.asarray(rng.standard_normal((4, 2049, dl + dr)), dtype)
    ql = jnp.asarray(rng.standard_normal((4, q_len, h, dl)), dtype)
    qr = jnp.asarray(rng.standard_normal((4, q_len, h, dr)), dtype)
    cache, pt = paginate_kv(np.asarray(kv), kv_lens, dcp_size=n, page_size=page,
                            interleave_size=interleave, fill=np.nan, shuffle_seed=0)
    scale = 1 / np.sqrt(192)
    gpu = _gpu()
    args = [jax.device_put(x, gpu) for x in (ql, qr, jnp.asarray(cache), jnp.asarray(pt),
                                               jnp.asarray(kv_lens, jnp.int32))]
    o, l = dcp_mla_decode_emulated(*args, softmax_scale=scale, interleave_size=interleave)
    assert list(o.devices())[0].platform == "gpu" and o.dtype == dtype
    ref_o, ref_l = mla_decode_reference(ql, qr, kv, kv_lens, softmax_scale=scale)
    o = np.asarray(o, np.float64)
    assert not np.isnan(o).any()
    tol = TOL[dtype]
    np.testing.assert_allclose(o, ref_o, rtol=tol, atol=tol * np.abs(ref_o).max())
    np.testing.assert_array_equal(o[0], 0.0)
    assert np.all(np.asarray(l)[0] == -np.inf)
    fin = np.isfinite(ref_l)
    np.testing.assert_allclose(np.asarray(l)[fin], ref_l[fin], rtol=tol, atol=tol)


def test_dcp_mla_decode_shard_map_on_all_gpus():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    n = len(gpus)
    rng = np.random.default_rng(5)
    h, dl, dr = 128, 512, 64
    kv_lens = np.array([3, 700])
    kv = rng.standard_normal((2, 700, dl + dr)).astype(np.float32)
    ql = rng.standard_normal((2, 1, h, dl)).astype(np.float32)
    qr = rng.standard_normal((2, 1, h, dr)).astype(np.float32)
    cache, pt = paginate_kv(kv, kv_lens, dcp_size=n, page_size=16, fill=np.nan)
    o, l = dcp_mla_decode(ql, qr, cache, pt, kv_lens, softmax_scale=0.05,
                          mesh=make_dcp_mesh(n, devices=gpus))
    ref_o, _ = mla_decode_reference(ql, qr, kv, kv_lens, softmax_scale=0.05)
    np.testing.assert_allclose(np.asarray(o), ref_o, rtol=1e-5, atol=1e-5 * np.abs(ref_o).max())


def test_torch_crosscheck_on_gpu_is_zero_copy():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    from dcp_jax.crosscheck import crosscheck_merge, edge_case_inputs

    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        out, lse = edge_case_inputs(8, t=64, h=128, d=512, dtype=dtype, device="cuda")
        rep = crosscheck_merge(out, lse)
        assert rep.zero_copy, str(rep)
        assert rep.passed(tol), str(rep)
