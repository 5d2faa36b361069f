"""Argument checks of the DCP attention forms: page tables, kv_lens (host checks of concrete
values; nothing under a trace), checked on 2 and 4 of the 8 CPU devices against float64."""

import jax
import numpy as np
import pytest

from dcp_jax import layout
from dcp_jax.attention import (
    dcp_gqa_decode,
    dcp_gqa_decode_emulated,
    dcp_mla_decode,
    dcp_mla_decode_emulated,
    gqa_decode_reference,
    mla_decode_reference,
    paginate_kv,
)
from dcp_jax.merge import make_dcp_mesh

pytestmark = pytest.mark.needs_8_devices

FORMS = ["mla", "mla_emulated", "gqa", "gqa_emulated"]
PAGE = 4


def _case(form, seed, kv_lens, *, n, interleave=1, q_len=1, shared=False):
    """Fresh random inputs for ``form``: (call(page_table, kv_lens, **kw), reference(kv_lens),
    cache num_pages, page_table)."""
    rng = np.random.default_rng(seed)
    b, s, h = len(kv_lens), max(kv_lens), 4
    kv_lens = np.asarray(kv_lens)
    paged = dict(dcp_size=n, page_size=PAGE, interleave_size=interleave, fill=np.nan,
                 shuffle_seed=seed, extra_pages=1, shared_page_table=shared)
    scale = float(rng.uniform(0.1, 0.5))
    if form.startswith("mla"):
        ql, qr = (rng.standard_normal((b, q_len, h, d)).astype(np.float32) for d in (8, 4))
        kv = rng.standard_normal((b, s, 12)).astype(np.float32)
        cache, pt = paginate_kv(kv, kv_lens, **paged)
        caches = (cache,)
        qs = (ql, qr)
        ref = lambda lens: mla_decode_reference(ql, qr, kv, lens, softmax_scale=scale)  # noqa: E731
        fn = dcp_mla_decode if form == "mla" else dcp_mla_decode_emulated
    else:
        q = rng.standard_normal((b, q_len, h, 8)).astype(np.float32)
        k = rng.standard_normal((b, s, 2, 8)).astype(np.float32)
        v = rng.standard_normal((b, s, 2, 6)).astype(np.float32)
        kc, pt = paginate_kv(k, kv_lens, **paged)
        vc, _ = paginate_kv(v, kv_lens, **paged)
        caches = (kc, vc)
        qs = (q,)
        ref = lambda lens: gqa_decode_reference(q, k, v, lens, softmax_scale=scale)  # noqa: E731
        fn = dcp_gqa_decode if form == "gqa" else dcp_gqa_decode_emulated
    extra = {} if form.endswith("emulated") else {"mesh": make_dcp_mesh(n)}

    def call(page_table, lens, **kw):
        kw = {"softmax_scale": scale, "interleave_size": interleave, **extra, **kw}
        return fn(*qs, *caches, page_table, lens, **kw)

    return call, ref, caches[0].shape[1], pt


def _pages_read(kv_lens, n, interleave):
    """[N, B] pages each rank reads, from the library's own local_len."""
    return np.stack([-(-layout.local_len_np(np.asarray(kv_lens), n, r, interleave) // PAGE)
                     for r in range(n)])


def _assert_matches(got, ref):
    o, l = (np.asarray(x, np.float64) for x in got)
    ref_o, ref_l = ref
    np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.isneginf(l), np.isneginf(ref_l))
    fin = np.isfinite(ref_l)
    np.testing.assert_allclose(l[fin], ref_l[fin], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- page ids and kv_lens


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("form", FORMS)
def test_page_id_past_the_cache_is_refused(form, n):
    kv_lens = [3, 21, 9]
    call, _, num_pages, pt = _case(form, 100 + n, kv_lens, n=n, interleave=2)
    bad = pt.copy()
    bad[n - 1, 1, 0] = num_pages + 6  # rank N-1 reads page 0 of request 1 (21 tokens)
    with pytest.raises(ValueError, match=rf"page_table\[{n - 1}, 1, 0\]={num_pages + 6} is not "
                                         rf"a page of the cache .*num_pages={num_pages}"):
        call(bad, np.asarray(kv_lens))


@pytest.mark.parametrize("form", FORMS)
def test_negative_page_id_is_refused(form):
    kv_lens = [13, 2]
    call, _, _, pt = _case(form, 200, kv_lens, n=2)
    bad = pt.copy()
    bad[0, 0, 1] = -1  # rank 0 holds 7 of 13 tokens: pages 0 and 1 are read
    with pytest.raises(ValueError, match=r"page_table\[0, 0, 1\]=-1 is not a page"):
        call(bad, np.asarray(kv_lens))


@pytest.mark.parametrize("form", ["mla", "gqa_emulated"])
def test_shared_table_names_the_shared_entry(form):
    kv_lens = [5, 17]
    call, _, num_pages, pt = _case(form, 300, kv_lens, n=4, shared=True)
    assert pt.ndim == 2
    bad = pt.copy()
    bad[1, 1] = num_pages
    with pytest.raises(ValueError, match=rf"page_table\[1, 1\]={num_pages} is not a page"):
        call(bad, np.asarray(kv_lens))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("form", FORMS)
def test_padding_past_the_pages_read_is_accepted(form, n):
    # Serving stacks pad a request's row past its used pages with -1 or 0 (or stale ids).
    kv_lens = [1, 26, 7, 0]
    call, ref, num_pages, pt = _case(form, 400 + n, kv_lens, n=n, interleave=3, q_len=2)
    read = _pages_read(kv_lens, n, 3)
    padded = pt.copy()
    rng = np.random.default_rng(401 + n)
    for r in range(n):
        for b in range(len(kv_lens)):
            tail = padded[r, b, read[r, b]:]
            tail[:] = rng.choice([-1, 0, num_pages, 10**6], size=tail.shape)
    assert (padded != pt).any()
    _assert_matches(call(padded, np.asarray(kv_lens)), ref(np.asarray(kv_lens)))


@pytest.mark.parametrize("form", FORMS)
def test_kv_lens_past_the_table_is_refused(form):
    kv_lens = [6, 16]
    call, _, _, pt = _case(form, 500, kv_lens, n=2)
    assert pt.shape[-1] == 2  # 8 local tokens per rank, 2 pages of 4
    with pytest.raises(ValueError, match=r"kv_lens\[1\]=20 does not fit the page table.*max_pages=2"):
        call(pt, np.array([6, 20]))


@pytest.mark.parametrize("form", FORMS)
def test_negative_kv_lens_is_refused(form):
    call, _, _, pt = _case(form, 600, [4, 9], n=2)
    with pytest.raises(ValueError, match=r"kv_lens\[1\]=-5 must be >= 0"):
        call(pt, np.array([4, -5]))


@pytest.mark.parametrize("form", ["mla", "gqa_emulated"])
def test_under_jit_nothing_is_checked_and_ids_are_clamped(form):
    # The documented behaviour under a trace: an out-of-range id reads the clamped page.
    kv_lens = np.array([16])
    call, _, num_pages, pt = _case(form, 700, [16], n=2)
    bad, clamped = pt.copy(), pt.copy()
    bad[1, 0, 1], clamped[1, 0, 1] = num_pages + 4, num_pages - 1
    got = jax.jit(call)(bad, kv_lens)
    want = call(clamped, kv_lens)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


# ---------------------------------------------------------------- softmax_scale


def _scale_case(form, seed):
    rng = np.random.default_rng(seed)
    scale = float(np.float32(rng.uniform(0.1, 0.5)))  # exact in float32 as well
    call, _, _, pt = _case(form, seed, [5, 11], n=2)
    lens = np.array([5, 11])
    return (lambda s: call(pt, lens, softmax_scale=s)), scale


@pytest.mark.parametrize("form", FORMS)
def test_softmax_scale_accepts_any_real_scalar(form):
    call, scale = _scale_case(form, 800)
    want = [np.asarray(x) for x in call(scale)]
    for s in (np.float32(scale), np.float64(scale), np.asarray(scale, np.float32), np.asarray(scale),
              jax.numpy.asarray(scale), jax.numpy.float32(scale)):
        got = call(s)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), w)
    # An int scale is the float of the same value; 1 / sqrt(np.float32(192)) is the usual spelling.
    for s, f in ((1, 1.0), (np.int64(2), 2.0), (1 / np.sqrt(np.float32(192)), float(1 / np.sqrt(np.float32(192))))):
        np.testing.assert_array_equal(np.asarray(call(s)[0]), np.asarray(call(f)[0]))


@pytest.mark.parametrize("form", ["mla", "gqa_emulated"])
@pytest.mark.parametrize("bad, exc", [
    (True, TypeError), (np.bool_(True), TypeError), ("0.5", TypeError), (0.5 + 0j, TypeError),
    (np.array([0.5, 0.5]), ValueError), (np.array([0.5]), ValueError), (0.0, ValueError),
    (-0.25, ValueError), (np.float32(-1), ValueError), (float("nan"), ValueError),
    (np.float32("inf"), ValueError), (np.asarray(np.nan), ValueError), (None, TypeError),
    (1e308, ValueError), (1e-50, ValueError),  # past float32: all-NaN (or all-equal) scores before
], ids=repr)
def test_softmax_scale_refused(form, bad, exc):
    call, _ = _scale_case(form, 801)
    with pytest.raises(exc, match="softmax_scale"):
        call(bad)


def test_softmax_scale_traced_is_refused_by_name():
    call, scale = _scale_case("mla", 802)
    with pytest.raises(TypeError, match="softmax_scale .*traced"):
        jax.jit(call)(scale)


# ---------------------------------------------------------------- dtypes and empty shapes


def _mla_args(seed, *, b=2, q_len=1, h=4, n=2):
    rng = np.random.default_rng(seed)
    kv_lens = rng.integers(1, 12, size=b)
    kv = rng.standard_normal((b, 12, 12)).astype(np.float32)
    cache, pt = paginate_kv(kv, kv_lens, dcp_size=n, page_size=PAGE, fill=np.nan, shuffle_seed=seed)
    ql = rng.standard_normal((b, q_len, h, 8)).astype(np.float32)
    qr = rng.standard_normal((b, q_len, h, 4)).astype(np.float32)
    return ql, qr, kv, cache, pt, kv_lens


def _gqa_args(seed, *, b=2, q_len=1, h=4, n=2):
    rng = np.random.default_rng(seed)
    kv_lens = rng.integers(1, 12, size=b)
    k = rng.standard_normal((b, 12, 2, 8)).astype(np.float32)
    kc, pt = paginate_kv(k, kv_lens, dcp_size=n, page_size=PAGE, fill=np.nan, shuffle_seed=seed)
    q = rng.standard_normal((b, q_len, h, 8)).astype(np.float32)
    return q, kc, pt, kv_lens


def _mla_forms(n=2):
    return [lambda *a, **k: dcp_mla_decode(*a, mesh=make_dcp_mesh(n), **k), dcp_mla_decode_emulated]


def _gqa_forms(n=2):
    return [lambda *a, **k: dcp_gqa_decode(*a, mesh=make_dcp_mesh(n), **k), dcp_gqa_decode_emulated]


@pytest.mark.parametrize("emulated", [False, True])
@pytest.mark.parametrize("bad", ["q_latent", "q_rope", "kv_cache"])
@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.bool_, np.complex64], ids=lambda d: d.__name__)
def test_mla_non_float_dtype_is_refused_by_name(bad, dtype, emulated):
    ql, qr, _, cache, pt, lens = _mla_args(900)
    args = {"q_latent": ql, "q_rope": qr, "kv_cache": cache}
    args[bad] = (np.nan_to_num(args[bad]) * 10).astype(dtype)
    fn = _mla_forms()[emulated]
    with pytest.raises(TypeError, match=rf"{bad} must have a floating dtype"):
        fn(args["q_latent"], args["q_rope"], args["kv_cache"], pt, lens, softmax_scale=0.3)


@pytest.mark.parametrize("emulated", [False, True])
@pytest.mark.parametrize("bad", ["q", "k_cache", "v_cache"])
def test_gqa_non_float_dtype_is_refused_by_name(bad, emulated):
    q, kc, pt, lens = _gqa_args(901)
    args = {"q": q, "k_cache": kc, "v_cache": kc}
    args[bad] = (np.nan_to_num(args[bad]) * 10).astype(np.int8)
    fn = _gqa_forms()[emulated]
    with pytest.raises(TypeError, match=rf"{bad} must have a floating dtype"):
        fn(args["q"], args["k_cache"], args["v_cache"], pt, lens, softmax_scale=0.3)


@pytest.mark.parametrize("emulated", [False, True])
def test_mla_mixed_query_dtypes_use_each_as_given(emulated):
    # Documented: q_latent f32 and q_rope bf16 are each used as given, scores in float32, out in
    # q_latent's dtype; a bf16 cache likewise.
    ql, qr, kv, cache, pt, lens = _mla_args(902, q_len=2)
    qr16 = jax.numpy.asarray(qr, jax.numpy.bfloat16)
    cache16 = jax.numpy.asarray(cache, jax.numpy.bfloat16)
    out, lse = _mla_forms()[emulated](ql, qr16, cache16, pt, lens, softmax_scale=0.3)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    kv16 = np.asarray(jax.numpy.asarray(kv, jax.numpy.bfloat16), np.float64)
    ref_o, ref_l = mla_decode_reference(ql, np.asarray(qr16, np.float64), kv16, lens, softmax_scale=0.3)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse, np.float64), ref_l, rtol=1e-5, atol=1e-5)
    # And the other way round: bf16 q_latent gives bf16 out (q_latent's dtype), same values.
    out_b, _ = _mla_forms()[emulated](jax.numpy.asarray(ql, jax.numpy.bfloat16), qr, cache, pt, lens,
                                      softmax_scale=0.3)
    assert out_b.dtype == jax.numpy.bfloat16
    ref_b, _ = mla_decode_reference(np.asarray(jax.numpy.asarray(ql, jax.numpy.bfloat16), np.float64),
                                    qr, kv, lens, softmax_scale=0.3)
    np.testing.assert_allclose(np.asarray(out_b, np.float64), ref_b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("form", ["mla", "mla_emulated", "gqa", "gqa_emulated"])
@pytest.mark.parametrize("b, q_len", [(0, 1), (3, 0), (0, 0)])
def test_empty_batch_or_queries_give_empty_results(form, n, b, q_len):
    h = 4
    if form.startswith("mla"):
        ql, qr, _, cache, pt, lens = _mla_args(903 + n, b=3, n=n)
        qs, caches, dv = (ql[:b, :q_len], qr[:b, :q_len]), (cache,), 8
        fn = _mla_forms(n)[form.endswith("emulated")]
    else:
        q, kc, pt, lens = _gqa_args(903 + n, b=3, n=n)
        qs, caches, dv = (q[:b, :q_len],), (kc, kc), 8
        fn = _gqa_forms(n)[form.endswith("emulated")]
    out, lse = fn(*qs, *caches, pt[:, :b], lens[:b], softmax_scale=0.3)
    assert out.shape == (b, q_len, h, dv) and out.dtype == np.float32
    assert lse.shape == (b, q_len, h) and lse.dtype == np.float32


@pytest.mark.parametrize("emulated", [False, True])
def test_zero_heads_or_pages_are_refused_by_name(emulated):
    ql, qr, _, cache, pt, lens = _mla_args(906)
    fn = _mla_forms()[emulated]
    with pytest.raises(ValueError, match="q_latent needs at least one head"):
        fn(ql[:, :, :0], qr[:, :, :0], cache, pt, lens, softmax_scale=0.3)
    with pytest.raises(ValueError, match=r"page_table needs at least one page per request"):
        fn(ql, qr, cache, pt[:, :, :0], lens * 0, softmax_scale=0.3)
    q, kc, pt, lens = _gqa_args(907)
    with pytest.raises(ValueError, match="k_cache needs at least one KV head"):
        _gqa_forms()[emulated](q, kc[:, :, :, :0], kc[:, :, :, :0], pt, lens, softmax_scale=0.3)


def test_paginate_kv_and_local_kv_lens_refuse_non_integers_and_negative_query_len():
    """kv_lens=[2.7] became 2 and query_len=-1 was taken (fresh-user trial 3)."""
    import numpy as np
    import pytest

    from dcp_jax.attention_partial import local_kv_lens
    from dcp_jax.attention_reference import paginate_kv

    kv = np.random.default_rng().standard_normal((1, 8, 4)).astype(np.float32)
    with pytest.raises(TypeError, match="kv_lens must hold integers.*float64"):
        paginate_kv(kv, [2.7], dcp_size=2, page_size=4)
    cache, table = paginate_kv(kv, np.array([3], np.int32), dcp_size=2, page_size=4)  # integers still fine
    assert table.shape[:2] == (2, 1)
    with pytest.raises(ValueError, match="query_len must be >= 0, got query_len=-1"):
        local_kv_lens(np.array([5]), -1, dcp_size=2)
    with pytest.raises(TypeError, match="query_len must be an int"):
        local_kv_lens(np.array([5]), 1.0, dcp_size=2)
    with pytest.raises(TypeError, match="kv_lens must hold integers.*got dtype float64"):
        local_kv_lens(np.array([5.5]), 1, dcp_size=2)  # named as given (float32 before)
    # tokens 0..4 over 2 ranks (I = 1): the one query sees 3 on rank 0 and 2 on rank 1
    assert local_kv_lens(np.array([5]), 1, dcp_size=2).tolist() == [[[3]], [[2]]]
