"""The sender's worker round, and the one owner of its control socket.

A mixin of `dcp_jax.transfer.KVSender`. The worker thread runs `_round` (read the receivers'
frames, plan and post windows, poll completions, timeouts, heartbeats) and owns the ROUTER
socket while it runs: zmq sockets are not thread-safe and the worker polls it outside the lock,
so every frame goes out through `_tell`, which queues what a caller's thread makes (an `abort`,
a `release`). Once the worker has stopped, the closing thread owns it (`_close_conns`).
"""
from __future__ import annotations

import time

from dcp_jax.transfer import protocol as proto
from dcp_jax.transfer._worker import ACTIVE, IDLE, PENDING, SPIN
from dcp_jax.transfer.control import BYE_LINGER_MS
from dcp_jax.transfer.spec import HandshakeError

__all__ = ["SenderRound"]


class SenderRound:
    """`_round`, `_on_frame`, `_tell`, `_flush_ctl`, `_close_conns`."""

    def _round(self) -> int:
        busy = False
        now = time.monotonic()
        gap, self._last_round = now - self._last_round, now
        if gap > self._stall_s and self._conns:  # before reading or posting anything
            with self._lock:
                self._on_stall(gap)
        if self._outbox:  # frames an abort or a release made on a caller's thread
            with self._lock:
                self._flush_ctl()
        for ident, msg in self._ctl.recv():
            busy = True
            with self._lock:
                self._on_frame(ident, msg)
        with self._lock:
            busy |= self._post_ready()  # earlier rounds whose packs finished
            self._plan_units()
            busy |= self._submit_units()
            if self._asks:  # region windows packed and asked: their grants may already be here,
                for ident, msg in self._ctl.recv():  # written now rather than a round later
                    busy = True
                    self._on_frame(ident, msg)
            busy |= self._poll_inflight()
            self._retry_held_hellos()
            self._check_timeouts()
            self._heartbeat()
            if busy:
                return ACTIVE
            if self._packing:  # a device pack finishes within a millisecond: its round posts then
                return SPIN
            # Grants arrive on the control socket; a held hello waits for the engine's completions.
            return PENDING if self._inflight or self._held_hellos or self._held_dones else IDLE

    def _on_frame(self, ident: bytes, msg: dict) -> None:
        """`_on_message`, isolated: `recv` drained every waiting frame, so one whose handling
        raises must not cost the others (other receivers' announcements, grants, pings) nor the
        rest of the round. It is counted in ``worker_errors`` and logged rate-limited
        (`Worker.isolate`); a hello that failed so is answered ``hello_nack(field="hello")``,
        not left to time out."""
        if self._worker.isolate(self._on_message, ident, msg) or msg["k"] != "hello" or ident in self._conns:
            return
        self._held_hellos.pop(ident, None)
        self._worker.isolate(self._nack, ident, HandshakeError(
            "hello", None, None, f"this sender failed to handle it ({self._worker.last_error[:200]})"))

    def _tell(self, ident: bytes, frame: bytes) -> None:
        """Sends one control frame to a receiver: every frame of the sender goes out here.

        The worker polls the control socket outside the lock and zmq sockets are not thread-safe,
        so only the thread that owns the socket (`Worker.owns_sockets`) sends; a frame made on a
        caller's thread (an `abort`, a `release`) is queued and the worker woken. The queue goes
        first, so frames leave in the order they were made (all are made under the lock)."""
        if self._worker.owns_sockets():
            if self._outbox:
                self._flush_ctl()
            self._ctl.send(ident, frame)
        else:
            self._outbox.append((ident, frame))
            self._worker.wake()

    def _flush_ctl(self) -> None:
        """Sends the frames `_tell` queued (on the thread that owns the socket, under the lock)."""
        while self._outbox:
            self._ctl.send(*self._outbox.popleft())

    def _close_conns(self) -> None:
        self._drain_packing()  # no pack kernel may still write the buffer once it is given back
        # After the engine's close: drained says none of its writes can land any more.
        bye = proto.encode("bye", reason="sender closed", drained=self.engine.torn_down)
        # region_notify="round": writes that completed but whose ``done`` still waited for the
        # rest of their round are told now (their bytes landed; their requests may already be
        # SUCCESS here), before the bye that fails what is still live on the ranks.
        self._tell_held([], [], flush=True)
        self._flush_ctl()  # the worker has stopped: this thread owns the socket now
        for conn in self._conns.values():  # after the "failed" frames of the live requests
            self._ctl.send(conn.ident, bye)
        self._ctl.close(linger_ms=BYE_LINGER_MS)
        for conn in self._conns.values():
            conn.close_mapping()
        self._conns.clear()  # stats say 0 connections once closed
        if self._flag is not None:
            self._flag.close()
