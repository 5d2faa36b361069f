"""The initiator's side of `bridge.jax_engine.JaxTransferEngine`: one batch, start to end, on the peer's worker.

A mixin: the state it works on (the transfer server, the dealers, ``_peer_xfer``, ``timeout_s``) is
created in ``JaxTransferEngine.__init__``. A READ asks the owner to stage its ranges and pulls
them; a WRITE offers the local ranges and waits for the target's "written" (the flow is in
`bridge.jax_engine`'s module docstring). Each peer's requests go over one DEALER, made in and used
only by that peer's worker thread.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time

import numpy as np
import zmq

from bridge._jax_parts import MAX_MESSAGE_BYTES, REPLIES, Refused, check, encode
from bridge.base import TransferError, TransferHandle, TransferTimeout
from bridge.handles import Job

__all__ = ["JaxInitiator"]

_log = logging.getLogger("bridge")
_WAIT_SLICE_MS = 50  # a worker waiting for an answer looks at cancel / deadline this often


class JaxInitiator:
    """`JaxTransferEngine`'s ``_engine_submit`` and the worker-thread exchange of one batch with its peer."""

    def _engine_submit(self, handle, descs, local_mem, remote_mem, info) -> None:
        job = Job(self._run, handle, descs.copy(), info.session, tag=handle.peer)
        self._submit_job(handle, job)

    def _run(self, job: Job, handle: TransferHandle, descs: np.ndarray, session: str) -> None:
        """Worker thread: one batch, start to end (see the module docstring)."""
        sock = self._dealer(handle.peer, session)
        seq, deadline = handle.seq, time.monotonic() + self.timeout_s
        if len(descs) == 0:
            if handle.notif is not None:
                self._send(sock, handle, encode("notify", seq=seq, notif=handle.notif, **{"from": self.name}))
                self._answer(sock, job, handle, deadline, "written")
            return
        remote = np.ascontiguousarray(descs[:, [1, 2]], dtype="<i8").tobytes()
        if handle.op == "WRITE":
            data = self._gather(descs[:, 0], descs[:, 2])
            uuid = secrets.randbits(63)
            self._xfer.offer(uuid, [data], copy=False)
            del data
            self._count_engine_call()
            try:
                self._send(sock, handle, encode("write", seq=seq, uuid=uuid, ranges=remote, notif=handle.notif,
                                                 address=self._xfer.address, **{"from": self.name}))
                self._answer(sock, job, handle, deadline, "written", cancel_msg=True)
            finally:
                self._xfer.release(uuid)
            return
        self._send(sock, handle, encode("read", seq=seq, ranges=remote, **{"from": self.name}))
        msg = self._answer(sock, job, handle, deadline, "offered")
        ok = False
        try:
            if msg["nbytes"] != handle.nbytes:
                raise handle.error(TransferError, "peer staged the wrong size",
                                   f"offered {msg['nbytes']} bytes for a {handle.nbytes}-byte READ")
            out = self._xfer.pull(self._peer_xfer[handle.peer], msg["uuid"], [((handle.nbytes,), np.uint8)],
                                  timeout_s=max(deadline - time.monotonic(), 1e-3), peer=handle.peer,
                                  should_stop=lambda: job.cancel_reason)
            self._count_engine_call()
            if job.cancel_reason is not None:
                raise handle.error(TransferError, "READ cancelled", job.cancel_reason)
            self._scatter(descs[:, 0], descs[:, 2], np.asarray(out[0]))
            ok = True
        finally:
            self._send(sock, handle, encode("read_done", seq=seq, uuid=msg["uuid"], ok=ok,
                              notif=handle.notif if ok else None, **{"from": self.name}))

    @staticmethod
    def _send(sock: zmq.Socket, handle: TransferHandle, data: bytes) -> None:
        try:
            sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # queue full: the peer has not taken anything for a long while
            raise handle.error(TransferError, "side channel to the peer is full", str(exc)) from None

    def _dealer(self, peer: str, session: str) -> zmq.Socket:
        """This peer's request socket (made in, and used only by, the peer's worker thread)."""
        key = (peer, threading.get_ident())
        old = self._dealers.get(key)
        if old is not None and old[0] == session:
            return old[1]
        if old is not None:  # the peer's info was refreshed with a new session
            old[1].close(0)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_MESSAGE_BYTES)
        sock.connect(f"tcp://{session}")
        self._dealers[key] = (session, sock)
        return sock

    def _answer(self, sock: zmq.Socket, job: Job, handle: TransferHandle, deadline: float, want: str,
                cancel_msg: bool = False) -> dict:
        """Waits for the peer's answer to request `handle.seq` (older answers are skipped)."""
        told = False
        while True:
            if job.cancel_reason is not None and not told:
                if not cancel_msg:
                    raise handle.error(TransferError, f"{handle.op} cancelled", job.cancel_reason)
                self._send(sock, handle, encode("cancel", seq=handle.seq, **{"from": self.name}))
                told = True  # the peer stops before writing, or finishes: its answer says which
            if time.monotonic() > deadline:
                raise handle.error(TransferTimeout, f"no answer from the peer within {self.timeout_s:g} s",
                                   f"waiting for {want!r}")
            if not sock.poll(_WAIT_SLICE_MS):
                continue
            try:
                msg = check(sock.recv(), REPLIES)
            except Refused as exc:
                self.rejected_messages += 1
                _log.warning("jax-transfer engine %r: refused an answer from %r: %s", self.name, handle.peer, exc)
                continue
            if msg["seq"] != handle.seq:
                continue  # the answer to a batch that already gave up
            if msg["op"] == "error":
                raise handle.error(TransferError, f"peer refused the {handle.op}", msg["msg"])
            if msg["op"] != want:
                raise handle.error(TransferError, f"peer answered {msg['op']!r}", f"expected {want!r}")
            return msg
