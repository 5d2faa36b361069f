"""The main job's demo KV: who owns which token, page tables, pool and pack sizes, buffers.

Ownership here is computed straight from the spec's formulas (section 2), token by token: the
decode ranks verify what the connector delivered against it, independently of the planner being
exercised. Page tables follow the connector's convention (spec section 10): a rank's table maps
its local rows from token 0, prefix included, so the prefix has pages on both sides too (never
sent; on the decode side they keep the sentinel). The send range's pages are drawn by
:func:`dcp_jax.kv_data.draw_page_table` (seeded shuffled free lists), the same drawing the cost
report (``dcp-jax plan``) plans on, so both print the same counts.

Buffers: ``"cpu"`` is page-aligned host memory with transparent huge pages requested; ``"gpu"``
is a CuPy allocation on GPU 0 (``bridge.buffers.DeviceBuffer``). Each side's KV is one
layer-major allocation, handed to the connector as one ``[num_pages, page_size, item]`` uint8
view per layer entry.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from dcp_jax.job.config import DEVICES, JobConfig
from dcp_jax.kv_data import DECODE_SIDE, PREFILL_SIDE, draw_page_table, pool_pages_for, rows_checksum

__all__ = ["owned_tokens", "prefill_page_table", "decode_pools", "decode_pool_pages", "decode_page_table",
           "request_page_tables", "pack_bytes", "estimate_host_bytes", "check_host_memory",
           "alloc_buffer", "buffer_addr", "sync", "to_host", "checksum", "flip_first_byte",
           "layer_views", "kv_bytes", "PACK_ALIGN"]

PACK_ALIGN = 64  # bytes the pack arena may round each region up to


def owned_tokens(start: int, stop: int, dcp_size: int, dcp_rank: int, interleave_size: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of ``[start, stop)`` that rank ``dcp_rank`` owns, and their local index from token 0.

    Brute force over every token, owner by definition: ``owner(t) = (t // I) % N``,
    ``local_index(t) = (t // (I*N)) * I + t % I`` (spec section 2).

    Returns:
        ``(tokens, local)``: two int64 [n] arrays in token order.
    """
    n, i = dcp_size, interleave_size
    t = np.arange(start, stop, dtype=np.int64)
    t = t[(t // i) % n == dcp_rank]
    return t, (t // (i * n)) * i + t % i


def _rows(num_tokens: int, dcp_size: int, dcp_rank: int, interleave_size: int) -> int:
    """Local rows of a rank holding tokens ``[0, num_tokens)`` (its ``local_len``)."""
    return len(owned_tokens(0, num_tokens, dcp_size, dcp_rank, interleave_size)[0])


def _table(prefix_rows: int, send_rows: int, page_size: int, slack: float, seed: int, side: int, rank: int,
           *seq: int, send_pool: int | None = None) -> tuple[np.ndarray, int]:
    """``(page table from local row 0, pool pages)`` of one rank.

    The send range's pages are drawn as a real allocator leaves them (a seeded shuffled free list
    of ``send_pool`` pages); the prefix's pages follow the drawn pool (ids ``send_pool ..``): they
    are never read nor written by the transfer. A prefix that does not fill whole pages (a prefill
    rank of M > 1) has no such split: the table is drawn for every row from token 0.
    """
    p = page_size
    if prefix_rows % p:
        pool = pool_pages_for(-(-(prefix_rows + send_rows) // p), slack)
        return draw_page_table(prefix_rows + send_rows, p, pool, seed, side, rank, *seq), pool
    if send_pool is None:
        send_pool = pool_pages_for(-(-send_rows // p), slack)
    prefix = np.arange(send_pool, send_pool + prefix_rows // p, dtype=np.int64)
    drawn = draw_page_table(send_rows, p, send_pool, seed, side, rank, *seq)
    return np.concatenate([prefix, drawn]), send_pool + prefix_rows // p


def prefill_page_table(cfg: JobConfig, prefill_rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Prefill rank's ``(tokens, local, page_table, pool_pages)``: its tokens of the send range,
    their local rows (from token 0), its page table and its pool size (pages)."""
    m, ip = cfg.prefill_dcp_size, cfg.prefill_interleave_size
    tokens, local = owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, m, prefill_rank, ip)
    prefix = _rows(cfg.prefix_tokens, m, prefill_rank, ip)
    table, pool = _table(prefix, len(tokens), cfg.src_page_size, cfg.pool_slack, cfg.seed, PREFILL_SIDE, prefill_rank)
    return tokens, local, table, pool


def decode_pools(cfg: JobConfig, min_dcp_size: int | None = None) -> tuple[int, int]:
    """``(send_pool, pool_pages)`` of every decode rank: the pages its send-range pages are drawn
    from (the largest rank share of the send range in any group of ``min_dcp_size ..
    cfg.dcp_size`` ranks, times ``cfg.pool_slack``, plus one) and the pool with the prefix's pages.

    Raises:
        ValueError: ``min_dcp_size`` outside ``[1, cfg.dcp_size]``.
    """
    lo = cfg.dcp_size if min_dcp_size is None else min_dcp_size
    if not 1 <= lo <= cfg.dcp_size:
        raise ValueError(f"{min_dcp_size=} must be in [1, dcp_size={cfg.dcp_size}]")
    groups = [(n, r) for n in range(lo, cfg.dcp_size + 1) for r in range(n)]
    share = max(len(owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, n, r, cfg.interleave_size)[0])
                for n, r in groups)
    prefix = max(_rows(cfg.prefix_tokens, n, r, cfg.interleave_size) for n, r in groups)
    send_pool = pool_pages_for(-(-share // cfg.page_size), cfg.pool_slack)
    return send_pool, send_pool + -(-prefix // cfg.page_size)


def decode_pool_pages(cfg: JobConfig, min_dcp_size: int | None = None) -> int:
    """Pages of each decode rank's pool (:func:`decode_pools`)."""
    return decode_pools(cfg, min_dcp_size)[1]


def decode_page_table(cfg: JobConfig, dcp_rank: int, dcp_size: int, send_pool: int, *, seq: int = 0) -> np.ndarray:
    """A decode rank's page table for the request (local rows from token 0, prefix pages first);
    its send-range pages popped from a seeded shuffled free list of ``send_pool`` pages
    (:func:`decode_pools`); ``seq`` numbers the requests (a new one gets a new draw).

    Raises:
        ValueError: the pool is too small for the rank's rows.
    """
    i = cfg.interleave_size
    prefix = _rows(cfg.prefix_tokens, dcp_size, dcp_rank, i)
    send = _rows(cfg.prompt_tokens, dcp_size, dcp_rank, i) - prefix
    if -(-send // cfg.page_size) > send_pool:
        raise ValueError(f"dcp_rank={dcp_rank} of dcp_size={dcp_size} needs {-(-send // cfg.page_size)} pages, "
                         f"{send_pool=}")
    return _table(prefix, send, cfg.page_size, cfg.pool_slack, cfg.seed, DECODE_SIDE, dcp_rank, seq,
                  send_pool=send_pool)[0]


def request_page_tables(cfg: JobConfig) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The page tables of the job's first request: ``(prefill tables, decode tables)``, one per rank.

    The send-range pages are those ``dcp_jax.cost.page_tables`` draws, so ``dcp-jax plan`` prints
    the job's counts.
    """
    src = [prefill_page_table(cfg, k)[2] for k in range(cfg.prefill_dcp_size)]
    send_pool = decode_pools(cfg)[0]
    return src, [decode_page_table(cfg, r, cfg.dcp_size, send_pool) for r in range(cfg.dcp_size)]


def most_rows_to_one_rank(cfg: JobConfig, prefill_rank: int) -> int:
    """The most rows prefill rank ``prefill_rank`` sends one decode rank in one chunk (0: none):
    the ``max_rows`` of its sender's `KVSender.warm_up`, and what its pack buffer must hold."""
    tokens = owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, cfg.prefill_dcp_size, prefill_rank,
                          cfg.prefill_interleave_size)[0]
    if not len(tokens):
        return 0
    n = cfg.dcp_size
    owner = (tokens // cfg.interleave_size) % n
    chunk = (tokens - cfg.prefix_tokens) // (cfg.chunk_tokens or cfg.send_tokens)
    return int(np.bincount(chunk * n + owner).max())


def pack_bytes(cfg: JobConfig, prefill_rank: int) -> int:
    """``pack_bytes`` of prefill rank ``prefill_rank``'s `KVSender`.

    ``--pack-tokens T``: the spec's ``N * ceil(T / N) * sum(item_len)`` (section 6); a window of
    more rows than the buffer holds is sliced. Default: every (chunk, decode rank) unit of the
    request in flight at once (the prefill rank's whole share, at least N regions of its largest
    unit, plus the arena's alignment per unit), so nothing waits for room and nothing is sliced.
    """
    row, n = cfg.geometry.row_bytes, cfg.dcp_size
    if cfg.pack_tokens is not None:
        return n * -(-cfg.pack_tokens // n) * row
    share = len(owned_tokens(cfg.prefix_tokens, cfg.prompt_tokens, cfg.prefill_dcp_size, prefill_rank,
                             cfg.prefill_interleave_size)[0])
    units = len(cfg.chunks()) * n
    rows = max(share, n * most_rows_to_one_rank(cfg, prefill_rank), 1)
    return rows * row + units * PACK_ALIGN


def region_bytes(cfg: JobConfig, path: str, dcp_rank: int, dcp_size: int) -> int | None:
    """``region_bytes`` of a decode rank's `KVReceiver` for a run of ``path``.

    "region": room for the rank's largest chunk share, rounded up to `PACK_ALIGN` (then each
    chunk reaches the rank as one window, one descriptor); "auto": the connector's default (a
    receive region for device layers only); the other paths: 0 (no receive region)."""
    if path == "auto":
        return None
    if path != "region":
        return 0
    rows = 0
    for start, length in cfg.chunks():
        toks = owned_tokens(start, start + length, dcp_size, dcp_rank, cfg.interleave_size)[0]
        rows = max(rows, len(toks))
    return -(-max(rows, 1) * cfg.geometry.row_bytes // PACK_ALIGN) * PACK_ALIGN  # >= one token: a receiver refuses less


def estimate_host_bytes(cfg: JobConfig) -> int:
    """Host memory the job's processes allocate, in bytes (an upper estimate).

    Prefill: each rank's KV pool and pack buffer; decode: each rank's pool of
    :func:`decode_pool_pages` pages. On ``device="gpu"`` the buffers live in VRAM and only the
    prefill's host copy of the KV pattern counts. The staged path (``cfg.staged``) adds each
    side's pinned-host staging copy (and, on the CPU, the "device" KV is host memory too).
    """
    row = cfg.geometry.row_bytes
    m, n, p, ps = cfg.prefill_dcp_size, cfg.dcp_size, cfg.page_size, cfg.src_page_size
    share = -(-cfg.prompt_tokens // m) + cfg.prefill_interleave_size  # most tokens one prefill rank holds
    prefill_pool = pool_pages_for(-(-share // ps), cfg.pool_slack) * ps * row
    decode_pool = decode_pool_pages(cfg) * p * row
    staged = cfg.staged
    if cfg.device == "gpu":
        return m * prefill_pool * (2 if staged else 1) + (n * decode_pool if staged else 0)
    prefill_pack = max(pack_bytes(cfg, k) for k in range(m))
    return m * (prefill_pool * (3 if staged else 1) + prefill_pack) + n * decode_pool * (2 if staged else 1)


def physical_memory_bytes() -> int | None:
    """This machine's physical memory in bytes, or None where sysconf cannot tell."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(cfg: JobConfig) -> None:
    """Refuses a job whose buffers would not fit this machine's physical memory.

    Raises:
        ValueError: :func:`estimate_host_bytes` exceeds the physical memory (naming the options).
    """
    need = estimate_host_bytes(cfg)
    have = physical_memory_bytes()
    if have is not None and need > have:
        # --pack-tokens sizes the pack buffer alone: named when it is what does not fit.
        pack = (f", pack_tokens={cfg.pack_tokens} (--pack-tokens: "
                f"{max(pack_bytes(cfg, k) for k in range(cfg.prefill_dcp_size)) / 2**30:.1f} GiB of pack buffer)"
                if cfg.pack_tokens is not None and cfg.device != "gpu" else "")
        raise ValueError(
            f"this job needs about {need / 2**30:.1f} GiB of host memory (prompt_tokens="
            f"{cfg.prompt_tokens}, page_size={cfg.page_size}, dcp_size={cfg.dcp_size}, "
            f"prefill_dcp_size={cfg.prefill_dcp_size}, model {cfg.model}{pack}); this machine has "
            f"{have / 2**30:.1f} GiB")


# ------------------------------------------------------------------------------------------------
# Buffers: the only place that knows host (numpy) from device (CuPy) memory.
# ------------------------------------------------------------------------------------------------
def _host_alloc(nbytes: int) -> np.ndarray:
    """uint8 [nbytes], zeroed, page-aligned anonymous memory with transparent huge pages requested
    (fewer page faults and page walks on the multi-GB KV and pools)."""
    import mmap

    mm = mmap.mmap(-1, max(int(nbytes), 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP support: plain pages
        pass
    return np.frombuffer(mm, dtype=np.uint8, count=int(nbytes))


def alloc_buffer(nbytes: int, device: str, *, like: np.ndarray | None = None) -> tuple[Any, Any]:
    """One uint8 [nbytes] buffer: ``(array, owner)`` (keep ``owner`` alive as long as ``array``).

    ``"cpu"``: page-aligned host memory; the owner is the array. ``"gpu"``: a CuPy allocation on
    GPU 0 (owner: its ``bridge.buffers.DeviceBuffer``). ``like`` (host uint8 [nbytes]) gives the
    initial bytes: on the CPU it is the buffer itself, on the GPU it is copied over once;
    otherwise the buffer is zeroed.

    Raises:
        ValueError: unknown device, or ``like`` of another size.
    """
    if like is not None and like.nbytes != nbytes:
        raise ValueError(f"like has {like.nbytes} bytes, {nbytes=}")
    if device == "cpu":
        buf = like if like is not None else _host_alloc(nbytes)
        return buf, buf
    if device != "gpu":
        raise ValueError(f"device={device!r} (--device) must be one of {DEVICES}")
    from bridge.buffers import DeviceBuffer

    dev = DeviceBuffer(max(int(nbytes), 1), device_id=0)
    if like is not None:
        dev.array.set(like)  # host -> device, once, at setup
    sync(dev.array)
    return dev.array, dev


def _is_host(a: Any) -> bool:
    return isinstance(a, np.ndarray)


def buffer_addr(a: Any) -> int:
    """Address of byte 0 of a numpy (host) or CuPy (device) array."""
    return int(a.ctypes.data) if _is_host(a) else int(a.data.ptr)


def sync(a: Any) -> None:
    """Waits for every queued device operation (no-op on the host): a fill must be complete
    before a peer may write."""
    if not _is_host(a):
        import cupy as cp

        cp.cuda.runtime.deviceSynchronize()


def to_host(a: Any) -> np.ndarray:
    """The bytes of ``a`` as numpy (``a`` itself on the host; one device-to-host copy on the GPU)."""
    return a if _is_host(a) else a.get()


def checksum(layer_rows: Any, rows: np.ndarray) -> int:
    """``rows_checksum`` of host or device rows (device rows are gathered on the GPU, then copied)."""
    if _is_host(layer_rows):
        return rows_checksum(layer_rows, rows)
    import cupy as cp

    got = layer_rows[cp.asarray(np.asarray(rows, np.int64))].get()
    return rows_checksum(got, slice(None))


def flip_first_byte(layer_rows: Any, row: int) -> None:
    """Test hook: inverts byte 0 of one row (host or device)."""
    layer_rows[int(row), 0:1] ^= np.uint8(0xFF)
    sync(layer_rows)


def layer_views(buf: Any, num_pages: int, page_size: int, item_lens: Sequence[int]) -> list[Any]:
    """``uint8 [num_pages, page_size, item_len_l]`` views (no copy) of a layer-major buffer."""
    need = kv_bytes(num_pages, page_size, item_lens)
    if need > buf.shape[0]:
        raise ValueError(f"a buffer of {buf.shape[0]} bytes cannot hold {need} bytes of layers")
    views, off = [], 0
    for il in item_lens:
        nb = num_pages * page_size * int(il)
        views.append(buf[off: off + nb].reshape(num_pages, page_size, int(il)))
        off += nb
    return views


def kv_bytes(num_pages: int, page_size: int, item_lens: Sequence[int]) -> int:
    """Bytes of a layer-major KV buffer of ``num_pages`` pages."""
    return num_pages * page_size * int(sum(item_lens))
