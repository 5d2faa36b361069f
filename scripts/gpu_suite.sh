#!/usr/bin/env bash
# The GPU suite in one command, on a machine with an NVIDIA GPU (the H200 image: python3 with
# jax[cuda13] 0.11.2, cupy, torch, triton, pytest, hypothesis, typer, rich; no NIXL, no network).
#
#   scripts/gpu_suite.sh            # results under ${OUT:-out/gpu}
#
# Installs NIXL's CUDA build from .whl/ if present (nixl_cu13_site.tgz, a trimmed unpacked wheel, or
# nixl_cu13-*.whl; no network needed), then runs:
# the GPU tests (kernels, DLPack/CuPy in place, the main job on device memory through NIXL), the
# merge benchmark, the PyTorch cross-check, and the main job on the GPU (deepseek-v3, 32,768 tokens,
# DCP1 -> DCP8, both modes). Every step runs under a time limit (about 8 minutes in all); a failing
# step is recorded and the suite goes on. Exit status: 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT="${OUT:-out/gpu}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
PY=${PYTHON:-python3}
SITE=${NIXL_SITE:-/tmp/site}
T0=$(date +%s)

declare -a STEP_NAMES=() STEP_RCS=() STEP_SECS=()
record() {  # name rc seconds
    STEP_NAMES+=("$1"); STEP_RCS+=("$2"); STEP_SECS+=("$3")
}
# step NAME LIMIT_S CMD...: runs CMD with output shown and kept in $OUT/NAME.log. At the limit it
# gets SIGINT (pytest prints what ran so far; the main job stops its processes), SIGKILL 10 s later.
# Limits add up to 480 s (worst case about 9 minutes with the kills), under a 10-minute session.
step() {
    local name=$1 limit=$2; shift 2
    echo; echo "=== [$name] (limit ${limit}s): $*"
    local t=$(date +%s)
    timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local s=$(( $(date +%s) - t ))
    record "$name" "$rc" "$s"
    echo "=== [$name] rc=$rc in ${s}s"
}

# --- NIXL (CUDA 13 build) from a local wheel ------------------------------------------------------
shopt -s nullglob
WHEELS=(.whl/nixl_cu13-*.whl)
SITES=(.whl/nixl_cu13_site.tgz)
shopt -u nullglob
if (( ${#SITES[@]} )); then
    # A trimmed site folder (nixl_cu13 + its libs, no nixl_ep, no headers): fits the device's carry.
    t=$(date +%s)
    mkdir -p "$SITE" && tar xzf "${SITES[0]}" -C "$SITE"
    record nixl_install $? $(( $(date +%s) - t ))
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
elif (( ${#WHEELS[@]} )); then
    t=$(date +%s)
    echo "=== [nixl_install] ${WHEELS[0]} -> $SITE"
    "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" "${WHEELS[0]}" 2>&1 \
        | grep -v -i "warning: running pip as" | tee "$OUT/nixl_install.log"
    record nixl_install "${PIPESTATUS[0]}" $(( $(date +%s) - t ))
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "=== no .whl/nixl_cu13-*.whl: NIXL tests will be skipped unless NIXL is installed"
fi
# The connector's control plane (pyzmq, msgpack) from local wheels when the image lacks them.
for pkg in zmq msgpack; do
    if ! "$PY" -c "import $pkg" 2>/dev/null; then
        shopt -s nullglob
        whl=(.whl/py"$pkg"-*.whl .whl/"$pkg"-*.whl)
        shopt -u nullglob
        (( ${#whl[@]} )) && "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${whl[0]}" 2>&1 \
            | grep -v -i "warning: running pip as"
    fi
done
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false UCX_LOG_LEVEL=fatal
export DCP_GPU_OUT="$OUT"  # tests write their tables here

# --- environment ------------------------------------------------------------------------------------
{
    date -u
    nvidia-smi -L 2>&1 || true
    "$PY" - <<'EOF' 2>&1
import importlib, sys
print("python", sys.version.split()[0])
for m in ("jax", "jaxlib", "cupy", "torch", "triton", "numpy"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:  # noqa: BLE001
        print(m, "unavailable:", type(e).__name__, e)
try:
    import jax
    print("jax devices", jax.devices())
except Exception as e:  # noqa: BLE001
    print("jax devices unavailable:", e)
from bridge.nixl import nixl_agent, nixl_available
print("nixl available", nixl_available(), getattr(nixl_agent, "__module__", None))
EOF
} | tee "$OUT/env.txt"

# --- the suite --------------------------------------------------------------------------------------
step pytest_gpu 280 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider --durations=15
# --no-attention: the attention rows compile for over a minute on the H200 (seen 2026-11-29); DCP
# attention on the GPU is checked by tests/gpu/test_merge_gpu.py above. The merge rows take about 30 s.
step merge_bench 90 "$PY" benchmarks/merge.py --no-attention --json "$OUT/merge_h200.json" --md "$OUT/merge_h200.md"
step crosscheck 30 "$PY" -m dcp_jax.crosscheck
step transfer_gpu 100 "$PY" -m dcp_jax.cli transfer --device gpu --no-progress --timeout-s 90 \
    --json "$OUT/transfer_gpu.json"

# --- summary ----------------------------------------------------------------------------------------
echo
echo "================ GPU suite summary ($(( $(date +%s) - T0 ))s, results in $OUT) ================"
FAILED=0
for i in "${!STEP_NAMES[@]}"; do
    rc=${STEP_RCS[$i]}
    status=ok
    if [ "$rc" != 0 ]; then
        FAILED=1
        status=FAILED
        [ "$rc" = 124 ] || [ "$rc" = 137 ] && status="FAILED (time limit)"
    fi
    printf '%-14s rc=%-4s %5ss  %s\n' "${STEP_NAMES[$i]}" "$rc" "${STEP_SECS[$i]}" "$status"
done
if [ -f "$OUT/pytest_gpu.log" ]; then
    echo "pytest: $(grep -E '(passed|failed|error|skipped)' "$OUT/pytest_gpu.log" | tail -1)"
fi
[ -f "$OUT/transfer_gpu_test_32k.md" ] && { echo; cat "$OUT/transfer_gpu_test_32k.md"; }
if [ -f "$OUT/transfer_gpu.json" ]; then
    echo
    "$PY" - "$OUT/transfer_gpu.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
c = r["config"]
print(f"main job --device {c.get('device')}: {c['model']}, {c['prompt_tokens']:,} tokens, "
      f"DCP{c['prefill_dcp_size']} -> DCP{c['dcp_size']}, engine {c['engine']}, verified={r['verified']}")
for run in r["runs"]:
    print(f"  {run['mode']:7s} descriptors {run['descriptors']:>10,}  engine calls {run['engine_calls']:>4}  "
          f"pack {run['pack_seconds']:.3f} s  transfer {run['transfer_seconds']:.3f} s  "
          f"total {run['total_seconds']:.3f} s  {run['gbps']:.2f} GB/s  verified={run['verified']}")
if "comparison" in r:
    cmp = r["comparison"]
    print(f"  packed vs direct: {cmp['descriptor_ratio']:.1f}x fewer descriptors, "
          f"{cmp['total_seconds_ratio']:.2f}x faster end to end")
EOF
fi
if [ "$FAILED" != 0 ]; then
    echo "GPU suite: FAILED"
    exit 1
fi
echo "GPU suite: all steps passed"
