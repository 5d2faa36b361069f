"""The caller's paged KV cache as the connector sees it: byte-row views, regions, base addresses.

`CacheLayers` wraps ``kv_layers`` (numpy, JAX on CPU or GPU, or CuPy arrays, one per layer entry,
``[num_pages, page_size, ...]``, or a per-head layout of `dcp_jax.hetero.layouts` named by
``spec.layout``) without copying a byte: it finds each buffer's pointer (the
buffer protocol, ``unsafe_buffer_pointer``, DLPack or ``__cuda_array_interface__``), checks the
shape against the `KVCacheSpec`, and keeps a reference to every array for as long as it lives,
so the memory an engine has registered cannot be freed under it.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from bridge import MemoryRegion
from dcp_jax.hetero.layouts import GQA_LAYOUTS, cache_pages
from dcp_jax.transfer.spec import KVCacheSpec
from pallas_kernels.registry import array_kind as _array_type

__all__ = ["MAX_BUFFER_BYTES", "CacheLayers", "alloc_pack", "array_kind"]


def array_kind(a: Any) -> str:
    """``"numpy"``, ``"cupy"``, ``"jax-cpu"``, ``"jax-gpu"`` (any non-CPU JAX device), or raises.

    Raises:
        TypeError: not one of those array types; ValueError: a deleted (or donated) JAX array.
    """
    try:
        kind = _array_type(a)  # the pack backends' rule: numpy, cupy or jax
    except TypeError:
        raise TypeError(f"KV layers must be numpy, CuPy or JAX arrays, got {type(a).__name__}") from None
    if kind == "jax":
        if a.is_deleted():
            raise ValueError("a deleted JAX array (deleted or donated before it was given): give the "
                             "cache's live buffer")
        devs = list(a.devices())
        if len(devs) != 1:
            raise TypeError(f"a JAX KV layer must live on one device, this one spans {len(devs)}")
        return "jax-cpu" if devs[0].platform == "cpu" else "jax-gpu"
    return kind


def _pointer(a: Any, kind: str) -> int:
    if kind == "numpy":
        return int(a.ctypes.data)
    if kind == "cupy":
        return int(a.data.ptr)
    return int(a.unsafe_buffer_pointer())


def _row_view(a: Any, kind: str, rows: int, item: int, writable: bool = False) -> Any:
    """u8[rows, item] view of one layer's memory (no copy) for the pack: numpy on the host,
    CuPy on a GPU (JAX GPU arrays are viewed through DLPack; the pack reads them in place).
    ``writable``: a receiver's unpack writes into the view; JAX's CPU DLPack export is
    read-only, so the view is then made over the buffer's address (as the engines write it)."""
    if kind == "numpy":
        return a.reshape(rows, -1).view(np.uint8).reshape(rows, item)
    if kind == "cupy":
        import cupy as cp

        return a.reshape(rows, -1).view(cp.uint8).reshape(rows, item)
    if kind == "jax-cpu":
        host = np.from_dlpack(a)  # zero-copy, read-only: the pack only reads, engines write raw
        if int(host.ctypes.data) != _pointer(a, kind):
            raise RuntimeError("DLPack import of a JAX CPU layer copied it")
        if writable:
            raw = (ctypes.c_uint8 * (rows * item)).from_address(int(host.ctypes.data))
            # The DLPack import holds an external reference on the buffer: a caller's
            # `a.delete()` (or a donation) then leaves the memory to this view until it is
            # dropped at close(). Holding ``a`` alone did not: its memory was freed under the
            # engines' writes (heap corruption at exit, found by a fresh-user trial).
            raw.dlpack_owner = host
            return np.frombuffer(raw, np.uint8).reshape(rows, item)
        return host.reshape(rows, -1).view(np.uint8).reshape(rows, item)
    import cupy as cp  # JAX on a GPU: a CuPy view of the same device memory (DLPack, no copy)

    view = cp.from_dlpack(a)
    if int(view.data.ptr) != _pointer(a, kind):
        raise RuntimeError("DLPack import of a JAX GPU layer copied it")
    return view.reshape(rows, -1).view(cp.uint8).reshape(rows, item)


def _check_head_shape(spec: KVCacheSpec, shape: tuple, itemsize: int, pages: int, l: int) -> None:
    """A per-head layout's cache in that layout's shape for this rank's heads (the same bytes per
    token in another arrangement of heads and head_dim would land heads mixed up). The last
    dimension counts bytes (a uint8 or uint16 array stands in for the spec's dtype).

    Raises:
        ValueError: ``kv_layers[l]`` in another shape (both shapes named).
    """
    if spec.layout not in GQA_LAYOUTS:
        return
    from dcp_jax.hetero.layouts import cache_shape, dtype_itemsize
    from dcp_jax.hetero.plan import HeteroSide

    try:
        side = HeteroSide.from_spec(spec)
        want = cache_shape(side.geometry(spec.tp_rank, pages))
    except ValueError:  # a spec the views cannot pair: the handshake names why
        return
    elem = dtype_itemsize(spec.dtype)
    if shape[:-1] != want[:-1] or shape[-1] * itemsize != want[-1] * elem:
        raise ValueError(f"kv_layers[{l}] has shape {shape}; the {spec.layout!r} layout of tp_rank={spec.tp_rank} "
                         f"({side.heads(spec.tp_rank)[1]} KV heads of head_dim={spec.head_dim}) is {want}")


class CacheLayers:
    """One side's KV layer buffers, checked against its spec and held alive.

    Args:
        spec: the side's `KVCacheSpec`.
        kv_layers: ``spec.num_layers`` arrays, each ``[num_pages, page_size, ...]`` whose
            trailing dims hold ``spec.item_lens[l]`` bytes per token, C-contiguous, all of one
            kind (numpy, CuPy, or JAX on one device). The caller owns them; this object keeps a
            reference until `close`.
        writable: refuse read-only numpy layers (a receiver's layers are written into) and give
            writable ``rows`` views (JAX CPU layers too: the region path unpacks into them).

    Attributes:
        kind: `array_kind` of the layers.
        mem_type: ``"DRAM"`` or ``"VRAM"``; device_id: accelerator ordinal (0 on the host).
        num_rows: i64[L] rows (``num_pages * page_size``) of each layer.
        bases: i64[L] address of row 0 of each layer (bytes).
        rows: per-layer u8[num_rows, item_len] views (numpy on the host, CuPy on a GPU).
        regions: the `bridge.MemoryRegion`s the engine registers: the union of the layers'
            memory (one per layer when they do not overlap; entries that view one buffer share one).

    Raises:
        TypeError: not a sequence, mixed kinds, unknown array type, a floating layer whose dtype
            is not ``spec.dtype`` (integer layers are byte containers of any dtype).
        ValueError: wrong number of layers, wrong page size or bytes per token, not contiguous
            (the message names ``kv_layers[l]``), or, ``writable``, two layers at one address.
    """

    def __init__(self, spec: KVCacheSpec, kv_layers: Sequence[Any], *, writable: bool = False):
        if not isinstance(kv_layers, (list, tuple)):
            raise TypeError(f"kv_layers must be a list or tuple of arrays, got {type(kv_layers).__name__}")
        if len(kv_layers) != spec.num_layers:
            raise ValueError(f"kv_layers has {len(kv_layers)} layers, spec.num_layers={spec.num_layers}")
        kinds = set()
        for l, a in enumerate(kv_layers):
            try:
                kinds.add(array_kind(a))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"kv_layers[{l}]: {exc}") from None
        if len(kinds) != 1:
            raise TypeError(f"kv_layers mixes array kinds {sorted(kinds)}; give one kind")
        self.kind = kinds.pop()
        self.mem_type = "DRAM" if self.kind in ("numpy", "jax-cpu") else "VRAM"
        self.device_id = 0
        self._arrays = tuple(kv_layers)
        bases, rows, regions, views = [], [], [], []
        for l, a in enumerate(kv_layers):
            shape = tuple(a.shape)
            # Per-head layouts put pages and slots elsewhere (nhd: [2, pages, P, H, D]).
            try:
                pages, page_size = cache_pages(spec.layout, shape) if len(shape) >= 2 else (0, 0)
            except ValueError as exc:
                raise ValueError(f"kv_layers[{l}]: {exc}") from None
            if page_size != spec.page_size:
                raise ValueError(f"kv_layers[{l}] has shape {shape}; expected [num_pages, "
                                 f"page_size={spec.page_size}, ...]" + (
                                     f" in the {spec.layout!r} layout" if spec.layout in GQA_LAYOUTS + ("tpu_mla",) else ""))
            if pages < 1:
                raise ValueError(f"kv_layers[{l}] has no page (shape {shape})")
            _check_head_shape(spec, shape, np.dtype(a.dtype).itemsize, pages, l)
            nbytes = int(np.prod(shape)) * np.dtype(a.dtype).itemsize
            n = pages * page_size
            if nbytes != n * spec.item_lens[l]:
                raise ValueError(f"kv_layers[{l}] holds {nbytes // n} bytes per token, "
                                 f"spec.item_lens[{l}]={spec.item_lens[l]}")
            if self.kind in ("numpy", "cupy") and not a.flags.c_contiguous:
                read_only = writable and self.kind == "numpy" and not a.flags.writeable
                raise ValueError(f"kv_layers[{l}] must be C-contiguous" + (
                    " and writeable (it is a read-only view, such as np.broadcast_to gives)" if read_only else ""))
            if writable and self.kind == "numpy" and not a.flags.writeable:
                raise ValueError(f"kv_layers[{l}] is read-only; a receiver's layers are written into")
            if np.dtype(a.dtype).hasobject:
                raise TypeError(f"kv_layers[{l}] has dtype {a.dtype}; KV layers hold plain numbers")
            _check_dtype(a, l, spec.dtype)
            if self.kind == "cupy":
                self.device_id = int(a.device.id)
            elif self.kind == "jax-gpu":
                self.device_id = int(list(a.devices())[0].local_hardware_id or 0)
            ptr = _pointer(a, self.kind)
            bases.append(ptr)
            rows.append(n)
            regions.append(MemoryRegion(ptr, nbytes, self.mem_type, self.device_id))
            views.append(_row_view(a, self.kind, n, spec.item_lens[l], writable))
        # Receiver entries may be views into one buffer whose extents overlap (vLLM's CPU cache,
        # one entry per head's K or V, pages interleaved): legal while no two written pages share
        # bytes. `page_clashes` finds the page-index distances at which they would.
        self.clashes = page_clashes(bases, [r.nbytes for r in regions],
                                    [spec.page_size * w for w in spec.item_lens],
                                    spec.layout in SPLIT_PAGE_LAYOUTS) if writable else {}
        self.bases = np.asarray(bases, np.int64)
        self.num_rows = np.asarray(rows, np.int64)
        self.item_lens = np.asarray(spec.item_lens, np.int64)
        self.rows = views
        self.regions = _union(regions)

    def check_pages(self, pages: Sequence[int], held: dict[int, str] | None = None) -> None:
        """Refuses page ids a request would write into with two entries at once, or into bytes
        another held request writes through another entry.

        Args:
            pages: the page ids the transfer writes (every entry's page ``p`` for each ``p``).
            held: page id -> id of the held request that writes it (the receiver's own page
                owners; the same page id is refused by the caller).

        Raises:
            ValueError: two pages, in two entries whose memory overlaps, land on the same bytes
                (names the pages, the ``kv_layers`` entries and the other request if any).
        """
        if not self.clashes or not len(pages):
            return
        new = {int(p) for p in pages}
        held = held or {}
        for k, (a, b) in self.clashes.items():
            # Page x of entry a is page x - k of entry b: a clash needs x and x - k both written,
            # at least one of them by this request. Set lookups: len(pages) x len(clashes).
            for p in sorted(new):
                x = p if (p - k in new or p - k in held) else p + k if p + k in held else None
                if x is not None:
                    who = [held[q] for q in (x, x - k) if q in held]
                    raise ValueError(
                        f"page_table: page {x} of kv_layers[{a}] and page {x - k} of kv_layers[{b}] are the same "
                        "bytes (the entries view one buffer)" + (f"; request {who[0]!r}, still held, writes one of them"
                                                                 if who else "") + ": give pages that do not overlap")

    @property
    def nbytes(self) -> int:
        """Bytes of the registered memory (every layer, shared bytes counted once)."""
        return sum(r.nbytes for r in self.regions)

    @property
    def min_rows(self) -> int:
        """Rows every layer has (page ids must stay below ``min_rows // page_size``)."""
        return int(self.num_rows.min())

    def close(self) -> None:
        """Drops the references to the caller's arrays (after the engine deregistered them)."""
        self._arrays = ()
        self.rows = []

    def __repr__(self) -> str:
        return (f"CacheLayers(kind={self.kind!r}, layers={len(self.bases)}, "
                f"bytes={self.nbytes:,}, mem_type={self.mem_type!r})")


#: Layouts whose page is not one contiguous range (K and V planes apart).
SPLIT_PAGE_LAYOUTS = ("nhd", "hnd")

#: Largest pack buffer or receive region a side takes (bytes): 2**62, within the allocators' C
#: sizes (2**63 raised a bare OverflowError naming no argument); anything past the machine's
#: memory below it is a MemoryError naming the argument.
MAX_BUFFER_BYTES = 1 << 62


def page_clashes(bases: Sequence[int], nbytes: Sequence[int], page_bytes: Sequence[int],
                 split_pages: bool) -> dict[int, tuple[int, int]]:
    """Where a receiver's overlapping layer entries would write the same bytes.

    Entry ``l`` spans ``[bases[l], bases[l] + nbytes[l])``, its page ``p`` the bytes
    ``bases[l] + p * page_bytes[l]`` onward. For two entries ``a``, ``b`` whose spans overlap,
    with equal page bytes ``P`` and ``d = bases[b] - bases[a]``, page ``p`` of ``a`` and page
    ``q`` of ``b`` share bytes iff ``|d - (p - q) * P| < P``: at most two distances ``k = p - q``.

    Returns:
        ``{k: (a, b)}``: every distance ``k > 0`` (or ``< 0``) at which two written pages ``q + k``
        (of ``a``) and ``q`` (of ``b``) would share bytes, with one pair of entries showing it.

    Raises:
        ValueError: overlapping entries that clash at distance 0 (the same page of both: one
            address, or views less than a page apart), or whose pages are not contiguous or not
            of one size (names both ``kv_layers`` entries).
    """
    order = sorted(range(len(bases)), key=lambda l: bases[l])
    out: dict[int, tuple[int, int]] = {}
    for i, a in enumerate(order):
        end = bases[a] + nbytes[a]
        for b in order[i + 1:]:
            if bases[b] >= end:
                break
            pa, pb = page_bytes[a], page_bytes[b]
            if split_pages or pa != pb:
                raise ValueError(f"kv_layers[{a}] and kv_layers[{b}] overlap in memory" + (
                    " and their pages are not contiguous" if split_pages else f" with pages of {pa} and {pb} B")
                    + ": a receiver's layers must be distinct buffers or views whose pages do not overlap")
            d = bases[b] - bases[a]
            for k in {d // pa, -(-d // pa)}:  # the integers within one page of d / P
                if abs(d - k * pa) < pa:
                    if k == 0:
                        raise ValueError(f"kv_layers[{a}] and kv_layers[{b}] start {d} B apart, less than a page "
                                         f"({pa} B): every page of one overlaps the same page of the other (a "
                                         "receiver's layers must be distinct buffers or views whose pages do not overlap)")
                    out.setdefault(k, (a, b))
    return out


def _check_dtype(a: Any, l: int, want: str) -> None:
    """A layer typed as numbers must be typed as the spec says: a bfloat16 array under a spec of
    ``dtype="float8_e4m3fn"`` would be sent and read as something it is not. Integer arrays are
    byte containers (uint8 rows, the uint16 view CuPy gives of bfloat16) and pass whatever the
    spec's dtype: their bytes are what the spec names.

    Raises:
        TypeError: a floating (or other non-integer) layer whose dtype name is not ``want``, or
            that is not in this machine's byte order (``">f2"`` is named "float16" too, but its
            numbers would arrive as other numbers: as `KVCacheSpec` refuses such a dtype). An
            integer container of any byte order passes: its bytes are what move (spec
            section 10: "any dtype; bytes are what move").
    """
    dt = np.dtype(a.dtype)
    if dt.kind not in "ui" and not dt.isnative:  # integer containers: bytes (spec section 10)
        raise TypeError(f"kv_layers[{l}] has dtype {dt.str!r}, not in this machine's byte order: the "
                        f"bytes would move as they are and be read as other numbers; give "
                        f"a.astype(a.dtype.newbyteorder('=')) or a raw integer view of the cache's own bytes")
    if dt.kind not in "ui" and dt.name != want:
        raise TypeError(f"kv_layers[{l}] has dtype {dt.name}, spec.dtype={want!r}: declare the dtype the "
                        "cache holds (KVCacheSpec(dtype=...)) or give the layers as raw integer views")


def _union(regions: list[MemoryRegion]) -> tuple[MemoryRegion, ...]:
    """The layers' memory as disjoint regions (overlapping ranges merged), in address
    order. Layer entries may be views into one buffer: vLLM's CPU cache holds K and V of every
    head inside one tensor per layer, each (layer, K/V, head) entry a shifted view of it. An
    engine refuses overlapping registrations, so the union is what it registers."""
    out: list[MemoryRegion] = []
    for r in sorted(regions, key=lambda r: r.addr):
        if out and r.addr < out[-1].end:
            last = out[-1]
            out[-1] = MemoryRegion(last.addr, max(last.end, r.end) - last.addr, last.mem_type, last.device_id)
        else:
            out.append(r)
    return tuple(out)


def alloc_pack(nbytes: int, layers: CacheLayers, staged: bool):
    """The sender's registered pack buffer of ``nbytes`` bytes: pinned host memory when the side
    stages (`staging.host_buffer`), host memory for host KV (zero-filled now: no page fault per
    4 KiB in the first packs), else device memory on the KV's device."""
    from bridge.buffers import DeviceBuffer, HostBuffer
    from dcp_jax.transfer.staging import host_buffer

    if staged:  # the only memory the engine sees: pinned host for GPU KV
        return host_buffer(nbytes, layers.mem_type, fill=0)
    if layers.mem_type == "DRAM":
        # Written once now, so the first packs do not pay a page fault per 4 KiB of the buffer.
        return HostBuffer(nbytes, fill=0)
    return DeviceBuffer(nbytes, device_id=layers.device_id)
