"""Argument checks of the DCP decode attention forms (:mod:`dcp_jax.attention`).

Shapes, dtypes, the page table against the cache, ``softmax_scale`` and the merge form; every
check raises before anything is traced and names the argument. Private helpers, called by
:mod:`dcp_jax.attention`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dcp_jax import layout
from dcp_jax.merge import MERGE_FORMS


def _concrete(x):
    """``x`` as a numpy array when it holds values, None when it is traced (jit, vmap, grad)."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def _check_integer_dtype(name, given):
    """Refuses a non-integer ``given`` (the caller's array as given: a host copy of a concrete
    one, so a float64 is named float64, not the float32 ``jnp.asarray`` would make of it).

    Raises:
        TypeError: naming ``name`` and the given dtype.
    """
    if not jnp.issubdtype(given.dtype, jnp.integer):
        raise TypeError(f"{name} must be integer, got {name}.dtype={given.dtype}")


def _check_common(q, q_name, page_table, kv_lens, cache_shape, name_cache, interleave_size):
    """Checks the shared arguments; returns (page table i32[N, B, max_pages], kv_lens i32[B]).

    Concrete ``page_table`` / ``kv_lens`` are also checked against the cache on the host
    (:func:`_check_pages`); traced ones cannot be (see the attention forms' docstrings).
    """
    pt_host, lens_host = _concrete(page_table), _concrete(kv_lens)
    page_table, kv_lens = jnp.asarray(page_table), jnp.asarray(kv_lens)
    b = q.shape[0]
    n_ranks, num_pages, page_size = cache_shape[:3]
    shared = page_table.ndim == 2 and page_table.shape[0] == b
    if shared:
        # sglang's convention (spec section 3): one table of virtual page ids for every rank.
        page_table = jnp.broadcast_to(page_table, (n_ranks,) + page_table.shape)
    if page_table.ndim != 3 or page_table.shape[:2] != (n_ranks, b):
        raise ValueError(
            f"page_table must be [N, B, max_pages] = [{n_ranks}, {b}, ...] or shared "
            f"[B, max_pages], got {page_table.shape=}"
        )
    _check_integer_dtype("page_table", page_table if pt_host is None else pt_host)
    if kv_lens.shape != (b,):
        raise ValueError(f"kv_lens must be [B] = [{b}], got {kv_lens.shape=}")
    _check_integer_dtype("kv_lens", kv_lens if lens_host is None else lens_host)
    if q.shape[2] < 1:
        raise ValueError(f"{q_name} needs at least one head, got {q_name}.shape={q.shape}")
    if page_table.shape[-1] < 1:
        raise ValueError(f"page_table needs at least one page per request (max_pages >= 1), "
                         f"got {page_table.shape=}")
    if num_pages < 1:
        raise ValueError(f"{name_cache} needs at least one page")
    if page_size < 1:
        raise ValueError(f"{name_cache} pages must hold at least one token, got page_size={page_size}")
    n_ranks, interleave_size, _ = layout.check_layout_args(n_ranks, interleave_size)
    _check_pages(pt_host, lens_host, max_pages=page_table.shape[-1], shared=shared, n=n_ranks,
                 interleave_size=interleave_size, page_size=page_size, num_pages=num_pages,
                 name_cache=name_cache)
    return page_table.astype(jnp.int32), kv_lens.astype(jnp.int32)


def _check_pages(pt, lens, *, max_pages, shared, n, interleave_size, page_size, num_pages,
                 name_cache):
    """Host check of what the attention will read: one vectorised numpy pass.

    ``lens`` (kv_lens, None when traced) must be >= 0 and fit the table: rank r reads
    ``ceil(local_len(kv_lens[b], r) / page_size)`` pages of request b (``dcp_jax.layout``).
    Those entries of ``pt`` (None when traced; [B, max_pages] when ``shared``) must be pages of
    the cache, ``0 <= id < num_pages``; entries past them are padding and are not looked at.
    """
    if lens is None:
        return
    lens = lens.astype(np.int64)
    if lens.size and lens.min() < 0:
        bi = int(np.argmin(lens))
        raise ValueError(f"kv_lens[{bi}]={int(lens[bi])} must be >= 0 tokens")
    local = layout.local_len_np(lens[None, :], n, np.arange(n)[:, None], interleave_size)  # [N, B]
    need = -(-local // page_size)  # pages rank r reads for request b
    over = need > max_pages
    if over.any():
        r, bi = (int(v) for v in np.argwhere(over)[0])
        raise ValueError(
            f"kv_lens[{bi}]={int(lens[bi])} does not fit the page table: rank {r} holds "
            f"{int(local[r, bi])} of its tokens, {int(need[r, bi])} pages of {page_size}, but "
            f"page_table has max_pages={max_pages}"
        )
    if pt is None:
        return
    if shared:
        pt = pt[None]  # [1, B, max_pages]; rank 0 reads the most pages of every rank
        need = need.max(axis=0, keepdims=True)
    used = np.arange(max_pages) < need[..., None]  # [N, B, max_pages]
    bad = used & ((pt < 0) | (pt >= num_pages))
    if bad.any():
        r, bi, k = (int(v) for v in np.argwhere(bad)[0])
        where = f"page_table[{bi}, {k}]" if shared else f"page_table[{r}, {bi}, {k}]"
        raise ValueError(
            f"{where}={int(pt[r, bi, k])} is not a page of the cache ({name_cache} has "
            f"num_pages={num_pages}); it is read for kv_lens[{bi}]={int(lens[bi])}"
        )


def _check_scale(softmax_scale) -> float:
    """``softmax_scale`` as a Python float: any real scalar (Python int/float, numpy scalar,
    0-d numpy or JAX array); not bool, complex, a string, a non-scalar, non-finite or <= 0.

    It is compiled into the kernel as a constant, so a traced value (the call inside
    ``jax.jit`` with the scale as a jitted argument) is refused too.
    """
    x = softmax_scale
    if isinstance(x, jax.core.Tracer):
        raise TypeError("softmax_scale must be a concrete real scalar (it is a compile-time "
                        "constant), got a traced value: pass it as a Python float or mark it static")
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        value = float(x)
    else:
        arr = np.asarray(x) if isinstance(x, (np.ndarray, np.generic, jax.Array)) else None
        if arr is None or not (np.issubdtype(arr.dtype, np.floating)
                               or np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"softmax_scale must be a real scalar (float, int, numpy or 0-d array), "
                            f"got {type(x).__name__} ({softmax_scale=!r})")
        if arr.shape != ():
            raise ValueError(f"softmax_scale must be a scalar, got an array of shape {arr.shape}")
        value = float(arr)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softmax_scale must be positive and finite, got softmax_scale={value}")
    f32 = float(np.float32(value)) if value <= float(np.finfo(np.float32).max) else math.inf
    if not (math.isfinite(f32) and f32 > 0):  # the scores are float32: 1e308 made them all NaN
        raise ValueError(f"softmax_scale={value} is past float32's range (it scales float32 scores): "
                         f"give a value in [{np.finfo(np.float32).smallest_subnormal:g}, "
                         f"{np.finfo(np.float32).max:g}]")
    return value


def _check_float(**arrays):
    """Queries and caches must hold floats: an integer query would give a truncated integer
    output, an integer cache raw (not dequantised) values."""
    for name, x in arrays.items():
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating dtype (float32, bfloat16, float16; "
                            f"dequantise an integer cache first), got {name}.dtype={x.dtype}")


def _check_width(name, x, dim_name):
    """Zero-width features are refused: the DCP forms' all-gather / merge collectives crash
    XLA:CPU (SIGSEGV) on an empty operand, so the check runs before anything is traced."""
    if x.shape[-1] < 1:
        raise ValueError(f"{name} needs at least one feature ({dim_name} >= 1), got "
                         f"{name}.shape={x.shape}")


def _check_mla(q_latent, q_rope, kv_cache, page_table, kv_lens, interleave_size):
    q_latent, q_rope, kv_cache = map(jnp.asarray, (q_latent, q_rope, kv_cache))
    _check_float(q_latent=q_latent, q_rope=q_rope, kv_cache=kv_cache)
    if q_latent.ndim != 4 or q_rope.ndim != 4 or q_latent.shape[:3] != q_rope.shape[:3]:
        raise ValueError(
            f"q_latent [B, Q, H, Dl] and q_rope [B, Q, H, Dr] must agree, got "
            f"{q_latent.shape=} {q_rope.shape=}"
        )
    _check_width("q_latent", q_latent, "Dl")
    _check_width("q_rope", q_rope, "Dr")
    dl, dr = q_latent.shape[-1], q_rope.shape[-1]
    if kv_cache.ndim != 4 or kv_cache.shape[-1] != dl + dr:
        raise ValueError(
            f"kv_cache must be [N, num_pages, page_size, Dl + Dr = {dl + dr}], got {kv_cache.shape=}"
        )
    page_table, kv_lens = _check_common(q_latent, "q_latent", page_table, kv_lens, kv_cache.shape,
                                        "kv_cache", interleave_size)
    return q_latent, q_rope, kv_cache, page_table, kv_lens


def _check_gqa(q, k_cache, v_cache, page_table, kv_lens, interleave_size):
    q, k_cache, v_cache = map(jnp.asarray, (q, k_cache, v_cache))
    _check_float(q=q, k_cache=k_cache, v_cache=v_cache)
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
    _check_width("q", q, "D")
    _check_width("v_cache", v_cache, "Dv")
    hkv = k_cache.shape[3]
    if hkv < 1:
        raise ValueError(f"k_cache needs at least one KV head (Hkv >= 1), got {k_cache.shape=}")
    if q.shape[2] % hkv != 0:
        raise ValueError(f"query heads H={q.shape[2]} must be a multiple of KV heads Hkv={hkv}")
    page_table, kv_lens = _check_common(q, "q", page_table, kv_lens, k_cache.shape, "k_cache",
                                        interleave_size)
    return q, k_cache, v_cache, page_table, kv_lens


def _check_form(merge, h, n, axis_name):
    if merge not in MERGE_FORMS:
        raise ValueError(f"{merge=} must be one of {MERGE_FORMS}")
    if h % n != 0:
        raise ValueError(f"heads H={h} must divide by the {axis_name!r} axis size N={n}")
