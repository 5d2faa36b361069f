"""How the float32 DCP attention's error grows with the size of the LSEs (docs/conventions.md, 8).

The spec's float32 tolerance (1e-5 relative) holds while |lse| is moderate. Past a few hundred
it cannot: the scores are float32 (a score near 1e3 rounds by ~3e-5) and the LSEs exchanged
between ranks are float32 too (as in vLLM and sglang), so each rank's weight
``exp(lse_r - lse)`` inherits a relative error ~ ulp_f32(|lse|). Measured with N = 4 (max error
relative to the output scale, fresh inputs): 1-3e-6 at |lse| ~ 100, ~5e-6 at ~300, 0.5-1.5e-5
at ~500, 1-3e-4 at ~1e4; the merged LSE within ~1 ulp. These tests pin both: 1e-5 at
|lse| ~ 120, and the ulp-sized bound beyond.
"""

import numpy as np
import pytest

from dcp_jax.attention import (
    dcp_mla_decode,
    dcp_mla_decode_emulated,
    mla_decode_reference,
    paginate_kv,
)
from dcp_jax.merge import make_dcp_mesh

pytestmark = pytest.mark.needs_8_devices

N = 4


def _large_logit_inputs(rng, offset, *, b=3, h=8, dl=32, dr=8, max_len=200):
    """MLA inputs whose scores are ``offset`` + a unit-scale spread: many keys (and every rank)
    share the softmax, so the ranks' LSEs, all ~offset + log(keys), really are merged."""
    ql = rng.standard_normal((b, 1, h, dl)).astype(np.float32)
    qr = np.ones((b, 1, h, dr), np.float32)
    kv = rng.standard_normal((b, max_len, dl + dr)).astype(np.float32)
    kv[..., dl:] = offset / dr  # q_rope . k_rope = offset for every key
    kv_lens = np.array([max_len, max_len - 7, 64])
    return ql, qr, kv, kv_lens


def _errors(offset):
    rng = np.random.default_rng()
    ql, qr, kv, kv_lens = _large_logit_inputs(rng, offset)
    ref_o, ref_l = mla_decode_reference(ql, qr, kv, kv_lens, softmax_scale=1.0)
    cache, pt = paginate_kv(kv, kv_lens, dcp_size=N, page_size=4, interleave_size=1)
    outs = [dcp_mla_decode(ql, qr, cache, pt, kv_lens, softmax_scale=1.0, mesh=make_dcp_mesh(N)),
            dcp_mla_decode_emulated(ql, qr, cache, pt, kv_lens, softmax_scale=1.0)]
    scale = np.abs(ref_o).max()
    errs = [np.abs(np.asarray(o, np.float64) - ref_o).max() / scale for o, _ in outs]
    lse_errs = [np.abs(np.asarray(l, np.float64) - ref_l).max() for _, l in outs]
    return errs, lse_errs, np.abs(ref_l).max()


def test_float32_tolerance_holds_at_moderate_lse():
    errs, lse_errs, lse_max = _errors(100.0)
    assert 100 < lse_max < 130
    assert max(errs) <= 1e-5, errs  # the spec's float32 bound, with room (measured 1-3e-6)
    assert max(lse_errs) <= 1e-5 * lse_max, lse_errs


@pytest.mark.parametrize("offset", [500.0, 1e4])
def test_error_beyond_is_bounded_by_the_float32_lse_ulp(offset):
    # Not 1e-5 any more (measured 0.5-1.5e-5 at 500, 1-3e-4 at 1e4), but within a fraction of
    # ulp_f32(|lse|) ~ 6e-8 |lse| (measured <= 0.3 ulp; the LSE <= 1 ulp): the documented
    # limit, not a growing bug.
    errs, lse_errs, lse_max = _errors(offset)
    ulp = float(np.spacing(np.float32(lse_max)))
    assert max(errs) <= ulp, (errs, ulp)
    assert max(lse_errs) <= 4 * ulp, (lse_errs, ulp)
