#!/usr/bin/env bash
# Probe (GPU): the 32k job on one path with benchmarks/gpu/time_hook timing the methods in $T (a
# comma list of module:Class.method / module:function) in every job process, then their medians.
#   OUT=... T=... [EXTRA="--mps"] bash benchmarks/gpu/time_job.sh NAME PATH [ENGINE] [REQUESTS] [SKIP]
# Writes $OUT/NAME.json and .log; prints the job's summary line and time_summary.py's table
# (each target's first SKIP calls left out). Used by time_region.sh and time_fused.sh.
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
name=$1 path=$2 engine=${3:-nixl} n=${4:-4} skip=${5:-8}
rm -rf "/tmp/$name"
PYTHONPATH="$PWD/benchmarks/gpu/time_hook:$PWD${PYTHONPATH:+:$PYTHONPATH}" DCP_TIME_DIR="/tmp/$name" DCP_TIME_TARGETS="$T" \
    timeout 150 "$PY" -m dcp_jax.cli transfer --device gpu --no-progress --timeout-s 60 --engine "$engine" \
    --path "$path" --prompt-tokens 32768 --requests "$n" ${EXTRA:-} --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
echo "$name rc=$?"
sleep 1  # the processes' time_hook writers
grep -m2 "^$path:" "$OUT/$name.log"
"$PY" benchmarks/gpu/time_summary.py "/tmp/$name" --skip "$skip"
