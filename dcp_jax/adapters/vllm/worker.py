"""The worker side of `DcpJaxConnector`: vLLM's per-layer CPU tensors under a `KVSender` /
`KVReceiver`, and the scheduler's orders mapped onto the connector's calls.

- `register_kv_caches`: the tensors become layer entries by pointer (`geometry.cache_entries`,
  numpy views, no copy); a producer opens a `KVSender` (listening on ``port + shard``), a
  consumer a `KVReceiver` (its DCP rank and group from vLLM, or ``kv_connector_extra_config``);
  ``kv_both`` opens both, each with its own engine.
- `start_load_kv` (decode): each `RecvJob` is `expect`-ed once its prefill is connected; the
  handshake runs on a background thread (bounded by ``connect_timeout_s``), so a dead prefill
  fails its requests without stalling the engine's steps.
- `wait_for_save` (prefill): each `SendJob` becomes one `KVSender.send` of the whole prompt,
  after the forward that wrote its last KV.
- `transfer_results`: polls every live request; SUCCESS becomes finished (sending or
  recving), FAILED / ABORTED a finished send or a failed receive (logged with the reason).
  Requests are `release`-d once `is_drained` (no engine operation touches their pages).
- `shutdown`: closes both sides within their bounds (5 s each).
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from dcp_jax.adapters.vllm.config import AdapterConfig
from dcp_jax.adapters.vllm.geometry import Geometry, cache_entries
from dcp_jax.adapters.vllm.scheduler import DcpJaxMetadata, RecvJob
from dcp_jax.transfer import KVReceiver, KVSender, TransferStatus

__all__ = ["DcpJaxWorker"]

logger = logging.getLogger(__name__)


def _ranks(cfg: AdapterConfig) -> tuple[int, int]:
    """(tp_rank, dcp_rank) of this worker: the extra config's, else vLLM's process groups."""
    tp, dcp = cfg.tp_rank, cfg.dcp_rank
    if tp is None or dcp is None:
        from vllm.distributed import parallel_state as ps

        if tp is None:
            tp = ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
        if dcp is None:
            dcp = ps.get_dcp_group().rank_in_group if cfg.dcp_size > 1 else 0
    if not 0 <= dcp < cfg.dcp_size or not 0 <= tp < cfg.tp_size:
        raise ValueError(f"dcp_rank={dcp} / tp_rank={tp} outside dcp_size={cfg.dcp_size} / tp_size={cfg.tp_size}")
    return int(tp), int(dcp)


def _request_amx() -> None:
    """Asks Linux for AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) for this process.

    vLLM 0.32's CPU attention picks its AMX kernel for bf16 caches but never requests the
    permission; oneDNN does, lazily, on its first large matmul (a prefill). A decode engine whose
    first forward is a loaded request's one-token step (P/D) has run no such matmul, and the
    attention kernel dies with SIGILL (measured: exit -4 in ``cpu_attention_with_kv_cache``).
    """
    import torch

    cpu = getattr(torch._C, "_cpu", None)
    if cpu is not None and hasattr(cpu, "_init_amx") and torch.cpu._is_amx_tile_supported():
        if not cpu._init_amx():
            logger.warning("dcp-jax: the kernel refused AMX tile state; vLLM's AMX attention may fail")


class DcpJaxWorker:
    """Worker-side state of one vLLM worker (see the module docstring)."""

    def __init__(self, cfg: AdapterConfig, geometry: Geometry, engine_id: str):
        self.cfg, self.geometry, self.engine_id = cfg, geometry, engine_id
        self.tp_rank, self.dcp_rank = _ranks(cfg)
        self.shard = self.tp_rank // cfg.dcp_size  # which KV heads this worker holds
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self._lock = threading.Lock()
        self._links: dict[str, str] = {}          # address -> "connecting" | "ok" | error text
        self._waiting: dict[str, RecvJob] = {}    # jobs whose prefill is not connected yet
        self._recving: dict[str, RecvJob] = {}    # decode request id -> job expected
        self._sending: set[str] = set()
        self._draining: list[tuple[Any, str]] = []  # (side, transfer id) ended, pages maybe in use
        self._failed: dict[str, str] = {}         # decode request id -> reason, to report
        self._threads: list[threading.Thread] = []

    # ---- registration --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any], layer_names: list[str]) -> None:
        _request_amx()
        missing = [n for n in layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"kv_caches lacks layers {missing[:3]} of the KV cache config")
        entries = cache_entries([kv_caches[n] for n in layer_names], self.geometry)
        role = self.cfg.role
        opts = dict(engine=self.cfg.engine, timeout_s=self.cfg.timeout_s)
        if role in ("kv_producer", "kv_both"):
            self.sender = KVSender(self.geometry.spec(0, self.shard), entries, host=self.cfg.host,
                                   port=self.cfg.port + self.shard, mode=self.cfg.mode, **opts)
            logger.info("dcp-jax sender of %s at %s (%d entries of %d B, %s)", self.engine_id,
                        self.sender.address, len(entries), self.geometry.item_len, self.cfg.engine)
        if role in ("kv_consumer", "kv_both"):
            self.receiver = KVReceiver(self.geometry.spec(self.dcp_rank, self.shard), entries,
                                       direction=self.cfg.direction, group=f"{self.engine_id}-{self.shard}", **opts)
            # GPU caches: the unpack's buckets compiled now, before any prefill links (host: none)
            self.receiver.warm_up()

    # ---- decode ----------------------------------------------------------------------------------
    def start_load(self, meta: DcpJaxMetadata) -> None:
        for rid in meta.abort:
            self._abort(rid)
        for job in meta.recv:
            if job.error or self.receiver is None:
                self._fail(job.req_id, job.error or "this engine has no consumer role (kv_role)")
                continue
            addr = job.address_list[self.shard % len(job.address_list)]
            with self._lock:
                state = self._links.get(addr)
                if state is None:
                    self._links[addr] = "connecting"
                    t = threading.Thread(target=self._connect, args=(addr,), daemon=True,
                                         name=f"dcp-jax-connect-{addr}")
                    self._threads.append(t)
                    t.start()
                job.address_list = [addr]
                self._waiting[job.req_id] = job
        self._flush_waiting()

    def _connect(self, addr: str) -> None:
        try:
            self.receiver.connect(addr, timeout_s=self.cfg.connect_timeout_s)
            state = "ok"
        except Exception as e:  # noqa: BLE001 - every cause fails the requests with its text
            state = f"cannot connect to the prefill at {addr}: {type(e).__name__}: {e}"
            logger.error("dcp-jax: %s", state)
        with self._lock:
            self._links[addr] = state

    def _flush_waiting(self) -> None:
        with self._lock:
            ready = [(j, self._links[j.address_list[0]]) for j in self._waiting.values()
                     if self._links[j.address_list[0]] != "connecting"]
            for job, _ in ready:
                del self._waiting[job.req_id]
            for addr in [a for a, s in self._links.items() if s not in ("ok", "connecting")]:
                del self._links[addr]  # a later request retries the handshake
        for job, state in ready:
            if state != "ok":
                self._fail(job.req_id, state)
                continue
            try:
                self.receiver.expect(job.transfer_id, self.geometry.page_table(job.block_ids),
                                     job.num_tokens, job.prefix_tokens)
                self._recving[job.req_id] = job
            except (ValueError, TypeError, RuntimeError) as e:
                self._fail(job.req_id, f"expect refused: {e}")

    def _fail(self, rid: str, reason: str) -> None:
        logger.error("dcp-jax: KV load of request %s failed: %s", rid, reason)
        self._failed[rid] = reason

    def _abort(self, rid: str) -> None:
        self._waiting.pop(rid, None)
        job = self._recving.pop(rid, None)
        if job is not None and self.receiver is not None:
            self.receiver.abort(job.transfer_id, "request aborted by the decode engine")
            self._draining.append((self.receiver, job.transfer_id))
        if rid in self._sending and self.sender is not None:
            self._sending.discard(rid)
            self.sender.abort(rid, "request aborted by the prefill engine")
            self._draining.append((self.sender, rid))

    # ---- prefill ---------------------------------------------------------------------------------
    def save(self, meta: DcpJaxMetadata) -> None:
        for job in meta.send:
            if self.sender is None:
                logger.error("dcp-jax: request %s asks for a send, but this engine has no producer role", job.req_id)
                continue
            n = self.geometry.transfer_tokens(job.num_tokens)
            if n == 0:
                continue
            need = -(-n // self.geometry.block_size)
            self.sender.send(job.req_id, self.geometry.page_table(job.block_ids[:need]), 0, n)
            self._sending.add(job.req_id)

    # ---- completion ------------------------------------------------------------------------------
    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        self._flush_waiting()
        sending, recving, failed = set(), set(), set()
        for rid in list(self._sending):
            st = self.sender.poll(rid)
            if st.terminal:
                if st is not TransferStatus.SUCCESS:
                    logger.warning("dcp-jax: send of %s %s: %s", rid, st.name, self.sender.failure_reason(rid))
                self._sending.discard(rid)
                self._draining.append((self.sender, rid))
                sending.add(rid)
        for rid, job in list(self._recving.items()):
            st = self.receiver.poll(job.transfer_id)
            if st.terminal:
                del self._recving[rid]
                self._draining.append((self.receiver, job.transfer_id))
                recving.add(rid)
                if st is not TransferStatus.SUCCESS:
                    self._fail(rid, f"{st.name}: {self.receiver.failure_reason(job.transfer_id)}")
        for rid in list(self._failed):
            del self._failed[rid]
            recving.add(rid)
            failed.add(rid)
        self._release_drained()
        return sending, recving, failed

    def _release_drained(self) -> None:
        keep = []
        for side, tid in self._draining:
            try:
                if side.is_drained(tid):
                    side.release(tid)
                else:
                    keep.append((side, tid))
            except KeyError:
                pass
        self._draining = keep

    def shutdown(self) -> None:
        for side in (self.receiver, self.sender):
            if side is not None:
                side.close()
        self.receiver = self.sender = None
