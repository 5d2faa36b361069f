#!/usr/bin/env bash
# Issue 18: the main job and the DCP decode merge over the G GPUs of one host, in one command.
#
#   scripts/multi_gpu.sh                               # G = the GPUs CUDA shows; results in ${OUT:-out/multi_gpu}
#   PROMPT_TOKENS=8192 ENGINES=nixl BUDGET_S=57 MERGE_KV_LEN=2048 scripts/multi_gpu.sh  # the rehearsal (gpu_suite.sh)
# Other knobs: DCP_SIZE (8), MERGE_ITERS / MERGE_REPS (10 / 5), PYTHON (python3).
#
# Placement: prefill rank on GPU 0; the DCP_SIZE (8) decode ranks round-robin over GPUs 1..G-1, or
# over 0..G-1 when G >= DCP_SIZE; with G = 1 every process is on GPU 0 (the rehearsal). Steps, each
# under its own time limit (and under what is left of BUDGET_S), each recorded even when it fails:
#   peer      benchmarks/d2d_ceiling.py --peer 0,<decode GPUs>: cudaMemcpyPeerAsync of the request's
#             bytes GPU 0 -> first decode GPU, and split over all of them at once (the NVLink peak)
#   job_<engine>  dcp-jax transfer --device gpu --prefill-gpus 0 --decode-gpus ...: every path the
#             engine has (NIXL: packed, region, fused; Mooncake: packed, region), every rank byte-exact;
#             fused only where GPU 0 has peer access to every decode GPU (else left out, and said so)
#   merge     benchmarks/multi_gpu_merge.py: ag_rs, ag_ar, a2a over a mesh of the GPUs (NCCL) vs the
#             single-device float64 reference, time per decode step; plus DCP_SIZE ranks emulated on GPU 0
# Then scripts/multi_gpu_summary.py writes $OUT/multi_gpu.json and .md (date, machine, versions,
# placement, GB/s per path beside the peer ceiling, merge table). Exit status 0 only if every step
# passed, every run was byte-exact and every merge equal. No GPU: exit 2 at once.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT="${OUT:-out/multi_gpu}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
PY=${PYTHON:-${PY:-python3}}
TOKENS=${PROMPT_TOKENS:-32768}
DCP=${DCP_SIZE:-8}
ENGINES=${ENGINES:-nixl mooncake}
BUDGET_S=${BUDGET_S:-900}
T0=$(date +%s)
rm -f "$OUT"/mg_*.json "$OUT"/multi_gpu.json "$OUT"/multi_gpu.md  # a failed step must not show old figures
: > "$OUT/mg_steps.tsv"

# gpu_suite.sh has set up the environment already (it exports DCP_GPU_OUT); alone, do it here.
if [ -z "${DCP_GPU_OUT:-}" ]; then
    record() { :; }
    source "$ROOT/scripts/gpu_env.sh"
fi

# mg_step NAME LIMIT_S CMD...: CMD under min(LIMIT_S, budget left - 5 s for the summary); SIGINT at the
# limit, SIGKILL 10 s later; output shown and kept in $OUT/mg_NAME.log.
mg_step() {
    local name=$1 limit=$2; shift 2
    local left=$(( BUDGET_S - ($(date +%s) - T0) - 5 ))
    (( left < limit )) && limit=$left
    local t=$(date +%s) rc
    if (( limit < 1 )); then
        echo "=== [multi_gpu/$name] not run: the ${BUDGET_S}s budget is spent" | tee "$OUT/mg_$name.log"
        rc=124
    else
        echo "=== [multi_gpu/$name] (limit ${limit}s): $*"
        timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/mg_$name.log"
        rc=${PIPESTATUS[0]}
    fi
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t ))" >> "$OUT/mg_steps.tsv"
    echo "=== [multi_gpu/$name] rc=$rc"
}

# --- the GPUs and the placement ---------------------------------------------------------------------
nvidia-smi -L > "$OUT/mg_gpus.txt" 2>&1
nvidia-smi topo -m > "$OUT/mg_topo.txt" 2>&1
# One Python call: the GPU count CUDA shows, the placement rule (dcp_jax.job.gpus.host_placement), the
# GPUs the decode ranks land on (round-robin) and GPU 0's peer access to each -> mg_placement.json.
read -r G DECODE PEER_DST FUSED < <(timeout 120 "$PY" - "$DCP" "$OUT/mg_placement.json" 2>"$OUT/mg_placement.err" <<'EOF'
import json, sys
import cupy as cp
from dcp_jax.job.gpus import host_placement, parse_gpu_list, place
count, dcp = cp.cuda.runtime.getDeviceCount(), int(sys.argv[1])
prefill, decode = host_placement(count, dcp)
used = sorted(set(place(dcp, parse_gpu_list(decode, "--decode-gpus"))))
peer = {d: d == 0 or bool(cp.cuda.runtime.deviceCanAccessPeer(0, d)) for d in used}
fused = all(peer.values())
with open(sys.argv[2], "w") as f:
    json.dump({"gpus": count, "dcp_size": dcp, "prefill_gpus": prefill, "decode_gpus": decode, "decode_gpus_used": used,
               "peer_access_from_0": {str(k): v for k, v in peer.items()}, "fused_allowed": fused}, f, indent=1)
print(count, decode, ",".join(map(str, used)), int(fused))
EOF
)
if ! [[ "${G:-}" =~ ^[0-9]+$ ]] || (( G < 1 )); then
    echo "multi_gpu.sh: no CUDA GPU here, or the placement check failed:" >&2
    tail -3 "$OUT/mg_placement.err" >&2
    exit 2
fi
echo "=== multi_gpu: $G GPU(s); prefill on GPU 0, $DCP decode ranks on GPU(s) $DECODE; fused allowed: $FUSED"

# --- the steps --------------------------------------------------------------------------------------
mg_step peer 60 "$PY" benchmarks/d2d_ceiling.py --prompt-tokens "$TOKENS" --peer "0,$PEER_DST" --repeats 3 \
    --json "$OUT/mg_peer.json"
for engine in $ENGINES; do
    case $engine in
        nixl) paths=packed,region; (( FUSED )) && paths+=,fused ;;
        mooncake) paths=packed,region ;;
        *) echo "multi_gpu.sh: unknown engine '$engine' in ENGINES (nixl, mooncake)" >&2; exit 2 ;;
    esac
    mg_step "job_$engine" 240 "$PY" -m dcp_jax.cli transfer --device gpu --no-progress --timeout-s 60 \
        --engine "$engine" --path "$paths" --prompt-tokens "$TOKENS" --dcp-size "$DCP" \
        --prefill-gpus 0 --decode-gpus "$DECODE" --json "$OUT/mg_job_$engine.json"
done
mg_step merge 180 "$PY" benchmarks/multi_gpu_merge.py --kv-len "${MERGE_KV_LEN:-$TOKENS}" --batch 4 --emulate "$DCP" \
    --iters "${MERGE_ITERS:-10}" --reps "${MERGE_REPS:-5}" --json "$OUT/mg_merge.json"

# --- the results file -------------------------------------------------------------------------------
"$PY" "$ROOT/scripts/multi_gpu_summary.py" --out "$OUT" --tokens "$TOKENS"
