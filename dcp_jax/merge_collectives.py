"""The collective forms of the merge, called INSIDE ``jax.shard_map`` over the DCP axis.

:func:`merge_ag_rs` (all-gather LSEs, reduce-scatter heads), :func:`merge_ag_ar` (all-reduce,
every rank keeps all heads) and :func:`merge_a2a` (all-to-all of head slices, then an N-way local
merge), all on the one merge core of :mod:`dcp_jax.merge_core` (spec section 7);
:func:`local_merge_fn` picks one by name. Their mesh-level wrappers (``ag_rs``, ``ag_ar``,
``a2a``) are in :mod:`dcp_jax.merge`, which re-exports every name.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from dcp_jax.merge_core import (
    DEFAULT_AXIS_NAME,
    MERGE_FORMS,
    _check_base,
    _check_widths,
    _compute_dtype,
    _live,
    _merge_core,
    _merge_weights,
    _weighted,
)

__all__ = ["merge_ag_rs", "merge_ag_ar", "merge_a2a", "local_merge_fn"]


# --------------------------------------------------------------------------------------------
# Collective forms, to be called INSIDE jax.shard_map over the DCP axis
# --------------------------------------------------------------------------------------------


def _check_local(out, lse, axis_name: str, form: str) -> int:
    if out.ndim != 3 or lse.ndim != 2 or out.shape[:2] != lse.shape:
        raise ValueError(
            f"{form}: per-rank out must be [T, H, D] and lse [T, H], got {out.shape=} {lse.shape=}"
        )
    _check_widths(out.shape, form)  # before any collective: H = 0 / D = 0 crash XLA:CPU
    n = jax.lax.axis_size(axis_name)
    h = out.shape[1]
    if h % n != 0:
        raise ValueError(f"{form}: heads H={h} must divide by the {axis_name!r} axis size N={n}")
    return n


def merge_ag_rs(out, lse, *, axis_name: str = DEFAULT_AXIS_NAME, base: str = "e",
                propagate_nan: bool = False):
    """AG+RS merge inside ``shard_map``: rank r ends with heads ``[r*H/N, (r+1)*H/N)``.

    Steps: (1) all-gather the LSEs over ``axis_name`` (``[N, T, H]``, small); (2) merge core ->
    this rank's weight ``exp(lse_r - lse)``; (3) correct the local output (empty -> exact 0);
    (4) reduce-scatter the corrected ``[T, H, D]`` over heads. vLLM / sglang DCP combine.

    Args:
      out: [T, H, D] this rank's partial output over its local KV (any float dtype).
      lse: f32[T, H] this rank's LSE (token-major) in ``base``.
      axis_name: the DCP mesh axis (default "dcp").
      base: "e" (default) or "2".
      propagate_nan: NaN in, NaN out (off by default): a NaN or +inf LSE on any rank makes that
        (token, head) NaN (``merge_core._merge_weights``); -inf stays empty. Either way a live
        shard's ``out`` is multiplied by its weight (a NaN survives an underflowed weight) and
        an empty one's is dropped (``merge_core._weighted``); the DCP attention forms pass True.

    Returns:
      ``(out [T, H/N, D] in out's dtype, lse f32[T, H/N])``. N = 1 (a one-rank axis) returns the inputs
      unchanged (spec section 7): no empty-shard normalisation, ``lse`` keeps its dtype.

    Raises:
      ValueError: H not divisible by N, H = 0 or D = 0 (message names ``out``; XLA:CPU's
        collectives crash on zero-width operands), bad shapes or ``base`` (at trace time).
    """
    base = _check_base(base)
    n = _check_local(out, lse, axis_name, "merge_ag_rs")
    if n == 1:
        return out, lse
    cdtype = _compute_dtype(out.dtype, lse.dtype)
    lse_c = lse.astype(cdtype)
    lse_all = jax.lax.all_gather(lse_c, axis_name, axis=0)  # [N, T, H]
    w_all, merged = _merge_weights(lse_all, base=base, propagate_nan=propagate_nan)
    r = jax.lax.axis_index(axis_name)
    w_local = jax.lax.dynamic_index_in_dim(w_all, r, axis=0, keepdims=False)  # [T, H]
    live = _live(lse_c, propagate_nan=propagate_nan)  # this rank's shard: empty -> exact 0
    corrected = _weighted(out, w_local, live)  # [T, H, D] in cdtype
    o = jax.lax.psum_scatter(corrected, axis_name, scatter_dimension=1, tiled=True)
    hs = out.shape[1] // n
    l = jax.lax.dynamic_slice_in_dim(merged, r * hs, hs, axis=1)
    return o.astype(out.dtype), l.astype(jnp.promote_types(jnp.float32, lse.dtype))


def merge_ag_ar(out, lse, *, axis_name: str = DEFAULT_AXIS_NAME, base: str = "e",
                propagate_nan: bool = False):
    """AG+AR merge inside ``shard_map``: every rank ends with all heads.

    Like :func:`merge_ag_rs` but step (4) is an all-reduce (``psum``) of the corrected output.

    Args:
      out: [T, H, D] this rank's partial output (any float dtype).
      lse: f32[T, H] this rank's LSE in ``base``.
      axis_name: the DCP mesh axis (default "dcp").
      base: "e" (default) or "2".
      propagate_nan: NaN in, NaN out (off by default): a NaN or +inf LSE on any rank makes that
        (token, head) NaN (``merge_core._merge_weights``); -inf stays empty. Either way a live
        shard's ``out`` is multiplied by its weight (a NaN survives an underflowed weight) and
        an empty one's is dropped (``merge_core._weighted``); the DCP attention forms pass True.

    Returns:
      ``(out [T, H, D] in out's dtype, lse f32[T, H])``, the same on every rank. N = 1 (a one-rank axis) returns the inputs
      unchanged (spec section 7): no empty-shard normalisation, ``lse`` keeps its dtype.

    Raises:
      ValueError: H not divisible by N, H = 0 or D = 0 (names ``out``), bad shapes or ``base``.
    """
    base = _check_base(base)
    n = _check_local(out, lse, axis_name, "merge_ag_ar")
    if n == 1:
        # Unchanged values; a psum over one rank is the identity and marks them replicated
        # (invariant over the axis) as an all-heads result must be.
        return jax.lax.psum(out, axis_name), jax.lax.psum(lse, axis_name)
    cdtype = _compute_dtype(out.dtype, lse.dtype)
    lse_c = lse.astype(cdtype)
    lse_all = jax.lax.all_gather(lse_c, axis_name, axis=0, to="invarying")
    w_all, merged = _merge_weights(lse_all, base=base, propagate_nan=propagate_nan)
    r = jax.lax.axis_index(axis_name)
    w_local = jax.lax.dynamic_index_in_dim(w_all, r, axis=0, keepdims=False)
    live = _live(lse_c, propagate_nan=propagate_nan)
    o = jax.lax.psum(_weighted(out, w_local, live), axis_name)
    return o.astype(out.dtype), merged.astype(jnp.promote_types(jnp.float32, lse.dtype))


def merge_a2a(out, lse, *, axis_name: str = DEFAULT_AXIS_NAME, base: str = "e",
              propagate_nan: bool = False):
    """All-to-all merge inside ``shard_map``: rank r ends with heads ``[r*H/N, (r+1)*H/N)``.

    Each rank sends head slice j of its partial (out and LSE) to rank j, receives the N partials
    of its own heads ``[N, T, H/N, D]`` and merges them locally with the merge core
    (tpu-inference's ``_dcp_a2a_reduce`` pattern: one collective, N-way local merge).

    Args:
      out: [T, H, D] this rank's partial output (any float dtype).
      lse: f32[T, H] this rank's LSE in ``base``.
      axis_name: the DCP mesh axis (default "dcp").
      base: "e" (default) or "2".
      propagate_nan: NaN in, NaN out (off by default): a NaN or +inf LSE on any rank makes that
        (token, head) NaN (``merge_core._merge_weights``); -inf stays empty. Either way a live
        shard's ``out`` is multiplied by its weight (a NaN survives an underflowed weight) and
        an empty one's is dropped (``merge_core._weighted``); the DCP attention forms pass True.

    Returns:
      ``(out [T, H/N, D] in out's dtype, lse f32[T, H/N])``. N = 1 (a one-rank axis) returns the inputs
      unchanged (spec section 7): no empty-shard normalisation, ``lse`` keeps its dtype.

    Raises:
      ValueError: H not divisible by N, H = 0 or D = 0 (names ``out``), bad shapes or ``base``.
    """
    base = _check_base(base)
    n = _check_local(out, lse, axis_name, "merge_a2a")
    if n == 1:
        return out, lse
    t, h, d = out.shape
    hs = h // n
    # [T, H, D] -> [N(dest), T, H/N, D]; after all_to_all axis 0 indexes the source rank.
    o_split = jnp.moveaxis(out.reshape(t, n, hs, d), 1, 0)
    l_split = jnp.moveaxis(lse.reshape(t, n, hs), 1, 0)
    o_recv = jax.lax.all_to_all(o_split, axis_name, split_axis=0, concat_axis=0, tiled=True)
    l_recv = jax.lax.all_to_all(l_split, axis_name, split_axis=0, concat_axis=0, tiled=True)
    o, l = _merge_core(o_recv, l_recv, base=base, propagate_nan=propagate_nan)
    return o.astype(out.dtype), l.astype(jnp.promote_types(jnp.float32, lse.dtype))


_LOCAL_FORMS: dict[str, Callable] = {"ag_rs": merge_ag_rs, "ag_ar": merge_ag_ar, "a2a": merge_a2a}


def local_merge_fn(form: str) -> Callable:
    """Returns the in-``shard_map`` merge for ``form`` in ``MERGE_FORMS``.

    Raises:
      ValueError: unknown ``form``.
    """
    if form not in _LOCAL_FORMS:
        raise ValueError(f"{form=} must be one of {MERGE_FORMS}")
    return _LOCAL_FORMS[form]
