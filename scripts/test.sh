#!/usr/bin/env bash
# Set up .venv (Python 3.12, pinned jax 0.11.2, NIXL, Mooncake, torch 2.11) and run the whole test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
rc=0
# The suite mostly waits (engine teardowns, peer timeouts, processes in network namespaces), so
# it runs on DCP_JAX_TEST_WORKERS pytest-xdist workers (default 2, the cores CI has), one test file
# per worker at a time (--dist loadfile keeps the module-scoped engine pairs and file order).
# DCP_JAX_TEST_WORKERS=0 runs it in this one process; later "-n N" arguments win.
# The two-host tests (tests/netns) run after the rest, in one process: two workers driving
# namespace harnesses at once failed NIXL's UCX endpoints with "Destination is unreachable"
# (seen twice on 2 cores). With arguments, one run of exactly what they name.
if [ $# -eq 0 ]; then
    .venv/bin/python -m pytest -n "${DCP_JAX_TEST_WORKERS:-2}" --dist loadfile --ignore=tests/netns || rc=$?
    .venv/bin/python -m pytest tests/netns || rc=$?
else
    .venv/bin/python -m pytest -n "${DCP_JAX_TEST_WORKERS:-2}" --dist loadfile "$@" || rc=$?
fi
# The vLLM suite (its own Python 3.11 venv, scripts/vllm_suite.sh): vLLM's own connector lifecycle
# tests against DcpJaxConnector and the stock one, then tests/vllm. It runs with the whole suite
# (no arguments); DCP_JAX_VLLM=0 leaves it out, DCP_JAX_VLLM=1 adds it to a run with arguments.
whole=0; [ $# -eq 0 ] && whole=1
if [ "${DCP_JAX_VLLM:-$whole}" = 1 ]; then
    ./scripts/vllm_suite.sh || rc=$?
fi
exit $rc
