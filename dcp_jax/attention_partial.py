"""Per-rank partial attention (no collectives): one rank's queries against its paged local KV.

:func:`mla_partial` (absorbed MLA) and :func:`gqa_partial` (GQA/MHA) return the rank's partial
``(out, lse)``, natural-log LSE, over the ``local_len`` tokens it owns (spec section 8, step 2);
:func:`local_kv_lens` says how many local tokens each query sees on each rank. The DCP forms that
all-gather the queries and merge the partials are in :mod:`dcp_jax.attention`, which re-exports
every name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dcp_jax import layout
from dcp_jax._validate import check_int

__all__ = ["gqa_partial", "local_kv_lens", "mla_partial"]

_HIGHEST = jax.lax.Precision.HIGHEST


# --------------------------------------------------------------------------------------------
# Per-rank partial attention (no collectives)
# --------------------------------------------------------------------------------------------


def _gather_local(pages, page_table):
    """pages [num_pages, P, ...], page_table i32[B, max_pages] -> rows [B, max_pages*P, ...]."""
    g = jnp.take(pages, page_table, axis=0, mode="clip")  # padding ids are masked later
    b, mp, ps = g.shape[:3]
    return g.reshape((b, mp * ps) + g.shape[3:])


def _masks(local_lens, s: int):
    """local_lens i32[B, Q] -> (mask bool[B, Q, S] per query, any bool[B, S] over queries)."""
    idx = jnp.arange(s, dtype=jnp.int32)
    mask = idx[None, None, :] < local_lens[:, :, None]
    return mask, idx[None, :] < jnp.max(local_lens, axis=1, initial=0)[:, None]


def _zero_unused(x, used):
    """Zeroes rows no query may read (NaN/garbage in free slots must not reach a matmul)."""
    used = used.reshape(used.shape + (1,) * (x.ndim - used.ndim))
    return jnp.where(used, x, jnp.zeros((), x.dtype))


def _softmax_partial(scores, mask):
    """Normalised probabilities and natural-log LSE over the masked keys.

    Args:
      scores: f32[B, Q, H, S] scaled scores.
      mask: bool[B, Q, S], True where query (b, j) may see local key s.

    Returns:
      ``(p f32[B, Q, H, S], lse f32[B, Q, H])``; a query with no visible key gets p = 0 and
      lse = -inf (not NaN). NaN in, NaN out, as the float64 reference (IEEE softmax with the max
      subtracted): a NaN or +inf score among the visible keys (a NaN in the query or in a key
      row it sees; +inf from an inf key entry) gives p = NaN and lse = NaN for that (query,
      head); a -inf score is a zero weight, like a masked key (all visible scores -inf: the
      no-visible-key result, where the reference's ``-inf - -inf`` gives NaN). Scores of
      masked keys never matter.
    """
    mask = mask[:, :, None, :]
    s = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(s, axis=-1)
    # Asked explicitly, not read off the max: XLA:CPU's vectorised max drops NaN on larger
    # arrays (a (576, 8) max with one NaN gave 1.3), which left lse finite or -inf.
    poisoned = jnp.any(mask & (jnp.isnan(scores) | (scores == jnp.inf)), axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # no visible key: (-inf) - (-inf) would be NaN
    e = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    tot = jnp.sum(e, axis=-1)
    live = tot > 0
    tot_safe = jnp.where(live, tot, 1.0)  # 0/0 guard
    lse = jnp.where(live, m + jnp.log(tot_safe), -jnp.inf)
    lse = jnp.where(poisoned, jnp.nan, lse)
    p = jnp.where(poisoned[..., None], jnp.nan, e / tot_safe[..., None])
    return p, lse


def _attend(p, v, local_lens, eq: str, eq_band: str):
    """``p @ v`` over the rows each query sees, with IEEE semantics for non-finite values.

    Rows no query sees are zero already (:func:`_zero_unused`), so for ``Q <= 1`` this is one
    einsum. For ``Q > 1`` a row seen by a later query but not an earlier one (causal, the
    ``Q - 1`` rows ``[lo, lo + Q - 1)`` past the ``lo`` rows every query of the request sees)
    would reach the earlier query's sum as ``0 * v``, and ``0 * NaN`` is NaN: those rows are
    zeroed in the shared product and added per query, selected by visibility.
    (``local_kv_lens`` gives that causal staircase; other ``local_lens`` stay exact for finite
    values, only a non-finite row past the band may reach a query that does not see it.)

    Args:
      p: f32[B, Q, ..., S] probabilities (0 on masked keys).
      v: [B, S, ...] value rows (cast to float32).
      local_lens: i32[B, Q] visible local rows per query.
      eq: the einsum of ``p`` and ``v`` (e.g. ``"bqhs,bsc->bqhc"``).
      eq_band: the same with a per-query ``v`` (``"bqhs,bqsc->bqhc"``).
    """
    f32 = jnp.float32
    v = v.astype(f32)
    b, qn, s = p.shape[0], p.shape[1], v.shape[1]
    if qn <= 1:
        return jnp.einsum(eq, p, v, precision=_HIGHEST)
    lo = jnp.min(local_lens, axis=1)  # [B]
    idx = lo[:, None] + jnp.arange(qn - 1, dtype=jnp.int32)[None, :]  # [B, W] band rows
    rows = jnp.arange(s, dtype=jnp.int32)[None, :]
    out = jnp.einsum(eq, p, _zero_unused(v, (rows < lo[:, None]) | (rows >= idx[:, -1:] + 1)),
                     precision=_HIGHEST)
    seen = (idx[:, None, :] < local_lens[:, :, None]) & (idx < s)[:, None, :]  # [B, Q, W]
    vi = idx.reshape(idx.shape + (1,) * (v.ndim - 2))
    vb = jnp.take_along_axis(v, jnp.broadcast_to(vi, idx.shape + v.shape[2:]), axis=1,
                             mode="clip")  # [B, W, ...]
    vb = _zero_unused(jnp.broadcast_to(vb[:, None], (b, qn) + vb.shape[1:]), seen)
    pi = idx.reshape((b, 1) + (1,) * (p.ndim - 3) + (qn - 1,))
    pb = jnp.take_along_axis(p, jnp.broadcast_to(pi, p.shape[:-1] + (qn - 1,)), axis=-1,
                             mode="clip")  # [B, Q, ..., W]
    return out + jnp.einsum(eq_band, pb, vb, precision=_HIGHEST)


def mla_partial(q_latent, q_rope, kv_pages, page_table, local_lens, *, softmax_scale: float):
    """Absorbed MLA attention of all heads against ONE rank's paged local KV.

    Args:
      q_latent: [B, Q, H, Dl] absorbed queries (Dl = kv_lora_rank, 512 for DeepSeek-V3).
      q_rope: [B, Q, H, Dr] rope queries (Dr = 64).
      kv_pages: [num_pages, page_size, Dl + Dr] this rank's KV pages (latent | rope).
      page_table: i32[B, max_pages] this rank's page ids per request (local index j lives at
        row ``page_table[b, j // page_size] * page_size + j % page_size``).
      local_lens: i32[B, Q] local tokens (of this rank) visible to each query.
      softmax_scale: multiplies the raw scores (e.g. ``1/sqrt(192)`` for DeepSeek-V3).

    Returns:
      ``(out [B, Q, H, Dl] in q_latent's dtype, lse f32[B, Q, H] natural log)``; no visible
      key gives out = 0, lse = -inf. NaN in, NaN out (:func:`_softmax_partial`,
      :func:`_attend`): a NaN in the query or in a row it sees gives out = NaN, lse = NaN (so
      the DCP merge, run with ``propagate_nan``, poisons the merged state); NaN in rows it does
      not see never reaches it.
    """
    dl = q_latent.shape[-1]
    kv = _gather_local(kv_pages, page_table)  # [B, S, Dl + Dr]
    mask, used = _masks(local_lens, kv.shape[1])
    kv = _zero_unused(kv, used)
    k_lat, k_rope = kv[..., :dl], kv[..., dl:]
    f32 = jnp.float32
    scores = jnp.einsum("bqhc,bsc->bqhs", q_latent, k_lat, precision=_HIGHEST,
                        preferred_element_type=f32)
    scores = scores + jnp.einsum("bqhc,bsc->bqhs", q_rope, k_rope, precision=_HIGHEST,
                                 preferred_element_type=f32)
    p, lse = _softmax_partial(scores * softmax_scale, mask)
    out = _attend(p, k_lat, local_lens, "bqhs,bsc->bqhc", "bqhs,bqsc->bqhc")
    return out.astype(q_latent.dtype), lse


def gqa_partial(q, k_pages, v_pages, page_table, local_lens, *, softmax_scale: float):
    """GQA/MHA attention of all query heads against ONE rank's paged local K and V.

    KV heads are replicated inside the DCP group: every rank holds all ``Hkv`` KV heads of the
    tokens it owns. Query head h uses KV head ``h // (H / Hkv)`` (MHA: ``Hkv = H``).

    Args:
      q: [B, Q, H, D] queries.
      k_pages: [num_pages, page_size, Hkv, D] this rank's key pages.
      v_pages: [num_pages, page_size, Hkv, Dv] this rank's value pages.
      page_table: i32[B, max_pages] this rank's page ids per request.
      local_lens: i32[B, Q] local tokens visible to each query.
      softmax_scale: multiplies the raw scores (usually ``1/sqrt(D)``).

    Returns:
      ``(out [B, Q, H, Dv] in q's dtype, lse f32[B, Q, H] natural log)``; NaN as
      :func:`mla_partial` (a NaN value entry: out NaN in its column, lse finite).
    """
    b, qn, h, d = q.shape
    hkv, dv = k_pages.shape[2], v_pages.shape[-1]  # explicit sizes, no -1: B or Q may be 0
    k = _gather_local(k_pages, page_table)  # [B, S, Hkv, D]
    v = _gather_local(v_pages, page_table)
    mask, used = _masks(local_lens, k.shape[1])
    k, v = _zero_unused(k, used), _zero_unused(v, used)
    qg = q.reshape(b, qn, hkv, h // hkv, d)
    f32 = jnp.float32
    scores = jnp.einsum("bqkgd,bskd->bqkgs", qg, k, precision=_HIGHEST, preferred_element_type=f32)
    s = k.shape[1]
    p, lse = _softmax_partial(scores.reshape(b, qn, h, s) * softmax_scale, mask)
    pg = p.reshape(b, qn, hkv, h // hkv, s)
    out = _attend(pg, v, local_lens, "bqkgs,bskd->bqkgd", "bqkgs,bqskd->bqkgd")
    return out.reshape(b, qn, h, dv).astype(q.dtype), lse


# --------------------------------------------------------------------------------------------
# Local lengths
# --------------------------------------------------------------------------------------------


def local_kv_lens(kv_lens, query_len: int, *, dcp_size: int, interleave_size: int = 1):
    """Local tokens each query sees on each rank: ``local_len(kv_lens - Q + j + 1, r)``.

    Args:
      kv_lens: i32[B] cached tokens per request including its ``query_len`` query tokens.
      query_len: Q, query tokens per request (static).
      dcp_size: N (static).
      interleave_size: I (static).

    Returns:
      i32[N, B, Q]: entry (r, b, j) is the number of tokens of rank r that query j of request b
      attends (its visible prefix is clamped at 0 tokens).

    Raises:
      ValueError / TypeError: bad static ints (from ``dcp_jax.layout``), ``query_len`` not an
        int >= 0, concrete ``kv_lens`` not integers.
    """
    layout.check_layout_args(dcp_size, interleave_size)
    query_len = check_int("query_len", query_len, minimum=0)
    if not isinstance(kv_lens, jax.core.Tracer):  # as given: jnp.asarray would call a float64 float32
        dtype = kv_lens.dtype if hasattr(kv_lens, "dtype") else np.asarray(kv_lens).dtype  # no device read
        if np.dtype(dtype).kind not in "iu":
            raise TypeError(f"kv_lens must hold integers (tokens per request), got dtype {dtype}")
    kv_lens = jnp.asarray(kv_lens, dtype=jnp.int32)
    visible = kv_lens[:, None] - query_len + 1 + jnp.arange(query_len, dtype=jnp.int32)[None, :]
    visible = jnp.maximum(visible, 0)  # layout's formulas want non-negative lengths
    return jnp.stack([
        jnp.asarray(layout.local_len(visible, dcp_size, r, interleave_size), dtype=jnp.int32)
        for r in range(dcp_size)
    ])
