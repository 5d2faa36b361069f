#!/usr/bin/env bash
# Probe (GPU): wall time of the region path's pieces in every process of the 32k NIXL job
# (benchmarks/gpu/time_hook), then their medians (time_summary.py, each target's first 8 calls out).
#   OUT=... [ENGINE=nixl] [N=4] [EXTRA="--mps"] bash benchmarks/gpu/time_region.sh
# The decode side's unpack is split too (RowUnpacker's checks and launch, the Triton plan's launch,
# the wait for the kernel): the host time between a window's "landed" and "unpack_enqueued".
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
S=dcp_jax.transfer._sender_region:SenderRegion
U=dcp_jax.transfer._sender_units:SenderUnits
R=dcp_jax.transfer._receiver_region:ReceiverRegion
API=$("$PY" -c "import bridge.nixl_agent as a; print(a.nixl_agent.__module__)" 2>/dev/null)
T="$S._write_region,$S._on_region_grant,$S._ask_regions,$U._post_packed,dcp_jax.transfer._sender_pack:SenderPack._pack_batch,$U._post_unit"
T="$T,bridge.base:TransferEngine.transfer_batch,bridge.nixl:NixlEngine._post,bridge.nixl:NixlEngine._stash_notifs"
T="$T,$API:nixl_agent.transfer,$API:nixl_agent.initialize_xfer,dcp_jax.transfer.control:ControlServer.send"
T="$T,$R._region_landed,$R._unpack,$R._on_region_ask,dcp_jax.transfer._receiver_region:_synchronize"
P=pallas_kernels.unpacker:RowUnpacker
T="$T,$P._unpack,$P._launch_direct,$P._destinations,pallas_kernels.triton_plans:UnpackPlan.launch"
T="$T,pallas_kernels.triton_launch:launch_into,pallas_kernels.unpacker:check_indices"
T="$T,pallas_kernels.triton_launch:enqueue,pallas_kernels.triton_launch:_SlotRing.claim"
T="$T" bash benchmarks/gpu/time_job.sh time_region region "${ENGINE:-nixl}" "${N:-4}" 8
