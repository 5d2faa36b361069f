"""Head and layout views: what one prefill rank sends one decode rank when the two sides differ
in TP split or cache layout (the heterogeneous pairs of `dcp_jax.hetero`, in the connector).

A pair uses views (`uses_views`) when the layouts differ, either side has ``tp_size > 1``, or
the layout splits a token's row (``nhd``, ``hnd``); otherwise rows move whole, as before. With
views, each side's `KVCacheSpec` declares its ``layout`` (a name of `dcp_jax.hetero.layouts.LAYOUTS`; the connector's ``"mla"`` is
``"sglang_mla"``), ``tp_size``/``tp_rank``, ``num_kv_heads`` and ``head_dim``; every prefill
(DCP, TP) rank is connected to every decode (DCP, TP) rank, and one pair moves:

- GQA: the heads both ranks hold (`dcp_jax.hetero.plan.head_pieces`: a replicated head is sent
  by the lowest prefill TP rank holding it); none at all when they share no head;
- MLA: the latent, replicated over TP, from prefill TP rank ``decode tp_rank % prefill tp_size``
  only (each decode rank gets it once, the sends spread over the prefill ranks).

The token rows are the schedule's as for any pair (each side's own page size, DCP size and
interleave); `StreamView.descriptors` turns ``(src_rows, dst_rows)`` into direct cache-to-cache
descriptors through both layouts (`dcp_jax.hetero.engine_path.pair_descriptors`), so every layout
pair lands in place, without a pack or a decode-side scatter. A pair with no piece (`pair_moves`
False) is not part of a request: the decode rank announces it only to the senders that move it
something, and a sender waits only for the decode ranks it moves something to
(`served_group_ranks`); so a decode rank may connect to just the prefill TP ranks holding its heads
(vLLM's pairing) and both sides still end SUCCESS.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from dcp_jax.hetero.engine_path import pair_descriptors
from dcp_jax.hetero.layouts import LAYOUTS, CacheGeometry, cache_shape, gather_to_wire, place_from_wire, wire_bytes
from dcp_jax.hetero.plan import HeteroPlanError, HeteroSide, head_pieces
from dcp_jax.transfer.spec import HandshakeError, KVCacheSpec

__all__ = ["uses_views", "check_view_pair", "StreamView", "stream_view", "side_view", "pair_pieces", "pair_moves", "served_group_ranks",
           "uncovered_heads", "view_path",
           "VIEW_MODES"]


#: Layouts whose token rows are not contiguous (K and V planes apart; HND: heads apart): any pair
#: of them moves through views, even with equal layouts and no TP.
SPLIT_ROW_LAYOUTS = ("nhd", "hnd")


def uses_views(prefill: KVCacheSpec, decode: KVCacheSpec) -> bool:
    """True when the pair moves head pieces through both layouts instead of whole rows."""
    return (prefill.layout != decode.layout or prefill.tp_size > 1 or decode.tp_size > 1
            or prefill.layout in SPLIT_ROW_LAYOUTS)


def _side(spec: KVCacheSpec, who: str) -> HeteroSide:
    try:
        return HeteroSide.from_spec(spec)
    except (TypeError, ValueError) as exc:
        raise HandshakeError("layout", None, None, f"the {who} side's spec cannot be paired by heads "
                             f"and layout: {exc}") from None


#: Layout names the views pair by heads (the connector's ``"mla"`` is ``"sglang_mla"``); any other
#: `KVCacheSpec.layout` is a custom label, served only as whole rows between equal labels.
VIEW_LAYOUTS = ("mla",) + LAYOUTS


def _check_labels(prefill_layout: str, decode_layout: str) -> None:
    """Refuses two different layout labels when either is custom (not in `VIEW_LAYOUTS`): such a
    label means whole rows, which need the same label on both sides. Both labels are named;
    an unknown label on one side says so, with the names the views know.

    Raises:
        HandshakeError: field ``"layout"``, ``ours`` the prefill label, ``theirs`` the decode one.
    """
    if prefill_layout == decode_layout:
        return
    custom = [x for x in (prefill_layout, decode_layout) if x not in VIEW_LAYOUTS]
    if not custom:
        return
    detail = ("the layout labels differ: a custom label moves whole rows and needs the same label on both "
              "sides")
    if len(custom) == 1:
        detail += f"; {custom[0]!r} is not a layout the views pair by heads (one of {VIEW_LAYOUTS})"
    raise HandshakeError("layout", prefill_layout, decode_layout, detail)


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
    _check_labels(prefill.layout, decode.layout)
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

    def _blocks(self, rows, geom: CacheGeometry, num_layers: int, head_col: int):
        """``(layer, pages, slots, head0, num_heads, offset, nbytes)`` of each wire block of
        ``rows``: layer-major, then piece, each in the adapters' wire order (plane, token, head)."""
        rows = np.asarray(rows, np.int64)
        pages, slots = rows // geom.page_size, rows % geom.page_size
        off = 0
        for layer in range(num_layers):
            for piece in self.pieces.tolist():
                nbytes = wire_bytes(geom, rows.size, piece[2])
                yield layer, pages, slots, piece[head_col], piece[2], off, nbytes
                off += nbytes

    def pack(self, layer_bytes, src_rows, out: np.ndarray, offset: int = 0) -> int:
        """Gathers the pair's wire block of ``src_rows`` into ``out[offset:]`` (the region path);
        returns its bytes (``len(src_rows) * row_bytes() * layers``).

        Args:
            layer_bytes: per layer, the prefill cache's bytes as a host uint8 array (`CacheLayers.rows`).
            src_rows: int ``[n]`` rows of the prefill cache.
            out: host uint8 ``[>= offset + bytes]``: the pack region.

        Raises:
            TypeError: device memory (the region path of a view pair runs on the host).
        """
        caches = _host_caches(layer_bytes, self.src_geom, "the prefill side's KV layers")
        end = offset
        for layer, pages, slots, h0, nh, off, nbytes in self._blocks(src_rows, self.src_geom, len(caches), 0):
            g, cache = caches[layer]
            out[offset + off: offset + off + nbytes] = gather_to_wire(g, cache, pages, slots, h0, nh)
            end = offset + off + nbytes
        return end - offset

    def unpack(self, region: np.ndarray, offset: int, layer_bytes, dst_rows) -> None:
        """Places a landed wire block (`pack`'s, at ``region[offset:]``) into the decode cache at
        ``dst_rows``, in place: the decode-side scatter for layouts descriptors cannot land
        directly in few pieces (the numpy adapter `dcp_jax.hetero.layouts.place_from_wire`).

        Raises:
            TypeError: device memory (the region path of a view pair runs on the host).
        """
        caches = _host_caches(layer_bytes, self.dst_geom, "the decode side's KV layers")
        for layer, pages, slots, h0, nh, off, nbytes in self._blocks(dst_rows, self.dst_geom, len(caches), 1):
            g, cache = caches[layer]
            place_from_wire(g, cache, region[offset + off: offset + off + nbytes], pages, slots, h0, nh)

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


def _host_caches(layer_bytes, geom: CacheGeometry, what: str) -> list[tuple[CacheGeometry, np.ndarray]]:
    """Each layer's ``(geometry, cache)``: its bytes seen as its cache (page count from the bytes)."""
    out = []
    for a in layer_bytes:
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{what} are {type(a).__name__}: a TP or layout pair's region path packs on the host")
        flat = a.reshape(-1).view(np.uint8)
        per_page = int(np.prod(cache_shape(dataclasses.replace(geom, num_pages=1)))) * geom.itemsize
        g = dataclasses.replace(geom, num_pages=flat.size // per_page)
        out.append((g, flat.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[geom.itemsize]).reshape(cache_shape(g))))
    return out


def stream_view(prefill: KVCacheSpec, decode: KVCacheSpec, src_pages: int, dst_pages: int) -> StreamView:
    """The `StreamView` of the pair (``prefill.tp_rank`` -> ``decode.tp_rank``; module rule).

    Args:
        prefill, decode: the two specs (checked by `check_view_pair`).
        src_pages, dst_pages: pages of each side's layer caches (>= 1).

    Raises:
        HandshakeError: as `check_view_pair`.
    """
    p, d = check_view_pair(prefill, decode)
    return side_view(p, d, prefill.tp_rank, decode.tp_rank, src_pages, dst_pages)


def side_view(prefill: HeteroSide, decode: HeteroSide, src_tp: int, dst_tp: int, src_pages: int,
              dst_pages: int) -> StreamView:
    """The `StreamView` of prefill TP rank ``src_tp`` -> decode TP rank ``dst_tp`` of two checked
    `HeteroSide`s (what `stream_view` builds from the specs; the plan's cost report counts with it)."""
    return StreamView(prefill.geometry(src_tp, src_pages), decode.geometry(dst_tp, dst_pages),
                      _pieces(prefill, decode, src_tp, dst_tp))


def _pieces(p: HeteroSide, d: HeteroSide, src_tp, dst_tp: int) -> np.ndarray:
    """int64 ``[k, 3]`` ``(src_head, dst_head, num_heads)`` prefill TP rank(s) ``src_tp`` (an int or
    None: every one) send decode TP rank ``dst_tp`` (module rule); with ``src_tp`` None ``[k, 4]``,
    the prefill TP rank first."""
    rows = head_pieces(p, d, mla_source_tp_rank=dst_tp % p.tp_size)
    sel = rows[:, 1] == dst_tp
    if src_tp is None:
        return np.ascontiguousarray(rows[sel][:, [0, 2, 3, 4]])
    return np.ascontiguousarray(rows[sel & (rows[:, 0] == src_tp), 2:])


def pair_pieces(prefill: KVCacheSpec, decode: KVCacheSpec) -> np.ndarray:
    """The heads one (prefill, decode) rank pair moves: int64 ``[k, 3]`` ``(src_head, dst_head,
    num_heads)``, heads local to each rank (`StreamView.pieces`).

    Raises:
        HandshakeError: as `check_view_pair`.
    """
    p, d = check_view_pair(prefill, decode)
    return _pieces(p, d, prefill.tp_rank, decode.tp_rank)


@functools.lru_cache(maxsize=256)  # asked per link at every expect: the answer is the specs'
def pair_moves(prefill: KVCacheSpec, decode: KVCacheSpec) -> bool:
    """Whether the pair moves any bytes: rows move whole, or `pair_pieces` is not empty.

    Raises:
        HandshakeError: as `check_view_pair`.
    """
    return not uses_views(prefill, decode) or len(pair_pieces(prefill, decode)) > 0


def reported_path(path: str, prefill: KVCacheSpec, decode: KVCacheSpec) -> str:
    """A connection's path as `KVSender.peers` / `KVReceiver.peers` and `request_stats` report it:
    the handshake's ``path``, or "none" for a pair that moves nothing (`pair_moves`)."""
    return path if pair_moves(prefill, decode) else "none"


@functools.lru_cache(maxsize=256)
def served_group_ranks(prefill: KVCacheSpec, decode: KVCacheSpec) -> frozenset[int]:
    """The decode group ranks (``tp_rank * dcp_size + dcp_rank``, `KVCacheSpec.group_rank`) the
    sender ``prefill`` moves bytes to: the ones a request waits for at that sender.

    Args:
        prefill: the sender's spec.
        decode: the spec of any rank of the decode group (its ``dcp_size``/``tp_size`` and
            geometry; the other ranks differ only in ``dcp_rank``/``tp_rank``).

    Raises:
        HandshakeError: as `check_view_pair`.
    """
    if not uses_views(prefill, decode):
        return frozenset(range(decode.group_size))
    p, d = check_view_pair(prefill, decode)
    # The pieces depend on the TP ranks only (every DCP rank holds every head of its TP rank). One
    # head plan for every decode TP rank, not one each (both TP sizes may be MAX_TP_SIZE).
    if p.kind == "mla":  # decode TP rank t's latent comes from prefill TP rank t % tp_size
        moves = np.arange(decode.tp_size) % p.tp_size == prefill.tp_rank
    else:
        rows = head_pieces(p, d)
        moves = np.zeros(decode.tp_size, bool)
        moves[rows[rows[:, 0] == prefill.tp_rank, 1]] = True
    g = np.arange(decode.group_size)
    return frozenset(g[moves[g // decode.dcp_size]].tolist())


@functools.lru_cache(maxsize=256)
def uncovered_heads(decode: KVCacheSpec, senders: tuple[KVCacheSpec, ...]) -> tuple[tuple, ...]:
    """KV heads of the decode rank ``decode`` that no sender in ``senders`` moves to it, per
    prefill DCP rank: the coverage rule `KVReceiver.expect` enforces.

    Every prefill DCP rank holds some tokens of every request, so for each one among ``senders``,
    the heads its connected TP ranks move to this rank (module rule: a GQA head from the lowest
    prefill TP rank holding it, MLA's latent from prefill TP rank ``decode tp_rank % prefill
    tp_size`` only) must together be every head this rank holds. A pair that moves whole rows (not
    `uses_views`) covers them all. A prefill DCP rank with no sender at all is not reported here
    (`receiver.missing_senders` names those).

    Args:
        decode: this decode rank's spec.
        senders: the connected senders' specs (each already accepted by `check_compatible`).

    Returns:
        ``(prefill_dcp_rank, head0, head1, source_tp_ranks)`` tuples, sorted: global KV heads
        ``[head0, head1)`` of this rank not covered, and the prefill TP ranks that would send them.
        Empty when every head comes.

    Raises:
        HandshakeError: a pair `check_view_pair` refuses.
    """
    whole = {sp.dcp_rank for sp in senders if not uses_views(sp, decode)}
    by_rank: dict[int, list[KVCacheSpec]] = {}
    for sp in senders:
        if sp.dcp_rank not in whole:
            by_rank.setdefault(sp.dcp_rank, []).append(sp)
    out = []
    t = decode.tp_rank
    d = _side(decode, "decode") if by_rank else None
    for rank, specs in sorted(by_rank.items()):
        head0, count = d.heads(t)
        got = np.zeros(count, bool)
        for sp in specs:
            for _, dh, nh in pair_pieces(sp, decode).tolist():
                got[dh:dh + nh] = True
        if got.all():
            continue
        every = _pieces(_side(specs[0], "prefill"), d, None, t)  # who would send each of this rank's heads
        edges = np.flatnonzero(np.diff(np.concatenate([[1], got.astype(np.int8), [1]])))
        for lo, hi in zip(edges[::2].tolist(), edges[1::2].tolist()):
            src = sorted({s for s, _, dh, nh in every.tolist() if dh < hi and lo < dh + nh})
            out.append((rank, head0 + lo, head0 + hi, tuple(src)))
    return tuple(out)


#: Sender modes a view pair takes: ``direct`` (cache-to-cache descriptors through both layouts),
#: ``region`` (the pair's wire block packed on the host, one descriptor per window into the decode
#: rank's receive region, placed there by `StreamView.unpack`), ``auto`` (region when offered).
VIEW_MODES = ("auto", "direct", "region")


def view_path(mode: str, view: StreamView, num_layers: int, sender_mem: str, offer) -> str:
    """The path of a view pair: ``mode`` as asked, ``auto`` = region when the decode rank offers a
    receive region of at least one token's wire bytes and both sides are host memory, else direct.
    A pair with no piece goes direct (its batches are notifications only).

    Raises:
        HandshakeError: field ``"path"``: a mode a view pair does not take (packed, fused), or
            region asked where it cannot be served (says why).
    """
    if mode not in VIEW_MODES:
        raise HandshakeError("path", None, None, f"mode={mode!r}: a TP or layout pair moves head pieces "
                             f"{' or '.join(VIEW_MODES[1:])} (KVSender(mode=...) one of {VIEW_MODES})")
    need = view.row_bytes() * num_layers
    if mode == "direct" or need == 0:
        return "direct"
    why = ("the sender's KV is device memory" if sender_mem != "DRAM" else
           "the receiver's KV is device memory" if offer.mem != "DRAM" else
           f"the receiver offers a receive region of {offer.region_bytes} bytes, less than one token's {need}"
           if offer.region_bytes < need else "")
    if mode == "region" and why:
        raise HandshakeError("path", None, None, f"the region path of a TP or layout pair cannot be served: {why}")
    return "direct" if why else "region"
