"""Mooncake adapter (``mooncake.engine.TransferEngine``: TCP, or NVLink/CUDA IPC within one host;
peer-to-peer handshake).

A batch goes to a per-peer worker thread (`bridge.workers.Worker`) that submits it with
``batch_transfer_async_write`` (op "WRITE") or ``batch_transfer_async_read`` (op "READ") in
windows of at most `MOONCAKE_MAX_BATCH_ENTRIES` entries and waits for each window with
``get_batch_transfer_status`` (which blocks in C++ with the GIL released), so packing the next
chunk in Python overlaps the transfer and `check` only looks at the job. One worker per peer also
keeps at most one window in flight per peer, which is what the TCP transport's per-peer queue
limit counts. `cancel` stops a batch between windows.

Completion notification: Mooncake delivers a ``TransferNotify(name, msg)`` with a synchronous
transfer; after the last window lands the worker sends a zero-length WRITE carrying the tag, and
the target reads it with ``get_notifies`` (verified over TCP on loopback). A READ's notification
goes the same way, to the peer it read from, after its last window. nvlink_intra refuses
zero-length copies (measured on the H200), so there the carrier is a one-byte READ of the peer's
first region into a private registered VRAM scratch of this engine.

Device memory (the CUDA build, ``mooncake-transfer-engine-cuda13``): with ``protocol="auto"`` (the
default) the transport is picked at the first registration (or `peer_info`): ``nvlink_intra`` when
it holds VRAM and the build has CUDA, else ``tcp``. ``nvlink_intra`` (``MC_INTRANODE_NVLINK=1``)
moves VRAM between processes of one host by ``cudaMemcpy`` through legacy CUDA IPC handles of the
registered ranges: 1.9 TB/s with one descriptor per target on an H200 (the project's platform notes). It handles
device memory only. Its handle is taken at the registered address and opened at the allocation's
base on the peer, so a range that starts inside a CuPy pool block or XLA buffer would be written
at the wrong offset: this adapter registers each VRAM region's whole allocation
(``cuMemGetAddressRange``, once per allocation, refcounted) while descriptors are still checked
against the caller's exact regions.

Engine traps handled here (measured on mooncake-transfer-engine-non-cuda 0.3.13.post1):
- the TCP transport never checks local source addresses: the shared validation in
  `bridge.base` rejects any range outside our registrations before submission;
- ``get_batch_transfer_status`` dereferences the batch id as a pointer and frees it: only ids
  from a successful async submit (non-zero) are passed, each exactly once, by the worker;
- failures come back as -1 / batch id 0 with the detail in the engine's log: they become
  `TransferError` naming the peer.
"""
from __future__ import annotations

import os
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
from bridge.handles import JobCompletion
from bridge.mooncake_wake import ListenerWaker
from bridge.workers import Job, Worker

__all__ = ["MooncakeEngine", "MOONCAKE_MAX_BATCH_ENTRIES", "MOONCAKE_PROTOCOLS", "mooncake_available",
           "mooncake_supports_cuda"]

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
#: Bytes of the private VRAM scratch an nvlink_intra engine reads a notification's byte into.
NOTIFY_SCRATCH_BYTES = 256


#: Values of ``MooncakeEngine(protocol=...)``: "auto" picks at the first registration.
MOONCAKE_PROTOCOLS = ("auto", "tcp", "rdma", "nvlink_intra")


def mooncake_available() -> bool:
    """True when ``mooncake.engine`` imports in this environment."""
    return _mc is not None


def mooncake_supports_cuda() -> bool:
    """True when the installed Mooncake is a CUDA build (it can register and move VRAM)."""
    return _mc is not None and bool(getattr(_mc, "SUPPORT_CUDA", False))


class MooncakeEngine(JobCompletion, TransferEngine):
    """`TransferEngine` over Mooncake's transfer engine: host memory over TCP, device memory of one
    host over ``nvlink_intra`` (CUDA build).

    Args:
        name: engine name, used as the sender name of notifications.
        hostname: local address peers connect to (default loopback).
        metadata_server: "P2PHANDSHAKE" (no metadata service) or a service URL.
        protocol: Mooncake transport, one of `MOONCAKE_PROTOCOLS`: "auto" (default: "nvlink_intra"
            if the first registration holds VRAM and the build has CUDA, else "tcp"; the engine
            starts then), "tcp", "rdma" (where RDMA devices exist) or "nvlink_intra" (VRAM only).
        device_name: RDMA device filter ("" for all).
        window: entries per async submission, 1 .. `MOONCAKE_MAX_BATCH_ENTRIES`.

    Raises:
        BridgeError: Mooncake is not installed, "nvlink_intra" without a CUDA build, or
            ``initialize`` failed (with "auto": at the first `register` or `peer_info`).
        ValueError: window or protocol out of range.
    """

    JOB_LABEL = "Mooncake"

    kind = "mooncake"

    def __init__(
        self,
        name: str,
        *,
        hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "auto",
        device_name: str = "",
        window: int = MOONCAKE_MAX_BATCH_ENTRIES,
    ):
        super().__init__(name)
        if _mc is None:
            raise BridgeError("Mooncake is not installed (pip install --no-deps "
                              "mooncake-transfer-engine-non-cuda; apt-get install libibverbs1)")
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MOONCAKE_MAX_BATCH_ENTRIES:
            raise ValueError(f"{window=} must be an int in 1..{MOONCAKE_MAX_BATCH_ENTRIES}")
        if protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(f"{protocol=} must be one of {MOONCAKE_PROTOCOLS}")
        if protocol == "nvlink_intra" and not mooncake_supports_cuda():
            raise BridgeError("protocol='nvlink_intra' needs Mooncake's CUDA build "
                              "(pip install --no-deps mooncake-transfer-engine-cuda13)")
        self.window = window
        self.protocol: str | None = None  # set when the engine starts
        self._init_args = (hostname, metadata_server, device_name)
        self._te = None
        self._scratch = 0  # nvlink_intra: device address of the notification scratch
        self._session = ""
        self._allocs: dict[tuple[int, int], list[int]] = {}  # nvlink_intra: (base, device) -> [size, refs]
        self._reg_allocs: dict[tuple[int, int], tuple[int, int]] = {}  # region (addr, nbytes) -> alloc key
        self._workers: dict[str, Worker] = {}  # one per peer
        self._retired: list[Worker] = []  # of removed peers, joined at close
        self._jobs: dict[int, Job] = {}  # handle.seq -> its job
        if protocol != "auto":
            self._start(protocol)

    # ---- start ----------------------------------------------------------------------------
    def _start(self, protocol: str) -> None:
        hostname, metadata_server, device_name = self._init_args
        if protocol == "nvlink_intra":
            # Read by the engine when it starts: intra-node NVLink (CUDA IPC) instead of TCP staging.
            os.environ["MC_INTRANODE_NVLINK"] = "1"
        te = _mc.TransferEngine()
        rc = te.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise BridgeError(f"Mooncake initialize({hostname=}, {metadata_server=}, {protocol=}) returned {rc}")
        if protocol == "nvlink_intra":
            self._scratch = self._make_scratch(te)
        self._te, self.protocol = te, protocol
        # The port in the hostname is ignored under P2PHANDSHAKE: peers must use the bound one.
        self._session = f"{hostname}:{te.get_rpc_port()}"

    @staticmethod
    def _make_scratch(te) -> int:
        """A private registered VRAM word for nvlink_intra notifications (see `_run`)."""
        import cupy

        ptr = int(cupy.cuda.runtime.malloc(NOTIFY_SCRATCH_BYTES))  # its own allocation: base = ptr
        rc = te.register_memory(ptr, NOTIFY_SCRATCH_BYTES)
        if rc != 0:
            cupy.cuda.runtime.free(ptr)
            raise BridgeError(f"Mooncake nvlink_intra: register_memory of the notification scratch returned {rc}")
        return ptr

    def _ensure_started(self, regions: Sequence[MemoryRegion] = ()) -> None:
        if self._te is None:
            vram = any(r.mem_type != "DRAM" for r in regions)
            self._start("nvlink_intra" if vram and mooncake_supports_cuda() else "tcp")

    @property
    def session(self) -> str:
        """``"host:rpc_port"`` peers reach this engine at (starts a "tcp" engine if none yet)."""
        self._ensure_started()
        return self._session

    # ---- registration ---------------------------------------------------------------------
    def _engine_register(self, regions: Sequence[MemoryRegion]) -> None:
        self._ensure_started(regions)
        done = []
        for r in regions:
            try:
                self._register_one(r)
            except RegistrationError:
                self._engine_deregister(done)
                raise
            done.append(r)

    def _register_one(self, r: MemoryRegion) -> None:
        if r.mem_type != "DRAM" and not mooncake_supports_cuda():
            raise RegistrationError(f"regions: {r.mem_type} region {r} needs a CUDA build of Mooncake "
                                    f"(mooncake-transfer-engine-cuda13)")
        if self.protocol != "nvlink_intra":
            rc = self._te.register_memory(r.addr, r.nbytes)
            if rc != 0:
                raise RegistrationError(f"regions: Mooncake register_memory refused {r} (rc={rc})")
            return
        if r.mem_type == "DRAM":
            raise RegistrationError(f"regions: host region {r} on a Mooncake nvlink_intra engine, which moves "
                                    f"device memory only (make a protocol='tcp' engine for host memory)")
        from bridge.cuda_ipc import IpcError, allocation_range

        try:
            base, size = allocation_range(r.addr, r.device_id)
        except IpcError as e:
            raise RegistrationError(f"regions: {r} is not CUDA device memory: {e}") from e
        key = (base, r.device_id)
        entry = self._allocs.get(key)
        if entry is None:
            rc = self._te.register_memory(base, size)
            if rc != 0:
                raise RegistrationError(f"regions: Mooncake register_memory refused the allocation "
                                        f"{base:#x}+{size} holding {r} (rc={rc})")
            entry = self._allocs[key] = [size, 0]
        entry[1] += 1
        self._reg_allocs[(r.addr, r.nbytes)] = key

    def _engine_deregister(self, regions: Sequence[MemoryRegion]) -> None:
        for r in regions:
            key = self._reg_allocs.pop((r.addr, r.nbytes), None) if self.protocol == "nvlink_intra" else None
            if key is not None:
                entry = self._allocs[key]
                entry[1] -= 1
                if entry[1] > 0:
                    continue
                del self._allocs[key]
                addr = key[0]
            elif self.protocol == "nvlink_intra":
                continue  # never reached the engine
            else:
                addr = r.addr
            rc = self._te.unregister_memory(addr)
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
        self._ensure_started()
        if self.protocol == "nvlink_intra" and any(r.mem_type == "DRAM" for r in info.regions):
            raise PeerError(f"info: peer {info.name!r} registered host memory; this nvlink_intra engine "
                            f"moves device memory only")
        if info.name not in self._workers:
            self._workers[info.name] = Worker(f"mooncake-{self.name}-{info.name}")
        if info.regions:
            # Opens the peer's segment now (a P2P handshake RPC, cached by the engine), while the
            # peer is answering: done lazily by the first transfer, that handshake holds an
            # engine-wide lock, so a first batch to a peer that stopped answering (SIGSTOP) blocks
            # every other peer's submissions until it resumes (measured: tests/netns/test_faults.py
            # ::test_stopped_receiver_does_not_block_other_receivers[mooncake]).
            self._te.get_first_buffer_address(info.session)

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
            if not mooncake_supports_cuda():
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
        self._submit_job(handle, job)

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
            if self._scratch:
                # nvlink_intra refuses a zero-length copy (cudaMemcpyBatchAsync: invalid argument), and
                # Mooncake sends a notification only with a transfer: read one byte of the peer's
                # first region into our private scratch, which changes nothing the caller owns.
                rc = te.transfer_sync(session, self._scratch, notif_addrs[1], 1, _mc.TransferOpcode.Read, note)
            else:
                rc = te.transfer_sync(session, notif_addrs[0], notif_addrs[1], 0, _mc.TransferOpcode.Write, note)
            self._count_engine_call()
            if rc != 0:
                raise handle.error(TransferError, "Mooncake could not deliver the notification",
                                   f"transfer_sync returned {rc}")


    def _engine_poll_notifs(self) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        if self._te is None:  # not started: nobody can have notified us
            return out
        for note in self._te.get_notifies():
            out.setdefault(note.name, []).append(note.msg.encode("latin-1"))
        return out

    def _engine_quiesce(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for job in list(self._jobs.values()):
            job.cancel("engine closed")  # a window under way ends; the next is not submitted
        workers = list(self._workers.values()) + self._retired
        for worker in workers:
            worker.stop("engine closed")
        return all(w.join(max(0.0, deadline - time.monotonic())) for w in workers)

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
        if self._te is None:
            return
        addrs = [k[0] for k in self._allocs] if self.protocol == "nvlink_intra" else [r.addr for r in regions]
        self._allocs.clear()
        self._reg_allocs.clear()
        for addr in addrs:
            try:
                self._te.unregister_memory(addr)
            except Exception:  # noqa: BLE001 - closing: best effort
                pass
        if self._scratch:
            try:
                self._te.unregister_memory(self._scratch)
            except Exception:  # noqa: BLE001 - closing: best effort
                pass
        # The destructor tears the engine down on this thread, holding the GIL; its handshake
        # listener is woken so that it does not wait out a 1 s accept timeout (`mooncake_wake`).
        port = self._session.rpartition(":")[2]  # "hostname:rpc_port" (`_start`)
        waker = ListenerWaker.start(self._init_args[0], int(port)) if port.isdigit() else None
        self._te = None
        if waker is not None:
            waker.close()
        if self._scratch:  # after the engine: nothing can copy into it any more
            import cupy

            cupy.cuda.runtime.free(self._scratch)
            self._scratch = 0
