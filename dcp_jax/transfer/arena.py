"""`PackArena`: byte ranges ("regions") of one registered pack buffer, handed out and taken back.

The sender registers one pack buffer with its transfer engine once; every packed window is
gathered into a region of it, sent, and the region is released when the engine reports every
transfer reading it done (the chunk barrier of spec section 6). After an abort or a failure
whose transfers the engine cannot cancel, a region is *quarantined*: it is never handed out
again until :meth:`PackArena.release_quarantined` once the engine reports those transfers done.

Regions start at multiples of ``align`` bytes and reserve whole multiples of it (the last one
may end at the buffer's end); all sizes are bytes. Every method is thread-safe (one lock).
"""
from __future__ import annotations

import bisect
import dataclasses
import threading
from typing import Any, Literal

from dcp_jax._validate import check_int

__all__ = ["PackArena", "PackRegion"]

RegionState = Literal["in_use", "quarantined", "released"]


@dataclasses.dataclass(eq=False)
class PackRegion:
    """A byte range of the pack buffer held by one user.

    Attributes:
        offset: first byte, relative to the buffer start (a multiple of the arena's ``align``).
        nbytes: bytes asked for (the region reserves them rounded up to ``align``).
        key: the caller's tag (e.g. ``(request_id, chunk, dst_rank, window)``).
        state: ``"in_use"``, ``"quarantined"`` or ``"released"`` (set by the arena only).
    """

    offset: int
    nbytes: int
    key: Any
    state: RegionState = "in_use"
    _reserved: int = dataclasses.field(default=0, repr=False)
    _arena: Any = dataclasses.field(default=None, repr=False)

    @property
    def reserved(self) -> int:
        """Bytes the region takes from the arena: ``nbytes`` rounded up to the arena's ``align``."""
        return self._reserved

    @property
    def end(self) -> int:
        """One past the last byte the caller may write: ``offset + nbytes``."""
        return self.offset + self.nbytes


class PackArena:
    """First-fit allocator of aligned byte ranges in a buffer of ``nbytes`` bytes.

    Args:
        nbytes: capacity (bytes), >= 0 (0: every acquire raises).
        align: region offsets are multiples of this (bytes), >= 1.

    Raises:
        TypeError, ValueError: ``nbytes`` or ``align`` not an int or out of range (named).
    """

    def __init__(self, nbytes: int, *, align: int = 64):
        self.capacity = check_int("nbytes", nbytes, minimum=0)
        self.align = check_int("align", align, minimum=1)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []  # (offset, size)
        self._in_use_bytes = self._quarantined_bytes = self._regions_in_use = 0
        self._high_water = self._acquires = self._waits = 0

    def acquire(self, key: Any, nbytes: int) -> PackRegion | None:
        """A region of at least ``nbytes`` bytes (first fit), or None when no free range fits now.

        Args:
            key: the caller's tag, kept on the region.
            nbytes: bytes needed, ``1 <= nbytes <= capacity``.

        Returns:
            The :class:`PackRegion` (state ``"in_use"``), or None (counted in ``stats["waits"]``):
            retry after a release.

        Raises:
            TypeError, ValueError: ``nbytes`` is not an int, <= 0 or larger than the capacity
                (it could never fit).
        """
        nbytes = check_int("nbytes", nbytes, minimum=1)
        if nbytes > self.capacity:
            raise ValueError(f"nbytes={nbytes} exceeds the pack arena's capacity of {self.capacity} bytes")
        want = -(-nbytes // self.align) * self.align
        with self._lock:
            for k, (off, size) in enumerate(self._free):
                if size >= nbytes:
                    take = min(want, size)  # only the range ending at the buffer's end can be shorter
                    if take == size:
                        del self._free[k]
                    else:
                        self._free[k] = (off + take, size - take)
                    self._in_use_bytes += take
                    self._regions_in_use += 1
                    self._acquires += 1
                    self._high_water = max(self._high_water, self._in_use_bytes + self._quarantined_bytes)
                    return PackRegion(off, nbytes, key, "in_use", take, self)
            self._waits += 1
            return None

    def _check(self, region: PackRegion, state: str, what: str) -> None:
        if not isinstance(region, PackRegion) or region._arena is not self:
            raise ValueError(f"region {region!r} was not acquired from this arena")
        if region.state != state:
            raise ValueError(f"cannot {what} region at offset {region.offset} (key={region.key!r}): it is "
                             f"{region.state}, not {state}")

    def _give_back(self, region: PackRegion) -> None:
        """Puts the reserved range back on the free list, merged with its free neighbours."""
        off, size = region.offset, region._reserved
        k = bisect.bisect_left(self._free, (off, 0))
        if k < len(self._free) and off + size == self._free[k][0]:
            size += self._free.pop(k)[1]
        if k > 0 and self._free[k - 1][0] + self._free[k - 1][1] == off:
            off, size = self._free[k - 1][0], self._free[k - 1][1] + size
            k -= 1
            self._free.pop(k)
        self._free.insert(k, (off, size))
        region.state = "released"

    def release(self, region: PackRegion) -> None:
        """Returns an ``in_use`` region to the free list (coalesced with its neighbours).

        Raises:
            ValueError: the region is not from this arena, already released, or quarantined
                (use :meth:`release_quarantined` once the engine reports its transfers done).
        """
        with self._lock:
            self._check(region, "in_use", "release")
            self._in_use_bytes -= region._reserved
            self._regions_in_use -= 1
            self._give_back(region)

    def quarantine(self, region: PackRegion) -> None:
        """Marks an ``in_use`` region whose transfers cannot be cancelled: never handed out again
        until :meth:`release_quarantined`.

        Raises:
            ValueError: the region is not from this arena or not in use.
        """
        with self._lock:
            self._check(region, "in_use", "quarantine")
            region.state = "quarantined"
            self._in_use_bytes -= region._reserved
            self._regions_in_use -= 1
            self._quarantined_bytes += region._reserved

    def release_quarantined(self, region: PackRegion) -> None:
        """Frees a quarantined region once the engine reports its transfers done.

        Raises:
            ValueError: the region is not from this arena or not quarantined.
        """
        with self._lock:
            self._check(region, "quarantined", "release_quarantined")
            self._quarantined_bytes -= region._reserved
            self._give_back(region)

    def largest_free(self) -> int:
        """Bytes of the largest free range (the largest ``nbytes`` an acquire can get now)."""
        with self._lock:
            return max((size for _, size in self._free), default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        """``[(offset, size)]`` of the free ranges, by offset (bytes)."""
        with self._lock:
            return list(self._free)

    @property
    def stats(self) -> dict[str, int]:
        """``capacity``, ``free_bytes``, ``in_use_bytes``, ``quarantined_bytes`` (reserved bytes;
        the three add up to ``capacity``), ``regions_in_use``, ``high_water_bytes`` (most bytes
        held, in use plus quarantined), ``acquires`` (successful) and ``waits`` (acquires that
        returned None)."""
        with self._lock:
            return dict(capacity=self.capacity, free_bytes=sum(s for _, s in self._free),
                        in_use_bytes=self._in_use_bytes, quarantined_bytes=self._quarantined_bytes,
                        regions_in_use=self._regions_in_use, high_water_bytes=self._high_water,
                        acquires=self._acquires, waits=self._waits)

    def __repr__(self) -> str:
        s = self.stats
        return (f"PackArena(capacity={s['capacity']:,}, free={s['free_bytes']:,}, in_use={s['in_use_bytes']:,} "
                f"({s['regions_in_use']} regions), quarantined={s['quarantined_bytes']:,}, align={self.align})")
