"""`jax.experimental.transfer` behind the bridge engine interface (``make_engine("jax-transfer")``).

`JaxTransferEngine` is a `bridge.base.TransferEngine` like the NIXL and Mooncake adapters, so the
connector (`KVSender` / `KVReceiver`) and the main job use it unchanged: registered host memory,
``i64[n, 3]`` descriptor batches, READ and WRITE, notifications, cancel, `remove_peer`, bounded
`close`. JAX's engine only moves whole arrays, by pull, so every batch is a pull:

- READ (what tpu-inference and sglang-jax do): the initiator asks the owner, over this engine's
  side channel, to stage the requested remote ranges; the owner checks them against its own
  registrations, gathers them into one uint8 array, copies it into ``staging`` memory
  (``pinned_host`` by default), schedules it with ``await_pull`` under a uuid it draws, and
  answers the uuid; the initiator pulls it, scatters it into its local ranges, and tells the
  owner ("read_done", with the batch's notification), which drops the staged copy.
- WRITE: the initiator gathers its local ranges and offers them; the target pulls them, checks
  and scatters them into its ranges, queues the notification, then answers "written". The
  handle completes on that answer, so SUCCESS still means landed.

The side channel is one ZeroMQ ROUTER per engine (its address is the `PeerInfo.session`; the
transfer server's address travels in `PeerInfo.metadata`); requests come from one DEALER per
peer, owned by that peer's worker thread. Every message is a msgpack map checked field by field
(`bridge._jax_parts.check`), never pickle; a request naming a range outside this engine's registrations (any
engine may ask, as any NIXL agent holding our metadata may write) is refused with an "error"
answer and counted (`rejected_messages`) before any memory is touched. The initiator's side
(one batch on the peer's worker, its DEALER, waiting for the answer) is in `bridge.jax_initiator`.

Staging: sglang-jax documents that unpinned host staging corrupts bf16 strides in this engine.
Bytes move here as flat uint8 arrays, whatever the caches' dtype, staged in ``pinned_host``;
tests/bridge/test_jax_transfer_engine.py checks bf16 caches byte for byte.

Limits: host memory ("DRAM") only (a device cache is copied to the host by the caller); one
batch at a time per peer (one worker each, like Mooncake); a WRITE's cancel stops the target
before it writes if the pull has not finished, otherwise the batch completes; a staged offer
nobody pulls is dropped after ``offer_ttl_s``.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence

import msgpack
import numpy as np
import zmq

from bridge._jax_parts import (
    MAX_MESSAGE_BYTES, MAX_RANGES, PROTOCOL_VERSION,  # noqa: F401 - the first two re-exported
    REPLIES, REQUESTS, HostMemory, Refused, check, encode,  # noqa: F401 - REPLIES: bridge.jax_initiator's
    is_address, ranges_of)
from bridge.base import (  # noqa: F401 - the last three used in bridge.jax_initiator, kept importable here
    BridgeError, DescriptorError, MemoryRegion, PeerError, PeerInfo, RegistrationError, TransferEngine,
    TransferError, TransferHandle, TransferTimeout)
from bridge.handles import Job, JobCompletion, Worker, check_timeout
from bridge.jax_transfer import KIND, STAGINGS, JaxTransferServer
from bridge.jax_initiator import _WAIT_SLICE_MS, JaxInitiator  # noqa: F401 - _WAIT_SLICE_MS kept importable here

__all__ = ["JaxTransferEngine", "PROTOCOL_VERSION", "MAX_MESSAGE_BYTES", "MAX_RANGES"]

_log = logging.getLogger("bridge")
#: Most requesting engines served at once (one worker thread each; a "from" name is only a claim).
MAX_SERVED_PEERS = 256

class JaxTransferEngine(JaxInitiator, JobCompletion, HostMemory, TransferEngine):
    """`TransferEngine` over `jax.experimental.transfer`: host memory, every batch a pull.

    Args:
        name: engine name (the sender name of its notifications).
        hostname: address the side channel and the transfer server listen on (default loopback).
        staging: memory kind staged copies live in, one of `bridge.jax_transfer.STAGINGS`
            (default "pinned_host": sglang-jax's bf16 warning).
        timeout_s: bound on each exchange with a peer (an answer, a pull), seconds (> 0).
        offer_ttl_s: a staged READ offer not pulled within this is dropped, seconds (> 0).
        device: the JAX device whose client serves transfers (default the first).

    Raises:
        ValueError: bad staging, timeout_s or offer_ttl_s.
        TransferError: the transfer server did not start.
    """

    JOB_LABEL = "jax-transfer"

    kind = KIND

    def __init__(self, name: str, *, hostname: str = "127.0.0.1", staging: str = "pinned_host",
                 timeout_s: float = 60.0, offer_ttl_s: float = 300.0, device=None):
        super().__init__(name)
        if staging not in STAGINGS:
            raise ValueError(f"{staging=} must be one of {STAGINGS}")
        self.timeout_s = check_timeout(timeout_s)
        self.offer_ttl_s = check_timeout(offer_ttl_s)
        self._xfer = JaxTransferServer(name, device=device, address=f"{hostname}:0",
                                       transport_addresses=(f"{hostname}:0",), staging=staging)
        self.staging = staging
        ctx = zmq.Context.instance()
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_MESSAGE_BYTES)
        port = self._router.bind_to_random_port(f"tcp://{hostname}")
        self._session = f"{hostname}:{port}"
        self._wake_addr = f"inproc://jax-engine-{id(self)}-{secrets.token_hex(4)}"
        self._wake_rx = ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = ctx.socket(zmq.PUSH)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()  # the PUSH socket is shared by the serving workers
        self._replies: list[tuple[bytes, bytes]] = []
        self._serving = True
        self.rejected_messages = 0
        self._new_notifs: dict[str, list[bytes]] = {}
        self._peer_xfer: dict[str, str] = {}  # peer -> its transfer server's address
        self._workers: dict[str, Worker] = {}  # initiator side, one per peer
        self._servers: dict[str, Worker] = {}  # serving side, one per requesting peer
        self._retired: list[Worker] = []
        # (peer, worker thread id) -> (session, socket): a removed and re-added peer gets a new
        # worker while the old one may still finish a batch; each keeps its own socket
        self._dealers: dict[tuple[str, int], tuple[str, zmq.Socket]] = {}
        self._jobs: dict[int, Job] = {}
        self._offers: dict[int, tuple[str, float]] = {}  # READ offers: uuid -> (peer, staged at)
        self._writing: set[tuple[str, int]] = set()  # (peer, seq) of WRITEs being served
        self._cancelled: set[tuple[str, int]] = set()  # ... of those the initiator cancelled
        self._views: dict[MemoryRegion, np.ndarray] = {}
        self._loop = threading.Thread(target=self._serve, name=f"jax-engine-{name}", daemon=True)
        self._loop.start()

    # ---- registrations and peers ------------------------------------------------------------
    def _engine_register(self, regions: Sequence[MemoryRegion]) -> None:
        for r in regions:
            if r.mem_type != "DRAM":
                raise RegistrationError(f"regions: {r} is {r.mem_type}; the jax-transfer engine moves host "
                                        f"memory (DRAM) regions only")

    def _engine_deregister(self, regions: Sequence[MemoryRegion]) -> None:
        for r in regions:
            self._views.pop(r, None)

    def _engine_peer_info(self) -> PeerInfo:
        meta = msgpack.packb({"v": PROTOCOL_VERSION, "transfer": self._xfer.address}, use_bin_type=True)
        return PeerInfo(engine=KIND, name=self.name, session=self._session, metadata=meta,
                        regions=tuple(self._regions))

    def _engine_add_peer(self, info: PeerInfo, refresh: bool) -> None:
        host, _, port = info.session.rpartition(":")
        if not host or not port.isdigit():
            raise PeerError(f"info: peer {info.name!r} has session={info.session!r}, expected 'host:port'")
        try:
            meta = msgpack.unpackb(info.metadata, raw=False, max_str_len=512, max_bin_len=0,
                                   max_array_len=0, max_map_len=4)
            addr = meta["transfer"] if isinstance(meta, dict) and meta.get("v") == PROTOCOL_VERSION else None
        except Exception:  # noqa: BLE001 - garbage metadata: refused below
            addr = None
        if not is_address(addr):
            raise PeerError(f"info: peer {info.name!r} metadata does not name its transfer server "
                            f"(a version-{PROTOCOL_VERSION} map with 'transfer': 'host:port')")
        self._peer_xfer[info.name] = addr
        if info.name not in self._workers:
            self._workers[info.name] = Worker(f"jax-engine-{self.name}-{info.name}")

    def _engine_remove_peer(self, info: PeerInfo) -> None:
        reason = f"peer {info.name!r} removed"
        for job in list(self._jobs.values()):
            if job.tag == info.name:
                job.cancel(reason)
        for pool in (self._workers, self._servers):
            worker = pool.pop(info.name, None)
            if worker is not None:
                worker.stop(reason)
                self._retired.append(worker)

    # ---- the serving side -------------------------------------------------------------------
    def _serve(self) -> None:
        """Side-channel thread: takes requests, hands them to the requesting peer's worker, sends
        the workers' answers, drops stale offers."""
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_sweep = time.monotonic() + 1.0
        while self._serving:
            events = dict(poller.poll(1000))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            while self._router in events:
                try:
                    frames = self._router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_request(frames)
            with self._wake_lock:
                replies, self._replies = self._replies, []
            for ident, data in replies:
                self._router.send_multipart([ident, data])
            if time.monotonic() > next_sweep:
                next_sweep = time.monotonic() + 1.0
                old = [u for u, (_, t) in list(self._offers.items()) if time.monotonic() - t > self.offer_ttl_s]
                for u in old:
                    self._offers.pop(u, None)
                    self._xfer.release(u)
        for s in (self._router, self._wake_rx):
            s.close(0)

    def _reply(self, ident: bytes, data: bytes) -> None:
        with self._wake_lock:
            self._replies.append((ident, data))
            if self._serving:
                self._wake_tx.send(b"", zmq.NOBLOCK)

    def _on_request(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.rejected_messages += 1
            return
        ident, data = frames
        msg = None
        try:
            msg = check(data, REQUESTS)
            peer = msg["from"]
            if not 0 < len(peer) <= 256 or (msg["op"] == "write" and not is_address(msg["address"])):
                raise Refused(f"{msg['op']}: from={peer!r:.80} / address must be a name and a 'host:port'")
        except Refused as exc:
            self.rejected_messages += 1
            _log.warning("jax-transfer engine %r: refused a request: %s", self.name, exc)
            seq = msg["seq"] if msg is not None else 0  # 0 never matches a live batch (seqs start at 1)
            self._router.send_multipart([ident, encode("error", seq=seq, msg=f"refused: {exc}")])
            return
        key = (peer, msg["seq"])
        if msg["op"] == "cancel":
            if key in self._writing:  # a cancel for a batch already answered is dropped
                self._cancelled.add(key)
            return
        if msg["op"] == "write":
            self._writing.add(key)
        worker = self._servers.get(peer)
        if worker is None:
            if len(self._servers) >= MAX_SERVED_PEERS:  # one thread per name: names are claims
                self.rejected_messages += 1
                self._router.send_multipart([ident, encode("error", seq=msg["seq"], msg=(
                    f"refused: engine {self.name!r} already serves {MAX_SERVED_PEERS} peers"))])
                return
            worker = self._servers[peer] = Worker(f"jax-engine-{self.name}-serve-{peer}")
        try:
            worker.submit(Job(self._serve_one, ident, msg, tag=peer))
        except RuntimeError:  # the peer is being removed
            self._router.send_multipart([ident, encode("error", seq=msg["seq"], msg="peer removed")])

    def _serve_one(self, job: Job, ident: bytes, msg: dict) -> None:
        """A serving worker: one request of one peer; always answers (except "read_done")."""
        op, peer, seq = msg["op"], msg["from"], msg["seq"]
        try:
            if op == "read_done":
                if self._offers.get(msg["uuid"], ("",))[0] == peer:
                    self._offers.pop(msg["uuid"], None)
                    self._xfer.release(msg["uuid"])
                    if msg["ok"] and msg["notif"] is not None:
                        self._notify(peer, msg["notif"])
                return
            if op == "notify":
                self._notify(peer, msg["notif"])
                self._reply(ident, encode("written", seq=seq))
                return
            ranges = ranges_of(msg["ranges"])
            if op == "read":
                data = self._gather(ranges[:, 0], ranges[:, 1])
                uuid = secrets.randbits(63)
                self._offers[uuid] = (peer, time.monotonic())
                self._xfer.offer(uuid, [data], copy=False)
                self._reply(ident, encode("offered", seq=seq, uuid=uuid, nbytes=int(data.nbytes)))
                return
            # write: pull the initiator's offer, then land it (unless it cancelled meanwhile)
            total = int(ranges[:, 1].sum())
            list(self._located(ranges[:, 0], ranges[:, 1]))  # checked before anything moves
            # A peer we know is pulled from where its PeerInfo says; one we do not (NIXL and
            # Mooncake targets need not add their initiators either) from where it says it is.
            out = self._xfer.pull(self._peer_xfer.get(peer, msg["address"]), msg["uuid"], [((total,), np.uint8)],
                                  timeout_s=self.timeout_s, peer=peer)
            if (peer, seq) in self._cancelled:
                raise BridgeError("cancelled by the initiator before its bytes were written")
            self._scatter(ranges[:, 0], ranges[:, 1], np.asarray(out[0]))
            if msg["notif"] is not None:
                self._notify(peer, msg["notif"])
            self._reply(ident, encode("written", seq=seq))
        except Exception as exc:  # noqa: BLE001 - the initiator gets the reason
            if isinstance(exc, (Refused, DescriptorError)):
                self.rejected_messages += 1
            if op != "read_done":
                self._reply(ident, encode("error", seq=seq, msg=f"{type(exc).__name__}: {exc}"[:4000]))
        finally:
            self._writing.discard((peer, seq))
            self._cancelled.discard((peer, seq))

    def _notify(self, peer: str, notif: bytes) -> None:
        with self._lock:
            self._new_notifs.setdefault(peer, []).append(notif)

    def _engine_poll_notifs(self) -> dict[str, list[bytes]]:
        with self._lock:
            out, self._new_notifs = self._new_notifs, {}
        return out

    # ---- teardown ---------------------------------------------------------------------------
    def _engine_close(self, regions, peers) -> None:
        for job in list(self._jobs.values()):
            job.cancel("engine closed")
        self._jobs.clear()
        workers = list(self._workers.values()) + list(self._servers.values()) + self._retired
        for w in workers:
            w.stop("engine closed")
        with self._wake_lock:
            self._serving = False
            self._wake_tx.send(b"", zmq.NOBLOCK)
        for w in workers:  # each is bounded by timeout_s (its answer wait or its pull)
            w.join()
        self._loop.join()
        self._wake_tx.close(0)
        for _, sock in self._dealers.values():
            sock.close(0)
        self._dealers.clear()
        self._views.clear()
        self._offers.clear()
        self._xfer.close()
