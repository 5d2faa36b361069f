# One device call (diagnostic, issue 13): the 32k region job as the suite runs it (REQUESTS timed
# requests), then again with cProfile around the sender's round pack, its region post and the
# decode rank's unpack in every process (benchmarks/gpu/profile_hook), summed per process by
# pstats_top.py. Results: $OUT/region_profile.log, $OUT/rep_*.json.
ROOT=$PWD
source "$ROOT/scripts/gpu_env.sh" > "$OUT/env.log" 2>&1
PY=${PY:-python3}
run() {  # name, extra env...
    local name=$1; shift
    env "$@" timeout --signal=INT 150 "$PY" -m dcp_jax.cli transfer --device gpu --no-progress --timeout-s 60 \
        --engine nixl --path region --prompt-tokens 32768 --requests "${REQUESTS:-6}" --json "$OUT/rep_$name.json" \
        > "$OUT/job_$name.log" 2>&1
    echo "$name rc=$?"
    grep -E "requests, first byte|warm" "$OUT/job_$name.log" | tail -3
}
run plain
T=dcp_jax.transfer._sender_units:SenderUnits._pack_batch,dcp_jax.transfer._sender_region:SenderRegion._write_region,dcp_jax.transfer._receiver_region:ReceiverRegion._unpack
run profiled PYTHONPATH="$ROOT/benchmarks/gpu/profile_hook:$PYTHONPATH" DCP_PROFILE_DIR=/tmp/prof DCP_PROFILE_TARGET=$T
for t in SenderUnits._pack_batch SenderRegion._write_region ReceiverRegion._unpack; do
    echo "### $t"
    "$PY" "$ROOT/benchmarks/gpu/pstats_top.py" /tmp/prof --target "$t" --skip 4 --top 18
done
