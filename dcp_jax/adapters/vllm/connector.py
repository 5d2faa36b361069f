"""`DcpJaxConnector`: a vLLM ``KVConnectorBase_V1`` whose both roles are dcp-jax's.

Loaded by ``--kv-transfer-config '{"kv_connector": "DcpJaxConnector", "kv_connector_module_path":
"dcp_jax.adapters.vllm", "kv_role": "kv_producer"}'`` (or ``kv_consumer``, ``kv_both``);
``kv_connector_extra_config`` keys are listed in `dcp_jax.adapters.vllm.config`. The scheduler
role is `DcpJaxScheduler`, the worker role `DcpJaxWorker`; this class routes vLLM's calls.
"""
from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from dcp_jax.adapters.vllm.config import AdapterConfig
from dcp_jax.adapters.vllm.scheduler import DcpJaxMetadata, DcpJaxScheduler
from dcp_jax.adapters.vllm.worker import DcpJaxWorker

__all__ = ["DcpJaxConnector"]

logger = logging.getLogger(__name__)


class DcpJaxConnector(KVConnectorBase_V1, SupportsHMA):
    """P/D KV transfer for vLLM through dcp-jax's `KVSender` / `KVReceiver` (NIXL or Mooncake).

    Args:
        vllm_config: the engine's ``VllmConfig`` (``kv_transfer_config`` set).
        role: ``KVConnectorRole.SCHEDULER`` or ``WORKER``.
        kv_cache_config: the engine's ``KVCacheConfig`` (its attention groups give the geometry).

    Raises:
        ValueError: a bad ``kv_connector_extra_config``; on the worker, a KV cache the adapter
            cannot move (not full attention, or not the CPU backend's layout).
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = AdapterConfig.from_vllm(vllm_config)
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.connector_scheduler: DcpJaxScheduler | None = None
        self.connector_worker: DcpJaxWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = DcpJaxScheduler(vllm_config, kv_cache_config, self.cfg, self.engine_id)
        else:
            self._layer_names = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
            self.connector_worker = DcpJaxWorker(self.cfg, self.cfg.geometry(kv_cache_config), self.engine_id)

    # ---- scheduler side ----------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.connector_scheduler.bind(kv_cache_manager)

    def on_new_request(self, request: Any) -> None:
        self.connector_scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> DcpJaxMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # SupportsHMA: the scheduler side keeps the hybrid allocator's contract (vLLM turns HMA
        # on by default); the worker moves full-attention caches only and refuses others.
        return self.connector_scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # The load moves the request's own blocks of every group, not a hash-addressed prefix.
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.connector_worker.register_kv_caches(kv_caches, self._layer_names)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.connector_worker.start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Whole requests land before the scheduler runs them (asynchronous load): no per-layer wait.
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # The send starts after the forward (`wait_for_save`), once every layer holds its KV.
        return None

    def wait_for_save(self) -> None:
        self.connector_worker.save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self.connector_worker.transfer_results()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self.connector_worker.transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
