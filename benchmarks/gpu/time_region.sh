#!/usr/bin/env bash
# Probe (GPU): wall time of the region path's pieces in every process of the 32k NIXL job
# (benchmarks/gpu/time_hook), then their medians (time_summary.py, each target's first 8 calls out).
#   OUT=... [ENGINE=nixl] [N=4] bash benchmarks/gpu/time_region.sh
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
S=dcp_jax.transfer._sender_region:SenderRegion
U=dcp_jax.transfer._sender_units:SenderUnits
R=dcp_jax.transfer._receiver_region:ReceiverRegion
API=$("$PY" -c "import bridge.nixl_agent as a; print(a.nixl_agent.__module__)" 2>/dev/null)
T="$S._write_region,$S._on_region_grant,$S._ask_regions,$U._post_packed,$U._pack_batch,$U._post_unit"
T="$T,bridge.base:TransferEngine.transfer_batch,bridge.nixl:NixlEngine._post,bridge.nixl:NixlEngine._stash_notifs"
T="$T,$API:nixl_agent.transfer,$API:nixl_agent.initialize_xfer,dcp_jax.transfer.control:ControlServer.send"
T="$T,$R._region_landed,$R._unpack,$R._on_region_ask"
rm -rf /tmp/time_region
PYTHONPATH="$PWD/benchmarks/gpu/time_hook:$PWD${PYTHONPATH:+:$PYTHONPATH}" DCP_TIME_DIR=/tmp/time_region DCP_TIME_TARGETS="$T" \
    timeout 150 "$PY" -m dcp_jax.cli transfer --device gpu --no-progress --timeout-s 60 --engine "${ENGINE:-nixl}" \
    --path region --prompt-tokens 32768 --requests "${N:-4}" --json "$OUT/time_region.json" > "$OUT/time_region.log" 2>&1
echo "time_region rc=$?"
sleep 1
"$PY" benchmarks/gpu/time_summary.py /tmp/time_region --skip 8
