"""The heterogeneous plan over one engine pair in one process (``dcp-jax transfer --engine
jax-transfer`` with TP or layout options; NIXL and Mooncake runs go through the connector,
`dcp_jax.hetero.connector_job`).

This run drives the heterogeneous plan over a real engine directly (`dcp_jax.hetero.engine_path`): one process, one prefill and one
decode engine over loopback, every prefill (DCP, TP) rank's caches filled with a per-element
pattern, every decode rank's caches with a sentinel; one notified WRITE batch per stream, then
every decode cache is compared byte for byte with the numpy mover's result
(`dcp_jax.hetero.mover.execute_plan` on copies: the library's reference), sentinel bytes included.
"""
from __future__ import annotations

import time

import numpy as np

from dcp_jax.hetero.cost import hetero_sides
from dcp_jax.hetero.engine_path import execute_over_engines
from dcp_jax.hetero.layouts import cache_shape
from dcp_jax.hetero.mover import execute_plan
from dcp_jax.hetero.plan import HeteroSide, build_hetero_plan
from dcp_jax.layout import local_len_np

__all__ = ["run_hetero_job"]

SENTINEL = 0xA5


def _side_caches(side: HeteroSide, tokens: int, num_layers: int, rng, fill: bool):
    tables, caches = [], {}
    itype = np.uint8 if side.dtype.startswith(("float8", "int8", "uint8")) else (
        np.uint32 if side.dtype == "float32" else np.uint16)
    for r in range(side.dcp_size):
        need = -(-int(local_len_np(tokens, side.dcp_size, r, side.interleave_size)) // side.page_size)
        num_pages = max(need, 1) + 1  # a spare page: untouched bytes must keep the sentinel
        tables.append(rng.permutation(num_pages)[:need])
        for t in range(side.tp_size):
            shape = cache_shape(side.geometry(t, num_pages))
            if fill:
                caches[(r, t)] = [rng.integers(0, np.iinfo(itype).max, shape, dtype=np.int64).astype(itype)
                                  for _ in range(num_layers)]
            else:
                size = int(np.prod(shape)) * np.dtype(itype).itemsize
                caches[(r, t)] = [np.full(size, SENTINEL, np.uint8).view(itype).reshape(shape)
                                  for _ in range(num_layers)]
    return tables, caches


def run_hetero_job(model: str, prompt_tokens: int, prefill: dict, decode: dict, *, engine: str = "nixl",
                   seed: int = 0, timeout_s: float = 60.0) -> dict:
    """Moves one request's KV between a heterogeneous pair through ``engine`` and verifies it.

    Args:
        model: a key of `dcp_jax.hetero.cost.HETERO_MODELS`.
        prompt_tokens: tokens moved (>= 1).
        prefill, decode: sides as `dcp_jax.hetero.cost.hetero_sides` takes them.
        engine: "nixl", "mooncake" or "jax-transfer".

    Returns:
        ``{"model", "engine", "prefill", "decode", "streams", "descriptors", "bytes", "seconds", "gbps",
        "ranks": [{"dcp_rank", "tp_rank", "descriptors", "verified"}], "verified"}``.

    Raises:
        ValueError: an unknown model or a side the plan refuses (named).
    """
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ValueError(f"prompt_tokens={prompt_tokens!r} must be an int >= 1")
    p, d, layers = hetero_sides(model, prefill, decode)
    rng = np.random.default_rng(seed)
    src_tables, src = _side_caches(p, prompt_tokens, layers, rng, True)
    dst_tables, dst = _side_caches(d, prompt_tokens, layers, rng, False)
    want = {k: [a.copy() for a in v] for k, v in dst.items()}
    plan = build_hetero_plan(p, d, 0, prompt_tokens, src_tables, dst_tables)
    t0 = time.perf_counter()
    stats = execute_over_engines(plan, src, dst, layers, engine=engine, timeout_s=timeout_s)
    seconds = time.perf_counter() - t0
    execute_plan(plan, src, want, layers)
    ranks = [dict(dcp_rank=k[0], tp_rank=k[1], descriptors=stats["descriptors_per_dst"][k],
                  verified=all(np.array_equal(a, b) for a, b in zip(dst[k], want[k]))) for k in sorted(dst)]
    side = lambda s: dict(page_size=s.page_size, dcp_size=s.dcp_size, interleave_size=s.interleave_size,  # noqa: E731
                          tp_size=s.tp_size, layout=s.layout)
    return dict(model=model, engine=engine, prefill=side(p), decode=side(d), streams=stats["streams"],
                descriptors=stats["descriptors"], bytes=stats["bytes"], seconds=seconds,
                gbps=stats["bytes"] / seconds / 1e9 if seconds > 0 else 0.0, ranks=ranks,
                verified=all(r["verified"] for r in ranks))
