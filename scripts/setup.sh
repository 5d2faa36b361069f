#!/usr/bin/env bash
# Create .venv with Python 3.12 and install dcp-jax with everything the main job and tests need.
# Usage: scripts/setup.sh [--no-torch]
set -euo pipefail
cd "$(dirname "$0")/.."

with_torch=1
[ "${1:-}" = "--no-torch" ] && with_torch=0

find_python312() {
    # pyenv's shim answers only with PYENV_VERSION set; try the versions dir, then the shim, then PATH.
    if command -v pyenv >/dev/null 2>&1; then
        for p in "$(pyenv root)"/versions/3.12.*/bin/python3.12; do
            [ -x "$p" ] && { echo "$p"; return; }
        done
        if PYENV_VERSION=3.12.1 python3.12 --version >/dev/null 2>&1; then
            echo "env PYENV_VERSION=3.12.1 python3.12"; return
        fi
    fi
    command -v python3.12 >/dev/null 2>&1 && { echo python3.12; return; }
    echo "error: Python 3.12 not found (install it or put python3.12 on PATH)" >&2
    exit 1
}

# Mooncake's non-CUDA build links libibverbs.so.1 (Debian package libibverbs1).
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
    if [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1 libnuma1) >/dev/null
    else
        echo "warning: libibverbs1 missing and not root; Mooncake will not import" >&2
    fi
fi

# A fresh .venv takes about 6 GB (torch's CUDA wheels are most of it; the vLLM suite's venv adds
# about 4.5 GB): say so up front rather than fail half-way with "No space left on device".
if [ ! -x .venv/bin/python ]; then
    free_gb=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
    if [ "${free_gb:-0}" -lt 11 ]; then
        echo "warning: ${free_gb} GB free on $(df -P . | awk 'NR==2 {print $6}'); setup and the vLLM suite need about 11 GB" >&2
    fi
fi

PY=$(find_python312)
if [ ! -x .venv/bin/python ]; then
    $PY -m venv .venv
fi
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip >/dev/null
# The engines declare torch/CUDA deps they do not need for host memory: install them alone, and
# keep pip from reporting those deliberately missing deps as conflicts on every later install.
$pip install -q --no-deps --no-warn-conflicts -c constraints.txt nixl-cu12 mooncake-transfer-engine-non-cuda
$pip install -q --no-warn-conflicts -c constraints.txt -e ".[test,plot]"
if [ "$with_torch" = 1 ]; then
    # The GPU machine's torch (2.11) for the PyTorch cross-check tests.
    $pip install -q --no-warn-conflicts -c constraints.txt "torch==2.11.0"
fi
echo "dcp-jax environment ready in .venv ($(.venv/bin/python --version))"
