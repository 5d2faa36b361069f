"""A host (numpy) mover that executes a `HeteroPlan`: gather each stream's wire block from the
prefill caches, place it into the decode caches. The reference the device path must match.

Caches are ``{(dcp_rank, tp_rank): [layer 0 cache, layer 1 cache, ...]}`` numpy arrays in each
side's layout (`dcp_jax.hetero.layouts.cache_shape`).
"""
from __future__ import annotations


from dcp_jax.hetero.layouts import gather_to_wire, place_from_wire
from dcp_jax.hetero.plan import HeteroPlan

__all__ = ["execute_plan"]


def _layers_of(caches, key, name: str, num_layers: int):
    if key not in caches:
        raise ValueError(f"{name} has no caches for rank (dcp_rank, tp_rank)={key}")
    layers = caches[key]
    if len(layers) != num_layers:
        raise ValueError(f"{name}[{key}] has {len(layers)} layers, expected {num_layers}")
    return layers


def execute_plan(plan: HeteroPlan, src_caches: dict, dst_caches: dict, num_layers: int) -> int:
    """Moves every planned row, layer by layer, through the wire format.

    Args:
        plan: the plan; src_caches/dst_caches: per-rank lists of ``num_layers`` caches (the
            decode ones are written in place).

    Returns:
        Wire bytes moved (all layers, all streams).

    Raises:
        ValueError: a rank's caches are missing or have the wrong count or shape (named).
    """
    moved = 0
    for (sd, st, dd, dt, sh, dh, nh), rows in plan.groups():
        src = _layers_of(src_caches, (sd, st), "src_caches", num_layers)
        dst = _layers_of(dst_caches, (dd, dt), "dst_caches", num_layers)
        # The page count is the one dimension a geometry takes from the cache itself.
        sg = plan.prefill.geometry(st, src[0].shape[1 if plan.prefill.layout in ("nhd", "hnd") else 0])
        dg = plan.decode.geometry(dt, dst[0].shape[1 if plan.decode.layout in ("nhd", "hnd") else 0])
        for layer in range(num_layers):
            wire = gather_to_wire(sg, src[layer], plan.src_page[rows], plan.src_slot[rows], sh, nh)
            place_from_wire(dg, dst[layer], wire, plan.dst_page[rows], plan.dst_slot[rows], dh, nh)
            moved += wire.size
    return moved
