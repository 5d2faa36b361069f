"""Layout adapters: byte offsets of (page, slot, head range) in each KV cache layout, and the
gather-to-wire / place-from-wire moves between a cache and the device-neutral wire format.

Wire format (one stream per (prefill rank, decode rank), one block per layer, numpy host model):
the rows of ``n`` tokens, **plane-major, then token, then head**. MLA has one plane (the latent
row of ``head_dim`` elements, so a block is ``n`` rows of ``item_len = head_dim * itemsize`` bytes:
byte-compatible with sglang's pack, spec section 6); GQA has two planes, K then V, each
``n x num_heads x head_dim`` (the K and V regions of vLLM's NIXL transfer, one after the other).

Cache layouts of one layer (element shapes; ``D = head_dim``, ``H`` = KV heads this TP rank holds):

================  =====================================  ===============================================
name              shape                                  source of the convention
================  =====================================  ===============================================
``sglang_mla``    ``[pages, P, D]``                      sglang MLA token pool (D = 576 for DeepSeek-V3)
``tpu_mla``       ``[pages, P/k, k, L]``                 tpu-inference MLA: ``k = 4 // itemsize`` tokens
                                                         per sublane row (2 for bf16), lanes ``L`` = D
                                                         rounded up to 128 (576 -> 640); P % k == 0
``nhd``           ``[2, pages, P, H, D]``                vLLM paged GQA, K/V plane first, NHD
``hnd``           ``[2, pages, H, P, D]``                vLLM paged GQA, HND (heads before tokens)
``tpu_gqa``       ``[pages, P, 2H, D]``                  tpu-inference ragged paged attention: K of
                                                         head h at ``2h``, V at ``2h + 1``
================  =====================================  ===============================================

Byte arithmetic is int64 numpy. A cache is any C-contiguous numpy array of the layout's element
shape whose itemsize is the geometry's (bytes are what move; ``uint16`` stands in for bf16).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from dcp_jax._validate import check_int

__all__ = ["LAYOUTS", "MLA_LAYOUTS", "GQA_LAYOUTS", "CacheGeometry", "layout_kind", "dtype_itemsize",
           "cache_shape", "cache_pages", "segments", "gather_to_wire", "place_from_wire", "run_descriptors", "wire_bytes"]

MLA_LAYOUTS = ("sglang_mla", "tpu_mla")
GQA_LAYOUTS = ("nhd", "hnd", "tpu_gqa")
LAYOUTS = MLA_LAYOUTS + GQA_LAYOUTS
_LANE = 128  # TPU vector lane width: the last dim of a TPU MLA row is padded to a multiple of it
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
             "int8": 1, "uint8": 1}


def layout_kind(layout: str) -> str:
    """``"mla"`` or ``"gqa"`` for a layout name. Raises ``ValueError`` naming ``layout``."""
    if layout in MLA_LAYOUTS:
        return "mla"
    if layout in GQA_LAYOUTS:
        return "gqa"
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout=}")


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a cache dtype name. Raises ``ValueError`` naming ``dtype``."""
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype must be one of {sorted(_ITEMSIZE)}, got {dtype=}")
    return _ITEMSIZE[dtype]


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """One layer's cache on one rank.

    Attributes:
        layout: one of `LAYOUTS`.
        num_pages: pages in the cache, >= 1.
        page_size: tokens per page P, >= 1 (``tpu_mla``: a multiple of ``4 // itemsize``).
        num_heads: KV heads this rank holds (MLA: must be 1, the shared latent).
        head_dim: elements per head (MLA: latent width, 576 for DeepSeek-V3).
        dtype: element type name (see `dtype_itemsize`).

    Raises:
        TypeError, ValueError: a field is out of range (the message names it).
    """

    layout: str
    num_pages: int
    page_size: int
    num_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        kind = layout_kind(self.layout)
        dtype_itemsize(self.dtype)
        for name in ("num_pages", "page_size", "num_heads", "head_dim"):
            check_int(name, getattr(self, name), minimum=1)
        if kind == "mla" and self.num_heads != 1:
            raise ValueError(f"num_heads must be 1 for the MLA layout {self.layout!r} (one latent "
                             f"row per token), got num_heads={self.num_heads}")
        if self.layout == "tpu_mla" and self.page_size % self.tokens_per_row:
            raise ValueError(f"page_size={self.page_size} must be a multiple of {self.tokens_per_row} "
                             f"for tpu_mla with dtype {self.dtype} ({self.tokens_per_row} tokens per row)")

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @property
    def kind(self) -> str:
        return layout_kind(self.layout)

    @property
    def planes(self) -> int:
        """Wire planes: 1 for MLA (latent), 2 for GQA (K, V)."""
        return 1 if self.kind == "mla" else 2

    @property
    def tokens_per_row(self) -> int:
        """TPU MLA sublane packing: tokens per 32-bit row (2 for bf16, 4 for fp8)."""
        return max(1, 4 // self.itemsize)

    @property
    def lanes(self) -> int:
        """TPU MLA padded row width (elements): ``head_dim`` rounded up to 128."""
        return -(-self.head_dim // _LANE) * _LANE


def cache_shape(geom: CacheGeometry) -> tuple[int, ...]:
    """Element shape of one layer's cache in ``geom.layout`` (table in the module docstring)."""
    n, p, h, d = geom.num_pages, geom.page_size, geom.num_heads, geom.head_dim
    return {"sglang_mla": (n, p, d), "tpu_mla": (n, p // geom.tokens_per_row, geom.tokens_per_row, geom.lanes),
            "nhd": (2, n, p, h, d), "hnd": (2, n, h, p, d), "tpu_gqa": (n, p, 2 * h, d)}[geom.layout]


def cache_pages(layout: str, shape) -> tuple[int, int]:
    """``(num_pages, page_size)`` of a cache of element ``shape`` in ``layout`` (the inverse of
    `cache_shape` on those two). Any other layout name is ``[num_pages, page_size, ...]`` (the
    connector's row caches).

    Raises:
        ValueError: ``shape`` has too few dimensions for ``layout`` (named).
    """
    shape = tuple(int(x) for x in shape)
    need = {"nhd": 5, "hnd": 5, "tpu_gqa": 4, "tpu_mla": 4}.get(layout, 2)
    if len(shape) < need:
        raise ValueError(f"a {layout!r} cache needs {need} dimensions, got shape {shape}")
    if layout == "nhd":
        return shape[1], shape[2]
    if layout == "hnd":
        return shape[1], shape[3]
    if layout == "tpu_mla":
        return shape[0], shape[1] * shape[2]
    return shape[0], shape[1]


def _head_range(geom: CacheGeometry, head0, num_heads) -> tuple[int, int]:
    if num_heads is None:
        num_heads = geom.num_heads - head0
    head0 = check_int("head0", head0, minimum=0)
    num_heads = check_int("num_heads", num_heads, minimum=1)
    if head0 + num_heads > geom.num_heads:
        raise ValueError(f"head range [head0, head0 + num_heads) = [{head0}, {head0 + num_heads}) exceeds "
                         f"the {geom.num_heads} heads this cache holds")
    return head0, num_heads


def _rows(geom: CacheGeometry, pages, slots) -> tuple[np.ndarray, np.ndarray]:
    pages, slots = np.asarray(pages), np.asarray(slots)
    for name, arr, hi in (("pages", pages, geom.num_pages), ("slots", slots, geom.page_size)):
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"{name} must be a 1-D integer array, got dtype {arr.dtype}, shape {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= hi):
            raise ValueError(f"{name} must lie in [0, {hi}), got min {int(arr.min())}, max {int(arr.max())}")
    if pages.shape != slots.shape:
        raise ValueError(f"pages and slots must have equal length, got {pages.shape} and {slots.shape}")
    return pages.astype(np.int64), slots.astype(np.int64)


def segments(geom: CacheGeometry, pages, slots, head0: int = 0, num_heads: int | None = None
             ) -> tuple[np.ndarray, int]:
    """Byte offsets of tokens ``(pages[i], slots[i])``, heads ``[head0, head0 + num_heads)``.

    Args:
        geom: the cache geometry.
        pages, slots: int ``[n]`` page ids and slots (``0 <= slot < page_size``).
        head0, num_heads: the head range on this rank (MLA: 0 and 1); ``num_heads`` None = the rest.

    Returns:
        ``(offsets, seg_len)``: int64 ``[n, planes, segs]`` byte offsets into the cache, in wire
        order within each (token, plane), and the bytes of each segment.

    Raises:
        TypeError, ValueError: bad pages, slots or head range (named).
    """
    head0, num_heads = _head_range(geom, head0, num_heads)
    pages, slots = _rows(geom, pages, slots)
    n_pages, p, h, d, isz = geom.num_pages, geom.page_size, geom.num_heads, geom.head_dim, geom.itemsize
    row = (pages * p + slots)[:, None, None]             # [n, 1, 1] token row within a plane
    plane = np.arange(geom.planes, dtype=np.int64)[None, :, None]
    head = head0 + np.arange(num_heads, dtype=np.int64)[None, None, :]
    if geom.layout == "sglang_mla":
        return row * d * isz, d * isz
    if geom.layout == "tpu_mla":                         # [P/k, k] flattens to the slot: row-linear
        return row * geom.lanes * isz, d * isz
    if geom.layout == "nhd":                             # heads of one token are adjacent: one segment
        return (((plane * n_pages * p + row) * h + head0) * d) * isz, num_heads * d * isz
    if geom.layout == "hnd":
        return ((((plane * n_pages + pages[:, None, None]) * h + head) * p + slots[:, None, None]) * d) * isz, d * isz
    return ((row * 2 * h + 2 * head + plane) * d) * isz, d * isz     # tpu_gqa: K at 2h, V at 2h + 1


def wire_bytes(geom: CacheGeometry, num_tokens: int, num_heads: int | None = None) -> int:
    """Bytes of one layer's wire block of ``num_tokens`` tokens and ``num_heads`` heads."""
    num_heads = geom.num_heads if num_heads is None else num_heads
    return geom.planes * num_tokens * num_heads * geom.head_dim * geom.itemsize


def _byte_index(geom, pages, slots, head0, num_heads) -> np.ndarray:
    off, seg = segments(geom, pages, slots, head0, num_heads)
    # Wire order is plane-major, then token, then segment: transpose [n, planes, segs] first.
    off = np.ascontiguousarray(off.transpose(1, 0, 2))
    return (off[..., None] + np.arange(seg, dtype=np.int64)).reshape(-1)


def _cache_bytes(geom: CacheGeometry, cache: np.ndarray, writable: bool) -> np.ndarray:
    if not isinstance(cache, np.ndarray):
        raise TypeError(f"cache must be a numpy array, got {type(cache).__name__}")
    shape = cache_shape(geom)
    if cache.shape != shape or cache.dtype.itemsize != geom.itemsize:
        raise ValueError(f"cache must have shape {shape} and itemsize {geom.itemsize} for {geom}, got "
                         f"shape {cache.shape}, dtype {cache.dtype}")
    if not cache.flags.c_contiguous or (writable and not cache.flags.writeable):
        raise ValueError("cache must be C-contiguous (and writeable to place into)")
    return cache.reshape(-1).view(np.uint8)


def gather_to_wire(geom: CacheGeometry, cache: np.ndarray, pages, slots, head0: int = 0,
                   num_heads: int | None = None) -> np.ndarray:
    """The wire block (uint8 ``[wire_bytes]``) of tokens ``(pages, slots)``, heads ``[head0, +num_heads)``.

    Raises:
        TypeError, ValueError: a cache of the wrong shape/itemsize, or bad rows/heads (named).
    """
    return _cache_bytes(geom, cache, False)[_byte_index(geom, pages, slots, head0, num_heads)]


def place_from_wire(geom: CacheGeometry, cache: np.ndarray, wire, pages, slots, head0: int = 0,
                    num_heads: int | None = None) -> None:
    """Writes a wire block into ``cache`` in place (the inverse of `gather_to_wire`).

    Raises:
        TypeError, ValueError: as `gather_to_wire`, or ``wire`` of the wrong size (named).
    """
    flat = _cache_bytes(geom, cache, True)
    idx = _byte_index(geom, pages, slots, head0, num_heads)
    wire = np.asarray(wire)
    if wire.dtype != np.uint8 or wire.size != idx.size:
        raise ValueError(f"wire must be {idx.size} uint8 bytes, got {wire.size} of dtype {wire.dtype}")
    flat[idx] = wire.reshape(-1)


def run_descriptors(geom: CacheGeometry, run_len, num_heads) -> np.ndarray:
    """Descriptors one layer needs to land a run directly in this cache from the wire.

    A run is ``run_len`` tokens at consecutive slots of one page, heads ``num_heads`` of the
    ``geom.num_heads`` held; a descriptor covers bytes contiguous both in the wire block and in
    the cache, within one plane. ``tpu_gqa``, ``hnd`` with more than one head (the wire is
    token-major, the cache head-major) and ``tpu_mla`` when ``head_dim`` is padded need one per
    token (and head): those layouts are better served by a scatter of the whole wire block.

    Args:
        run_len: int ``[k]`` tokens per run (>= 1); num_heads: int ``[k]`` or scalar heads per run.

    Returns:
        int64 ``[k]`` descriptors per run for one layer.
    """
    run_len = np.asarray(run_len, np.int64)
    num_heads = np.broadcast_to(np.asarray(num_heads, np.int64), run_len.shape)
    if geom.layout == "sglang_mla":
        return np.ones_like(run_len)
    if geom.layout == "tpu_mla":
        return np.ones_like(run_len) if geom.lanes == geom.head_dim else run_len.copy()
    if geom.layout == "nhd":                 # token rows of all heads are contiguous, of a subset not
        return np.where(num_heads == geom.num_heads, 2, 2 * run_len)
    if geom.layout == "hnd":                 # the wire is token-major, the cache head-major:
        return np.where((num_heads == 1) | (geom.page_size == 1), 2, 2 * num_heads * run_len)
    return 2 * num_heads * run_len           # tpu_gqa: K and V of each head alternate in a token row
