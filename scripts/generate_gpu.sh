#!/usr/bin/env bash
# dcp-jax generate on device memory (run on the GPU box from the repository root; not part of CI).
#   scripts/generate_gpu.sh            # DCP = number of GPUs (max 8), the 32k-token prompt
# Prefill on GPU 0 (its pages in CuPy device memory, a KVSender over them), decode rank r on GPU r
# (its KVReceiver over JAX device arrays; the ranks merge through jax.distributed = NCCL), the
# single-process reference on GPU 0. NCCL wants one GPU per rank, so one H200 runs DCP 1 only.
# Writes $OUT/generate_gpu_<N>.json and .log. Exit status: that of dcp-jax generate.
# Status: written and checked on CPU only (the --device gpu path has not run on a GPU yet).
set -u
ROOT=${ROOT:-$PWD}
PY=${PY:-${PYTHON:-python3}}
OUT=${OUT:-/tmp}
source "$ROOT/scripts/gpu_env.sh"
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
(( GPUS >= 1 )) || { echo "no GPU"; exit 2; }
N=$(( GPUS >= 8 ? 8 : GPUS >= 4 ? 4 : GPUS >= 2 ? 2 : 1 ))
PROMPT=${PROMPT_TOKENS:-32768}
timeout 540 "$PY" -m dcp_jax.cli generate --device gpu --dcp-size "$N" --prompt-tokens "$PROMPT" \
    --new-tokens 32 --page-size 64 --engine "${ENGINE:-nixl}" --timeout-s 300 \
    --json "$OUT/generate_gpu_$N.json" 2>&1 | grep -v '^\[Gloo\]' | tee "$OUT/generate_gpu_$N.log"
exit "${PIPESTATUS[0]}"
