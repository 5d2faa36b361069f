#!/usr/bin/env bash
# One device call (issue 13): the 32k NIXL region job in several arms, alternating REPS times on
# one machine start, then each run's median whole / transfer GB/s and its timeline's first/last
# marks (ms). An arm is "NAME|ENV ...|CLI ..." (either part may be empty), e.g.
#   REPS=2 bash benchmarks/gpu/region_arms.sh 'mps||--mps' 'each|DCP_JAX_PACK_TICKET_EACH=1|--mps'
# Writes $OUT/arm_NAME_REP.json and $OUT/arms.log.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY=${PY:-python3}
for r in $(seq "${REPS:-1}"); do
    for arm in "$@"; do
        IFS='|' read -r name envs cli <<< "$arm"
        # shellcheck disable=SC2086 - envs and cli are word lists
        env $envs timeout --signal=INT 150 "$PY" -m dcp_jax.cli transfer --device gpu --no-progress --timeout-s 60 \
            --engine nixl --path region --prompt-tokens 32768 --requests "${REQUESTS:-6}" $cli \
            --json "$OUT/arm_${name}_$r.json" >> "$OUT/arms.log" 2>&1
        echo "$name rep $r rc=$?"
    done
done
"$PY" "$ROOT/benchmarks/gpu/job_medians.py" "$OUT"/arm_*.json
