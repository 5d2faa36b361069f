#!/usr/bin/env bash
# Probe (GPU): cupti_probe.sh's cases under CUDA MPS (the nine job processes share one GPU
# context server, so their kernels and copies may run at once instead of time-slicing), with
# the MPS control log's client count as proof that the processes went through it.
#   OUT=... CASES="region_rr32768_hold plain_fused" bash benchmarks/gpu/mps_cupti.sh
# Writes $OUT/mps.log and $OUT/mps.json (TAG=mps of cupti_probe.sh); stops MPS at the end.
set -u
cd "$(dirname "$0")/../.."
if ! command -v nvidia-cuda-mps-control >/dev/null; then echo "MPS: no nvidia-cuda-mps-control" | tee -a "$OUT/mps.log"; exit 0; fi
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "MPS: the daemon did not start" | tee -a "$OUT/mps.log"; exit 0; }
TAG=mps bash benchmarks/gpu/cupti_probe.sh
{ echo "== MPS control log (clients):"; grep -c -i "new client" "$CUDA_MPS_LOG_DIRECTORY/control.log";
  grep -i -m5 "error\|fail" "$CUDA_MPS_LOG_DIRECTORY"/*.log; tail -3 "$CUDA_MPS_LOG_DIRECTORY/server.log"; } >> "$OUT/mps.log" 2>&1
echo quit | timeout 20 nvidia-cuda-mps-control
exit 0
