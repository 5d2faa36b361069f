"""Cost report of a heterogeneous pair: descriptors per decode rank with per-layer caches and with
the cross-layer page layout, side by side (``dcp-jax plan --decode-layout ...``).

`HETERO_MODELS` gives each model's cache as the hetero plan sees it (kind, layers, KV heads,
head_dim, dtype). The MLA entries restate `dcp_jax.geometry` (576 latent elements per token per
layer); ``llama-3.1-8b`` (GQA, 32 layers, 8 KV heads of 128, bf16) is here until the geometry
table lists it.
"""
from __future__ import annotations

import numpy as np

from dcp_jax.hetero.layouts import LAYOUTS
from dcp_jax.hetero.plan import HeteroSide, build_hetero_plan, check_pair, descriptor_counts
from dcp_jax.transfer.spec import check_layout_bounds
from dcp_jax.layout import local_len_np

__all__ = ["HETERO_MODELS", "hetero_sides", "hetero_counts"]

#: model -> (layout kind, num_layers, num_kv_heads, head_dim, dtype)
HETERO_MODELS = {
    "deepseek-v3": ("mla", 61, 1, 576, "bfloat16"),
    "kimi-k2": ("mla", 61, 1, 576, "bfloat16"),
    "deepseek-v3-fp8": ("mla", 61, 1, 576, "float8_e4m3fn"),
    "llama-3.1-8b": ("gqa", 32, 8, 128, "bfloat16"),
}
_DEFAULT_LAYOUT = {"mla": "sglang_mla", "gqa": "nhd"}


def hetero_sides(model: str, prefill: dict, decode: dict) -> tuple[HeteroSide, HeteroSide, int]:
    """The two `HeteroSide`s of ``model`` and its layer count.

    Args:
        model: a key of `HETERO_MODELS`.
        prefill, decode: each ``{"page_size", "dcp_size", "interleave_size", "tp_size", "layout"}``
            (``layout`` None: the model kind's default, ``sglang_mla`` or ``nhd``).

    Raises:
        ValueError: an unknown layout (checked first, the side named), an unknown model (the names
            listed), a side past the connector's layout bounds (`check_layout_bounds`, named by
            its option), a side the plan refuses (named), or a pair that cannot be paired
            (`HeteroPlanError`: dtype, kind, heads or head_dim differ).
    """
    for name, s in (("prefill", prefill), ("decode", decode)):  # a bad name first, whatever the model
        if s.get("layout") is not None and s["layout"] not in LAYOUTS:
            raise ValueError(f"{name} layout must be one of {LAYOUTS}, got {s['layout']!r}")
    if model not in HETERO_MODELS:
        raise ValueError(f"model={model!r} has no heterogeneous cache entry; one of {sorted(HETERO_MODELS)}")
    kind, layers, heads, head_dim, dtype = HETERO_MODELS[model]

    def side(s: dict, prefix: str) -> HeteroSide:
        check_layout_bounds(s["page_size"], s["dcp_size"], s["interleave_size"],
                            names=(f"{prefix}page-size", f"{prefix}dcp-size", f"{prefix}interleave-size"))
        return HeteroSide(s["page_size"], s["dcp_size"], s["interleave_size"], s["tp_size"],
                          s.get("layout") or _DEFAULT_LAYOUT[kind], heads, head_dim, dtype)

    # The decode side first: a prefill page size left out is --page-size's, named as such.
    d = side(decode, "--")
    p = side(prefill, "--prefill-")
    check_pair(p, d)  # before any plan is sized or process started (transfer ran 9 processes first)
    return p, d, layers


def _tables(side: HeteroSide, stop: int, rng) -> list[np.ndarray]:
    out = []
    for r in range(side.dcp_size):
        need = -(-int(local_len_np(stop, side.dcp_size, r, side.interleave_size)) // side.page_size)
        out.append(rng.permutation(max(need, 1) + need)[:need])  # pages drawn from a pool twice as large
    return out


def hetero_counts(model: str, prompt_tokens: int, prefill: dict, decode: dict, *, seed: int = 0) -> list[dict]:
    """Descriptors per decode rank for the whole prompt, per-layer and cross-layer.

    Returns:
        one dict per decode ``(dcp_rank, tp_rank)``: ``dcp_rank``, ``tp_rank``, ``rows`` (tokens x
        heads it receives), ``descriptors`` (per-layer caches, all layers), ``cross_layer``.
    """
    p, d, layers = hetero_sides(model, prefill, decode)
    rng = np.random.default_rng(seed)
    plan = build_hetero_plan(p, d, 0, prompt_tokens, _tables(p, prompt_tokens, rng), _tables(d, prompt_tokens, rng))
    per_layer = descriptor_counts(plan, layers)
    cross = descriptor_counts(plan, layers, cross_layer=True)
    rows = {}
    for dd, dt, nh in zip(plan.dst_dcp.tolist(), plan.dst_tp.tolist(), plan.num_heads.tolist()):
        rows[(dd, dt)] = rows.get((dd, dt), 0) + nh
    return [dict(dcp_rank=k[0], tp_rank=k[1], rows=rows.get(k, 0), descriptors=per_layer[k],
                 cross_layer=cross[k]) for k in sorted(per_layer)]
