"""The sender's pack of one submission round (a mixin of `dcp_jax.transfer.KVSender`, worker
thread, lock held): region asks and the pack kernels, and the tickets `SenderUnits._post_ready`
posts by; the worker's spin check while a pack runs.

Why the asks all go before the launches, and one ticket a round (2026-12-07, one H200, the 32k
region job, `benchmarks/gpu/cupti_probe.sh` against the tree before): asking and launching window
by window, each window with a ticket of its own so its write could go once its own pack ended,
read 301.8 / 321.3 GB/s whole against 315.9 / 339.4. A direct pack launch costs ~0.2 ms of host
time there, more than its 0.14 ms kernel: the launches are host-bound, the asks between them
came up to 2 ms late, and so did their grants, while no write could go before the last launch
anyway (the same thread posts).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from dcp_jax.transfer.memory import array_kind
from pallas_kernels.config import env_flag

__all__ = ["SenderPack"]

logger = logging.getLogger(__name__)

#: A ticket a window (``DCP_JAX_PACK_TICKET_EACH=1``; off by default, an A/B for the GPU): the
#: round's asks still go first, then each window's direct launch with a ticket after it, so a
#: window's write may go once ITS kernel ended rather than the round's last one. On an H100
#: (2026-12-08, 32k region job, `--mps`, `benchmarks/gpu/region_arms.sh`) the first write went
#: ~0.5 ms earlier but the last one ended no earlier (the device is HBM-bound: packs and copies
#: share it): 349.1 / 329.9 GB/s whole against 357.4 / 311.7 without; with ``region_notify=
#: "write"`` 345.2 / 259.9 (the ranks' unpacks ran beside the packs and stretched them). Unmeasured
#: on an H200, where the launches, not the kernels, are the slower side.
TICKET_EACH = env_flag("DCP_JAX_PACK_TICKET_EACH", False)


class SenderPack:
    """`_pack_round` and what it uses: `_pack_batch`, `_pack_each`, `_pack_ticket`; the worker's
    spin check while a pack runs (`_spin_ready`)."""

    def _spin_ready(self) -> bool:
        """The worker's spin check after a round that left a pack running (worker thread, no
        lock: ``_packing`` changes on this thread only): the oldest pack's ticket is ready, or
        a control frame (a grant) waits on the socket. A failed kernel raises here; the round
        that follows reports it."""
        if self._packing:
            ticket = self._packing[0][0]
            if ticket is None or ticket.ready():
                return True
        return bool(self._ctl.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _pack_round(self, packed: list, batch: list) -> None:
        """Asks (region push) and packs a round's windows, then queues what their posts wait
        for in ``self._packing``. ``packed``: (unit, lo, hi, pack address or None) per window;
        ``batch``: (unit, rows, pack offset) of the windows the pack kernels fill."""
        # Region push: ask for room while the pack runs. A device pack is enqueued, not run, so
        # its asks go before the enqueue and the round trip also overlaps the launch's host time.
        # A host pack runs in the call: asked before it, the ranks that granted poll their engine
        # through it (the 16k region job on a 2-core host packed in 0.30-0.34 s against
        # 0.21-0.22, 2026-12-07).
        device_pack = array_kind(self._pack.array) == "cupy"
        if packed:
            self._round_no += 1
            for p in packed:
                p[0].round = self._round_no
        if device_pack:
            asked = self._ask_regions(packed)
            if len(asked) < len(packed):  # a window whose ask failed ended its request: not packed
                live = {p[0] for p in asked}
                batch = [b for b in batch if b[0] in live]
            packed = asked
        if TICKET_EACH and batch and len(batch) == len(packed) \
                and self._packer.launches_each([rows for _, rows, _ in batch]):
            return self._pack_each(packed if device_pack else self._ask_regions(packed), batch)
        failed = self._pack_batch(batch)
        for u, exc in failed:
            self._submit_failed(u, exc)
        if failed:
            gone = {u for u, _ in failed}
            packed = [p for p in packed if p[0] not in gone]
        if not device_pack:
            packed = self._ask_regions(packed)
        if packed:
            self._packing.append((self._pack_ticket(packed), packed, time.perf_counter()))

    def _pack_each(self, packed: list, batch: list) -> None:
        """`TICKET_EACH`: the asked windows' direct launches in turn, a `pallas_kernels.written`
        ticket after each (it covers the launches so far: one stream), queued one window an
        entry so `_post_ready` posts each once its own kernel ended. A window whose launch fails
        ends its request. A request's pack time: its launches, then the wait after its last."""
        from pallas_kernels import written

        at = {p[0]: p for p in packed}  # units hash by identity
        last = {u.req: k for k, (u, _, _) in enumerate(batch)}
        for k, (u, rows, offset) in enumerate(batch):
            p = at.get(u)
            if p is None:
                continue
            tk = time.perf_counter()
            try:
                self._packer(rows, offset, sync=False)
                ticket = written(self._pack.array)
            except Exception as exc:  # noqa: BLE001 - its request fails, the sender lives on
                self._submit_failed(u, exc)
                continue
            now = time.perf_counter()
            u.req.pack_seconds += now - tk
            u.req.launches += 1
            # Only a request's last window counts its wait (`_post_packed` adds it from `since`).
            self._packing.append((ticket, [p], now if last[u.req] == k else None))

    def _pack_ticket(self, packed: list) -> Any:
        """What a round's posts wait for: a `pallas_kernels.written` ticket for the device pack
        just enqueued (it covers that pack only, not the engine's copies of earlier rounds, which
        a device-wide wait also waited for), or None: no device pack (host buffers, fused or
        direct windows), or a view pair's host-made block, which the device-wide wait covers."""
        if not any(addr is not None for _, _, _, addr in packed):
            return None
        if array_kind(self._pack.array) != "cupy" or any(
                addr is not None and u.target.conn.view is not None for u, _, _, addr in packed):
            return None
        from pallas_kernels import written

        return written(self._pack.array)

    def _pack_batch(self, batch: list) -> list:
        """Enqueues the round's windows as ONE pack (`Packer.pack_windows`: one kernel launch on
        a GPU, where a call per window cost ~0.6 ms of host time each). Should it raise, the
        windows are packed one by one, so only a window that fails ends its request; returns
        those (unit, exception) pairs. The call's time counts in each request's pack time."""
        if not batch:
            return []
        tk, staged0 = time.perf_counter(), self._packer.stage_seconds
        failed = []
        try:  # one launch for the round, or one a window (direct launches, a named backend)
            per_window = self._packer.pack_windows([(rows, off) for _, rows, off in batch], sync=False) > 1
        except Exception:  # noqa: BLE001 - find the window that fails; the others go out
            logger.warning("one pack for %d windows failed; packing window by window", len(batch),
                           exc_info=True)
            per_window = True
            for u, rows, off in batch:
                try:
                    self._packer(rows, off, sync=False)
                except Exception as exc:  # noqa: BLE001 - its request fails, the sender lives on
                    failed.append((u, exc))
        took, staged = time.perf_counter() - tk, self._packer.stage_seconds - staged0
        for req in dict.fromkeys(u.req for u, _, _ in batch):
            req.pack_seconds += took
            req.stage_seconds += staged
            req.launches += sum(1 for u, _, _ in batch if u.req is req) if per_window else 1
        return failed
