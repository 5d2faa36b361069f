#!/usr/bin/env bash
# Probe (GPU): the 32k NIXL region job with its rounds packed in ONE direct windowed launch (kind
# "windows", DCP_JAX_DIRECT_ON=windows) against one direct launch a window (the default),
# alternating on one machine start, each case RUNS times.
#   OUT=... [REQUESTS=6] [CASES="region_mps region"] [RUNS=2] bash benchmarks/gpu/windows_ab.sh
# Each run is a `plain_` case of benchmarks/gpu/cupti_probe.sh (no CUPTI hook): $OUT/windows_{on,off}_CASE_rN.{log,json}.
set -u
cd "$(dirname "$0")/../.."
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/dcp-jax-jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
for r in $(seq 1 "${RUNS:-2}"); do
    for case in ${CASES:-region_mps region}; do
        for kind in on off; do
            if [ $kind = on ]; then export DCP_JAX_DIRECT_ON=windows; else unset DCP_JAX_DIRECT_ON; fi
            TAG="windows_${kind}_${case}_r$r" CASES="plain_$case" REQUESTS=${REQUESTS:-6} \
                bash benchmarks/gpu/cupti_probe.sh | sed "s/^/windows_${kind} r$r /"
        done
    done
done
unset DCP_JAX_DIRECT_ON
