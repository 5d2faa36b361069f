"""Transfer-engine protocol, typed errors and descriptor validation shared by every adapter.

The main job talks to a transfer engine only through `TransferEngine` below; `bridge.nixl` and
`bridge.mooncake` implement it. A descriptor batch is an integer array ``i64[n, 3]`` of
``(local_addr, remote_addr, nbytes)`` rows, always a WRITE from local to remote memory.

Before anything reaches an engine, every descriptor is checked against the local registrations
and against the regions the peer advertised in its `PeerInfo`. The engines do not do this
reliably: Mooncake's TCP transport reads unregistered local memory without complaint, and NIXL
keeps writing into a remote region the peer has deregistered if its metadata is stale.
"""
from __future__ import annotations

import abc
import atexit
import dataclasses
import itertools
import threading
import weakref
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "BridgeError",
    "RegistrationError",
    "DescriptorError",
    "PeerError",
    "TransferError",
    "TransferTimeout",
    "MemoryRegion",
    "PeerInfo",
    "EngineCounters",
    "RegionTable",
    "TransferHandle",
    "TransferEngine",
    "as_region",
    "validate_descriptors",
    "MEM_TYPES",
]

#: Memory kinds a region may have: host memory or accelerator memory.
MEM_TYPES = ("DRAM", "VRAM")


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------
class BridgeError(Exception):
    """Base class of every error raised by `bridge`."""


class RegistrationError(BridgeError):
    """A memory region could not be registered or deregistered (engine refusal, overlap, bad kind)."""


class DescriptorError(BridgeError, ValueError):
    """A descriptor batch is malformed or reaches outside registered memory; nothing was sent."""


class PeerError(BridgeError):
    """The peer is unknown to this engine, was removed, or its `PeerInfo` is unusable."""


class TransferError(BridgeError):
    """A submitted transfer failed; bytes of this batch may be missing at the peer.

    Attributes:
        peer: name of the destination peer.
        num_descriptors: descriptors in the failed batch.
        engine_message: the engine's own message or status code, verbatim.
        dcp_rank: decode rank the batch was for, when the caller said so.
        chunk: request chunk index the batch belonged to, when the caller said so.
    """

    def __init__(
        self,
        message: str,
        *,
        peer: str,
        num_descriptors: int,
        engine_message: str = "",
        dcp_rank: int | None = None,
        chunk: int | None = None,
    ):
        self.message = message
        self.peer = peer
        self.num_descriptors = int(num_descriptors)
        self.engine_message = engine_message
        self.dcp_rank = dcp_rank
        self.chunk = chunk
        super().__init__(self._render())

    def _render(self) -> str:
        parts = [f"{self.message}: peer={self.peer!r}, num_descriptors={self.num_descriptors}"]
        if self.dcp_rank is not None:
            parts.append(f"dcp_rank={self.dcp_rank}")
        if self.chunk is not None:
            parts.append(f"chunk={self.chunk}")
        text = ", ".join(parts)
        if self.engine_message:
            text += f" (engine: {self.engine_message})"
        return text

    def __reduce__(self):  # keep keyword-only fields across pickling (errors cross process pipes)
        return (
            _rebuild_transfer_error,
            (type(self), self.message, self.peer, self.num_descriptors, self.engine_message,
             self.dcp_rank, self.chunk),
        )

    def with_context(self, *, dcp_rank: int | None = None, chunk: int | None = None) -> TransferError:
        """Returns a copy of this error with the decode rank and/or chunk filled in."""
        return type(self)(
            self.message,
            peer=self.peer,
            num_descriptors=self.num_descriptors,
            engine_message=self.engine_message,
            dcp_rank=self.dcp_rank if dcp_rank is None else dcp_rank,
            chunk=self.chunk if chunk is None else chunk,
        )


class TransferTimeout(TransferError):
    """A transfer (or an awaited notification) did not complete before its deadline."""


def _rebuild_transfer_error(cls, message, peer, num_descriptors, engine_message, dcp_rank, chunk):
    return cls(message, peer=peer, num_descriptors=num_descriptors, engine_message=engine_message,
               dcp_rank=dcp_rank, chunk=chunk)


# --------------------------------------------------------------------------------------------
# Regions and peers
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MemoryRegion:
    """One contiguous memory range to register with a transfer engine.

    Attributes:
        addr: start address (bytes; a host pointer for "DRAM", a device pointer for "VRAM").
        nbytes: length in bytes, > 0.
        mem_type: "DRAM" (host memory) or "VRAM" (accelerator memory).
        device_id: accelerator ordinal for "VRAM"; 0 for host memory.

    Raises:
        TypeError: addr / nbytes / device_id not integers.
        ValueError: addr < 0, nbytes <= 0, unknown mem_type, device_id < 0.
    """

    addr: int
    nbytes: int
    mem_type: str = "DRAM"
    device_id: int = 0

    def __post_init__(self):
        for field in ("addr", "nbytes", "device_id"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"MemoryRegion.{field} must be an int, got {type(value).__name__}")
            object.__setattr__(self, field, int(value))
        if self.addr < 0:
            raise ValueError(f"MemoryRegion: addr={self.addr} must be >= 0")
        if self.nbytes <= 0:
            raise ValueError(f"MemoryRegion: nbytes={self.nbytes} must be > 0")
        if self.mem_type not in MEM_TYPES:
            raise ValueError(f"MemoryRegion: mem_type={self.mem_type!r} must be one of {MEM_TYPES}")
        if self.device_id < 0:
            raise ValueError(f"MemoryRegion: device_id={self.device_id} must be >= 0")

    @property
    def end(self) -> int:
        """One past the last byte (bytes)."""
        return self.addr + self.nbytes


def as_region(obj: Any) -> MemoryRegion:
    """Turns a buffer-like object into a `MemoryRegion`.

    Accepts a `MemoryRegion`; anything with ``.addr`` and ``.nbytes`` (and optionally
    ``.mem_type``, ``.device_id``), such as `bridge.buffers.HostBuffer`; or a C-contiguous numpy
    array (host memory, its data pointer and ``nbytes``).

    Raises:
        TypeError: obj is none of those, or a numpy array that is not C-contiguous.
    """
    if isinstance(obj, MemoryRegion):
        return obj
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise TypeError("as_region: numpy array obj must be C-contiguous")
        return MemoryRegion(int(obj.ctypes.data), int(obj.nbytes), "DRAM", 0)
    if hasattr(obj, "addr") and hasattr(obj, "nbytes"):
        return MemoryRegion(
            int(obj.addr), int(obj.nbytes), getattr(obj, "mem_type", "DRAM"),
            int(getattr(obj, "device_id", 0)),
        )
    raise TypeError(f"as_region: cannot make a MemoryRegion from obj of type {type(obj).__name__}")


@dataclasses.dataclass(frozen=True)
class PeerInfo:
    """What one engine sends out of band so that others can reach it (picklable).

    Attributes:
        engine: "nixl" or "mooncake"; a peer of another kind is refused by `add_peer`.
        name: the peer's engine name (NIXL agent name; Mooncake: the name used in notifications).
        session: how to reach it: "" for NIXL (the metadata carries it), "host:rpc_port" for
            Mooncake.
        metadata: NIXL agent metadata bytes (``get_agent_metadata()``); b"" for Mooncake.
        regions: every region the peer had registered when it produced this info. The initiator
            validates remote descriptor ranges against exactly these.
    """

    engine: str
    name: str
    session: str = ""
    metadata: bytes = b""
    regions: tuple[MemoryRegion, ...] = ()


@dataclasses.dataclass
class EngineCounters:
    """Running totals of what an engine submitted (the main job reports them).

    Attributes:
        descriptors: descriptors submitted (rows of every accepted batch).
        bytes: payload bytes submitted.
        batches: `transfer_batch` calls accepted.
        engine_calls: submit calls made into the engine library (a Mooncake batch larger than its
            window costs several).
    """

    descriptors: int = 0
    bytes: int = 0
    batches: int = 0
    engine_calls: int = 0


# --------------------------------------------------------------------------------------------
# Vectorised range checks
# --------------------------------------------------------------------------------------------
class RegionTable:
    """Sorted view of a set of regions answering "is [addr, addr+n) inside one region?" fast.

    Regions are sorted by start; with the running maximum of their ends, a range lies inside
    some region iff the largest end among regions starting at or before ``addr`` reaches
    ``addr + n``. One ``np.searchsorted`` per batch, so 250k descriptors take milliseconds.
    """

    def __init__(self, regions: Iterable[MemoryRegion]):
        self.regions: tuple[MemoryRegion, ...] = tuple(regions)
        order = sorted(range(len(self.regions)), key=lambda i: self.regions[i].addr)
        starts = np.array([self.regions[i].addr for i in order], dtype=np.int64)
        ends = np.array([self.regions[i].end for i in order], dtype=np.int64)
        self._starts = starts
        if len(order):
            running = np.maximum.accumulate(ends)
            # index (into self.regions) of the region achieving the running maximum
            best = np.zeros(len(order), dtype=np.int64)
            cur = 0
            for k in range(len(order)):
                if ends[k] >= ends[cur]:
                    cur = k
                best[k] = order[cur]
            self._running_end = running
            self._best = best
        else:
            self._running_end = np.zeros(0, dtype=np.int64)
            self._best = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.regions)

    def locate(self, addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Index into `regions` of a region holding each range, or -1 where none does.

        Args:
            addrs: i64[n] start addresses (bytes).
            lengths: i64[n] lengths (bytes), > 0.

        Returns:
            i64[n] region index per range (-1: outside every region).
        """
        if len(self.regions) == 0:
            return np.full(addrs.shape, -1, dtype=np.int64)
        pos = np.searchsorted(self._starts, addrs, side="right") - 1
        ok = pos >= 0
        pos_c = np.where(ok, pos, 0)
        # Compare lengths with the room left (end - addr), never addr + length: that sum can wrap
        # int64 and let a huge length pass as inside a region.
        ok &= lengths <= self._running_end[pos_c] - addrs
        return np.where(ok, self._best[pos_c], -1)


def _check_descs(descs: Any) -> np.ndarray:
    if not isinstance(descs, np.ndarray):
        raise TypeError(f"descs must be a numpy array of shape [n, 3], got {type(descs).__name__}")
    if descs.dtype.kind not in "iu":
        raise TypeError(f"descs must have an integer dtype (int64), got {descs.dtype=}")
    if descs.ndim != 2 or descs.shape[1] != 3:
        raise DescriptorError(f"descs must have shape [n, 3] (local_addr, remote_addr, nbytes), got {descs.shape=}")
    if descs.dtype.kind == "u" and descs.size and int(descs.max()) > np.iinfo(np.int64).max:
        raise DescriptorError("descs holds values beyond the int64 range")
    return np.ascontiguousarray(descs, dtype=np.int64)


def validate_descriptors(
    descs: np.ndarray,
    local: RegionTable,
    remote: RegionTable,
    *,
    peer: str = "?",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Checks a WRITE batch against local registrations and the peer's advertised regions.

    Args:
        descs: i64[n, 3] rows of (local_addr, remote_addr, nbytes); any integer dtype.
        local: this engine's registered regions.
        remote: the regions the peer advertised in its `PeerInfo`.
        peer: peer name, for messages.

    Returns:
        (descs as contiguous i64[n, 3], i64[n] local region index, i64[n] remote region index).

    Raises:
        TypeError: descs is not a numpy integer array.
        DescriptorError: wrong shape, nbytes <= 0, a negative address, or a local / remote range
            not inside one registered region (the message gives the count and the first
            offending row).
    """
    d = _check_descs(descs)
    if d.shape[0] == 0:
        empty = np.zeros(0, dtype=np.int64)
        return d, empty, empty
    la, ra, ln = d[:, 0], d[:, 1], d[:, 2]
    bad = ln <= 0
    if bad.any():
        i = int(np.argmax(bad))
        raise DescriptorError(
            f"descs: {int(bad.sum())} descriptor(s) with nbytes <= 0, first at row {i}: {d[i].tolist()}"
        )
    bad = (la < 0) | (ra < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise DescriptorError(f"descs: negative address at row {i}: {d[i].tolist()}")
    li = local.locate(la, ln)
    bad = li < 0
    if bad.any():
        i = int(np.argmax(bad))
        raise DescriptorError(
            f"descs: {int(bad.sum())} of {d.shape[0]} local ranges are outside every locally "
            f"registered region; first at row {i}: local_addr={int(la[i]):#x}, nbytes={int(ln[i])}"
        )
    ri = remote.locate(ra, ln)
    bad = ri < 0
    if bad.any():
        i = int(np.argmax(bad))
        raise DescriptorError(
            f"descs: {int(bad.sum())} of {d.shape[0]} remote ranges are outside every region peer "
            f"{peer!r} advertised; first at row {i}: remote_addr={int(ra[i]):#x}, nbytes={int(ln[i])}"
        )
    return d, li, ri


# --------------------------------------------------------------------------------------------
# Handles and the engine protocol
# --------------------------------------------------------------------------------------------
class TransferHandle:
    """One submitted batch; pass it to `TransferEngine.wait` exactly once.

    Attributes:
        peer: destination peer name.
        num_descriptors: rows in the batch.
        nbytes: payload bytes.
        notif: notification sent to the peer on completion, or None.
        dcp_rank, chunk: caller context copied into any `TransferError`.
        released: True once `wait` returned or raised.
    """

    __slots__ = ("peer", "num_descriptors", "nbytes", "notif", "dcp_rank", "chunk", "released",
                 "submitted_at", "seq")

    def __init__(self, peer: str, num_descriptors: int, nbytes: int, notif: bytes | None,
                 dcp_rank: int | None, chunk: int | None):
        self.peer = peer
        self.num_descriptors = num_descriptors
        self.nbytes = nbytes
        self.notif = notif
        self.dcp_rank = dcp_rank
        self.chunk = chunk
        self.released = False
        self.submitted_at = time.monotonic()
        self.seq = 0  # set by the engine: unique per engine, keys its bookkeeping

    def __repr__(self) -> str:
        ctx = "" if self.dcp_rank is None else f", dcp_rank={self.dcp_rank}"
        ctx += "" if self.chunk is None else f", chunk={self.chunk}"
        return (f"TransferHandle(peer={self.peer!r}, descriptors={self.num_descriptors:,}, "
                f"bytes={self.nbytes:,}{ctx}, released={self.released})")

    def error(self, cls: type[TransferError], message: str, engine_message: str = "") -> TransferError:
        """Builds a `TransferError` (or subclass) carrying this batch's peer, size and context."""
        return cls(message, peer=self.peer, num_descriptors=self.num_descriptors,
                   engine_message=engine_message, dcp_rank=self.dcp_rank, chunk=self.chunk)


def _check_notif(notif: Any) -> bytes | None:
    if notif is None:
        return None
    if not isinstance(notif, (bytes, bytearray)):
        raise TypeError(f"notif must be bytes or None, got {type(notif).__name__}")
    if len(notif) == 0:
        raise ValueError("notif must be non-empty bytes (an empty tag cannot be matched)")
    return bytes(notif)


def _check_timeout(timeout_s: Any) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number of seconds, got {type(timeout_s).__name__}")
    if not timeout_s > 0:
        raise ValueError(f"{timeout_s=} must be > 0 seconds")
    return float(timeout_s)


# Engines still open when the interpreter exits are closed by an atexit hook: otherwise their worker
# threads and the engines' C++ state are torn down during interpreter finalization, after the Python
# objects they call back into are gone.
_LIVE_ENGINES: "weakref.WeakSet[TransferEngine]" = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    for eng in list(_LIVE_ENGINES):
        try:
            eng.close()
        except Exception:  # noqa: BLE001 - exiting anyway; one engine must not stop the others
            pass


class TransferEngine(abc.ABC):
    """One process's transfer engine: registrations, known peers, WRITE batches, notifications.

    Subclasses implement the ``_engine_*`` hooks; everything the main job calls lives here so
    both engines validate and count the same way. Engines are context managers; `close` is
    idempotent.
    """

    #: engine kind written into `PeerInfo.engine`
    kind: str = ""

    def __init__(self, name: str):
        if not isinstance(name, str) or not name:
            raise ValueError(f"{name=} must be a non-empty string")
        self.name = name
        self._lock = threading.RLock()
        self._regions: list[MemoryRegion] = []
        self._local_table = RegionTable(())
        self._peers: dict[str, tuple[PeerInfo, RegionTable]] = {}
        self._counters = EngineCounters()
        self._outstanding: dict[int, TransferHandle] = {}  # by seq: submitted, not yet waited
        self._seq = itertools.count(1)
        self._notifs: dict[str, list[bytes]] = {}
        self._closed = False
        _LIVE_ENGINES.add(self)

    # ---- engine hooks ---------------------------------------------------------------------
    @abc.abstractmethod
    def _engine_register(self, regions: Sequence[MemoryRegion]) -> None: ...

    @abc.abstractmethod
    def _engine_deregister(self, regions: Sequence[MemoryRegion]) -> None: ...

    @abc.abstractmethod
    def _engine_peer_info(self) -> PeerInfo: ...

    @abc.abstractmethod
    def _engine_add_peer(self, info: PeerInfo, refresh: bool) -> None: ...

    @abc.abstractmethod
    def _engine_remove_peer(self, info: PeerInfo) -> None: ...

    @abc.abstractmethod
    def _engine_submit(self, handle: TransferHandle, descs: np.ndarray, local_mem: tuple[str, np.ndarray],
                       remote_mem: tuple[str, np.ndarray], info: PeerInfo) -> None: ...

    @abc.abstractmethod
    def _engine_wait(self, handle: TransferHandle, deadline: float) -> None: ...

    @abc.abstractmethod
    def _engine_abort(self, handle: TransferHandle) -> None: ...

    @abc.abstractmethod
    def _engine_poll_notifs(self) -> dict[str, list[bytes]]: ...

    @abc.abstractmethod
    def _engine_close(self) -> None: ...

    # ---- public API -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BridgeError(f"engine {self.name!r} is closed")

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        """Regions currently registered by this engine."""
        return tuple(self._regions)

    @property
    def peers(self) -> tuple[str, ...]:
        """Names of the peers this engine can send to."""
        return tuple(self._peers)

    @property
    def counters(self) -> EngineCounters:
        """A snapshot of the submission counters."""
        with self._lock:
            return dataclasses.replace(self._counters)

    @property
    def outstanding(self) -> int:
        """Handles submitted and not yet passed to `wait`."""
        return len(self._outstanding)

    def reset_counters(self) -> None:
        """Sets every counter back to zero."""
        with self._lock:
            self._counters = EngineCounters()

    def register(self, regions: Iterable[Any]) -> None:
        """Registers memory regions with the engine and remembers them for validation.

        Register before calling `peer_info`: the peer validates against the regions listed there.

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
        with self._lock:
            ordered = sorted(self._regions + new, key=lambda r: r.addr)
            for a, b in zip(ordered, ordered[1:]):
                if b.addr < a.end and a.mem_type == b.mem_type and a.device_id == b.device_id:
                    raise RegistrationError(f"regions: {b} overlaps {a} (overlapping registrations are refused)")
            self._engine_register(new)
            self._regions.extend(new)
            self._local_table = RegionTable(self._regions)

    def deregister(self, regions: Iterable[Any]) -> None:
        """Deregisters regions registered earlier (exact address and length).

        Peers keep their copy of our `PeerInfo` until they re-add it: send them a fresh
        `peer_info()` so their validation drops the region.

        Raises:
            RegistrationError: a region was not registered here, or the engine refused.
        """
        self._check_open()
        drop = [as_region(r) for r in regions]
        with self._lock:
            for r in drop:
                if r not in self._regions:
                    raise RegistrationError(f"regions: {r} is not registered with engine {self.name!r}")
            self._engine_deregister(drop)
            self._regions = [r for r in self._regions if r not in drop]
            self._local_table = RegionTable(self._regions)

    def peer_info(self) -> PeerInfo:
        """What peers need to reach this engine and validate descriptors (send it out of band)."""
        self._check_open()
        return self._engine_peer_info()

    def add_peer(self, info: PeerInfo) -> str:
        """Makes a peer reachable; adding the same name again refreshes its metadata and regions.

        Args:
            info: the peer's `PeerInfo`, received out of band.

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
        with self._lock:
            refresh = info.name in self._peers
            self._engine_add_peer(info, refresh)
            self._peers[info.name] = (info, RegionTable(info.regions))
        return info.name

    def remove_peer(self, name: str) -> None:
        """Forgets a peer; later batches to it raise `PeerError`.

        Raises:
            PeerError: name is not a known peer.
        """
        self._check_open()
        with self._lock:
            if name not in self._peers:
                raise PeerError(f"{name=} is not a known peer of engine {self.name!r}")
            info, _ = self._peers.pop(name)
            self._engine_remove_peer(info)

    def transfer_batch(
        self,
        peer: str,
        descs: np.ndarray,
        *,
        notif: bytes | None = None,
        dcp_rank: int | None = None,
        chunk: int | None = None,
    ) -> TransferHandle:
        """Validates and submits one WRITE batch (local -> remote) as one engine submission.

        Args:
            peer: a name returned by `add_peer`.
            descs: i64[n, 3] of (local_addr, remote_addr, nbytes), bytes. Every local range must
                lie inside one registered region, every remote range inside one region the peer
                advertised, nbytes > 0. An empty batch completes at once (no engine call).
            notif: bytes the peer receives (`wait_notification`) once every byte has landed.
            dcp_rank: decode rank the batch is for, copied into errors.
            chunk: request chunk index, copied into errors.

        Returns:
            A handle; pass it to `wait` exactly once.

        Raises:
            PeerError: unknown peer.
            DescriptorError: malformed descriptors or ranges outside registered memory (nothing is
                sent).
            TypeError: descs not an integer numpy array; notif not bytes.
            TransferError: the engine refused the submission.
        """
        self._check_open()
        notif = _check_notif(notif)
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
                                dcp_rank, chunk)
        handle.seq = next(self._seq)
        self._engine_submit(handle, d, local_mem, remote_mem, info)
        with self._lock:
            self._outstanding[handle.seq] = handle
            self._counters.descriptors += handle.num_descriptors
            self._counters.bytes += handle.nbytes
            self._counters.batches += 1
        return handle

    def _count_engine_call(self, n: int = 1) -> None:
        with self._lock:
            self._counters.engine_calls += n

    def wait(self, handle: TransferHandle, timeout_s: float = 30.0) -> None:
        """Blocks until the batch has fully landed at the peer, then releases the handle.

        Args:
            handle: from `transfer_batch` of this engine, not yet waited.
            timeout_s: deadline in seconds (> 0).

        Raises:
            TransferTimeout: not complete by the deadline (the batch is aborted and released;
                its bytes may be partly written).
            TransferError: the engine reported a failure (peer named, engine message kept).
            BridgeError: the handle was already waited or belongs to another engine.
        """
        timeout_s = _check_timeout(timeout_s)
        if not isinstance(handle, TransferHandle):
            raise TypeError(f"handle must be a TransferHandle, got {type(handle).__name__}")
        if handle.released or self._outstanding.get(handle.seq) is not handle:
            raise BridgeError(f"handle {handle!r} was already waited or is not from engine {self.name!r}")
        deadline = time.monotonic() + timeout_s
        try:
            self._engine_wait(handle, deadline)
        except TransferError:
            self._engine_abort(handle)
            raise
        except Exception as exc:  # anything else the engine threw: keep its message
            self._engine_abort(handle)
            raise handle.error(TransferError, "transfer failed", f"{type(exc).__name__}: {exc}") from exc
        finally:
            handle.released = True
            with self._lock:
                self._outstanding.pop(handle.seq, None)

    def notifications(self) -> dict[str, list[bytes]]:
        """Returns and forgets every notification received so far, by sender name."""
        self._check_open()
        with self._lock:
            self._merge_notifs(self._engine_poll_notifs())
            out, self._notifs = self._notifs, {}
        return out

    def _merge_notifs(self, new: dict[str, list[bytes]]) -> None:
        for sender, msgs in new.items():
            self._notifs.setdefault(sender, []).extend(msgs)

    def wait_notification(self, peer_name: str, tag: bytes, timeout_s: float = 30.0) -> bytes:
        """Waits on the target side for a notification from `peer_name` equal to `tag`.

        The initiator attaches `tag` as ``notif=`` to `transfer_batch`; it is delivered only
        after every byte of that batch has landed. The matching message is consumed; others
        stay queued for later calls.

        Args:
            peer_name: the initiator's engine name.
            tag: the exact notification bytes.
            timeout_s: deadline in seconds (> 0).

        Returns:
            The notification bytes (equal to tag).

        Raises:
            TransferTimeout: nothing matching arrived in time.
        """
        self._check_open()
        timeout_s = _check_timeout(timeout_s)
        tag = _check_notif(tag)
        if tag is None:
            raise TypeError("tag must be non-empty bytes")
        deadline = time.monotonic() + timeout_s
        sleep = 1e-4
        while True:
            with self._lock:
                self._merge_notifs(self._engine_poll_notifs())
                msgs = self._notifs.get(peer_name, [])
                if tag in msgs:
                    msgs.remove(tag)
                    return tag
            if time.monotonic() >= deadline:
                raise TransferTimeout(
                    f"no notification {tag!r} from {peer_name!r} within {timeout_s} s",
                    peer=peer_name, num_descriptors=0)
            time.sleep(sleep)
            sleep = min(sleep * 2, 5e-3)

    def close(self) -> None:
        """Releases handles, peers, registrations and the engine itself. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine_close()
        self._peers.clear()
        self._regions.clear()
        self._outstanding.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self._counters
        return (f"{type(self).__name__}(name={self.name!r}, regions={len(self._regions)}, "
                f"peers={len(self._peers)}, descriptors={c.descriptors:,}, bytes={c.bytes:,}, "
                f"engine_calls={c.engine_calls}, closed={self._closed})")


def _mem_of(table: RegionTable, idx: np.ndarray, side: str) -> tuple[str, np.ndarray]:
    """(mem_type, i64[n] device ids) of the regions holding a batch; one mem_type per side."""
    if idx.size == 0:
        return "DRAM", np.zeros(0, dtype=np.int64)
    kinds = np.array([r.mem_type == "VRAM" for r in table.regions], dtype=bool)[idx]
    if kinds.any() and not kinds.all():
        raise DescriptorError(f"descs: the {side} ranges mix DRAM and VRAM regions; split the batch by memory kind")
    devs = np.array([r.device_id for r in table.regions], dtype=np.int64)[idx]
    return ("VRAM" if kinds[0] else "DRAM"), devs
