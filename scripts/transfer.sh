#!/usr/bin/env bash
# Set up .venv (no torch needed) and run the main job: ship one request's KV from a prefill process to
# decode-rank processes through a real engine. Extra arguments go to `dcp-jax transfer`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --no-torch
exec .venv/bin/dcp-jax transfer "$@"
