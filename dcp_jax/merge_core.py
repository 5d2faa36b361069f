"""The one merge core of the exact LSE merge, and the checks every merge form shares.

:func:`_merge_weights` (per-shard weights ``exp(lse_r - lse)`` and the merged LSE) and
:func:`_weighted` (an empty shard's term selected as 0, every live shard's multiplied) are the
formula of spec section 7; :func:`_live` says which shards are empty; :func:`_merge_core` is the
N-way merge of stacked states. Their ``propagate_nan`` option (off by default; the DCP attention
forms turn it on) makes NaN / +inf LSEs poison instead of mark empty, so NaN in gives NaN out.
Also the trace-time argument checks and the constants (``BASES``, ``LSE_LAYOUTS``,
``MERGE_FORMS``, ``DEFAULT_AXIS_NAME``). The formula and conventions are in
:mod:`dcp_jax.merge`, which re-exports every name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BASES", "LSE_LAYOUTS", "MERGE_FORMS", "DEFAULT_AXIS_NAME"]

BASES = ("e", "2")
LSE_LAYOUTS = ("TH", "HT")
MERGE_FORMS = ("ag_rs", "ag_ar", "a2a")
DEFAULT_AXIS_NAME = "dcp"
_UNROLL_MAX_SHARDS = 16  # up to this many partials the N-way sum is unrolled (see _merge_core)


# --------------------------------------------------------------------------------------------
# Validation (trace-time, static shapes and knobs)
# --------------------------------------------------------------------------------------------


def _check_base(base) -> str:
    # Accept the int 2 as a courtesy; anything else must be spelled "e" or "2".
    if isinstance(base, int) and not isinstance(base, bool) and base == 2:
        return "2"
    if base not in BASES:
        raise ValueError(f"{base=} must be one of {BASES} (natural log or base 2)")
    return base


def _check_layout(lse_layout) -> str:
    if lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"{lse_layout=} must be 'TH' (token-major) or 'HT' (head-major)")
    return lse_layout


def _as_float_array(x, name: str) -> jax.Array:
    if isinstance(x, jax.Array):
        arr = x
    elif isinstance(x, np.ndarray):
        arr = jnp.asarray(_narrowed(x, name))
    else:
        try:
            host = np.asarray(x, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} must be an array of floats, got {type(x).__name__}") from e
        arr = jnp.asarray(_narrowed(host, name), dtype=jnp.float32)
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {name}.dtype={arr.dtype}")
    return arr


def _narrowed(x: np.ndarray, name: str) -> np.ndarray:
    """``x`` as JAX will hold it: without ``jax_enable_x64`` JAX narrows float64 host input to
    float32, here once, on the host, checked: a finite value that rounds past float32's range
    would become inf, and an LSE of inf is an empty shard, silently dropped. A float wider than
    float64 (``np.longdouble``) JAX does not take at all. Other arrays come back as they are.

    Raises:
        ValueError: ``x`` (named ``name``) holds a finite value that float32 rounds to inf.
        TypeError: ``x`` is wider than float64.
    """
    if x.dtype.kind != "f" or x.dtype.itemsize <= 4:
        return x
    if x.dtype.itemsize > 8:
        raise TypeError(f"{name} has dtype {x.dtype}: JAX takes float16, bfloat16, float32 and float64 "
                        f"(give {name}.astype(np.float64))")
    if jax.dtypes.canonicalize_dtype(x.dtype) == x.dtype:
        return x  # x64: kept as it is
    with np.errstate(over="ignore"):
        narrow = x.astype(np.float32)  # what JAX's narrowing gives: the one conversion
    big = np.isinf(narrow) & np.isfinite(x)
    if big.any():
        what = " (an lse of inf marks an empty shard)" if name.startswith("lse") else ""
        raise ValueError(f"{name} holds finite values beyond float32's range (e.g. {x[big].flat[0]:g}), "
                         f"which JAX would narrow to inf{what}: enable jax_enable_x64 to merge "
                         f"in float64, or give values within float32")
    return narrow


def _check_stacked(out, lse, lse_layout: str) -> tuple[jax.Array, jax.Array]:
    """Checks out [N, T, H, D] and lse [N, T, H] (or [N, H, T]) and returns them as arrays."""
    out = _as_float_array(out, "out")
    lse = _as_float_array(lse, "lse")
    if out.ndim != 4:
        raise ValueError(f"out must be [N, T, H, D] (4-D), got {out.shape=}")
    if lse.ndim != 3:
        raise ValueError(f"lse must be [N, T, H] or [N, H, T] (3-D), got {lse.shape=}")
    n, t, h, _ = out.shape
    want = (n, t, h) if lse_layout == "TH" else (n, h, t)
    if lse.shape != want:
        raise ValueError(
            f"lse.shape={lse.shape} does not match out.shape={out.shape} for "
            f"{lse_layout=} (expected {want})"
        )
    if n == 0:
        raise ValueError(f"need at least one partial state, got {out.shape=}")
    return out, lse


def _check_widths(shape, form: str) -> None:
    """Refuses H = 0 or D = 0 in ``out [..., T, H, D]`` of a collective form (trace time).

    XLA:CPU's collectives crash the process (SIGSEGV) on a zero-width operand and ``psum_scatter``
    over 0 heads fails MLIR verification, so the check must fire before any collective is traced.
    T = 0 is fine there (the attention forms' B = 0 / Q = 0 rely on it).
    """
    h, d = shape[-2], shape[-1]
    if h < 1 or d < 1:
        raise ValueError(f"{form}: out needs at least one head and one feature (H >= 1, D >= 1), "
                         f"got out.shape={tuple(shape)}")


def _compute_dtype(*dtypes) -> jnp.dtype:
    # "Arithmetic in float32": bf16 / f16 are promoted; a float64 out OR lse (x64 mode) keeps
    # float64 (rounding a float64 LSE to float32 first shifts the weights by ulp_f32(|lse|)).
    return jnp.result_type(jnp.float32, *dtypes)


# --------------------------------------------------------------------------------------------
# The merge core
# --------------------------------------------------------------------------------------------


def _merge_weights(lse: jax.Array, *, base: str,
                   propagate_nan: bool = False) -> tuple[jax.Array, jax.Array]:
    """The one merge core: per-shard weights and the merged LSE.

    Args:
      lse: f32[N, ...] LSEs of N partial states (natural log for ``base="e"``, log2 for "2").
        Non-finite entries (-inf, +inf, NaN) mark empty shards, unless ``propagate_nan``.
      base: "e" or "2".
      propagate_nan: IEEE rule instead of the empty-shard rule for NaN and +inf: a NaN or +inf
        LSE in any shard (``exp(inf - inf)`` is NaN) makes every weight and the merged LSE of
        that position NaN; -inf still marks an empty shard (weight 0). The DCP attention forms
        use it (``dcp_jax.attention``: NaN in, NaN out); the merge forms default to False.

    Returns:
      ``(weights f32[N, ...], lse f32[...])``: ``weights[r] = exp(lse_r - lse)`` for non-empty
      shards and exactly 0 for empty ones (they sum to 1 unless all are empty); the merged LSE
      is ``-inf`` when all shards are empty. With ``propagate_nan``, NaN where poisoned. A live
      shard's weight may underflow to 0 too (``lse_r`` ~104 below the max in float32): tell
      empty from live by :func:`_live`, never by ``weights > 0``.
    """
    exp, log = (jnp.exp, jnp.log) if base == "e" else (jnp.exp2, jnp.log2)
    valid = jnp.isfinite(lse)
    lse_v = jnp.where(valid, lse, -jnp.inf)
    m = jnp.max(lse_v, axis=0)
    # All shards empty: m = -inf and (-inf) - (-inf) would be NaN; use 0 as the pivot instead.
    m = jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))
    # exp(-inf - m) = 0 already, but select anyway so no NaN pivot can reach the sum.
    w = jnp.where(valid, exp(lse_v - m), jnp.zeros_like(lse_v))
    s = jnp.sum(w, axis=0)
    any_valid = s > 0  # the max shard contributes exp(0) = 1, so s >= 1 when any is valid
    s_safe = jnp.where(any_valid, s, jnp.ones_like(s))  # 0/0 guard for the all-empty case
    merged = jnp.where(any_valid, m + log(s_safe), -jnp.inf)
    w = w / s_safe
    if propagate_nan:
        poisoned = jnp.any(jnp.isnan(lse) | (lse == jnp.inf), axis=0)
        w = jnp.where(poisoned, jnp.nan, w)
        merged = jnp.where(poisoned, jnp.nan, merged)
    return w, merged


def _live(lse: jax.Array, *, propagate_nan: bool = False) -> jax.Array:
    """bool mask of the shards that take part: lse finite (``propagate_nan``: lse != -inf, so a
    NaN / +inf shard stays in and poisons). The rest are empty: their ``out`` is ignored."""
    return lse != -jnp.inf if propagate_nan else jnp.isfinite(lse)


def _weighted(out: jax.Array, w: jax.Array, live: jax.Array) -> jax.Array:
    """``w * out`` for live shards, exactly 0 for empty ones whatever their ``out`` (NaN too).

    Args:
      out: [..., D] partial outputs (any float dtype; computed in ``w.dtype``).
      w: [...] weights from :func:`_merge_weights`.
      live: bool[...] from :func:`_live` (the same ``propagate_nan`` as ``w``).

    A live shard is multiplied even when its weight underflowed to 0 (IEEE: ``0 * NaN = NaN``,
    as the float64 references): its NaN / inf ``out`` must not vanish; a NaN weight poisons.
    Selecting on ``w > 0`` instead dropped such a shard (spec: only a non-finite LSE is empty).
    """
    return jnp.where(live[..., None], w[..., None] * out.astype(w.dtype), jnp.zeros((), w.dtype))


def _merge_core(out: jax.Array, lse: jax.Array, *, base: str,
                propagate_nan: bool = False) -> tuple[jax.Array, jax.Array]:
    """N-way merge of token-major stacked states; out [N, T, H, D], lse [N, T, H] -> cdtype
    (float32, or float64 when ``out`` or ``lse`` is float64).

    ``propagate_nan``: the IEEE rule of :func:`_merge_weights` and :func:`_live`.
    """
    cdtype = _compute_dtype(out.dtype, lse.dtype)
    lse = lse.astype(cdtype)
    w, merged = _merge_weights(lse, base=base, propagate_nan=propagate_nan)
    live = _live(lse, propagate_nan=propagate_nan)
    # Materialise the small [N, T, H] weights and mask: otherwise XLA may fuse exp/log into the
    # big [T, H, D] pass and recompute them for every element of D.
    w, live = jax.lax.optimization_barrier((w, live))
    n = out.shape[0]
    if n > _UNROLL_MAX_SHARDS:
        return jnp.sum(_weighted(out, w, live), axis=0), merged
    # Few shards: an unrolled sum is one elementwise, memory-bound pass reading each partial
    # once (a predictable lowering on GPU, unlike a reduction over the outermost axis).
    acc = _weighted(out[0], w[0], live[0])
    for r in range(1, n):
        acc = acc + _weighted(out[r], w[r], live[r])
    return acc, merged
