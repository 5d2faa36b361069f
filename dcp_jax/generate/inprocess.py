"""Generation in ONE process: the single-device reference, and DCP-N over a mesh of local devices.

The prefill's rows are placed into each rank's pages by `dcp_jax.model.paging.place_rows` (the
layout's formulas, no connector); the decode step is the same `make_decode_step` the decode
processes run. With ``dcp_size = 1`` this is the reference `dcp-jax generate` compares against.
"""
from __future__ import annotations

import numpy as np

from dcp_jax.generate.config import GenerateConfig

__all__ = ["prefill_rows", "generate_in_process"]


def prefill_rows(cfg: GenerateConfig, prompt: np.ndarray) -> list[np.ndarray]:
    """The prefill's KV rows of the shipped tokens, per layer entry ``[kv_tokens, ...]`` (numpy)."""
    import jax.numpy as jnp

    from dcp_jax.model import PREFILL_CHUNK, init_params, prefill

    mcfg = cfg.model_config()
    pad = -(-cfg.prompt_tokens // PREFILL_CHUNK) * PREFILL_CHUNK
    tokens = np.pad(np.asarray(prompt[: cfg.kv_tokens], np.int32), (0, pad - cfg.kv_tokens))
    return [np.asarray(e)[: cfg.kv_tokens] for e in prefill(mcfg, init_params(mcfg), jnp.asarray(tokens))]


def generate_in_process(cfg: GenerateConfig, prompt: np.ndarray, rows: list[np.ndarray] | None = None,
                        *, devices=None) -> tuple[list[int], np.ndarray]:
    """Greedy generation of ``cfg.new_tokens`` with ``cfg.dcp_size`` ranks on this process's devices.

    Args:
      cfg: the run (``dcp_size``, ``interleave_size``, ``page_size``, ``merge``, model, dtype, seed).
      prompt: i32[prompt_tokens].
      rows: `prefill_rows` of this prompt (computed when None).
      devices: the mesh's devices (default the first ``dcp_size`` of ``jax.devices()``).

    Returns:
      ``(tokens, logits f32[new_tokens, vocab])``.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dcp_jax.merge import make_dcp_mesh
    from dcp_jax.model import DecodeGeometry, global_caches, greedy_decode, init_params, make_decode_step, replicated
    from dcp_jax.model.paging import place_rows, request_pages

    mcfg = cfg.model_config()
    rows = prefill_rows(cfg, prompt) if rows is None else rows
    n = cfg.dcp_size
    mesh = make_dcp_mesh(n, devices=devices)
    pages = request_pages(cfg.total_tokens, dcp_size=n, page_size=cfg.page_size,
                          interleave_size=cfg.interleave_size, seed=cfg.seed)
    geo = DecodeGeometry(cfg.page_size, pages.num_pages, pages.max_pages, cfg.interleave_size, cfg.merge)
    devs = list(mesh.devices.flat)
    placed = [place_rows(e, cfg.kv_tokens, pages, fill=np.nan) for e in rows]  # free rows: NaN
    # jnp.copy: XLA-owned buffers, which the step can donate (a device_put numpy array may be aliased)
    caches = global_caches(mesh, [[jnp.copy(jax.device_put(c[r], devs[r])) for c in placed] for r in range(n)])
    pt = jax.device_put(pages.tables, NamedSharding(mesh, P("dcp")))
    params = jax.tree.map(lambda a: replicated(mesh, a), init_params(mcfg))
    tokens, logits, _ = greedy_decode(make_decode_step(mcfg, mesh, geo), params, caches, pt,
                                      replicated(mesh, np.int32(prompt[cfg.kv_tokens])),
                                      replicated(mesh, np.int32(cfg.kv_tokens)), cfg.new_tokens)
    return tokens, logits
