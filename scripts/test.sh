#!/usr/bin/env bash
# Set up .venv (Python 3.12, pinned jax 0.11.2, NIXL, Mooncake, torch 2.11) and run the whole test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
rc=0
.venv/bin/python -m pytest "$@" || rc=$?
# The vLLM suite (its own Python 3.11 venv) with the whole suite: no arguments, or DCP_JAX_VLLM=1;
# DCP_JAX_VLLM=0 leaves it out.
if [ "${DCP_JAX_VLLM:-$([ $# = 0 ] && echo 1 || echo 0)}" = 1 ]; then
    ./scripts/vllm_suite.sh || rc=$?
fi
exit $rc
