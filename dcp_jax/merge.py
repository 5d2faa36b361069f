"""Exact LSE merge of partial attention results, flat and as DCP collectives.

Each DCP rank ``r`` attends the KV it holds and returns ``out_r`` (normalised over its own KV) and
``lse_r`` (log-sum-exp of its scores). For one (token, head), natural log unless told otherwise
(spec section 7)::

    m   = max_r lse_r                      (0 if every lse_r is -inf)
    lse = m + log(sum_r exp(lse_r - m))    (-inf if every shard is empty)
    out = sum_r exp(lse_r - lse) * out_r

Conventions everywhere in this module (and the two it is built from):

- the state (shard) axis comes first: ``out [N, T, H, D]``, ``lse [N, T, H]``;
- the LSE is token-major ``[T, H]`` by default; ``lse_layout="HT"`` selects head-major ``[H, T]``
  (vLLM's ``merge_attn_states`` layout);
- ``base="e"`` (natural log, vLLM / sglang) or ``base="2"`` (FlashInfer: ``lse2 = lse * log2(e)``)
  is always an explicit keyword: mixing the bases silently is the classic bug;
- an empty shard is one whose LSE is ``-inf``, ``+inf`` or NaN; it contributes exactly zero even
  when its ``out`` holds NaN (its term is *selected* with ``jnp.where``, never multiplied by 0,
  because ``0 * NaN = NaN``); all shards empty gives ``out = 0``, ``lse = -inf``. A shard with a
  finite LSE is live and always multiplied, so its NaN / inf ``out`` is not lost when its weight
  underflows to 0 (an LSE ~104 below the max): NaN stays NaN, as in the float64 oracle, and an
  inf becomes NaN (``0 * inf``) where the oracle's weight is still > 0 and keeps the inf;
  the in-``shard_map`` forms take ``propagate_nan=True`` for the IEEE rule instead (a NaN or
  +inf LSE poisons the merged state; -inf stays empty): the DCP attention forms merge that way;
- arithmetic in float32, or float64 when ``out`` or ``lse`` is float64 (``jax_enable_x64``);
  ``out`` comes back in the input dtype, ``lse`` in float32 (float64 for a float64 ``lse``);
- the collective forms refuse zero-width states (H = 0 or D = 0: ``ValueError`` naming ``out``,
  at trace time, before XLA's collectives would crash on them); :func:`merge_states` takes them;
- the one exception: the collective forms on a ONE-device axis (N = 1: :func:`ag_rs`,
  :func:`ag_ar`, :func:`a2a`, and :func:`merge_ag_rs` & co. inside ``shard_map``) return the
  inputs unchanged, as spec section 7 requires: no empty-shard normalisation (an LSE of +inf or
  NaN and a NaN ``out`` come back as they are) and ``lse`` keeps its dtype. The two rules above
  apply to them for N >= 2; :func:`merge_states` applies them at every N, N = 1 included.

There is ONE merge core, :func:`_merge_weights` + :func:`_weighted` (:mod:`dcp_jax.merge_core`,
with the argument checks): the flat forms (:func:`merge_states`, :func:`merge_state`, here) and
the collective forms (:func:`merge_ag_rs`, :func:`merge_ag_ar`, :func:`merge_a2a` inside
``shard_map``, :mod:`dcp_jax.merge_collectives`; :func:`ag_rs`, :func:`ag_ar`, :func:`a2a` on a
mesh, here) all call it. Every name stays importable from this module.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dcp_jax.merge_collectives import (  # noqa: F401  (re-exported)
    _LOCAL_FORMS,
    _check_local,
    local_merge_fn,
    merge_a2a,
    merge_ag_ar,
    merge_ag_rs,
)
from dcp_jax.merge_core import (  # noqa: F401  (re-exported)
    _UNROLL_MAX_SHARDS,
    BASES,
    DEFAULT_AXIS_NAME,
    LSE_LAYOUTS,
    MERGE_FORMS,
    _as_float_array,
    _check_base,
    _check_layout,
    _check_stacked,
    _check_widths,
    _compute_dtype,
    _live,
    _merge_core,
    _merge_weights,
    _weighted,
)

__all__ = [
    "BASES",
    "LSE_LAYOUTS",
    "MERGE_FORMS",
    "a2a",
    "ag_ar",
    "ag_rs",
    "make_dcp_mesh",
    "merge_a2a",
    "merge_ag_ar",
    "local_merge_fn",
    "merge_ag_rs",
    "merge_state",
    "merge_states",
    "merge_states_reference",
]


# --------------------------------------------------------------------------------------------
# Flat forms: N stacked partial states in, one merged state out
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("base", "lse_layout"))
def _merge_states_jit(out, lse, *, base, lse_layout):
    if lse_layout == "HT":
        lse = jnp.swapaxes(lse, 1, 2)
    o, l = _merge_core(out, lse, base=base)
    l = l.astype(jnp.promote_types(jnp.float32, lse.dtype))
    if lse_layout == "HT":
        l = l.T
    return o.astype(out.dtype), l


def merge_states(out, lse, *, base: str = "e", lse_layout: str = "TH"):
    """Merges N partial attention states into one (spec section 7).

    ``lse = m + log(sum_r exp(lse_r - m))``, ``out = sum_r exp(lse_r - lse) * out_r`` with
    ``m = max_r lse_r``; empty shards (LSE -inf, +inf or NaN) contribute exactly zero.

    Args:
      out: [N, T, H, D] partial outputs, state axis FIRST, each normalised over its own KV
        (any float dtype: bf16, f16, f32; f64 stays f64 only with ``jax_enable_x64``, otherwise
        JAX holds it as f32). numpy, JAX or nested sequences.
      lse: f32[N, T, H] LSEs (token-major), or [N, H, T] with ``lse_layout="HT"``. Natural log
        for ``base="e"``, base 2 for ``base="2"``. A float64 ``lse`` (x64 mode) is merged in
        float64 whatever ``out``'s dtype.
      base: "e" (default; vLLM, sglang) or "2" (FlashInfer's ``lse * log2(e)``; the int 2 is
        taken as "2").
      lse_layout: "TH" (token-major, default) or "HT" (head-major) for both input and output LSE.

    Returns:
      ``(out [T, H, D] in out's dtype as JAX holds it, lse f32[T, H] (or [H, T]; float64 for a
      float64 ``lse``) in the same base)``. All shards empty gives out = 0 and lse = -inf.
      H = 0, D = 0 or T = 0 give empty results of those shapes.

    Raises:
      ValueError: bad ``base`` / ``lse_layout``, wrong ranks or mismatched shapes, N = 0; a
        float64 host ``out`` or ``lse`` with finite values past float32's range while
        ``jax_enable_x64`` is off (JAX would narrow them to inf: an empty shard).
      TypeError: non-floating inputs.

    Example:
      >>> o, l = merge_states([[[[2., 4.]]], [[[6., 8.]]]], [[[1.]], [[2.]]])
      >>> [round(float(v), 4) for v in o[0, 0]], round(float(l[0, 0]), 4)
      ([4.9242, 6.9242], 2.3133)
    """
    base = _check_base(base)
    lse_layout = _check_layout(lse_layout)
    out, lse = _check_stacked(out, lse, lse_layout)
    return _merge_states_jit(out, lse, base=base, lse_layout=lse_layout)


def merge_state(out_a, lse_a, out_b, lse_b, *, base: str = "e", lse_layout: str = "TH"):
    """Merges two partial states (prefix + suffix, cache + new tokens, chunked prefill).

    Same math and edge cases as :func:`merge_states` with N = 2.

    Args:
      out_a: [T, H, D] first partial output (any float dtype).
      lse_a: f32[T, H] (or [H, T] with ``lse_layout="HT"``) LSE of ``out_a``.
      out_b: [T, H, D] second partial output, same shape and dtype as ``out_a``.
      lse_b: LSE of ``out_b``, same shape as ``lse_a``.
      base: "e" (default) or "2"; both LSEs must use it.
      lse_layout: "TH" (default) or "HT".

    Returns:
      ``(out [T, H, D] in out_a's dtype, lse [T, H] or [H, T] in float32, or float64 when an
      input LSE is float64 under ``jax_enable_x64``)``.

    Raises:
      ValueError: ``out_a`` and ``out_b`` of different shapes or dtypes, ``lse_a`` and ``lse_b``
        of different shapes (their dtypes may differ: both are widened to the wider of them and
        float32), bad ``base`` / ``lse_layout``; float64 host inputs past float32's range
        without ``jax_enable_x64`` (as `merge_states`).
      TypeError: non-floating inputs.
    """
    base = _check_base(base)
    lse_layout = _check_layout(lse_layout)
    out_a, out_b = _as_float_array(out_a, "out_a"), _as_float_array(out_b, "out_b")
    lse_a, lse_b = _as_float_array(lse_a, "lse_a"), _as_float_array(lse_b, "lse_b")
    if out_a.shape != out_b.shape or out_a.dtype != out_b.dtype:
        raise ValueError(
            f"out_a and out_b must match: {out_a.shape=} {out_a.dtype=}, {out_b.shape=} {out_b.dtype=}"
        )
    if lse_a.shape != lse_b.shape:
        raise ValueError(f"lse_a and lse_b must match: {lse_a.shape=}, {lse_b.shape=}")
    # float32 at least, wider kept (as merge_states): narrowing a float64 LSE to float32 first
    # rounded the weights computed from it.
    wide = jnp.promote_types(jnp.float32, jnp.result_type(lse_a, lse_b))
    out, lse = _check_stacked(
        jnp.stack([out_a, out_b]), jnp.stack([lse_a.astype(wide), lse_b.astype(wide)]), lse_layout
    )
    return _merge_states_jit(out, lse, base=base, lse_layout=lse_layout)


def merge_states_reference(out, lse, *, base: str = "e"):
    """Float64 numpy oracle of :func:`merge_states` (token-major), written independently.

    Loops over (token, head) and shards; empty shards are skipped, never multiplied.

    Args:
      out: [N, T, H, D] partial outputs.
      lse: [N, T, H] LSEs in ``base``.
      base: "e" or "2".

    Returns:
      ``(out f64[T, H, D], lse f64[T, H])``.
    """
    base = _check_base(base)
    out = np.asarray(out, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    b = math.e if base == "e" else 2.0
    n, t, h, d = out.shape
    res = np.zeros((t, h, d))
    res_lse = np.full((t, h), -np.inf)
    for i in range(t):
        for j in range(h):
            live = [r for r in range(n) if np.isfinite(lse[r, i, j])]
            if not live:
                continue
            m = max(lse[r, i, j] for r in live)
            s = sum(b ** (lse[r, i, j] - m) for r in live)
            res_lse[i, j] = m + math.log(s, b)
            for r in live:
                res[i, j] += b ** (lse[r, i, j] - res_lse[i, j]) * out[r, i, j]
    return res, res_lse


# --------------------------------------------------------------------------------------------
# Mesh-level wrappers: stacked [N, ...] arrays in, shard_map over the DCP axis
# --------------------------------------------------------------------------------------------


def make_dcp_mesh(dcp_size: int | None = None, *, axis_name: str = DEFAULT_AXIS_NAME, devices=None) -> Mesh:
    """A 1-D mesh of ``dcp_size`` devices with one Auto axis named ``axis_name``.

    Auto axis type on purpose: ``jax.make_mesh`` defaults to Explicit axes in jax 0.11, which
    makes ``shard_map`` demand pre-sharded inputs.

    Args:
      dcp_size: number of devices N (default: all of ``devices``).
      axis_name: mesh axis name (default "dcp").
      devices: devices to use (default ``jax.devices()``); the first N are taken.

    Raises:
      ValueError: ``dcp_size`` not positive or larger than the number of devices.
    """
    devs = list(jax.devices() if devices is None else devices)
    n = len(devs) if dcp_size is None else dcp_size
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{dcp_size=} must be a positive int")
    if n > len(devs):
        raise ValueError(f"{dcp_size=} exceeds the {len(devs)} available devices")
    return Mesh(np.array(devs[:n]), (axis_name,), axis_types=(AxisType.Auto,))


def _place(x, sharding: NamedSharding):
    """Puts ``x`` on ``sharding``: ``device_put`` for a concrete array; a sharding constraint
    for a traced one. Under ``jax.vmap`` ``device_put`` applies the spec to the BATCHED array,
    so ``P(axis)`` partitioned the vmap axis (IndivisibleError unless it divided by N); the
    constraint's batching rule adds the vmap axis unsharded. Inside ``jit`` the two agree."""
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)


def _mesh_axis_size(mesh: Mesh, axis_name: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.shape:
        raise ValueError(f"{axis_name=} is not an axis of the mesh {dict(mesh.shape)}")
    return int(mesh.shape[axis_name])


@functools.lru_cache(maxsize=64)
def _mesh_merge_fn(mesh: Mesh, axis_name: str, form: str, base: str):
    local = local_merge_fn(form)
    heads_out = P(None, axis_name, None) if form in ("ag_rs", "a2a") else P()
    lse_out = P(None, axis_name) if form in ("ag_rs", "a2a") else P()

    def _shard_fn(out_local, lse_local):
        # out_local [1, T, H, D], lse_local [1, T, H]: this rank's partial.
        return local(out_local[0], lse_local[0], axis_name=axis_name, base=base)

    f = jax.shard_map(
        _shard_fn,
        mesh=mesh,
        in_specs=(
            P(axis_name),  # out: [N, T, H, D], one partial per rank
            P(axis_name),  # lse: [N, T, H]
        ),
        out_specs=(heads_out, lse_out),
        # ag_ar returns a psum/all_gather result that is the same on every rank.
        check_vma=True,
    )
    return jax.jit(f)


def _mesh_merge(out, lse, *, mesh, axis_name, base, lse_layout, form):
    base = _check_base(base)
    lse_layout = _check_layout(lse_layout)
    out, lse = _check_stacked(out, lse, lse_layout)
    _check_widths(out.shape, form)  # at every N, before the collectives (SIGSEGV on XLA:CPU)
    if mesh is None:
        mesh = make_dcp_mesh(out.shape[0], axis_name=axis_name)
    n = _mesh_axis_size(mesh, axis_name)
    if out.shape[0] != n:
        raise ValueError(f"out has {out.shape[0]} partials but the {axis_name!r} axis has N={n} devices")
    h = out.shape[2]
    if h % n != 0:
        raise ValueError(f"heads H={h} must divide by the {axis_name!r} axis size N={n} ({form})")
    if lse_layout == "HT":
        lse = jnp.swapaxes(lse, 1, 2)
    if n == 1:
        o, l = out[0], lse[0]  # spec: N = 1 returns the inputs unchanged
    else:
        sharding = NamedSharding(mesh, P(axis_name))
        o, l = _mesh_merge_fn(mesh, axis_name, form, base)(
            _place(out, sharding), _place(lse, sharding)
        )
    if lse_layout == "HT":
        l = l.T
    return o, l


def ag_rs(out, lse, *, mesh: Mesh | None = None, axis_name: str = DEFAULT_AXIS_NAME,
          base: str = "e", lse_layout: str = "TH"):
    """AG+RS merge of N stacked partials, one per device of the ``axis_name`` mesh axis.

    Runs :func:`merge_ag_rs` under ``jax.shard_map``: partial r lives on rank r; rank r ends with
    heads ``[r*H/N, (r+1)*H/N)``, so the global result is sharded over heads. Works under
    ``jax.jit`` and ``jax.vmap`` (any batch size, any ``in_axes``): a vmapped axis stays
    unsharded and each batch entry is merged as an unbatched call would.

    Args:
      out: [N, T, H, D] partial outputs (state axis first), any float dtype.
      lse: f32[N, T, H] LSEs (or [N, H, T] with ``lse_layout="HT"``) in ``base``.
      mesh: a mesh with an ``axis_name`` axis of size N (default: :func:`make_dcp_mesh` (N)).
      axis_name: the DCP mesh axis (default "dcp").
      base: "e" (default) or "2".
      lse_layout: "TH" (default) or "HT".

    Returns:
      ``(out [T, H, D] in out's dtype, sharded over heads; lse f32[T, H] or [H, T])``.
      Empty shards (LSE -inf, +inf or NaN) contribute exactly zero for N >= 2 only. N = 1 (a
      one-device axis) returns ``(out[0], lse[0])`` UNCHANGED, as spec section 7 requires: no
      empty-shard normalisation (an LSE of +inf or NaN and a NaN ``out`` come back as given,
      where :func:`merge_states` would give out 0, lse -inf) and ``lse`` keeps its dtype (bf16
      stays bf16). Use :func:`merge_states` for the normalised single-shard result.

    Raises:
      ValueError: ``H % N != 0`` (before tracing), N != mesh axis size, bad shapes / knobs;
        H = 0 or D = 0 (zero-width ``out``, at every N; the message names ``out``). T = 0 is
        fine: empty results of those shapes.
    """
    return _mesh_merge(out, lse, mesh=mesh, axis_name=axis_name, base=base,
                       lse_layout=lse_layout, form="ag_rs")


def ag_ar(out, lse, *, mesh: Mesh | None = None, axis_name: str = DEFAULT_AXIS_NAME,
          base: str = "e", lse_layout: str = "TH"):
    """AG+AR merge of N stacked partials over a mesh axis; every rank holds all heads.

    Args, Returns and Raises as :func:`ag_rs`, except that the result is replicated. As there,
    N = 1 returns ``(out[0], lse[0])`` unchanged (no empty-shard normalisation, ``lse`` dtype
    kept); empty shards count as zero for N >= 2.
    """
    return _mesh_merge(out, lse, mesh=mesh, axis_name=axis_name, base=base,
                       lse_layout=lse_layout, form="ag_ar")


def a2a(out, lse, *, mesh: Mesh | None = None, axis_name: str = DEFAULT_AXIS_NAME,
        base: str = "e", lse_layout: str = "TH"):
    """All-to-all merge of N stacked partials over a mesh axis (heads sharded like ``ag_rs``).

    Args, Returns and Raises as :func:`ag_rs`. As there, N = 1 returns ``(out[0], lse[0])``
    unchanged (no empty-shard normalisation, ``lse`` dtype kept); empty shards count as zero
    for N >= 2.
    """
    return _mesh_merge(out, lse, mesh=mesh, axis_name=axis_name, base=base,
                       lse_layout=lse_layout, form="a2a")
