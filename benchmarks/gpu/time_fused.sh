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
rm -rf /tmp/time_fused
PYTHONPATH="$PWD/benchmarks/gpu/time_hook:$PWD${PYTHONPATH:+:$PYTHONPATH}" DCP_TIME_DIR=/tmp/time_fused DCP_TIME_TARGETS="$T" \
    timeout 150 "$PY" -m dcp_jax.cli transfer --device gpu --no-progress --timeout-s 60 --engine nixl \
    --path fused --prompt-tokens 32768 --requests "${N:-5}" --json "$OUT/time_fused.json" > "$OUT/time_fused.log" 2>&1
echo "time_fused rc=$?"
sleep 1
grep -m2 "fused:" "$OUT/time_fused.log"
"$PY" benchmarks/gpu/time_summary.py /tmp/time_fused --skip 3
