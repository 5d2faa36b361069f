# One device call (issue 13): the 32k NIXL region job, this tree against another tree's copy of
# the packages (BASE=dir holding dcp_jax/, pallas_kernels/, bridge/, e.g. `git archive <commit>
# dcp_jax pallas_kernels bridge | tar -x -C ab_base`), alternating on one machine start (this tree
# first: its decode ranks warm the unpack, which also fills Triton's cache for the base's), then
# once more with cProfile (benchmarks/gpu/profile_hook) around the round pack, the region post and
# the unpack. Prints each run's median whole / transfer GB/s; $OUT/ab_*.json, $OUT/ab.log.
#   BASE=ab_base REPS=2 REQUESTS=6 [EXTRA=--mps] bash benchmarks/gpu/region_ab.sh   (PROFILE=0: no profiled run)
# ALT_ENV="NAME=value ...": a third arm each rep, this tree with that environment (ab_alt_*.json).
ROOT=$PWD
source "$ROOT/scripts/gpu_env.sh" > "$OUT/env.log" 2>&1
PY=${PY:-python3}
job() {  # arm dir, json name, extra env...
    local dir=$1 name=$2; shift 2
    (cd "$dir" && env "$@" timeout --signal=INT 150 "$PY" -m dcp_jax.cli transfer --device gpu --no-progress \
        --timeout-s 60 --engine nixl --path region --prompt-tokens 32768 --requests "${REQUESTS:-6}" \
        ${EXTRA:-} --json "$OUT/ab_$name.json" >> "$OUT/ab.log" 2>&1)
    echo "$name rc=$?"
}
for r in $(seq "${REPS:-2}"); do
    job "$ROOT" "new_$r"
    [ -n "${BASE:-}" ] && job "$ROOT/$BASE" "base_$r"
    [ -n "${ALT_ENV:-}" ] && job "$ROOT" "alt_$r" $ALT_ENV
done
T=dcp_jax.transfer._sender_pack:SenderPack._pack_batch,dcp_jax.transfer._sender_region:SenderRegion._write_region,dcp_jax.transfer._receiver_region:ReceiverRegion._unpack
[ "${PROFILE:-1}" = 1 ] && job "$ROOT" profiled PYTHONPATH="$ROOT/benchmarks/gpu/profile_hook:$PYTHONPATH" DCP_PROFILE_DIR=/tmp/prof DCP_PROFILE_TARGET=$T
"$PY" "$ROOT/benchmarks/gpu/job_medians.py" "$OUT"/ab_*.json
[ "${PROFILE:-1}" = 1 ] && for t in SenderPack._pack_batch SenderRegion._write_region ReceiverRegion._unpack; do
    echo "### $t"
    "$PY" "$ROOT/benchmarks/gpu/pstats_top.py" /tmp/prof --target "$t" --skip 4 --top 16
done
