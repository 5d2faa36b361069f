# One device call: the main job's fused path (and the region path once) run several times in a row,
# each run its own `dcp-jax transfer` (one request after the warm-up one), so the spread of the
# whole-request time shows beside its median. Results: $OUT/reps.json (every run's JSON), reps.log.
#   REPS=3 TOKENS=32768 bash benchmarks/gpu/fused_reps.sh
# REQUESTS=N: each run ships N timed requests (`--requests`, median reported, each one listed).
# ROUND_ROWS="default 8192": each value a run of its own (`--round-rows`; "default" leaves it out),
# alternating within each repeat, so an A/B of the round's launch size shares one machine start.
# ENVS="default DCP_JAX_DIRECT_OFF=unpack": likewise, each a run with that one VAR=VALUE set.
# DIRECTIONS="push pull": likewise, each a run with that `--direction` (region and packed paths).
ROOT=$PWD
source "$ROOT/scripts/gpu_env.sh" > "$OUT/env.log" 2>&1
PY=${PY:-python3}
REPS=${REPS:-3}
runs=()
for tokens in ${TOKENS:-32768}; do
    for path in ${PATHS:-fused}; do
        for r in $(seq "$REPS"); do
            for rr in ${ROUND_ROWS:-default}; do
              for ev in ${ENVS:-default}; do
               for dir in ${DIRECTIONS:-push}; do
                tag=$([ "$rr" = default ] && echo "" || echo "_rr$rr")
                extra=$([ "$rr" = default ] && echo "" || echo "--round-rows $rr")
                [ "$dir" = push ] || { tag="${tag}_$dir"; extra="$extra --direction $dir"; }
                envset=()
                if [ "$ev" != default ]; then envset=("$ev"); tag="${tag}_${ev//[^A-Za-z0-9]/_}"; fi
                j="/tmp/rep_${tokens}_${path}${tag}_${r}.json"
                # shellcheck disable=SC2086  # $extra: zero or two words
                env "${envset[@]}" timeout --signal=INT "${RUN_LIMIT_S:-150}" "$PY" -m dcp_jax.cli transfer --device gpu --no-progress \
                    --timeout-s 60 --engine nixl --path "$path" --prompt-tokens "$tokens" --requests "${REQUESTS:-1}" \
                    $extra --json "$j" >> "$OUT/reps.log" 2>&1
                echo "tokens=$tokens path=$path round_rows=$rr env=$ev direction=$dir rep=$r rc=$?" | tee -a "$OUT/reps.log"
                [ -f "$j" ] && runs+=("$j")
               done
              done
            done
        done
    done
done
"$PY" - "$OUT/reps.json" "${runs[@]}" <<'PY'
import json, sys
out, runs = sys.argv[1], {}
for p in sys.argv[2:]:
    runs[p.rsplit("/", 1)[-1]] = json.load(open(p))
json.dump(runs, open(out, "w"), indent=1)
for name, d in runs.items():
    for r in d.get("runs", d) if isinstance(d, dict) else d:
        if not isinstance(r, dict) or "mode" not in r:
            continue
        gb = r["bytes"] / 1e9
        tl = {k: v[:2] for k, v in (r.get("timeline_ms") or {}).items()}
        print(f"{name}: {r['mode']} whole {gb / r['request_seconds']:.1f} GB/s "
              f"({r['request_seconds'] * 1e3:.3f} ms) transfer {gb / r['transfer_seconds']:.1f} GB/s "
              f"launches={r.get('launches')} verified={r['verified']} {tl}")
        for q in r.get("repeats", []):
            print(f"   request: whole {gb / q['request_seconds']:.1f} GB/s ({q['request_seconds'] * 1e3:.3f} ms) "
                  f"launches={q.get('launches')} verified={q['verified']}")
PY
