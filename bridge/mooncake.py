"""Mooncake adapter (``mooncake.engine.TransferEngine``, TCP, peer-to-peer handshake).

A batch goes to a per-peer worker thread (`bridge.handles.Worker`) that submits it with
``batch_transfer_async_write`` (op "WRITE") or ``batch_transfer_async_read`` (op "READ") in
windows of at most `MOONCAKE_MAX_BATCH_ENTRIES` entries and waits for each window with
``get_batch_transfer_status`` (which blocks in C++ with the GIL released), so packing the next
chunk in Python overlaps the transfer and `check` only looks at the job. One worker per peer also
keeps at most one window in flight per peer, which is what the TCP transport's per-peer queue
limit counts. `cancel` stops a batch between windows.

Completion notification: Mooncake delivers a ``TransferNotify(name, msg)`` with a synchronous
transfer; after the last window lands the worker sends a zero-length WRITE carrying the tag, and
the target reads it with ``get_notifies`` (verified over TCP on loopback). A READ's notification
goes the same way, to the peer it read from, after its last window.

Engine traps handled here (measured on mooncake-transfer-engine-non-cuda 0.3.13.post1):
- the TCP transport never checks local source addresses: the shared validation in
  `bridge.base` rejects any range outside our registrations before submission;
- ``get_batch_transfer_status`` dereferences the batch id as a pointer and frees it: only ids
  from a successful async submit (non-zero) are passed, each exactly once, by the worker;
- failures come back as -1 / batch id 0 with the detail in the engine's log: they become
  `TransferError` naming the peer.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from bridge.base import (
    BridgeError,
    MemoryRegion,
    PeerError,
    PeerInfo,
    RegistrationError,
    TransferEngine,
    TransferError,
    TransferHandle,
)
from bridge.handles import Job, Worker

__all__ = ["MooncakeEngine", "MOONCAKE_MAX_BATCH_ENTRIES", "mooncake_available"]

try:
    from mooncake import engine as _mc
except ImportError:  # pragma: no cover - depends on the environment (needs libibverbs1)
    _mc = None

#: Most entries submitted to Mooncake in one async batch. With default settings the TCP
#: transport admits about 1,024 queued transfers per peer (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER,
#: MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER); a batch of more than ~2,000 entries fails with
#: "queue-full" and, worse, poisons the session: every later transfer from this engine to that
#: peer fails too. Windows of 1,024, each completed before the next, never reach the limit
#: whatever the environment says.
MOONCAKE_MAX_BATCH_ENTRIES = 1024


def mooncake_available() -> bool:
    """True when ``mooncake.engine`` imports in this environment."""
    return _mc is not None


class MooncakeEngine(TransferEngine):
    """`TransferEngine` over Mooncake's transfer engine (host memory over TCP on this build).

    Args:
        name: engine name, used as the sender name of notifications.
        hostname: local address peers connect to (default loopback).
        metadata_server: "P2PHANDSHAKE" (no metadata service) or a service URL.
        protocol: Mooncake transport ("tcp"; "rdma" where RDMA devices exist).
        device_name: RDMA device filter ("" for all).
        window: entries per async submission, 1 .. `MOONCAKE_MAX_BATCH_ENTRIES`.

    Raises:
        BridgeError: Mooncake is not installed or ``initialize`` failed.
        ValueError: window out of range.
    """

    kind = "mooncake"

    def __init__(
        self,
        name: str,
        *,
        hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device_name: str = "",
        window: int = MOONCAKE_MAX_BATCH_ENTRIES,
    ):
        super().__init__(name)
        if _mc is None:
            raise BridgeError("Mooncake is not installed (pip install --no-deps "
                              "mooncake-transfer-engine-non-cuda; apt-get install libibverbs1)")
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MOONCAKE_MAX_BATCH_ENTRIES:
            raise ValueError(f"{window=} must be an int in 1..{MOONCAKE_MAX_BATCH_ENTRIES}")
        self.window = window
        self._te = _mc.TransferEngine()
        rc = self._te.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise BridgeError(f"Mooncake initialize({hostname=}, {metadata_server=}, {protocol=}) returned {rc}")
        # The port in the hostname is ignored under P2PHANDSHAKE: peers must use the bound one.
        self.session = f"{hostname}:{self._te.get_rpc_port()}"
        self._workers: dict[str, Worker] = {}  # one per peer
        self._retired: list[Worker] = []  # of removed peers, joined at close
        self._jobs: dict[int, Job] = {}  # handle.seq -> its job

    # ---- registration ---------------------------------------------------------------------
    def _engine_register(self, regions: Sequence[MemoryRegion]) -> None:
        done = []
        for r in regions:
            if r.mem_type != "DRAM" and not getattr(_mc, "SUPPORT_CUDA", False):
                self._engine_deregister(done)
                raise RegistrationError(f"regions: {r.mem_type} region {r} needs a CUDA build of Mooncake")
            rc = self._te.register_memory(r.addr, r.nbytes)
            if rc != 0:
                self._engine_deregister(done)
                raise RegistrationError(f"regions: Mooncake register_memory refused {r} (rc={rc})")
            done.append(r)

    def _engine_deregister(self, regions: Sequence[MemoryRegion]) -> None:
        for r in regions:
            rc = self._te.unregister_memory(r.addr)
            if rc != 0:
                raise RegistrationError(f"regions: Mooncake unregister_memory refused {r} (rc={rc})")

    # ---- peers ----------------------------------------------------------------------------
    def _engine_peer_info(self) -> PeerInfo:
        return PeerInfo(engine=self.kind, name=self.name, session=self.session, metadata=b"",
                        regions=tuple(self._regions))

    def _engine_add_peer(self, info: PeerInfo, refresh: bool) -> None:
        host, _, port = info.session.rpartition(":")
        if not host or not port.isdigit():
            raise PeerError(f"info: peer {info.name!r} has session={info.session!r}, expected 'host:port'")
        if info.name not in self._workers:
            self._workers[info.name] = Worker(f"mooncake-{self.name}-{info.name}")

    def _engine_remove_peer(self, info: PeerInfo) -> None:
        # Queued batches are dropped; a running one stops after the window inside the engine.
        reason = f"peer {info.name!r} removed"
        for job in list(self._jobs.values()):
            if job.tag == info.name:
                job.cancel(reason)
        worker = self._workers.pop(info.name, None)
        if worker is not None:
            worker.stop(reason)
            self._retired.append(worker)

    # ---- transfers ------------------------------------------------------------------------
    def _engine_submit(self, handle, descs, local_mem, remote_mem, info) -> None:
        if local_mem[0] != "DRAM" or remote_mem[0] != "DRAM":
            if not getattr(_mc, "SUPPORT_CUDA", False):
                raise handle.error(TransferError, "this Mooncake build moves host memory only")
        notif_addrs = None
        if handle.notif is not None:
            if not self._regions or not info.regions:
                raise PeerError("notif: a Mooncake notification needs one registered region on each side")
            notif_addrs = (self._regions[0].addr, info.regions[0].addr)
        # Python ints for pybind's list[int]; done here so the worker holds no numpy views.
        local, remote, lens = (descs[:, k].tolist() for k in range(3))
        # The job holds the engine object: it stays alive while the worker may be inside it.
        job = Job(self._run, self._te, handle, info.session, local, remote, lens, notif_addrs, tag=handle.peer)
        worker = self._workers.get(handle.peer)
        try:
            if worker is None:
                raise RuntimeError("no worker")
            self._jobs[handle.seq] = job
            worker.submit(job)
        except RuntimeError as exc:  # worker stopped by a concurrent remove_peer or close
            self._jobs.pop(handle.seq, None)
            raise PeerError(f"peer={handle.peer!r} was removed") from exc

    def _run(self, job: Job, te, handle: TransferHandle, session: str, local: list, remote: list, lens: list,
             notif_addrs: tuple[int, int] | None) -> None:
        """Worker thread: the windows of one batch, in order, then the notification."""
        n, w, op = len(lens), self.window, handle.op
        submit = te.batch_transfer_async_write if op == "WRITE" else te.batch_transfer_async_read
        for lo in range(0, n, w):
            if job.cancel_reason is not None:
                raise handle.error(TransferError, f"Mooncake {op} cancelled",
                                   f"{job.cancel_reason}; {lo} of {n} entries were submitted")
            hi = min(lo + w, n)
            bid = submit(session, local[lo:hi], remote[lo:hi], lens[lo:hi])
            self._count_engine_call()
            if bid == 0:  # failure sentinel: never pass it to get_batch_transfer_status
                raise handle.error(TransferError, f"Mooncake refused the {op} batch",
                                   f"batch_transfer_async_{op.lower()} returned 0 for entries {lo}..{hi - 1}")
            rc = te.get_batch_transfer_status([bid])  # blocks, frees bid
            if rc != 0:
                raise handle.error(TransferError, f"Mooncake reported a failed {op} batch",
                                   f"get_batch_transfer_status returned {rc} for entries {lo}..{hi - 1}")
        if notif_addrs is not None:
            if job.cancel_reason is not None:
                raise handle.error(TransferError, f"Mooncake {op} cancelled before its notification",
                                   f"{job.cancel_reason}; all {n} entries had moved")
            # latin-1 maps bytes 1:1 onto str, so any tag survives pybind's str round trip.
            note = _mc.TransferNotify(self.name, handle.notif.decode("latin-1"))
            rc = te.transfer_sync(session, notif_addrs[0], notif_addrs[1], 0, _mc.TransferOpcode.Write, note)
            self._count_engine_call()
            if rc != 0:
                raise handle.error(TransferError, "Mooncake could not deliver the notification",
                                   f"transfer_sync returned {rc}")

    def _engine_check(self, handle: TransferHandle) -> bool:
        job = self._jobs[handle.seq]
        if not job.done.is_set():
            return False
        self._jobs.pop(handle.seq, None)
        if job.dropped:
            raise handle.error(TransferError, f"Mooncake {handle.op} cancelled before it started",
                               job.cancel_reason or "")
        if job.error is not None:
            if isinstance(job.error, TransferError):
                raise job.error
            raise handle.error(TransferError, f"Mooncake {handle.op} failed",
                               f"{type(job.error).__name__}: {job.error}")
        return True

    def _engine_block(self, handle: TransferHandle, max_s: float) -> None:
        job = self._jobs.get(handle.seq)
        if job is not None:
            job.done.wait(max_s)
        else:
            time.sleep(max_s)

    def _engine_cancel(self, handle: TransferHandle) -> None:
        job = self._jobs.get(handle.seq)
        if job is not None:
            job.cancel("cancelled by the caller")

    def _engine_abort(self, handle: TransferHandle) -> None:
        job = self._jobs.pop(handle.seq, None)
        if job is not None:  # stops further windows; the one inside the engine ends on its own
            job.cancel("abandoned after a timeout")

    def _engine_poll_notifs(self) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for note in self._te.get_notifies():
            out.setdefault(note.name, []).append(note.msg.encode("latin-1"))
        return out

    def _engine_close(self, regions, peers) -> None:
        for job in list(self._jobs.values()):
            job.cancel("engine closed")
        self._jobs.clear()
        workers = list(self._workers.values()) + self._retired
        for worker in workers:
            worker.stop("engine closed")
        # Join every worker before the engine is destroyed: a thread still inside
        # get_batch_transfer_status would touch freed memory. No timeout: `close` does not wait for
        # this thread beyond its own timeout, and the engine must outlive a stuck window.
        for worker in workers:
            worker.join()
        self._workers.clear()
        self._retired.clear()
        for r in regions:
            try:
                self._te.unregister_memory(r.addr)
            except Exception:  # noqa: BLE001 - closing: best effort
                pass
        self._te = None  # the destructor tears the engine down (~1 s), on this thread
