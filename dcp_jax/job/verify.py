"""What the job checks: the decode ranks' pools byte for byte, the ``--verify`` CRC-32s, the hooks.

Everything here is computed from the spec's ownership formulas by brute force
(:func:`dcp_jax.job.kv.owned_tokens`) and the job's own page tables, never from the connector's
planner: the check of record is independent of what it checks.
"""

from __future__ import annotations

import time

import numpy as np

from dcp_jax.job import kv
from dcp_jax.job.config import JobConfig
from dcp_jax.kv_data import page_rows, verify_rows

__all__ = ["unit_rows", "send_checksums", "die_bytes", "verify_pool"]


def unit_rows(cfg: JobConfig, rank: int, n: int, chunks) -> dict[int, list[int]]:
    """``{decode rank: [rows of each chunk]}`` this prefill rank sends a group of ``n`` decode
    ranks (brute-force ownership)."""
    toks = kv.owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, cfg.prefill_dcp_size, rank,
                           cfg.prefill_interleave_size)[0]
    owner = (toks // cfg.interleave_size) % n
    out = {}
    for r in range(n):
        t = toks[owner == r]
        out[r] = [int(np.count_nonzero((t >= a) & (t < b))) for a, b in chunks]
    return out


def send_checksums(cfg: JobConfig, rank: int, n: int, table: np.ndarray, layers) -> dict[int, list[list[int]]]:
    """``{decode rank: [[CRC-32 per layer] per chunk]}`` of the rows this prefill rank sends a
    group of ``n`` decode ranks."""
    toks, local = kv.owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, cfg.prefill_dcp_size, rank,
                                  cfg.prefill_interleave_size)
    rows = page_rows(table, local, cfg.src_page_size)
    owner = (toks // cfg.interleave_size) % n
    flat = [v.reshape(v.shape[0] * v.shape[1], -1) for v in layers]
    out: dict[int, list[list[int]]] = {}
    for r in range(n):
        out[r] = []
        for start, length in cfg.chunks():
            sel = rows[(owner == r) & (toks >= start) & (toks < start + length)]
            out[r].append([kv.checksum(f, sel) for f in flat])
    return out


def die_bytes(cfg: JobConfig, r: int, n: int) -> int:
    """Bytes rank r has received once its first ``die_after_chunks`` chunks landed (at least 1)."""
    chunks = cfg.chunks()
    start, length = chunks[min(cfg.die_after_chunks, len(chunks)) - 1]
    toks = kv.owned_tokens(cfg.prefix_tokens, start + length, n, r, cfg.interleave_size)[0]
    return max(1, len(toks) * cfg.geometry.row_bytes)


def verify_pool(cfg: JobConfig, r: int, n: int, table, buf, layers, arg: dict, landed: bool) -> dict:
    """The rank's pool against the pattern: owned rows byte-exact, every other row the sentinel;
    with ``--verify`` also each (chunk, prefill rank, layer)'s CRC-32 against the sender's."""
    p = cfg.page_size
    tokens, local = kv.owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, n, r, cfg.interleave_size)
    rows = page_rows(table, local, p)
    flat = [v.reshape(v.shape[0] * v.shape[1], -1) for v in layers]
    if landed and arg["hooks"] and cfg.corrupt_rank == r and len(rows):
        kv.flip_first_byte(flat[-1], rows[0])  # test hook: a byte damaged on arrival
    bad_checks = []
    for k, per_chunk in sorted((arg.get("checks") or {}).items()):
        src_owner = (tokens // cfg.prefill_interleave_size) % cfg.prefill_dcp_size
        for ci, (start, length) in enumerate(cfg.chunks()):
            sel = rows[(src_owner == k) & (tokens >= start) & (tokens < start + length)]
            bad_checks += [(ci, li) for li, f in enumerate(flat) if kv.checksum(f, sel) != per_chunk[ci][li]]
    tv = time.perf_counter()
    # Device pools are copied back to the host once and checked by the same code as host pools.
    host = kv.to_host(buf)
    host_layers = [v.reshape(v.shape[0] * v.shape[1], -1) for v in
                   kv.layer_views(host, layers[0].shape[0], p, cfg.geometry.kv_item_lens)]
    res = verify_rows(host_layers, rows, tokens, cfg.seed)
    chunks_ok = 0
    if res["ok"]:
        chunks_ok = len(cfg.chunks())
    else:
        for start, length in cfg.chunks():
            sel = (tokens >= start) & (tokens < start + length)
            chunks_ok += bool(verify_rows(host_layers, rows[sel], tokens[sel], cfg.seed)["bad_rows"] == 0)
    return dict(
        rows=int(len(tokens)), chunks=chunks_ok,
        bytes_verified=int(len(tokens)) * cfg.geometry.row_bytes,
        verified=bool(res["ok"]) and landed and not bad_checks,
        bytes_exact=bool(res["ok"]), bad_rows=res["bad_rows"], bad_sentinel_rows=res["bad_sentinel_rows"],
        first_bad=res["first_bad"], checksum_ok=(not bad_checks) if arg.get("checks") else None,
        bad_checksums=bad_checks[:10], verify_seconds=time.perf_counter() - tv,
    )
