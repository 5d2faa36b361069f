"""Brute-force references for the hetero tests, written from the layout conventions directly
(semantic indexing of each cache layout, ownership formula inline), not from the code under test."""
from __future__ import annotations

import numpy as np

TOKENS_PER_ROW = {2: 2, 1: 4, 4: 1}  # TPU MLA sublane packing by itemsize


def cell(layout: str, cache: np.ndarray, page: int, slot: int, plane: int, head: int, head_dim: int):
    """View of the ``head_dim`` elements of (page, slot, K/V plane, local head) in one layer's cache."""
    if layout == "sglang_mla":
        return cache[page, slot, :]
    if layout == "tpu_mla":
        k = cache.shape[2]
        return cache[page, slot // k, slot % k, :head_dim]
    if layout == "nhd":
        return cache[plane, page, slot, head, :]
    if layout == "hnd":
        return cache[plane, page, head, slot, :]
    return cache[page, slot, 2 * head + plane, :]          # tpu_gqa


def heads_held(num_kv_heads: int, tp_size: int, tp_rank: int, mla: bool) -> list[int]:
    if mla:
        return [0]
    if num_kv_heads % tp_size == 0:
        per = num_kv_heads // tp_size
        return list(range(tp_rank * per, (tp_rank + 1) * per))
    return [tp_rank // (tp_size // num_kv_heads)]


def locate(t: int, dcp_size: int, interleave: int, page_size: int, tables) -> tuple[int, int, int]:
    rank = (t // interleave) % dcp_size
    j = (t // (interleave * dcp_size)) * interleave + t % interleave
    return rank, int(tables[rank][j // page_size]), j % page_size


def reference_move(p, d, start, stop, src_tables, dst_tables, src_caches, dst_caches, num_layers,
                   mla_source_tp_rank=0):
    """Per token, per decode TP rank, per head it holds: copy from the prefill rank that sends it."""
    mla = p.layout in ("sglang_mla", "tpu_mla")
    planes = 1 if mla else 2
    for t in range(start, stop):
        sd, sp, ss = locate(t, p.dcp_size, p.interleave_size, p.page_size, src_tables)
        dd, dp, ds = locate(t, d.dcp_size, d.interleave_size, d.page_size, dst_tables)
        for dt in range(d.tp_size):
            dheads = heads_held(d.num_kv_heads, d.tp_size, dt, mla)
            for dh, h in enumerate(dheads):
                if mla:
                    st, sh = mla_source_tp_rank, 0
                else:
                    st = min(r for r in range(p.tp_size) if h in heads_held(p.num_kv_heads, p.tp_size, r, False))
                    sh = heads_held(p.num_kv_heads, p.tp_size, st, False).index(h)
                for layer in range(num_layers):
                    for plane in range(planes):
                        src = cell(p.layout, src_caches[(sd, st)][layer], sp, ss, plane, sh, p.head_dim)
                        dst = cell(d.layout, dst_caches[(dd, dt)][layer], dp, ds, plane, dh, d.head_dim)
                        dst[...] = src


def reference_rows(p, d, start, stop, src_tables, dst_tables, mla_source_tp_rank=0) -> list[tuple[int, ...]]:
    """Per (token, head, decode TP rank): ``(token, src_dcp, src_tp, src_page, src_slot, src_head,
    dst_dcp, dst_tp, dst_page, dst_slot, dst_head)``, heads local to each rank, sorted."""
    mla = p.layout in ("sglang_mla", "tpu_mla")
    moves = []  # (src_tp, src_head, dst_tp, dst_head), the same for every token
    for dt in range(d.tp_size):
        for dh, h in enumerate(heads_held(d.num_kv_heads, d.tp_size, dt, mla)):
            if mla:
                st, sh = mla_source_tp_rank, 0
            else:
                st = min(r for r in range(p.tp_size) if h in heads_held(p.num_kv_heads, p.tp_size, r, False))
                sh = heads_held(p.num_kv_heads, p.tp_size, st, False).index(h)
            moves.append((st, sh, dt, dh))
    out = []
    for t in range(start, stop):
        sd, sp, ss = locate(t, p.dcp_size, p.interleave_size, p.page_size, src_tables)
        dd, dp, ds = locate(t, d.dcp_size, d.interleave_size, d.page_size, dst_tables)
        out.extend((t, sd, st, sp, ss, sh, dd, dt, dp, ds, dh) for st, sh, dt, dh in moves)
    return sorted(out)
