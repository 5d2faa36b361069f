#!/usr/bin/env bash
# Probe (GPU): wall time of the fused path's host pieces in the 32k NIXL job's prefill process
# (benchmarks/gpu/time_hook), then their medians (time_summary.py, each target's first 8 calls out).
#   OUT=... [N=5] bash benchmarks/gpu/time_fused.sh
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
S=dcp_jax.transfer._sender_region:SenderRegion
F=pallas_kernels.fanout
T="$S._launch_fused,$S._copy_fused,$S._flag_after_launch,$S._finish_fused,pallas_kernels:copy_fanout"
T="$T,$F:_launch,$F:_enqueue_fanout,$F:_fanout_groups,$F:_fanout_slot_jit,pallas_kernels.mapped_ring:stage_indices"
T="$T,bridge.host_flag:SharedFlag.bump_after,dcp_jax.transfer._sender_units:SenderUnits._post_packed"
T="$T,jax._src.pjit:_run_python_pjit,jax._src.pjit:_infer_params,jax._src.pjit:_resolve_and_lower"
T="$T" bash benchmarks/gpu/time_job.sh time_fused fused nixl "${N:-5}" 3
