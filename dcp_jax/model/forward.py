"""Per-token pieces of the tiny model and its prefill: norms, RoPE, projections, MLP, causal attention.

Shared by the prefill (whole prompt) and the decode step (`dcp_jax.model.decode`), so both sides
compute the same projections. The prefill attends in the non-absorbed form (DeepSeek's prefill:
``K_nope = c_kv W_UK``, ``V = c_kv W_UV`` per head); the decode step in the absorbed form over the
latent cache (`dcp_jax.attention.mla_partial`). Both are exact reformulations of one another,
which `tests/generate` checks (teacher-forced logits of the prefill equal the decode step's).

Shapes: ``T`` tokens of one request, ``d = d_model``, ``H`` heads. Activations in the model dtype,
matmuls at ``Precision.HIGHEST`` (no TF32 on GPUs), norms and softmax in float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dcp_jax.attention import _softmax_partial
from dcp_jax.merge_core import _merge_core
from dcp_jax.model.config import ModelConfig

__all__ = ["rmsnorm", "rope", "mlp", "project_mla", "project_gqa", "prefill", "prefill_logits",
           "PREFILL_CHUNK"]

_HI = jax.lax.Precision.HIGHEST
PREFILL_CHUNK = 256  # query/key block of the prefill attention (prompts are padded to a multiple)


def _mm(a, b, eq):
    return jnp.einsum(eq, a, b, precision=_HI, preferred_element_type=jnp.float32).astype(a.dtype)


def rmsnorm(x, w, eps: float = 1e-6):
    """RMSNorm over the last axis in float32; returns x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope(x, pos, theta: float):
    """Rotary embedding, half-split pairs (x[..., i] with x[..., i + D/2]).

    Args:
      x: [T, ..., D] (D even); pos: i32[T] token positions; theta: base.
    """
    d = x.shape[-1]
    freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    ang = pos.astype(jnp.float32)[:, None] * freq[None, :]  # [T, D/2]
    ang = ang.reshape(ang.shape[:1] + (1,) * (x.ndim - 2) + ang.shape[1:])
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    c, s = jnp.cos(ang), jnp.sin(ang)
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)


def mlp(lp, x):
    """SwiGLU MLP with its pre-norm: ``x [T, d] -> [T, d]`` (the residual is the caller's)."""
    h = rmsnorm(x, lp["mlp_norm"])
    g = _mm(h, lp["w_gate"], "td,df->tf")
    u = _mm(h, lp["w_up"], "td,df->tf")
    return _mm((jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype),
               lp["w_down"], "tf,fd->td")


def project_mla(cfg: ModelConfig, lp, x, pos):
    """MLA projections of T tokens.

    Returns:
      ``(q_nope [T, H, nope], q_pe [T, H, rope] (roped), row [T, 512 + 64])``: ``row`` is the KV
      cache row (normed latent ``c_kv`` | roped ``k_pe``), the bytes the connector moves.
    """
    h = rmsnorm(x, lp["attn_norm"])
    t, nope, r, c = x.shape[0], cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    q = _mm(h, lp["wq"], "td,de->te").reshape(t, cfg.num_heads, nope + r)
    q_pe = rope(q[..., nope:], pos, cfg.rope_theta)
    kv_a = _mm(h, lp["wkv_a"], "td,de->te")
    c_kv = rmsnorm(kv_a[:, :c], lp["kv_norm"])
    k_pe = rope(kv_a[:, c:], pos, cfg.rope_theta)
    return q[..., :nope], q_pe, jnp.concatenate([c_kv, k_pe], axis=-1)


def project_gqa(cfg: ModelConfig, lp, x, pos):
    """GQA projections of T tokens: ``(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D])``, q and k roped."""
    h = rmsnorm(x, lp["attn_norm"])
    t, hd, hkv = x.shape[0], cfg.head_dim, cfg.num_kv_heads
    q = rope(_mm(h, lp["wq"], "td,de->te").reshape(t, cfg.num_heads, hd), pos, cfg.rope_theta)
    k = rope(_mm(h, lp["wk"], "td,de->te").reshape(t, hkv, hd), pos, cfg.rope_theta)
    return q, k, _mm(h, lp["wv"], "td,de->te").reshape(t, hkv, hd)


def _block_attention(q, k, v, q0, k0, scale):
    """Causal attention of one query block against one key block (non-absorbed heads).

    q [C, H, Dq], k [C, H, Dq], v [C, H, Dv] (KV heads already broadcast to H); q0, k0: first
    positions. Returns ``(out f32[C, H, Dv], lse f32[C, H])`` (natural log).
    """
    s = jnp.einsum("qhd,khd->qhk", q, k, precision=_HI, preferred_element_type=jnp.float32) * scale
    qp = q0 + jnp.arange(q.shape[0])
    kp = k0 + jnp.arange(k.shape[0])
    mask = (qp[:, None] >= kp[None, :])[None]  # [1, C, C]
    p, lse = _softmax_partial(s[None], mask)  # scores [1, C, H, C], mask [1, C, C]
    out = jnp.einsum("qhk,khd->qhd", p[0], v.astype(jnp.float32), precision=_HI)
    return out, lse[0]


def _causal_attention(q, k, v, scale):
    """Blocked causal attention over a whole (padded) prompt; blocks combined by the LSE merge.

    q, k: [S, H, Dq]; v: [S, H, Dv]; S a multiple of PREFILL_CHUNK. Query block i visits key
    blocks 0..i only (causal), folding each partial into the running state with
    the DCP merge core (`dcp_jax.merge_core._merge_core`, NaN propagated). Returns [S, H, Dv] in q's dtype.
    """
    c = PREFILL_CHUNK
    s, h, dv = q.shape[0], q.shape[1], v.shape[-1]
    blocks = lambda a: a.reshape((s // c, c) + a.shape[1:])  # noqa: E731
    qb, kb, vb = blocks(q), blocks(k), blocks(v)

    def one_query_block(i):
        def body(j, state):
            o, l = _block_attention(qb[i], kb[j], vb[j], i * c, j * c, scale)
            # NaN in, NaN out (as the DCP attention forms): a poisoned block is not an empty one.
            return _merge_core(jnp.stack([state[0], o]), jnp.stack([state[1], l]), base="e",
                               propagate_nan=True)

        init = (jnp.zeros((c, h, dv), jnp.float32), jnp.full((c, h), -jnp.inf, jnp.float32))
        return jax.lax.fori_loop(0, i + 1, body, init)[0]

    return jax.lax.map(one_query_block, jnp.arange(s // c)).reshape(s, h, dv).astype(q.dtype)


def _layer_prefill(cfg: ModelConfig, lp, x, pos):
    """One layer over the whole prompt: ``(x_out [S, d], [entry rows of this layer])``."""
    if cfg.kind == "mla":
        q_nope, q_pe, row = project_mla(cfg, lp, x, pos)
        c_kv, k_pe = row[:, : cfg.kv_lora_rank], row[:, cfg.kv_lora_rank:]
        w_uk, w_uv = lp["wkv_b"][..., : cfg.qk_nope_head_dim], lp["wkv_b"][..., cfg.qk_nope_head_dim:]
        k_nope = _mm(c_kv, w_uk, "sc,chn->shn")
        v = _mm(c_kv, w_uv, "sc,chv->shv")
        k_pe_h = jnp.broadcast_to(k_pe[:, None, :], q_pe.shape)
        att = _causal_attention(jnp.concatenate([q_nope, q_pe], -1), jnp.concatenate([k_nope, k_pe_h], -1),
                                v, cfg.softmax_scale)
        entries = [row]
    else:
        q, k, v = project_gqa(cfg, lp, x, pos)
        g = cfg.num_heads // cfg.num_kv_heads
        att = _causal_attention(q, jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1), cfg.softmax_scale)
        entries = [k, v]
    x = x + _mm(att.reshape(x.shape[0], -1), lp["wo"], "te,ed->td")
    return x + mlp(lp, x), entries


def _forward(cfg: ModelConfig, params, tokens):
    pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    x = params["embed"][tokens]
    entries = []
    for lp in params["layers"]:
        x, e = _layer_prefill(cfg, lp, x, pos)
        entries += e
    return x, entries


@functools.partial(jax.jit, static_argnums=0)
def prefill(cfg: ModelConfig, params, tokens):
    """Prefill of a whole prompt: the KV cache rows of every layer entry.

    Args:
      cfg: the model (static).
      params: `init_params(cfg)`.
      tokens: i32[S] token ids, S a multiple of `PREFILL_CHUNK` (pad the prompt; rows of padded
        positions are computed but must not be sent: causality keeps real rows independent of them).

    Returns:
      list over layer entries (`ModelConfig.entry_shapes`) of ``[S, *entry_shape]`` in the model dtype.
    """
    return _forward(cfg, params, tokens)[1]


@functools.partial(jax.jit, static_argnums=0)
def prefill_logits(cfg: ModelConfig, params, tokens):
    """Logits f32[S, vocab] of every position of a full forward (the teacher-forced oracle of tests)."""
    x = _forward(cfg, params, tokens)[0]
    return jnp.einsum("td,dv->tv", rmsnorm(x, params["final_norm"]), params["lm_head"], precision=_HI,
                      preferred_element_type=jnp.float32)
