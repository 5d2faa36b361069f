"""The heterogeneous plan over a real transfer engine: byte descriptors straight from each prefill
cache into each decode cache, one WRITE batch per stream, through `bridge` (NIXL, Mooncake,
jax-transfer).

`stream_descriptors` turns a `HeteroPlan` into ``i64[n, 3]`` ``(src_addr, dst_addr, nbytes)``
rows per stream ``(src_dcp, src_tp, dst_dcp, dst_tp)``: for each group of the plan and each
layer, the byte segments of both layouts (`dcp_jax.hetero.layouts.segments`) are listed in wire
order (plane, token, segment), cut to the smaller of the two segment lengths (they nest: a head
row or all heads of a token row), paired one to one, and merged where both sides continue. So
every layout pair lands directly, without a wire block or an extra copy; layouts whose
segments are small (``tpu_gqa``, ``hnd`` with several heads) simply cost more descriptors, which
the counts show. `execute_over_engines` registers the caches with one prefill and one decode
engine and WRITEs every stream; its result is checked against the numpy mover
(`dcp_jax.hetero.mover.execute_plan`) and the per-token reference in tests/hetero.
"""
from __future__ import annotations

import numpy as np

from dcp_jax.hetero.layouts import segments
from dcp_jax.hetero.plan import HeteroPlan

__all__ = ["pair_descriptors", "stream_descriptors", "execute_over_engines"]


def _pages_of(side, layers) -> int:
    """The page count of a rank's caches (the one dimension a geometry takes from the cache)."""
    return layers[0].shape[1 if side.layout in ("nhd", "hnd") else 0]


def _units(offsets: np.ndarray, seg: int, unit: int) -> np.ndarray:
    """Offsets ``[n, planes, segs]`` of ``seg``-byte segments, in wire order, cut to ``unit`` bytes."""
    wire = np.ascontiguousarray(offsets.transpose(1, 0, 2)).reshape(-1)
    return (wire[:, None] + np.arange(seg // unit, dtype=np.int64) * unit).reshape(-1)


def _merge(descs: np.ndarray) -> np.ndarray:
    """Merges rows that continue the previous one on both sides."""
    if len(descs) < 2:
        return descs
    cont = (descs[1:, 0] == descs[:-1, 0] + descs[:-1, 2]) & (descs[1:, 1] == descs[:-1, 1] + descs[:-1, 2])
    start = np.flatnonzero(np.r_[True, ~cont])
    return np.stack([descs[start, 0], descs[start, 1], np.add.reduceat(descs[:, 2], start)], axis=1)


def pair_descriptors(src_geom, dst_geom, src_pages, src_slots, dst_pages, dst_slots, src_head: int, dst_head: int,
                     num_heads: int, src_bases, dst_bases) -> np.ndarray:
    """Direct descriptors of one head piece of tokens ``i`` (``(src_pages[i], src_slots[i])`` ->
    ``(dst_pages[i], dst_slots[i])``), every layer, merged where both sides continue.

    Args:
        src_geom, dst_geom: `CacheGeometry` of one layer on each side.
        src_pages, src_slots, dst_pages, dst_slots: int ``[n]`` token locations on each side.
        src_head, dst_head, num_heads: the head piece (local first heads on each rank, count).
        src_bases, dst_bases: int ``[L]`` address of each layer's cache (bytes).

    Returns:
        int64 ``[k, 3]`` of ``(src_addr, dst_addr, nbytes)`` in source-address order.

    Raises:
        ValueError: layer counts differ, or segment lengths that do not nest (no layout pair
            produces them).
    """
    src_bases, dst_bases = np.asarray(src_bases, np.int64), np.asarray(dst_bases, np.int64)
    if src_bases.shape != dst_bases.shape:
        raise ValueError(f"src_bases and dst_bases need one address per layer, got {src_bases.size} and {dst_bases.size}")
    so, sl = segments(src_geom, src_pages, src_slots, src_head, num_heads)
    do, dl = segments(dst_geom, dst_pages, dst_slots, dst_head, num_heads)
    unit = min(sl, dl)
    if max(sl, dl) % unit:
        raise ValueError(f"segments of {sl} and {dl} bytes do not nest ({src_geom.layout} -> {dst_geom.layout})")
    su, du = _units(so, sl, unit), _units(do, dl, unit)
    out = [np.stack([a + su, b + du, np.full(su.size, unit, np.int64)], axis=1)
           for a, b in zip(src_bases.tolist(), dst_bases.tolist())]
    if not out:
        return np.zeros((0, 3), np.int64)
    # Source-address order puts each head's tokens side by side (wire order interleaves the heads
    # of a token), so runs contiguous on both sides merge; one batch has no order to keep.
    d = np.concatenate(out)
    return _merge(d[np.argsort(d[:, 0], kind="stable")])


def stream_descriptors(plan: HeteroPlan, src_caches: dict, dst_caches: dict, num_layers: int
                       ) -> dict[tuple[int, int, int, int], np.ndarray]:
    """Direct cache-to-cache descriptors of every stream of ``plan``.

    Args:
        plan: the plan.
        src_caches, dst_caches: ``{(dcp_rank, tp_rank): [num_layers C-contiguous numpy caches]}``
            in each side's layout (`dcp_jax.hetero.layouts.cache_shape`); addresses are taken
            from them, so these very arrays must be the registered memory.
        num_layers: layers per rank.

    Returns:
        ``{(src_dcp, src_tp, dst_dcp, dst_tp): int64 [n, 3]}`` of ``(src_addr, dst_addr, nbytes)``
        (bytes; all layers of the stream in one array).

    Raises:
        ValueError: missing caches or a wrong layer count (named); segment lengths that do not
            nest (no layout pair produces them).
    """
    out: dict[tuple[int, int, int, int], list[np.ndarray]] = {}
    for (sd, st, dd, dt, sh, dh, nh), rows in plan.groups():
        src, dst = src_caches.get((sd, st)), dst_caches.get((dd, dt))
        for name, layers, key in (("src_caches", src, (sd, st)), ("dst_caches", dst, (dd, dt))):
            if layers is None or len(layers) != num_layers:
                raise ValueError(f"{name}[{key}] must hold {num_layers} layer caches")
        sg = plan.prefill.geometry(st, _pages_of(plan.prefill, src))
        dg = plan.decode.geometry(dt, _pages_of(plan.decode, dst))
        out.setdefault((sd, st, dd, dt), []).append(pair_descriptors(
            sg, dg, plan.src_page[rows], plan.src_slot[rows], plan.dst_page[rows], plan.dst_slot[rows], sh, dh, nh,
            [a.ctypes.data for a in src], [b.ctypes.data for b in dst]))
    return {k: _merge(np.concatenate(v)) for k, v in out.items()}


def execute_over_engines(plan: HeteroPlan, src_caches: dict, dst_caches: dict, num_layers: int, *,
                         engines=None, engine: str = "nixl", timeout_s: float = 60.0) -> dict:
    """Moves ``plan`` with real engine WRITEs, one batch per stream, each notified on landing.

    Args:
        plan, src_caches, dst_caches, num_layers: as `stream_descriptors`.
        engines: ``(prefill engine, decode engine)`` to use (the caches are registered for the
            call and deregistered after); None makes a pair of kind ``engine`` and closes it.
        engine: `bridge.make_engine` kind when ``engines`` is None.
        timeout_s: bound on each batch and its notification, seconds.

    Returns:
        ``{"streams", "descriptors", "bytes", "descriptors_per_dst": {(dcp_rank, tp_rank): n}}``.

    Raises:
        bridge.BridgeError: an engine refused a registration or a batch failed (the peer named).
    """
    from bridge import make_engine

    descs = stream_descriptors(plan, src_caches, dst_caches, num_layers)
    own = engines is None
    ini, tgt = (make_engine(engine, "hetero-prefill"), make_engine(engine, "hetero-decode")) if own else engines
    src_arrays = [a for v in src_caches.values() for a in v]
    dst_arrays = [a for v in dst_caches.values() for a in v]
    ini.register(src_arrays)
    try:
        tgt.register(dst_arrays)
        try:
            peer = ini.add_peer(tgt.peer_info())
            per_dst = {k: 0 for k in dst_caches}
            for k, (key, d) in enumerate(sorted(descs.items())):
                tag = f"hetero-{k}".encode()
                ini.wait(ini.transfer_batch(peer, d, notif=tag, dcp_rank=key[2]), timeout_s=timeout_s)
                tgt.wait_notification(ini.name, tag, timeout_s=timeout_s)
                per_dst[key[2:]] += len(d)
            ini.remove_peer(peer)
        finally:
            tgt.deregister(dst_arrays)
    finally:
        ini.deregister(src_arrays)
        if own:
            ini.close()
            tgt.close()
    return dict(streams=len(descs), descriptors=sum(len(d) for d in descs.values()),
                bytes=int(sum(int(d[:, 2].sum()) for d in descs.values())), descriptors_per_dst=per_dst)
