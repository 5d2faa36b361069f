"""What a `KVSender` reports: its counters (`stats`), its decode ranks (`peers`) and each
request's figures (`request_stats`).

A mixin of `dcp_jax.transfer.KVSender` over the state ``KVSender.__init__`` creates; the public
methods take the sender's lock (the worker changes that state meanwhile).
"""
from __future__ import annotations

import time
from typing import Any

from dcp_jax.transfer.views import reported_path

__all__ = ["SenderStats"]


class SenderStats:
    """`request_stats`, `stats`, `peers`."""

    def request_stats(self, request_id: str) -> dict[str, Any]:
        """Per-request figures (plain values, for JSON): ``status`` (`TransferStatus.value`, the
        lowercase string: ``"success"``; `poll` and `wait` give the enum), per-rank ``path`` (the connection's transfer path, as in
        `peers`: "none" for a TP pair sharing no KV head),
        rows/descriptors/bytes/batches/engine calls and strategies, plan/pack/copy (fused kernel)
        seconds, ``launches`` (the pack calls: one a round on a device, one a window where the
        round's windows were launched directly or for a named ``pack_backend``, and fused fan-out launches that carried its windows: the
        rounds it took, `warm_up`'s ``round_rows``), ``transfer_seconds`` (first submit to this side's completion) and
        ``first_byte_at`` (`time.monotonic()` when the first byte was packed, or sent on the
        unpacked paths: a clock every process of the host shares, for whole-request timings),
        ``pack_backend`` (registry name), ``stage_seconds`` (device -> host staging copies, part
        of ``pack_seconds``), per rank ``staging``: ``{"prefill": "direct"|"staged",
        "decode": "direct"|"staged"}`` (what each side of that connection registers) and
        ``timeline`` (``[event, rank, time.monotonic()]`` lists, rank the decode rank's group rank:
        `requests.Timeline`; at most `requests.MAX_EVENTS`, ``timeline_dropped`` counts the rest)."""
        with self._lock:
            req = self._get(request_id)
            t0, t1 = req.t_first_submit, req.t_done
            mine = "staged" if self.staged else "direct"
            return dict(status=req.status.value, reason=req.state.reason, inflight=req.inflight,
                        plan_seconds=req.plan_seconds, pack_seconds=req.pack_seconds,
                        copy_seconds=req.copy_seconds, launches=req.launches, first_byte_at=req.first_byte_at,
                        transfer_seconds=(t1 - t0) if t0 is not None and t1 is not None else None,
                        pack_backend=self.pack_backend, stage_seconds=req.stage_seconds,
                        timeline=req.timeline.as_list(), timeline_dropped=req.timeline.dropped,
                        ranks={r: dict(t.counters.as_dict(), path=reported_path(t.conn.path, self.spec, t.conn.spec),
                                       staging=dict(prefill=mine, decode="staged" if t.conn.staged else "direct"))
                               for r, t in sorted(req.targets.items())})

    @property
    def stats(self) -> dict[str, Any]:
        """Counters of this sender: requests by outcome, bytes/descriptors/batches/engine calls
        submitted, dropped and rejected messages, kernel compiles, pack arena, connections."""
        with self._lock:
            out = dict(self._counts)
            out.update(rejected_messages=self._ctl.rejected, live_requests=len(self._requests),
                       queued_windows=len(self._queue), inflight_windows=len(self._inflight) + len(self._pulls),
                       connections=len(self._conns), kernel_compiles=self._compile_count(),
                       arena=dict(self._arena.stats), worker_errors=self._worker.errors)
        return out

    @property
    def peers(self) -> list[dict[str, Any]]:
        """The connected decode ranks, one dict each, by (group, dcp_rank, tp_rank): ``name`` (the
        receiver's engine name), ``group``, ``dcp_rank``, ``tp_rank``, ``path`` (chosen at the
        handshake: "direct", "packed", "region" or "fused"; "none" for a TP pair that shares no
        KV head, between which nothing moves), ``direction`` ("push" / "pull"),
        ``staged`` (its KV is not registered), ``silent_s`` (seconds since its last message) and
        its own ``heartbeat_s`` / ``peer_timeout_s`` (seconds, from its hello). Empty once closed."""
        with self._lock:
            return self._peer_list()

    def _peer_list(self) -> list[dict[str, Any]]:
        """`KVSender.peers` (under the lock)."""
        now = time.monotonic()
        return [dict(name=c.name, group=c.group, dcp_rank=c.spec.dcp_rank, tp_rank=c.spec.tp_rank,
                     path=reported_path(c.path, self.spec, c.spec),
                     direction=c.direction, staged=c.staged, silent_s=now - c.last_seen, heartbeat_s=c.heartbeat_s,
                     peer_timeout_s=c.peer_timeout_s)
                for c in sorted(self._conns.values(), key=lambda c: (c.group, c.spec.dcp_rank, c.spec.tp_rank))]
