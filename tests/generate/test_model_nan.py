"""NaN in, NaN out through the tiny model's attention (the rule of the DCP attention forms): a
poisoned KV row must not be merged away as an empty shard or block."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dcp_jax.merge import make_dcp_mesh
from dcp_jax.model import PREFILL_CHUNK, DecodeGeometry, ModelConfig, global_caches, init_params, make_decode_step, replicated
from dcp_jax.model.forward import _causal_attention
from dcp_jax.model.paging import place_rows, request_pages


def _reference(q, k, v, scale):
    s = q.shape[0]
    sc = np.einsum("qhd,khd->hqk", q.astype(np.float64), k.astype(np.float64)) * scale
    sc[:, ~np.tril(np.ones((s, s), bool))] = -np.inf
    with np.errstate(invalid="ignore"):
        p = np.exp(sc - sc.max(-1, keepdims=True))
        return np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v.astype(np.float64))


def test_blocked_causal_attention_propagates_a_nan_key_across_blocks():
    s, h, d, dv = 2 * PREFILL_CHUNK, 2, 8, 4
    rng = np.random.default_rng()
    q, k = rng.normal(size=(2, s, h, d)).astype(np.float32)
    v = rng.normal(size=(s, h, dv)).astype(np.float32)
    j = int(rng.integers(0, PREFILL_CHUNK))  # in block 0: later blocks see it through the merge
    k[j, 1] = np.nan
    got = np.asarray(_causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 0.3))
    want = _reference(q, k, v, 0.3)
    assert np.isnan(want[j:, 1]).all() and not np.isnan(want[:j]).any() and not np.isnan(want[:, 0]).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_decode_step_logits_are_nan_when_a_visible_kv_row_is():
    n, page, t = 4, 4, 30
    mesh = make_dcp_mesh(n)
    pages = request_pages(40, dcp_size=n, page_size=page, interleave_size=2, seed=0)
    geo = DecodeGeometry(page, pages.num_pages, pages.max_pages, 2, "ag_rs")
    cfg = ModelConfig(num_layers=1)
    params = jax.tree.map(lambda a: replicated(mesh, a), init_params(cfg))
    pt = jax.device_put(pages.tables, NamedSharding(mesh, P("dcp")))
    rows = np.random.default_rng().normal(size=(t, 576)).astype(np.float32)
    devs = list(mesh.devices.flat)
    logits = {}
    for poisoned in (False, True):
        if poisoned:
            rows[5, :] = np.nan  # token 5: rank (5 // 2) % 4 = 2, one of four shards
        placed = place_rows(rows, t, pages)
        caches = global_caches(mesh, [[jnp.copy(jax.device_put(placed[r], devs[r]))] for r in range(n)])
        step = make_decode_step(cfg, mesh, geo)
        out = step(params, caches, pt, replicated(mesh, np.int32(5)), replicated(mesh, np.int32(t)))
        logits[poisoned] = np.asarray(out[0])
    assert np.isfinite(logits[False]).all()
    assert np.isnan(logits[True]).all()  # before: rank 2's shard was dropped and the logits finite
