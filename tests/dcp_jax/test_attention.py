"""DCP decode attention (MLA absorbed, GQA/MHA) on 8 CPU devices vs float64 full-KV attention."""

import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax import layout
from dcp_jax.attention import (
    dcp_gqa_decode,
    dcp_gqa_decode_emulated,
    dcp_mla_decode,
    dcp_mla_decode_emulated,
    gqa_decode_reference,
    local_kv_lens,
    mla_decode_reference,
    paginate_kv,
)
from dcp_jax.merge import MERGE_FORMS, make_dcp_mesh

pytestmark = pytest.mark.needs_8_devices

N = 8
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _mla_inputs(seed, kv_lens, *, q_len=1, h=16, dl=32, dr=8, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    b, s = len(kv_lens), max(1, max(kv_lens))
    ql = jnp.asarray(rng.standard_normal((b, q_len, h, dl)), dtype)
    qr = jnp.asarray(rng.standard_normal((b, q_len, h, dr)), dtype)
    kv = jnp.asarray(rng.standard_normal((b, s, dl + dr)), dtype)
    return ql, qr, kv, np.asarray(kv_lens)


def _check(out, lse, ref_o, ref_l, dtype):
    out = np.asarray(out, np.float64)
    lse = np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    tol = TOL[dtype]
    # Relative to the output scale (outputs are convex mixes of unit-normal values).
    np.testing.assert_allclose(out, ref_o, rtol=tol, atol=tol * max(1.0, np.abs(ref_o).max()))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_l))
    fin = np.isfinite(ref_l)
    np.testing.assert_allclose(lse[fin], ref_l[fin], rtol=tol, atol=tol)


# ---------------------------------------------------------------- MLA, the spec's contract


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("interleave", [1, 4, 3], ids=lambda i: f"I={i}")
def test_mla_matches_full_kv_attention(interleave, dtype):
    # Lengths: L=0 (padding slot), L < N (empty ranks), L = 1, a partial block, a long one.
    kv_lens = [0, 3, 1, 8, 129]
    ql, qr, kv, kv_lens = _mla_inputs(interleave, kv_lens, dtype=dtype)
    scale = 1 / np.sqrt(40)
    cache, pt = paginate_kv(np.asarray(kv), kv_lens, dcp_size=N, page_size=4,
                            interleave_size=interleave, fill=np.nan, shuffle_seed=0)
    out, lse = dcp_mla_decode(ql, qr, cache, pt, kv_lens, softmax_scale=scale,
                              mesh=make_dcp_mesh(N), interleave_size=interleave)
    assert out.dtype == dtype and out.shape == (5, 1, 16, 32) and lse.shape == (5, 1, 16)
    ref_o, ref_l = mla_decode_reference(ql, qr, kv, kv_lens, softmax_scale=scale)
    _check(out, lse, ref_o, ref_l, dtype)
    # L = 0: exactly zero output and -inf LSE.
    np.testing.assert_array_equal(np.asarray(out, np.float32)[0], 0.0)
    assert np.all(np.asarray(lse)[0] == -np.inf)


@pytest.mark.parametrize("form", MERGE_FORMS)
def test_mla_every_merge_form(form):
    ql, qr, kv, kv_lens = _mla_inputs(1, [5, 33, 64])
    cache, pt = paginate_kv(np.asarray(kv), kv_lens, dcp_size=N, page_size=8, interleave_size=8,
                            fill=np.nan, shuffle_seed=1, extra_pages=2)
    out, lse = dcp_mla_decode(ql, qr, cache, pt, kv_lens, softmax_scale=0.2,
                              mesh=make_dcp_mesh(N), interleave_size=8, merge=form)
    ref_o, ref_l = mla_decode_reference(ql, qr, kv, kv_lens, softmax_scale=0.2)
    _check(out, lse, ref_o, ref_l, jnp.float32)
    if form != "ag_ar":
        shards = sorted(out.addressable_shards, key=lambda s: s.device.id)
        assert [s.data.shape[2] for s in shards] == [2] * N  # rank r holds heads [2r, 2r+2)


def test_mla_deepseek_dims_512_plus_64():
    ql, qr, kv, kv_lens = _mla_inputs(2, [1, 77, 200], h=8, dl=512, dr=64)
    scale = 1 / np.sqrt(192)
    cache, pt = paginate_kv(np.asarray(kv), kv_lens, dcp_size=N, page_size=16, fill=np.nan,
                            shuffle_seed=2)
    out, lse = dcp_mla_decode(ql, qr, cache, pt, kv_lens, softmax_scale=scale, mesh=make_dcp_mesh(N))
    ref_o, ref_l = mla_decode_reference(ql, qr, kv, kv_lens, softmax_scale=scale)
    _check(out, lse, ref_o, ref_l, jnp.float32)


@pytest.mark.parametrize("interleave", [1, 2])
def test_mla_speculative_verify_queries_see_their_own_prefix(interleave):
    # Q = 3 query tokens per request: query j of history L sees local_len(L + j + 1, r).
    q_len = 3
    ql, qr, kv, kv_lens = _mla_inputs(3, [3, 4, 10, 19], q_len=q_len)
    cache, pt = paginate_kv(np.asarray(kv), kv_lens, dcp_size=N, page_size=2,
                            interleave_size=interleave, fill=np.nan, shuffle_seed=3)
    out, lse = dcp_mla_decode(ql, qr, cache, pt, kv_lens, softmax_scale=0.3,
                              mesh=make_dcp_mesh(N), interleave_size=interleave)
    ref_o, ref_l = mla_decode_reference(ql, qr, kv, kv_lens, softmax_scale=0.3)
    _check(out, lse, ref_o, ref_l, jnp.float32)
    # A shifted final length (every query sees all kv_lens tokens) is a different answer.
    shifted = np.stack([mla_decode_reference(ql[:, j:j + 1], qr[:, j:j + 1], kv, kv_lens,
                                             softmax_scale=0.3)[0][:, 0] for j in range(q_len)], 1)
    assert np.abs(np.asarray(out)[:, 0] - shifted[:, 0]).max() > 1e-3


def test_mla_emulated_equals_sharded():
    ql, qr, kv, kv_lens = _mla_inputs(4, [0, 2, 9, 40], q_len=2)
    cache, pt = paginate_kv(np.asarray(kv), kv_lens, dcp_size=N, page_size=4, interleave_size=2,
                            fill=np.nan, shuffle_seed=4)
    a_o, a_l = dcp_mla_decode(ql, qr, cache, pt, kv_lens, softmax_scale=0.25,
                              mesh=make_dcp_mesh(N), interleave_size=2)
    e_o, e_l = dcp_mla_decode_emulated(ql, qr, cache, pt, kv_lens, softmax_scale=0.25,
                                       interleave_size=2)
    np.testing.assert_allclose(np.asarray(e_o), np.asarray(a_o), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(e_l), np.asarray(a_l), rtol=1e-6, atol=1e-6)
    ref_o, ref_l = mla_decode_reference(ql, qr, kv, kv_lens, softmax_scale=0.25)
    _check(e_o, e_l, ref_o, ref_l, jnp.float32)


def test_mla_shared_page_table_sglang_convention():
    ql, qr, kv, kv_lens = _mla_inputs(8, [2, 9, 31], q_len=2)
    cache, pt = paginate_kv(np.asarray(kv), kv_lens, dcp_size=N, page_size=4, fill=np.nan,
                            shuffle_seed=8, shared_page_table=True)
    assert pt.shape == (3, 1)  # ceil(max local_len 4 / 4) pages, same ids on every rank
    out, lse = dcp_mla_decode(ql, qr, cache, pt, kv_lens, softmax_scale=0.3, mesh=make_dcp_mesh(N))
    ref_o, ref_l = mla_decode_reference(ql, qr, kv, kv_lens, softmax_scale=0.3)
    _check(out, lse, ref_o, ref_l, jnp.float32)
    e_o, _ = dcp_mla_decode_emulated(ql, qr, cache, pt, kv_lens, softmax_scale=0.3)
    np.testing.assert_allclose(np.asarray(e_o), np.asarray(out), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", MERGE_FORMS)
@pytest.mark.parametrize("n", [1, 2])
def test_mla_smaller_dcp_group(n, form):
    ql, qr, kv, kv_lens = _mla_inputs(5, [0, 1, 6, 17], h=4)
    cache, pt = paginate_kv(np.asarray(kv), kv_lens, dcp_size=n, page_size=4, fill=np.nan)
    out, lse = dcp_mla_decode(ql, qr, cache, pt, kv_lens, softmax_scale=0.3, mesh=make_dcp_mesh(n),
                              merge=form)
    ref_o, ref_l = mla_decode_reference(ql, qr, kv, kv_lens, softmax_scale=0.3)
    _check(out, lse, ref_o, ref_l, jnp.float32)


# ---------------------------------------------------------------- GQA / MHA


@pytest.mark.parametrize("hkv", [1, 4, 16], ids=lambda k: f"Hkv={k}")
def test_gqa_matches_full_kv_attention(hkv):
    rng = np.random.default_rng(hkv)
    kv_lens = np.array([0, 5, 23])
    b, q_len, h, d, dv = 3, 2, 16, 8, 12
    q = rng.standard_normal((b, q_len, h, d)).astype(np.float32)
    k = rng.standard_normal((b, 23, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, 23, hkv, dv)).astype(np.float32)
    kc, pt = paginate_kv(k, kv_lens, dcp_size=N, page_size=2, interleave_size=2, fill=np.nan,
                         shuffle_seed=7)
    vc, pt_v = paginate_kv(v, kv_lens, dcp_size=N, page_size=2, interleave_size=2, fill=np.nan,
                           shuffle_seed=7)
    np.testing.assert_array_equal(pt, pt_v)
    out, lse = dcp_gqa_decode(q, kc, vc, pt, kv_lens, softmax_scale=d**-0.5, mesh=make_dcp_mesh(N),
                              interleave_size=2)
    ref_o, ref_l = gqa_decode_reference(q, k, v, kv_lens, softmax_scale=d**-0.5)
    _check(out, lse, ref_o, ref_l, jnp.float32)
    e_o, _ = dcp_gqa_decode_emulated(q, kc, vc, pt, kv_lens, softmax_scale=d**-0.5, interleave_size=2)
    np.testing.assert_allclose(np.asarray(e_o), np.asarray(out), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- layout helpers, brute force


@pytest.mark.parametrize("n, i", [(1, 1), (3, 1), (8, 4), (4, 3)])
def test_local_kv_lens_brute_force(n, i):
    kv_lens = np.array([0, 1, 2, 7, 30])
    q_len = 3
    got = np.asarray(local_kv_lens(kv_lens, q_len, dcp_size=n, interleave_size=i))
    assert got.shape == (n, 5, q_len)
    for r in range(n):
        for b, length in enumerate(kv_lens):
            for j in range(q_len):
                vis = max(0, length - q_len + j + 1)
                assert got[r, b, j] == sum(1 for t in range(vis) if (t // i) % n == r)


@pytest.mark.parametrize("n, i, page", [(8, 1, 4), (4, 4, 4), (3, 2, 5)])
def test_paginate_kv_brute_force(n, i, page):
    rng = np.random.default_rng(0)
    kv_lens = np.array([0, 3, 17])
    kv = rng.standard_normal((3, 17, 6)).astype(np.float32)
    cache, pt = paginate_kv(kv, kv_lens, dcp_size=n, page_size=page, interleave_size=i,
                            fill=np.nan, shuffle_seed=9, extra_pages=1)
    seen = np.zeros(cache.shape[:3], bool)
    for b in range(3):
        nxt = [0] * n  # brute force: the owner's tokens get dense local slots in token order
        for t in range(kv_lens[b]):
            r = (t // i) % n
            j = nxt[r]
            nxt[r] += 1
            row = (pt[r, b, j // page], j % page)
            np.testing.assert_array_equal(cache[r][row], kv[b, t])
            seen[r][row] = True
        assert nxt == [int(layout.local_len_np(kv_lens[b], n, r, i)) for r in range(n)]
    assert np.isnan(cache[~seen]).all()  # every other row keeps the poison


# ---------------------------------------------------------------- bad input


def test_bad_inputs():
    ql, qr, kv, kv_lens = _mla_inputs(6, [3, 9], h=12)
    cache, pt = paginate_kv(np.asarray(kv), kv_lens, dcp_size=N, page_size=4)
    mesh = make_dcp_mesh(N)
    with pytest.raises(ValueError, match="H=12.*N=8"):
        dcp_mla_decode(ql, qr, cache, pt, kv_lens, softmax_scale=0.1, mesh=mesh)
    ql, qr, kv, kv_lens = _mla_inputs(6, [3, 9])
    cache, pt = paginate_kv(np.asarray(kv), kv_lens, dcp_size=N, page_size=4)
    ok = dict(softmax_scale=0.1, mesh=mesh)
    with pytest.raises(ValueError, match="merge"):
        dcp_mla_decode(ql, qr, cache, pt, kv_lens, merge="psum", **ok)
    with pytest.raises(ValueError, match="softmax_scale"):
        dcp_mla_decode(ql, qr, cache, pt, kv_lens, softmax_scale=-1.0, mesh=mesh)
    with pytest.raises(ValueError, match="kv_cache"):
        dcp_mla_decode(ql, qr, cache[..., :-1], pt, kv_lens, **ok)
    with pytest.raises(ValueError, match="q_latent"):
        dcp_mla_decode(ql, qr[:, :, :4], cache, pt, kv_lens, **ok)
    with pytest.raises(ValueError, match="page_table"):
        dcp_mla_decode(ql, qr, cache, pt[:, :1], kv_lens, **ok)
    with pytest.raises(TypeError, match="page_table"):
        dcp_mla_decode(ql, qr, cache, pt.astype(np.float32), kv_lens, **ok)
    with pytest.raises(ValueError, match="kv_lens"):
        dcp_mla_decode(ql, qr, cache, pt, kv_lens[:1], **ok)
    with pytest.raises(ValueError, match="interleave_size"):
        dcp_mla_decode(ql, qr, cache, pt, kv_lens, interleave_size=0, **ok)
    with pytest.raises(ValueError, match="ranks.*N=4"):
        dcp_mla_decode(ql, qr, cache, pt, kv_lens, softmax_scale=0.1, mesh=make_dcp_mesh(4))
    q = np.zeros((2, 1, 6, 4), np.float32)
    k = np.zeros((N, 2, 4, 4, 4), np.float32)
    with pytest.raises(ValueError, match="Hkv=4"):
        dcp_gqa_decode(q, k, k, pt, kv_lens, **ok)
    with pytest.raises(ValueError, match="page_size"):
        paginate_kv(np.asarray(kv), kv_lens, dcp_size=N, page_size=0)
    with pytest.raises(ValueError, match="kv_lens"):
        paginate_kv(np.asarray(kv), [3, 99], dcp_size=N, page_size=4)
    with pytest.raises(ValueError, match="dcp_size"):
        paginate_kv(np.asarray(kv), kv_lens, dcp_size=0, page_size=4)
