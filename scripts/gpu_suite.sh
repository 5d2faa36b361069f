#!/usr/bin/env bash
# The GPU suite in one command, on a machine with an NVIDIA GPU (the H200 image: python3 with
# jax[cuda13] 0.11.2, cupy, torch, triton, pytest, hypothesis, typer, rich; no NIXL, no Mooncake,
# no pyzmq/msgpack, no network).
#
#   scripts/gpu_suite.sh                       # every step; results under ${OUT:-out/gpu}
#   scripts/gpu_suite.sh d2d_ceiling pack      # only the steps whose names start with these words
#   GIT_COMMIT=<sha> scripts/gpu_suite.sh      # recorded in the summary (else `git rev-parse HEAD`)
#   BUNDLE=1 OUT=$OUT scripts/gpu_suite.sh ...  # on the device tool (8 files back at most): the steps'
#                                              # files in one gpu_suite_steps.tgz beside the summary
#   GPU_TEST_WORKERS=0 scripts/gpu_suite.sh    # the GPU tests in one process (default: 3 pytest-xdist
#                                              # workers sharing the GPU, 101 s on the H200 against
#                                              # 236-251 s in one, 2026-12-04; the image has xdist)
#
# Installs from .whl/ (no network): NIXL's CUDA build (nixl_cu13_site.tgz, a trimmed unpacked
# wheel, or nixl_cu13-*.whl), Mooncake's CUDA build (mooncake_cu13_site.tgz: mooncake/engine.so and
# the libraries it links; it needs libcudart.so.13, found under nvidia/cu13/lib of the image's
# site-packages), pyzmq and msgpack wheels. Then runs, each step under its own time limit:
#   pytest_gpu        the GPU tests (tests/gpu, -m gpu)
#   d2d_ceiling       one process copying the main job's bytes device to device (the ceiling)
#   pack_bench        benchmarks/pack.py, per-rank pack: kernel time and wall time per call
#                     (160 s: with direct launches each shape also compiles through Triton, ~3-7 s;
#                     it ran past 100 s at b0b33c6 after writing every row)
#   job_32k_nixl      dcp-jax transfer --device gpu, 32,768 tokens, NIXL: paths packed, region, fused
#   job_32k_nixl_mps  the region path of job_32k_nixl with --mps (the job's own CUDA MPS daemon)
#   job_32k_mooncake  the same through Mooncake nvlink_intra: paths packed, region
#   job_128k_nixl / job_128k_mooncake   the same at --prompt-tokens 131072
#   pack_backends     benchmarks/pack_backends.py --part backends: xla, gpu-triton, gpu-mosaic on one
#                     DeepSeek-V3 rank pack, each checked byte for byte; s per call and GB/s
#   job_32k_nixl_staged  dcp-jax transfer --staging host --path region, 32,768 tokens, NIXL: the staged
#                     path's GB/s, beside job_32k_nixl's region run (direct) in the summary
#   pack_host_cost    benchmarks/pack_host_cost.py: host us per call, per-window packs vs one
#                     pack_windows, per-layer vs one-buffer unpack
#   generate_gpu      scripts/generate_gpu.sh: dcp-jax generate on device memory (DCP 1 on one GPU)
#   multi_gpu_rehearsal  scripts/multi_gpu.sh on this one GPU
# A failing step (an unknown --path too) is recorded as failed and the suite goes on. The limits
# add up to 1,535 s (the GPU tests alone took 236 s on 2026-12-04, and JAX's exit clean-up a few more: a
# 240 s limit cut the step at exit after all 138 passed): more than one 10-minute device call, so
# split the steps over calls whose limits fit one each. A name selects every step it begins
# (job_32k_nixl also selects job_32k_nixl_mps and job_32k_nixl_staged), e.g. `pytest_gpu d2d`,
# then `pack_bench job_32k`, then the rest in two calls. Exit status 0 only if every step passed.
# The summary ($OUT/gpu_suite_summary.md and .json: date, device, versions, commit, steps, figures)
# can be copied to benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT="${OUT:-out/gpu}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
PY=${PYTHON:-python3}
SITE=${NIXL_SITE:-/tmp/site}
T0=$(date +%s)
ONLY=("$@")
: > "$OUT/steps.tsv"
rm -f "$OUT"/job_*.json "$OUT"/d2d_ceiling.json "$OUT"/pack.json "$OUT"/pack_backends.json  # a failed step must not show old figures

record() {  # name rc seconds
    printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$OUT/steps.tsv"
}
wanted() {  # step name -> 0 when selected by the command line (all when none given)
    (( ${#ONLY[@]} == 0 )) && return 0
    local w
    for w in "${ONLY[@]}"; do [[ "$1" == "$w"* ]] && return 0; done
    return 1
}
# step NAME LIMIT_S CMD...: runs CMD with output shown and kept in $OUT/NAME.log. At the limit it
# gets SIGINT (pytest prints what ran so far; the main job stops its processes), SIGKILL 10 s later.
step() {
    local name=$1 limit=$2; shift 2
    wanted "$name" || return 0
    echo; echo "=== [$name] (limit ${limit}s): $*"
    local t=$(date +%s)
    timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local s=$(( $(date +%s) - t ))
    record "$name" "$rc" "$s"
    echo "=== [$name] rc=$rc in ${s}s"
}

source "$ROOT/scripts/gpu_env.sh"

# --- environment ------------------------------------------------------------------------------------
{
    date -u
    nvidia-smi -L 2>&1 || true
    echo "commit $GIT_COMMIT"
    echo "libcudart.so.13 dir: ${CUDART_DIR:-not found}"
    "$PY" "$ROOT/scripts/gpu_suite_summary.py" --versions 2>&1
} | tee "$OUT/env.txt"

# --- the suite --------------------------------------------------------------------------------------
# The 32k DCP8 job test is the job_32k_* steps' own run: deselected here to keep the limits.
# -v names each test as it runs and faulthandler dumps every thread of a test past 40 s: a hang
# is named in the log even when the step's limit kills pytest.
# GPU_TEST_WORKERS=N (N > 0, pytest-xdist from .whl/): N worker processes share the GPU, one test
# file each at a time (XLA_PYTHON_CLIENT_PREALLOCATE=false keeps each to what it uses).
XDIST=()
if (( ${GPU_TEST_WORKERS:-3} > 0 )); then
    if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n "${GPU_TEST_WORKERS:-3}" --dist loadfile)
    else echo "=== no pytest-xdist: the GPU tests run in one process"; fi
fi
step pytest_gpu ${PYTEST_LIMIT_S:-320} "$PY" -m pytest -v -m gpu ${PYTEST_TARGETS:-tests/gpu} -p no:cacheprovider \
    ${XDIST[@]+"${XDIST[@]}"} \
    --durations=15 -o faulthandler_timeout=40 \
    --deselect tests/gpu/test_transfer_job_gpu.py::test_deepseek_32k_dcp8_on_device_memory
step d2d_ceiling 25 "$PY" benchmarks/d2d_ceiling.py --prompt-tokens 32768 --prompt-tokens 131072 \
    --json "$OUT/d2d_ceiling.json" --md "$OUT/d2d_ceiling.md"
step pack_bench ${PACK_LIMIT_S:-160} "$PY" benchmarks/pack.py --no-sweep --only deepseek-v3/rank-4096 --rounds 3 \
    --json "$OUT/pack.json" --md "$OUT/pack.md"
# JOB_REQUESTS=N: each job step times N requests per path (`--requests`; the table shows their
# median), its limit raised by 20 s per extra request.
JOB_REQUESTS=${JOB_REQUESTS:-1}
# The job steps share JAX's persistent compilation cache: each path's senders compile the same
# pack buckets again otherwise (131,072 tokens, H100, 2026-12-06: twelve buckets 79.7 s cold,
# 9.2 s from the cache). JAX_CACHE= (empty) turns it off.
JAX_CACHE=${JAX_CACHE-/tmp/dcp-jax-jax-cache}
job() {  # name limit engine paths tokens [more options of dcp-jax transfer]
    step "$1" $(( $2 + 20 * (JOB_REQUESTS - 1) )) env ${JAX_CACHE:+JAX_COMPILATION_CACHE_DIR=$JAX_CACHE} \
        ${JAX_CACHE:+JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0} \
        "$PY" -m dcp_jax.cli transfer --device gpu --no-progress \
        --timeout-s 60 --engine "$3" --path "$4" --prompt-tokens "$5" --requests "$JOB_REQUESTS" --json "$OUT/$1.json" \
        "${@:6}"
}
# Limits include each sender's kernel warm-up (every index bucket up to one window's, per path:
# ~0.5 s a bucket at 32,768 tokens on an H100, but 59.2 s for ten buckets at 131,072 at dc6c770,
# from the cache 9.2 s for twelve). The job waits up to 600 s for it, whatever --timeout-s says.
job job_32k_nixl 70 nixl packed,region,fused 32768
# The region path under the job's own CUDA MPS daemon (--mps): the eight decode ranks' unpacks share
# one server context instead of time-slicing the GPU (+15-19 % whole on an H100, 2026-12-07).
job job_32k_nixl_mps 40 nixl region 32768 --mps
job job_32k_mooncake 60 mooncake packed,region 32768
job job_128k_nixl 240 nixl packed,region,fused 131072
job job_128k_mooncake 200 mooncake packed,region 131072
# Issue 14: the pack backends side by side (JSON rewritten per backend: a step stopped at its limit
# keeps what it measured; exit 1 when one failed or differed), and the staged path beside the direct one.
step pack_backends ${PACK_BACKENDS_LIMIT_S:-40} "$PY" benchmarks/pack_backends.py --device gpu --part backends --backends xla,gpu-triton,gpu-mosaic \
    --rows 4096 --pool-rows 8192 --repeats 5 --json "$OUT/pack_backends.json" --md "$OUT/pack_backends.md"
step job_32k_nixl_staged 40 "$PY" -m dcp_jax.cli transfer --device gpu --no-progress --timeout-s 30 --engine nixl \
    --staging host --path region --prompt-tokens 32768 --json "$OUT/job_32k_nixl_staged.json"
# Issue 13: host microseconds per call of the pieces of a sender round and a receiver unpack (pack_rows
# per window vs one pack_windows; separate layers vs one buffer), and issue 16's generation on device
# memory (DCP 1 on one GPU: NCCL wants a GPU per rank).
step pack_host_cost ${HOST_COST_LIMIT_S:-130} "$PY" benchmarks/pack_host_cost.py --json "$OUT/pack_host_cost.json"
step generate_gpu 150 env OUT="$OUT" PY="$PY" PROMPT_TOKENS=${GENERATE_TOKENS:-32768} "$ROOT/scripts/generate_gpu.sh"
# multi_gpu_rehearsal: issue 18's scripts/multi_gpu.sh on this one GPU (placement options, peer copy, NIXL at 8,192
# tokens, merge mesh; $OUT/multi_gpu/). +60 s: where the suite must fit one 10-minute call, run it on its own.
step multi_gpu_rehearsal 60 env OUT="$OUT/multi_gpu" PROMPT_TOKENS=8192 ENGINES=nixl BUDGET_S=57 MERGE_KV_LEN=2048 \
    MERGE_ITERS=5 MERGE_REPS=3 "$ROOT/scripts/multi_gpu.sh"

# --- summary ----------------------------------------------------------------------------------------
echo
echo "================ GPU suite ($(( $(date +%s) - T0 ))s, results in $OUT) ================"
"$PY" "$ROOT/scripts/gpu_suite_summary.py" --out "$OUT"
rc=$?
# BUNDLE=1 (a device call brings back at most 8 files): every step's own files go into ONE
# gpu_suite_steps.tgz beside the summary (gpu_suite_summary.md/.json stay as they are).
if [ "${BUNDLE:-0}" = 1 ]; then
    (cd "$OUT" && find . -type f ! -name 'gpu_suite_summary.*' ! -name gpu_suite_steps.tgz -print0 \
        | tar czf gpu_suite_steps.tgz --null -T - --remove-files)
    find "$OUT" -mindepth 1 -type d -empty -delete
fi
exit $rc
