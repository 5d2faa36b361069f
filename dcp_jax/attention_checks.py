"""Argument checks of the DCP decode attention forms (:mod:`dcp_jax.attention`).

Shapes, dtypes, the page table against the cache, ``softmax_scale`` and the merge form; every
check raises before anything is traced and names the argument. Private helpers, called by
:mod:`dcp_jax.attention`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from dcp_jax.merge import MERGE_FORMS


def _check_common(q, page_table, kv_lens, n_ranks, num_pages_axis_len, name_cache):
    """Checks the shared arguments; returns the page table as i32[N, B, max_pages]."""
    b = q.shape[0]
    if page_table.ndim == 2 and page_table.shape[0] == b:
        # sglang's convention (spec section 3): one table of virtual page ids for every rank.
        page_table = jnp.broadcast_to(page_table, (n_ranks,) + page_table.shape)
    if page_table.ndim != 3 or page_table.shape[:2] != (n_ranks, b):
        raise ValueError(
            f"page_table must be [N, B, max_pages] = [{n_ranks}, {b}, ...] or shared "
            f"[B, max_pages], got {page_table.shape=}"
        )
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise TypeError(f"page_table must be integer, got {page_table.dtype=}")
    if kv_lens.shape != (b,):
        raise ValueError(f"kv_lens must be [B] = [{b}], got {kv_lens.shape=}")
    if not jnp.issubdtype(kv_lens.dtype, jnp.integer):
        raise TypeError(f"kv_lens must be integer, got {kv_lens.dtype=}")
    if num_pages_axis_len < 1:
        raise ValueError(f"{name_cache} needs at least one page")
    return page_table.astype(jnp.int32)


def _check_scale(softmax_scale):
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not (
        math.isfinite(softmax_scale) and softmax_scale > 0
    ):
        raise ValueError(f"{softmax_scale=} must be a positive finite float")
    return float(softmax_scale)


def _check_mla(q_latent, q_rope, kv_cache, page_table, kv_lens):
    q_latent, q_rope, kv_cache = map(jnp.asarray, (q_latent, q_rope, kv_cache))
    page_table, kv_lens = jnp.asarray(page_table), jnp.asarray(kv_lens)
    if q_latent.ndim != 4 or q_rope.ndim != 4 or q_latent.shape[:3] != q_rope.shape[:3]:
        raise ValueError(
            f"q_latent [B, Q, H, Dl] and q_rope [B, Q, H, Dr] must agree, got "
            f"{q_latent.shape=} {q_rope.shape=}"
        )
    dl, dr = q_latent.shape[-1], q_rope.shape[-1]
    if kv_cache.ndim != 4 or kv_cache.shape[-1] != dl + dr:
        raise ValueError(
            f"kv_cache must be [N, num_pages, page_size, Dl + Dr = {dl + dr}], got {kv_cache.shape=}"
        )
    page_table = _check_common(q_latent, page_table, kv_lens, kv_cache.shape[0], kv_cache.shape[1],
                               "kv_cache")
    return q_latent, q_rope, kv_cache, page_table, kv_lens.astype(jnp.int32)


def _check_gqa(q, k_cache, v_cache, page_table, kv_lens):
    q, k_cache, v_cache = map(jnp.asarray, (q, k_cache, v_cache))
    page_table, kv_lens = jnp.asarray(page_table), jnp.asarray(kv_lens)
    if q.ndim != 4:
        raise ValueError(f"q must be [B, Q, H, D], got {q.shape=}")
    if k_cache.ndim != 5 or k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k_cache must be [N, num_pages, page_size, Hkv, D={q.shape[-1]}], got {k_cache.shape=}"
        )
    if v_cache.ndim != 5 or v_cache.shape[:4] != k_cache.shape[:4]:
        raise ValueError(
            f"v_cache must be [N, num_pages, page_size, Hkv, Dv] like k_cache, got {v_cache.shape=}"
        )
    hkv = k_cache.shape[3]
    if q.shape[2] % hkv != 0:
        raise ValueError(f"query heads H={q.shape[2]} must be a multiple of KV heads Hkv={hkv}")
    page_table = _check_common(q, page_table, kv_lens, k_cache.shape[0], k_cache.shape[1], "k_cache")
    return q, k_cache, v_cache, page_table, kv_lens.astype(jnp.int32)


def _check_form(merge, h, n, axis_name):
    if merge not in MERGE_FORMS:
        raise ValueError(f"{merge=} must be one of {MERGE_FORMS}")
    if h % n != 0:
        raise ValueError(f"heads H={h} must divide by the {axis_name!r} axis size N={n}")
