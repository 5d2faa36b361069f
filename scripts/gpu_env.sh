# Sourced by scripts/gpu_suite.sh, or by hand for one-off device runs (`source scripts/gpu_env.sh`
# from the repository root): installs what the GPU image lacks from .whl/ (no network) into
# ${NIXL_SITE:-/tmp/site} and exports PYTHONPATH, LD_LIBRARY_PATH and the engines' quiet settings.
#   .whl/nixl_cu13_site.tgz      NIXL's CUDA build, trimmed (no nixl_ep, no headers); or nixl_cu13-*.whl
#   .whl/mooncake_cu13_site.tgz  Mooncake's CUDA build, trimmed (mooncake/engine.so + the libraries it
#                                links); it needs libcudart.so.13, found under nvidia/cu13/lib of the
#                                image's site-packages and put on LD_LIBRARY_PATH
#   .whl/pyzmq-*.whl, .whl/msgpack-*.whl   the connector's control plane, when the image lacks them
# Uses `record NAME RC SECONDS` when the caller defines it (the suite's step table), and $OUT for logs.
ROOT=${ROOT:-$PWD}
PY=${PY:-${PYTHON:-python3}}
SITE=${SITE:-${NIXL_SITE:-/tmp/site}}
OUT=${OUT:-/tmp}
declare -F record >/dev/null || record() { :; }
untar() {  # name tgz: a trimmed site folder into $SITE
    local t=$(date +%s)
    mkdir -p "$SITE" && tar xzf "$2" -C "$SITE"
    record "$1" $? $(( $(date +%s) - t ))
}

# --- NIXL and Mooncake (CUDA 13 builds), pyzmq and msgpack, from .whl/ -----------------------------
shopt -s nullglob
NIXL_WHEELS=(.whl/nixl_cu13-*.whl)
shopt -u nullglob
if [ -f .whl/nixl_cu13_site.tgz ]; then
    untar nixl_install .whl/nixl_cu13_site.tgz  # nixl_cu13 + its libs, no nixl_ep, no headers
elif (( ${#NIXL_WHEELS[@]} )); then
    t=$(date +%s)
    "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" "${NIXL_WHEELS[0]}" 2>&1 \
        | grep -v -i "warning: running pip as" | tee "$OUT/nixl_install.log"
    record nixl_install "${PIPESTATUS[0]}" $(( $(date +%s) - t ))
else
    echo "=== no .whl/nixl_cu13_site.tgz or nixl_cu13-*.whl: NIXL tests will be skipped unless NIXL is installed"
fi
if [ -f .whl/mooncake_cu13_site.tgz ]; then
    untar mooncake_install .whl/mooncake_cu13_site.tgz  # mooncake/engine.so + the libraries it links
else
    echo "=== no .whl/mooncake_cu13_site.tgz: Mooncake GPU tests and jobs will fail or skip"
fi
for pkg in zmq msgpack; do  # the connector's control plane
    if ! "$PY" -c "import $pkg" 2>/dev/null; then
        shopt -s nullglob
        whl=(.whl/py"$pkg"-*.whl .whl/"$pkg"-*.whl)
        shopt -u nullglob
        (( ${#whl[@]} )) && "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${whl[0]}" 2>&1 \
            | grep -v -i "warning: running pip as"
    fi
done
# pytest-xdist for the GPU tests on several workers (GPU_TEST_WORKERS in scripts/gpu_suite.sh).
if ! "$PY" -c "import xdist" 2>/dev/null; then
    shopt -s nullglob
    whl=(.whl/pytest_xdist-*.whl .whl/execnet-*.whl)
    shopt -u nullglob
    (( ${#whl[@]} == 2 )) && "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${whl[@]}" 2>&1 \
        | grep -v -i "warning: running pip as"
fi
# Mooncake's engine.so links libcudart.so.13: the image has it in nvidia/cu13/lib of site-packages.
CUDART_DIR=$("$PY" - <<'EOF' 2>/dev/null
import glob, os, site
for p in site.getsitepackages() + [site.getusersitepackages()]:
    for lib in glob.glob(os.path.join(p, "nvidia", "*", "lib", "libcudart.so.13*")):
        print(os.path.dirname(lib)); raise SystemExit
EOF
)
[ -n "$CUDART_DIR" ] && export LD_LIBRARY_PATH="$CUDART_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false UCX_LOG_LEVEL=fatal MC_LOG_LEVEL=ERROR PYTHONUNBUFFERED=1
# One persistent compile cache for every step and process of the suite: the main job's nine
# processes and the pack benchmark compile the same Pallas kernels; later steps load them.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/dcp_jax_jit_cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
export DCP_GPU_OUT="$OUT"  # tests write their tables here
# The device tool copies the working tree but its git may hold an older HEAD (2026-12-06: the
# landed ee643c6 under a tree of 9f5c712): a tree that differs from HEAD says so.
if [ -z "${GIT_COMMIT:-}" ]; then
    GIT_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
    [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && GIT_COMMIT="$GIT_COMMIT+modified-tree"
fi
export GIT_COMMIT

