"""NIXL adapter (UCX backend): one agent per process, out-of-band metadata, one transfer per batch.

Per batch: ``get_xfer_descs`` for both sides, ``initialize_xfer(op, ...)`` ("WRITE" local ->
remote, "READ" remote -> local) with the notification, ``transfer``. ``transfer`` posts every
descriptor before it returns (400k small descriptors keep it busy ~4 s over CMA, GIL released),
so the posting runs on a background worker thread (`bridge.workers.Worker`) and `transfer_batch`
returns at once; a small batch (`INLINE_MAX_DESCRIPTORS`, a region write's one descriptor) is
posted in the caller's thread instead while that thread is idle. A transfer DONE at posting is released by the worker; one still moving goes to a
poller thread (`bridge.workers.Poller`) that follows ``check_xfer_state`` to DONE or ERR and
releases it. `check` never calls into NIXL: it reads what those threads recorded (a status
check or release from the caller's thread was measured waiting 0.5-3 s on a loaded machine
behind a big posting). NIXL's typed exceptions (``nixlNotFoundError``,
``nixlRemoteDisconnectError``, ...) and its "ERR" status become `TransferError` in `check`/`wait`.

Locking: with a worker the agent uses ``NIXL_THREAD_SYNC_RW``: posting and status checks share
NIXL's lock (under ``NIXL_THREAD_SYNC_STRICT`` a status check waited 1-6 s for a 200-300k
descriptor posting). Exclusive calls (register, deregister, metadata, peers, notifications)
wait for a posting in progress; `notifications` therefore skips the agent while the worker
posts (the worker collects them after each posting), and peer changes run on the worker in order
with the postings (`add_peer` waits for it, `remove_peer` does not). NIXL forgets a removed peer
only once that peer's posted transfers have ended: removed at once, NIXL answers NOT_FOUND for them
while UCX may still be moving their bytes, and `check` would hand back memory still in use.

Peers (metadata, loads, refreshes against stale metadata, removal once their transfers ended) are
in `bridge.nixl_peers`.

What touches the NIXL library without the engine's bookkeeping (which wheel imports, agent
creation, descriptor lists, the `Posted` record the poller follows) is in `bridge.nixl_agent`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from bridge.base import (  # noqa: F401 - PeerError, PeerInfo: used in bridge.nixl_peers, kept importable here
    BridgeError,
    MemoryRegion,
    PeerError,
    PeerInfo,
    RegistrationError,
    TransferEngine,
    TransferError,
    TransferHandle,
)
from bridge.workers import Job, Poller, Worker
from bridge.nixl_peers import NixlPeers
from bridge.nixl_agent import (  # noqa: F401 - nixl_agent re-exported (scripts/gpu_suite_summary.py)
    NIXL_ERRORS,
    PROGRESS_THREAD_DELAY_US,
    Posted,
    agent_config,
    create_agent,
    engine_msg,
    nixl_agent,
    nixl_available,
    release,
    xfer_desc_lists,
)

__all__ = ["NixlEngine", "nixl_available"]

_log = logging.getLogger("bridge")

#: How long the teardown of a closed engine waits for posted transfers to reach DONE or ERR before
#: it gives up and leaves the agent alive (seconds); it runs on a daemon thread.
CLOSE_LINGER_S = 30.0
# Agents whose transfers never finished at close: kept alive so NIXL never frees memory UCX uses.
_LEAKED_AGENTS: list = []


#: A batch of at most this many descriptors is posted in the caller's thread when the posting
#: thread is idle (`bridge.workers.Worker.run_if_idle`): handing a one-descriptor region write to
#: the thread cost more than posting it. On one H200 (2026-12-04, the 32k region job, 3 requests
#: per run, alternating on one machine start) posting inline took the whole request from 204.5 /
#: 213.1 GB/s to 264.3 / 237.3 and the first window landed 0.5-0.7 ms after the first post, not 1.65-2.37.
#: Big batches (a packed window: thousands) stay on the thread: posting them takes milliseconds.
INLINE_MAX_DESCRIPTORS = 64


class NixlEngine(NixlPeers, TransferEngine):
    """`TransferEngine` over a NIXL agent with the UCX backend (host or device memory).

    Args:
        name: agent name; unique among the agents that talk to each other.
        backends: NIXL backends to create (default UCX, the one that moves agent-to-agent bytes).
        async_submit: post batches on a background worker thread (True) or inside
            `transfer_batch` (False: engine refusals then raise from `transfer_batch`).
        progress_delay_us: pause of NIXL's progress thread between polls, microseconds (0 = spin).

    Raises:
        BridgeError: NIXL is not installed or the agent could not be created.
    """

    kind = "nixl"

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",), async_submit: bool = True,
                 progress_delay_us: int = PROGRESS_THREAD_DELAY_US):
        super().__init__(name)
        if nixl_agent is None:
            raise BridgeError("NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)")
        if progress_delay_us < 0:
            raise ValueError(f"{progress_delay_us=} must be >= 0")
        conf = agent_config(backends, shared_lock=async_submit)  # worker and poller share the agent
        try:
            self._agent = create_agent(name, conf, progress_delay_us)
        except Exception as exc:
            raise BridgeError(f"cannot create NIXL agent {name=}: {engine_msg(exc)}") from exc
        self._reg_dlists: dict[MemoryRegion, object] = {}
        self._jobs: dict[int, Job] = {}  # handle.seq -> its posting; result (xfer or None, state)
        self._worker = Worker(f"nixl-{name}", inline=not async_submit)
        # Follows posted transfers, oldest first (they end mostly in posting order).
        self._poller = Poller(f"nixl-poll-{name}", self._poll_posted, in_order=True)
        # Held by the worker while it is inside a posting: `notifications` skips the agent then.
        self._posting = threading.Lock()
        self._stash: list[dict] = []  # notifications the worker collected after its postings
        self._stash_lock = threading.Lock()
        # Removed peers whose posted transfers still run: name -> their handle seqs.
        self._removing: dict[str, set[int]] = {}
        self._removing_lock = threading.Lock()

    # ---- registration ---------------------------------------------------------------------
    def _engine_register(self, regions: Sequence[MemoryRegion]) -> None:
        done: list[MemoryRegion] = []
        try:
            for r in regions:  # one registration per region so each can be deregistered alone
                dl = self._agent.register_memory([(r.addr, r.nbytes, r.device_id, "")], r.mem_type)
                if dl is None:
                    raise RegistrationError(f"regions: NIXL refused {r}")
                self._reg_dlists[r] = dl
                done.append(r)
        except RegistrationError:
            self._engine_deregister(done)
            raise
        except Exception as exc:
            self._engine_deregister(done)
            raise RegistrationError(f"regions: NIXL could not register {r}: {engine_msg(exc)}") from exc

    def _engine_deregister(self, regions: Sequence[MemoryRegion]) -> None:
        for r in regions:
            dl = self._reg_dlists.pop(r, None)
            if dl is None:
                continue
            try:
                self._agent.deregister_memory(dl)
            except Exception as exc:
                raise RegistrationError(f"regions: NIXL could not deregister {r}: {engine_msg(exc)}") from exc

    # ---- transfers ------------------------------------------------------------------------
    def _engine_submit(self, handle, descs, local_mem, remote_mem, info) -> None:
        job = Job(self._post_job, handle, descs, local_mem, remote_mem, info.name, tag=info.name)
        self._jobs[handle.seq] = job
        try:
            if len(descs) <= INLINE_MAX_DESCRIPTORS and not self._worker.inline and self._worker.run_if_idle(job):
                return  # posted here (a refusal is in job.error, seen by `check` as from the worker)
            self._worker.submit(job)  # inline mode: engine refusals raise here
        except RuntimeError as exc:  # worker stopped: the engine is closing
            self._jobs.pop(handle.seq, None)
            raise handle.error(TransferError, f"engine {self.name!r} is closing") from exc
        except BaseException:
            self._jobs.pop(handle.seq, None)
            raise

    def _post_job(self, job: Job, handle, descs, local_mem, remote_mem, peer: str) -> Posted:
        """Worker thread: posts the batch; a transfer done at once is released here, one still
        moving goes to the poller. `check` itself never calls into NIXL."""
        with self._posting:
            try:
                xfer, state = self._post(handle, descs, local_mem, remote_mem, peer)
            finally:  # on the thread, collect notifications too: back-to-back postings never starve
                if self._worker.in_thread():  # them (a caller posting inline polls them itself)
                    self._stash_notifs()
        rec = Posted(xfer)
        if state == "PROC":
            self._poller.add(rec)
        else:
            rec.finish(state)
        return rec

    def _poll_posted(self, rec: Posted) -> bool:
        """Poller thread: True (and the NIXL handle released) once the transfer is DONE or ERR."""
        try:
            state = self._agent.check_xfer_state(rec.xfer)
            message = f"check_xfer_state: {state}"
        except Exception as exc:  # noqa: BLE001 - NIXL's typed errors: a failed transfer
            state, message = "ERR", engine_msg(exc)
        if state == "PROC":
            return False
        rec.finish(state, message)
        return True

    def _stash_notifs(self) -> None:
        try:
            new = self._agent.get_new_notifs()
        except Exception:  # noqa: BLE001 - the caller's own poll reports a broken agent
            return
        if new:
            with self._stash_lock:
                self._stash.append(new)

    def _post(self, handle, descs, local_mem, remote_mem, peer: str):
        """Builds and posts one transfer of ``handle.op``; returns (xfer handle, or None for an
        empty batch, and its state)."""
        op = handle.op
        if descs.shape[0] == 0:
            if handle.notif is not None:
                try:
                    self._agent.send_notif(peer, handle.notif)
                except Exception as exc:
                    raise handle.error(TransferError, "NIXL could not send the notification",
                                       engine_msg(exc)) from exc
            return None, "DONE"
        xfer = None
        try:
            ld, rd = xfer_desc_lists(self._agent, descs, local_mem, remote_mem)
            if ld is None or rd is None:
                raise handle.error(TransferError, "NIXL could not build descriptor lists")
            xfer = self._agent.initialize_xfer(op, ld, rd, peer, handle.notif or b"")
            self._count_engine_call()
            state = self._agent.transfer(xfer)
        except TransferError:
            raise
        except NIXL_ERRORS + (KeyError,) as exc:
            if xfer is not None:
                release(xfer)
            raise handle.error(TransferError, f"NIXL refused the {op}", engine_msg(exc)) from exc
        if state == "ERR":
            release(xfer)
            raise handle.error(TransferError, f"NIXL failed to post the {op}", "transfer() returned ERR")
        return xfer, state

    def _engine_check(self, handle: TransferHandle) -> bool:
        job = self._jobs[handle.seq]
        if not job.done.is_set():
            return False  # queued or being posted
        if job.dropped or job.error is not None:
            self._forget(handle)
            if job.dropped:
                raise handle.error(TransferError, f"NIXL {handle.op} cancelled before it was posted",
                                   job.cancel_reason or "")
            if isinstance(job.error, TransferError):
                raise job.error
            raise handle.error(TransferError, f"NIXL {handle.op} failed", engine_msg(job.error))
        rec: Posted = job.result
        if not rec.final.is_set():
            return False  # posted, still moving (the poller follows it)
        self._forget(handle)
        if rec.state != "DONE":
            raise handle.error(TransferError, f"NIXL reported a failed {handle.op}", rec.message)
        return True

    def _engine_block(self, handle: TransferHandle, max_s: float) -> None:
        job = self._jobs.get(handle.seq)
        if job is None:
            time.sleep(max_s)
        elif not job.done.is_set():
            job.done.wait(max_s)  # wakes when the posting ends
        elif isinstance(job.result, Posted):
            job.result.final.wait(max_s)  # wakes when the poller saw DONE / ERR

    def _engine_cancel(self, handle: TransferHandle) -> None:
        job = self._jobs.get(handle.seq)
        if job is not None:  # effective only while queued: NIXL cannot stop a posting
            job.cancel("cancelled by the caller")

    def _engine_abort(self, handle: TransferHandle) -> None:
        # A queued posting is dropped; a posted transfer is still followed (and released) by the
        # poller, so its NIXL handle is freed once UCX is done with the memory.
        job = self._forget(handle)
        if job is not None:
            job.cancel("abandoned after a timeout")

    def _engine_poll_notifs(self) -> dict[str, list[bytes]]:
        batches = []
        if self._posting.acquire(blocking=False):  # else the worker is posting: getNotifs would
            try:                                   # wait for NIXL's lock until the posting ends
                batches.append(self._agent.get_new_notifs())
            finally:
                self._posting.release()
        with self._stash_lock:  # what the worker collected between postings (older: first)
            batches[:0], self._stash = self._stash, []
        out: dict[str, list[bytes]] = {}
        for new in batches:
            for k, v in new.items():
                out.setdefault(k.decode() if isinstance(k, bytes) else k, []).extend(bytes(m) for m in v)
        return out

    def _engine_quiesce(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for job in list(self._jobs.values()):
            job.cancel("engine closed")
        self._worker.stop("engine closed")
        # The posting under way ends on its own; posted transfers must end before the poller stops.
        if not (self._worker.join(timeout_s) and self._poller.drain(max(0.0, deadline - time.monotonic()))):
            return False
        self._poller.stop()
        return self._poller.join(max(0.0, deadline - time.monotonic()))

    def _engine_close(self, regions, peers) -> None:
        jobs = list(self._jobs.values())
        self._jobs.clear()
        for job in jobs:
            job.cancel("engine closed")
        self._worker.stop("engine closed")
        self._worker.join()  # no thread may be inside the agent when it is destroyed
        # Posted transfers still moving: let them reach DONE or ERR before releasing anything.
        if not self._poller.drain(CLOSE_LINGER_S):
            _log.warning("NIXL agent %r: %d transfer(s) still in progress %.0f s after close; the agent is "
                         "kept alive", self.name, self._poller.pending, CLOSE_LINGER_S)
            _LEAKED_AGENTS.append(self._agent)
            self._poller.stop()
            return
        self._poller.stop()
        self._poller.join()
        for info in peers:
            try:
                self._agent.remove_remote_agent(info.name)
            except Exception:  # noqa: BLE001 - closing: best effort
                pass
        for r in list(self._reg_dlists):
            try:
                self._engine_deregister([r])
            except RegistrationError:
                pass
        self._agent = None

