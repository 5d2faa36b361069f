"""A tiny DeepSeek-style decoder: its geometry (`ModelConfig`) and seeded random weights.

MLA keeps DeepSeek-V3's KV geometry (latent ``kv_lora_rank = 512`` + rope 64, one 576-wide row
per token and layer, DeepSeek-V3 `config.json`) and scales down everything else (heads, hidden
size, layers, vocabulary). The GQA variant stores K and V as two layer entries per layer
(``[Hkv, head_dim]`` each), the way vLLM registers them.

Weights come from ``jax.random`` with a seed: no download, the same bits in every process.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ModelConfig", "init_params", "DTYPES"]

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
KINDS = ("mla", "gqa")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Geometry of the tiny model.

    Attributes:
        kind: ``"mla"`` (DeepSeek MLA, absorbed at decode) or ``"gqa"``.
        dtype: ``"fp32"`` or ``"bf16"`` (weights, activations and KV cache).
        vocab_size, d_model, num_layers, num_heads, mlp_hidden: sizes.
        kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim: MLA head geometry
            (DeepSeek-V3: 512, 64, 128, 128; here nope and v are 64).
        num_kv_heads, head_dim: GQA geometry.
        rope_theta: RoPE base (plain RoPE, no YaRN: the tiny model is not long-context trained).
        seed: PRNG seed of the weights.

    Raises:
        ValueError: unknown kind or dtype, a non-positive size, heads not a multiple of KV heads.
    """

    kind: str = "mla"
    dtype: str = "fp32"
    vocab_size: int = 512
    d_model: int = 256
    num_layers: int = 2
    num_heads: int = 8
    mlp_hidden: int = 512
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} must be one of {KINDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {tuple(DTYPES)}")
        for f in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_hidden", "kv_lora_rank",
                  "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}={v!r} must be a positive int")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE pairs)")
        if self.kind == "gqa" and (self.num_heads % self.num_kv_heads or self.head_dim % 2):
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                             f"{self.num_kv_heads} and head_dim={self.head_dim} even")

    @property
    def jdtype(self):
        return DTYPES[self.dtype]

    @property
    def softmax_scale(self) -> float:
        """``1/sqrt(qk head dim)``: MLA's is nope + rope (192 for DeepSeek-V3), GQA's head_dim."""
        d = self.qk_nope_head_dim + self.qk_rope_head_dim if self.kind == "mla" else self.head_dim
        return 1.0 / math.sqrt(d)

    @property
    def entry_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-token shape of each KV layer entry: MLA ``(576,)`` per layer; GQA ``(Hkv, D)`` for K,
        then V, of each layer (2 entries per layer)."""
        if self.kind == "mla":
            return ((self.kv_lora_rank + self.qk_rope_head_dim,),) * self.num_layers
        return ((self.num_kv_heads, self.head_dim),) * (2 * self.num_layers)

    @property
    def item_lens(self) -> tuple[int, ...]:
        """Bytes per token of each layer entry (MLA bf16: 576 x 2 = 1152, spec section 1)."""
        isz = np.dtype(self.jdtype).itemsize
        return tuple(int(np.prod(s)) * isz for s in self.entry_shapes)


def _dense(key, fan_in: int, shape, dtype):
    return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)


def init_params(cfg: ModelConfig) -> dict:
    """Seeded random weights (normal, 1/sqrt(fan_in)); norms are ones. Pytree of ``cfg.dtype``.

    MLA layer: ``wq [d, H*(nope+rope)]``, ``wkv_a [d, 512+64]``, ``kv_norm [512]``,
    ``wkv_b [512, H, nope+v]`` (``W_UK = wkv_b[..., :nope]``, ``W_UV = wkv_b[..., nope:]``),
    ``wo [H*v, d]``. GQA layer: ``wq [d, H*D]``, ``wk``, ``wv [d, Hkv*D]``, ``wo [H*D, d]``.
    Both: ``attn_norm``, ``mlp_norm [d]``, SwiGLU ``w_gate``, ``w_up [d, F]``, ``w_down [F, d]``.
    """
    dt, d, h = cfg.jdtype, cfg.d_model, cfg.num_heads
    keys = iter(jax.random.split(jax.random.PRNGKey(cfg.seed), 8 + 8 * cfg.num_layers))
    layers = []
    for _ in range(cfg.num_layers):
        lp = dict(attn_norm=jnp.ones((d,), dt), mlp_norm=jnp.ones((d,), dt),
                  w_gate=_dense(next(keys), d, (d, cfg.mlp_hidden), dt),
                  w_up=_dense(next(keys), d, (d, cfg.mlp_hidden), dt),
                  w_down=_dense(next(keys), cfg.mlp_hidden, (cfg.mlp_hidden, d), dt))
        if cfg.kind == "mla":
            nope, rope, c = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
            lp.update(wq=_dense(next(keys), d, (d, h * (nope + rope)), dt),
                      wkv_a=_dense(next(keys), d, (d, c + rope), dt),
                      kv_norm=jnp.ones((c,), dt),
                      wkv_b=_dense(next(keys), c, (c, h, nope + cfg.v_head_dim), dt),
                      wo=_dense(next(keys), h * cfg.v_head_dim, (h * cfg.v_head_dim, d), dt))
        else:
            hd, hkv = cfg.head_dim, cfg.num_kv_heads
            lp.update(wq=_dense(next(keys), d, (d, h * hd), dt), wk=_dense(next(keys), d, (d, hkv * hd), dt),
                      wv=_dense(next(keys), d, (d, hkv * hd), dt),
                      wo=_dense(next(keys), h * hd, (h * hd, d), dt))
        layers.append(lp)
    return dict(embed=_dense(next(keys), 1, (cfg.vocab_size, d), dt), final_norm=jnp.ones((d,), dt),
                lm_head=_dense(next(keys), d, (d, cfg.vocab_size), dt), layers=layers)
