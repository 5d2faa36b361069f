#!/usr/bin/env bash
# Probe (GPU): the device's own timeline of the 32k NIXL job, every process traced by CUPTI
# (benchmarks/gpu/cupti_hook), summarised per request by cupti_summary.py: when the prefill's
# pack kernels, its cuda_ipc copies and each decode rank's unpack actually ran on the GPU, and
# where the GPU sat idle, beside the job's host timeline of the same run.
#   OUT=... [CASES="region region_rr32768 region_rr32768_pull fused"] [REQUESTS=4] bash benchmarks/gpu/cupti_probe.sh
# A case is PATH[_rrN][_pull][_hold][_rK]; "plain_" in front runs it without the hook (its cost,
# same start); "_round" / "_write" pass --region-notify round / write (default: auto); "_hold"
# sets DCP_JAX_REGION_HOLD=1 (trees before region_notify); "_mps" passes --mps (the job's own CUDA
# MPS daemon); "_rK" only names a repeat; "base_" in front
# runs it from another tree's copy of the packages (BASE=ab_base, as region_ab.sh).
# Writes $OUT/${TAG}.log (summaries) and $OUT/${TAG}.json (job JSONs and summaries), TAG=cupti_probe.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
source "$ROOT/scripts/gpu_env.sh" > "$OUT/env.log" 2>&1
PY=${PY:-python3}
TAG=${TAG:-cupti_probe}
LOG="$OUT/$TAG.log"
names=()
for case in ${CASES:-plain_region region region_rr32768 region_rr32768_pull fused}; do
    c=${case#base_}
    where=$ROOT
    [ "$c" != "$case" ] && where="$ROOT/${BASE:-ab_base}"
    c=${c#plain_}
    path=${c%%_*}
    extra=()
    [[ $c =~ _rr([0-9]+) ]] && extra+=(--round-rows "${BASH_REMATCH[1]}")
    [[ $c == *_pull* ]] && extra+=(--direction pull)
    [[ $c == *_round* ]] && extra+=(--region-notify round)
    [[ $c == *_write* ]] && extra+=(--region-notify write)
    [[ $c == *_mps* ]] && extra+=(--mps)
    envs=()
    [[ $c == *_hold* ]] && envs+=(DCP_JAX_REGION_HOLD=1)
    dir="/tmp/cupti_$case"
    rm -rf "$dir"
    hook=(env "${envs[@]}")
    [[ $case != *plain_* ]] && hook+=("PYTHONPATH=$ROOT/benchmarks/gpu/cupti_hook:${PYTHONPATH:-}" "DCP_CUPTI_DIR=$dir")
    t=$(date +%s)
    (cd "$where" && "${hook[@]}" timeout --signal=INT "${RUN_LIMIT_S:-200}" "$PY" -m dcp_jax.cli transfer --device gpu --no-progress \
        --timeout-s 60 --engine nixl --path "$path" --prompt-tokens 32768 --requests "${REQUESTS:-4}" \
        "${extra[@]}" --json "/tmp/job_$case.json" > "/tmp/job_$case.log" 2>&1)
    echo "== $case rc=$? $(( $(date +%s) - t )) s" | tee -a "$LOG"
    grep -m3 -E "^(region|fused):|verified" "/tmp/job_$case.log" | tee -a "$LOG"
    sleep 2
    [[ $case != *plain_* ]] && "$PY" benchmarks/gpu/cupti_summary.py "$dir" --json "/tmp/sum_$case.json" >> "$LOG" 2>&1
    names+=("$case")
done
"$PY" - "$OUT/$TAG.json" "${names[@]}" <<'PY'
import json, os, sys
out, res = sys.argv[1], {}
for case in sys.argv[2:]:
    d = {}
    for key, p in (("job", f"/tmp/job_{case}.json"), ("gpu", f"/tmp/sum_{case}.json")):
        if os.path.exists(p):
            d[key] = json.load(open(p))
    res[case] = d
    for r in d.get("job", {}).get("runs", []):
        gb = r["bytes"] / 1e9
        print(f"{case}: whole {gb / r['request_seconds']:.1f} GB/s transfer {gb / r['transfer_seconds']:.1f} "
              f"verified={r['verified']} each: {[round(gb / q['request_seconds'], 1) for q in r.get('repeats', [])]}")
json.dump(res, open(out, "w"))
PY
