#!/usr/bin/env bash
# Set up .venv (Python 3.12, pinned jax 0.11.2, NIXL, Mooncake, torch 2.11) and run the whole test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
