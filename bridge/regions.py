"""Memory regions, peer descriptions and the vectorised descriptor checks (no engine needed).

`MemoryRegion` is one registered range; `PeerInfo` is what an engine publishes so peers can reach
it (plain-dict form for a network control plane: `PeerInfo.to_dict` / `PeerInfo.from_dict`, the
latter validating everything a peer sends). `RegionTable` and `validate_descriptors` check a
descriptor batch against local registrations and the peer's advertised regions before anything
reaches an engine. All of it is re-exported unchanged by `bridge` and `bridge.base`.
"""
from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from bridge.errors import DescriptorError, PeerError

__all__ = [
    "MEM_TYPES",
    "MAX_PEER_METADATA",
    "MAX_PEER_NAME",
    "MAX_PEER_REGIONS",
    "MAX_PEER_SESSION",
    "PEER_ENGINES",
    "MemoryRegion",
    "PeerInfo",
    "RegionTable",
    "as_region",
    "validate_descriptors",
]

#: Memory kinds a region may have: host memory or accelerator memory.
MEM_TYPES = ("DRAM", "VRAM")


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
    """What one engine sends out of band so that others can reach it (picklable, or plain via
    `to_dict` / `from_dict` for a msgpack or JSON control plane).

    Attributes:
        engine: "nixl", "mooncake" or "jax-transfer"; a peer of another kind is refused by `add_peer`.
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

    def to_dict(self) -> dict[str, Any]:
        """This info as plain types (str, bytes, int, lists) that msgpack can carry, no pickle.

        Returns:
            ``{"engine": str, "name": str, "session": str, "metadata": bytes,
            "regions": [[addr, nbytes, mem_type, device_id], ...]}`` (addresses and sizes in bytes).
        """
        return {
            "engine": self.engine,
            "name": self.name,
            "session": self.session,
            "metadata": bytes(self.metadata),
            "regions": [[r.addr, r.nbytes, r.mem_type, r.device_id] for r in self.regions],
        }

    @classmethod
    def from_dict(cls, d: Any) -> PeerInfo:
        """Rebuilds a `PeerInfo` from `to_dict` output received from a peer, checking everything.

        Args:
            d: a dict with exactly the keys engine, name, session, metadata, regions. engine is
                one of `PEER_ENGINES`; name a non-empty str of at most `MAX_PEER_NAME` chars;
                session a str of at most `MAX_PEER_SESSION` chars; metadata bytes (or bytearray)
                of at most `MAX_PEER_METADATA` bytes; regions a list (or tuple) of at most
                `MAX_PEER_REGIONS` entries ``[addr, nbytes, mem_type, device_id]`` that
                `MemoryRegion` accepts and whose end fits in int64.

        Returns:
            The `PeerInfo` (regions as a tuple of `MemoryRegion`).

        Raises:
            PeerError: d is not such a dict; the message names the bad field (e.g.
                ``regions[3].nbytes``).
        """
        if not isinstance(d, dict):
            raise PeerError(f"PeerInfo: expected a dict, got {type(d).__name__}")
        keys = set(d)
        if keys != _PEER_KEYS:
            missing = ", ".join(map(repr, sorted(_PEER_KEYS - keys)))
            extra = ", ".join(sorted(repr(k)[:80] for k in keys - _PEER_KEYS)[:8])
            parts = ([f"missing key(s) {missing}"] if missing else []) + ([f"unknown key(s) {extra}"] if extra else [])
            raise PeerError(f"PeerInfo: {'; '.join(parts)}; expected exactly {sorted(_PEER_KEYS)}")
        engine, name, session, metadata, regions = (d[k] for k in ("engine", "name", "session", "metadata", "regions"))
        if not isinstance(engine, str) or engine not in PEER_ENGINES:
            raise PeerError(f"PeerInfo.engine={engine!r:.80} must be one of {PEER_ENGINES}")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_PEER_NAME:
            raise PeerError(f"PeerInfo.name must be a non-empty str of at most {MAX_PEER_NAME} chars, "
                            f"got {type(name).__name__} {name!r:.80}")
        if not isinstance(session, str) or len(session) > MAX_PEER_SESSION:
            raise PeerError(f"PeerInfo.session must be a str of at most {MAX_PEER_SESSION} chars, "
                            f"got {type(session).__name__} {session!r:.80}")
        if not isinstance(metadata, (bytes, bytearray)) or len(metadata) > MAX_PEER_METADATA:
            size = f" of {len(metadata)} bytes" if isinstance(metadata, (bytes, bytearray)) else ""
            raise PeerError(f"PeerInfo.metadata must be bytes of at most {MAX_PEER_METADATA} bytes, "
                            f"got {type(metadata).__name__}{size}")
        if not isinstance(regions, (list, tuple)) or len(regions) > MAX_PEER_REGIONS:
            size = f" of {len(regions)} entries" if isinstance(regions, (list, tuple)) else ""
            raise PeerError(f"PeerInfo.regions must be a list of at most {MAX_PEER_REGIONS} entries, "
                            f"got {type(regions).__name__}{size}")
        return cls(engine, name, session, bytes(metadata), tuple(_region_from_peer(i, r) for i, r in enumerate(regions)))


#: Engine kinds `PeerInfo.from_dict` accepts.
PEER_ENGINES = ("nixl", "mooncake", "jax-transfer")
#: Limits `PeerInfo.from_dict` applies to what a peer sends: name and session length (chars),
#: metadata size (bytes), number of regions.
MAX_PEER_NAME = 256
MAX_PEER_SESSION = 256
MAX_PEER_METADATA = 16 << 20
MAX_PEER_REGIONS = 65536
_PEER_KEYS = frozenset(("engine", "name", "session", "metadata", "regions"))
_INT64_MAX = (1 << 63) - 1


def _region_from_peer(i: int, r: Any) -> MemoryRegion:
    field = f"PeerInfo.regions[{i}]"
    if not isinstance(r, (list, tuple)) or len(r) != 4:
        raise PeerError(f"{field} must be a list [addr, nbytes, mem_type, device_id], got {type(r).__name__} {r!r:.80}")
    try:
        region = MemoryRegion(*r)
    except (TypeError, ValueError) as exc:  # MemoryRegion names the field (addr, nbytes, ...)
        raise PeerError(f"{field}: {exc}") from None
    if region.end > _INT64_MAX or region.device_id > _INT64_MAX:
        raise PeerError(f"{field}: addr + nbytes = {region.end} (or device_id) does not fit in int64")
    return region


# --------------------------------------------------------------------------------------------
# Vectorised range checks
# --------------------------------------------------------------------------------------------
class RegionTable:
    """Sorted view of a set of regions answering "is [addr, addr+n) inside one region?" fast.

    Regions are sorted by start; with the running maximum of their ends, a range lies inside
    some region iff the largest end among regions starting at or before ``addr`` reaches
    ``addr + n``. One ``np.searchsorted`` per batch, so 250k descriptors take milliseconds; a
    one-descriptor batch (a region write) is answered with Python integers (`locate_one`).
    ``vram`` / ``device_ids``: each region's memory kind and device, in ``regions`` order.
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
        # The same tables as Python lists, for `locate_one` (no numpy call per descriptor).
        self._starts_l, self._running_l, self._best_l = (
            self._starts.tolist(), self._running_end.tolist(), self._best.tolist())
        self.vram = np.array([r.mem_type == "VRAM" for r in self.regions], dtype=bool)
        self.device_ids = np.array([r.device_id for r in self.regions], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.regions)

    def locate_one(self, addr: int, length: int) -> int:
        """`locate` for one range of Python ints (addr >= 0, length > 0): the index into
        `regions` of a region holding it, or -1."""
        pos = bisect.bisect_right(self._starts_l, addr) - 1
        if pos < 0 or length > self._running_l[pos] - addr:
            return -1
        return self._best_l[pos]

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
    """Checks a batch against local registrations and the peer's advertised regions.

    Rows are (local_addr, remote_addr, nbytes) for a WRITE (local -> remote) and a READ
    (remote -> local) alike.

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
    if d.shape[0] == 1:  # one descriptor (a region write): Python integers, same checks, same errors
        one = _validate_one(d, local, remote, peer)
        if one is not None:
            return one
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


def _validate_one(d: np.ndarray, local: RegionTable, remote: RegionTable, peer: str):
    """`validate_descriptors`' answer for one well-formed descriptor inside both tables, or None
    (then the vectorised checks run and raise their usual errors)."""
    la, ra, ln = d[0].tolist()
    if ln <= 0 or la < 0 or ra < 0:
        return None
    li, ri = local.locate_one(la, ln), remote.locate_one(ra, ln)
    if li < 0 or ri < 0:
        return None
    return d, np.array([li], np.int64), np.array([ri], np.int64)
