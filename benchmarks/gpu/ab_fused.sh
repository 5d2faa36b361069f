# A/B of the fused path (PATHS=region: that path) on ONE machine start (host speed differs between starts by 10-20%, more
# than most changes): a base tree and the working tree alternate, each run its own
# `dcp-jax transfer --path fused --requests N`.
#   here:    AB_BASE=<commit> bash benchmarks/gpu/ab_fused.sh prepare   # base tree into ab_base/ (untracked)
#   device:  OUT=$OUT ROUNDS=2 REQUESTS=5 bash benchmarks/gpu/ab_fused.sh  # results under $OUT/{base,new}<i>/
# ab_base/ must not be ignored by git (the device tool copies untracked, not ignored, files);
# add it to .git/info/exclude instead.
set -u
if [ "${1:-}" = prepare ]; then
    rm -rf ab_base && mkdir ab_base
    git archive "${AB_BASE:?AB_BASE=<commit>}" dcp_jax pallas_kernels bridge benchmarks/gpu scripts pyproject.toml \
        | tar x -C ab_base
    echo "ab_base/ holds $(git rev-parse --short "$AB_BASE")"
    exit 0
fi
export PYTHONUNBUFFERED=1
ROOT=$PWD
source scripts/gpu_env.sh > "$OUT/env.log" 2>&1
ln -sfn "$ROOT/.whl" ab_base/.whl
for i in $(seq "${ROUNDS:-2}"); do
    for v in base new; do
        d=$OUT/$v$i
        mkdir -p "$d"
        if [ $v = base ]; then dir=ab_base; else dir=.; fi
        (cd $dir && OUT=$d REQUESTS=${REQUESTS:-5} REPS=1 TOKENS=${TOKENS:-32768} PATHS=${PATHS:-fused} \
            timeout 100 bash benchmarks/gpu/fused_reps.sh > "$d/out.txt" 2>&1)
        echo "== $v$i"
        grep -E "whole|rc=" "$d/out.txt" | cut -c1-400
    done
done
