"""NaN in -> NaN out: the DCP attention forms against the float64 reference's NaN / inf mask.

A NaN in a key or value row a query can see, or in the query itself, must make that query's
result NaN exactly where the float64 full-KV reference gives NaN (out and lse); every other
query and head stays exact. Before the fix the LSE merge took the poisoned shard's LSE (-inf)
for an empty shard and dropped it: N = 2 lost rank 0's good tokens too, N = 4 only the bad
token's shard, N = 1 gave a finite out with lse = -inf, a NaN query gave out 0, lse -inf.
Free slots (rows past kv_len, here all NaN) are masked on purpose and must stay harmless.
Inf in the KV follows the reference too (a +inf score gives NaN, a -inf one a zero weight), with one
exception the partials document: a query whose every visible score is -inf gets out 0, lse -inf (the
reference: NaN), as a rank with no key for it does.
Fresh random inputs each case; N = 1, 2, 4; every form (shard_map, under jit, emulated).
"""

import functools
import zlib

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

Q = 2  # two query tokens (speculative verify): query 0 does not see request 0's last token
KV_LENS = np.array([13, 6, 0])  # request 2 is a padding slot (kv_len 0)
H, HKV, D, DV, DL, DR = 8, 2, 8, 6, 12, 4
T_BAD = 5  # request 0's poisoned token: rank 1 owns it for N = 2 and N = 4 (I = 1)
T_LAST = 12  # request 0's last token: visible to query 1 only
SCALE = 0.3
FORMS = ("shard_map", "shard_map_jit", "emulated", "emulated_jit")
CASES = ("clean", "k", "v", "q", "q_rope", "free", "causal_k", "causal_v", "k_inf", "v_inf")


def _poison(case, seed, kind):
    """Fresh random inputs for ``case``: (queries, contiguous KV arrays)."""
    rng = np.random.default_rng(seed)
    b, s = len(KV_LENS), int(KV_LENS.max()) + 3
    if kind == "mla":
        qs = [rng.standard_normal((b, Q, H, DL)), rng.standard_normal((b, Q, H, DR))]
        kvs = [rng.standard_normal((b, s, DL + DR))]
    else:
        qs = [rng.standard_normal((b, Q, H, D))]
        kvs = [rng.standard_normal((b, s, HKV, D)), rng.standard_normal((b, s, HKV, DV))]
    qs = [x.astype(np.float32) for x in qs]
    kvs = [x.astype(np.float32) for x in kvs]
    for x in kvs:  # rows past kv_len: never read (paginate leaves its free slots NaN too)
        for bi, n in enumerate(KV_LENS):
            x[bi, n:] = np.nan
    # MLA: latent columns are keys AND values, rope columns keys only.
    k_col = (0, T_BAD, DL + 1) if kind == "mla" else (0, T_BAD, 1, 2)
    v_col = (0, T_BAD, 3) if kind == "mla" else (0, T_BAD, 0, 3)
    k, v = kvs[0], kvs[-1]
    if case == "k":
        k[k_col] = np.nan
    elif case == "v":
        v[v_col] = np.nan
    elif case == "q":
        qs[0][1, 0, 2, 0] = np.nan  # request 1, query 0, head 2
    elif case == "q_rope":
        qs[-1][0, 1, 5, 1] = np.nan  # request 0, query 1, head 5 (GQA: the one query array)
        qs[-1][2, 0, 1, 0] = np.nan  # the padding slot sees no key: stays out 0, lse -inf
    elif case == "causal_k":
        k[k_col[:1] + (T_LAST,) + k_col[2:]] = np.nan
    elif case == "causal_v":
        v[v_col[:1] + (T_LAST,) + v_col[2:]] = np.nan
    elif case == "k_inf":
        k[k_col] = np.inf  # score +-inf by the query's sign: +inf -> NaN, -inf -> weight 0
    elif case == "v_inf":
        v[v_col] = -np.inf
    return qs, kvs


def _reference(kind, qs, kvs):
    ref = mla_decode_reference if kind == "mla" else gqa_decode_reference
    with np.errstate(invalid="ignore"):
        return ref(*qs, *kvs, KV_LENS, softmax_scale=SCALE)


def _run(kind, form, n, qs, kvs, merge="ag_rs"):
    caches = []
    for x in kvs:
        cache, pt = paginate_kv(x, KV_LENS, dcp_size=n, page_size=4, fill=np.nan, shuffle_seed=n)
        caches.append(cache)
    fn = {("mla", False): dcp_mla_decode, ("gqa", False): dcp_gqa_decode,
          ("mla", True): dcp_mla_decode_emulated, ("gqa", True): dcp_gqa_decode_emulated}
    emulated = form.startswith("emulated")
    kw = {} if emulated else {"mesh": make_dcp_mesh(n), "merge": merge}
    call = functools.partial(fn[kind, emulated], softmax_scale=SCALE, **kw)
    if form.endswith("_jit"):
        call = jax.jit(call)
    return call(*qs, *caches, pt, KV_LENS)


def _assert_like_reference(got, ref, name):
    got = np.asarray(got, np.float64)
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(ref), err_msg=f"{name}: {test.__name__}")
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=2e-5, atol=2e-5, err_msg=name)


def _check(kind, case, got, ref):
    (out, lse), (ref_o, ref_l) = got, ref
    _assert_like_reference(out, ref_o, "out")
    _assert_like_reference(lse, ref_l, "lse")
    assert np.isfinite(ref_o).any()  # the other queries / heads are there and exact
    poisoned = case not in ("clean", "free")
    assert (~np.isfinite(ref_o)).any() == poisoned  # the case poisons what it means to
    if case in ("causal_k", "causal_v"):
        assert not np.isnan(ref_o[0, 0]).any() and np.isnan(ref_o[0, 1]).any()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_nan_propagates_like_the_float64_reference(kind, n, form, case):
    seed = zlib.crc32(f"{kind}-{n}-{form}-{case}".encode())  # fresh inputs per case, stable
    qs, kvs = _poison(case, seed, kind)
    _check(kind, case, _run(kind, form, n, qs, kvs), _reference(kind, qs, kvs))


@pytest.mark.parametrize("merge", ["ag_ar", "a2a"])
@pytest.mark.parametrize("case", ["k", "v", "q", "causal_k", "free"])
@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_nan_propagates_through_every_merge_form(kind, case, merge):
    qs, kvs = _poison(case, 7, kind)
    _check(kind, case, _run(kind, "shard_map", 4, qs, kvs, merge), _reference(kind, qs, kvs))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_nan_token_poisons_every_query_that_sees_it_and_no_other(n):
    # The brief's defect, spelled out: one NaN K entry on rank owner(T_BAD) of request 0.
    qs, kvs = _poison("k", 11, "gqa")
    out, lse = (np.asarray(x) for x in _run("gqa", "shard_map", n, qs, kvs))
    assert layout.owner_np(np.array([T_BAD]), n, 1)[0] == (T_BAD % n)
    group = np.arange(H) // (H // HKV) == 1  # heads reading KV head 1
    assert np.isnan(lse[0][:, group]).all() and np.isnan(out[0][:, group]).all()
    assert np.isfinite(lse[0][:, ~group]).all() and np.isfinite(out[1:]).all()
    assert np.isneginf(lse[2]).all() and (out[2] == 0).all()  # the padding slot


def test_masked_free_slot_past_kv_len_stays_finite():
    # A NaN in the very next row of a partly filled page (past kv_len) is masked on purpose.
    qs, kvs = _poison("clean", 3, "mla")
    cache, pt = paginate_kv(kvs[0], KV_LENS, dcp_size=2, page_size=4, fill=0.0)
    for r in range(2):
        for bi, n in enumerate(KV_LENS):
            j = int(layout.local_len_np(np.array([n]), 2, r, 1)[0])
            cache[r, pt[r, bi, j // 4], j % 4] = np.nan  # local slot j: the first free one
    out, lse = dcp_mla_decode(*qs, cache, pt, KV_LENS, softmax_scale=SCALE, mesh=make_dcp_mesh(2))
    ref_o, ref_l = _reference("mla", qs, kvs)
    _assert_like_reference(out, ref_o, "out")
    _assert_like_reference(lse, ref_l, "lse")
    assert not np.isnan(np.asarray(out)).any()


def test_partials_stay_exact_for_any_local_lens():
    # The causal band split of the value product must lose no row, even for local_lens that
    # are not the staircase local_kv_lens gives (here the queries' lengths differ by > Q - 1).
    from dcp_jax.attention import gqa_partial, mla_partial

    rng = np.random.default_rng(21)
    lens = np.array([[9, 1, 4], [0, 7, 7], [3, 3, 12]], np.int32)  # B = 3, Q = 3, S = 12
    ql, qr = rng.standard_normal((3, 3, 4, 6)), rng.standard_normal((3, 3, 4, 2))
    kv = rng.standard_normal((3, 12, 8))
    pt = np.arange(9, dtype=np.int32).reshape(3, 3)  # pages of 4 rows
    out, lse = mla_partial(*(x.astype(np.float32) for x in (ql, qr)),
                           kv.reshape(9, 4, 8).astype(np.float32), pt, lens, softmax_scale=0.5)
    q = rng.standard_normal((3, 3, 4, 8))
    k, v = rng.standard_normal((3, 12, 2, 8)), rng.standard_normal((3, 12, 2, 5))
    g_out, g_lse = gqa_partial(q.astype(np.float32), k.reshape(9, 4, 2, 8).astype(np.float32),
                               v.reshape(9, 4, 2, 5).astype(np.float32), pt, lens,
                               softmax_scale=0.5)
    for b in range(3):
        for j in range(3):
            n = int(lens[b, j])
            ref_o, ref_l = mla_decode_reference(ql[b:b + 1, j:j + 1], qr[b:b + 1, j:j + 1],
                                                kv[b:b + 1], [n], softmax_scale=0.5)
            _assert_like_reference(np.asarray(out)[b, j], ref_o[0, 0], "mla out")
            _assert_like_reference(np.asarray(lse)[b, j], ref_l[0, 0], "mla lse")
            ref_o, ref_l = gqa_decode_reference(q[b:b + 1, j:j + 1], k[b:b + 1], v[b:b + 1], [n],
                                                softmax_scale=0.5)
            _assert_like_reference(np.asarray(g_out)[b, j], ref_o[0, 0], "gqa out")
            _assert_like_reference(np.asarray(g_lse)[b, j], ref_l[0, 0], "gqa lse")


@pytest.mark.parametrize("n", [2, 8])
def test_nan_reaches_lse_at_a_realistic_batch(n):
    """B = 8, H = 16: XLA:CPU's max over the scores dropped the NaN, and the poisoned heads got a
    finite lse (the NaN query's head -inf) while out was NaN (final fresh-user trial)."""
    rng = np.random.default_rng()
    b, h, lens = 8, 16, np.full(8, 40)
    ql = rng.standard_normal((b, 1, h, 512)).astype(np.float32)
    qr = rng.standard_normal((b, 1, h, 64)).astype(np.float32)
    kv = rng.standard_normal((b, 48, 576)).astype(np.float32)
    kv[0, 7, 3] = np.nan
    ql[b - 1, 0, h - 1, 5] = np.nan
    ro, rl = mla_decode_reference(ql, qr, kv, lens, softmax_scale=0.05)
    cache, pt = paginate_kv(kv, lens, dcp_size=n, page_size=16)
    for fn in (dcp_mla_decode, dcp_mla_decode_emulated):
        kw = dict(mesh=make_dcp_mesh(n)) if fn is dcp_mla_decode else {}  # emulated: N from pt
        o, l = fn(ql, qr, cache, pt, lens, softmax_scale=0.05, **kw)
        assert np.isnan(rl).sum() == h + 1
        np.testing.assert_array_equal(np.isnan(np.asarray(l)), np.isnan(rl))
        np.testing.assert_array_equal(np.isnan(np.asarray(o)), np.isnan(ro))
        np.testing.assert_allclose(np.asarray(l), rl, rtol=1e-4, atol=1e-4)
