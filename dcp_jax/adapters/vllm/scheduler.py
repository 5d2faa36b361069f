"""The scheduler side of `DcpJaxConnector`: vLLM's P/D contract, as its NixlConnector keeps it.

- Decode (a request with ``do_remote_prefill``): `get_num_new_matched_tokens` answers
  ``(prompt tokens - computed, True)``: an asynchronous load; `update_state_after_alloc`
  records the blocks it lands in and hands the worker a `RecvJob` (the prefill's ``dcp_jax``
  entry checked here: a peer of another version or geometry becomes a job that fails at once,
  so the request ends with the reason, never with wrong tokens).
- Prefill (``do_remote_decode``): in the step whose forward completes the prompt, a `SendJob`
  tells the worker to `KVSender.send` the request's blocks right after that forward (an offline
  ``LLM.generate`` takes no further step); `request_finished` returns ``(True, params)`` with
  NixlConnector's fields plus ``dcp_jax`` (versions, geometry, sender addresses, token count),
  and the blocks stay held until the worker reports the send finished.
- Like NixlConnector, the prefill leaves the last ``backoff`` prompt tokens to the decode when
  the model has Mamba layers (the decode needs h(N-1)); the transfer itself moves full-attention
  caches only (the worker refuses others at registration).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from dcp_jax.adapters.vllm.config import AdapterConfig
from dcp_jax.adapters.vllm.geometry import ADAPTER_VERSION, Geometry, PeerMismatch, check_peer
from dcp_jax.transfer import PROTOCOL_VERSION

__all__ = ["DcpJaxMetadata", "RecvJob", "SendJob", "DcpJaxScheduler"]

logger = logging.getLogger(__name__)

_REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclasses.dataclass
class RecvJob:
    """Decode: load the prefill's request ``transfer_id`` into ``block_ids`` (this request's
    whole block table, local prefix included); ``error`` set: fail it at once with that reason."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    prefix_tokens: int
    address_list: list[str]
    error: str = ""


@dataclasses.dataclass
class SendJob:
    """Prefill: send tokens ``[0, num_tokens)`` of ``req_id`` held in ``block_ids``."""

    req_id: str
    block_ids: list[int]
    num_tokens: int


@dataclasses.dataclass
class DcpJaxMetadata(KVConnectorMetadata):
    """One step's orders from the scheduler to the workers (plain data, picklable)."""

    recv: list[RecvJob] = dataclasses.field(default_factory=list)
    send: list[SendJob] = dataclasses.field(default_factory=list)
    abort: list[str] = dataclasses.field(default_factory=list)  # request ids (either side)


class DcpJaxScheduler:
    """Scheduler-side state of one engine (see the module docstring)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: AdapterConfig, engine_id: str):
        self.cfg, self.engine_id = cfg, engine_id
        self.block_size = int(vllm_config.cache_config.block_size)
        self.geometry: Geometry | None
        self.unsupported = ""
        try:
            self.geometry = cfg.geometry(kv_cache_config)
        except ValueError as e:  # scheduling still works; a transfer of this cache is refused
            self.geometry, self.unsupported = None, str(e)
        self._has_mamba = bool(getattr(kv_cache_config, "has_mamba_layers", False))
        self._lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
        self._kv_cache_manager = None
        self._producing: dict[str, Any] = {}   # prefill requests whose prompt is not complete
        self._sent: dict[str, int] = {}        # prefill request id -> tokens sent
        self._recv: dict[str, RecvJob] = {}    # decode loads not handed to the worker yet
        self._receiving: set[str] = set()      # decode loads the worker holds
        self._abort: list[str] = []

    def bind(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager

    # ---- decode ------------------------------------------------------------------------------
    def backoff(self) -> int:
        """Trailing prompt tokens the decode recomputes (1 with Mamba layers, the drafter's
        lookahead window for multi-token prediction), as in NixlConnector."""
        return max(1 if self._has_mamba else 0, self._lookahead - 1)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):
            n = len(request.prompt_token_ids or [])
            b = self.backoff()
            count = (n - b if b and n > b else n) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        rid = request.request_id
        if params.get("do_remote_decode"):
            self._producing[rid] = request
            return
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens <= 0 or not params.get("remote_block_ids") \
                or not all(k in params for k in _REMOTE_FIELDS):
            return
        ids = self._block_ids(rid, blocks)
        prefix = sum(b.block_hash is not None and not b.is_null for b in blocks.blocks[0]) * self.block_size
        job = RecvJob(rid, str(params["remote_request_id"]), ids, 0, prefix, [])
        try:
            if self.geometry is None:
                raise PeerMismatch("cache", "a full-attention cache", None, self.unsupported)
            info = check_peer(self.geometry, params.get("dcp_jax"))
            job.num_tokens, job.address_list = int(info["num_tokens"]), list(info["addresses"])
            job.prefix_tokens = min(prefix, job.num_tokens)
        except PeerMismatch as e:
            job.error = str(e)
        self._recv[rid] = job

    def _block_ids(self, rid: str, blocks: Any) -> list[int]:
        if self._kv_cache_manager is not None:
            return list(self._kv_cache_manager.get_block_ids(rid)[0])
        return list(blocks.get_block_ids()[0])

    # ---- both --------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> DcpJaxMetadata:
        meta = DcpJaxMetadata(recv=list(self._recv.values()), abort=self._abort)
        self._receiving.update(self._recv)
        self._recv, self._abort = {}, []
        scheduled = scheduler_output.num_scheduled_tokens
        for rid, req in list(self._producing.items()):
            n = scheduled.get(rid, 0)
            if n and req.num_computed_tokens + n >= req.num_prompt_tokens:
                del self._producing[rid]  # its prompt's KV is complete after this step's forward
                meta.send.append(self._send_job(req))
        return meta

    def _send_job(self, req: Any) -> SendJob:
        n = int(req.num_prompt_tokens)
        ids = self._block_ids(req.request_id, None) if self._kv_cache_manager is not None else []
        self._sent[req.request_id] = n
        return SendJob(req.request_id, ids, n)

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._receiving.discard(rid)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        rid = request.request_id
        self._producing.pop(rid, None)
        if rid in self._recv:  # finished before the worker got the load: nothing to cancel there
            del self._recv[rid]
        if rid in self._receiving:
            self._receiving.discard(rid)
            self._abort.append(rid)
        if not params or not params.get("do_remote_decode"):
            if params and params.get("do_remote_prefill"):
                params["do_remote_prefill"] = False  # never scheduled; the prefill's sender times out
            return False, None
        sent = self._sent.pop(rid, None)
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            if sent is not None:
                self._abort.append(rid)
            return False, None
        delay = any(len(g) > 0 for g in block_ids)
        info: dict[str, Any] = dict(adapter_version=ADAPTER_VERSION, protocol_version=PROTOCOL_VERSION,
                                    geometry=None if self.geometry is None else self.geometry.to_dict(),
                                    unsupported=self.unsupported, addresses=self.cfg.addresses(),
                                    num_tokens=0)
        if delay and self.geometry is not None:
            n = sent if sent is not None else int(request.num_computed_tokens)
            info["num_tokens"] = self.geometry.transfer_tokens(n)
        return delay, dict(
            do_remote_prefill=True, do_remote_decode=False, remote_block_ids=block_ids,
            remote_engine_id=self.engine_id, remote_request_id=rid, remote_host=self.cfg.host,
            remote_port=self.cfg.port, tp_size=self.cfg.tp_size, dcp_size=self.cfg.dcp_size,
            pp_size=1, remote_num_tokens=int(request.num_computed_tokens) if delay else 0,
            remote_blocks_expiry_time=None, transfer_mode=self.cfg.direction, dcp_jax=info)

    def on_new_request(self, request: Any) -> None:
        """Prefill: leave the trailing `backoff` prompt tokens to the decode (once per request)."""
        params = request.kv_transfer_params
        b = self.backoff()
        if not b or params is None or not params.get("do_remote_decode") or params.get("_p_side_truncated") \
                or request.num_prompt_tokens <= b or request.prompt_token_ids is None:
            return
        del request.prompt_token_ids[-b:]
        del request._all_token_ids[-b:]
        request.num_prompt_tokens -= b
        request.max_tokens = 1
        params["_p_side_truncated"] = True
