#!/usr/bin/env bash
# Probe (GPU): the 32k job's region and fused paths with the decode processes time-slicing the
# GPU (the default), then under CUDA MPS (the processes' kernels and copies share the GPU at once).
#   OUT=... [CASES="A R"] [N=3] bash benchmarks/gpu/mps_probe.sh
# Prints latency_probe.sh's LATENCY / TIMELINE lines, tagged "plain" then "mps"; MPS is stopped
# at the end. Tells whether the one-GPU job's region path is bound by time slicing between its
# nine processes (on separate GPUs, as deployed, they would not share one).
set -u
cd "$(dirname "$0")/../.."
CASES=${CASES:-"A R"}
N=${N:-3}
echo "== plain"; CASES="$CASES" bash benchmarks/gpu/latency_probe.sh "$N"
if ! command -v nvidia-cuda-mps-control >/dev/null; then echo "MPS: no nvidia-cuda-mps-control"; exit 0; fi
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "MPS: the daemon did not start"; exit 0; }
if timeout 60 python3 -c "import cupy as cp; a = cp.ones(1 << 20); print('MPS client ok', float(a.sum()))"; then
    echo "== mps"; CASES="$CASES" bash benchmarks/gpu/latency_probe.sh "$N" | sed 's/^LATENCY /LATENCY mps:/; s/^TIMELINE /TIMELINE mps:/'
else
    echo "MPS: a client could not start"; tail -5 "$CUDA_MPS_LOG_DIRECTORY"/*.log
fi
echo quit | timeout 20 nvidia-cuda-mps-control
exit 0
