"""A sender's checks of a chunk against what its request already holds: a chunk the decode ranks
need not get (`redundant`), and a reused id's chunk whose pages moved (`moved_page`, spec
section 10: a request's page table never moves a page between chunks).
"""
from __future__ import annotations

import numpy as np

from dcp_jax.layout import local_len_np
from dcp_jax.transfer.requests import SendRequest

__all__ = ["moved_page", "redundant"]


def redundant(req: SendRequest, start: int, stop: int) -> bool:
    """Whether a chunk of a SUCCESS request is one its ranks need not get: within every rank's
    announced tokens and overlapping no chunk already sent (they hold those tokens, by prefix or
    by transfer), or any chunk overlapping none sent when no decode rank takes anything from
    this sender (``needed`` empty: a TP rank whose heads another rank sends, or whose heads no
    decode rank of the group holds; its serving loop sends every chunk all the same). A chunk
    past the ranks' tokens, or sent twice, is more likely a reused id's: refused."""
    if req.sent.overlaps(start, stop):
        return False
    if req.needed is not None and not req.needed:
        return True
    return bool(req.targets) and stop <= min(t.num_tokens for t in req.targets.values())


def moved_page(rid: str, chunks: list, table: np.ndarray, spec) -> str | None:
    """Why a chunk's page table cannot be this request's: it gives another page than an earlier
    chunk's table did for local rows that chunk sent (those rows' KV is in that page; entries
    past them, such as a fixed-width table's padding, are not compared); or None."""
    for start, stop, before in chunks:
        lo = int(local_len_np(start, spec.dcp_size, spec.dcp_rank, spec.interleave_size)) // spec.page_size
        hi = -(-int(local_len_np(stop, spec.dcp_size, spec.dcp_rank, spec.interleave_size)) // spec.page_size)
        hi = min(hi, len(before), len(table))
        moved = np.flatnonzero(before[lo:hi] != table[lo:hi])
        if len(moved):
            k = lo + int(moved[0])
            return (f"page_table[{k}]={int(table[k])} but an earlier send of request_id={rid!r} gave page "
                    f"{int(before[k])} for tokens it sent: a request's pages do not move between chunks (a late "
                    "send of a request released meanwhile? its id named a new request from that send on)")
    return None
