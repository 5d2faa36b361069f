"""What a `KVReceiver` reports: its counters (`stats`), its senders (`peers`) and each
request's figures (`request_stats`, `request_latency`).

A mixin of `dcp_jax.transfer.KVReceiver` over the state ``KVReceiver.__init__`` creates; every
method is public and takes the receiver's lock (the worker changes that state meanwhile).
"""
from __future__ import annotations

import time
from typing import Any

from dcp_jax.transfer.views import reported_path

__all__ = ["ReceiverStats"]


class ReceiverStats:
    """`stats`, `peers`, `request_stats`, `request_latency`."""

    @property
    def stats(self) -> dict[str, Any]:
        """Counters: requests by outcome, bytes landed, reads, dropped/rejected/inconsistent
        messages, connections, the receive region, and ``kernel_compiles``
        (`pallas_kernels.compile_count`, process-wide, as the sender's: unchanged across
        windows once `warm_up` compiled what they launch)."""
        from pallas_kernels import compile_count

        with self._lock:
            out = dict(self._counts)
            out.update(rejected_messages=sum(link.client.rejected for link in self._links),
                       live_requests=len(self._requests), inflight_reads=len(self._reads),
                       connections=len(self._links), worker_errors=self._worker.errors,
                       region=dict(self._region.arena.stats), region_grants=len(self._grants) + len(self._read_grants),
                       region_waiting=len(self._waiting), kernel_compiles=compile_count())
        return out

    @property
    def peers(self) -> list[dict[str, Any]]:
        """The connected prefill senders, one dict each, in connection order: ``address`` (what
        `connect` was given), ``name`` (the sender's engine name), its prefill ``dcp_rank`` and
        ``tp_rank``, ``path`` (what it chose at the handshake: "direct", "packed", "region" or
        "fused"; "none" for a TP pair that shares no KV head: nothing moves), ``direction`` ("push" / "pull"), ``staged`` (its KV is not registered) and
        ``silent_s`` (seconds since its last message). Empty once closed."""
        with self._lock:
            return self._link_list()

    def request_stats(self, request_id: str) -> dict[str, Any]:
        """Per-request figures on this rank (plain values, for JSON): ``status``
        (`TransferStatus.value`, the lowercase string; `poll` and `wait` give the enum), ``reason``, ``bytes`` landed,
        ``senders`` (one dict per sender it was announced to, in connection order: ``address``,
        prefill ``dcp_rank`` and ``tp_rank``, ``path`` as `peers` says it, ``staging``:
        ``{"prefill": "direct"|"staged", "decode": ...}``; the
        sender's own `KVSender.request_stats` keys its figures by decode rank the same way),
        ``paths`` and ``staging`` (those senders' paths and stagings, in the same order),
        ``unpacks`` and ``unpack_seconds`` (region path: windows placed from the receive region
        into the pages, kernels waited for), ``latency_seconds`` (`expect` to the end, None
        while live) and ``done_at`` (`time.monotonic()` of the end, None while live: a clock
        every process of the host shares, for whole-request timings),
        ``stage_seconds`` (staged on a GPU: host -> device window copies, part of
        ``unpack_seconds``) and ``timeline`` (``[event, rank, time.monotonic()]`` lists, rank this
        rank's group rank: `requests.Timeline`). Raises KeyError if unknown."""
        with self._lock:
            req = self._get(request_id)
            end = req.t_done
            mine = "staged" if self.staged else "direct"
            senders = [dict(address=link.client.address, dcp_rank=link.spec.dcp_rank, tp_rank=link.spec.tp_rank,
                            path=reported_path(link.path, link.spec, self.spec),
                            staging=dict(prefill="staged" if link.staged else "direct", decode=mine))
                       for link in req.senders]
            return dict(status=req.status.value, reason=req.state.reason, bytes=req.bytes, senders=senders,
                        paths=[s["path"] for s in senders], unpacks=req.unpacks,
                        unpack_seconds=req.unpack_seconds, stage_seconds=req.stage_seconds,
                        staging=[s["staging"] for s in senders],
                        latency_seconds=None if end is None else end - req.created,
                        timeline=req.timeline.as_list(), timeline_dropped=req.timeline.dropped,
                        done_at=None if end is None else time.monotonic() - (time.perf_counter() - end))

    def request_latency(self, request_id: str) -> float | None:
        """Seconds from `expect` to SUCCESS/FAILED/ABORTED (None while live)."""
        req = self._get(request_id)
        return None if req.t_done is None else req.t_done - req.created
