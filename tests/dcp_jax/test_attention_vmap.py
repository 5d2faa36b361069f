"""The DCP attention forms under jax.vmap: a leading batch axis of 3 (not divisible by the mesh
size) equals a Python loop of unbatched calls and the float64 reference, on 2 and 4 devices (Q = 3
query tokens: before the fix the placement split the vmapped array's Q axis, which 3 does not
divide)."""

import jax
import numpy as np
import pytest

from dcp_jax.attention import (
    dcp_gqa_decode,
    dcp_gqa_decode_emulated,
    dcp_mla_decode,
    dcp_mla_decode_emulated,
    gqa_decode_reference,
    mla_decode_reference,
    paginate_kv,
)
from dcp_jax.merge import MERGE_FORMS, make_dcp_mesh

pytestmark = pytest.mark.needs_8_devices

BATCH = 3
KV_LENS = np.array([2, 19, 0, 11])


def _close(a, b, tol=1e-6):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
    fin = np.isfinite(b)
    np.testing.assert_allclose(a[fin], b[fin], rtol=tol, atol=tol)


def _mla(seed, n, interleave):
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((4, 19, 12)).astype(np.float32)
    cache, pt = paginate_kv(kv, KV_LENS, dcp_size=n, page_size=4, interleave_size=interleave,
                            fill=np.nan, shuffle_seed=seed)
    qs = tuple(rng.standard_normal((BATCH, 4, 3, 8, d)).astype(np.float32) for d in (8, 4))
    ref = lambda i: mla_decode_reference(qs[0][i], qs[1][i], kv, KV_LENS, softmax_scale=0.3)  # noqa: E731
    return qs, (cache,), pt, ref


def _gqa(seed, n, interleave):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((4, 19, 2, 8)).astype(np.float32)
    v = rng.standard_normal((4, 19, 2, 5)).astype(np.float32)
    paged = dict(dcp_size=n, page_size=4, interleave_size=interleave, fill=np.nan, shuffle_seed=seed)
    kc, pt = paginate_kv(k, KV_LENS, **paged)
    vc, _ = paginate_kv(v, KV_LENS, **paged)
    qs = (rng.standard_normal((BATCH, 4, 3, 8, 8)).astype(np.float32),)
    ref = lambda i: gqa_decode_reference(qs[0][i], k, v, KV_LENS, softmax_scale=0.3)  # noqa: E731
    return qs, (kc, vc), pt, ref


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("merge", MERGE_FORMS)
@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_vmap_over_queries_equals_a_loop(kind, merge, n):
    qs, caches, pt, ref = (_mla if kind == "mla" else _gqa)(1300 + n, n, interleave=2)
    fn = dcp_mla_decode if kind == "mla" else dcp_gqa_decode
    call = lambda *q: fn(*q, *caches, pt, KV_LENS, softmax_scale=0.3, mesh=make_dcp_mesh(n),  # noqa: E731
                         interleave_size=2, merge=merge)
    got_o, got_l = jax.vmap(call)(*qs)
    assert got_o.shape[0] == BATCH and got_l.shape == (BATCH, 4, 3, 8)
    for i in range(BATCH):
        loop_o, loop_l = call(*(q[i] for q in qs))
        _close(got_o[i], loop_o)
        _close(got_l[i], loop_l)
        ref_o, ref_l = ref(i)
        _close(got_o[i], ref_o, 1e-5)
        _close(got_l[i], ref_l, 1e-5)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_vmap_over_queries_caches_and_lengths_under_jit(kind, n):
    # Everything batched (traced page tables and lengths: no host check), inside jit, for the
    # mesh and the emulated forms.
    rng = np.random.default_rng(1400 + n)
    make = _mla if kind == "mla" else _gqa
    cases = [make(int(rng.integers(1 << 30)), n, interleave=1) for _ in range(BATCH)]
    qs = tuple(np.stack([c[0][j][0] for c in cases]) for j in range(len(cases[0][0])))
    caches = tuple(np.stack([c[1][j] for c in cases]) for j in range(len(cases[0][1])))
    pts = np.stack([c[2] for c in cases])
    lens = np.stack([KV_LENS] * BATCH)
    mesh_fn = dcp_mla_decode if kind == "mla" else dcp_gqa_decode
    emu_fn = dcp_mla_decode_emulated if kind == "mla" else dcp_gqa_decode_emulated
    for fn, extra in ((mesh_fn, {"mesh": make_dcp_mesh(n)}), (emu_fn, {})):
        call = lambda *a, fn=fn, extra=extra: fn(*a, softmax_scale=0.3, **extra)  # noqa: E731
        got_o, got_l = jax.jit(jax.vmap(call))(*qs, *caches, pts, lens)
        for i in range(BATCH):
            loop_o, loop_l = call(*(q[i] for q in qs), *(c[i] for c in caches), pts[i], lens[i])
            _close(got_o[i], loop_o)
            _close(got_l[i], loop_l)
            ref_o, ref_l = cases[i][3](0)
            _close(got_o[i], ref_o, 1e-5)
            _close(got_l[i], ref_l, 1e-5)
