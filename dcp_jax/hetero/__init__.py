"""Heterogeneous prefill/decode (issue 15): any page size, DCP size and interleave, TP size and KV
cache layout on each side, converted byte-exactly. The plan and a numpy mover; the plan over real
engines (`dcp_jax.hetero.engine_path`: direct cache-to-cache descriptors, NIXL / Mooncake); the
cost report (`dcp_jax.hetero.cost`, ``dcp-jax plan --decode-layout ...``). The connector moves
rows between different page sizes (the job's ``--prefill-page-size``) and TP and layout pairs
(`dcp_jax.transfer.views`: head pieces through both layouts, direct or through the decode rank's
receive region); `dcp_jax.hetero.connector_job` runs them one process per rank.

Guide:

- :mod:`dcp_jax.hetero.plan`: each side declares a `HeteroSide` (page_size, dcp_size,
  interleave_size, tp_size, layout, num_kv_heads, head_dim, dtype). `build_hetero_plan` maps
  every token of ``[start, stop)`` (and for GQA every head range, see `head_pieces`) from its
  prefill (dcp_rank, tp_rank, page, slot, head) to its decode one; dtype (or head geometry)
  mismatch raises `HeteroPlanError`. `HeteroPlan.runs` splits at page boundaries only;
  `descriptor_counts` gives descriptors per rank, per-layer or cross-layer pages.
- :mod:`dcp_jax.hetero.layouts`: the wire format (per stream, per layer, plane-major rows;
  MLA rows byte-compatible with sglang's pack) and the adapters for ``sglang_mla``, ``tpu_mla``,
  ``nhd``, ``hnd``, ``tpu_gqa``: `segments` (byte offsets), `gather_to_wire`,
  `place_from_wire`, `run_descriptors`.
- :mod:`dcp_jax.hetero.mover`: `execute_plan`, the numpy mover that runs a plan over caches
  (the reference for the device path).
- :mod:`dcp_jax.hetero.engine_path`: `stream_descriptors` (direct descriptors, any layout pair)
  and `execute_over_engines` (one notified WRITE batch per stream through `bridge`).
- :mod:`dcp_jax.hetero.cost`: `hetero_counts`, descriptors per decode rank, per-layer and
  cross-layer, for the models of `HETERO_MODELS` (llama-3.1-8b among them).

Example::

    from dcp_jax.hetero import HeteroSide, build_hetero_plan, descriptor_counts
    p = HeteroSide(page_size=16, tp_size=2, layout="nhd", num_kv_heads=8, head_dim=128)
    d = HeteroSide(page_size=64, dcp_size=2, tp_size=4, layout="hnd", num_kv_heads=8, head_dim=128)
    plan = build_hetero_plan(p, d, 0, 256, [range(16)], [range(2), range(2)])
    descriptor_counts(plan, num_layers=32)          # {(dcp_rank, tp_rank): descriptors}
"""
from dcp_jax.hetero.layouts import (GQA_LAYOUTS, LAYOUTS, MLA_LAYOUTS, CacheGeometry, cache_shape,
                                    gather_to_wire, place_from_wire, run_descriptors, segments)
from dcp_jax.hetero.mover import execute_plan
from dcp_jax.hetero.plan import (HeteroPlan, HeteroPlanError, HeteroSide, build_hetero_plan, descriptor_counts,
                                 head_pieces, tp_head_range)

__all__ = ["LAYOUTS", "MLA_LAYOUTS", "GQA_LAYOUTS", "CacheGeometry", "cache_shape", "segments", "gather_to_wire",
           "place_from_wire", "run_descriptors", "execute_plan", "HeteroPlan", "HeteroPlanError", "HeteroSide",
           "build_hetero_plan", "descriptor_counts", "head_pieces", "tp_head_range"]
