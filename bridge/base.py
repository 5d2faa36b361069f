"""Transfer-engine protocol shared by every adapter (`bridge.nixl`, `bridge.mooncake`,
`bridge.jax_engine`).

The main job and the KV connector talk to a transfer engine only through `TransferEngine`. A
descriptor batch is an integer array ``i64[n, 3]`` of ``(local_addr, remote_addr, nbytes)`` rows,
moved local -> remote (``op="WRITE"``) or remote -> local (``op="READ"``). Batches run in the
background: `transfer_batch` returns a handle at once, `check` polls it without blocking, `wait`
blocks on it, `cancel` asks the engine to stop it.

Before anything reaches an engine, every descriptor is checked against the local registrations
and against the regions the peer advertised in its `PeerInfo` (`bridge.regions`). The engines do
not do this reliably: Mooncake's TCP transport reads unregistered local memory without complaint,
and NIXL keeps writing into a remote region the peer has deregistered if its metadata is stale.

Errors live in `bridge.errors`, regions and validation in `bridge.regions`, handles in
`bridge.handles`, engine state, adapter hooks, notifications and teardown (`close`) in
`bridge.core`; all are re-exported here unchanged.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from bridge.core import EngineCore, _account, registered_bytes
from bridge.errors import (  # noqa: F401 - re-exported
    BridgeError, DescriptorError, PeerError, RegistrationError, TransferError, TransferTimeout)
from bridge.handles import OPS, EngineCounters, TransferHandle, check_notif, check_timeout  # noqa: F401
from bridge.regions import (  # noqa: F401 - re-exported
    MEM_TYPES, MemoryRegion, PeerInfo, RegionTable, as_region, validate_descriptors)

__all__ = [
    "BridgeError", "RegistrationError", "DescriptorError", "PeerError", "TransferError",
    "TransferTimeout", "MemoryRegion", "PeerInfo", "EngineCounters", "RegionTable",
    "TransferHandle", "TransferEngine", "as_region", "validate_descriptors", "registered_bytes",
    "MEM_TYPES", "OPS",
]

# `wait` polls `check` with this backoff (seconds): small batches finish in ~100 us; the cap keeps
# a finished transfer noticed within a few ms.
_POLL_FIRST_S = 2e-5
_POLL_MAX_S = 2e-3


class TransferEngine(EngineCore):
    """One process's transfer engine: registrations, known peers, WRITE/READ batches, notifications.

    Subclasses implement the ``_engine_*`` hooks; everything callers use lives here (notifications,
    `close` and the context manager in the base class `bridge.core.EngineCore`) so every engine
    validates and counts the same way. Engines are context managers. One handle is driven
    by one thread at a time (`check` / `wait` / `cancel`); different handles, `transfer_batch`
    and `notifications` may be used from different threads.
    """

    # ---- registrations and peers ----------------------------------------------------------
    def register(self, regions: Iterable[Any]) -> None:
        """Registers memory regions with the engine and remembers them for validation.

        Register before calling `peer_info`: the peer validates against the regions listed there.
        The bytes count towards `registered_bytes`.

        Args:
            regions: `MemoryRegion`s, or objects `as_region` accepts (HostBuffer, numpy arrays).

        Raises:
            RegistrationError: a region overlaps one already registered (or another in the call),
                or the engine refused it (its message is included).
            TypeError, ValueError: a region is malformed.
        """
        self._check_open()
        new = [as_region(r) for r in regions]
        if not new:
            return
        with self._reg_lock:
            ordered = sorted(self._regions + new, key=lambda r: r.addr)
            for a, b in zip(ordered, ordered[1:]):
                if b.addr < a.end and a.mem_type == b.mem_type and a.device_id == b.device_id:
                    raise RegistrationError(f"regions: {b} overlaps {a} (overlapping registrations are refused)")
            self._engine_register(new)
            with self._lock:
                self._regions.extend(new)
                self._local_table = RegionTable(self._regions)
            _account(sum(r.nbytes for r in new))

    def deregister(self, regions: Iterable[Any]) -> None:
        """Deregisters regions registered earlier (exact address and length).

        Peers keep their copy of our `PeerInfo` until they re-add it: send them a fresh
        `peer_info()` so their validation drops the region.

        Raises:
            RegistrationError: a region was not registered here, or the engine refused.
        """
        self._check_open()
        drop = [as_region(r) for r in regions]
        with self._reg_lock:
            for r in drop:
                if r not in self._regions:
                    raise RegistrationError(f"regions: {r} is not registered with engine {self.name!r}")
            self._engine_deregister(drop)
            with self._lock:
                self._regions = [r for r in self._regions if r not in drop]
                self._local_table = RegionTable(self._regions)
            _account(-sum(r.nbytes for r in set(drop)))

    def peer_info(self) -> PeerInfo:
        """What peers need to reach this engine and validate descriptors (send it out of band;
        `PeerInfo.to_dict` gives plain types)."""
        self._check_open()
        return self._engine_peer_info()

    def add_peer(self, info: PeerInfo) -> str:
        """Makes a peer reachable; adding the same name again refreshes its metadata and regions.

        Args:
            info: the peer's `PeerInfo`, received out of band (`PeerInfo.from_dict` for a dict).

        Returns:
            The peer's name (pass it to `transfer_batch`).

        Raises:
            PeerError: info is of another engine kind, names this engine itself, or the engine
                refused the metadata.
            TypeError: info is not a `PeerInfo`.
        """
        self._check_open()
        if not isinstance(info, PeerInfo):
            raise TypeError(f"info must be a PeerInfo, got {type(info).__name__}")
        if info.engine != self.kind:
            raise PeerError(f"info: peer {info.name!r} is a {info.engine!r} engine, this one is {self.kind!r}")
        if info.name == self.name:
            raise PeerError(f"info: peer name {info.name!r} is this engine's own name")
        with self._reg_lock:
            refresh = info.name in self._peers
            table = RegionTable(info.regions)
            self._engine_add_peer(info, refresh)
            with self._lock:
                self._peers[info.name] = (info, table)
        return info.name

    def remove_peer(self, name: str) -> None:
        """Forgets a peer; later batches to it raise `PeerError`.

        Outstanding handles to the peer stay valid: the engine stops them as far as it can, and
        their `check` returns True or raises `TransferError` (as after `cancel`).

        Raises:
            PeerError: name is not a known peer.
        """
        self._check_open()
        with self._reg_lock:
            with self._lock:
                if name not in self._peers:
                    raise PeerError(f"{name=} is not a known peer of engine {self.name!r}")
                info, _ = self._peers.pop(name)
            self._engine_remove_peer(info)

    # ---- batches --------------------------------------------------------------------------
    def transfer_batch(
        self,
        peer: str,
        descs: np.ndarray,
        *,
        notif: bytes | None = None,
        op: str = "WRITE",
        dcp_rank: int | None = None,
        chunk: int | None = None,
    ) -> TransferHandle:
        """Validates one batch and starts it as one engine submission; returns without waiting
        for its bytes (an adapter may post a small batch before returning: NIXL, <= 64 descriptors).

        Args:
            peer: a name returned by `add_peer`.
            descs: i64[n, 3] of (local_addr, remote_addr, nbytes), bytes, for either op. Every local
                range must lie inside one registered region, every remote range inside one region
                the peer advertised, nbytes > 0. An empty batch makes no transfer call (with a
                notif it only sends the notification).
            notif: bytes the peer receives (`wait_notification`) once the whole batch is done: for
                a WRITE every byte has landed at the peer, for a READ every byte has been read.
            op: "WRITE" (local -> remote) or "READ" (remote -> local).
            dcp_rank: decode rank the batch is for, copied into errors.
            chunk: request chunk index, copied into errors.

        Returns:
            A handle: drive it to its end with `check` or `wait`.

        Raises:
            ValueError: op is neither "WRITE" nor "READ"; notif is empty.
            PeerError: unknown peer.
            DescriptorError: malformed descriptors or ranges outside registered memory (nothing is
                sent).
            TypeError: descs not an integer numpy array; notif not bytes.
            TransferError: the engine refused the submission.
        """
        self._check_open()
        if op not in OPS:
            raise ValueError(f"op={op!r} must be one of {OPS}")
        notif = check_notif(notif)
        with self._lock:
            entry = self._peers.get(peer)
            if entry is None:
                raise PeerError(f"{peer=} is not a known peer of engine {self.name!r} (add_peer first)")
            info, remote_table = entry
            local_table = self._local_table
        d, li, ri = validate_descriptors(descs, local_table, remote_table, peer=peer)
        local_mem = _mem_of(local_table, li, "local")
        remote_mem = _mem_of(remote_table, ri, "remote")
        handle = TransferHandle(peer, int(d.shape[0]), int(d[:, 2].sum()) if len(d) else 0, notif,
                                dcp_rank, chunk, op)
        handle.seq = next(self._seq)
        with self._lock:
            self._outstanding[handle.seq] = handle
        try:
            self._engine_submit(handle, d, local_mem, remote_mem, info)
        except BaseException:
            self._release(handle)
            raise
        with self._lock:
            self._counters.descriptors += handle.num_descriptors
            self._counters.bytes += handle.nbytes
            self._counters.batches += 1
        return handle

    def check(self, handle: TransferHandle) -> bool:
        """Polls a batch without blocking: it never calls into the engine library, only reads what
        the adapter's background threads recorded (measured: median ~10 us, max ~0.1 ms while a
        200k-descriptor NIXL posting was in flight; only the GIL or the OS can delay it).

        Args:
            handle: from `transfer_batch` of this engine, not yet released.

        Returns:
            True once the batch has completed: every byte moved and its notif (if any) sent. The
            handle is then released and the engine no longer touches the batch's memory.
            False while the batch is queued, being posted or moving.

        Raises:
            TransferError: the engine reported a failure, or the batch was cancelled (by `cancel`,
                `remove_peer`) before it completed; peer, batch size, rank, chunk and the engine's
                message are kept. The handle is released and, as with True, the engine no longer
                touches the batch's memory (bytes of it may be missing at the destination).
            BridgeError: the handle was already released, is from another engine, or the engine
                is closed.
            TypeError: handle is not a `TransferHandle`.
        """
        self._own(handle)
        try:
            done = self._engine_check(handle)
        except TransferError:
            self._release(handle)
            raise
        except Exception as exc:  # anything else the engine threw: keep its message
            self._engine_abort(handle)
            self._release(handle)
            raise handle.error(TransferError, f"{handle.op} batch failed", f"{type(exc).__name__}: {exc}") from exc
        if done:
            self._release(handle)
        return done

    def cancel(self, handle: TransferHandle) -> None:
        """Asks the engine to stop a batch as far as it can; returns at once, releases nothing.

        Contract: after `cancel`, keep calling `check` (or `wait`) on the handle until it returns
        True or raises; only then is the engine done with the memory the batch reads or writes,
        and only then may that memory be reused or freed. `check` then raises `TransferError`
        ("cancelled") when the engine stopped the batch early, or returns True when it had
        already completed (nothing is undone). What each engine can stop:

        - Mooncake: no further window of at most `MOONCAKE_MAX_BATCH_ENTRIES` entries is
          submitted and the notification is not sent; the window already inside the engine
          finishes (or fails) first.
        - NIXL: a batch still queued for posting is dropped; a posting in progress or a posted
          transfer cannot be stopped, it runs to DONE (True) or ERR (TransferError).

        Cancelling twice, or a handle already released, does nothing.

        Raises:
            BridgeError: the handle is from another engine.
            TypeError: handle is not a `TransferHandle`.
        """
        if not isinstance(handle, TransferHandle):
            raise TypeError(f"handle must be a TransferHandle, got {type(handle).__name__}")
        if handle.released or self._closed:
            return
        if self._outstanding.get(handle.seq) is not handle:
            raise BridgeError(f"handle {handle!r} is not from engine {self.name!r}")
        self._engine_cancel(handle)

    def wait(self, handle: TransferHandle, timeout_s: float = 30.0) -> None:
        """Blocks until the batch has completed (as `check` returning True), then releases it.

        Args:
            handle: from `transfer_batch` of this engine, not yet released.
            timeout_s: deadline in seconds (> 0).

        Raises:
            TransferTimeout: not complete by the deadline. The batch is aborted (as `cancel`) and
                the handle released at once, so the engine may still be finishing it: its bytes
                may be partly moved and its memory still in use for a while.
            TransferError: the engine reported a failure (peer named, engine message kept).
            BridgeError: the handle was already released or belongs to another engine.
        """
        timeout_s = check_timeout(timeout_s)
        self._own(handle)
        deadline = time.monotonic() + timeout_s
        pause = _POLL_FIRST_S
        try:
            while not self._engine_check(handle):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise handle.error(TransferTimeout, f"{self.kind} {handle.op} batch not complete within "
                                                        f"{timeout_s:g} s")
                self._engine_block(handle, min(left, pause))
                pause = min(pause * 2, _POLL_MAX_S)
        except TransferError:
            self._engine_abort(handle)  # no-op when the engine already finished the batch
            raise
        except Exception as exc:
            self._engine_abort(handle)
            raise handle.error(TransferError, f"{handle.op} batch failed", f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._release(handle)

    def __repr__(self) -> str:
        c = self._counters
        return (f"{type(self).__name__}(name={self.name!r}, regions={len(self._regions)}, "
                f"peers={len(self._peers)}, descriptors={c.descriptors:,}, bytes={c.bytes:,}, "
                f"engine_calls={c.engine_calls}, closed={self._closed})")


def _mem_of(table: RegionTable, idx: np.ndarray, side: str) -> tuple[str, np.ndarray]:
    """(mem_type, i64[n] device ids) of the regions holding a batch; one mem_type per side."""
    if idx.size == 0:
        return "DRAM", np.zeros(0, dtype=np.int64)
    kinds = table.vram[idx]
    if kinds.any() and not kinds.all():
        raise DescriptorError(f"descs: the {side} ranges mix DRAM and VRAM regions; split the batch by memory kind")
    return ("VRAM" if kinds[0] else "DRAM"), table.device_ids[idx]
