"""Head and layout views: what one prefill rank sends one decode rank when the two sides differ
in TP split or cache layout (the heterogeneous pairs of `dcp_jax.hetero`, in the connector).

A pair uses views (`uses_views`) when the layouts differ or either side has ``tp_size > 1``;
otherwise rows move whole, as before. With views, each side's `KVCacheSpec` declares its
``layout`` (a name of `dcp_jax.hetero.layouts.LAYOUTS`; the connector's ``"mla"`` is
``"sglang_mla"``), ``tp_size``/``tp_rank``, ``num_kv_heads`` and ``head_dim``; every prefill
(DCP, TP) rank is connected to every decode (DCP, TP) rank, and one pair moves:

- GQA: the heads both ranks hold (`dcp_jax.hetero.plan.head_pieces`: a replicated head is sent
  by the lowest prefill TP rank holding it); none at all when they share no head;
- MLA: the latent, replicated over TP, from prefill TP rank ``decode tp_rank % prefill tp_size``
  only (each decode rank gets it once, the sends spread over the prefill ranks).

The token rows are the schedule's as for any pair (each side's own page size, DCP size and
interleave); `StreamView.descriptors` turns ``(src_rows, dst_rows)`` into direct cache-to-cache
descriptors through both layouts (`dcp_jax.hetero.engine_path.pair_descriptors`), so every layout
pair lands in place, without a pack or a decode-side scatter. A pair with no piece still sends its
chunks' completions (notification-only batches), so the decode rank's completion rule is unchanged.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from dcp_jax.hetero.engine_path import pair_descriptors
from dcp_jax.hetero.layouts import CacheGeometry, cache_shape
from dcp_jax.hetero.plan import HeteroPlanError, HeteroSide, head_pieces
from dcp_jax.transfer.spec import HandshakeError, KVCacheSpec

__all__ = ["uses_views", "check_view_pair", "StreamView", "stream_view"]


def uses_views(prefill: KVCacheSpec, decode: KVCacheSpec) -> bool:
    """True when the pair moves head pieces through both layouts instead of whole rows."""
    return prefill.layout != decode.layout or prefill.tp_size > 1 or decode.tp_size > 1


def _side(spec: KVCacheSpec, who: str) -> HeteroSide:
    try:
        return HeteroSide.from_spec(spec)
    except (TypeError, ValueError) as exc:
        raise HandshakeError("layout", None, None, f"the {who} side's spec cannot be paired by heads "
                             f"and layout: {exc}") from None


def _token_bytes(side: HeteroSide, tp_rank: int) -> int:
    """Cache bytes per token per layer on ``tp_rank`` (padding included: ``tpu_mla`` lanes)."""
    g = side.geometry(tp_rank, 1)
    return int(np.prod(cache_shape(g))) * g.itemsize // g.page_size


def check_view_pair(prefill: KVCacheSpec, decode: KVCacheSpec) -> tuple[HeteroSide, HeteroSide]:
    """Refuses a view pair the plan cannot serve; returns both sides.

    Raises:
        HandshakeError: ``num_layers`` or ``dtype`` differ, a side is not a per-head or MLA layout
            the plan knows, the two describe different models (``num_kv_heads``, ``head_dim``,
            layout kind), or a side's ``item_lens`` is not its layout's bytes per token.
    """
    for field in ("num_layers", "dtype"):
        a, b = getattr(prefill, field), getattr(decode, field)
        if a != b:
            raise HandshakeError(field, a, b, "" if field == "num_layers" else
                                 "the connector moves bytes and never converts them")
    p, d = _side(prefill, "prefill"), _side(decode, "decode")
    try:
        head_pieces(p, d)
    except HeteroPlanError as exc:
        raise HandshakeError(exc.field, exc.prefill, exc.decode, "the two sides describe different models") from None
    for who, spec, side in (("prefill", prefill, p), ("decode", decode, d)):
        want = _token_bytes(side, spec.tp_rank)
        bad = [k for k, v in enumerate(spec.item_lens) if v != want]
        if bad:
            raise HandshakeError("item_lens", None, None, f"the {who} side declares item_lens[{bad[0]}]="
                                 f"{spec.item_lens[bad[0]]}, its {side.layout} cache holds {want} bytes per token "
                                 f"({side.heads(spec.tp_rank)[1]} heads of {side.head_dim} on TP rank {spec.tp_rank})")
    return p, d


@dataclasses.dataclass(frozen=True)
class StreamView:
    """One (prefill rank, decode rank) pair's head pieces and both layer geometries.

    Attributes:
        src_geom, dst_geom: one layer's `CacheGeometry` on the prefill / decode rank.
        pieces: int64 ``[k, 3]`` ``(src_head, dst_head, num_heads)``, heads local to each rank;
            ``k = 0`` when this pair moves nothing.
    """

    src_geom: CacheGeometry
    dst_geom: CacheGeometry
    pieces: np.ndarray

    def row_bytes(self) -> int:
        """Bytes one token row of this pair moves over one layer (0 with no piece)."""
        g = self.dst_geom
        return int(self.pieces[:, 2].sum()) * g.planes * g.head_dim * g.itemsize

    def descriptors(self, src_rows, dst_rows, src_bases, dst_bases) -> np.ndarray:
        """Direct descriptors of token rows ``src_rows[i] -> dst_rows[i]`` (each side's rows,
        ``page * page_size + slot``), every piece and layer.

        Args:
            src_rows, dst_rows: int ``[n]`` rows of the prefill / decode cache.
            src_bases, dst_bases: int ``[L]`` addresses of each layer's cache (bytes).

        Returns:
            int64 ``[k, 3]`` ``(src_addr, dst_addr, nbytes)``; ``[0, 3]`` with no piece or row.
        """
        src_rows, dst_rows = np.asarray(src_rows, np.int64), np.asarray(dst_rows, np.int64)
        if src_rows.shape != dst_rows.shape:
            raise ValueError(f"src_rows and dst_rows must have equal length, got {src_rows.shape} and {dst_rows.shape}")
        if not src_rows.size or not len(self.pieces):
            return np.zeros((0, 3), np.int64)
        sp, dp = self.src_geom.page_size, self.dst_geom.page_size
        out = [pair_descriptors(self.src_geom, self.dst_geom, src_rows // sp, src_rows % sp, dst_rows // dp,
                                dst_rows % dp, sh, dh, nh, src_bases, dst_bases)
               for sh, dh, nh in self.pieces.tolist()]
        return np.concatenate(out)


def stream_view(prefill: KVCacheSpec, decode: KVCacheSpec, src_pages: int, dst_pages: int) -> StreamView:
    """The `StreamView` of the pair (``prefill.tp_rank`` -> ``decode.tp_rank``; module rule).

    Args:
        prefill, decode: the two specs (checked by `check_view_pair`).
        src_pages, dst_pages: pages of each side's layer caches (>= 1).

    Raises:
        HandshakeError: as `check_view_pair`.
    """
    p, d = check_view_pair(prefill, decode)
    s, t = prefill.tp_rank, decode.tp_rank
    rows = head_pieces(p, d, mla_source_tp_rank=t % p.tp_size)
    sel = (rows[:, 0] == s) & (rows[:, 1] == t)
    return StreamView(p.geometry(s, src_pages), d.geometry(t, dst_pages), np.ascontiguousarray(rows[sel, 2:]))
