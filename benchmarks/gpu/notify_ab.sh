#!/usr/bin/env bash
# Probe (GPU): the 32k region path with the ranks told per write (--region-notify each) against
# once the sender's writes in flight ended (round), alternating on one machine start.
#   OUT=... [ROUNDS=2] [ENGINES="nixl mooncake"] bash benchmarks/gpu/notify_ab.sh [requests]
# Prints one NOTIFY line per run: whole / transfer GB/s of the median request, every request's
# whole GB/s, the policy the senders reported; then the median request's timeline (ms).
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
N=${1:-3}
run_case() {  # name engine policy
    timeout 150 "$PY" -m dcp_jax.cli transfer --device gpu --no-progress --timeout-s 60 --engine "$2" \
        --path region --region-notify "$3" --prompt-tokens 32768 --requests "$N" \
        --json "$OUT/notify_$1.json" > "$OUT/notify_$1.log" 2>&1
    echo "rc=$? $1" >> "$OUT/notify_rc.txt"
    "$PY" - "$OUT/notify_$1.json" "$1" <<'PYEOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as exc:
    print("NOTIFY", sys.argv[2], "no json", exc); sys.exit(0)
for r in d["runs"]:
    gb = r["bytes"] / 1e9
    print("NOTIFY", sys.argv[2], r["mode"], "verified", r["verified"], "policy", r.get("region_notify"),
          "whole", round(gb / r["request_seconds"], 1), "transfer", round(gb / r["transfer_seconds"], 1),
          "reqs", [round(x["whole_gbps"], 1) for x in r.get("repeats", [])])
    print("TIMELINE", sys.argv[2], json.dumps(r.get("timeline_ms", {})))
PYEOF
}
for r in $(seq "${ROUNDS:-2}"); do
    for e in ${ENGINES:-nixl mooncake}; do
        run_case "${e}_each$r" "$e" each
        run_case "${e}_round$r" "$e" round
    done
done
exit 0
