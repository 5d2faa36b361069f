"""When a region write's ``done`` notification goes out: with its write, or once the round's writes ended.

A mixin of `dcp_jax.transfer.KVSender` (worker thread, lock held). A decode rank unpacks a
region window into its pages as soon as the window's ``done`` notification arrives. Where the
rank has a GPU of its own that overlaps its unpack with the sender's later writes. Where the
rank shares the sender's GPU (several decode processes on one device), its unpack runs in
another CUDA context: contexts time-slice, so the unpacks delay the sender's copies still in
flight (H200, 32k tokens, 8 decode processes: the writes landed one every ~0.6 ms over 5.2 ms
with the unpacks running, all within 1.6-2.4 ms of the first post with the unpacks held back;
`docs/gpu_log.md`, 2026-12-04).

Per connection (`Conn.notify`, chosen at the handshake by `notify_policy`):

- ``"each"``: the write carries its ``done`` (the engine sends it after the write's bytes).
- ``"round"``: the write goes out without one; once it completed, its ``done`` is held until no
  held-policy write of this sender is in flight any more, or for at most `HOLD_MAX_S`, then sent
  as a notification-only batch (`bridge.base.TransferEngine.transfer_batch` with no descriptors).
  The window's pack region is freed at the write's end; it counts in flight (its request's and
  its rank's) until its notification completed.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from dcp_jax.transfer import protocol as proto

__all__ = ["NOTIFY_POLICIES", "HOLD_MAX_S", "SenderNotify", "notify_policy"]

#: ``KVSender(region_notify=...)``: ``"auto"`` (``"round"`` for a rank whose KV cache is on the
#: sender's own GPU, else ``"each"``), ``"each"`` or ``"round"``.
NOTIFY_POLICIES = ("auto", "each", "round")

#: The longest a completed write's ``done`` waits for the other held writes (seconds): bounds the
#: delay a steady stream of writes from many requests could add to a rank's unpack.
HOLD_MAX_S = 0.004

_MAX_GPU_KEY = 64  # characters of a peer's ``host["gpu"]`` taken as a device identity
_NO_DESCS = np.empty((0, 3), np.int64)


def notify_policy(setting: str, *, path: str, direction: str, sender_gpu: str, peer_host: Any,
                  same_host: bool) -> str:
    """The ``done`` policy of one connection: ``"each"`` or ``"round"``.

    Args:
        setting: the sender's ``region_notify`` (one of `NOTIFY_POLICIES`).
        path, direction: the connection's transfer path and direction: only a pushed region path
            posts region writes; every other connection is ``"each"``.
        sender_gpu: `CacheLayers.gpu_key` of the sender's KV ("" on the host).
        peer_host: the rank's ``hello.host`` dict (a peer's message: its ``"gpu"`` is taken only
            as a str of at most 64 characters).
        same_host: the rank runs on this very host and boot (`bridge.cuda_ipc.same_host`).
    """
    if path != "region" or direction != "push":
        return "each"
    if setting != "auto":
        return setting
    gpu = peer_host.get("gpu") if isinstance(peer_host, dict) else None
    shared = (isinstance(gpu, str) and 0 < len(gpu) <= _MAX_GPU_KEY and bool(sender_gpu)
              and gpu == sender_gpu and same_host)
    return "round" if shared else "each"


class SenderNotify:
    """Region writes whose ``done`` waits for the round (`Conn.notify` ``"round"``)."""

    def _write_notif(self, u: Any, frame: bytes) -> bytes | None:
        """The notification a region write carries: its ``done`` frame, or None when it is held
        (the frame is kept on the unit and sent by `_release_notes`)."""
        if u.target.conn.notify != "round":
            return frame
        u.note = frame
        return None

    def _held_write_done(self, u: Any, now: float) -> None:
        """A held-policy write completed: its pack region is free (nothing reads it any more);
        its ``done`` waits in `_inflight` (no handle) for `_release_notes`."""
        self._free_region(u)
        u.handle, u.landed_at = None, now
        u.req.timeline.mark("written", u.target.conn.spec.group_rank)

    def _release_notes(self, keep: list, now: float) -> list:
        """Sends the held ``done`` notifications once no held-policy write is in flight, or the
        oldest has waited `HOLD_MAX_S`; returns ``keep`` (the in-flight units) with the notified
        ones now waiting on their notification's batch. A request that ended meanwhile gets none
        (its ranks were told how it ended): the unit just finishes."""
        held = [u for u in keep if u.landed_at is not None]
        if not held:
            return keep
        writing = any(u.note is not None and u.landed_at is None for u in keep)
        if writing and now - min(u.landed_at for u in held) < HOLD_MAX_S:
            return keep
        out = [u for u in keep if u.landed_at is None]
        for u in held:
            frame, u.note, u.landed_at = u.note, None, None
            if u.req.status.terminal or self._requests.get(u.req.rid) is not u.req:
                self._unit_finished(u, None)
                continue
            try:
                u.handle = self.engine.transfer_batch(u.target.conn.peer, _NO_DESCS, notif=frame,
                                                      dcp_rank=u.target.conn.spec.dcp_rank, chunk=u.rc.chunk)
            except Exception as exc:  # noqa: BLE001 - the rank never hears of the window: the request fails
                self._unit_finished(u, f"done notification: {type(exc).__name__}: {exc}")
                continue
            u.req.timeline.mark("noted", u.target.conn.spec.group_rank)
            out.append(u)
        return out
