"""Cost report of a heterogeneous pair: descriptors per decode rank with per-layer caches and with
the cross-layer page layout, side by side (``dcp-jax plan --decode-layout ...``).

`HETERO_MODELS` gives each model's cache as the hetero plan sees it (kind, layers, KV heads,
head_dim, dtype). The MLA entries restate `dcp_jax.geometry` (576 latent elements per token per
layer); ``llama-3.1-8b`` (GQA, 32 layers, 8 KV heads of 128, bf16) is here until the geometry
table lists it.
"""
from __future__ import annotations

import numpy as np

from dcp_jax.hetero.layouts import LAYOUTS, cache_shape
from dcp_jax.hetero.plan import HeteroSide, build_hetero_plan, check_pair, descriptor_counts
from dcp_jax.transfer.spec import check_layout_bounds
from dcp_jax.layout import local_len_np

__all__ = ["HETERO_MODELS", "hetero_sides", "hetero_counts", "rank_pages", "rank_tables", "direct_counts"]

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
            raise ValueError(f"{name} layout must be one of {LAYOUTS}, got {s['layout']!r} (--{name}-layout)")
    if model not in HETERO_MODELS:
        raise ValueError(f"model={model!r} has no heterogeneous cache entry; one of {sorted(HETERO_MODELS)}")
    kind, layers, heads, head_dim, dtype = HETERO_MODELS[model]

    def side(s: dict, prefix: str) -> HeteroSide:
        check_layout_bounds(s["page_size"], s["dcp_size"], s["interleave_size"],
                            names=(f"{prefix}page-size", f"{prefix}dcp-size", f"{prefix}interleave-size"))
        try:
            return HeteroSide(s["page_size"], s["dcp_size"], s["interleave_size"], s["tp_size"],
                              s.get("layout") or _DEFAULT_LAYOUT[kind], heads, head_dim, dtype)
        except ValueError as exc:  # the plan names its field; the user gave an option of one side
            which = "decode" if prefix == "--" else "prefill"
            raise ValueError(f"the {which} side ({prefix}tp-size={s['tp_size']}, {prefix}page-size="
                             f"{s['page_size']}): {exc}") from None

    # The decode side first: a prefill page size left out is --page-size's, named as such.
    d = side(decode, "--")
    p = side(prefill, "--prefill-")
    check_pair(p, d)  # before any plan is sized or process started (transfer ran 9 processes first)
    return p, d, layers


def rank_pages(side: HeteroSide, tokens: int) -> list[tuple[int, int]]:
    """Each DCP rank's ``(pages its tokens need, pages of its cache)`` for tokens ``[0, tokens)``:
    one spare page, so the TP/layout job's untouched bytes must keep their sentinel."""
    out = []
    for r in range(side.dcp_size):
        need = -(-int(local_len_np(tokens, side.dcp_size, r, side.interleave_size)) // side.page_size)
        out.append((need, max(need, 1) + 1))
    return out


def rank_tables(side: HeteroSide, tokens: int, rng) -> tuple[list[np.ndarray], list[int]]:
    """Each DCP rank's page table (i64, pages drawn at random from its cache) and its cache's
    page count (`rank_pages`); the TP/layout job and this cost report draw the same tables."""
    tables, pages = [], []
    for need, num_pages in rank_pages(side, tokens):
        tables.append(rng.permutation(num_pages)[:need].astype(np.int64))
        pages.append(num_pages)
    return tables, pages


def direct_counts(p: HeteroSide, d: HeteroSide, layers: int, tokens: int, src: tuple, dst: tuple) -> dict:
    """Descriptors the connector's direct path posts to each decode ``(dcp_rank, tp_rank)`` for
    tokens ``[0, tokens)`` sent as one chunk and one window (``max_batch_indices`` None): each
    prefill rank's rows (`dcp_jax.transfer.schedule.chunk_rows`) through both layouts
    (`dcp_jax.transfer.views.StreamView.descriptors`, the function the sender posts with), every
    layer at its own address.

    Args:
        p, d: the two sides; layers: layers per cache; tokens: tokens moved.
        src, dst: ``(tables, pages)`` of each side (`rank_tables`).
    """
    from dcp_jax.transfer.schedule import SideLayout, chunk_rows
    from dcp_jax.transfer.views import side_view

    out = {}
    for dr in range(d.dcp_size):
        dl = SideLayout(d.dcp_size, dr, d.interleave_size, d.page_size)
        # The rows each prefill DCP rank sends this decode DCP rank: the same for every TP rank.
        rows = [chunk_rows(0, tokens, src=SideLayout(p.dcp_size, pr, p.interleave_size, p.page_size), dst=dl,
                           src_page_table=src[0][pr], dst_page_table=dst[0][dr]) for pr in range(p.dcp_size)]
        for dt in range(d.tp_size):
            n = 0
            for pr in range(p.dcp_size):
                for pt in range(p.tp_size):
                    view = side_view(p, d, pt, dt, src[1][pr], dst[1][dr])
                    if rows[pr][0].size and len(view.pieces):
                        n += len(view.descriptors(*rows[pr], _bases(view.src_geom, layers),
                                                  _bases(view.dst_geom, layers)))
            out[(dr, dt)] = n
    return out


def _bases(geom, layers: int) -> np.ndarray:
    """Layer addresses a page apart past each cache: no descriptor merges across two layers."""
    stride = int(np.prod(cache_shape(geom))) * geom.itemsize + 4096
    return np.arange(1, layers + 1, dtype=np.int64) * stride


def hetero_counts(model: str, prompt_tokens: int, prefill: dict, decode: dict, *, seed: int = 0) -> list[dict]:
    """Descriptors per decode rank for the whole prompt: the plan's wire blocks, per-layer and
    cross-layer, and what the connector's direct path posts.

    The page tables are the TP/layout job's for the same ``seed`` (`rank_tables`), so ``direct``
    is the count ``dcp-jax transfer --path direct`` reports for that pair and seed.

    Raises:
        ValueError: as `hetero_sides`, and a job `transfer` would refuse
            (`dcp_jax.hetero.connector_job.check_job_size`: more than 64 ranks a side, caches past
            this machine's memory).

    Returns:
        one dict per decode ``(dcp_rank, tp_rank)``: ``dcp_rank``, ``tp_rank``, ``rows`` (tokens x
        heads it receives), ``descriptors`` (the plan's wire blocks with per-layer caches, all
        layers), ``cross_layer`` (the same with cross-layer pages), ``direct`` (`direct_counts`).
    """
    p, d, layers = hetero_sides(model, prefill, decode)
    from dcp_jax.hetero.connector_job import check_job_size

    # What `transfer` refuses, refused here too: the direct count builds the sender's descriptor
    # arrays (~4.5 KB a token for llama-3.1-8b), and a million ranks would take minutes.
    check_job_size(p, d, layers, prompt_tokens)
    rng = np.random.default_rng(seed)
    src, dst = rank_tables(p, prompt_tokens, rng), rank_tables(d, prompt_tokens, rng)
    plan = build_hetero_plan(p, d, 0, prompt_tokens, src[0], dst[0])
    per_layer = descriptor_counts(plan, layers)
    cross = descriptor_counts(plan, layers, cross_layer=True)
    direct = direct_counts(p, d, layers, prompt_tokens, src, dst)
    rows = {}
    for dd, dt, nh in zip(plan.dst_dcp.tolist(), plan.dst_tp.tolist(), plan.num_heads.tolist()):
        rows[(dd, dt)] = rows.get((dd, dt), 0) + nh
    return [dict(dcp_rank=k[0], tp_rank=k[1], rows=rows.get(k, 0), descriptors=per_layer[k],
                 cross_layer=cross[k], direct=direct[k]) for k in sorted(per_layer)]
