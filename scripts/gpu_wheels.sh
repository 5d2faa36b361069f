#!/usr/bin/env bash
# Builds the gitignored .whl/ folder the GPU device needs (it has no network; the device tool
# carries at most 64 MiB): run HERE, on a machine with network, then carry ".whl" to the device
# where scripts/gpu_env.sh unpacks it.
#
#   scripts/gpu_wheels.sh            # -> .whl/nixl_cu13_site.tgz, .whl/mooncake_cu13_site.tgz,
#                                    #    .whl/pyzmq-*.whl, .whl/msgpack-*.whl (cp312, x86_64),
#                                    #    .whl/pytest_xdist-*.whl, .whl/execnet-*.whl (pure Python)
#
# The CUDA 13 engine wheels are too big to carry whole (nixl-cu13 58.8 MB, Mooncake 49.7 MB), so
# they are unpacked and trimmed (../shared/spec/platform.md, "GPU transfer between processes"):
# - NIXL: everything but nixl_ep_cu13 (the expert-parallel kernels), the C headers and scripts;
# - Mooncake: its Python files, engine.so and the libraries engine.so needs (its NEEDED entries,
#   followed through the wheel's own libraries), nothing of the store, EP or the binaries.
# Uses `pip download --no-deps` of the Python that runs it (PYTHON, default .venv/bin/python or
# python3) and readelf. Exit status 0 when every file is there and the total is < 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
NIXL=${NIXL_WHEEL:-nixl-cu13==1.5.1}
MOONCAKE=${MOONCAKE_WHEEL:-mooncake-transfer-engine-cuda13==0.3.14}
LIMIT=$((64 << 20))
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p .whl
rm -f .whl/nixl_cu13_site.tgz .whl/mooncake_cu13_site.tgz .whl/pyzmq-*.whl .whl/msgpack-*.whl \
    .whl/pytest_xdist-*.whl .whl/execnet-*.whl

# The device runs CPython 3.12 on x86_64 glibc >= 2.28: ask for exactly those wheels.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$TMP/dl" "$NIXL" "$MOONCAKE" pyzmq msgpack
cp "$TMP"/dl/pyzmq-*.whl "$TMP"/dl/msgpack-*.whl .whl/
# pytest-xdist and execnet (pure Python): the suite's GPU tests on several workers (GPU_TEST_WORKERS).
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$TMP/dl" pytest-xdist execnet
cp "$TMP"/dl/pytest_xdist-*.whl "$TMP"/dl/execnet-*.whl .whl/

# --- NIXL: drop nixl_ep (27.9 MB compressed) and the headers ---------------------------------------
mkdir -p "$TMP/nixl"
"$PY" -m zipfile -e "$TMP"/dl/nixl_cu13-*.whl "$TMP/nixl"
rm -rf "$TMP"/nixl/nixl_ep_cu13* "$TMP"/nixl/nixl_cu13-*.data "$TMP"/nixl/nixl_cu13.scripts
tar czf .whl/nixl_cu13_site.tgz -C "$TMP/nixl" .

# --- Mooncake: engine.so and its library closure -----------------------------------------------------
mkdir -p "$TMP/mc" "$TMP/mc_keep"
"$PY" -m zipfile -e "$TMP"/dl/mooncake_transfer_engine_cuda13-*.whl "$TMP/mc"
cd "$TMP/mc"
LIBS=$(ls -d mooncake_transfer_engine_cuda13.libs)
keep=(mooncake/engine.so)
todo=(mooncake/engine.so)
while (( ${#todo[@]} )); do  # breadth-first over NEEDED entries the wheel itself ships
    f=${todo[0]}; todo=("${todo[@]:1}")
    for lib in $(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
        for cand in "mooncake/$lib" "$LIBS/$lib"; do
            if [ -f "$cand" ] && [[ " ${keep[*]} " != *" $cand "* ]]; then
                keep+=("$cand"); todo+=("$cand")
            fi
        done
    done
done
find mooncake -name '*.py' -o -name '*.pyi' -o -name py.typed | while read -r f; do keep+=("$f"); echo "$f"; done \
    > "$TMP/py_files"
printf '%s\n' "${keep[@]}" > "$TMP/so_files"
ls -d mooncake_transfer_engine_cuda13-*.dist-info >> "$TMP/so_files"
tar czf "$OLDPWD/.whl/mooncake_cu13_site.tgz" -T "$TMP/so_files" -T "$TMP/py_files"
cd "$OLDPWD"

echo "kept for Mooncake: $(tr '\n' ' ' < "$TMP/so_files")"
ls -l .whl
total=$(du -cb .whl/* | tail -1 | cut -f1)
echo "total $total bytes (limit $LIMIT)"
(( total < LIMIT )) || { echo "error: .whl is over the 64 MiB the device tool carries" >&2; exit 1; }
