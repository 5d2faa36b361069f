"""The per-rank paged layout of contiguous KV, and float64 references over the full KV.

:func:`paginate_kv` lays out each request's KV as N per-rank paged caches (spec sections 2-3);
:func:`mla_decode_reference` and :func:`gqa_decode_reference` are the single-device numpy oracles
the DCP forms of :mod:`dcp_jax.attention` (which re-exports every name) are checked against.
"""

from __future__ import annotations

import numpy as np

from dcp_jax import layout

__all__ = ["gqa_decode_reference", "mla_decode_reference", "paginate_kv"]


def paginate_kv(kv, kv_lens, *, dcp_size: int, page_size: int, interleave_size: int = 1,
                fill=0.0, shuffle_seed: int | None = None, extra_pages: int = 0,
                shared_page_table: bool = False):
    """Lays out contiguous per-request KV as N per-rank paged caches (spec sections 2-3).

    Token t of request b goes to rank ``owner(t)``, local index ``j = local_index(t)``, row
    ``page_table[r, b, j // P] * P + j % P`` of that rank's pages.

    Args:
      kv: [B, S, ...] KV rows of each request in token order (only ``kv[b, :kv_lens[b]]`` used).
      kv_lens: i64[B] tokens per request (each <= S).
      dcp_size: N ranks.
      page_size: P tokens per page.
      interleave_size: I tokens per ownership block.
      fill: value of every unused row (tests pass NaN to poison free slots).
      shuffle_seed: if given, page ids are randomly permuted per rank (else allocated in order).
      extra_pages: spare pages per rank (left at ``fill``).
      shared_page_table: every rank uses the same page ids (sglang's convention, spec section
        3); the table is then returned as ``[B, max_pages]``.

    Returns:
      ``(cache np[N, num_pages, P, ...] in kv's dtype, page_table np.int32[N, B, max_pages])``
      (``[B, max_pages]`` with ``shared_page_table``)
      with ``max_pages = max(1, ceil(max_r,b local_len / P))`` and ``num_pages = B * max_pages +
      extra_pages``.

    Raises:
      ValueError: bad layout ints, ``page_size < 1``, ``kv_lens`` outside ``[0, S]`` or not [B].
      TypeError: ``kv_lens`` not integers.
    """
    kv = np.asarray(kv)
    given = np.asarray(kv_lens)
    if given.size and given.dtype.kind not in "iu":  # 2.7 would silently become 2
        raise TypeError(f"kv_lens must hold integers (tokens per request), got dtype {given.dtype}: {given!r}")
    kv_lens = given.astype(np.int64)
    n, i, _ = layout.check_layout_args(dcp_size, interleave_size)
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"{page_size=} must be a positive int")
    if kv.ndim < 2 or kv_lens.shape != (kv.shape[0],):
        raise ValueError(f"kv must be [B, S, ...] and kv_lens [B], got {kv.shape=} {kv_lens.shape=}")
    if (kv_lens < 0).any() or (kv_lens > kv.shape[1]).any():
        raise ValueError(f"kv_lens must lie in [0, S={kv.shape[1]}], got {kv_lens=}")
    if isinstance(extra_pages, bool) or not isinstance(extra_pages, (int, np.integer)) or extra_pages < 0:
        raise ValueError(f"{extra_pages=} must be a non-negative int")
    b = kv.shape[0]
    lens = np.stack([layout.local_len_np(kv_lens, n, r, i) for r in range(n)])  # [N, B]
    max_pages = max(1, int(-(-lens.max(initial=0) // page_size)))
    num_pages = b * max_pages + extra_pages
    cache = np.full((n, num_pages, page_size) + kv.shape[2:], fill, dtype=kv.dtype)
    rng = None if shuffle_seed is None else np.random.default_rng(shuffle_seed)
    page_table = np.empty((n, b, max_pages), dtype=np.int32)
    for r in range(n):
        if r == 0 or not shared_page_table:
            ids = np.arange(num_pages) if rng is None else rng.permutation(num_pages)
        page_table[r] = ids[: b * max_pages].reshape(b, max_pages)
    for bi in range(b):
        t = np.arange(kv_lens[bi])
        if t.size == 0:
            continue
        own = layout.owner_np(t, n, i)
        j = layout.local_index_np(t, n, i)
        pages = page_table[own, bi, j // page_size]
        cache[own, pages, j % page_size] = kv[bi, t]
    return cache, (page_table[0] if shared_page_table else page_table)


def _softmax_ref(scores):
    """f64 scores [H, S] -> (p [H, S], lse [H]) with S possibly 0."""
    if scores.shape[-1] == 0:
        return np.zeros_like(scores), np.full(scores.shape[:-1], -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    e = np.exp(scores - m)
    tot = e.sum(axis=-1, keepdims=True)
    return e / tot, (m + np.log(tot))[..., 0]


def mla_decode_reference(q_latent, q_rope, kv, kv_lens, *, softmax_scale: float):
    """Single-device absorbed MLA over each request's FULL KV, float64 numpy (the oracle).

    Args:
      q_latent: [B, Q, H, Dl]; q_rope: [B, Q, H, Dr].
      kv: [B, S, Dl + Dr] contiguous KV per request in token order.
      kv_lens: [B] tokens per request including its Q query tokens.
      softmax_scale: score multiplier.

    Returns:
      ``(out f64[B, Q, H, Dl], lse f64[B, Q, H])``; query j sees ``kv_lens - Q + j + 1`` tokens.
    """
    ql, qr, kv = (np.asarray(x, dtype=np.float64) for x in (q_latent, q_rope, kv))
    b, qn, h, dl = ql.shape
    out = np.zeros((b, qn, h, dl))
    lse = np.zeros((b, qn, h))
    for bi in range(b):
        for j in range(qn):
            vis = max(0, int(kv_lens[bi]) - qn + j + 1)
            k = kv[bi, :vis]
            s = softmax_scale * (ql[bi, j] @ k[:, :dl].T + qr[bi, j] @ k[:, dl:].T)
            p, lse[bi, j] = _softmax_ref(s)
            out[bi, j] = p @ k[:, :dl]
    return out, lse


def gqa_decode_reference(q, k, v, kv_lens, *, softmax_scale: float):
    """Single-device GQA/MHA over each request's full K/V, float64 numpy.

    Args:
      q: [B, Q, H, D]; k: [B, S, Hkv, D]; v: [B, S, Hkv, Dv]; kv_lens: [B].
      softmax_scale: score multiplier.

    Returns:
      ``(out f64[B, Q, H, Dv], lse f64[B, Q, H])``.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, qn, h, _ = q.shape
    g = h // k.shape[2]
    out = np.zeros((b, qn, h, v.shape[-1]))
    lse = np.zeros((b, qn, h))
    for bi in range(b):
        for j in range(qn):
            vis = max(0, int(kv_lens[bi]) - qn + j + 1)
            for hh in range(h):
                s = softmax_scale * (k[bi, :vis, hh // g] @ q[bi, j, hh])
                p, l = _softmax_ref(s[None])
                lse[bi, j, hh] = l[0]
                out[bi, j, hh] = p[0] @ v[bi, :vis, hh // g]
    return out, lse
