"""DCP decode attention: MLA (absorbed form) and GQA/MHA over each rank's paged local KV.

Per layer and decode step (spec section 8), under ``jax.shard_map`` over the DCP axis:

1. all-gather the query heads over the DCP axis (queries arrive head-sharded, ``H/N`` per rank);
2. each rank attends ALL heads against its local KV: the ``local_len`` tokens it owns under block
   round-robin with interleave ``I`` (``dcp_jax.layout``), stored densely in its own pages
   (local index ``j`` at row ``page_table[j // P] * P + j % P``, spec section 3);
3. merge the N partial ``(out, lse)`` with ``dcp_jax.merge`` (``ag_rs`` by default: rank r keeps
   heads ``[r*H/N, (r+1)*H/N)``).

MLA absorbed form (DeepSeek-V2/V3): ``q_nope`` is already multiplied by ``W_UK``, so a query is
``q_latent [H, 512]`` + ``q_rope [H, 64]``; a KV cache row is ``[512 latent | 64 rope]`` (576);
``score = softmax_scale * (q_latent . k_latent + q_rope . k_rope)``; the value is the latent
part (512), so ``out`` is in latent space (``W_UV`` is applied after the merge, outside).

Queries: ``B`` requests with ``Q`` query tokens each (``Q = 1`` plain decode, ``Q > 1``
speculative verify). ``kv_lens[b]`` counts the cached tokens of request b INCLUDING its ``Q``
query tokens (vLLM's ``seq_lens``), so with history ``L = kv_lens - Q`` query ``j`` sees the
``L + j + 1`` first tokens, i.e. ``local_len(L + j + 1, r)`` tokens on rank r: causal per query,
not a shifted final length. ``kv_lens = 0`` (a padding slot) gives ``out = 0``, ``lse = -inf``;
so does every query ``j`` with ``L + j + 1 <= 0`` when ``0 < kv_lens < Q`` (a request shorter than
its own queries: those queries see no key, the later ones see the first ``L + j + 1``).

All LSEs are natural log of the scaled scores, token-major ``[B, Q, H]``. Arithmetic in float32
(matmuls at ``Precision.HIGHEST`` so GPUs do not fall back to TF32); partial and merged outputs
come back in the query dtype.

NaN in, NaN out (the convention of plain softmax attention, FlashAttention and vLLM's
``merge_attn_states``; the float64 references of :mod:`dcp_jax.attention_reference` are the
oracle): a NaN in a query, or in a key or value row that query sees (its causal, valid range;
rows past ``kv_lens`` and the pages no query reads are masked on purpose and never poison),
gives NaN for that (query, head) exactly where the reference does: ``out`` and ``lse`` for a
NaN score (NaN query or key entry; MLA's latent part is key and value both), ``out`` alone, in
the columns of the NaN, for a NaN in a GQA value row. Other queries and heads stay exact. How:
the rank holding the NaN returns lse = NaN (:func:`mla_partial`), and the merge step runs the
merge core with ``propagate_nan=True`` (a NaN LSE on any rank poisons the merged state; every
rank with a finite LSE is multiplied by its weight, even one that underflows to 0, and only a
rank with no visible key, lse -inf, is dropped; ``dcp_jax.merge_core``), at every N, N = 1
included. The
standalone merges (``dcp_jax.merge``) keep their documented empty-shard rule. Inf in the KV
follows the reference as well: a +inf score (an inf key entry times the query) gives NaN, a
-inf score a zero weight, an inf value entry an inf (or ``0 * inf`` = NaN) in its column; the
one difference: a query whose every visible score is -inf gets the no-visible-key result (out
0, lse -inf) where the reference's ``-inf - -inf`` gives NaN. Scores are float32: a finite
score past float32's range counts as inf.

Dtypes: queries and caches must be floating (float32, bfloat16, float16); integer queries or an
integer (int8 / quantised) cache are a ``TypeError`` naming the argument: there is no
dequantisation here, so dequantise the cache first. The float dtypes may differ: ``q_latent``
and ``q_rope`` (and the cache) are each used as given, every score term is computed in float32
and ``out`` comes back in ``q_latent``'s (GQA: ``q``'s) dtype. Empty batches (``B = 0``) or no
query tokens (``Q = 0``) give empty ``out`` / ``lse`` of those shapes; ``H = 0``, ``Hkv = 0``,
``max_pages = 0`` and zero-width features (``Dl``, ``Dr``, ``D`` or ``Dv`` = 0; XLA:CPU's
collectives crash on them) are ``ValueError`` naming the argument, raised before tracing.

Accuracy: float32 results agree with the float64 references to 1e-5 (relative to the output
scale) while the LSEs stay moderate; the error grows like ``ulp_f32(|lse|)``, as the float32
scores and the float32 LSEs exchanged between ranks (as vLLM and sglang do) both round at
that scale. Measured with N = 4: 1-3e-6 at ``|lse|`` ~ 100, ~5e-6 at ~300, 0.5-1.5e-5 at
~500, 1-3e-4 at ~1e4 (``docs/conventions.md``, section 8).

Where things are: the per-rank partial attention (:func:`mla_partial`, :func:`gqa_partial`) and
:func:`local_kv_lens` in :mod:`dcp_jax.attention_partial`; :func:`paginate_kv` and the float64
references in :mod:`dcp_jax.attention_reference`; the argument checks in
:mod:`dcp_jax.attention_checks`; the DCP forms (:func:`dcp_mla_decode`, :func:`dcp_gqa_decode`
and their ``_emulated`` twins) here. Every public name stays importable from this module.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dcp_jax import layout
from dcp_jax.attention_checks import _check_form, _check_gqa, _check_mla, _check_scale
from dcp_jax.attention_partial import (  # noqa: F401  (re-exported)
    _HIGHEST,
    _gather_local,
    _masks,
    _softmax_partial,
    _zero_unused,
    gqa_partial,
    local_kv_lens,
    mla_partial,
)
from dcp_jax.attention_reference import (  # noqa: F401  (re-exported)
    _softmax_ref,
    gqa_decode_reference,
    mla_decode_reference,
    paginate_kv,
)
from dcp_jax.merge import (
    DEFAULT_AXIS_NAME,
    _merge_core,
    _mesh_axis_size,
    _place,
    local_merge_fn,
)

__all__ = [
    "dcp_gqa_decode",
    "dcp_gqa_decode_emulated",
    "dcp_mla_decode",
    "dcp_mla_decode_emulated",
    "gqa_decode_reference",
    "gqa_partial",
    "local_kv_lens",
    "mla_decode_reference",
    "mla_partial",
    "paginate_kv",
]


# --------------------------------------------------------------------------------------------
# DCP forms: shard_map over the mesh axis, and an all-ranks-on-one-device emulation
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _dcp_fn(kind: str, mesh: Mesh, axis_name: str, merge: str, query_len: int,
            interleave_size: int, softmax_scale: float):
    n = int(mesh.shape[axis_name])
    merge_local = local_merge_fn(merge)
    partial = mla_partial if kind == "mla" else gqa_partial
    heads = P(None, None, axis_name)  # [B, Q, H, ...] sharded over heads
    n_q = 2 if kind == "mla" else 1
    n_cache = 1 if kind == "mla" else 2

    def _shard_fn(*args):
        qs_local = args[:n_q]  # each [B, Q, H/N, d]
        caches_local = [c[0] for c in args[n_q:n_q + n_cache]]  # [num_pages, P, ...]
        pt_local, lens_local = args[-2][0], args[-1][0]  # [B, max_pages], [B, Q]
        # (1) all-gather the query heads: every rank attends all H heads against its own KV.
        qs = [jax.lax.all_gather(x, axis_name, axis=2, tiled=True) for x in qs_local]
        # (2) local attention over this rank's local_len tokens.
        out, lse = partial(*qs, *caches_local, pt_local, lens_local, softmax_scale=softmax_scale)
        b, qn, h = lse.shape
        dv = out.shape[-1]  # explicit sizes, no -1: B = 0 or Q = 0 gives empty arrays
        # (3) merge across ranks (head-sliced for ag_rs / a2a).
        o, l = merge_local(out.reshape(b * qn, h, dv), lse.reshape(b * qn, h),
                           axis_name=axis_name, base="e", propagate_nan=True)
        return o.reshape(b, qn, o.shape[1], dv), l.reshape(b, qn, l.shape[1])

    rank = P(axis_name)
    out_specs = (heads, P(None, None, axis_name)) if merge != "ag_ar" else (P(), P())
    smap = jax.shard_map(
        _shard_fn,
        mesh=mesh,
        in_specs=(heads,) * n_q  # q_latent, q_rope (MLA) or q (GQA): head-sharded
        + (rank,) * n_cache  # kv_cache (MLA) or k_cache, v_cache (GQA): [N, num_pages, P, ...]
        + (rank,  # page_table [N, B, max_pages]
           rank),  # local lens [N, B, Q]
        out_specs=out_specs,
    )

    def run(*args):
        kv_lens = args[-1]
        lens = local_kv_lens(kv_lens, query_len, dcp_size=n, interleave_size=interleave_size)
        return smap(*args[:-1], lens)

    return jax.jit(run)


def _dcp_call(kind, qs, caches, page_table, kv_lens, *, mesh, axis_name, merge, interleave_size,
              softmax_scale):
    n = _mesh_axis_size(mesh, axis_name)
    if caches[0].shape[0] != n:
        raise ValueError(f"the KV cache has {caches[0].shape[0]} ranks but the {axis_name!r} axis has N={n}")
    _check_form(merge, qs[0].shape[2], n, axis_name)
    layout.check_layout_args(n, interleave_size)
    fn = _dcp_fn(kind, mesh, axis_name, merge, qs[0].shape[1], int(interleave_size),
                 _check_scale(softmax_scale))
    shard = lambda x, spec: _place(x, NamedSharding(mesh, spec))  # noqa: E731  (vmap-safe)
    qs = [shard(x, P(None, None, axis_name)) for x in qs]
    caches = [shard(c, P(axis_name)) for c in caches]
    return fn(*qs, *caches, shard(page_table, P(axis_name)), kv_lens)


def dcp_mla_decode(q_latent, q_rope, kv_cache, page_table, kv_lens, *, softmax_scale: float,
                   mesh: Mesh, interleave_size: int = 1, axis_name: str = DEFAULT_AXIS_NAME,
                   merge: str = "ag_rs"):
    """DCP decode attention for absorbed MLA over a mesh axis (spec section 8).

    Steps inside ``shard_map`` (rank r): (1) all-gather the ``H/N`` local query heads to all H;
    (2) :func:`mla_partial` over rank r's ``local_len`` tokens (query j of request b sees
    ``local_len(kv_lens[b] - Q + j + 1, r)``); (3) merge the N partials with ``merge``.
    Works under ``jax.jit`` and ``jax.vmap`` over any of the arrays (a vmapped axis stays
    unsharded; each batch entry equals the unbatched call).

    Args:
      q_latent: [B, Q, H, Dl] absorbed queries (Dl = 512), head-sharded over ``axis_name`` (a
        replicated array is resharded); H must divide by N.
      q_rope: [B, Q, H, Dr] rope queries (Dr = 64); any float dtype, it may differ from
        ``q_latent``'s (scores are float32 either way; out takes ``q_latent``'s dtype).
      kv_cache: [N, num_pages, page_size, Dl + Dr] per-rank KV pages; slice r lives on rank r.
      page_table: i32[N, B, max_pages] per-rank page ids per request (see :func:`paginate_kv`),
        or one shared i32[B, max_pages] table for every rank (sglang's virtual pages). Rank r
        reads the first ``ceil(local_len(kv_lens[b], r) / page_size)`` entries of request b
        (``dcp_jax.layout``); those must be pages of the cache (``0 <= id < num_pages``), the
        entries past them are padding and may hold anything (-1, 0, stale ids).
      kv_lens: i32[B] cached tokens per request including its Q query tokens (0 = empty slot);
        ``>= 0`` and within what the table holds on every rank.
      softmax_scale: score multiplier (DeepSeek-V3: ``1/sqrt(192)`` times the YaRN mscale^2): any
        positive finite real scalar (Python float or int, numpy scalar, 0-d numpy/JAX array),
        concrete (it is compiled in as a constant).
      mesh: a mesh with an ``axis_name`` axis of size N (e.g. ``merge.make_dcp_mesh(N)``).
      interleave_size: I, tokens per ownership block (1 = token round-robin).
      axis_name: the DCP mesh axis (default "dcp").
      merge: "ag_rs" (default), "ag_ar" or "a2a".

    Returns:
      ``(out [B, Q, H, Dl] in q_latent's dtype, lse f32[B, Q, H] natural log)``; heads sharded
      over ``axis_name`` for ag_rs / a2a, replicated for ag_ar. Empty queries: out 0, lse -inf.
      ``B = 0`` or ``Q = 0``: empty arrays of those shapes. NaN in, NaN out: a NaN in a query
      or in a KV row it sees gives NaN where the float64 reference does (module docstring);
      NaN in rows it does not see (free slots past ``kv_lens``, later tokens) is harmless.

    Checks: concrete ``page_table`` and ``kv_lens`` are checked on the host before anything
    runs (one vectorised numpy pass; it copies both to the host, a small transfer and a sync).
    Traced ones (the call inside ``jax.jit``, or ``vmap`` over them) cannot be checked, and
    then bad values are NOT reported: a page id outside ``[0, num_pages)`` is clamped to page 0
    or ``num_pages - 1`` (``jnp.take(mode="clip")``), so another page's KV is read; a
    ``kv_lens`` past the table's capacity attends only the ``max_pages * page_size`` local
    tokens the table holds; a negative ``kv_lens`` attends nothing (out 0, lse -inf).

    Raises:
      ValueError: shapes disagree, ``H % N != 0``, ``H = 0``, ``Dl = 0`` or ``Dr = 0`` (named
        ``q_latent`` / ``q_rope``), N != mesh axis size, bad ``merge``,
        ``softmax_scale`` or layout ints; concrete ``kv_lens < 0``, a ``kv_lens`` past the
        table (message names ``kv_lens[b]``), a page id read outside ``[0, num_pages)``
        (message names ``page_table[r, b, k]``, or ``page_table[b, k]`` when shared).
      TypeError: integer arguments of the wrong dtype; a non-floating query or cache (named);
        a ``softmax_scale`` that is not a real scalar (bool, complex, str) or is traced.
    """
    q_latent, q_rope, kv_cache, page_table, kv_lens = _check_mla(q_latent, q_rope, kv_cache,
                                                                 page_table, kv_lens,
                                                                 interleave_size)
    return _dcp_call("mla", (q_latent, q_rope), (kv_cache,), page_table, kv_lens, mesh=mesh,
                     axis_name=axis_name, merge=merge, interleave_size=interleave_size,
                     softmax_scale=softmax_scale)


def dcp_gqa_decode(q, k_cache, v_cache, page_table, kv_lens, *, softmax_scale: float, mesh: Mesh,
                   interleave_size: int = 1, axis_name: str = DEFAULT_AXIS_NAME,
                   merge: str = "ag_rs"):
    """DCP decode attention for GQA/MHA with KV heads replicated inside the DCP group.

    Same steps as :func:`dcp_mla_decode` with :func:`gqa_partial` as the local attention.

    Args:
      q: [B, Q, H, D] queries, head-sharded over ``axis_name``; H must divide by N and by Hkv.
      k_cache: [N, num_pages, page_size, Hkv, D] per-rank key pages.
      v_cache: [N, num_pages, page_size, Hkv, Dv] per-rank value pages.
      page_table: i32[N, B, max_pages] per-rank page ids per request, or shared [B, max_pages];
        the entries read must be pages of the cache, as :func:`dcp_mla_decode`.
      kv_lens: i32[B] cached tokens per request including its Q query tokens.
      softmax_scale: score multiplier (usually ``1/sqrt(D)``).
      mesh, interleave_size, axis_name, merge: as :func:`dcp_mla_decode`.

    Returns:
      ``(out [B, Q, H, Dv] in q's dtype, lse f32[B, Q, H] natural log)``; NaN in, NaN out as
      :func:`dcp_mla_decode` (a NaN value entry: ``out`` NaN in its column, ``lse`` finite).

    Raises:
      ValueError / TypeError: as :func:`dcp_mla_decode` (the same host checks of concrete
        ``page_table`` / ``kv_lens``, none under a trace), plus ``H % Hkv != 0``, ``Hkv = 0``,
        ``D = 0`` (named ``q``) and ``Dv = 0`` (named ``v_cache``).
    """
    q, k_cache, v_cache, page_table, kv_lens = _check_gqa(q, k_cache, v_cache, page_table, kv_lens,
                                                          interleave_size)
    return _dcp_call("gqa", (q,), (k_cache, v_cache), page_table, kv_lens, mesh=mesh,
                     axis_name=axis_name, merge=merge, interleave_size=interleave_size,
                     softmax_scale=softmax_scale)


@functools.partial(jax.jit, static_argnames=("kind", "interleave_size", "softmax_scale"))
def _emulated_jit(qs, caches, page_table, kv_lens, *, kind, interleave_size, softmax_scale):
    n = caches[0].shape[0]
    lens = local_kv_lens(kv_lens, qs[0].shape[1], dcp_size=n, interleave_size=interleave_size)
    partial = functools.partial(mla_partial if kind == "mla" else gqa_partial,
                                softmax_scale=softmax_scale)
    outs, lses = jax.vmap(lambda c, pt, ll: partial(*qs, *c, pt, ll))(caches, page_table, lens)
    n, b, qn, h, dv = outs.shape  # [N, B, Q, H, Dv], [N, B, Q, H]
    # The merge of merge_states, with the NaN-propagating rule of the attention forms.
    o, l = _merge_core(outs.reshape(n, b * qn, h, dv), lses.reshape(n, b * qn, h), base="e",
                       propagate_nan=True)
    return o.reshape(b, qn, h, dv).astype(outs.dtype), l.reshape(b, qn, h)


def _emulated(kind, qs, caches, page_table, kv_lens, interleave_size, softmax_scale):
    layout.check_layout_args(caches[0].shape[0], interleave_size)
    return _emulated_jit(tuple(qs), tuple(caches), page_table, kv_lens, kind=kind,
                         interleave_size=int(interleave_size),
                         softmax_scale=_check_scale(softmax_scale))


def dcp_mla_decode_emulated(q_latent, q_rope, kv_cache, page_table, kv_lens, *,
                            softmax_scale: float, interleave_size: int = 1):
    """:func:`dcp_mla_decode` with all N ranks on ONE device (vmap over ranks + the merge core).

    Same numbers without a mesh: for single-GPU tests and benchmarks of the N-rank layout.
    Args, Returns, Raises and the host checks of concrete ``page_table`` / ``kv_lens`` as
    :func:`dcp_mla_decode` (no mesh; N = ``kv_cache.shape[0]``, output replicated), but for
    the heads: the emulation splits none over the ranks, so H need not be a multiple of N.
    """
    q_latent, q_rope, kv_cache, page_table, kv_lens = _check_mla(q_latent, q_rope, kv_cache,
                                                                 page_table, kv_lens,
                                                                 interleave_size)
    return _emulated("mla", (q_latent, q_rope), (kv_cache,), page_table, kv_lens,
                     interleave_size, softmax_scale)


def dcp_gqa_decode_emulated(q, k_cache, v_cache, page_table, kv_lens, *, softmax_scale: float,
                            interleave_size: int = 1):
    """:func:`dcp_gqa_decode` with all N ranks on one device. Args, checks as :func:`dcp_gqa_decode`,
    but for the heads: none are split over the ranks, so H need not be a multiple of N."""
    q, k_cache, v_cache, page_table, kv_lens = _check_gqa(q, k_cache, v_cache, page_table, kv_lens,
                                                          interleave_size)
    return _emulated("gqa", (q,), (k_cache, v_cache), page_table, kv_lens, interleave_size,
                     softmax_scale)
