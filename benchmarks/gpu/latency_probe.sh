#!/usr/bin/env bash
# Probe (GPU): the 32k region path under the polling knobs of benchmarks/gpu/latency_hook.
#   OUT=... [CASES="A B"] bash benchmarks/gpu/latency_probe.sh [requests]
# Each case runs `dcp-jax transfer --device gpu --path region` (and fused where named) with
# the hook's variables set; prints one LATENCY line per case: whole / transfer GB/s of the
# median request, every request's whole GB/s, and the median request's timeline (ms).
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
N=${1:-3}
export PYTHONPATH="$PWD/benchmarks/gpu/latency_hook:$PWD${PYTHONPATH:+:$PYTHONPATH}"
case_run() {  # name engine path env...
    local name=$1 engine=$2 path=$3; shift 3
    env "$@" timeout 120 "$PY" -m dcp_jax.cli transfer --device gpu --no-progress --timeout-s 60 \
        --engine "$engine" --path "$path" --prompt-tokens 32768 --requests "$N" \
        --json "$OUT/lat_$name.json" > "$OUT/lat_$name.log" 2>&1
    echo "rc=$? $name" >> "$OUT/lat_rc.txt"
    "$PY" - "$OUT/lat_$name.json" "$name" <<'PYEOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as exc:
    print("LATENCY", sys.argv[2], "no json", exc); sys.exit(0)
for r in d["runs"]:
    gb = r["bytes"] / 1e9
    print("LATENCY", sys.argv[2], r["mode"], "verified", r["verified"],
          "whole", round(gb / r["request_seconds"], 1), "transfer", round(gb / r["transfer_seconds"], 1),
          "reqs", [round(x["whole_gbps"], 1) for x in r.get("repeats", [])])
    print("TIMELINE", sys.argv[2], r["mode"], json.dumps(r.get("timeline_ms", {})))
PYEOF
}
want() { [ -z "${CASES:-}" ] || [[ " $CASES " == *" ${1%%_*} "* ]]; }  # CASES="A B": those only
for r in $(seq "${ROUNDS:-1}"); do  # ROUNDS=2: the selected cases alternate twice (one machine start)
want A_default && case_run A_default$r nixl region
want B_prog50 && case_run B_prog50$r nixl region DCP_NIXL_PROGRESS_US=50
want C_all100 && case_run C_all100$r nixl region DCP_NIXL_PROGRESS_US=50 DCP_POLLER_MAX_US=100 DCP_WORKER_MAX_US=100
want D_spin && case_run D_spin$r nixl region DCP_NIXL_PROGRESS_US=0 DCP_POLLER_MAX_US=50 DCP_WORKER_MAX_US=50
want E_mc_default && case_run E_mc_default$r mooncake region
want F_mc_all100 && case_run F_mc_all100$r mooncake region DCP_POLLER_MAX_US=100 DCP_WORKER_MAX_US=100
want G_poll100 && case_run G_poll100$r nixl region DCP_POLLER_MAX_US=100 DCP_WORKER_MAX_US=100
want H_inline && case_run H_inline$r nixl region DCP_NIXL_INLINE=1
want Q_queued && case_run Q_queued$r nixl region DCP_NIXL_QUEUED=1
want S_switch100 && case_run S_switch100$r nixl region DCP_SWITCH_US=100
want U_unpack5 && case_run U_unpack5$r nixl region DCP_UNPACK_DELAY_MS=5
want R_fused && case_run R_fused$r nixl fused
want M_mc_region && case_run M_mc_region$r mooncake region
done
exit 0
