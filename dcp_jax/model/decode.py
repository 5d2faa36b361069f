"""The DCP decode step of the tiny model: one token, attention over each rank's paged KV, merged.

Runs under ``jax.shard_map`` over the DCP mesh axis, the same code for an in-process mesh (N
devices of one process) and a multi-process one (``jax.distributed``: one device per decode
process, gloo on CPU, NCCL on GPUs). Per layer, on rank r:

1. the token's projections (weights replicated: every rank computes all heads' queries);
2. the token's KV row is written ONLY on its owner rank ``owner(t)`` (`dcp_jax.layout`), at its
   local row ``page_table[j // P] * P + j % P`` with ``j = local_index(t)``, in place (the caches
   are donated; other ranks' writes are dropped);
3. partial attention of all heads over the rank's ``local_len(t + 1)`` tokens
   (`dcp_jax.attention.mla_partial` / `gqa_partial`);
4. exact merge over the axis (`dcp_jax.merge`: ``ag_rs`` / ``a2a`` leave rank r heads
   ``[r*H/N, (r+1)*H/N)``, whose ``W_UV`` and ``o_proj`` rows it applies before a ``psum``
   (row-parallel output projection); ``ag_ar`` leaves all heads on every rank).

The caches are global arrays ``[N * num_pages, P, *entry_shape]`` sharded on axis 0: rank r's
shard is its own ``[num_pages, P, ...]`` cache (the one its `KVReceiver` wrote).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dcp_jax import layout
from dcp_jax.attention import gqa_partial, local_kv_lens, mla_partial
from dcp_jax.merge import DEFAULT_AXIS_NAME, MERGE_FORMS, local_merge_fn
from dcp_jax.model.config import ModelConfig
from dcp_jax.model.forward import mlp, project_gqa, project_mla, rmsnorm

__all__ = ["DecodeGeometry", "make_decode_step", "replicated", "global_caches", "greedy_decode"]

_HI = jax.lax.Precision.HIGHEST


class DecodeGeometry(tuple):
    """(page_size, num_pages, max_pages, interleave_size, merge) of one decode group; hashable."""

    def __new__(cls, page_size: int, num_pages: int, max_pages: int, interleave_size: int = 1,
                merge: str = "ag_rs"):
        for name, v in (("page_size", page_size), ("num_pages", num_pages), ("max_pages", max_pages),
                        ("interleave_size", interleave_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if merge not in MERGE_FORMS:
            raise ValueError(f"merge={merge!r} must be one of {MERGE_FORMS}")
        return super().__new__(cls, (page_size, num_pages, max_pages, interleave_size, merge))

    page_size = property(lambda s: s[0])
    num_pages = property(lambda s: s[1])
    max_pages = property(lambda s: s[2])
    interleave_size = property(lambda s: s[3])
    merge = property(lambda s: s[4])


def _append(cache, row, pos, pt, r, n, geo):
    """Writes ``row [1, ...]`` of token ``pos`` into this rank's cache iff it owns the token."""
    own = layout.owner(pos, n, geo.interleave_size) == r
    j = layout.local_index(pos, n, geo.interleave_size)
    idx = pt[j // geo.page_size] * geo.page_size + j % geo.page_size
    idx = jnp.where(own, idx, geo.num_pages * geo.page_size)  # out of range: dropped
    flat = cache.reshape((-1,) + cache.shape[2:])
    return flat.at[idx].set(row[0].astype(cache.dtype), mode="drop").reshape(cache.shape)


def _out_proj(cfg, lp, out, r, n, geo, axis_name):
    """Merged heads -> residual update [1, d]: ``W_UV`` (MLA) and o_proj rows of this rank's heads."""
    hs = out.shape[1]
    h0 = 0 if geo.merge == "ag_ar" else r * hs
    if cfg.kind == "mla":
        w_uv = jax.lax.dynamic_slice_in_dim(lp["wkv_b"][..., cfg.qk_nope_head_dim:], h0, hs, axis=1)
        out = jnp.einsum("thc,chv->thv", out, w_uv, precision=_HI, preferred_element_type=jnp.float32)
        out = out.astype(lp["wo"].dtype)
    dv = out.shape[-1]
    wo = jax.lax.dynamic_slice_in_dim(lp["wo"], h0 * dv, hs * dv, axis=0)
    o = jnp.einsum("te,ed->td", out.reshape(1, hs * dv), wo, precision=_HI, preferred_element_type=jnp.float32)
    if geo.merge != "ag_ar":
        o = jax.lax.psum(o, axis_name)  # the other heads live on the other ranks
    return o.astype(lp["wo"].dtype)


@functools.lru_cache(maxsize=32)
def make_decode_step(cfg: ModelConfig, mesh: Mesh, geo: DecodeGeometry, axis_name: str = DEFAULT_AXIS_NAME):
    """The jitted DCP decode step for a model, a mesh and a decode geometry.

    Returns ``step(params, caches, page_table, token, pos) -> (logits, next_token, pos + 1, caches)``:

    - params: `init_params(cfg)` as arrays replicated over the mesh;
    - caches: tuple over layer entries of ``[N * num_pages, P, *entry_shape]`` sharded on axis 0
      (DONATED: updated in place, the returned tuple replaces them);
    - page_table: i32[N, max_pages] sharded on axis 0 (row r: rank r's pages of the request);
    - token, pos: i32[] replicated: the input token and its position (prefix included);
    - logits f32[vocab], next_token i32[] (greedy argmax), replicated.

    Raises:
      ValueError: ``num_heads`` not a multiple of N (``ag_rs`` / ``a2a``), bad geometry.
    """
    n = int(mesh.shape[axis_name])
    if cfg.num_heads % n:
        raise ValueError(f"num_heads={cfg.num_heads} must divide by the DCP size N={n}")
    layout.check_layout_args(n, geo.interleave_size)
    merge_local = local_merge_fn(geo.merge)

    def body(params, caches, pt, token, pos):
        r = jax.lax.axis_index(axis_name)
        pt = pt[0]
        posv = pos[None]
        lens = jax.lax.dynamic_index_in_dim(
            local_kv_lens(posv + 1, 1, dcp_size=n, interleave_size=geo.interleave_size), r, keepdims=False)
        x = params["embed"][token][None]  # [1, d]
        caches, new = list(caches), []
        for l, lp in enumerate(params["layers"]):
            if cfg.kind == "mla":
                q_nope, q_pe, row = project_mla(cfg, lp, x, posv)
                c = _append(caches[l], row, pos, pt, r, n, geo)
                w_uk = lp["wkv_b"][..., : cfg.qk_nope_head_dim]
                q_lat = jnp.einsum("thn,chn->thc", q_nope, w_uk, precision=_HI,
                                   preferred_element_type=jnp.float32).astype(x.dtype)
                out, lse = mla_partial(q_lat[None], q_pe[None], c, pt[None], lens,
                                       softmax_scale=cfg.softmax_scale)
                new.append(c)
            else:
                q, k, v = project_gqa(cfg, lp, x, posv)
                kc = _append(caches[2 * l], k, pos, pt, r, n, geo)
                vc = _append(caches[2 * l + 1], v, pos, pt, r, n, geo)
                out, lse = gqa_partial(q[None], kc, vc, pt[None], lens, softmax_scale=cfg.softmax_scale)
                new += [kc, vc]
            o, _ = merge_local(out[0], lse[0], axis_name=axis_name, base="e", propagate_nan=True)
            x = x + _out_proj(cfg, lp, o, r, n, geo, axis_name)
            x = x + mlp(lp, x)
        logits = jnp.einsum("td,dv->tv", rmsnorm(x, params["final_norm"]), params["lm_head"], precision=_HI,
                            preferred_element_type=jnp.float32)[0]
        return logits, jnp.argmax(logits).astype(jnp.int32), pos + 1, tuple(new)

    rep, shard = P(), P(axis_name)

    def step(params, caches, page_table, token, pos):
        f = jax.shard_map(
            body, mesh=mesh,
            in_specs=(jax.tree.map(lambda _: rep, params), tuple(shard for _ in caches), shard, rep, rep),
            out_specs=(rep, rep, rep, tuple(shard for _ in caches)),
        )
        return f(params, caches, page_table, token, pos)

    return jax.jit(step, donate_argnums=(1,))


def replicated(mesh: Mesh, x):
    """A global array replicated over ``mesh`` from a host value every process holds (numpy/JAX)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P()), lambda idx: x[idx])


def global_caches(mesh: Mesh, local: list, axis_name: str = DEFAULT_AXIS_NAME) -> tuple:
    """Wraps this process's per-rank caches as the step's global caches, without a copy.

    Args:
      mesh: the DCP mesh.
      local: ``local[k][e]`` is layer entry e of the k-th of this process's devices in the mesh
        (``[num_pages, P, ...]``, a JAX array on that device); one process per rank has k = 0 only.

    Returns:
      tuple over entries of ``[N * num_pages, P, ...]`` arrays sharded on axis 0.
    """
    n = int(mesh.shape[axis_name])
    sharding = NamedSharding(mesh, P(axis_name))
    out = []
    for e in range(len(local[0])):
        shards = [local[k][e] for k in range(len(local))]
        shape = (n * shards[0].shape[0],) + tuple(shards[0].shape[1:])
        out.append(jax.make_array_from_single_device_arrays(shape, sharding, shards))
    return tuple(out)


def greedy_decode(step, params, caches, page_table, token, pos, steps: int, on_step=None):
    """Runs ``steps`` greedy decode steps; returns ``(tokens, logits f32[steps, vocab], caches)``.

    ``token``/``pos`` are the first step's replicated inputs; each step feeds its argmax to the
    next without leaving the device. ``on_step(k)`` is called after step k's logits are on the host
    (timing hooks). Logits and tokens are read from this process's first shard (replicated).
    """
    tokens, logits = [], []
    for k in range(steps):
        lg, token, pos, caches = step(params, caches, page_table, token, pos)
        logits.append(np.asarray(lg.addressable_data(0)))
        tokens.append(int(np.asarray(token.addressable_data(0))))
        if on_step is not None:
            on_step(k)
    return tokens, np.stack(logits), caches
